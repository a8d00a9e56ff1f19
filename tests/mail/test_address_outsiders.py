"""Addresses an outsider can abuse (issue 27 LOW items): characters that are not seen or
that reorder what is seen (Unicode Cf, line/paragraph separators) are refused; non-ASCII
addresses only in a transaction whose MAIL carried SMTPUTF8 (RFC 6531 §3.4: 553 5.6.7);
address literals must be addresses (RFC 5321 §4.1.3). Table rows in relay/mail/address.py's
own style, then the replies over SMTP in-process."""

from __future__ import annotations

import time

import pytest

from relay.mail.address import AddressError, check_mailbox, parse_path
from tests.inbound.test_inprocess import MSG, QUEUED, Start, message, start  # noqa: F401

UNSEEN = [
    "\u202e",  # RIGHT-TO-LEFT OVERRIDE
    "\u202a",  # LEFT-TO-RIGHT EMBEDDING
    "\u2066",  # LEFT-TO-RIGHT ISOLATE
    "\u200e",  # LEFT-TO-RIGHT MARK
    "\u200b",  # ZERO WIDTH SPACE
    "\u200d",  # ZERO WIDTH JOINER
    "\u2060",  # WORD JOINER
    "\ufeff",  # BOM / ZERO WIDTH NO-BREAK SPACE
    "\u00ad",  # SOFT HYPHEN
    "\u061c",  # ARABIC LETTER MARK
    "\U000e0041",  # TAG LATIN CAPITAL LETTER A
    "\u2028",  # LINE SEPARATOR (Zl)
    "\u2029",  # PARAGRAPH SEPARATOR (Zp)
]


@pytest.mark.parametrize("ch", UNSEEN, ids=[f"U+{ord(c):04X}" for c in UNSEEN])
@pytest.mark.parametrize(
    "shape",
    ["<a{}b@example.org>", "<ab@exa{}mple.org>", "<{}ab@example.org>", '<"a{}b"@example.org>'],
    ids=["local", "domain", "first", "quoted"],
)
def test_unseen_characters_are_refused_anywhere(ch: str, shape: str) -> None:
    arg = shape.format(ch)
    with pytest.raises(AddressError, match=rf"U\+{ord(ch):04X}"):
        parse_path(arg, null_ok=False)
    with pytest.raises(AddressError):
        check_mailbox(arg[1:-1])  # the config's and the CLI's check too


@pytest.mark.parametrize(
    "address",
    [
        "jürgen@example.org",
        "用户@例子.广告",
        "δοκιμή@παράδειγμα.δοκιμή",
        '"a\u00a0b"@example.org',
        "user@xn--bcher-kva.example",
    ],
)
def test_visible_utf8_still_parses(address: str) -> None:
    assert parse_path(f"<{address}>", null_ok=False).address == address


@pytest.mark.parametrize(
    ("literal", "ok"),
    [
        ("[192.0.2.1]", True),
        ("[255.255.255.255]", True),
        ("[IPv6:2001:db8::1]", True),
        ("[ipv6:2001:DB8::1]", True),  # the tag is case-insensitive
        ("[IPv6:::1]", True),
        ("[IPv6:::]", True),  # the unspecified address is an address
        ("[IPv6:::ffff:192.0.2.1]", True),  # IPv6v4-comp
        ("[IPv6:1:2:3:4:5:6:192.0.2.1]", True),  # IPv6v4-full
        ("[IPv6:1:2:3:4:5:6:7:8]", True),
        ("[IPv6:::::]", False),
        ("[IPv6::::]", False),
        ("[IPv6:1]", False),
        ("[IPv6:1::2::3]", False),
        ("[IPv6:1:2:3:4:5:6:7:8:9]", False),
        ("[IPv6:12345::1]", False),
        ("[IPv6:::1.2.3]", False),
        ("[IPv6:::256.1.1.1]", False),
        ("[IPv6:fe80::1%eth0]", False),  # a zone id is no part of an address literal
        ("[IPv6:" + "1:" * 60 + "]", False),
        ("[1.2.3]", False),
        ("[1.2.3.4.5]", False),
        ("[256.1.1.1]", False),
        ("[1.2.3.-4]", False),
        ("[x400:foo]", False),  # a general literal: no tag but IPv6 is registered
        ("[tag:1.2.3.4]", False),
        ("[]", False),
    ],
)
def test_address_literals(literal: str, ok: bool) -> None:
    arg = f"<postmaster@{literal}>"
    if ok:
        assert parse_path(arg, null_ok=False).address == arg[1:-1]
    else:
        with pytest.raises(AddressError, match="literal"):
            parse_path(arg, null_ok=False)


def test_literal_checks_stay_linear() -> None:
    started = time.process_time()
    for body in (":" * 240, "1" * 240, "1:" * 120, "::" + "f" * 238):
        with pytest.raises(AddressError):
            parse_path(f"<a@[IPv6:{body}]>", null_ok=False)
    assert time.process_time() - started < 0.5


async def test_smtp_refuses_unseen_characters_with_the_address_replies(
    start: Start,  # noqa: F811  (the fixture imported above)
) -> None:
    r = await start()
    c = await r.connect()
    code, text = await c.cmd("MAIL FROM:<app\u202e@example.com> SMTPUTF8")
    assert code == 501 and text.startswith("501 5.1.7 Bad sender address syntax: "), text
    assert "U+202E" in text
    assert (await c.cmd("MAIL FROM:<app@example.com> SMTPUTF8"))[0] == 250
    code, text = await c.cmd("RCPT TO:<a\u200b@example.org>")
    assert code == 501 and text.startswith("501 5.1.3 Bad recipient address syntax: "), text
    code, text = await c.cmd("RCPT TO:<\ufeffa@example.org>")
    assert code == 501 and "U+FEFF" in text
    code, text = await c.cmd("RCPT TO:<a@[IPv6:::::]>")
    assert code == 501 and "IPv6" in text


async def test_non_ascii_addresses_need_smtputf8(start: Start) -> None:  # noqa: F811
    r = await start()
    c = await r.connect()
    assert await c.cmd("MAIL FROM:<jürgen@example.com>") == (
        553,
        "553 5.6.7 Non-ASCII sender address needs the SMTPUTF8 parameter on MAIL",
    )
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert await c.cmd("RCPT TO:<jörg@example.org>") == (
        553,
        "553 5.6.7 Non-ASCII recipient address needs the SMTPUTF8 parameter on MAIL",
    )
    assert await c.cmd("RCPT TO:<user@bücher.example>") == (
        553,
        "553 5.6.7 Non-ASCII recipient address needs the SMTPUTF8 parameter on MAIL",
    )
    assert (await c.cmd("RCPT TO:<ok@example.org>"))[0] == 250
    assert QUEUED.match(await c.data(MSG))
    assert r.handler.stats.by_reason == {"bad_address": 3}
    # with SMTPUTF8 the same addresses are taken, exactly as sent
    assert (await c.cmd("MAIL FROM:<jürgen@example.com> SMTPUTF8"))[0] == 250
    assert (await c.cmd("RCPT TO:<jörg@example.org>"))[0] == 250
    assert (await c.cmd("RCPT TO:<user@bücher.example>"))[0] == 250
    m = QUEUED.match(await c.data(message("<m2@app.example>")))
    assert m, m
    rows = r.rows("SELECT address FROM recipients WHERE msg_id = ?", m.group(1))
    assert sorted(a for (a,) in rows) == ["jörg@example.org", "user@bücher.example"]
