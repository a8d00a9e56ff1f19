"""relay/inbound/core.py: the sans-I/O SMTP server core, row by row of its rules."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from relay.inbound import core
from relay.inbound.core import (
    NEED_DATA,
    PAUSED,
    TRANSITIONS,
    Auth,
    AuthAnswer,
    BareNewline,
    Closed,
    DataChunk,
    DataEnd,
    DataStart,
    Ehlo,
    Mail,
    ProtocolStateError,
    Rcpt,
    Refused,
    ServerCore,
    Settings,
    StartTls,
    State,
    with_enhanced,
)

HOST = "relay.test"
BASE = Settings(hostname=HOST, max_size=1000, max_command=512, max_line=1001, max_errors=10)


def ehlo_lines(ev: Ehlo) -> list[str]:
    """What InboundHandler.handle_EHLO does to the offered lines."""
    lines = list(ev.responses)
    last = lines.pop()
    return [*lines, "250-PIPELINING", "250-ENHANCEDSTATUSCODES", last]


def default_answer(ev: core.Event) -> str | list[str]:
    if isinstance(ev, Ehlo):
        return ehlo_lines(ev)
    if isinstance(ev, Mail):
        return "250 2.1.0 OK"
    if isinstance(ev, Rcpt):
        return "250 2.1.5 OK"
    if isinstance(ev, DataEnd):
        return "250 2.0.0 Ok: queued as Q1"
    if isinstance(ev, Auth):
        return "235 2.7.0 Authentication successful"
    raise AssertionError(ev)


Answer = Callable[[core.Event], "str | list[str]"]


def converse(
    c: ServerCore, data: bytes, answer: Answer = default_answer
) -> tuple[list[str], list[core.Event]]:
    """Feed `data`, answer every event that asks, return the reply lines and the events."""
    c.receive_data(data)
    events: list[core.Event] = []
    while True:
        ev = c.next_event()
        if ev is NEED_DATA or ev is PAUSED:
            break
        assert isinstance(ev, core.Event)
        events.append(ev)
        if ev.needs_reply:
            got = answer(ev)
            if isinstance(got, list):
                c.reply_lines(got)
            else:
                c.reply(got)
    out = c.data_to_send().decode("utf-8", "surrogateescape")
    assert out == "" or out.endswith("\r\n")
    return out.split("\r\n")[:-1], events


def session(settings: Settings = BASE, **kw: Any) -> ServerCore:
    return ServerCore(dataclasses.replace(settings, **kw))


def replies(data: bytes, answer: Answer = default_answer, **kw: Any) -> list[str]:
    return converse(session(**kw), data, answer)[0]


EHLO = b"EHLO client.test\r\n"

# --- the greeting and EHLO --------------------------------------------------------------------


def test_the_greeting_names_the_host() -> None:
    assert session().greeting() == b"220 relay.test relay ESMTP\r\n"


@pytest.mark.parametrize(
    ("kw", "ehlo"),
    [
        (
            {},
            [
                "250-relay.test",
                "250-SIZE 1000",
                "250-8BITMIME",
                "250-SMTPUTF8",
                "250-PIPELINING",
                "250-ENHANCEDSTATUSCODES",
                "250 HELP",
            ],
        ),
        (
            {"max_size": 0},
            [
                "250-relay.test",
                "250-8BITMIME",
                "250-SMTPUTF8",
                "250-PIPELINING",
                "250-ENHANCEDSTATUSCODES",
                "250 HELP",
            ],
        ),
        (
            {"starttls": True},
            [
                "250-relay.test",
                "250-SIZE 1000",
                "250-8BITMIME",
                "250-SMTPUTF8",
                "250-STARTTLS",
                "250-PIPELINING",
                "250-ENHANCEDSTATUSCODES",
                "250 HELP",
            ],
        ),
        (  # AUTH in the clear only with allow_plaintext
            {"auth_offered": True, "auth_plaintext": True},
            [
                "250-relay.test",
                "250-SIZE 1000",
                "250-8BITMIME",
                "250-SMTPUTF8",
                "250-AUTH LOGIN PLAIN",
                "250-PIPELINING",
                "250-ENHANCEDSTATUSCODES",
                "250 HELP",
            ],
        ),
        (  # implicit TLS: no STARTTLS, AUTH at once
            {"auth_offered": True, "implicit_tls": True},
            [
                "250-relay.test",
                "250-SIZE 1000",
                "250-8BITMIME",
                "250-SMTPUTF8",
                "250-AUTH LOGIN PLAIN",
                "250-PIPELINING",
                "250-ENHANCEDSTATUSCODES",
                "250 HELP",
            ],
        ),
        (  # STARTTLS listener with auth: AUTH only after STARTTLS
            {"auth_offered": True, "starttls": True},
            [
                "250-relay.test",
                "250-SIZE 1000",
                "250-8BITMIME",
                "250-SMTPUTF8",
                "250-STARTTLS",
                "250-PIPELINING",
                "250-ENHANCEDSTATUSCODES",
                "250 HELP",
            ],
        ),
    ],
)
def test_the_ehlo_reply_offers_what_the_listener_has(kw: dict[str, Any], ehlo: list[str]) -> None:
    assert replies(EHLO, **kw) == ehlo


def test_helo_is_answered_by_the_core_and_ehlo_waits_for_the_decision() -> None:
    c = session()
    c.receive_data(b"HELO a\r\nEHLO b\r\nNOOP\r\n")
    ev = c.next_event()
    assert isinstance(ev, core.Helo) and ev.hostname == "a"
    ev = c.next_event()
    assert isinstance(ev, Ehlo) and ev.hostname == "b"
    assert c.next_event() is PAUSED and c.state is State.DECIDE  # NOOP is not read yet
    assert c.data_to_send() == b"250 2.0.0 relay.test\r\n"
    c.reply_lines(ehlo_lines(ev))
    assert isinstance(c.next_event(), core.Noop)
    assert c.data_to_send().endswith(b"250 HELP\r\n250 2.0.0 OK\r\n")


# --- command replies, table ---------------------------------------------------------------

ROWS: list[tuple[str, dict[str, Any], bytes, list[str]]] = [
    ("empty line", {}, b"\r\n", ["500 5.5.2 bad syntax"]),
    ("non-ASCII verb", {}, b"\xc3\xa9HLO x\r\n", ["500 5.5.2 bad syntax"]),
    ("unknown", {}, b"FOO\r\n", ['500 5.5.2 command "FOO" not recognized']),
    ("lower case verb", {}, b"noop\r\n", ["250 2.0.0 OK"]),
    ("NOOP with args", {}, b"NOOP x y\r\n", ["250 2.0.0 OK"]),
    ("HELO without name", {}, b"HELO\r\n", ["501 5.5.4 Syntax: HELO hostname"]),
    ("EHLO without name", {}, b"EHLO \r\n", ["501 5.5.4 Syntax: EHLO hostname"]),
    ("MAIL before HELO", {}, b"MAIL FROM:<a@b.c>\r\n", ["503 5.5.1 send HELO first"]),
    (
        "RCPT before MAIL",
        {},
        EHLO[:0] + b"HELO x\r\nRCPT TO:<a@b.c>\r\n",
        ["250 2.0.0 relay.test", "503 5.5.1 Error: need MAIL command"],
    ),
    (
        "DATA before RCPT",
        {},
        b"HELO x\r\nMAIL FROM:<>\r\nDATA\r\n",
        ["250 2.0.0 relay.test", "250 2.1.0 OK", "503 5.5.1 Error: need RCPT command"],
    ),
    (
        "DATA with an argument",
        {},
        b"HELO x\r\nMAIL FROM:<>\r\nRCPT TO:<a@b.c>\r\nDATA x\r\n",
        ["250 2.0.0 relay.test", "250 2.1.0 OK", "250 2.1.5 OK", "501 5.5.4 Syntax: DATA"],
    ),
    (
        "nested MAIL",
        {},
        b"HELO x\r\nMAIL FROM:<>\r\nMAIL FROM:<>\r\n",
        ["250 2.0.0 relay.test", "250 2.1.0 OK", "503 5.5.1 Error: nested MAIL command"],
    ),
    (
        "RSET ends the transaction",
        {},
        b"HELO x\r\nMAIL FROM:<>\r\nRSET\r\nRCPT TO:<a@b.c>\r\n",
        [
            "250 2.0.0 relay.test",
            "250 2.1.0 OK",
            "250 2.0.0 OK",
            "503 5.5.1 Error: need MAIL command",
        ],
    ),
    ("RSET with an argument", {}, b"RSET x\r\n", ["501 5.5.4 Syntax: RSET"]),
    ("QUIT with an argument", {}, b"QUIT x\r\n", ["501 5.5.4 Syntax: QUIT"]),
    ("QUIT", {}, b"QUIT\r\nNOOP\r\n", ["221 2.0.0 Bye"]),
    ("EXPN", {}, b"EXPN x\r\n", ["502 5.5.1 EXPN not implemented"]),
    (
        "VRFY",
        {},
        b"VRFY <a@b.c>\r\n",
        ["252 2.0.0 Cannot VRFY user, but will accept message and attempt delivery"],
    ),
    ("VRFY bad", {}, b"VRFY <a@@b>\r\n", ["502 5.5.1 Could not VRFY <a@@b>"]),
    ("VRFY nothing", {}, b"VRFY\r\n", ["501 5.5.4 Syntax: VRFY <address>"]),
    (
        "HELP",
        {},
        b"HELP\r\n",
        ["250 2.0.0 Supported commands: AUTH DATA EHLO HELO HELP MAIL NOOP QUIT RCPT RSET VRFY"],
    ),
    (
        "HELP with STARTTLS",
        {"starttls": True},
        b"HELP\r\n",
        [
            "250 2.0.0 Supported commands: AUTH DATA EHLO HELO HELP MAIL NOOP QUIT RCPT RSET"
            " STARTTLS VRFY"
        ],
    ),
    (
        "HELP MAIL after HELO",
        {},
        b"HELO x\r\nHELP mail\r\n",
        ["250 2.0.0 relay.test", "250 2.0.0 Syntax: MAIL FROM: <address>"],
    ),
    (
        "HELP unknown",
        {},
        b"HELP FOO\r\n",
        ["501 5.5.4 Supported commands: AUTH DATA EHLO HELO HELP MAIL NOOP QUIT RCPT RSET VRFY"],
    ),
    ("STARTTLS not offered", {}, b"STARTTLS\r\n", ["454 4.7.0 TLS not available"]),
    (
        "STARTTLS with an argument",
        {"starttls": True},
        b"STARTTLS x\r\n",
        ["501 5.5.4 Syntax: STARTTLS"],
    ),
    (
        "require_tls refuses MAIL",
        {"starttls": True, "require_tls": True},
        b"EHLO x\r\nMAIL FROM:<>\r\nFOO\r\nNOOP\r\n",
        [
            "250-relay.test",
            "250-SIZE 1000",
            "250-8BITMIME",
            "250-SMTPUTF8",
            "250-STARTTLS",
            "250-PIPELINING",
            "250-ENHANCEDSTATUSCODES",
            "250 HELP",
            "530 5.7.0 Must issue a STARTTLS command first",
            "530 5.7.0 Must issue a STARTTLS command first",
            "250 2.0.0 OK",
        ],
    ),
    (
        "command line too long",
        {"max_command": 20},
        b"NOOP " + b"x" * 16 + b"\r\nNOOP\r\n",
        ["500 5.5.2 Command line too long", "250 2.0.0 OK"],
    ),
    (
        "command line at the limit",
        {"max_command": 20},
        b"NOOP " + b"x" * 15 + b"\r\n",
        ["250 2.0.0 OK"],
    ),
    (
        "line over max_line, in one block",
        {"max_line": 50},
        b"NOOP " + b"x" * 100 + b"\r\nNOOP\r\n",
        ["500 5.5.2 Command line too long", "250 2.0.0 OK"],
    ),
    (
        "AUTH before EHLO",
        {"auth_offered": True, "auth_plaintext": True},
        b"AUTH PLAIN\r\n",
        ["503 5.5.1 send EHLO first"],
    ),
    (
        "AUTH after HELO",
        {"auth_offered": True, "auth_plaintext": True},
        b"HELO x\r\nAUTH PLAIN\r\n",
        ["250 2.0.0 relay.test", "500 5.5.2 command 'AUTH' not recognized"],
    ),
    (
        "AUTH in the clear",
        {"auth_offered": True, "starttls": True},
        b"HELO x\r\nAUTH PLAIN\r\n",
        ["250 2.0.0 relay.test", "500 5.5.2 command 'AUTH' not recognized"],
    ),
    (
        "AUTH on a TLS listener without auth",
        {"starttls": True},
        b"AUTH PLAIN\r\n",
        ["502 5.5.1 AUTH not available on this listener"],
    ),
]


@pytest.mark.parametrize(("name", "kw", "data", "want"), ROWS, ids=[r[0] for r in ROWS])
def test_command_replies(name: str, kw: dict[str, Any], data: bytes, want: list[str]) -> None:
    assert replies(data, **kw) == want


def test_auth_in_the_clear_is_refused_with_538_and_a_bad_mechanism_with_504() -> None:
    lines = replies(EHLO + b"AUTH PLAIN\r\n", auth_offered=True, starttls=True)
    assert lines[-1] == "538 5.7.11 Encryption required for requested authentication mechanism"
    kw = {"auth_offered": True, "auth_plaintext": True}
    assert replies(EHLO + b"AUTH CRAM-MD5\r\n", **kw)[-1] == (
        "504 5.5.4 Unrecognized authentication type"
    )
    assert replies(EHLO + b"AUTH plain\r\n", **kw)[-1] == (  # as aiosmtpd: case matters
        "504 5.5.4 Unrecognized authentication type"
    )
    assert replies(EHLO + b"AUTH\r\n", **kw)[-1] == "501 5.5.4 Not enough value"
    assert replies(EHLO + b"AUTH PLAIN a b\r\n", **kw)[-1] == "501 5.5.4 Too many values"


# --- MAIL and RCPT --------------------------------------------------------------------------

MAIL_ROWS: list[tuple[bytes, str | tuple[str, tuple[str, ...], bool]]] = [
    (b"MAIL FROM:<a@b.example>", ("a@b.example", (), False)),
    (b"MAIL FROM: <a@b.example>", ("a@b.example", (), False)),
    (b"mail from:<>", ("", (), False)),
    (
        b"MAIL FROM:<a@b.example> BODY=8BITMIME SMTPUTF8",
        ("a@b.example", ("BODY=8BITMIME", "SMTPUTF8"), True),
    ),
    (b"MAIL FROM:<a@b.example> size=100", ("a@b.example", ("SIZE=100",), False)),
    (
        b"MAIL FROM:<a@b.example> SIZE=1001",
        "552 5.3.4 Message size exceeds fixed maximum message size",
    ),
    (
        b"MAIL FROM:<a@b.example> SIZE=x",
        "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]",
    ),
    (
        b"MAIL FROM:<a@b.example> SIZE",
        "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]",
    ),
    (
        b"MAIL FROM:<a@b.example> BODY=BINARYMIME",
        "501 5.5.4 BODY can only be one of 7BIT, 8BITMIME",
    ),
    (b"MAIL FROM:<a@b.example> SMTPUTF8=yes", "501 5.5.4 SMTPUTF8 takes no arguments"),
    (
        b"MAIL FROM:<a@b.example> FOO=1",
        "555 5.5.4 MAIL FROM parameters not recognized or not implemented",
    ),
    (
        b"MAIL FROM:<a@b.example> FOO=",
        "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]",
    ),
    (b"MAIL TO:<a@b.example>", "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]"),
    (b"MAIL", "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]"),
    (b"MAIL FROM:<a b@c.example>", "501 5.1.7 Bad sender address syntax: "),
    (b"MAIL FROM:<root>", "501 5.1.7 Bad sender address syntax: "),
    (  # RFC 6531 §3.4
        "MAIL FROM:<\u00e9@b.example>".encode(),
        "553 5.6.7 Non-ASCII sender address needs the SMTPUTF8 parameter on MAIL",
    ),
    ("MAIL FROM:<\u00e9@b.example> SMTPUTF8".encode(), ("\u00e9@b.example", ("SMTPUTF8",), True)),
]


@pytest.mark.parametrize(("line", "want"), MAIL_ROWS)
def test_mail_paths_and_parameters(
    line: bytes, want: str | tuple[str, tuple[str, ...], bool]
) -> None:
    lines, events = converse(session(), EHLO + line + b"\r\n")
    if isinstance(want, str):
        assert lines[-1].startswith(want), lines[-1]
        assert not any(isinstance(e, Mail) for e in events)
    else:
        mail = [e for e in events if isinstance(e, Mail)]
        assert [(m.address, m.options, m.smtputf8) for m in mail] == [want]


def test_a_bad_path_is_counted_as_a_refusal() -> None:
    _, events = converse(session(), EHLO + b"MAIL FROM:<a b@c.example>\r\n")
    assert Refused("bad_address") in events


@pytest.mark.parametrize(
    ("mail", "want"),
    [
        (b"MAIL FROM:<a@b.example>", "553 5.6.7 Non-ASCII recipient address needs the SMTPUTF8"),
        (b"MAIL FROM:<a@b.example> SMTPUTF8", "250 2.1.5 OK"),
    ],
)
def test_a_non_ascii_recipient_needs_smtputf8_on_the_mail(mail: bytes, want: str) -> None:
    """RFC 6531 §3.4: the MAIL of this transaction decides, and a refused MAIL's SMTPUTF8
    does not carry over to the next one."""
    rcpt = "RCPT TO:<\u00e9@d.example>\r\n".encode()
    lines, events = converse(session(), EHLO + mail + b"\r\n" + rcpt)
    assert lines[-1].startswith(want), lines[-1]
    assert (Refused("bad_address") in events) is want.startswith("553")
    c = session()
    converse(
        c,
        EHLO + b"MAIL FROM:<a@b.example> SMTPUTF8\r\n",
        lambda e: "451 4.3.0 no" if isinstance(e, Mail) else default_answer(e),
    )
    lines, _ = converse(c, b"MAIL FROM:<a@b.example>\r\n" + rcpt)
    assert lines[-1].startswith("553 5.6.7 Non-ASCII recipient"), lines[-1]


def test_a_bare_local_part_is_qualified_only_for_a_client_that_may_relay() -> None:
    data = EHLO + b"MAIL FROM:<root>\r\nRCPT TO:<ops>\r\n"
    _, events = converse(session(bare_ok=True, local_domain="host.example"), data)
    got = [e.address for e in events if isinstance(e, (Mail, Rcpt))]
    assert got == ["root@host.example", "ops@host.example"]
    lines, _ = converse(session(local_domain="host.example"), data)
    assert lines[-2].startswith("501 5.1.7")


def test_helo_mode_takes_no_parameters() -> None:
    lines = replies(b"HELO x\r\nMAIL FROM:<a@b.example> BODY=8BITMIME\r\n")
    assert lines[-1] == "501 5.5.4 Syntax: MAIL FROM:<address>"


def test_a_refused_mail_starts_no_transaction() -> None:
    c = session()
    lines, _ = converse(
        c,
        EHLO + b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\n",
        lambda e: "451 4.3.0 no" if isinstance(e, Mail) else default_answer(e),
    )
    assert lines[-2:] == ["451 4.3.0 no", "503 5.5.1 Error: need MAIL command"]


def test_mail_gets_36_more_octets_after_ehlo() -> None:
    path = b"MAIL FROM:<" + b"a" * 20 + b"@b.example>"  # 42 octets
    assert replies(b"HELO x\r\n" + path + b"\r\n", max_command=40)[-1] == (
        "500 5.5.2 Command line too long"
    )
    assert replies(EHLO + path + b"\r\n", max_command=40)[-1] == "250 2.1.0 OK"


# --- DATA -----------------------------------------------------------------------------------

TXN = EHLO + b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n"


def test_data_is_streamed_in_chunks_then_decided_and_pipelined_commands_follow() -> None:
    c = session()
    lines, first = converse(c, TXN + b"Subject: x\r\n\r\n..dot\r\n")
    assert lines[-1] == "354 End data with <CR><LF>.<CR><LF>"
    assert isinstance(first[-2], DataStart) and c.state is State.DATA
    lines, events = converse(c, b"more\r\n.\r\nNOOP\r\nQUIT\r\n")
    chunks = b"".join(e.data for e in first + events if isinstance(e, DataChunk))
    assert chunks == b"Subject: x\r\n\r\n.dot\r\nmore\r\n"  # the parser's chunks, dot removed
    assert lines == ["250 2.0.0 Ok: queued as Q1", "250 2.0.0 OK", "221 2.0.0 Bye"]


def test_bare_lf_dot_does_not_end_data() -> None:
    c = session()
    converse(c, TXN)
    lines, _events = converse(c, b"a\n.\nMAIL FROM:<x@y.example>\r\n")
    assert lines == [] and c.state is State.DATA
    lines, _ = converse(c, b"\r\n.\r\n")
    assert lines == ["250 2.0.0 Ok: queued as Q1"]


@pytest.mark.parametrize(
    ("kw", "body", "refusal"),
    [
        ({"max_size": 10}, b"x" * 20 + b"\r\n", "552 5.3.4 Message size exceeds fixed maximum"),
        ({"max_line": 30}, b"x" * 40 + b"\r\n", "500 5.5.2 Line too long (see RFC 5321 4.5.3.1.6)"),
        (
            {"max_header": 20},
            b"Subject: " + b"x" * 20 + b"\r\n\r\nbody\r\n",
            "552 5.3.4 Message header too large",
        ),
    ],
)
def test_data_over_a_limit_is_refused_by_the_core(
    kw: dict[str, Any], body: bytes, refusal: str
) -> None:
    c = session(**kw)
    lines, events = converse(c, TXN + body + b".\r\nRCPT TO:<e@f.example>\r\n")
    end = [e for e in events if isinstance(e, DataEnd)]
    assert len(end) == 1 and end[0].refusal is not None and not end[0].needs_reply
    assert lines[-2].startswith(refusal)
    assert lines[-1] == "503 5.5.1 Error: need MAIL command"  # the transaction is over
    # counted in relay_rejected_total as before (RelaySMTP): only the header limit
    counted = [e for e in events if isinstance(e, Refused)]
    assert counted == ([Refused("header_too_large")] if "max_header" in kw else [])


def test_a_header_block_within_the_limit_is_accepted() -> None:
    body = b"Subject: " + b"x" * 9 + b"\r\n\r\n" + b"y" * 100 + b"\r\n.\r\n"  # 20 octets
    assert replies(TXN + body, max_header=20)[-1] == "250 2.0.0 Ok: queued as Q1"


def test_the_accept_decision_ends_the_transaction_whatever_it_says() -> None:
    c = session()
    lines, _ = converse(
        c,
        TXN + b".\r\nDATA\r\n",
        lambda e: "451 4.3.0 later" if isinstance(e, DataEnd) else default_answer(e),
    )
    assert lines[-2:] == ["451 4.3.0 later", "503 5.5.1 Error: need RCPT command"]


def test_pipelined_replies_come_out_in_order_in_one_buffer() -> None:
    c = session()
    c.receive_data(EHLO + b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nRCPT TO:<x>\r\n")
    seen = []
    while (ev := c.next_event()) not in (NEED_DATA, PAUSED):
        assert isinstance(ev, core.Event)
        seen.append(type(ev).__name__)
        if ev.needs_reply:
            a = default_answer(ev)
            c.reply_lines(a) if isinstance(a, list) else c.reply(a)
    out = c.data_to_send().split(b"\r\n")[:-1]
    assert out[-3:] == [
        b"250 2.1.0 OK",
        b"250 2.1.5 OK",
        b"501 5.1.3 Bad recipient address"
        b" syntax: " + out[-1][len(b"501 5.1.3 Bad recipient address syntax: ") :],
    ]
    assert seen == ["Ehlo", "Mail", "Rcpt", "Refused"]


# --- bare CR and LF -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        b"NOOP\n",
        b"NOOP\r\r\n",
        b"NO\rOP\r\n",
        b"MAIL FROM:<a@b.example>\n",
        b"\n",
        b"RCPT TO:<a@b.c\n>\r\n",  # the rows of the strict reader's tests (smtpd_adapter)
        b"MAIL FROM:<a\rb@c.d>\r\n",
    ],
)
def test_a_command_line_with_a_bare_cr_or_lf_is_never_acted_on(line: bytes) -> None:
    c = session()
    lines, events = converse(c, b"HELO x\r\n" + line + b"NOOP\r\n")
    assert lines == [
        "250 2.0.0 relay.test",
        "500 5.5.2 Syntax error: bare CR or LF in command line (RFC 5321 2.3.8)",
    ]
    assert isinstance(events[-1], BareNewline) and c.state is State.CLOSED
    assert not any(isinstance(e, (Mail, core.Noop)) for e in events)


def test_a_bare_cr_waits_for_its_lf() -> None:
    c = session()
    assert converse(c, b"NOOP\r")[0] == []
    assert converse(c, b"\n")[0] == ["250 2.0.0 OK"]


# --- max_errors and unknown commands --------------------------------------------------------


def test_the_max_errors_th_error_closes_with_421() -> None:
    c = session(max_errors=3)
    lines, events = converse(c, b"MAIL\r\nRCPT\r\nDATA\r\nNOOP\r\n")
    assert lines == [
        "503 5.5.1 send HELO first",
        "503 5.5.1 send HELO first",
        "503 5.5.1 send HELO first",
        "421 4.7.0 relay.test too many errors, closing connection",
    ]
    assert events[-1] == Closed("max_errors") and c.state is State.CLOSED


def test_an_accepted_message_starts_the_error_count_again() -> None:
    c = session(max_errors=2)
    lines, _ = converse(c, b"FOO\r\n" + TXN + b".\r\nFOO\r\nNOOP\r\n")
    assert lines[-2:] == ['500 5.5.2 command "FOO" not recognized', "250 2.0.0 OK"]


def test_a_suppressed_recipient_and_our_own_4xx_are_not_client_errors() -> None:
    c = session(max_errors=1)
    lines, _ = converse(
        c,
        EHLO + b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nNOOP\r\n",
        lambda e: (
            "550 5.1.1 Recipient is suppressed since x: y"
            if isinstance(e, Rcpt)
            else default_answer(e)
        ),
    )
    assert lines[-1] == "250 2.0.0 OK"


def test_the_fifth_unknown_command_closes() -> None:
    c = session(max_errors=0)
    lines, events = converse(c, b"A\r\nB\r\nC\r\nD\r\nE\r\nNOOP\r\n")
    assert lines[-1] == "502 5.5.1 Too many unrecognized commands, goodbye."
    assert len(lines) == 5 and events[-1] == Closed("bogus")


def test_a_421_decision_closes() -> None:
    c = session(auth_offered=True, auth_plaintext=True)
    lines, events = converse(
        c,
        EHLO + b"AUTH PLAIN\r\nNOOP\r\n",
        lambda e: (
            "421 4.7.0 too many authentication failures"
            if isinstance(e, Auth)
            else default_answer(e)
        ),
    )
    assert lines[-1] == "421 4.7.0 too many authentication failures"
    assert c.state is State.CLOSED
    assert events[-1] == Closed("421", "421 4.7.0 too many authentication failures")


# --- AUTH exchanges -------------------------------------------------------------------------


def test_an_auth_exchange_reads_answers_to_challenges() -> None:
    c = session(auth_offered=True, auth_plaintext=True)
    converse(c, EHLO)
    c.receive_data(b"AUTH LOGIN\r\n")
    ev = c.next_event()
    assert ev == Auth("LOGIN", None)
    c.auth_challenge(b"User Name\x00")
    assert c.data_to_send() == b"334 VXNlciBOYW1lAA==\r\n" and c.state is State.AUTH
    assert c.next_event() is NEED_DATA
    c.receive_data(base64.b64encode(b"alice") + b"\r\n")
    assert c.next_event() == AuthAnswer(b"alice")
    c.auth_done(True, "235 2.7.0 Authentication successful")
    assert c.authenticated and c.data_to_send() == b"235 2.7.0 Authentication successful\r\n"
    c.receive_data(b"AUTH PLAIN\r\n")
    assert c.next_event() is NEED_DATA
    assert c.data_to_send() == b"503 5.5.1 Already authenticated\r\n"


def test_an_auth_answer_that_is_no_answer_is_answered_by_the_core() -> None:
    for answer, reply in [
        (b"*\r\n", "501 5.7.0 Auth aborted"),
        (b"!!!\r\n", "501 5.5.2 Can't decode base64"),
        (b"x" * 2000 + b"\r\n", "500 5.5.6 Authentication exchange line is too long"),
        (
            b"x" * 500 + b"\r\n" * 0 + b"y" * 1600 + b"\r\n",
            "500 5.5.6 Authentication exchange line is too long",
        ),
    ]:
        c = session(auth_offered=True, auth_plaintext=True)
        converse(c, EHLO)
        c.receive_data(b"AUTH PLAIN\r\n")
        assert isinstance(c.next_event(), Auth)
        c.auth_challenge(b"")
        c.data_to_send()
        for i in range(0, len(answer), 700):  # in pieces: the long line is dropped as it comes
            c.receive_data(answer[i : i + 700])
        assert c.next_event() == AuthAnswer(None), answer[:10]
        c.auth_done(False, None)
        assert c.data_to_send() == reply.encode() + b"\r\n"
        assert c.state is State.COMMAND


@pytest.mark.parametrize(
    "answer", [b"*\r\n", b"!!!\r\n", b"x" * 2000 + b"\r\n"], ids=["cancel", "base64", "long"]
)
def test_an_auth_answer_that_is_the_last_error_ends_with_closed_alone(answer: bytes) -> None:
    """The answer the core refuses itself is the max_errors-th error: the session closes
    (421), and no AuthAnswer follows the Closed event (the handler would call auth_done on
    a closed session: ProtocolStateError; found by the core fuzzer, `make fuzz`)."""
    c = session(auth_offered=True, auth_plaintext=True, max_errors=2)
    converse(c, EHLO)
    c.receive_data(b"FOO\r\nAUTH PLAIN\r\n")
    assert c.next_event() == Auth("PLAIN", None)
    c.auth_challenge(b"")
    c.receive_data(answer)
    assert c.next_event() == Closed("max_errors")
    assert c.next_event() is PAUSED and c.state is State.CLOSED
    assert c.data_to_send().endswith(
        b"421 4.7.0 relay.test too many errors, closing connection\r\n"
    )


def test_a_bare_lf_in_an_auth_answer_closes() -> None:
    c = session(auth_offered=True, auth_plaintext=True)
    converse(c, EHLO)
    c.receive_data(b"AUTH PLAIN\r\n")
    c.next_event()
    c.auth_challenge(b"")
    c.data_to_send()
    c.receive_data(b"AGEAYg==\n")
    assert isinstance(c.next_event(), BareNewline) and c.state is State.CLOSED


def test_the_ehlo_lines_made_once_are_each_settings_own() -> None:
    """`_ehlo_lines` keeps what it made per settings object and TLS state: equal settings
    but for the host or SIZE, or the same settings with and without TLS, never share."""
    a = dataclasses.replace(BASE, hostname="a.test", starttls=True)
    b = dataclasses.replace(a, hostname="b.test", max_size=0)
    implicit = dataclasses.replace(a, implicit_tls=True)
    for _ in range(2):  # made, then taken from what was made
        assert converse(ServerCore(a), EHLO)[0][0] == "250-a.test"
        lines = converse(ServerCore(b), EHLO)[0]
        assert lines[0] == "250-b.test" and not any(x.startswith("250-SIZE") for x in lines)
        assert "250-STARTTLS" in converse(ServerCore(a), EHLO)[0]
        assert "250-STARTTLS" not in converse(ServerCore(implicit), EHLO)[0]
    c = ServerCore(a)
    converse(c, EHLO)
    c.tls = True  # as after the handshake
    assert "250-STARTTLS" not in converse(c, EHLO)[0]


# --- STARTTLS -------------------------------------------------------------------------------


def test_starttls_drops_what_was_pipelined_and_starts_over() -> None:
    c = session(starttls=True, auth_offered=True)
    converse(c, EHLO)
    lines, events = converse(c, b"STARTTLS\r\nMAIL FROM:<evil@x.example>\r\n")
    assert lines == ["220 Ready to start TLS"] and events == [StartTls()]
    assert c.state is State.TLS and c.next_event() is PAUSED
    c.receive_data(b"RCPT TO:<evil@x.example>\r\n")  # before the handshake: dropped
    c.tls_started()
    lines, _ = converse(c, b"MAIL FROM:<a@b.example>\r\n" + EHLO)
    assert lines[0] == "503 5.5.1 send HELO first"  # RFC 3207 §4.2: EHLO again
    assert "250-AUTH LOGIN PLAIN" in lines and "250-STARTTLS" not in lines
    assert replies(b"STARTTLS\r\n", starttls=True, implicit_tls=True) == [
        "454 4.7.0 TLS not available"
    ]


# --- the state table ------------------------------------------------------------------------


def test_a_reply_nobody_asked_for_is_our_bug() -> None:
    c = session()
    with pytest.raises(ProtocolStateError):
        c.reply("250 OK")
    with pytest.raises(ProtocolStateError):
        c.tls_started()


def test_every_state_but_closed_can_close_and_closed_leads_nowhere_else() -> None:
    for state in State:
        assert TRANSITIONS.get((state, "close")) is State.CLOSED
    assert {nxt for (st, _), nxt in TRANSITIONS.items() if st is State.CLOSED} == {State.CLOSED}


def test_closed_reads_nothing() -> None:
    c = session()
    converse(c, b"QUIT\r\n")
    c.receive_data(b"NOOP\r\n")
    assert c.next_event() is PAUSED and c.data_to_send() == b""


def test_the_tail_of_a_line_too_long_to_keep_is_dropped_unchecked_and_the_session_goes_on() -> None:
    c = session(max_line=50)
    lines, events = converse(c, b"NOOP " + b"x" * 60)
    assert lines == [] and c.state is State.COMMAND
    lines, events = converse(c, b"x" * 100 + b"\r\nQUIT\r\n")
    assert lines == ["500 5.5.2 Command line too long", "221 2.0.0 Bye"]
    assert not any(isinstance(e, BareNewline) for e in events)


# The enhanced status codes added to the core's own replies (until issue 28 in
# tests/test_inbound_unit.py).
# --- relay/inbound/core.py: with_enhanced ----------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("250 OK", "250 2.0.0 OK"),
        (
            "552 Error: message size exceeds fixed maximum message size",
            "552 5.3.4 message size exceeds fixed maximum message size",
        ),
        ("503 Error: need MAIL command", "503 5.5.1 need MAIL command"),
        ("550 5.1.1 already enhanced", "550 5.1.1 already enhanced"),
        ("250 HELP", "250 HELP"),  # EHLO's last line carries no status code
        ("250-PIPELINING", "250-PIPELINING"),  # continuation lines are left alone
        ("220 relay.test ESMTP", "220 relay.test ESMTP"),  # greeting: no enhanced code
        ("354 End data with <CR><LF>.<CR><LF>", "354 End data with <CR><LF>.<CR><LF>"),
    ],
)
def test_enhanced_codes_added_to_builtin_replies(raw: str, expected: str) -> None:
    assert with_enhanced(raw) == expected
