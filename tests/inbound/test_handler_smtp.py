"""The protocol class (`InboundProtocol`), in the test process where mutation testing sees it
(tests/MUTANTS.md): what the survivors of the inbound.py run showed untested. The DATA line
limit with its transparent dot; implicit TLS (a session over TLS from the first byte, and a
refused client whose EOF arrives while the 421 closes it); a plain session leaving no error in
the event loop; the log events an operator reads (a refused connection, a bare newline, a
session we closed with 421: reason, peer, listener) and the metric counting the closes; the
421 texts of the timers; a session that stops at its 421 even while replies wait to be sent
(a client that does not read) and gets no second 421; AUTH answers that are not strict
base64; a quoted bare local part holding an `@`."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from relay.config.tree import from_mapping
from relay.inbound import auth
from relay.inbound.handler import InboundHandler, InboundStats, Suppressions
from relay.inbound.tls_listener import implicit_context
from relay.ops.metrics import Metrics
from relay.spool.writer import SpoolWriter
from tests.harness import deep_merge
from tests.inbound.test_inprocess import (
    QUEUED,
    WAIT,
    Client,
    Relay,
    message,
    serve,
    shut_down,
)

LISTENER = "127.0.0.1:2525"  # the listener's name (its configured address)
LINE_TOO_LONG = "500 5.5.2 Line too long (see RFC 5321 4.5.3.1.6)"
BARE_NEWLINE = "500 5.5.2 Syntax error: bare CR or LF in command line (RFC 5321 2.3.8)"


class Started(Relay):
    """The harness's Relay, with the metrics its guard and stats count in."""

    metrics: Metrics


Start = Callable[..., Awaitable[Started]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """As tests/inbound/test_inprocess.py's, with real Metrics under the stats and the guard
    (relay_sessions_closed_total), an optional gate, and an implicit-TLS listener served with
    the daemon's context (relay/inbound/tls_listener.py) when the listener has TLS. `sndbuf`: a
    small kernel send buffer for the connections, so that replies a client does not read
    stay in the transport's buffer."""
    made: list[tuple[Started, asyncio.AbstractServer]] = []

    async def factory(
        cfg: dict[str, Any] | None = None,
        *,
        gate: Callable[[], str | None] = lambda: None,
        sndbuf: int | None = None,
    ) -> Started:
        spool = tmp_path / f"spool{len(made)}"
        base: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(spool)}}
        config = from_mapping(deep_merge(base, cfg or {}), tmp_path)
        writer = SpoolWriter(config.spool_path)
        writer.start()
        metrics = Metrics()
        queued: list[int] = []
        lst = config.listen[0]
        handler = InboundHandler(
            config,
            lst,
            writer,
            Suppressions(),
            on_queued=lambda: queued.append(1),
            stats=InboundStats(metrics=metrics),
            gate=gate,
        )
        tls = lst.tls
        context = implicit_context(tls, lambda: tls) if tls is not None else None
        server, port = await serve(handler, context, sndbuf)
        relay = Started(config, config.spool_path, writer, handler, port, queued)
        relay.metrics = metrics
        made.append((relay, server))
        return relay

    yield factory
    await shut_down(made)


def logged(
    caplog: pytest.LogCaptureFixture, event: str, logger: str
) -> list[tuple[str, str, dict[str, Any]]]:
    """(level, message text, fields) of each `event` logged by `logger`."""
    return [
        (r.levelname, r.getMessage(), dict(getattr(r, "fields", {})))
        for r in caplog.records
        if r.name == logger and getattr(r, "event", "") == event
    ]


def loop_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the event loop's exception handler logged (an exception in a protocol callback,
    such as connection_made, is logged there and otherwise swallowed)."""
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def closed_count(r: Started, reason: str) -> float | None:
    return r.metrics.registry.get_sample_value("relay_sessions_closed_total", {"reason": reason})


async def eof(c: Client) -> bytes:
    """Everything the server still sends, up to its close (within WAIT)."""
    return await asyncio.wait_for(c.reader.read(), WAIT)


def session_closed(reason: str) -> tuple[str, str, dict[str, Any]]:
    return (
        "WARNING",
        "client disconnected with 421",
        {"reason": reason, "peer": "127.0.0.1", "listener": LISTENER, "closed_unlogged": 0},
    )


# --- DATA: the line limit and its transparent dot ------------------------------------------


async def test_a_data_line_at_the_limit_is_kept_with_its_transparent_dot(start: Start) -> None:
    """`limits.max_line_length` counts the CRLF; a line of that length that starts with a dot
    arrives one octet longer (RFC 5321 §4.5.2) and is still accepted. One more is refused."""
    r = await start({"limits": {"max_line_length": 200}})
    c = await r.connect()
    at_limit = b"." + b"d" * 197  # 198 octets + CRLF = 200; on the wire: 201
    text = await c.send("app@example.com", ["a@example.org"], message(body=at_limit + b"\r\n"))
    m = QUEUED.match(text)
    assert m, text
    assert r.body(m.group(1)).endswith(b"\r\n\r\n" + at_limit + b"\r\n")
    over = b"." + b"d" * 198  # 199 octets + CRLF = 201; on the wire: 202
    text = await c.send("app@example.com", ["a@example.org"], message(body=over + b"\r\n"))
    assert text == LINE_TOO_LONG
    assert len(r.messages()) == 1


# --- connection_made: the refusal's log, a connection gone before it was accepted, TLS -------


async def test_a_refused_connection_is_logged_with_its_listener(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start({"limits": {"max_connections_per_ip_allowed": 1}})
    await r.connect()
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    try:
        assert await asyncio.wait_for(reader.read(), WAIT) == (
            b"421 4.7.0 too many connections from your address, try again later\r\n"
        )
    finally:
        writer.close()
    assert logged(caplog, "connection_limit", "relay.inbound.guard") == [
        (
            "WARNING",
            "connection refused",
            {
                "reason": "per_ip",
                "peer": "127.0.0.1",
                "listener": LISTENER,
                "open_total": 1,
                "open_from_peer": 1,
                "refused_unlogged": 0,
            },
        )
    ]


async def test_a_plain_session_raises_nothing_in_the_event_loop(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """On a listener without TLS, connection_made has no TLS to look at (an exception there
    would only be logged by the loop, the session going on as if nothing happened)."""
    r = await start()
    c = await r.connect()
    assert await c.cmd("NOOP") == (250, "250 2.0.0 OK")
    assert await c.cmd("QUIT") == (221, "221 2.0.0 Bye")
    assert await eof(c) == b""
    assert loop_errors(caplog) == []
    assert r.handler.stats.sessions == 1


def _implicit(tmp_path: Path) -> tuple[ssl.SSLContext, dict[str, Any]]:
    """A client context and an implicit-TLS listener's `tls`, from a throwaway CA."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx, {"cert_file": "cert.pem", "key_file": "key.pem", "mode": "implicit"}


async def test_an_implicit_tls_session_is_over_tls_from_the_first_byte(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctx, tls = _implicit(tmp_path)
    r = await start({"listen": [{"address": LISTENER, "tls": tls}]})
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", r.port, ssl=ctx, server_hostname="127.0.0.1"), WAIT
    )
    c = Client(reader, writer)
    r.clients.append(c)
    assert await c.reply() == (220, "220 relay.test relay ESMTP")
    code, text = await c.cmd("EHLO client.test")
    assert code == 250 and "STARTTLS" not in text, text
    text = await c.send("app@example.com", ["a@example.org"], message())
    m = QUEUED.match(text)
    assert m, text
    stored = r.body(m.group(1))
    assert f"\tby relay.test (relay) with ESMTPS id {m.group(1)}".encode() in stored
    assert loop_errors(caplog) == []


# --- the 421s we send, and the sessions they close -------------------------------------------


async def test_an_idle_client_is_closed_and_the_close_is_logged_and_counted(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start({"limits": {"command_timeout": "0.2s"}})
    c = await r.connect()
    assert await eof(c) == (
        b"421 4.4.2 relay.test timeout waiting for a command, closing connection\r\n"
    )
    assert logged(caplog, "session_closed", "relay.inbound.guard") == [
        session_closed("command_timeout")
    ]
    assert closed_count(r, "command_timeout") == 1


async def test_a_client_too_slow_in_data_gets_its_own_421(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start({"limits": {"min_data_rate": 1000, "min_data_rate_window": "0.3s"}})
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    assert (await c.cmd("DATA"))[0] == 354
    c.writer.write(b"Subject: slow\r\n")  # then nothing
    assert await eof(c) == b"421 4.4.2 relay.test data arriving too slowly, closing connection\r\n"
    assert logged(caplog, "session_closed", "relay.inbound.guard") == [session_closed("data_rate")]
    assert closed_count(r, "data_rate") == 1
    assert r.messages() == []


async def test_too_many_errors_close_with_their_reason(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start({"limits": {"max_errors": 2}})
    c = await r.connect()
    assert (await c.cmd("BOGUS"))[0] == 500
    assert (await c.cmd("BOGUS"))[0] == 500
    assert await eof(c) == b"421 4.7.0 relay.test too many errors, closing connection\r\n"
    assert logged(caplog, "session_closed", "relay.inbound.guard") == [session_closed("max_errors")]
    assert closed_count(r, "max_errors") == 1


async def test_any_other_421_closes_with_reason_421(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """Every 421 we send closes (RFC 5321 §3.8), here one from the gate at MAIL."""
    reply = "421 4.3.2 relay.test service not available, closing transmission channel"
    r = await start(gate=lambda: reply)
    c = await r.connect()
    assert await c.cmd("MAIL FROM:<app@example.com>") == (421, reply)
    assert await eof(c) == b""
    assert logged(caplog, "session_closed", "relay.inbound.guard") == [session_closed("421")]
    assert closed_count(r, "421") == 1
    assert closed_count(r, "auth_failures") is None


def _auth_listener(tmp_path: Path) -> dict[str, Any]:
    users = tmp_path / "users"
    users.write_text(f"alice:{auth.hash_password('right')}\n")
    return {
        "listen": [
            {
                "address": LISTENER,
                "auth": {"users_file": str(users), "allow_plaintext": True},
            }
        ],
        "auth": {"failure_delay": "0.01s", "max_failure_delay": "0.01s"},
    }


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


async def test_three_wrong_passwords_close_with_reason_auth_failures(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start(_auth_listener(tmp_path))
    c = await r.connect()
    wrong = "AUTH PLAIN " + _b64("\0alice\0wrong")
    assert (await c.cmd(wrong))[0] == 535
    assert (await c.cmd(wrong))[0] == 535
    assert await c.cmd(wrong) == (421, "421 4.7.0 too many authentication failures")
    assert await eof(c) == b""
    assert logged(caplog, "session_closed", "relay.inbound.guard") == [
        session_closed("auth_failures")
    ]
    assert closed_count(r, "auth_failures") == 1
    assert closed_count(r, "421") is None


# --- AUTH answers: strict base64 ----------------------------------------------------------


async def test_an_auth_answer_with_characters_outside_base64_is_refused(
    start: Start, tmp_path: Path
) -> None:
    """`YWxp!Y2U=` is `alice` once the `!` is dropped: a lenient decoder would take it."""
    r = await start(_auth_listener(tmp_path))
    c = await r.connect()
    assert await c.cmd("AUTH LOGIN") == (334, "334 VXNlciBOYW1lAA==")
    assert await c.cmd("YWxp!Y2U=") == (501, "501 5.5.2 Can't decode base64")
    assert await c.cmd("AUTH LOGIN") == (334, "334 VXNlciBOYW1lAA==")
    assert await c.cmd(_b64("alice")) == (334, "334 UGFzc3dvcmQA")
    assert await c.cmd(_b64("right")) == (235, "235 2.7.0 Authentication successful")


# --- MAIL: a quoted bare local part ------------------------------------------------------------


async def test_a_quoted_bare_local_part_with_an_at_sign_is_qualified(start: Start) -> None:
    """`<"a@b">` has no domain: the `@` is inside the quotes. It is qualified like `<root>`."""
    r = await start({"local": {"domain": "corp.test"}})
    c = await r.connect()
    text = await c.send('"a@b"', ["a@example.org"], message())
    assert QUEUED.match(text), text
    assert r.messages()[0][2] == '"a@b"@corp.test'


# --- a bare newline: the log line -----------------------------------------------------------


async def test_a_bare_newline_is_logged_with_peer_and_listener(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start()
    c = await r.connect()
    c.writer.write(b"NOOP\nNOOP\r\n")
    assert await eof(c) == BARE_NEWLINE.encode() + b"\r\n"
    assert logged(caplog, "bare_newline", "relay.inbound") == [
        (
            "WARNING",
            "bare CR or LF in a command line; connection closed",
            {"peer": "127.0.0.1", "listener": LISTENER},
        )
    ]
    assert r.handler.stats.by_reason == {"bare_newline": 1}


# --- a client that does not read: what happens while our replies wait in the buffer --------

HELP = b"250 2.0.0 Supported commands: AUTH DATA EHLO HELO HELP MAIL NOOP QUIT RCPT RSET VRFY\r\n"


async def slow_reader(r: Started) -> socket.socket:
    """A client socket with a small receive buffer that reads nothing until `read_all`: with
    the relay's small send buffer (`sndbuf`), a few kB of replies fill the kernel's buffers
    and the rest waits in the relay's transport."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", r.port)), WAIT)
    return s


async def read_all(s: socket.socket) -> bytes:
    """Everything the relay sends, up to its close."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    try:
        while chunk := await asyncio.wait_for(loop.sock_recv(s, 65536), WAIT):
            got += chunk
    finally:
        s.close()
    return bytes(got)


async def test_the_session_stops_at_a_421_while_replies_wait_to_be_sent(start: Start) -> None:
    """The 421 of `max_errors` closes the transport, which then waits for the replies before
    it to be sent; meanwhile the session must stop reading the commands already received
    (as aiosmtpd's QUIT does), not act on them one by one until the transport is gone:
    the 421 is the last reply, not even the command right after it is answered (RFC 5321
    §3.8)."""
    r = await start({"limits": {"max_errors": 2}}, sndbuf=4096)
    s = await slow_reader(r)
    pipeline = (
        b"EHLO client.test\r\n"
        + b"HELP\r\n" * 300  # ~27 kB of replies: more than the kernel's buffers hold
        + b"BOGUS\r\nBOGUS\r\n"
        + b"NOOP\r\n"
        + b"MAIL FROM:<not an address>\r\n"
    )
    await asyncio.get_running_loop().sock_sendall(s, pipeline)
    got = await read_all(s)
    assert got.count(HELP) == 300
    tail = got[got.rindex(HELP) + len(HELP) :]
    assert tail == (
        b'500 5.5.2 command "BOGUS" not recognized\r\n'
        b'500 5.5.2 command "BOGUS" not recognized\r\n'
        b"421 4.7.0 relay.test too many errors, closing connection\r\n"
    ), tail
    assert "bad_address" not in r.handler.stats.by_reason
    assert closed_count(r, "max_errors") == 1


async def test_a_closing_connection_gets_no_second_421_from_a_timer(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """After a 421 the transport waits for the replies before it to be sent; the command timer
    the last of those replies started still runs and must find the session closed already."""
    reply = "421 4.3.2 relay.test service not available, closing transmission channel"
    r = await start({"limits": {"command_timeout": "0.2s"}}, gate=lambda: reply, sndbuf=4096)
    s = await slow_reader(r)
    pipeline = b"EHLO client.test\r\n" + b"HELP\r\n" * 300 + b"MAIL FROM:<app@example.com>\r\n"
    await asyncio.get_running_loop().sock_sendall(s, pipeline)
    # the timer's time must pass before the client reads (no event to wait for: a timer that
    # finds the session closed leaves no trace)
    await asyncio.sleep(0.5)
    got = await read_all(s)
    assert got.count(HELP) == 300
    assert got.endswith(HELP + reply.encode() + b"\r\n"), got[-300:]
    assert closed_count(r, "421") == 1
    assert closed_count(r, "command_timeout") is None
    assert logged(caplog, "session_closed", "relay.inbound.guard") == [session_closed("421")]


async def test_an_implicit_tls_client_refused_and_gone_at_once_leaves_no_error(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over the connection limit on an implicit-TLS listener: the protocol sees the connection
    once the handshake is done, answers 421 and closes, before any session began. Here the
    client's last handshake message and its close_notify arrive together, so the EOF reaches
    the protocol during that close: it must be taken quietly (no session to end)."""
    ctx, tls = _implicit(tmp_path)
    r = await start(
        {
            "listen": [{"address": LISTENER, "tls": tls}],
            "limits": {"max_connections_per_ip_allowed": 1},
        }
    )
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", r.port, ssl=ctx, server_hostname="127.0.0.1"), WAIT
    )
    first = Client(reader, writer)
    r.clients.append(first)
    assert (await first.reply())[0] == 220
    loop = asyncio.get_running_loop()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    s = socket.socket()
    s.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", r.port)), WAIT)
        while True:
            try:
                tls_obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await loop.sock_sendall(s, outgoing.read())
                data = await asyncio.wait_for(loop.sock_recv(s, 65536), WAIT)
                assert data, "closed during the handshake"
                incoming.write(data)
        finished = outgoing.read()  # our side is done; the relay's is not until this arrives
        with pytest.raises(ssl.SSLWantReadError):
            tls_obj.unwrap()
        await loop.sock_sendall(s, finished + outgoing.read())  # Finished + close_notify
        got = bytearray()
        while chunk := await asyncio.wait_for(loop.sock_recv(s, 65536), WAIT):
            got += chunk
    finally:
        s.close()
    incoming.write(bytes(got))
    assert tls_obj.read(4096) == (
        b"421 4.7.0 too many connections from your address, try again later\r\n"
    )
    assert [e[2]["reason"] for e in logged(caplog, "connection_limit", "relay.inbound.guard")] == [
        "per_ip"
    ]
    assert loop_errors(caplog) == []
    assert r.handler.stats.sessions == 1
    assert await first.cmd("NOOP") == (250, "250 2.0.0 OK")
