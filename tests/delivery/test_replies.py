"""Reply parsing and classification, driven by replies seen from real servers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.delivery.replies import (
    Outcome,
    Phase,
    Reply,
    Scope,
    Verdict,
    classify,
    synthetic,
)

D, T, B, F = Outcome.DELIVERED, Outcome.TRANSIENT, Outcome.BOUNCE, Outcome.FAIL


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    code: int
    message: str  # as aiosmtplib hands it over: continuation lines joined by "\n"
    phase: Phase
    outcome: Outcome
    throttled: bool = False
    closes: bool = False


CASES = [
    # --- Gmail -----------------------------------------------------------------------------
    Case(
        "gmail-no-such-user",
        550,
        "5.1.1 The email account that you tried to reach does not exist. Please try\n"
        "5.1.1 double-checking the recipient's email address for typos or\n"
        "5.1.1 unnecessary spaces. For more information, go to\n"
        "5.1.1  https://support.google.com/mail/?p=NoSuchUser a1si123456qkb.42 - gsmtp",
        Phase.RCPT,
        B,
    ),
    Case(
        "gmail-try-again-later",
        421,
        "4.7.0 Try again later, closing connection. (EHLO)\n"
        "4.7.0  For more information, go to\n"
        "4.7.0  https://support.google.com/a/answer/3221692 a1si123456qkb.42 - gsmtp",
        Phase.EHLO,
        T,
        throttled=True,
        closes=True,
    ),
    Case(
        "gmail-over-quota",
        452,
        "4.2.2 The email account that you tried to reach is over quota. Please direct\n"
        "4.2.2 the recipient to\n"
        "4.2.2  https://support.google.com/mail/?p=OverQuotaTemp a1si123456qkb.42 - gsmtp",
        Phase.RCPT,
        T,
    ),
    Case(
        "gmail-receiving-rate",
        450,
        "4.2.1 The user you are trying to contact is receiving mail at a rate that\n"
        "4.2.1 prevents additional messages from being delivered. Please resend your\n"
        "4.2.1 message at a later point. - gsmtp",
        Phase.RCPT,
        T,
        throttled=True,
    ),
    Case(
        "gmail-dmarc-unauthenticated",
        550,
        "5.7.26 This mail has been blocked because the sender is unauthenticated.\n"
        "5.7.26 Gmail requires all senders to authenticate with either SPF or DKIM.",
        Phase.DOT,
        F,
    ),
    Case(
        "gmail-unsolicited",
        550,
        "5.7.1 [203.0.113.5] Our system has detected that this message is\n"
        "5.7.1 likely unsolicited mail. To reduce the amount of spam sent to Gmail,\n"
        "5.7.1 this message has been blocked. - gsmtp",
        Phase.DOT,
        F,
    ),
    Case(
        "gmail-unusual-rate",
        421,
        "4.7.28 [203.0.113.5] Our system has detected an unusual rate of\n"
        "4.7.28 unsolicited mail originating from your IP address. - gsmtp",
        Phase.DOT,
        T,
        throttled=True,
        closes=True,
    ),
    Case(
        "gmail-disabled",
        550,
        "5.2.1 The email account that you tried to reach is disabled. - gsmtp",
        Phase.RCPT,
        B,
    ),
    Case(
        "gmail-full-and-inactive",
        552,
        "5.2.2 The email account that you tried to reach is over quota and inactive.",
        Phase.RCPT,
        F,
    ),
    Case("gmail-starttls-first", 530, "5.7.0 Must issue a STARTTLS command first.", Phase.MAIL, F),
    Case(
        "gmail-bad-credentials",
        535,
        "5.7.8 Username and Password not accepted. For more information, go to\n"
        "5.7.8  https://support.google.com/mail/?p=BadCredentials - gsmtp",
        Phase.AUTH,
        T,
    ),
    Case(
        "gmail-relay-daily-limit",
        550,
        "5.4.5 Daily user sending limit exceeded. - gsmtp",
        Phase.RCPT,
        F,
    ),
    Case("gmail-greeting", 220, "smtp.gmail.com ESMTP a1sm123456qkb.42 - gsmtp", Phase.GREETING, D),
    Case("gmail-go-ahead", 354, "Go ahead a1si123456qkb.42 - gsmtp", Phase.DATA, D),
    Case("gmail-ok", 250, "2.0.0 OK  1700000000 a1si123456qkb.42 - gsmtp", Phase.DOT, D),
    Case("rcpt-ok", 250, "2.1.5 OK a1si123456qkb.42 - gsmtp", Phase.RCPT, D),
    Case("rcpt-will-forward", 251, "2.1.5 User not local; will forward", Phase.RCPT, D),
    Case("rcpt-cannot-vrfy", 252, "2.1.5 Cannot VRFY user, but will accept", Phase.RCPT, D),
    Case("starttls-ready", 220, "2.0.0 Ready to start TLS", Phase.STARTTLS, D),
    Case("auth-ok", 235, "2.7.0 Authentication successful", Phase.AUTH, D),
    Case("auth-continue", 334, "VXNlcm5hbWU6", Phase.AUTH, D),
    # --- Microsoft ---------------------------------------------------------------------------
    Case(
        "outlook-mailbox-unavailable",
        550,
        "5.5.0 Requested action not taken: mailbox unavailable (1234567890:ABCDEF)",
        Phase.RCPT,
        B,
    ),
    Case(
        "exo-dbeb-access-denied",
        550,
        "5.4.1 Recipient address rejected: Access denied. For more information see "
        "https://aka.ms/EXOSmtpErrors [AM0PR01MB1234.eurprd01.prod.exchangelabs.com]",
        Phase.RCPT,
        B,
    ),
    Case(
        "exo-server-busy",
        451,
        "4.7.500 Server busy. Please try again later from [203.0.113.5]. (S77714) "
        "[DB5EUR01FT012.eop-EUR01.prod.protection.outlook.com]",
        Phase.MAIL,
        T,
        throttled=True,
    ),
    Case(
        "outlook-ip-reputation",
        451,
        "4.7.650 The mail server [203.0.113.5] has been temporarily rate limited due to IP "
        "reputation. For e-mail delivery information, see https://postmaster.live.com (S775)",
        Phase.MAIL,
        T,
        throttled=True,
    ),
    Case(
        "outlook-s3150-tagged-deferral",
        451,
        "Messages from [203.0.113.5] temporarily refused (S3150)",
        Phase.RCPT,
        T,
        throttled=True,
    ),
    Case(
        "outlook-block-list",
        550,
        "5.7.1 Unfortunately, messages from [203.0.113.5] weren't sent. Please contact your "
        "Internet service provider since part of their network is on our block list (S3150).",
        Phase.RCPT,
        F,
    ),
    Case(
        "exo-banned-ip",
        550,
        "5.7.708 Service unavailable. Access denied, traffic not accepted from this IP.",
        Phase.MAIL,
        F,
    ),
    Case(
        "exo-recipient-not-found-after-data",
        550,
        "5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address lookup",
        Phase.DOT,
        B,
    ),
    Case("exo-too-many-recipients", 452, "4.5.3 Too many recipients (AS780090)", Phase.RCPT, T),
    Case(
        "exo-invalid-mime",
        554,
        "5.6.211 Invalid MIME Content: Single text value size (32768) exceeded allowed maximum",
        Phase.DOT,
        F,
    ),
    Case(
        "service-not-available-mail",
        421,
        "4.3.2 Service not available",
        Phase.MAIL,
        T,
        throttled=True,
        closes=True,
    ),
    # --- Yahoo -------------------------------------------------------------------------------
    Case(
        "yahoo-ts01",
        421,
        "4.7.0 [TS01] Messages from 203.0.113.5 temporarily deferred due to unexpected volume "
        "or user complaints - 4.16.55.1; see https://postmaster.yahooinc.com/error-codes",
        Phase.GREETING,
        T,
        throttled=True,
        closes=True,
    ),
    Case("yahoo-deferred", 451, "Message temporarily deferred - [160]", Phase.DOT, T, True),
    Case(
        "yahoo-policy",
        554,
        "5.7.9 Message not accepted for policy reasons.  See "
        "https://postmaster.yahooinc.com/error-codes",
        Phase.DOT,
        F,
    ),
    Case(
        "yahoo-invalid-address",
        553,
        "5.1.3 <bad..dots@yahoo.com>: Recipient address rejected: invalid address",
        Phase.RCPT,
        B,
    ),
    Case(
        "yahoo-dd-no-account-after-dot",  # 554 without 5.1.x after DATA: not provably the address
        554,
        "delivery error: dd This user doesn't have a yahoo.com account (x@yahoo.com) [0] - "
        "mta1234.mail.bf1.yahoo.com",
        Phase.DOT,
        F,
    ),
    # --- Postfix, Exim, qmail ----------------------------------------------------------------
    Case(
        "postfix-sender-domain-not-found",
        450,
        "4.1.8 <bounce@nonexist.example>: Sender address rejected: Domain not found",
        Phase.RCPT,
        T,
    ),
    Case(
        "postfix-unknown-virtual",
        550,
        "5.1.1 <nobody@example.org>: Recipient address rejected: User unknown in virtual "
        "mailbox table",
        Phase.RCPT,
        B,
    ),
    Case(
        "postfix-unlisted-sender-at-rcpt",
        550,
        "5.1.0 <someone@example.com>: Sender address rejected: User unknown in local "
        "recipient table",
        Phase.RCPT,
        F,
    ),
    Case(
        "postfix-unknown-sender-domain-at-rcpt",
        553,
        "5.1.8 <s@nx.example>: Sender address rejected: Domain not found",
        Phase.RCPT,
        F,
    ),
    Case(
        "sender-5.1.x-at-mail",
        550,
        "5.1.1 <someone@example.com>: Sender address rejected",
        Phase.MAIL,
        F,
    ),
    Case("postfix-size", 552, "5.3.4 Message size exceeds fixed limit", Phase.DOT, F),
    Case("size-at-mail", 552, "5.3.4 Message size exceeds fixed limit", Phase.MAIL, F),
    Case("transaction-failed", 554, "5.3.0 transaction failed", Phase.DOT, F),
    Case(
        "postfix-rbl",
        554,
        "5.7.1 Service unavailable; Client host [203.0.113.5] blocked using zen.spamhaus.org; "
        "https://www.spamhaus.org/query/ip/203.0.113.5",
        Phase.RCPT,
        F,
    ),
    Case("postfix-relay-denied", 554, "5.7.1 <x@example.net>: Relay access denied", Phase.RCPT, F),
    Case(
        "postfix-no-ptr",
        550,
        "5.7.1 Client host rejected: cannot find your reverse hostname, [203.0.113.5]",
        Phase.RCPT,
        F,
    ),
    Case(
        "postgrey",
        450,
        "4.2.0 <x@example.org>: Recipient address rejected: Greylisted, see "
        "http://postgrey.schweikert.ch/help/example.org.html",
        Phase.RCPT,
        T,
    ),
    Case("postfix-queue-write", 451, "4.3.0 Error: queue file write error", Phase.DOT, T),
    Case("postfix-storage", 452, "4.3.1 Insufficient system storage", Phase.MAIL, T),
    Case("postfix-bad-rcpt-syntax", 501, "5.1.3 Bad recipient address syntax", Phase.RCPT, B),
    Case("postfix-need-rcpt", 503, "5.5.1 Error: need RCPT command", Phase.DATA, F),
    Case("postfix-bad-syntax", 500, "5.5.2 Error: bad syntax", Phase.MAIL, F),
    Case(
        "postfix-idle-timeout",  # 4.4.2: the connection, not a request to slow down
        421,
        "4.4.2 mx.example.org Error: timeout exceeded",
        Phase.DATA,
        T,
        closes=True,
    ),
    Case("congestion", 451, "4.4.5 Mail system congestion", Phase.MAIL, T, throttled=True),
    Case(
        "exim-sender-verify",
        550,
        "Verification failed for <x@nowhere.example>\nUnrouteable address\nSender verify failed",
        Phase.RCPT,
        F,
    ),
    Case("exim-unrouteable", 550, "Unrouteable address", Phase.RCPT, B),
    Case(
        "qmail-rcpthosts",
        553,
        "sorry, that domain isn't in my list of allowed rcpthosts (#5.7.1)",
        Phase.RCPT,
        F,
    ),
    Case(
        "rfc7504-no-mail-host",
        521,
        "5.3.2 mx.example.com does not accept mail",
        Phase.GREETING,
        F,
        closes=True,
    ),
    Case(
        "tls-unavailable",  # 4.7.0 at STARTTLS is about the session, not our rate
        454,
        "4.7.0 TLS not available due to local problem",
        Phase.STARTTLS,
        T,
    ),
    Case("auth-temporary", 454, "4.7.0 Temporary authentication failure", Phase.AUTH, T),
    Case(
        "too-many-connections",
        421,
        "Too many concurrent SMTP connections; please try again later.",
        Phase.GREETING,
        T,
        throttled=True,
        closes=True,
    ),
    Case(
        "throttled-text-450",
        450,
        "4.2.0 Rate limit exceeded for this sender, slow down",
        Phase.RCPT,
        T,
        throttled=True,
    ),
    # --- replies without enhanced codes, RFC 821/5321 style ----------------------------------
    Case("no-such-user", 550, "No such user here", Phase.RCPT, B),
    Case("user-not-local", 551, "User not local; please try <x@example.net>", Phase.RCPT, B),
    Case("user-moved", 551, "5.1.6 User has moved; please try <new@example.com>", Phase.RCPT, B),
    Case(
        "mailbox-name-not-allowed",
        553,
        "Requested action not taken: mailbox name not allowed",
        Phase.RCPT,
        B,
    ),
    Case("rbl-without-enh", 550, "Rejected: 203.0.113.5 listed at zen.spamhaus.org", Phase.RCPT, F),
    Case("550-at-dot-without-enh", 550, "Message rejected", Phase.DOT, F),
    Case("550-at-mail-without-enh", 550, "Sender not allowed", Phase.MAIL, F),
    Case("rfc821-too-many-recipients", 552, "Too many recipients", Phase.RCPT, T),
    Case("too-many-recipients-enh", 552, "5.5.3 Too many recipients", Phase.RCPT, T),
    Case(
        "service-not-available",
        421,
        "mx.example.org Service not available, closing transmission channel",
        Phase.GREETING,
        T,
        throttled=True,
        closes=True,
    ),
    Case("greeting-554", 554, "No SMTP service here", Phase.GREETING, F, closes=True),
    # --- synthetic replies from our own resolver / transport --------------------------------
    Case(
        "null-mx",
        556,
        "5.1.10 example.net does not accept mail (null MX, RFC 7505)",
        Phase.CONNECT,
        B,
        closes=True,
    ),
    Case(
        "nxdomain",
        550,
        "5.1.2 domain nowhere.test does not exist (NXDOMAIN)",
        Phase.CONNECT,
        B,
        closes=True,
    ),
    Case(
        "connection-refused",
        421,
        "4.4.1 connection refused by 127.0.0.1:25",
        Phase.CONNECT,
        T,
        closes=True,
    ),
    Case("dns-servfail", 451, "4.4.3 DNS lookup failed", Phase.CONNECT, T, closes=True),
    # --- unexpected codes: defensive TRANSIENT, drop the session -----------------------------
    Case("250-to-data", 250, "2.0.0 Ok", Phase.DATA, T, closes=True),
    Case("354-to-dot", 354, "End data with <CR><LF>.<CR><LF>", Phase.DOT, T, closes=True),
    Case("334-to-mail", 334, "VXNlcm5hbWU6", Phase.MAIL, T, closes=True),
    Case("1xx", 150, "Preliminary", Phase.DOT, T, closes=True),
    Case("out-of-range", 600, "What?", Phase.RCPT, T, closes=True),
    Case("221-closing", 221, "2.0.0 Bye", Phase.RCPT, D, closes=True),
]


def test_table_is_big_and_ids_unique() -> None:
    assert len(CASES) >= 35
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_classify_real_replies(case: Case) -> None:
    reply = Reply.parse(case.code, case.message)
    expected_scope = Scope.RECIPIENT if case.phase is Phase.RCPT else Scope.TRANSACTION
    assert classify(reply, case.phase) == Verdict(
        outcome=case.outcome,
        closes_connection=case.closes,
        throttled=case.throttled,
        scope=expected_scope,
    )


# --- Reply.parse ----------------------------------------------------------------------------


def test_parse_strips_enhanced_code_and_joins_lines() -> None:
    reply = Reply.parse(
        550,
        "5.1.1 The email account that you tried to reach does not exist. Please try\n"
        "5.1.1 double-checking the recipient's email address for typos",
    )
    assert reply.enhanced == "5.1.1"
    assert reply.text == (
        "The email account that you tried to reach does not exist. Please try"
        " / double-checking the recipient's email address for typos"
    )
    assert str(reply).startswith("550 5.1.1 The email account")


@pytest.mark.parametrize(
    ("code", "message", "enhanced", "text"),
    [
        # RFC 3463 §2: the class digit must repeat the reply code's first digit.
        (450, "5.7.1 mismatched class", None, "5.7.1 mismatched class"),
        (550, "4.2.2 mismatched class", None, "4.2.2 mismatched class"),
        (250, "2.0.0 Ok", "2.0.0", "Ok"),
        (250, "", None, ""),
        (550, "5.1.1", "5.1.1", ""),
        (550, "   5.1.1    spaced   ", "5.1.1", "spaced"),
        (451, "4.7.500 three-digit detail", "4.7.500", "three-digit detail"),
        (550, "5.1.1000 four digits is not a code", None, "5.1.1000 four digits is not a code"),
        (550, "5.1.1.x not followed by a space", None, "5.1.1.x not followed by a space"),
        (550, "5.1 too short", None, "5.1 too short"),
        (550, "No enhanced code 5.1.1 inside", None, "No enhanced code 5.1.1 inside"),
        (550, "5.1.1 first\r\n5.1.1 second\r\n", "5.1.1", "first / second"),
        (550, "5.1.1 first\n5.7.1 other code stays", "5.1.1", "first / 5.7.1 other code stays"),
        (550, "\n\n5.1.1 after blank lines", "5.1.1", "after blank lines"),
        (550, "5.1.1\n5.1.1 text on the second line", "5.1.1", "text on the second line"),
        (550, "5.\u0661.1 arabic-indic digit", None, "5.\u0661.1 arabic-indic digit"),
        (250, "bad byte \udce9 from surrogateescape", None, "bad byte \ufffd from surrogateescape"),
    ],
)
def test_parse_edge_cases(code: int, message: str, enhanced: str | None, text: str) -> None:
    reply = Reply.parse(code, message)
    assert (reply.code, reply.enhanced, reply.text) == (code, enhanced, text)


def test_str_and_from_str() -> None:
    assert str(Reply(550, "5.1.1", "No such user")) == "550 5.1.1 No such user"
    assert str(Reply(421, None, "Service not available")) == "421 Service not available"
    assert str(Reply(250, None, "")) == "250"
    assert Reply.from_str("550 5.1.1 No such user") == Reply(550, "5.1.1", "No such user")
    assert Reply.from_str("250") == Reply(250, None, "")
    assert Reply.from_str("  354 go ahead \n") == Reply(354, None, "go ahead")


def test_from_str_accepts_a_raw_multiline_reply() -> None:
    raw = "550-5.1.1 first line\r\n550-5.1.1 second line\r\n550 5.1.1 last line\r\n"
    assert Reply.from_str(raw) == Reply(550, "5.1.1", "first line / second line / last line")


@pytest.mark.parametrize("value", ["", "   ", "hello", "55 short", "5500 long", "550x", "-1 x"])
def test_from_str_rejects_garbage(value: str) -> None:
    with pytest.raises(ValueError):
        Reply.from_str(value)


def test_json_round_trip() -> None:
    reply = Reply(556, "5.1.10", "example.net does not accept mail (null MX, RFC 7505)")
    assert reply.to_json() == {
        "code": 556,
        "enhanced": "5.1.10",
        "text": "example.net does not accept mail (null MX, RFC 7505)",
    }
    assert Reply.from_json(reply.to_json()) == reply


def test_constructor_normalizes_text() -> None:
    # No line break may reach the spool, a log line or a DSN header field.
    assert Reply(550, None, " first\r\nsecond \n").text == "first / second"
    assert Reply(550, None, "a\u2028b\x85c").text == "a / b / c"


@pytest.mark.parametrize(
    ("code", "enhanced"),
    [(550, "4.1.1"), (550, "5.1"), (550, "5.1.1.1"), (550, "6.1.1"), (550, " 5.1.1"), (99, None)],
)
def test_constructor_validates(code: int, enhanced: str | None) -> None:
    with pytest.raises(ValueError):
        Reply(code, enhanced, "x")


def test_code_class_properties() -> None:
    assert Reply(250, None, "").is_success and Reply(354, None, "").is_success
    assert Reply(451, None, "").is_transient and not Reply(451, None, "").is_success
    assert Reply(554, None, "").is_permanent and not Reply(554, None, "").is_transient
    odd = Reply(150, None, "")
    assert not (odd.is_success or odd.is_transient or odd.is_permanent)


def test_synthetic() -> None:
    assert synthetic(421, "4.4.1", "connection refused by 127.0.0.1:25") == Reply.from_str(
        "421 4.4.1 connection refused by 127.0.0.1:25"
    )
    with pytest.raises(ValueError):
        synthetic(250, "2.0.0", "a made-up reply never reports success")
    with pytest.raises(ValueError):
        synthetic(451, "5.4.2", "class mismatch")


# --- properties -----------------------------------------------------------------------------

phases = st.sampled_from(Phase)
enhanced_codes = st.builds(
    "{}.{}.{}".format,
    st.sampled_from("245"),
    st.integers(0, 999),
    st.integers(0, 999),
)
messages = st.one_of(
    st.text(),
    st.builds("{} {}".format, enhanced_codes, st.text()),
    st.lists(st.builds("{} {}".format, enhanced_codes, st.text()), max_size=4).map("\n".join),
)


@given(code=st.integers(400, 499), message=messages, phase=phases)
def test_every_4xx_is_transient(code: int, message: str, phase: Phase) -> None:
    assert classify(Reply.parse(code, message), phase).outcome is Outcome.TRANSIENT


@given(code=st.integers(200, 299), message=messages)
def test_every_2xx_at_dot_is_delivered(code: int, message: str) -> None:
    assert classify(Reply.parse(code, message), Phase.DOT).outcome is Outcome.DELIVERED


@given(code=st.integers(100, 999), message=messages, phase=phases)
def test_parse_str_round_trip(code: int, message: str, phase: Phase) -> None:
    reply = Reply.parse(code, message)
    again = Reply.from_str(str(reply))
    assert again == reply
    assert Reply.from_json(reply.to_json()) == reply
    assert classify(again, phase) == classify(reply, phase)


@given(code=st.integers(100, 999), message=messages, phase=phases)
def test_classify_invariants(code: int, message: str, phase: Phase) -> None:
    reply = Reply.parse(code, message)
    verdict = classify(reply, phase)
    assert verdict.scope is (Scope.RECIPIENT if phase is Phase.RCPT else Scope.TRANSACTION)
    if verdict.outcome is Outcome.DELIVERED:
        assert reply.is_success
    if verdict.outcome in (Outcome.BOUNCE, Outcome.FAIL):
        # Only a permanent reply stops retries; never one given to AUTH (operator's fault).
        assert reply.is_permanent and phase is not Phase.AUTH
    if verdict.outcome is Outcome.BOUNCE:
        assert phase in (Phase.CONNECT, Phase.RCPT, Phase.DATA, Phase.DOT)
    if verdict.throttled:
        assert reply.is_transient
    if code == 421:
        assert verdict.closes_connection


# Edge cases the main tables did not pin down, each written against a surviving mutant
# (tests/MUTANTS.md; until issue 28 in tests/test_mutants_core_more.py).
# --- relay/delivery/replies.py --------------------------------------------------------------------


def test_lone_surrogate_not_from_a_byte_becomes_replacement_characters() -> None:
    # U+D800 cannot come from surrogateescape (which uses U+DC80-U+DCFF): it is encoded with
    # surrogatepass (3 bytes) and each invalid byte decodes to U+FFFD.
    assert Reply(550, None, "x\ud800 y").text == "x\ufffd\ufffd\ufffd y"


def test_reply_code_bounds() -> None:
    assert Reply(999, None, "odd").code == 999
    with pytest.raises(ValueError, match="three digits"):
        Reply(1000, None, "odd")


def test_from_str_keeps_a_continuation_line_without_code() -> None:
    assert Reply.from_str("550-5.1.1 a\nfoo bar") == Reply(550, "5.1.1", "a / foo bar")


@pytest.mark.parametrize(("code", "enhanced"), [(400, "4.0.0"), (599, "5.0.0")])
def test_synthetic_accepts_bounds(code: int, enhanced: str) -> None:
    assert synthetic(code, enhanced, "t") == Reply(code, enhanced, "t")


@pytest.mark.parametrize("code", [399, 600])
def test_synthetic_refuses_outside_bounds(code: int) -> None:
    with pytest.raises(ValueError, match=rf"^synthetic replies are 4xx or 5xx, got {code}$"):
        synthetic(code, "5.0.0", "t")


@pytest.mark.parametrize(
    ("code", "message", "phase", "outcome"),
    [
        # 5.2.1 mailbox disabled is about the address in every address phase.
        (550, "5.2.1 account disabled", Phase.DOT, Outcome.BOUNCE),
        (554, "5.2.1 account disabled", Phase.RCPT, Outcome.BOUNCE),
        # 5.3.1 mail system full: not the address.
        (550, "5.3.1 mail system full", Phase.RCPT, Outcome.FAIL),
        # Not a mailbox code (550/551/553): not the address, whatever the enh.
        (554, "5.0.0 transaction failed", Phase.RCPT, Outcome.FAIL),
        # 5.2.2 mailbox full: a valid mailbox.
        (550, "5.2.2 mailbox full", Phase.RCPT, Outcome.FAIL),
        # 5.2.3 message too long for the mailbox.
        (550, "5.2.3 message length exceeds limit", Phase.RCPT, Outcome.FAIL),
        # 5.4.4 unable to route: keeps 550's meaning.
        (550, "5.4.4 unable to route", Phase.RCPT, Outcome.BOUNCE),
        # 5.6.1 media not supported: content.
        (550, "5.6.1 media not supported", Phase.RCPT, Outcome.FAIL),
    ],
)
def test_enhanced_codes_at_address_phases(
    code: int, message: str, phase: Phase, outcome: Outcome
) -> None:
    assert classify(Reply.parse(code, message), phase).outcome is outcome


@pytest.mark.parametrize(
    ("code", "message", "throttled"),
    [
        (450, "4.7.1 go away", True),  # 4.7.x policy, not a security detail
        (450, "4.1.7 go away", False),  # subject 1, detail 7: not policy
        (454, "4.7.5 go away", False),  # security detail (cryptographic failure)
    ],
)
def test_throttled_by_enhanced_code_alone(code: int, message: str, throttled: bool) -> None:
    assert classify(Reply.parse(code, message), Phase.RCPT).throttled is throttled


# What the 2026-12-04 mutation run of retry/dedup/address/replies/regex_guard found unpinned
# (tests/MUTANTS.md, "First set, fourth run"; until issue 28 in
# tests/test_mutants_first_set.py): the exact texts of the errors an operator or a client
# reads, the bytes every dedup key hashes (keys are stored in the spool, so a release that
# hashed other bytes would let a resubmission after an upgrade through as new mail), text that
# was not UTF-8 in the hashed parts, the Idempotency-Key limits, and the boundaries of the
# command-character check of a path.
# --- relay/delivery/replies.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "enhanced", "message"),
    [
        (99, None, "SMTP reply code must have three digits, got 99"),
        (550, "5.1", "malformed enhanced status code '5.1'"),
        (550, "4.1.1", "enhanced code 4.1.1 does not match 550"),
    ],
)
def test_reply_construction_errors_say_what_is_wrong(
    code: int, enhanced: str | None, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        Reply(code, enhanced, "text")
    assert str(raised.value) == message


def test_from_str_names_what_is_not_a_reply() -> None:
    with pytest.raises(ValueError) as raised:
        Reply.from_str("hello")
    assert str(raised.value) == "not an SMTP reply: 'hello'"
    with pytest.raises(ValueError) as raised:
        synthetic(250, "2.0.0", "fine")
    assert str(raised.value) == "synthetic replies are 4xx or 5xx, got 250"


def test_a_continuation_line_with_only_the_code_adds_no_text() -> None:
    # "250-first\r\n250": the last line carries the code alone; the text is "first", not
    # "first / " plus a placeholder.
    assert Reply.from_str("250-first\r\n250") == Reply(250, None, "first")
    assert Reply.from_str("550-5.1.1 a\r\n550\r\n550 5.1.1 b") == Reply(550, "5.1.1", "a / b")
