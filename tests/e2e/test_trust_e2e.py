"""Mail that receivers trust, end to end: a real daemon signs with the keys `relay dkim
keygen` made, an upstream sink verifies every signature with dkimpy against the TXT
records the loopback DNS server publishes; one-click unsubscribe headers go out signed,
one per recipient, and the links work (POST suppresses for that identity, GET never does);
a signing failure defers and logs; `relay check-dns` reads good and broken records."""

from __future__ import annotations

import base64
import http.client
import json
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dkim
import dns.resolver
import pytest
import yaml

from relay.mail.message import parse_headers
from tests.dnsserver import DnsServer
from tests.harness import RelayProcess, Upstream, deep_merge, fast_config, make_message, send

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
FROM = "From: Shop <app@example.com>"


def txt(*strings: str) -> str:
    chunks = [s[k : k + 255] for s in strings for k in range(0, max(len(s), 1), 255)]
    return " ".join('"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' for c in chunks)


def keygen(tmp: Path, selector: str, algorithm: str) -> tuple[Path, str]:
    """`relay dkim keygen` as an operator runs it; returns the key file and the TXT value
    of the zone line it printed."""
    out = tmp / f"{selector}.key"
    res = subprocess.run(
        [sys.executable, "-m", "relay", "dkim", "keygen", "example.com", "--selector",
         selector, "--algorithm", algorithm, "--out", str(out)],
        capture_output=True, text=True, timeout=60, cwd=tmp,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    zone = next(line for line in res.stdout.splitlines() if "IN TXT" in line)
    assert zone.startswith(f"{selector}._domainkey.example.com.")
    return out, "".join(re.findall(r'"([^"]*)"', zone))


class World:
    def __init__(self, relay: RelayProcess, up: Upstream, dns_: DnsServer, tmp: Path) -> None:
        self.relay, self.up, self.dns, self.tmp = relay, up, dns_, tmp

    def verify(self, data: bytes) -> list[bool]:
        """Every DKIM-Signature of `data`, checked as a receiver does (DNS from our server)."""
        res = dns.resolver.Resolver(configure=False)
        host, port = self.dns.nameserver.split(":")
        res.nameservers = [host]
        res.port = int(port)

        def dnsfunc(name: bytes, timeout: int = 5) -> bytes:
            ans = res.resolve(name.decode().rstrip("."), "TXT")
            return b"".join(b"".join(r.strings) for r in ans)

        d = dkim.DKIM(data)
        n = len([h for h in d.headers if h[0].lower() == b"dkim-signature"])
        out = []
        for i in range(n):
            try:
                out.append(bool(d.verify(idx=i, dnsfunc=dnsfunc)))
            except dkim.ValidationError:
                out.append(False)
        return out

    def received_by(self, rcpt: str, n: int = 1, timeout: float = 20) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [m for m in self.up.received if rcpt in m.rcpt_tos]
            if len(got) >= n:
                return got
            time.sleep(0.1)
        raise AssertionError(f"{rcpt}: upstream got nothing\n{self.relay.logs()[-3000:]}")

    def http(self, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.relay.admin_port, timeout=10)
        headers = {"Content-Type": "application/x-www-form-urlencoded"} if body else {}
        c.request(method, path, body=body, headers=headers)
        resp = c.getresponse()
        out = (resp.status, resp.read().decode("utf-8", "replace"))
        c.close()
        return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("trust")
    rsa_key, rsa_txt = keygen(tmp, "rsa1", "rsa-sha256")
    ed_key, ed_txt = keygen(tmp, "ed1", "ed25519-sha256")
    secret = tmp / "unsub.secret"
    secret.write_text(base64.b64encode(b"s" * 32).decode() + "\n")
    faults = tmp / "faults"
    faults.write_text("")
    with DnsServer(
        {
            "example.com": {
                "TXT": [txt("v=spf1 ip4:127.0.0.1 -all")],
                "MX": [(10, "mx.example.com")],
            },
            "mx.example.com": {"A": ["127.0.0.1"]},
            "rsa1._domainkey.example.com": {"TXT": [txt(rsa_txt)]},
            "ed1._domainkey.example.com": {"TXT": [txt(ed_txt)]},
            "_dmarc.example.com": {"TXT": [txt("v=DMARC1; p=reject; rua=mailto:d@example.com")]},
            # a domain with everything wrong
            "broken.example": {"TXT": [txt("v=spf1 +all"), txt("v=spf1 -all")]},
        }
    ) as dns_:
        up = Upstream().start()
        cfg = deep_merge(
            fast_config("2s"),
            {
                "upstream": {
                    "mode": "smarthost",
                    "smarthost": {"host": "127.0.0.1", "port": up.port, "tls": "none"},
                    "mx": {"nameservers": [dns_.nameserver]},
                },
                "dkim": {
                    "example.com": [
                        {"selector": "rsa1", "key_file": str(rsa_key)},
                        {
                            "selector": "ed1",
                            "key_file": str(ed_key),
                            "algorithm": "ed25519-sha256",
                        },
                    ]
                },
                # an app whose From the provider cannot sign for: the route rewrites it
                # to ours, and the signature covers the rewritten From
                "routes": [
                    {
                        "sender_domain": "legacy.example",
                        "via": ["smarthost"],
                        "rewrite": {"from": "noreply@example.com"},
                    },
                    {"via": ["smarthost"]},
                ],
                "identities": {
                    "example.com": {
                        "unsubscribe": {
                            "url": "https://relay.example.com/u",
                            "mailto": "unsubscribe@relay.test",
                            "secret_file": str(secret),
                        }
                    }
                },
            },
        )
        relay = RelayProcess(tmp / "relay", cfg, env={"RELAY_FAULTS_FILE": str(faults)}).start()
        try:
            yield World(relay, up, dns_, tmp)
        finally:
            relay.close()
            up.stop()


def message(i: int, *, bulk: bool = False, to: str = "user@example.org", **kw: Any) -> bytes:
    data = make_message(i, headers={"Precedence": "bulk"} if bulk else None, **kw)
    return data.replace(b"From: app@example.com", FROM.encode()).replace(
        b"To: user@example.org", f"To: {to}".encode()
    )


# --- DKIM ----------------------------------------------------------------------------------


def test_rsa_and_ed25519_signatures_verify_at_the_receiver(world: World) -> None:
    send(world.relay.port, SENDER, ["dk1@example.org"], message(101))
    (got,) = world.received_by("dk1@example.org")
    sigs = re.findall(rb"^DKIM-Signature:.*?(?=^\S)", got.data, re.MULTILINE | re.DOTALL)
    assert len(sigs) == 2
    assert b"a=rsa-sha256" in sigs[0] and b"s=rsa1" in sigs[0]
    assert b"a=ed25519-sha256" in sigs[1] and b"s=ed1" in sigs[1]
    assert world.verify(got.data) == [True, True]
    # what a receiver would also see: a tampered copy fails
    assert world.verify(got.data.replace(b"message 101", b"message 999")) == [False, False]


def test_a_large_stored_message_is_signed_while_it_streams(world: World) -> None:
    # over spool.inline_max (128 KiB): kept in a body file, signed without being loaded
    # (relay/delivery/outbound.py); bulk, so the one-click headers go in its header block too
    body = b"".join(b"line %06d of a large newsletter \t \r\n" % i for i in range(12_000))
    send(world.relay.port, SENDER, ["big@example.org"], message(106, bulk=True, body=body))
    (got,) = world.received_by("big@example.org")
    assert len(got.data) > 400_000 and got.data.endswith(body)
    assert b"List-Unsubscribe-Post: List-Unsubscribe=One-Click" in got.data
    assert world.verify(got.data) == [True, True]
    assert world.verify(got.data.replace(b"line 011999", b"line 0119xx")) == [False, False]


def test_a_message_the_relay_re_encodes_still_verifies(world: World) -> None:
    long_body = b"x" * 3000 + b"\r\nshort line\r\n"  # over 998 octets: re-encoded at accept
    send(world.relay.port, SENDER, ["dk2@example.org"], message(102, body=long_body))
    (got,) = world.received_by("dk2@example.org")
    assert b"Content-Transfer-Encoding: quoted-printable" in got.data
    assert max(len(line) for line in got.data.split(b"\r\n")) <= 998
    assert world.verify(got.data) == [True, True]


def test_a_message_a_route_rewrites_is_signed_as_rewritten(world: World) -> None:
    data = make_message(108).replace(
        b"From: app@example.com", b"From: Old App <app@legacy.example>"
    )
    send(world.relay.port, "app@legacy.example", ["dk4@example.org"], data)
    (got,) = world.received_by("dk4@example.org")
    head = dict((n.lower(), v) for n, v in parse_headers(got.data.split(b"\r\n\r\n")[0]))
    assert head["from"] == "Old App <noreply@example.com>"
    assert head["x-original-from"] == "Old App <app@legacy.example>"
    assert world.verify(got.data) == [True, True]


def test_a_signing_failure_defers_and_logs_never_sends_unsigned(world: World) -> None:
    r = world.relay
    (r.workdir.parent / "faults").write_text("dkim.sign error times=1\n")
    time.sleep(0.2)  # the daemon re-reads the file within 50 ms
    send(r.port, SENDER, ["dk3@example.org"], message(103))
    r.wait_until(
        lambda: any(e.get("event") == "dkim_failed" for e in r.events()),
        timeout=15,
        what="dkim_failed",
    )
    failed = next(e for e in r.events() if e.get("event") == "dkim_failed")
    assert failed["level"] == "error" and "DKIM signing failed" in failed["error"]
    # deferred, then delivered signed on the retry: never unsigned
    (got,) = world.received_by("dk3@example.org")
    assert world.verify(got.data) == [True, True]
    deferred = [e for e in r.events() if e.get("event") == "deferred"]
    assert any("DKIM signing failed" in str(e.get("reply")) for e in deferred)


# --- one-click unsubscribe -----------------------------------------------------------------


def unsubscribe_link(data: bytes) -> str:
    m = re.search(rb"^List-Unsubscribe: <https://relay\.example\.com(/u/[^>]+)>", data, re.M)
    assert m, data[:600]
    return m.group(1).decode()


def suppressed(r: RelayProcess, addr: str) -> list[dict[str, Any]]:
    return [e for e in r.cli_json("suppression", "list") if e["address"] == addr]


def test_bulk_mail_gets_signed_one_click_headers_per_recipient(world: World) -> None:
    r = world.relay
    a, b = "news-a@example.org", "news-b@example.org"
    send(r.port, SENDER, [a, b], message(104, bulk=True))
    (got_a,) = world.received_by(a)
    (got_b,) = world.received_by(b)
    assert got_a.rcpt_tos == [a] and got_b.rcpt_tos == [b]  # one transaction each
    link_a, link_b = unsubscribe_link(got_a.data), unsubscribe_link(got_b.data)
    assert link_a != link_b
    assert b"List-Unsubscribe-Post: List-Unsubscribe=One-Click" in got_a.data
    assert b"<mailto:unsubscribe@relay.test?subject=unsubscribe%20" in got_a.data
    # covered by both signatures (RFC 8058 §4)
    for sig in re.findall(rb"^DKIM-Signature:.*?(?=^\S)", got_a.data, re.M | re.S):
        h = re.search(rb"h=([^;]+)", sig.replace(b"\r\n", b""))
        assert h is not None
        names = [x.strip().lower() for x in h.group(1).split(b":")]
        assert b"list-unsubscribe" in names and b"list-unsubscribe-post" in names
    assert world.verify(got_a.data) == [True, True]
    assert world.verify(got_b.data) == [True, True]
    # a transactional message gets none
    send(r.port, SENDER, ["tx@example.org"], message(105))
    (tx,) = world.received_by("tx@example.org")
    names = [n.lower() for n, _ in parse_headers(tx.data.split(b"\r\n\r\n")[0])]
    assert "list-unsubscribe" not in names and "list-unsubscribe-post" not in names


def test_one_click_post_suppresses_for_that_identity_get_never_does(world: World) -> None:
    r = world.relay
    rcpt = "click@example.org"
    send(r.port, SENDER, [rcpt], message(106, bulk=True))
    (got,) = world.received_by(rcpt)
    link = unsubscribe_link(got.data)
    # a mail scanner following the link: a page with a POST form, nothing suppressed
    status, page = world.http("GET", link)
    assert status == 200 and 'method="post"' in page.lower()
    assert "One-Click" in page
    assert suppressed(r, rcpt) == []
    # the one-click POST (RFC 8058 §3.2)
    status, _ = world.http("POST", link, b"List-Unsubscribe=One-Click")
    assert status == 200
    (entry,) = suppressed(r, rcpt)
    assert entry["scope"] == "example.com" and entry["source"] == "unsubscribe"
    status, _ = world.http("POST", link, b"List-Unsubscribe=One-Click")  # twice is fine
    assert status == 200 and len(suppressed(r, rcpt)) == 1
    r.wait_until(lambda: _rcpt_code(r, rcpt, SENDER) == 550, timeout=5, what="refused at RCPT")
    assert _rcpt_code(r, rcpt, "other@another.example") == 250  # other identities may
    # forged and garbage tokens
    forged = link[:-3] + ("AAA" if not link.endswith("AAA") else "BBB")
    assert world.http("POST", forged, b"List-Unsubscribe=One-Click")[0] == 400
    assert world.http("POST", "/u/garbage", b"List-Unsubscribe=One-Click")[0] == 400
    assert world.http("GET", "/u/" + "A" * 5000)[0] == 400
    assert any(e.get("event") == "unsubscribe_refused" for e in r.events())


def _rcpt_code(r: RelayProcess, rcpt: str, sender: str) -> int:
    import smtplib

    with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as s:
        s.ehlo("client.test")
        s.mail(sender)
        return int(s.rcpt(rcpt)[0])


def test_mailto_unsubscribe_suppresses_too(world: World) -> None:
    r = world.relay
    rcpt = "mailto@example.org"
    send(r.port, SENDER, [rcpt], message(107, bulk=True))
    (got,) = world.received_by(rcpt)
    m = re.search(rb"<mailto:(unsubscribe@relay\.test)\?subject=([^>]+)>", got.data)
    assert m
    subject = urllib.parse.unquote(m.group(2).decode()).removeprefix("subject=")
    req = f"From: {rcpt}\r\nTo: unsubscribe@relay.test\r\nSubject: {subject}\r\n\r\n\r\n"
    assert send(r.port, rcpt, ["unsubscribe@relay.test"], req.encode()) == {}
    r.wait_until(lambda: bool(suppressed(r, rcpt)), timeout=10, what="mailto unsubscribe")
    assert suppressed(r, rcpt)[0]["scope"] == "example.com"
    # not relayed anywhere
    assert not [x for x in world.up.received if "unsubscribe@relay.test" in x.rcpt_tos]


# --- check-dns -----------------------------------------------------------------------------


def test_check_dns_reports_good_and_broken_domains_with_exit_codes(world: World) -> None:
    r = world.relay
    good = r.cli("check-dns", "example.com", "--ip", "127.0.0.1")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "dkim:rsa1" in good.stdout and "dkim:ed1" in good.stdout
    doc = json.loads(r.cli("check-dns", "example.com", "--json").stdout)
    assert doc["exit_code"] == 0 and {c["status"] for c in doc["checks"]} == {"ok"}
    bad_ip = r.cli("check-dns", "example.com", "--ip", "192.0.2.7")
    assert bad_ip.returncode == 2 and "ip4:192.0.2.7" in bad_ip.stdout
    broken = r.cli("check-dns", "broken.example", "--json")
    assert broken.returncode == 2
    names = {c["name"]: c["status"] for c in json.loads(broken.stdout)["checks"]}
    assert names["spf"] == "error" and names["dmarc"] == "warning"
    # the daemon ran the same checks for its signing domain at start and logged them
    assert any(
        e.get("event") == "dns_check" and e.get("domain") == "example.com" for e in r.events()
    )


def test_a_missing_or_unusable_key_is_a_config_error(world: World, tmp_path: Path) -> None:
    cfg = dict(world.relay.config)
    for bad in (tmp_path / "missing.key", tmp_path / "garbage.key"):
        if bad.name == "garbage.key":
            bad.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
        cfg["dkim"] = {"example.com": {"selector": "x", "key_file": str(bad)}}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for cmd in (["check-config"], ["serve"]):
            res = subprocess.run(
                [sys.executable, "-m", "relay", *cmd, "-c", str(path)],
                capture_output=True, text=True, timeout=30, cwd=world.relay.workdir,
            )  # fmt: skip
            assert res.returncode == 78, res.stderr
            assert "dkim.example.com" in res.stderr and str(bad) in res.stderr
