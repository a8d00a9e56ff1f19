"""`relay check-dns` (relay/authenticity/checkdns.py) against a real DNS server on loopback."""

from __future__ import annotations

import json
import time

import pytest

from relay.authenticity.checkdns import (
    Check,
    _expand,
    _MacroContext,
    _parse_ip,
    _parse_spf,
    _tags,
    check_domain,
    exit_code,
    org_domain,
    render_text,
    to_json,
)
from tests.dnsserver import TIMEOUT, DnsServer, NameData, dns_server_fixture


def txt(*strings: str) -> str:
    """One TXT record in presentation format: each string quoted (so spaces and ';' stay
    in it), strings longer than 255 characters split as DNS requires."""
    chunks = [s[k : k + 255] for s in strings for k in range(0, max(len(s), 1), 255)]
    return " ".join('"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' for c in chunks)


KEY = "MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA" + "q" * 300 + "IDAQAB"
OTHER_KEY = "MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA" + "z" * 300 + "IDAQAB"
DKIM_RECORD = f"v=DKIM1; k=rsa; p={KEY}"
# the DKIM record as configured, with the key wrapped the way tools print it
EXPECTED = f"v=DKIM1; k=rsa; p={KEY[:64]} {KEY[64:]}"

ZONES: dict[str, NameData] = {
    # -- a domain with everything right
    "good.test": {
        "TXT": [
            txt("v=spf1 ip4:192.0.2.0/24 ", "include:_spf.good.test -all"),  # split in two
            txt("site-verification=abc"),
        ],
        "MX": [(10, "mx.good.test")],
    },
    "_spf.good.test": {"TXT": [txt("v=spf1 ip6:2001:db8::/32 ip4:198.51.100.7 ~all")]},
    "mx.good.test": {"A": ["192.0.2.10"]},
    "sel1._domainkey.good.test": {"TXT": [txt(DKIM_RECORD)]},
    "revoked._domainkey.good.test": {"TXT": [txt("v=DKIM1; k=rsa; p=")]},
    "testing._domainkey.good.test": {"TXT": [txt(f"v=DKIM1; t=y; p={KEY}")]},
    "ed._domainkey.good.test": {"TXT": [txt(f"v=DKIM1; k=ed25519; p={KEY}")]},
    "_dmarc.good.test": {"TXT": [txt("v=DMARC1; p=reject; rua=mailto:dmarc@good.test")]},
    "_mta-sts.good.test": {"TXT": [txt("v=STSv1; id=20240101T000000")]},
    "_smtp._tls.good.test": {"TXT": [txt("v=TLSRPTv1; rua=mailto:tlsrpt@good.test")]},
    "sub.good.test": {"TXT": [txt("v=spf1 -all")]},
    # -- under a multi-label public suffix (co.uk): the organisational domain is example.co.uk
    "example.co.uk": {"TXT": [txt("v=spf1 ip4:192.0.2.0/24 -all")]},
    "sub.example.co.uk": {"TXT": [txt("v=spf1 ip4:192.0.2.0/24 -all")]},
    "_dmarc.example.co.uk": {"TXT": [txt("v=DMARC1; p=reject; rua=mailto:dmarc@example.co.uk")]},
    "_dmarc.co.uk": {"TXT": [txt("v=DMARC1; p=none; rua=mailto:wrong@co.uk")]},
    # -- SPF
    "nospf.test": {"TXT": [txt("site-verification=abc")], "MX": [(10, "mx.good.test")]},
    "twospf.test": {"TXT": [txt("v=spf1 -all"), txt("v=spf1 mx -all")]},
    "badspf.test": {"TXT": [txt("v=spf1 foo:bar ip4:300.1.1.1 -all")]},
    "plusall.test": {"TXT": [txt("v=spf1 ip4:192.0.2.1 +all")]},
    "noall.test": {"TXT": [txt("v=spf1 ip4:192.0.2.1")]},
    "deep.test": {"TXT": [txt("v=spf1 include:l1.deep.test -all")]},
    **{
        f"l{i}.deep.test": {"TXT": [txt(f"v=spf1 include:l{i + 1}.deep.test -all")]}
        for i in range(1, 10)
    },
    "l10.deep.test": {"TXT": [txt("v=spf1 mx -all")], "MX": [(10, "mx.good.test")]},
    "amx.test": {
        "TXT": [txt("v=spf1 a mx/24 a:host.amx.test//64 -all")],
        "A": ["192.0.2.77"],
        "MX": [(10, "mx.good.test")],
    },
    "host.amx.test": {"AAAA": ["2001:db8:aa::1"]},
    "redir.test": {"TXT": [txt("v=spf1 redirect=_spf.good.test")]},
    "loop.test": {"TXT": [txt("v=spf1 include:loop2.test -all")]},
    "loop2.test": {"TXT": [txt("v=spf1 include:loop.test -all")]},
    "voids.test": {"TXT": [txt("v=spf1 a:nx1.voids.test a:nx2.voids.test mx:nx3.voids.test -all")]},
    "badinclude.test": {"TXT": [txt("v=spf1 include:nospf.test -all")]},
    "macro.test": {"TXT": [txt("v=spf1 exists:%{i}._spf.%{d} ptr -all")]},
    "spfservfail.test": {"TXT": "SERVFAIL", "MX": [(10, "mx.good.test")]},
    # -- DMARC
    "nodmarc.test": {"TXT": [txt("v=spf1 mx -all")], "MX": [(10, "mx.good.test")]},
    "pnone.test": {"TXT": [txt("v=spf1 mx -all")]},
    "_dmarc.pnone.test": {"TXT": [txt("v=DMARC1; p=none; rua=mailto:d@pnone.test")]},
    "strict.test": {"TXT": [txt("v=spf1 mx -all")]},
    "_dmarc.strict.test": {
        "TXT": [txt("v=DMARC1; p=quarantine; aspf=s; rua=mailto:d@strict.test")]
    },
    "norua.test": {"TXT": [txt("v=spf1 mx -all")]},
    "_dmarc.norua.test": {"TXT": [txt("v=DMARC1; p=reject")]},
    "twodmarc.test": {"TXT": [txt("v=spf1 mx -all")]},
    "_dmarc.twodmarc.test": {"TXT": [txt("v=DMARC1; p=reject"), txt("v=DMARC1; p=none")]},
    "badp.test": {"TXT": [txt("v=spf1 mx -all")]},
    "_dmarc.badp.test": {"TXT": [txt("v=DMARC1; p=block; rua=mailto:d@badp.test")]},
    "ext.test": {"TXT": [txt("v=spf1 mx -all")]},
    "_dmarc.ext.test": {
        "TXT": [txt("v=DMARC1; p=reject; rua=mailto:d@reports.test,mailto:x@authorised.test")]
    },
    "ext.test._report._dmarc.authorised.test": {"TXT": [txt("v=DMARC1")]},
    "dmarcservfail.test": {"TXT": [txt("v=spf1 mx -all")], "MX": [(10, "mx.good.test")]},
    "_dmarc.dmarcservfail.test": "SERVFAIL",
    "fail.test": {"TXT": [txt("v=spf1 include:_spf.fail.test -all")], "MX": "SERVFAIL"},
    "_spf.fail.test": "SERVFAIL",
    "sel._domainkey.fail.test": "SERVFAIL",
    "_dmarc.fail.test": {"TXT": [txt("v=DMARC1; p=reject; rua=mailto:d@fail.test")]},
    "_mta-sts.fail.test": "SERVFAIL",
    "_smtp._tls.fail.test": {"TXT": "SERVFAIL"},
    # -- MX
    "nullmx.test": {"MX": [(0, ".")]},
    "nomx.test": {"A": ["192.0.2.1"]},
    "noaddr.test": {"MX": [(10, "mx.noaddr.test"), (20, "mx.good.test")]},
    "mx.noaddr.test": {"TXT": [txt("nothing")]},
    # -- MTA-STS and TLS-RPT
    "badsts.test": {"MX": [(10, "mx.good.test")]},
    "_mta-sts.badsts.test": {"TXT": [txt("v=STSv1; id=not valid!")]},
    "_smtp._tls.badsts.test": {"TXT": [txt("v=TLSRPTv1; rua=ftp://reports.test")]},
    "nosts.test": {"MX": [(10, "mx.good.test")]},
    "_mta-sts.nosts.test": {"TXT": [txt("v=STSv1 id=123")]},
    "_smtp._tls.nosts.test": {"TXT": [txt("v=TLSRPTv1;")]},
    "slowsts.test": {"MX": [(10, "mx.good.test")]},
    "_mta-sts.slowsts.test": TIMEOUT,
}

dns_zones = dns_server_fixture(ZONES, scope="module")


@pytest.fixture
def ns(dns_zones: DnsServer) -> list[str]:
    return [dns_zones.nameserver]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


async def run(ns: list[str], domain: str, **kwargs: object) -> dict[str, Check]:
    checks = await check_domain(domain, nameservers=ns, timeout=2.0, **kwargs)  # type: ignore[arg-type]
    assert len({c.name for c in checks}) == len(checks)
    return by_name(checks)


# -- the good domain ---------------------------------------------------------------------


async def test_good_domain_is_all_ok(ns: list[str], dns_zones: DnsServer) -> None:
    dns_zones.reset_counters()
    checks = await check_domain(
        "Good.Test.",
        nameservers=ns,
        dkim=[("sel1", EXPECTED)],
        ip="192.0.2.55",
        envelope_domain="bounce.good.test",
    )
    assert [c.name for c in checks] == [
        "spf",
        "spf.lookups",
        "spf.authorises",
        "dkim:sel1",
        "dmarc",
        "dmarc.alignment",
        "mx",
        "mta-sts",
        "tls-rpt",
    ]
    assert [c for c in checks if c.status != "ok"] == []
    assert exit_code(checks) == 0
    got = by_name(checks)
    # the two strings of the SPF record are one record (RFC 7208 §3.3)
    assert got["spf"].record == "v=spf1 ip4:192.0.2.0/24 include:_spf.good.test -all"
    assert got["spf.lookups"].detail == "1 of 10 DNS lookups, 0 of 2 void lookups"
    assert got["spf.authorises"].record == "pass: ip4:192.0.2.0/24 in good.test matched"
    assert got["dkim:sel1"].record == DKIM_RECORD  # a 2048-bit key: several strings
    assert got["dmarc"].detail.startswith("policy p=reject")
    assert got["mx"].record == "10 mx.good.test."
    assert got["mta-sts"].record == "v=STSv1; id=20240101T000000"
    assert got["tls-rpt"].record == "v=TLSRPTv1; rua=mailto:tlsrpt@good.test"
    # the SPF walk, the evaluation and the other checks share one cache
    assert dns_zones.count("good.test", "TXT") == 1
    assert dns_zones.count("_spf.good.test", "TXT") == 1


# -- SPF ---------------------------------------------------------------------------------


async def test_spf_missing(ns: list[str]) -> None:
    got = await run(ns, "nospf.test", ip="192.0.2.1")
    assert got["spf"].status == "error"
    assert "publish a TXT record nospf.test" in got["spf"].detail
    assert "v=spf1 ip4:192.0.2.1 -all" in got["spf"].detail
    assert "spf.lookups" not in got
    assert got["spf.authorises"].status == "error"
    assert got["spf.authorises"].record == "none: nospf.test has no SPF record"


async def test_two_spf_records(ns: list[str]) -> None:
    got = await run(ns, "twospf.test")
    assert got["spf"].status == "error"
    assert got["spf"].detail.startswith("2 SPF records")
    assert "RFC 7208 §3.2" in got["spf"].detail
    assert got["spf"].record == "v=spf1 -all | v=spf1 mx -all"  # sorted


async def test_spf_syntax_error(ns: list[str]) -> None:
    got = await run(ns, "badspf.test")
    spf = got["spf"]
    assert spf.status == "error"
    assert "'foo:bar': unknown mechanism" in spf.detail
    assert "'300.1.1.1' is not an IPv4 address" in spf.detail


async def test_eleven_lookups_through_nested_includes(ns: list[str]) -> None:
    got = await run(ns, "deep.test", ip="192.0.2.10")
    lookups = got["spf.lookups"]
    assert lookups.status == "error"
    assert lookups.detail.startswith("11 DNS lookups: receivers allow 10")
    assert lookups.record is not None and lookups.record.startswith("lookups 11 (deep.test 1,")
    # the evaluation stops at the 11th lookup, before the mx that would match
    assert got["spf.authorises"].status == "error"
    assert got["spf.authorises"].record is not None
    assert got["spf.authorises"].record.startswith("permerror: more than 10 DNS lookups")


async def test_plus_all_and_no_all_warn(ns: list[str]) -> None:
    got = await run(ns, "plusall.test")
    assert got["spf"].status == "warning"
    assert "+all lets every host on the Internet send" in got["spf"].detail
    got = await run(ns, "noall.test")
    assert got["spf"].status == "warning"
    assert "no 'all' term" in got["spf"].detail


async def test_ip_not_authorised(ns: list[str]) -> None:
    got = await run(ns, "good.test", ip="203.0.113.9")
    check = got["spf.authorises"]
    assert check.status == "error"
    assert check.record == "fail: -all in good.test matched"
    assert "add ip4:203.0.113.9 to the SPF record of good.test" in check.detail
    assert '"v=spf1 ip4:192.0.2.0/24 include:_spf.good.test ip4:203.0.113.9 -all"' in check.detail


INCLUDE = "include:_spf.good.test in good.test matched"


@pytest.mark.parametrize(
    ("ip", "record"),
    [
        ("192.0.2.200", "pass: ip4:192.0.2.0/24 in good.test matched"),  # CIDR
        ("198.51.100.7", f"pass: {INCLUDE} (ip4:198.51.100.7 in _spf.good.test matched)"),
        ("::ffff:198.51.100.7", f"pass: {INCLUDE} (ip4:198.51.100.7 in _spf.good.test matched)"),
        ("2001:db8::5", f"pass: {INCLUDE} (ip6:2001:db8::/32 in _spf.good.test matched)"),
    ],
)
async def test_ip_authorised(ns: list[str], ip: str, record: str) -> None:
    got = await run(ns, "good.test", ip=ip)
    assert got["spf.authorises"].status == "ok"
    assert got["spf.authorises"].record == record


async def test_ip6_not_authorised(ns: list[str]) -> None:
    got = await run(ns, "good.test", ip="2001:db9::1")
    check = got["spf.authorises"]
    assert check.status == "error"
    assert check.record == "fail: -all in good.test matched"  # the include gave softfail
    assert "add ip6:2001:db9::1" in check.detail


@pytest.mark.parametrize(
    ("ip", "result"),
    [
        ("192.0.2.77", "pass: a in amx.test matched"),
        ("192.0.2.99", "pass: mx/24 in amx.test matched"),  # mx.good.test is 192.0.2.10
        ("2001:db8:aa::ffff", "pass: a:host.amx.test//64 in amx.test matched"),
        ("192.0.3.1", "fail: -all in amx.test matched"),
    ],
)
async def test_a_and_mx_mechanisms(ns: list[str], ip: str, result: str) -> None:
    got = await run(ns, "amx.test", ip=ip)
    assert got["spf.authorises"].record == result
    assert got["spf.lookups"].detail == "3 of 10 DNS lookups, 0 of 2 void lookups"


async def test_redirect(ns: list[str]) -> None:
    got = await run(ns, "redir.test", ip="198.51.100.7")
    assert got["spf"].status == "ok"
    assert got["spf.lookups"].record == "lookups 1 (redir.test 1, _spf.good.test 0), void 0"
    assert got["spf.authorises"].status == "ok"
    got = await run(ns, "redir.test", ip="203.0.113.1")
    assert got["spf.authorises"].record == "softfail: ~all in _spf.good.test matched"
    assert '"v=spf1 ip4:203.0.113.1 redirect=_spf.good.test"' in got["spf.authorises"].detail


async def test_include_loop_is_reported_not_followed(ns: list[str]) -> None:
    got = await run(ns, "loop.test", ip="192.0.2.1")
    assert got["spf.lookups"].status == "error"
    assert "loops back to loop.test" in got["spf.lookups"].detail
    assert got["spf.authorises"].record == "permerror: include:loop.test in loop2.test loops"


async def test_void_lookups_warn(ns: list[str]) -> None:
    got = await run(ns, "voids.test")
    assert got["spf.lookups"].status == "warning"
    assert got["spf.lookups"].detail.startswith("3 void lookups")
    got = await run(ns, "voids.test", ip="192.0.2.1")
    assert got["spf.authorises"].record is not None
    assert got["spf.authorises"].record.startswith("permerror: more than 2 void lookups")


async def test_include_without_spf_is_an_error(ns: list[str]) -> None:
    got = await run(ns, "badinclude.test")
    assert got["spf.lookups"].status == "error"
    assert "include:nospf.test in badinclude.test: nospf.test has no SPF record" in (
        got["spf.lookups"].detail
    )


async def test_exists_and_ptr_are_noted(ns: list[str]) -> None:
    got = await run(ns, "macro.test", ip="192.0.2.1")
    assert got["spf"].status == "warning"  # ptr
    assert "ptr is slow" in got["spf"].detail
    assert got["spf.lookups"].record == "lookups 2 (macro.test 2), void 0"
    authorises = got["spf.authorises"]
    assert authorises.record == "fail: -all in macro.test matched"
    assert "note: exists:%{i}._spf.%{d} in macro.test not evaluated" in authorises.detail


async def test_spf_servfail(ns: list[str]) -> None:
    got = await run(ns, "spfservfail.test", ip="192.0.2.1")
    assert got["spf"] == Check(
        "spf",
        "error",
        None,
        "DNS lookup failed: TXT spfservfail.test: no nameserver answered (SERVFAIL or refused)",
    )
    assert got["spf.authorises"].status == "error"
    assert got["spf.authorises"].record is not None
    assert got["spf.authorises"].record.startswith("temperror: DNS lookup failed")
    assert got["mx"].status == "ok"


# -- DKIM --------------------------------------------------------------------------------


async def test_dkim_missing(ns: list[str]) -> None:
    got = await run(ns, "good.test", dkim=[("nosuch", EXPECTED)])
    check = got["dkim:nosuch"]
    assert check.status == "error"
    assert check.record is None
    assert f'publish TXT nosuch._domainkey.good.test "{EXPECTED}"' in check.detail


async def test_dkim_different_key(ns: list[str]) -> None:
    got = await run(ns, "good.test", dkim=[("sel1", f"v=DKIM1; k=rsa; p={OTHER_KEY}")])
    check = got["dkim:sel1"]
    assert check.status == "error"
    assert "DNS has a different key" in check.detail
    assert check.record == DKIM_RECORD


async def test_dkim_revoked_testing_and_k(ns: list[str]) -> None:
    got = await run(
        ns,
        "good.test",
        dkim=[("revoked", EXPECTED), ("testing", EXPECTED), ("ed", EXPECTED), ("sel1", EXPECTED)],
    )
    assert got["dkim:revoked"].status == "error"
    assert "the key is revoked" in got["dkim:revoked"].detail
    assert got["dkim:testing"].status == "warning"
    assert got["dkim:testing"].detail.startswith("t=y: testing mode")
    assert got["dkim:ed"].status == "error"
    assert "k=ed25519 in DNS but the configured key is k=rsa" in got["dkim:ed"].detail
    assert got["dkim:sel1"].status == "ok"


# -- DMARC -------------------------------------------------------------------------------


async def test_dmarc_missing_is_a_warning(ns: list[str]) -> None:
    checks = await check_domain("nodmarc.test", nameservers=ns, dkim=[], timeout=2.0)
    got = by_name(checks)
    assert got["dmarc"].status == "warning"
    assert 'publish TXT _dmarc.nodmarc.test "v=DMARC1; p=none; rua=mailto:' in (got["dmarc"].detail)
    assert {c.status for c in checks} == {"ok", "warning"}
    assert exit_code(checks) == 1


async def test_dmarc_p_none(ns: list[str]) -> None:
    got = await run(ns, "pnone.test")
    assert got["dmarc"].status == "warning"
    assert got["dmarc"].detail.startswith("p=none is monitoring only")


async def test_dmarc_reject_with_relaxed_alignment(ns: list[str]) -> None:
    got = await run(ns, "good.test", dkim=[("sel1", EXPECTED)], envelope_domain="bounce.good.test")
    assert got["dmarc"].status == "ok"
    assert got["dmarc.alignment"].status == "ok"
    assert got["dmarc.alignment"].record == (
        "From good.test; envelope bounce.good.test; aspf=r adkim=r; DKIM: d=good.test, 1 key(s)"
    )


async def test_alignment_without_dkim(ns: list[str]) -> None:
    # SPF aligns but there is no DKIM: warning
    got = await run(ns, "good.test")
    assert got["dmarc.alignment"].status == "warning"
    assert got["dmarc.alignment"].detail.startswith("only SPF aligns")
    # strict SPF alignment fails for a subdomain envelope and there is no DKIM: error
    got = await run(ns, "strict.test", envelope_domain="bounce.strict.test")
    assert got["dmarc.alignment"].status == "error"
    assert got["dmarc.alignment"].detail.startswith("neither SPF nor DKIM aligns")
    # the same with DKIM configured and published: only DKIM aligns
    got = await run(ns, "good.test", envelope_domain="other.test", dkim=[("sel1", EXPECTED)])
    assert got["dmarc.alignment"].status == "warning"
    assert got["dmarc.alignment"].detail.startswith("only DKIM aligns")
    # DKIM configured but its key is wrong in DNS: it does not count
    got = await run(ns, "good.test", envelope_domain="other.test", dkim=[("nosuch", EXPECTED)])
    assert got["dmarc.alignment"].status == "error"


async def test_dmarc_inherited_from_org_domain(ns: list[str]) -> None:
    got = await run(ns, "sub.good.test")
    assert got["dmarc"].status == "ok"
    assert got["dmarc"].record == "v=DMARC1; p=reject; rua=mailto:dmarc@good.test"
    assert "inherited from _dmarc.good.test" in got["dmarc"].detail


async def test_dmarc_under_a_multi_label_suffix(ns: list[str]) -> None:
    # inherited from the organisational domain example.co.uk, never from co.uk
    got = await run(ns, "sub.example.co.uk", envelope_domain="bounce.example.co.uk")
    assert got["dmarc"].record == "v=DMARC1; p=reject; rua=mailto:dmarc@example.co.uk"
    assert "inherited from _dmarc.example.co.uk" in got["dmarc"].detail
    # relaxed alignment: a sibling under co.uk is another organisation, so SPF does not align
    got = await run(ns, "example.co.uk", envelope_domain="bounce.other.co.uk")
    assert got["dmarc.alignment"].status == "error"
    assert got["dmarc.alignment"].detail.startswith("neither SPF nor DKIM aligns")
    got = await run(ns, "example.co.uk", envelope_domain="bounce.example.co.uk")
    assert got["dmarc.alignment"].detail.startswith("only SPF aligns")


async def test_dmarc_problems(ns: list[str]) -> None:
    got = await run(ns, "norua.test")
    assert got["dmarc"].status == "warning"
    assert got["dmarc"].detail.startswith("no rua=")
    got = await run(ns, "twodmarc.test")
    assert got["dmarc"].status == "error"
    assert got["dmarc"].detail.startswith("2 DMARC records")
    got = await run(ns, "badp.test")
    assert got["dmarc"].status == "error"
    assert got["dmarc"].detail.startswith("p=block is missing or invalid")
    got = await run(ns, "ext.test")
    assert got["dmarc"].status == "warning"
    assert got["dmarc"].detail == (
        "reports to mailto:d@reports.test are dropped: reports.test must publish TXT"
        ' ext.test._report._dmarc.reports.test "v=DMARC1" (RFC 7489 §7.1)'
    )


async def test_dmarc_servfail_errors_only_that_check(ns: list[str]) -> None:
    got = await run(ns, "dmarcservfail.test")
    assert got["dmarc"].status == "error"
    assert got["dmarc"].detail == (
        "DNS lookup failed: TXT _dmarc.dmarcservfail.test:"
        " no nameserver answered (SERVFAIL or refused)"
    )
    assert got["spf"].status == "ok"
    assert got["mx"].status == "ok"


async def test_servfail_makes_each_item_an_error(ns: list[str]) -> None:
    checks = await check_domain(
        "fail.test", nameservers=ns, dkim=[("sel", EXPECTED)], ip="192.0.2.1", timeout=2.0
    )
    got = by_name(checks)
    servfail = "no nameserver answered (SERVFAIL or refused)"
    assert got["spf"].status == "ok"
    assert got["spf.lookups"].status == "error"
    assert got["spf.lookups"].detail.startswith(
        f"DNS lookup failed: TXT _spf.fail.test: {servfail}"
    )
    assert got["spf.authorises"].record == (
        f"temperror: DNS lookup failed: TXT _spf.fail.test: {servfail}"
    )
    for name, query in [
        ("dkim:sel", "TXT sel._domainkey.fail.test"),
        ("mx", "MX fail.test"),
        ("mta-sts", "TXT _mta-sts.fail.test"),
        ("tls-rpt", "TXT _smtp._tls.fail.test"),
    ]:
        assert got[name] == Check(name, "error", None, f"DNS lookup failed: {query}: {servfail}")
    assert got["dmarc"].status == "ok"
    assert exit_code(checks) == 2


async def test_alignment_needs_spf_that_can_pass(ns: list[str]) -> None:
    got = await run(ns, "nospf.test")
    alignment = got["dmarc.alignment"]
    assert alignment.status == "error"
    assert "SPF of nospf.test cannot pass" in alignment.detail
    assert "DKIM is not configured" in alignment.detail


# -- MX, MTA-STS, TLS-RPT ----------------------------------------------------------------


async def test_mx(ns: list[str]) -> None:
    got = await run(ns, "nullmx.test")
    assert got["mx"].status == "warning"
    assert got["mx"].detail.endswith("the domain accepts no mail: bounces to it are lost")
    got = await run(ns, "nomx.test")
    assert got["mx"].status == "warning"
    assert "implicit MX" in got["mx"].detail
    got = await run(ns, "noaddr.test")
    assert got["mx"].status == "warning"
    assert got["mx"].detail == "MX host mx.noaddr.test has no A/AAAA record: mail cannot reach it"
    got = await run(ns, "nonexistent.test")
    assert got["mx"] == Check("mx", "error", None, "nonexistent.test does not exist (NXDOMAIN)")


async def test_mta_sts_and_tls_rpt(ns: list[str]) -> None:
    got = await run(ns, "good.test")
    assert got["mta-sts"].status == "ok"
    assert got["mta-sts"].detail.startswith("published (id=20240101T000000)")
    assert got["tls-rpt"].status == "ok"
    got = await run(ns, "nodmarc.test")
    assert got["mta-sts"] == Check("mta-sts", "ok", None, "not published (optional)")
    assert got["tls-rpt"] == Check("tls-rpt", "ok", None, "not published (optional)")
    got = await run(ns, "badsts.test")
    assert got["mta-sts"].status == "error"
    assert "id=not valid! must be 1-32 letters and digits" in got["mta-sts"].detail
    assert got["tls-rpt"].status == "error"
    assert "rua 'ftp://reports.test' is not a mailto: or https:// URI" in got["tls-rpt"].detail
    got = await run(ns, "nosts.test")
    assert got["mta-sts"].status == "error"
    assert "the record must start with v=STSv1;" in got["mta-sts"].detail
    assert got["tls-rpt"].status == "error"
    assert "no rua=" in got["tls-rpt"].detail


async def test_timeout_errors_only_that_check(ns: list[str]) -> None:
    started = time.monotonic()
    checks = await check_domain("slowsts.test", nameservers=ns, timeout=0.5)
    assert time.monotonic() - started < 3
    got = by_name(checks)
    assert got["mta-sts"] == Check(
        "mta-sts", "error", None, "DNS lookup failed: TXT _mta-sts.slowsts.test: timed out"
    )
    assert got["mx"].status == "ok"


async def test_invalid_input_raises(ns: list[str]) -> None:
    with pytest.raises(ValueError, match="invalid domain name"):
        await check_domain("a..b", nameservers=ns)
    with pytest.raises(ValueError):
        await check_domain("good.test", nameservers=ns, ip="not-an-ip")


# -- results -----------------------------------------------------------------------------


def test_exit_code() -> None:
    ok = Check("a", "ok", None, "")
    warning = Check("b", "warning", None, "")
    error = Check("c", "error", None, "")
    assert exit_code([]) == 0
    assert exit_code([ok, ok]) == 0
    assert exit_code([ok, warning]) == 1
    assert exit_code([warning, error, ok]) == 2


def test_render_text_and_json() -> None:
    checks = [
        Check("spf", "ok", "v=spf1 -all", "one valid SPF record"),
        Check("dmarc", "warning", None, "no DMARC record"),
        Check("mx", "error", "10 mx.\x1b[2Jevil.test.", "bad"),
    ]
    assert render_text("x.test", checks) == (
        "OK     spf    one valid SPF record\n"
        "      record: v=spf1 -all\n"
        "WARN   dmarc  no DMARC record\n"
        "ERROR  mx     bad\n"
        "      record: 10 mx.\\x1b[2Jevil.test.\n"
        "x.test: 1 ok, 1 warning(s), 1 error(s)\n"
    )
    doc = to_json("x.test", checks)
    assert json.loads(json.dumps(doc)) == doc
    assert doc["domain"] == "x.test"
    assert doc["status"] == "error"
    assert doc["exit_code"] == 2
    assert doc["checks"][1] == {
        "name": "dmarc",
        "status": "warning",
        "record": None,
        "detail": "no DMARC record",
    }
    assert to_json("x.test", checks[:1])["status"] == "ok"


# -- pure parts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        "v=spf1",
        "V=SPF1 -ALL",
        "v=spf1  ip4:192.0.2.0/24  ip6:2001:db8::/32 -all",
        "v=spf1 a a/24 a//64 a:mail.example.com/24//64 mx:example.com ?all",
        "v=spf1 include:_spf.example.com exists:%{ir}.%{l1r+-}._spf.%{d} ~all",
        "v=spf1 ptr:example.com redirect=_spf.example.com exp=explain.%{d2}",
        "v=spf1 a:%{d/} a:%% a:%{D}",
        "v=spf1 unknown-mod=anything -all",
    ],
)
def test_spf_syntax_valid(record: str) -> None:
    assert _parse_spf(record).errors == ()


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ("v=spf1 foo", "unknown mechanism"),
        ("v=spf1 redirect:x.example", "redirect is a modifier"),
        ("v=spf1 all:x", "all takes no argument"),
        ("v=spf1 include", "include needs a domain"),
        ("v=spf1 include:localhost", "is not a domain name"),
        ("v=spf1 include:example.123", "is not a domain name"),
        ("v=spf1 ip4:192.0.2.0/33", "bad CIDR length"),
        ("v=spf1 ip4:2001:db8::1", "is not an IPv4 address"),
        ("v=spf1 ip6:192.0.2.1", "is not an IPv6 address"),
        ("v=spf1 a/024", "bad IPv4 CIDR length"),
        ("v=spf1 mx//129", "bad IPv6 CIDR length"),
        ("v=spf1 ptr/24", "ptr takes no CIDR length"),
        ("v=spf1 exists:%{x}.example.com", "unknown macro"),
        ("v=spf1 exists:%{d0}.example.com", "bad macro transformer"),
        ("v=spf1 exists:%{d;}.example.com", "bad macro delimiter"),
        ("v=spf1 exists:%{d", "unterminated macro"),
        ("v=spf1 exists:50%.example.com", "'%' must start a macro"),
        ("v=spf1 redirect=a.example redirect=b.example", "redirect= appears 2 times"),
        ("v=spf1 -all\x00", "invalid character"),
    ],
)
def test_spf_syntax_errors(record: str, error: str) -> None:
    errors = _parse_spf(record).errors
    assert errors and error in errors[0], errors


@pytest.mark.parametrize(
    ("spec", "expanded"),
    [
        # RFC 7208 §7.4 examples (sender strong-bad@email.example.com, ip 192.0.2.3)
        ("%{s}", "strong-bad@email.example.com"),
        ("%{o}", "email.example.com"),
        ("%{d}", "email.example.com"),
        ("%{d4}", "email.example.com"),
        ("%{d3}", "email.example.com"),
        ("%{d2}", "example.com"),
        ("%{d1}", "com"),
        ("%{dr}", "com.example.email"),
        ("%{d2r}", "example.email"),
        ("%{l}", "strong-bad"),
        ("%{l-}", "strong.bad"),
        ("%{lr}", "strong-bad"),
        ("%{lr-}", "bad.strong"),
        ("%{l1r-}", "strong"),
        ("%{ir}.%{v}._spf.%{d2}", "3.2.0.192.in-addr._spf.example.com"),
        ("%{lr-}.lp._spf.%{d2}", "bad.strong.lp._spf.example.com"),
        ("%{d2}.trusted-domains.example.net", "example.com.trusted-domains.example.net"),
        ("%%%_%-", "% %20"),
    ],
)
def test_macro_expansion(spec: str, expanded: str) -> None:
    ctx = _MacroContext(_parse_ip("192.0.2.3"), "strong-bad@email.example.com", "mx.example.org")
    assert _expand(spec, ctx, "email.example.com") == expanded


def test_macro_expansion_ipv6() -> None:
    ctx = _MacroContext(_parse_ip("2001:db8::cb01"), "a@b.example", "h.example")
    assert _expand("%{ir}.%{v}._spf.%{d2}", ctx, "email.example.com") == (
        "1.0.b.c.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.8.b.d.0.1.0.0.2.ip6._spf.example.com"
    )


def test_org_domain_and_tags() -> None:
    assert org_domain("Mail.Example.COM.") == "example.com"
    assert org_domain("example.com") == "example.com"
    assert org_domain("localhost") == "localhost"
    # the Public Suffix List, not the last two labels (RFC 7489 §3.2)
    assert org_domain("a.b.Example.CO.UK") == "example.co.uk"
    assert org_domain("co.uk") == "co.uk"  # a public suffix is its own
    assert org_domain("x.y.test") == "y.test"  # unlisted TLD: the default rule "*"
    assert _tags(" v=DKIM1 ;k = rsa;; p=ab cd ;") == (
        [("v", "DKIM1"), ("k", "rsa"), ("p", "ab cd")],
        [],
    )
    assert _tags("v=DMARC1; p; p=none; P=reject")[1] == [
        "'p' is not tag=value",
        "tag P appears twice",
    ]


@pytest.mark.parametrize(
    "hostile",
    [
        "v=spf1 " + "a" * 50_000,
        "v=spf1 " + "%{" * 25_000,
        "v=spf1 exists:" + "%{d}" * 12_000,
        "v=spf1 a:" + "/" * 50_000,
        "v=spf1 " + "include:x." * 5_000,
        "v=spf1 " + "ip4:" + "1" * 50_000,
        "v=spf1 " + "a " * 25_000,
    ],
)
def test_parsers_are_linear(hostile: str) -> None:
    started = time.process_time()
    _parse_spf(hostile)
    _tags(hostile.replace(" ", ";"))
    assert time.process_time() - started < 0.5
