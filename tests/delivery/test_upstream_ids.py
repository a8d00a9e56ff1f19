"""Upstream ids from replies to the final dot, driven by replies seen from real servers.

Each sample names where it was seen. "log" means a Postfix/Sendmail log line quoting the
reply ("status=sent (250 ...)"); the reply is the part in parentheses.
"""

from __future__ import annotations

import random
import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.delivery.replies import Reply
from relay.delivery.upstream_ids import MAX_ID, MAX_SCAN, PATTERNS, upstream_id
from relay.mail.regex_guard import check_linear
from relay.spool import ops

OUR_QUEUE_ID = ops.new_queue_id(1_700_000_000.0)

FOUND = [
    # --- Postfix ---------------------------------------------------------------------------
    # github.com/stalwartlabs/mail-send/issues/24 (swaks-style transcript)
    pytest.param("250 2.0.0 Ok: queued as 224B824BD40", "224B824BD40", id="postfix"),
    # github.com/nodemailer/nodemailer/issues/602 (nodemailer info.response)
    pytest.param("250 2.0.0 Ok: queued as 0CA4412040B", "0CA4412040B", id="postfix-2"),
    # the long queue id form (enable_long_queue_ids), shape from the task brief
    pytest.param("250 2.0.0 Ok: queued as 4Q1x2Y3zZ8z9", "4Q1x2Y3zZ8z9", id="postfix-long"),
    # our own relay: relay/inbound.py answers with ops.new_queue_id()
    pytest.param(f"250 2.0.0 Ok: queued as {OUR_QUEUE_ID}", OUR_QUEUE_ID, id="this-relay"),
    # --- Exim --------------------------------------------------------------------------------
    # log: relay=mailcleaner.example.com (code search, MailLogParser test fixture)
    pytest.param("250 OK id=1WUWWi-0000ig-Gu", "1WUWWi-0000ig-Gu", id="exim"),
    # git.exim.org test/stdout/4002: Exim 4.97+ long message ids
    pytest.param("250 OK id=10HmaX-000000005vi-0000", "10HmaX-000000005vi-0000", id="exim-4.97"),
    # log: relay=mail.smtp2go.com (SMTP2Go runs Exim)
    pytest.param("250 OK id=1vhsr7-FnQW0hPugdQ-KFqD", "1vhsr7-FnQW0hPugdQ-KFqD", id="smtp2go"),
    # log: relay=mxs.mail.ru
    pytest.param("250 OK id=1ptY0i-009HgJ-1h", "1ptY0i-009HgJ-1h", id="mail.ru"),
    # --- Sendmail ----------------------------------------------------------------------------
    # log: Postfix relaying to a Sendmail host (code search, Jul 31 lrkprdappsmtprelay)
    pytest.param(
        "250 2.0.0 36VKKS9J026559-36VKKS9K026559 Message accepted for delivery",
        "36VKKS9J026559-36VKKS9K026559",
        id="sendmail",
    ),
    # log: sendmail "stat=Sent (o0RABp3N006085 Message accepted for delivery)"; the reply
    # text as Sendmail's own log quotes it, without the code
    pytest.param(
        "o0RABp3N006085 Message accepted for delivery", "o0RABp3N006085", id="sendmail-text"
    ),
    # log: LKML 2001 sendmail log, "stat=Sent (DAA75168 Message accepted for delivery)"
    pytest.param("250 DAA75168 Message accepted for delivery", "DAA75168", id="sendmail-old"),
    # --- OpenSMTPD ---------------------------------------------------------------------------
    # smtp_session.c: smtp_reply(s, "250 %s %08x Message accepted for delivery", ...)
    pytest.param("250 2.0.0 3f4a5b6c Message accepted for delivery", "3f4a5b6c", id="opensmtpd"),
    # older smtp_session.c "250 %s: %08x ..."; msgid 67a9a85f from OpenSMTPD/OpenSMTPD#1253
    pytest.param(
        "250 2.0.0: 67a9a85f Message accepted for delivery", "67a9a85f", id="opensmtpd-colon"
    ),
    # --- Amazon SES --------------------------------------------------------------------------
    # code search: SES newsletter tutorial transcript
    pytest.param(
        "250 Ok 010001870dbae81e-35118332-f389-474c-8b37-69ce1e1934ae-000000",
        "010001870dbae81e-35118332-f389-474c-8b37-69ce1e1934ae-000000",
        id="ses",
    ),
    # log: 2013 postfix relaying through SES (logzilla docs)
    pytest.param(
        "250 Ok 0000014189659bbc-ddd0a727-cab3-49fe-8560-c75a39130a5f-000000",
        "0000014189659bbc-ddd0a727-cab3-49fe-8560-c75a39130a5f-000000",
        id="ses-2013",
    ),
    # --- Gmail -------------------------------------------------------------------------------
    # code search: nodemailer info.response in a test file
    pytest.param(
        "250 2.0.0 OK  1653776100 r33-20020a056870582100b000f169cbbb32sm1847208oap.43 - gsmtp",
        "r33-20020a056870582100b000f169cbbb32sm1847208oap.43",
        id="gmail",
    ),
    # github.com/stalwartlabs/stalwart/issues/927
    pytest.param(
        "250 2.0.0 OK  1731389794 ffacd0b85a97d-381ed975a54si7856017f8f.119 - gsmtp",
        "ffacd0b85a97d-381ed975a54si7856017f8f.119",
        id="gmail-2",
    ),
    # log: pastebin 6uVdcA6f, relay=gmail-smtp-in.l.google.com (single space)
    pytest.param(
        "250 2.0.0 OK 1484311347 g184si2019052wma.77 - gsmtp", "g184si2019052wma.77", id="gmail-mx"
    ),
    # --- Microsoft 365 / Exchange / Outlook.com: the Message-ID in <> -----------------------
    # code search: EOP (*.mail.protection.outlook.com:25) acknowledgment quoted in a report
    pytest.param(
        "250 2.6.0 <7b0d9d63-abb7-430a-8cca-f315eb44be95@SG2PEPF000B66CA.apcprd03.prod.outlook"
        ".com> [InternalId=287762816233, Hostname=TY1PPF58FC46D96.apcprd06.prod.outlook.com] "
        "12064 bytes in 0.275, 42.744 KB/sec Queued mail for delivery",
        "7b0d9d63-abb7-430a-8cca-f315eb44be95@SG2PEPF000B66CA.apcprd03.prod.outlook.com",
        id="microsoft-365-mx",
    ),
    # code search: smtp.office365.com submission transcript
    pytest.param(
        "250 2.0.0 OK <BYAPR17MB292020A5FA913E69A3A1C26BDC192@BYAPR17MB2920.namprd17.prod.outl"
        "ook.com> [Hostname=BYAPR17MB2920.namprd17.prod.outlook.com]",
        "BYAPR17MB292020A5FA913E69A3A1C26BDC192@BYAPR17MB2920.namprd17.prod.outlook.com",
        id="microsoft-365-submission",
    ),
    # log: 2011 forum post, Postfix relaying to Exchange (forum markup removed)
    pytest.param(
        "250 2.6.0 <20111025103822.7F94E1C0299@ASTNAGIOS> [InternalId=274498] Queued mail for "
        "delivery",
        "20111025103822.7F94E1C0299@ASTNAGIOS",
        id="exchange",
    ),
    # code search: sntp/smtp status tool transcript against hotmail.com (two lines)
    pytest.param(
        "250 <SNT0-MC3-F1964xSNUX00142e45@SNT0-MC3-F19.Snt0.hotmail.com>\nQueued mail for delivery",
        "SNT0-MC3-F1964xSNUX00142e45@SNT0-MC3-F19.Snt0.hotmail.com",
        id="hotmail",
    ),
    # --- SendGrid and other "queued as" servers ---------------------------------------------
    # github.com/sendgrid/docs/issues/2638
    pytest.param(
        "250 Ok: queued as nhIMmON9SFOPcT0ii4nt2A", "nhIMmON9SFOPcT0ii4nt2A", id="sendgrid"
    ),
    # code search: a project's notes quoting MailerSend (ZoneMTA's wording)
    pytest.param(
        "250 Message queued as 6a9068083f3f7659bff76c97",
        "6a9068083f3f7659bff76c97",
        id="mailersend",
    ),
    # Brevo's reply shape from a Postfix log (relay=smtp-relay.brevo.com; the id there was a
    # placeholder), with an id in Brevo's Message-ID format from its API responses
    pytest.param(
        "250 2.0.0 OK: queued as <202305110534.61060994606@smtp-relay.mailin.fr>",
        "202305110534.61060994606@smtp-relay.mailin.fr",
        id="brevo",
    ),
    # emailit.com/docs/changelog/2026-09-27-smtp-email-id-reply
    pytest.param(
        "250 2.0.0 OK: queued as em_4yM2nTvR8oPcX3uZiKeLg7sB",
        "em_4yM2nTvR8oPcX3uZiKeLg7sB",
        id="emailit",
    ),
    # code search: nodemailer response from smtp.163.com (NetEase Coremail); the trailing
    # number is a time, the id has a comma
    pytest.param(
        "250 Mail OK queued as smtp13,EcCowAAH6pONaCdiDzW+Gg--.24616S3 1646749837",
        "smtp13,EcCowAAH6pONaCdiDzW+Gg--.24616S3",
        id="netease",
    ),
    # log: amavisd-new passing on Postfix's reply; the next hop's queue id wins over id=
    pytest.param(
        "250 2.6.0 Ok, id=04497-01, from MTA([127.0.0.1]:10025): 250 Ok: queued as EFD4020904",
        "EFD4020904",
        id="amavisd",
    ),
    # --- Yandex ------------------------------------------------------------------------------
    # github.com/nodemailer/nodemailer/issues/422 (submission)
    pytest.param(
        "250 2.0.0 Ok: queued on smtp3m.mail.yandex.net as 1430081058-6ltgNFKSir-iHEKdOrm",
        "1430081058-6ltgNFKSir-iHEKdOrm",
        id="yandex",
    ),
    # log: relay=mx.yandex.ru (MX: no "as")
    pytest.param(
        "250 2.0.0 Ok: queued on mail-nwsmtp-mxfront-production-main-10.myt.yp-c.yandex.net "
        "1682952938-btNFgWJPMCg0-4gaCVu2s",
        "1682952938-btNFgWJPMCg0-4gaCVu2s",
        id="yandex-mx",
    ),
    # --- Haraka ------------------------------------------------------------------------------
    # github.com/haraka/Haraka/issues/408
    pytest.param(
        "250 Message Queued (51DE505A-C5B4-4ED3-9FA0-45ED43F49E96.1)",
        "51DE505A-C5B4-4ED3-9FA0-45ED43F49E96.1",
        id="haraka",
    ),
    # --- qmail: time and qmail-queue pid ----------------------------------------------------
    # code search: self-hosting notes, manual SMTP session
    pytest.param("250 ok 1714841964 qp 843479", "1714841964.843479", id="qmail"),
    # code search: an API's README, "postfix_response"
    pytest.param("250 ok 1730385564 qp 30909", "1730385564.30909", id="qmail-2"),
    # --- "OK <id>" and "queued <id>" ---------------------------------------------------------
    # code search: swaks transcript against Momentum (Message Systems, SparkPost's MTA)
    pytest.param("250 2.0.0 OK 00/00-28443-3AF54065", "00/00-28443-3AF54065", id="momentum"),
    # github.com/stalwartlabs/stalwart/issues/927 ("or others")
    pytest.param(
        "250 2.0.0 OK ef6e1f86a16411ef8a5442010a7c0015",
        "ef6e1f86a16411ef8a5442010a7c0015",
        id="ok-hex",
    ),
    # github.com/emersion/go-smtp/pull/278
    pytest.param(
        "250 2.0.0 OK: queued 2K6C7TNVWUIRJYGYXJ6K4TYT", "2K6C7TNVWUIRJYGYXJ6K4TYT", id="go-smtp"
    ),
]

_JUNK = "".join(random.Random(5321).choices(string.printable, k=10_000))

NONE = [
    # the bare acknowledgement (RFC 5321 examples, many servers)
    pytest.param("250 OK", id="ok"),
    pytest.param("250 2.0.0 Ok", id="ok-enhanced"),
    # Mailgun: code search, nodemailer responses from smtp.mailgun.org
    pytest.param("250 Great success", id="mailgun"),
    # github.com/knadh/listmonk/issues/2206 (MailerSend)
    pytest.param("250 Accepted", id="accepted"),
    # Yahoo: logs, relay=mta*.am0.yahoodns.net
    pytest.param("250 ok dirdel", id="yahoo"),
    # Stalwart's source (and github.com/stalwartlabs/stalwart/issues/927)
    pytest.param("250 2.0.0 Message queued for delivery.", id="stalwart"),
    # QQ Mail: code search, smtp.qq.com transcripts: "queued as" and nothing
    pytest.param("250 OK: queued as.", id="qq"),
    # github.com/nodemailer/nodemailer/issues/373
    pytest.param("250 Message received", id="received"),
    # DavMail's test suite (Exchange gateway), no id
    pytest.param("250 Queued mail for delivery", id="davmail"),
    # code search: JavaMail debug output; the enhanced code is not an id
    pytest.param("250 2.5.0 Message accepted for delivery", id="accepted-enhanced"),
    pytest.param("250 OK: Message accepted for delivery", id="accepted-ok"),
    pytest.param("250 Message accepted for delivery", id="accepted-plain"),
    # wormly.com: RFC 5321's text for 250
    pytest.param("250 Requested mail action okay, completed", id="rfc-text"),
    # a time alone is not an id (decision)
    pytest.param("250 2.0.0 OK 1700000000", id="time-alone"),
    pytest.param("250 2.0.0 OK 1700000000123", id="time-ms-alone"),
    pytest.param("250 2.0.0 OK  1700000000 - gsmtp", id="gmail-time-alone"),
    # not a 2xx: nothing was accepted
    pytest.param("554 5.7.1 Message rejected, id=1rXyZ-000abc-12", id="rejected"),
    pytest.param("451 4.3.0 Ok: queued as 224B824BD40", id="transient"),
    # nothing at all, or not a reply
    pytest.param("", id="empty"),
    pytest.param("   \n  / \r\n", id="blank"),
    pytest.param("\x00\x01\ufffd\udcff garbage \u2028", id="garbage"),
    pytest.param(_JUNK, id="junk-10k"),
    pytest.param("queued as " * 1000, id="queued-as-repeated"),
    pytest.param("250 OK id=ok", id="word-is-not-an-id"),
    pytest.param("<" * 10_000, id="open-brackets"),
]


def _valid(value: str) -> bool:
    return (
        1 <= len(value) <= MAX_ID
        and all("\x21" <= c <= "\x7e" for c in value)
        and "<" not in value
        and ">" not in value
    )


@pytest.mark.parametrize(("reply", "expected"), FOUND)
def test_found(reply: str, expected: str) -> None:
    assert upstream_id(reply) == expected
    assert _valid(expected)


WITH_CODE = [p for p in FOUND if str(p.values[0])[:3].isdigit()]


@pytest.mark.parametrize(("reply", "expected"), WITH_CODE)
def test_found_in_what_the_caller_logs(reply: str, expected: str) -> None:
    """relay/delivery/attempt.py passes str(Reply); the text alone (no code) works too."""
    parsed = Reply.from_str(reply)
    assert upstream_id(str(parsed)) == expected
    assert upstream_id(parsed.text) == expected


@pytest.mark.parametrize("reply", NONE)
def test_none(reply: str) -> None:
    assert upstream_id(reply) is None


def test_raw_multiline_reply_with_codes_on_every_line() -> None:
    reply = "250-2.0.0 Message accepted\r\n250 2.0.0 Ok: queued as 224B824BD40"
    assert upstream_id(reply) == "224B824BD40"
    assert upstream_id(str(Reply.from_str(reply))) == "224B824BD40"


def test_trailing_punctuation_and_brackets() -> None:
    assert upstream_id("250 Ok: queued as 224B824BD40.") == "224B824BD40"
    assert upstream_id("250 OK id=1WUWWi-0000ig-Gu, thanks") == "1WUWWi-0000ig-Gu"
    assert upstream_id('250 Ok: queued as "224B824BD40"') == "224B824BD40"
    assert upstream_id("250 Message queued as <2123@some-host>") == "2123@some-host"
    # a closing bracket that opens inside the id stays
    assert upstream_id("250 OK id=abc(1)") == "abc(1)"
    # inside <> nothing is trimmed
    assert upstream_id("250 2.6.0 <x.1@[10.0.0.1]> Queued mail for delivery") == "x.1@[10.0.0.1]"


def test_id_length_limit() -> None:
    longest = "A1" * (MAX_ID // 2)
    assert upstream_id(f"250 Ok: queued as {longest}") == longest
    assert upstream_id(f"250 Ok: queued as {longest}B") is None
    assert upstream_id(f"250 2.6.0 <{longest}@x> Queued mail for delivery") is None


def test_only_the_first_max_scan_characters_are_read() -> None:
    head = "250 2.0.0 Ok: queued as 224B824BD40 "
    assert upstream_id(head + "x" * 10 * MAX_SCAN) == "224B824BD40"
    late = "250 2.0.0 " + "padding " * (MAX_SCAN // 8) + "Ok: queued as 224B824BD40"
    assert upstream_id(late) is None


def test_an_id_cut_by_the_limit_is_not_returned_in_part() -> None:
    def reply(id_ends_at: int) -> str:
        marker = "Ok: queued as 1234567890"
        return "250" + " " * (id_ends_at - 3 - len(marker)) + marker + " tail"

    assert upstream_id(reply(MAX_SCAN)) == "1234567890"  # ends at the limit: whole
    assert upstream_id(reply(MAX_SCAN + 5)) is None  # "12345" is all that was read
    assert upstream_id(reply(MAX_SCAN + 5)[: MAX_SCAN + 10]) is None


def test_non_ascii_next_to_an_id_is_not_cut_off() -> None:
    assert upstream_id("250 Ok: queued as 224B824BD40\u00e9") is None
    assert upstream_id("250 Ok: queued as 224B824BD40 \u00e9") == "224B824BD40"


def test_patterns_are_linear() -> None:
    for name, pattern, _ in PATTERNS:
        check_linear(pattern.pattern)  # raises on nested unbounded repetitions
        assert name


HOSTILE = [
    "queued as " * 2000,
    "OK " + "1" * 20_000,
    "a" * 20_000 + " Message accepted for delivery",
    "id=" * 7000,
    "queued on " + "h" * 20_000,
    "OK " + "x" * 5000 + " - gsmtp",
    "<" + "a" * 20_000,
    ("250-" + "9" * 300 + "\n") * 100,
    " / ".join(["250 2.0.0 OK"] * 3000),
    "\t" * 20_000 + "x",
    "queued (" * 3000,
    ("ok 1700000000 qp " * 2000),
    _JUNK * 10,
]


def test_hostile_input_is_fast() -> None:
    for reply in HOSTILE:
        start = time.process_time()
        for _ in range(20):
            result = upstream_id(reply)
        elapsed = (time.process_time() - start) / 20
        assert result is None or _valid(result)
        assert elapsed < 0.01, (reply[:40], elapsed)


_PIECES = st.sampled_from(
    [
        "250",
        "250-",
        " ",
        "  ",
        "\n",
        "\r\n",
        " / ",
        "2.0.0",
        "2.6.0:",
        "OK",
        "Ok:",
        "ok",
        "queued",
        "as",
        "on",
        "id=",
        "qp",
        "Message accepted for delivery",
        "- gsmtp",
        "<",
        ">",
        "(",
        ")",
        ".",
        ",",
        '"',
        "1700000000",
        "12345",
        "224B824BD40",
        "a@b.example",
        "0100018c0a1b2c3d-0a1b2c3d-0a1b-0a1b-0a1b-0a1b2c3d4e5f-000000",
        "\u00e9",
        "\x00",
        "\udcff",
    ]
)


@settings(max_examples=300, deadline=200)
@given(st.lists(_PIECES, max_size=40).map("".join))
def test_reply_like_text_gives_none_or_a_valid_id(reply: str) -> None:
    result = upstream_id(reply)
    if result is not None:
        assert _valid(result)
        assert result in reply or "qp" in reply.lower()


@settings(max_examples=300, deadline=200)
@given(st.text(max_size=3 * MAX_SCAN))
def test_any_text_gives_none_or_a_valid_id(reply: str) -> None:
    result = upstream_id(reply)
    if result is not None:
        assert _valid(result)
        assert result in reply or "qp" in reply.lower()
