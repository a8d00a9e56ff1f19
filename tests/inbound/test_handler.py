"""The inbound handler (`InboundHandler` outside `_accept`'s body, and relay/inbound.py's module
helpers), in the test process where mutation testing sees it (tests/MUTANTS.md): what the
survivors of the inbound.py runs showed untested. The protocol each listener gets (EHLO
keywords, STARTTLS, `require_tls`, implicit TLS, the session timeout), a failed STARTTLS
handshake in the log, the guard's connection gauge, the MAIL and RCPT hooks' own checks
(called directly: relay/mail/address.py refuses such paths first), recipients taken once whatever
their case (aliases, feedback), a suppressed alias target, DATA ends in flight at once,
feedback mail spooled to a file, an AUTH line over twice the reader's limit, a peer that is
not a (host, port) pair, and a bare status given its enhanced code."""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from relay.config.tree import from_mapping
from relay.inbound import auth, core
from relay.inbound.handler import InboundHandler, InboundStats, Suppressions
from relay.inbound.session import Envelope, Session, TLSSetupException
from relay.inbound.tls_listener import implicit_context
from relay.ops import faults
from relay.ops.metrics import Metrics
from relay.spool.incoming import IncomingBody
from relay.spool.writer import SpoolWriter
from tests.harness import deep_merge
from tests.inbound.test_handler_accept import handler_with_feedback
from tests.inbound.test_inprocess import (
    MSG,
    QUEUED,
    WAIT,
    Client,
    Relay,
    message,
    serve,
    shut_down,
)

LISTENER = "127.0.0.1:2525"
BOUNCES = "bounces@relay.test"
FEEDBACK_OK = "250 2.0.0 Ok: feedback received"
BAD_RCPT = "553 5.1.3 Recipient address must be a fully qualified mailbox"
BAD_SENDER = "553 5.1.7 Sender address must be a fully qualified mailbox or <>"
SIZE = "250-SIZE 26214400"  # limits.max_message_size's default, 25 MiB
PLAIN_EHLO = [
    "250-relay.test",
    SIZE,
    "250-8BITMIME",
    "250-SMTPUTF8",
    "250-PIPELINING",
    "250-ENHANCEDSTATUSCODES",
    "250 HELP",
]


@pytest.fixture(autouse=True)
def _clean_faults() -> Iterator[None]:
    faults.disarm_all()
    yield
    faults.disarm_all()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


Start = Callable[..., Awaitable[Relay]]


@pytest.fixture
async def start(tmp_path: Path, ca: trustme.CA) -> AsyncIterator[Start]:
    """As tests/inbound/test_inprocess.py's, plus: the listener's TLS (a trustme certificate;
    `tls="implicit"` serves TLS from the first byte as relay/inbound/processes.py does), AUTH with
    a users file (alice:right), a FeedbackService, and a Metrics for the stats."""
    made: list[tuple[Relay, asyncio.AbstractServer]] = []

    async def factory(
        cfg: dict[str, Any] | None = None,
        *,
        tls: str | None = None,
        require_tls: bool = False,
        with_auth: bool = False,
        allow_plaintext: bool = False,
        feedback: bool = False,
        stats: InboundStats | None = None,
        suppressions: Suppressions | None = None,
    ) -> Relay:
        n = len(made)
        spool = tmp_path / f"spool{n}"
        listen: dict[str, Any] = {"address": LISTENER}
        if tls is not None:
            cert = ca.issue_cert("127.0.0.1", "localhost")
            cert.cert_chain_pems[0].write_to_path(str(tmp_path / f"cert{n}.pem"))
            cert.private_key_pem.write_to_path(str(tmp_path / f"key{n}.pem"))
            listen["tls"] = {
                "cert_file": str(tmp_path / f"cert{n}.pem"),
                "key_file": str(tmp_path / f"key{n}.pem"),
                "mode": tls,
            }
        if require_tls:
            listen["require_tls"] = True
        if with_auth:
            users = tmp_path / f"users{n}"
            users.write_text(f"alice:{auth.hash_password('right')}\n")
            listen["auth"] = {"users_file": str(users), "allow_plaintext": allow_plaintext}
        base: dict[str, Any] = {
            "hostname": "relay.test",
            "spool": {"path": str(spool)},
            "listen": [listen],
            "auth": {"failure_delay": "0.01s", "max_failure_delay": "0.01s"},
        }
        if feedback:
            base["feedback"] = {"address": BOUNCES}
        config = from_mapping(deep_merge(base, cfg or {}), tmp_path)
        writer = SpoolWriter(config.spool_path)
        writer.start()
        queued: list[int] = []
        handler = await handler_with_feedback(
            config, writer, suppressions or Suppressions(), queued, feedback, stats
        )
        lst = config.listen[0]
        context = None
        if lst.tls is not None and lst.tls.implicit:
            context = implicit_context(lst.tls, lambda: handler.listener.tls)
        server, port = await serve(handler, context)
        relay = Relay(config, config.spool_path, writer, handler, port, queued)
        made.append((relay, server))
        return relay

    yield factory
    await shut_down(made)


async def connect_tls(r: Relay, ca: trustme.CA) -> Client:
    """A client of an implicit-TLS listener: the handshake, then the greeting."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            "127.0.0.1", r.port, ssl=client_context(ca), server_hostname="127.0.0.1"
        ),
        WAIT,
    )
    c = Client(reader, writer)
    r.clients.append(c)
    code, text = await c.reply()
    assert code == 220, text
    return c


async def starttls(c: Client, ca: trustme.CA) -> None:
    assert await c.cmd("STARTTLS") == (220, "220 Ready to start TLS")
    await asyncio.wait_for(
        c.writer.start_tls(client_context(ca), server_hostname="127.0.0.1"), WAIT
    )


async def ehlo(c: Client) -> list[str]:
    code, text = await c.cmd("EHLO client.test")
    assert code == 250, text
    return text.split("\n")


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(level, message text, fields) of each `event` logged by relay.inbound."""
    return [
        (r.levelname, r.getMessage(), dict(getattr(r, "fields", {})))
        for r in caplog.records
        if r.name == "relay.inbound" and getattr(r, "event", "") == event
    ]


def qid_of(text: str) -> str:
    m = QUEUED.match(text)
    assert m, text
    return m.group(1)


def session_from(peer: Any) -> Any:
    s: Any = Session()
    s.peer = peer
    return s


# --- with_enhanced ------------------------------------------------------------------------------


def test_a_bare_status_code_gets_its_enhanced_status() -> None:
    # four characters, the space included: a reply with an empty text is still a reply
    assert core.with_enhanced("250 ") == "250 2.0.0 "
    assert core.with_enhanced("452 ") == "452 4.3.1 "
    assert core.with_enhanced("250") == "250"  # no text separator: left alone
    assert core.with_enhanced("250 Ok") == "250 2.0.0 Ok"


# --- the protocol each listener gets ------------------------------------------------------------


async def test_a_plain_listener_offers_8bitmime_and_smtputf8_and_no_starttls(
    start: Start,
) -> None:
    r = await start()
    c = await r.connect(ehlo=None)
    assert await ehlo(c) == PLAIN_EHLO
    assert await c.cmd("STARTTLS") == (454, "454 4.7.0 TLS not available")
    assert await c.cmd("MAIL FROM:<app@example.com>") == (250, "250 2.1.0 OK")


async def test_starttls_is_offered_once_and_not_required_without_require_tls(
    start: Start, ca: trustme.CA
) -> None:
    r = await start(tls="starttls")
    c = await r.connect(ehlo=None)
    lines = await ehlo(c)
    assert lines == [*PLAIN_EHLO[:4], "250-STARTTLS", *PLAIN_EHLO[4:]]
    # not required: MAIL before STARTTLS is fine (and RSET before the upgrade)
    assert await c.cmd("MAIL FROM:<app@example.com>") == (250, "250 2.1.0 OK")
    assert (await c.cmd("RSET"))[0] == 250
    await starttls(c, ca)
    assert await ehlo(c) == PLAIN_EHLO  # not offered again over TLS
    qid = qid_of(await c.send("app@example.com", ["a@example.org"], MSG))
    assert f"\tby relay.test (relay) with ESMTPS id {qid}".encode() in r.body(qid)


async def test_require_tls_refuses_mail_before_starttls_with_530(
    start: Start, ca: trustme.CA
) -> None:
    r = await start(tls="starttls", require_tls=True)
    c = await r.connect()
    assert await c.cmd("MAIL FROM:<app@example.com>") == (
        530,
        "530 5.7.0 Must issue a STARTTLS command first",
    )
    await starttls(c, ca)
    assert await ehlo(c) == PLAIN_EHLO
    assert await c.cmd("MAIL FROM:<app@example.com>") == (250, "250 2.1.0 OK")


async def test_an_implicit_tls_listener_offers_no_starttls_and_auth_at_once(
    start: Start, ca: trustme.CA
) -> None:
    # require_tls is met from the first byte; AUTH needs no STARTTLS (and no allow_plaintext)
    r = await start(tls="implicit", require_tls=True, with_auth=True)
    c = await connect_tls(r, ca)
    assert await ehlo(c) == [*PLAIN_EHLO[:4], "250-AUTH LOGIN PLAIN", *PLAIN_EHLO[4:]]
    assert await c.cmd("STARTTLS") == (454, "454 4.7.0 TLS not available")
    assert await c.cmd("MAIL FROM:<app@example.com>") == (250, "250 2.1.0 OK")
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    qid = qid_of(await c.data(MSG))
    assert f"\tby relay.test (relay) with ESMTPS id {qid}".encode() in r.body(qid)


async def test_auth_is_listed_once_by_aiosmtpd_on_a_listener_with_auth(start: Start) -> None:
    r = await start(with_auth=True, allow_plaintext=True)
    c = await r.connect(ehlo=None)
    assert await ehlo(c) == [*PLAIN_EHLO[:4], "250-AUTH LOGIN PLAIN", *PLAIN_EHLO[4:]]


async def test_an_idle_session_is_closed_after_the_session_timeout(start: Start) -> None:
    # aiosmtpd's own timer (limits.session_timeout) closes without a reply; the command
    # timeout (relay/inbound/session_watch.py, 421 4.4.2) is far away here
    r = await start({"limits": {"session_timeout": "0.5s", "command_timeout": "60s"}})
    c = await r.connect(ehlo=None)
    assert await asyncio.wait_for(c.reader.read(), WAIT) == b""  # no 421: aiosmtpd's close


async def test_the_guard_counts_connections_into_the_stats_metrics(start: Start) -> None:
    metrics = Metrics()
    r = await start(stats=InboundStats(metrics=metrics))
    c = await r.connect()
    assert metrics.registry.get_sample_value("relay_connections_open") == 1
    assert (await c.cmd("NOOP"))[0] == 250


# --- a failed STARTTLS handshake ---------------------------------------------------------------


async def test_a_failed_starttls_handshake_is_logged_with_its_cause(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start(tls="starttls")
    c = await r.connect()
    assert await c.cmd("STARTTLS") == (220, "220 Ready to start TLS")
    c.writer.write(b"GET / HTTP/1.0\r\n\r\n")  # not a TLS ClientHello
    await c.writer.drain()
    assert await asyncio.wait_for(c.reader.read(), WAIT) == b""  # closed, no reply
    deadline = time.monotonic() + WAIT
    while not logged(caplog, "tls_failed"):
        assert time.monotonic() < deadline, "no tls_failed event"
        await asyncio.sleep(0.01)
    [(level, msg, fields)] = logged(caplog, "tls_failed")
    assert (level, msg) == ("WARNING", "STARTTLS handshake failed")
    assert set(fields) == {"listener", "error"} and fields["listener"] == LISTENER
    assert re.fullmatch(r"SSLError: \[SSL: [A-Z_]+\] .+", str(fields["error"])), fields


async def test_a_tls_setup_failure_without_a_cause_is_logged_as_handshake(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start(tls="starttls")
    reply = await r.handler.handle_exception(TLSSetupException())
    assert reply == "454 4.7.0 TLS not available due to temporary reason"
    assert logged(caplog, "tls_failed") == [
        ("WARNING", "STARTTLS handshake failed", {"listener": LISTENER, "error": "handshake"})
    ]


# --- MAIL and RCPT: the hooks' own checks ------------------------------------------------------


async def test_the_rcpt_hook_refuses_what_is_not_a_mailbox(start: Start) -> None:
    """relay/mail/address.py refuses these paths before the hook; the hook checks again."""
    r = await start()
    h = r.handler
    s = session_from(("127.0.0.1", 5000))
    env = Envelope()
    env.mail_from = "app@example.com"
    for bad in ("a@-bad-.org", "@example.org", "a\udcff@example.org", "a@", "example.org"):
        assert await h.handle_RCPT(h.protocol(), s, env, bad, []) == BAD_RCPT, bad
    assert env.rcpt_tos == []
    assert h.stats.by_reason == {"bad_address": 5} and h.stats.rejected == 5
    assert await h.handle_RCPT(h.protocol(), s, env, "a@example.org", []) == "250 2.1.5 OK"
    assert env.rcpt_tos == ["a@example.org"]


async def test_the_mail_hook_refuses_what_is_not_a_mailbox(start: Start) -> None:
    r = await start()
    h = r.handler
    s = session_from(("127.0.0.1", 5000))
    for bad in ("a@-bad-.org", "@example.com", "a\udcff@example.com", "a@", "example.com"):
        env = Envelope()
        assert await h.handle_MAIL(h.protocol(), s, env, bad, []) == BAD_SENDER, bad
        assert env.mail_from is None
    env = Envelope()
    assert await h.handle_MAIL(h.protocol(), s, env, "a@example.com", ["BODY=8BITMIME"]) == (
        "250 2.1.0 OK"
    )
    assert (env.mail_from, env.mail_options) == ("a@example.com", ["BODY=8BITMIME"])


async def test_a_sender_with_an_at_in_its_quoted_local_part(start: Start) -> None:
    r = await start()
    c = await r.connect()
    assert await c.cmd('MAIL FROM:<"a@b"@Example.COM>') == (250, "250 2.1.0 OK")
    assert (await c.cmd("RCPT TO:<x@example.org>"))[0] == 250
    qid = qid_of(await c.data(MSG))
    [row] = r.messages()
    assert (row[0], row[2], row[7]) == (qid, '"a@b"@Example.COM', "example.com")


async def test_a_recipient_given_twice_in_any_case_is_taken_once(start: Start) -> None:
    r = await start()
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert await c.cmd("RCPT TO:<a@example.org>") == (250, "250 2.1.5 OK")
    assert await c.cmd("RCPT TO:<A@Example.ORG>") == (250, "250 2.1.5 OK")
    assert await c.cmd("RCPT TO:<a@example.org>") == (250, "250 2.1.5 OK")
    qid = qid_of(await c.data(MSG))
    assert [(x[0], x[1]) for x in r.recipients()] == [(qid, "a@example.org")]
    assert b"\tfor <a@example.org>; " in r.body(qid)  # one recipient


async def test_the_feedback_address_given_twice_is_taken_once(start: Start) -> None:
    r = await start(feedback=True)
    c = await r.connect()
    content = b"From: d@example.net\r\nSubject: hi\r\nMessage-ID: <f@example.net>\r\n\r\nnote\r\n"
    assert (await c.cmd("MAIL FROM:<d@example.net>"))[0] == 250
    for rcpt in (BOUNCES, "Bounces@Relay.TEST", BOUNCES):
        assert await c.cmd(f"RCPT TO:<{rcpt}>") == (250, "250 2.1.5 OK (feedback address)")
    assert await c.data(content) == FEEDBACK_OK
    assert r.rows("SELECT sender, rcpt, body FROM feedback_mail") == [
        ("d@example.net", BOUNCES, content)
    ]


async def test_a_long_suppression_reason_is_cut_at_200_characters(start: Start) -> None:
    supp = Suppressions()
    supp.add_local("gone@example.org", "r" * 199 + "st" + "x" * 50, 1_700_000_000.0)
    r = await start(suppressions=supp)
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert await c.cmd("RCPT TO:<gone@example.org>") == (
        550,
        "550 5.1.1 Recipient is suppressed since 2023-11-14T22:13:20Z: " + "r" * 199 + "s",
    )


async def test_an_alias_with_a_suppressed_first_target_takes_the_others(start: Start) -> None:
    supp = Suppressions()
    supp.add_local("gone@example.org", "bounced", 1_700_000_000.0)
    r = await start(
        {
            "local": {
                "domain": "corp.test",
                "aliases": {"team": ["gone@example.org", "ops@example.org", "dev@example.org"]},
            }
        },
        suppressions=supp,
    )
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert await c.cmd("RCPT TO:<team@corp.test>") == (
        250,
        "250 2.1.5 OK (alias: 3 recipients)",
    )
    qid = qid_of(await c.data(MSG))
    assert [(x[0], x[1]) for x in r.recipients()] == [
        (qid, "ops@example.org"),
        (qid, "dev@example.org"),
    ]
    assert r.handler.stats.by_reason == {"suppressed": 1}


# --- DATA ---------------------------------------------------------------------------------------


async def test_two_data_ends_in_flight_at_once_are_both_counted(start: Start) -> None:
    r = await start()
    hold = threading.Event()
    # the spool writer runs one job at a time: this one holds it until the test lets go
    blocker = asyncio.ensure_future(r.writer.run(lambda conn: hold.wait(WAIT)))
    clients = [await r.connect(), await r.connect()]
    try:
        for n, c in enumerate(clients):
            assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
            assert (await c.cmd(f"RCPT TO:<r{n}@example.org>"))[0] == 250
            assert (await c.cmd("DATA"))[0] == 354
            c.writer.write(message(f"<inflight{n}@app.example>") + b".\r\n")
            await c.writer.drain()
        deadline = time.monotonic() + WAIT
        while r.handler.in_flight != 2:
            assert time.monotonic() < deadline, f"in flight: {r.handler.in_flight}"
            await asyncio.sleep(0.01)
    finally:
        hold.set()
    assert await blocker is True
    for c in clients:
        qid_of((await c.reply())[1])
    assert r.handler.in_flight == 0
    assert len(r.messages()) == 2


async def test_feedback_mail_spooled_to_a_file_is_kept_whole(start: Start) -> None:
    r = await start({"spool": {"inline_max": "1KiB"}}, feedback=True)
    content = (
        b"From: d@example.net\r\nSubject: big\r\nMessage-ID: <big@example.net>\r\n\r\n"
        + (b"z" * 70 + b"\r\n") * 40
    )
    c = await r.connect()
    assert await c.send("d@example.net", [BOUNCES], content) == FEEDBACK_OK
    assert r.rows("SELECT rcpt, size, body FROM feedback_mail") == [
        (BOUNCES, len(content), content)
    ]


async def test_a_peer_that_is_not_a_host_port_pair_is_stored_as_it_is(tmp_path: Path) -> None:
    """aiosmtpd's peer is the transport's peername: (host, port, ...) for TCP, a string
    (a socket path, or '') for a UNIX socket."""
    base: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(tmp_path / "s")}}
    config = from_mapping(base, tmp_path)
    writer = SpoolWriter(config.spool_path)
    writer.start()
    h = InboundHandler(config, config.listen[0], writer, Suppressions())
    try:
        for n, peer in enumerate(("/run/app.sock", "")):
            incoming = IncomingBody(config.spool_path, config.inline_max)
            await incoming.add(message(f"<peer{n}@app.example>"))
            s = session_from(peer)
            s.host_name = "client.test"
            env = Envelope()
            env.mail_from = "app@example.com"
            env.rcpt_tos = ["a@example.org"]
            qid_of(await h.accept_stream(s, env, incoming, 0))
        r = Relay(config, config.spool_path, writer, h, 0)
        assert [m[5] for m in r.messages()] == ["/run/app.sock", ""]
    finally:
        h.guard.close()
        writer.close()


# --- AUTH: an over-long exchange line ---------------------------------------------------------


async def test_an_auth_line_over_twice_the_line_limit_is_read_to_its_end(start: Start) -> None:
    r = await start(with_auth=True, allow_plaintext=True)
    c = await r.connect()
    assert (await c.cmd("AUTH LOGIN"))[0] == 334
    c.writer.write(b"A" * 300_000 + b"\r\n")  # the reader's limit is 65537: five overruns
    assert await c.reply() == (500, "500 5.5.6 Authentication exchange line is too long")
    assert await c.cmd("NOOP") == (250, "250 2.0.0 OK")


# --- the peer check ----------------------------------------------------------------------------


async def test_a_peer_given_as_a_string_is_checked_as_an_address(start: Start) -> None:
    r = await start({"listen": [{"address": LISTENER, "allow": ["10.1.0.0/16"]}]})
    assert r.handler.peer_allowed(session_from("10.1.2.3"))
    assert not r.handler.peer_allowed(session_from("10.2.0.1"))
    assert not r.handler.peer_allowed(session_from("/run/app.sock"))


# --- after the first pass of triage (tests/MUTANTS.md) -------------------------------------------


async def test_any_other_hook_error_is_logged_with_its_type_and_answered_451(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception in a hook that is not a failed handshake: a temporary 451 (never
    aiosmtpd's permanent 500, so the client retries) and one ERROR line naming it."""
    r = await start()
    with caplog.at_level(logging.ERROR, logger="relay.inbound"):
        reply = await r.handler.handle_exception(RuntimeError("boom"))
    assert reply == "451 4.3.0 Internal error; message not accepted, try again later"
    assert [(x.levelname, x.getMessage()) for x in caplog.records if x.name == "relay.inbound"] == [
        ("ERROR", "inbound session error: RuntimeError: boom")
    ]


async def test_a_suppression_for_the_null_senders_identity_binds_bounces_only(
    start: Start,
) -> None:
    """The sending identity of `MAIL FROM:<>` is `<>`: an entry scoped to it refuses the
    recipient of a null-sender message, and not that of another sender."""
    supp = Suppressions()
    supp.add_local("x@example.org", "no bounces here", 1_700_000_000.0, scope="<>")
    r = await start(suppressions=supp)
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<>"))[0] == 250
    assert await c.cmd("RCPT TO:<x@example.org>") == (
        550,
        "550 5.1.1 Recipient is suppressed since 2023-11-14T22:13:20Z: no bounces here",
    )
    assert (await c.cmd("RSET"))[0] == 250
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<x@example.org>"))[0] == 250


async def test_a_client_that_half_closes_still_gets_its_replies(start: Start) -> None:
    """A client that sends its last command and shuts its side (EOF) still reads the reply:
    the connection stays half-open until the command loop has answered (aiosmtpd's
    eof_received, which the relay's wraps)."""
    r = await start()
    c = await r.connect()
    c.writer.write(b"NOOP\r\n")
    c.writer.write_eof()
    assert await asyncio.wait_for(c.reader.read(), WAIT) == b"250 2.0.0 OK\r\n"


async def test_the_ehlo_reply_follows_the_listeners_auth(tmp_path: Path) -> None:
    """handle_EHLO's reply, session after session, per the core's lines and whether the
    connection's listener (as it was when it began: a SIGHUP may add `auth`) has AUTH."""
    config = from_mapping({"hostname": "relay.test", "spool": {"path": str(tmp_path)}}, tmp_path)
    h = InboundHandler(config, config.listen[0], None, Suppressions())  # type: ignore[arg-type]

    class Server:
        def __init__(self, auth: object) -> None:
            self.relay_listener = type("L", (), {"auth": auth})()

    offered = ["250-relay.test", "250-AUTH LOGIN PLAIN", "250 HELP"]
    for _ in range(2):  # the same again
        for listener_auth, expected in (
            (None, ["250-relay.test", "250-PIPELINING", "250-ENHANCEDSTATUSCODES", "250 HELP"]),
            (object(), [*offered[:2], "250-PIPELINING", "250-ENHANCEDSTATUSCODES", "250 HELP"]),
        ):
            session = Session()
            got = await h.handle_EHLO(
                Server(listener_auth),  # type: ignore[arg-type]
                session,
                Envelope(),
                "c.test",
                list(offered),
            )
            assert got == expected and session.host_name == "c.test"
            got.append("changed")  # the caller's own list: the next reply is as before
    h.guard.close()
