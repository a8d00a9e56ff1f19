"""relay.delivery.transport.Connection in process, against the real scripted aiosmtpd
upstream of tests/harness.py: every step's phase, per-recipient verdicts, timeouts, the
ambiguous reply to the final dot, TLS policies and AUTH."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any
from unittest import mock

import pytest
import trustme
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.delivery import transport
from relay.delivery.replies import Outcome, Phase
from relay.delivery.transport import ConnectFailed, Connection, Timeouts, TlsPolicy
from tests.harness import Upstream, free_port, server_context

SENDER = "app@example.com"
BODY = b"From: app@example.com\r\nTo: user@example.org\r\nSubject: t\r\n\r\nhello\r\n"
PLAIN = TlsPolicy("none", False)
TIMEOUTS = Timeouts(connect=2.0, command=1.0, data=1.0)

MakeConn = Callable[..., Connection]


@pytest.fixture(params=[False, True], ids=["stepwise", "pipelined"])
def upstream(request: pytest.FixtureRequest, upstream: Callable[..., Upstream]) -> Any:
    """Every dialogue twice: an upstream without PIPELINING (one command at a time) and one
    with it (RFC 2920: MAIL, the RCPTs and DATA in one write); the outcomes are the same."""

    def make(**kwargs: Any) -> Upstream:
        kwargs.setdefault("pipelining", request.param)
        return upstream(**kwargs)

    return make


@pytest.fixture
async def conn_factory() -> AsyncIterator[MakeConn]:
    made: list[Connection] = []

    def make(
        up: Upstream | None = None,
        *,
        port: int | None = None,
        tls: TlsPolicy = PLAIN,
        host: str = "127.0.0.1",
        **kwargs: Any,
    ) -> Connection:
        c = Connection(
            host=host,
            address=up.host if up is not None else "127.0.0.1",
            port=port if port is not None else (up.port if up is not None else 0),
            helo="relay.test",
            tls=tls,
            timeouts=kwargs.pop("timeouts", TIMEOUTS),
            **kwargs,
        )
        made.append(c)
        return c

    yield make
    for c in made:
        await c.quit()
    if any(c.tls_active for c in made):
        # closing a TLS session is a close_notify exchange that completes on the event
        # loop; let it finish before the test's loop closes (else: unclosed socket warning)
        await asyncio.sleep(0.3)


# --- a plain session ----------------------------------------------------------------------


async def test_delivers_and_reuses_the_connection(upstream, conn_factory) -> None:
    up = upstream()
    c = conn_factory(up)
    await c.open()
    assert c.usable and not c.tls_active
    assert c.label == f"127.0.0.1[127.0.0.1]:{up.port}"

    res = await c.send(SENDER, ["a@example.org", "b@example.org"], BODY)
    assert not res.connection_failed
    assert set(res.results) == {"a@example.org", "b@example.org"}
    for r in res.results.values():
        assert r.verdict.outcome is Outcome.DELIVERED
        assert r.phase is Phase.DOT
        assert r.reply.code == 250 and not r.ambiguous
    res2 = await c.send(SENDER, ["c@example.org"], BODY.replace(b"hello", b"again"))
    assert res2.results["c@example.org"].verdict.outcome is Outcome.DELIVERED
    assert c.messages == 2 and c.usable
    got = up.wait_for(2)
    assert [m.rcpt_tos for m in got] == [["a@example.org", "b@example.org"], ["c@example.org"]]
    assert got[0].data == BODY and b"again" in got[1].data
    assert up.connections == 1


async def test_dot_stuffing_and_missing_final_crlf(upstream, conn_factory) -> None:
    up = upstream()
    c = conn_factory(up)
    await c.open()
    body = b"Subject: dots\r\n\r\n.leading dot\r\n..two\r\n.\r\nlast line without CRLF"
    res = await c.send(SENDER, ["a@example.org"], body)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].data == body + b"\r\n"


async def test_null_sender(upstream, conn_factory) -> None:
    up = upstream()
    c = conn_factory(up)
    await c.open()
    res = await c.send("", ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.commands[0] == "MAIL <>"  # aiosmtpd hands the hook "<>" for MAIL FROM:<>
    assert up.wait_for(1)[0].mail_from == "<>"


# --- replies per phase ----------------------------------------------------------------------


async def test_per_recipient_rcpt_replies(upstream, conn_factory) -> None:
    up = upstream()
    replies = {"bad@example.org": "550 5.1.1 no such user", "busy@example.org": "451 4.2.1 busy"}
    up.rcpt_reply = lambda a: replies.get(a)
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["ok@example.org", "bad@example.org", "busy@example.org"], BODY)
    ok, bad, busy = (
        res.results[a] for a in ("ok@example.org", "bad@example.org", "busy@example.org")
    )
    assert ok.verdict.outcome is Outcome.DELIVERED and ok.phase is Phase.DOT
    assert bad.verdict.outcome is Outcome.BOUNCE and bad.phase is Phase.RCPT
    assert str(bad.reply) == "550 5.1.1 no such user"
    assert busy.verdict.outcome is Outcome.TRANSIENT and busy.phase is Phase.RCPT
    assert not res.connection_failed
    assert [m.rcpt_tos for m in up.wait_for(1)] == [["ok@example.org"]]
    assert c.usable


async def test_all_recipients_refused_sends_no_data(upstream, conn_factory) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user"
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["x@example.org", "y@example.org"], BODY)
    assert {r.verdict.outcome for r in res.results.values()} == {Outcome.BOUNCE}
    # pipelined, DATA went in the group and was refused (503: no valid recipients)
    assert ("DATA" in up.commands) is up.pipelining
    assert up.received == []
    assert c.usable  # RSET, ready for the next transaction
    res = await c.send(SENDER, ["x@example.org"], BODY)
    assert res.results["x@example.org"].verdict.outcome is Outcome.BOUNCE


async def test_mail_from_refused_applies_to_every_recipient(upstream, conn_factory) -> None:
    up = upstream()
    up.mail_reply = lambda s: "553 5.1.7 bad sender"
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org", "b@example.org"], BODY)
    for r in res.results.values():
        assert r.phase is Phase.MAIL
        assert r.verdict.outcome is Outcome.FAIL  # the sender, never the recipients' fault
    assert not any(cmd.startswith("RCPT") for cmd in up.commands)
    assert c.usable


async def test_transient_mail_reply_then_the_next_transaction(upstream, conn_factory) -> None:
    up = upstream()
    up.mail_reply = lambda s: "451 4.3.0 try later" if s == "busy@example.com" else None
    c = conn_factory(up)
    await c.open()
    res = await c.send("busy@example.com", ["a@example.org", "b@example.org"], BODY)
    for r in res.results.values():
        assert r.phase is Phase.MAIL and r.verdict.outcome is Outcome.TRANSIENT
        assert str(r.reply) == "451 4.3.0 try later"
    assert not res.connection_failed and c.usable
    assert not any(cmd.startswith("RCPT") for cmd in up.commands)  # 503 need MAIL, if sent
    # the replies to the rest of the group were read: the next transaction is in step
    res = await c.send(SENDER, ["c@example.org"], BODY)
    assert res.results["c@example.org"].verdict.outcome is Outcome.DELIVERED
    assert [m.rcpt_tos for m in up.wait_for(1)] == [["c@example.org"]]
    assert up.connections == 1


async def test_refused_rcpt_then_the_next_transaction(upstream, conn_factory) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("bad") else None
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["bad@example.org", "ok@example.org", "bad2@example.org"], BODY)
    assert {a: (r.phase, r.verdict.outcome) for a, r in res.results.items()} == {
        "bad@example.org": (Phase.RCPT, Outcome.BOUNCE),
        "ok@example.org": (Phase.DOT, Outcome.DELIVERED),
        "bad2@example.org": (Phase.RCPT, Outcome.BOUNCE),
    }
    res = await c.send(SENDER, ["bad@example.org"], BODY)
    assert res.results["bad@example.org"].verdict.outcome is Outcome.BOUNCE
    res = await c.send(SENDER, ["ok2@example.org"], BODY)
    assert res.results["ok2@example.org"].verdict.outcome is Outcome.DELIVERED
    assert [m.rcpt_tos for m in up.wait_for(2)] == [["ok@example.org"], ["ok2@example.org"]]
    assert c.messages == 2 and up.connections == 1


async def test_pipelined_group_is_one_write(upstream, conn_factory) -> None:
    """RFC 2920: with PIPELINING offered, MAIL, the RCPTs and DATA go in one write; without
    it, one command at a time."""
    up = upstream()
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org", "b@example.org"], BODY)
    assert {r.verdict.outcome for r in res.results.values()} == {Outcome.DELIVERED}
    group = (
        b"MAIL FROM:<app@example.com> SIZE=%d\r\n" % len(BODY)
        + b"RCPT TO:<a@example.org>\r\nRCPT TO:<b@example.org>\r\nDATA\r\n"
    )
    if up.pipelining:
        assert group in up.chunks
    else:
        assert not any(b"MAIL" in chunk and b"RCPT" in chunk for chunk in up.chunks)
        assert b"MAIL FROM:<app@example.com> SIZE=%d\r\n" % len(BODY) in up.chunks
    assert up.chunks[-1] == BODY + b".\r\n"  # the body and the final dot: one write too


async def test_pipelined_354_without_recipients_gets_a_lone_dot(conn_factory) -> None:
    """RFC 2920 §3.1: a server that says 354 to a pipelined DATA though it refused every
    RCPT gets a lone "." (the client must send one), then RSET; the outcome is the RCPT's."""
    seen: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"220 raw.test\r\n")
        while line := await r.readline():
            seen.append(line)
            verb = line[:4].upper()
            if verb == b"EHLO":
                w.write(b"250-raw.test\r\n250 PIPELINING\r\n")
            elif verb in (b"MAIL", b"RSET"):
                w.write(b"250 2.0.0 ok\r\n")
            elif verb == b"RCPT":
                w.write(b"550 5.1.1 no such user\r\n")
            elif verb == b"DATA":
                w.write(b"354 go ahead\r\n")
            elif line == b".\r\n":
                w.write(b"554 5.5.1 no valid recipients\r\n")
            else:
                w.write(b"221 2.0.0 bye\r\n")
                break
            await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        c = conn_factory(port=server.sockets[0].getsockname()[1])
        await c.open()
        for _ in range(2):
            res = await c.send(SENDER, ["x@example.org"], BODY)
            r = res.results["x@example.org"]
            assert r.phase is Phase.RCPT and r.verdict.outcome is Outcome.BOUNCE
            assert str(r.reply) == "550 5.1.1 no such user"
            assert not res.connection_failed and c.usable
        assert seen[1:] == 2 * [
            b"MAIL FROM:<app@example.com>\r\n",
            b"RCPT TO:<x@example.org>\r\n",
            b"DATA\r\n",
            b".\r\n",
            b"RSET\r\n",
        ]
        await c.quit()
    finally:
        server.close()
        await server.wait_closed()


async def test_421_to_rcpt_defers_the_rest_and_closes(upstream, conn_factory) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "421 4.3.2 shutting down" if a == "b@example.org" else None
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org", "b@example.org", "c@example.org"], BODY)
    assert {a: r.verdict.outcome for a, r in res.results.items()} == {
        "a@example.org": Outcome.TRANSIENT,
        "b@example.org": Outcome.TRANSIENT,
        "c@example.org": Outcome.TRANSIENT,
    }
    assert not c.usable
    assert up.received == []


async def test_permanent_reply_to_dot_fails(upstream, conn_factory) -> None:
    up = upstream()
    up.data_reply = lambda env: "554 5.7.1 rejected as spam"
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org"], BODY)
    r = res.results["a@example.org"]
    assert r.phase is Phase.DOT and r.verdict.outcome is Outcome.FAIL and not r.ambiguous
    assert str(r.reply) == "554 5.7.1 rejected as spam"
    assert c.usable  # RSET after a refused message


# --- timeouts, lost connections, ambiguity -----------------------------------------------


async def test_rcpt_stall_is_a_command_timeout_not_ambiguous(upstream, conn_factory) -> None:
    up = upstream(stall={"rcpt": 30.0})
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org"], BODY)
    r = res.results["a@example.org"]
    assert r.phase is Phase.RCPT
    assert r.verdict.outcome is Outcome.TRANSIENT
    assert not r.ambiguous
    assert r.reply.code == 451 and "timeout" in r.reply.text
    assert res.connection_failed and not c.usable
    assert res.duration < 15  # bounded by the 1 s command timeout, not by the 30 s stall


async def test_stall_after_dot_is_ambiguous(upstream, conn_factory) -> None:
    up = upstream(stall={"data": 3.0})
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org", "b@example.org"], BODY)
    for r in res.results.values():
        assert r.phase is Phase.DOT
        assert r.ambiguous
        assert r.verdict.outcome is Outcome.TRANSIENT  # retried by default: at-least-once
        assert r.reply.code == 451 and "timeout" in r.reply.text
    assert res.connection_failed and not c.usable


async def test_disconnect_after_dot_is_ambiguous(upstream, conn_factory) -> None:
    up = upstream(disconnect_after_dot=True)
    c = conn_factory(up)
    await c.open()
    res = await c.send(SENDER, ["a@example.org"], BODY)
    r = res.results["a@example.org"]
    assert r.phase is Phase.DOT and r.ambiguous
    assert r.verdict.outcome is Outcome.TRANSIENT
    assert "connection lost" in r.reply.text
    assert len(up.wait_for(1)) == 1  # it did arrive: exactly the ambiguous case


class DataRefusingUpstream(Upstream):
    """Answers the DATA command itself (not the final dot) with `data_command_reply`."""

    data_command_reply = "451 4.3.0 no DATA now"

    def _protocol(self) -> Any:
        proto = super()._protocol()

        async def smtp_DATA(arg: str) -> None:
            await proto.push(self.data_command_reply)

        proto._smtp_methods["DATA"] = smtp_DATA  # aiosmtpd dispatches through this table
        return proto


@pytest.mark.parametrize("pipelining", [False, True], ids=["stepwise", "pipelined"])
@pytest.mark.parametrize(
    ("reply", "outcome"),
    [("451 4.3.0 no DATA now", Outcome.TRANSIENT), ("554 5.5.1 no DATA", Outcome.FAIL)],
)
async def test_data_command_refused_is_not_ambiguous(
    conn_factory, pipelining: bool, reply: str, outcome: Outcome
) -> None:
    up = DataRefusingUpstream(pipelining=pipelining)
    up.data_command_reply = reply
    up.start()
    try:
        c = conn_factory(up)
        await c.open()
        res = await c.send(SENDER, ["a@example.org", "b@example.org"], BODY)
        for r in res.results.values():
            assert r.phase is Phase.DATA and not r.ambiguous
            assert r.verdict.outcome is outcome and str(r.reply) == reply
        assert up.received == []
        assert not res.connection_failed and c.usable  # RSET: in step for the next one
        res = await c.send(SENDER, ["c@example.org"], BODY)
        assert res.results["c@example.org"].phase is Phase.DATA
        assert c.messages == 2
        await c.quit()
    finally:
        up.stop()


# --- opening a connection ---------------------------------------------------------------


async def test_connection_refused(conn_factory) -> None:
    c = conn_factory(port=free_port())
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    e = info.value
    assert e.verdict.outcome is Outcome.TRANSIENT
    assert str(e.reply).startswith("421 4.4.1") and "refused" in e.reply.text
    assert not e.operator_fault
    assert not c.usable


async def test_connect_timeout(conn_factory) -> None:
    # a listening socket that never accepts nor greets: the greeting never comes
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        c = conn_factory(
            port=srv.getsockname()[1], timeouts=Timeouts(connect=0.5, command=0.5, data=0.5)
        )
        with pytest.raises(ConnectFailed) as info:
            await c.open()
    assert info.value.verdict.outcome is Outcome.TRANSIENT
    assert info.value.reply.code in (421, 451)
    assert "timeout" in info.value.reply.text


async def test_421_greeting(upstream, conn_factory) -> None:
    up = upstream(connect_reply="421 4.3.2 busy")
    c = conn_factory(up)
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    assert info.value.verdict.outcome is Outcome.TRANSIENT
    assert info.value.reply.code == 421
    assert not info.value.operator_fault


async def test_554_greeting_is_permanent(upstream, conn_factory) -> None:
    up = upstream(connect_reply="554 5.7.1 no service for you")
    c = conn_factory(up)
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    assert info.value.verdict.outcome is Outcome.FAIL
    assert info.value.reply.code == 554


# --- TLS ----------------------------------------------------------------------------------


async def test_starttls_verified(upstream, conn_factory, ca, ca_file) -> None:
    up = upstream(tls_context=server_context(ca), require_starttls=True)
    c = conn_factory(up, tls=TlsPolicy("starttls", True, ca_file))
    await c.open()
    assert c.tls_active
    res = await c.send(SENDER, ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].tls is True


async def test_starttls_untrusted_certificate_is_operator_fault(
    upstream, conn_factory, ca_file
) -> None:
    up = upstream(tls_context=server_context(trustme.CA()))
    c = conn_factory(up, tls=TlsPolicy("starttls", True, ca_file))
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    e = info.value
    assert e.phase is Phase.STARTTLS
    assert e.operator_fault
    assert e.verdict.outcome is Outcome.TRANSIENT  # never a bounce
    assert str(e.reply).startswith("454 4.7.5")


async def test_starttls_hostname_mismatch(upstream, conn_factory, ca, ca_file) -> None:
    up = upstream(tls_context=server_context(ca, "mail.elsewhere.test"))
    c = conn_factory(up, tls=TlsPolicy("starttls", True, ca_file))
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    assert info.value.operator_fault
    assert info.value.reply.code == 454


async def test_starttls_required_but_not_offered(upstream, conn_factory, ca_file) -> None:
    up = upstream()
    c = conn_factory(up, tls=TlsPolicy("starttls", True, ca_file))
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    e = info.value
    assert e.phase is Phase.STARTTLS and e.operator_fault
    assert e.verdict.outcome is Outcome.TRANSIENT
    assert "STARTTLS" in e.reply.text
    assert up.commands == []


async def test_opportunistic_without_verification(upstream, conn_factory) -> None:
    up = upstream(tls_context=server_context(trustme.CA(), "elsewhere.test"))
    c = conn_factory(up, tls=TlsPolicy("opportunistic", False))
    await c.open()
    assert c.tls_active
    res = await c.send(SENDER, ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].tls is True


async def test_opportunistic_plain_when_not_offered(upstream, conn_factory) -> None:
    up = upstream()
    c = conn_factory(up, tls=TlsPolicy("opportunistic", False))
    await c.open()
    assert not c.tls_active
    res = await c.send(SENDER, ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].tls is False


async def test_opportunistic_falls_back_to_plain_when_handshake_fails(
    upstream, conn_factory
) -> None:
    # the server offers STARTTLS but has no certificate: every handshake fails
    up = upstream(tls_context=ssl.create_default_context(ssl.Purpose.CLIENT_AUTH))
    c = conn_factory(up, tls=TlsPolicy("opportunistic", False))
    await c.open()
    assert not c.tls_active
    res = await c.send(SENDER, ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].tls is False
    assert up.connections == 2  # the failed TLS attempt, then plain text


async def test_implicit_tls(upstream, conn_factory, ca, ca_file) -> None:
    up = upstream(tls_context=server_context(ca), implicit_tls=True)
    c = conn_factory(up, tls=TlsPolicy("implicit", True, ca_file))
    await c.open()
    assert c.tls_active
    assert c.smtp is not None and c.smtp.transport is not None
    assert c.smtp.transport.get_extra_info("ssl_object") is not None
    res = await c.send(SENDER, ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED


# --- AUTH -----------------------------------------------------------------------------------


async def test_auth_after_starttls(upstream, conn_factory, ca, ca_file) -> None:
    up = upstream(tls_context=server_context(ca), auth={"user": "right"})
    c = conn_factory(
        up, tls=TlsPolicy("starttls", True, ca_file), username="user", password="right"
    )
    await c.open()
    res = await c.send(SENDER, ["a@example.org"], BODY)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].auth == "user"


async def test_auth_refused_is_transient_operator_fault(
    upstream, conn_factory, ca, ca_file
) -> None:
    up = upstream(tls_context=server_context(ca), auth={"user": "right"})
    c = conn_factory(
        up, tls=TlsPolicy("starttls", True, ca_file), username="user", password="wrong"
    )
    with pytest.raises(ConnectFailed) as info:
        await c.open()
    e = info.value
    assert e.phase is Phase.AUTH
    assert e.operator_fault
    assert e.verdict.outcome is Outcome.TRANSIENT
    assert e.reply.code == 535
    assert "wrong" not in str(e.reply)


# --- the final-dot boundary and stored bodies (fault seam: relay/ops/faults.py) -------------------


async def test_a_write_that_fails_before_the_final_dot_is_not_ambiguous(
    upstream,
    conn_factory,
) -> None:
    """Commit 3331261: the ambiguity flag is set only once the final dot was written. A body
    write that fails before it is a plain transient failure: the upstream cannot have
    accepted a message it never saw the end of."""
    from relay.ops import faults

    up = upstream()
    c = conn_factory(up)
    await c.open()
    faults.arm("transport.body", "reset", times=1)
    try:
        res = await c.send(SENDER, ["a@example.org"], BODY)
    finally:
        faults.disarm_all()
    r = res.results["a@example.org"]
    assert r.verdict.outcome is Outcome.TRANSIENT
    assert not r.ambiguous, r
    assert r.phase is Phase.DATA


async def test_a_stored_body_is_streamed_with_transparency(
    upstream,
    conn_factory,
    tmp_path,
) -> None:
    from relay.spool.bodies import StoredBody

    up = upstream()
    c = conn_factory(up)
    await c.open()
    lines = [b".dot first\r\n", b"plain\r\n", b"..two\r\n", b".\r\n", b"x" * 100 + b"\r\n"]
    data = b"Subject: stored\r\n\r\n" + b"".join(lines[i % 5] for i in range(60_000))
    (tmp_path / "body").write_bytes(data)
    prefix = b"Received: from test\r\n"
    body = StoredBody(prefix, tmp_path / "body", len(prefix) + len(data))
    blocks = list(body.blocks(size=4096))
    assert all(b.endswith(b"\r\n") for b in blocks)  # line-aligned: transparency per block
    res = await c.send(SENDER, ["a@example.org"], body)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].data == prefix + data


async def test_a_stored_body_with_dots_only_inside_lines_then_one_at_a_line_start(
    upstream,
    conn_factory,
    tmp_path,
) -> None:
    """A stored body whose first blocks have dots only inside lines (sent as they are) and a
    later one a line that starts with a dot (doubled): the upstream gets the body back."""
    from relay.spool.bodies import StoredBody

    up = upstream()
    c = conn_factory(up)
    await c.open()
    data = b"Subject: stored\r\n\r\n" + b"a.b c.\r\n" * 80_000 + b".start\r\n" + b"x.y\r\n" * 100
    (tmp_path / "body").write_bytes(data)
    body = StoredBody(b"", tmp_path / "body", len(data))
    assert len(list(body.blocks())) > 2
    res = await c.send(SENDER, ["a@example.org"], body)
    assert res.results["a@example.org"].verdict.outcome is Outcome.DELIVERED
    assert up.wait_for(1)[0].data == data


def test_unsafe_addresses_are_every_control_character_and_a_bracket_in_the_domain() -> None:
    """The defence-in-depth check before MAIL/RCPT (one regex scan): exactly the C0 controls
    and DEL anywhere, or ">" in the domain, as the per-character loop it replaced."""
    from relay.delivery.transport import _unsafe

    for n in range(0x110):
        ch = chr(n)
        for address in (f"a{ch}b@example.org", f"ab@exa{ch}mple.org"):
            expected = n < 32 or n == 127 or (ch == ">" and address.startswith("ab@"))
            assert _unsafe(address) is expected, (n, address)
    assert not _unsafe("") and not _unsafe("ü>ser@exämple.org")
    assert _unsafe("a@b>c@example.org") is False and _unsafe("a@example.org>") is True


@given(
    st.binary(max_size=300)
    | st.lists(st.sampled_from([b".", b"\r\n", b"\n", b"\r", b"a", b".."])).map(b"".join)
)
@settings(max_examples=500, deadline=None)
def test_dot_stuffing_is_aiosmtplibs(body: bytes) -> None:
    """The transparency of relay/delivery/transport.py gives the octets aiosmtplib's regex
    gives (`(?m)^\\.` -> `..`), on any bytes: CRLF, bare LF, bare CR, dots anywhere."""
    from aiosmtplib.protocol import PERIOD_REGEX

    assert transport.dot_stuffed(body) == PERIOD_REGEX.sub(b"..", body)


_long_bodies = st.lists(
    st.sampled_from([b".", b"\r\n", b"\n", b"\r", b"a", b"..", b"y" * 700, b"x.y"]), max_size=60
).map(b"".join)


@given(_long_bodies)
@settings(max_examples=300, deadline=None)
def test_dot_stuffing_is_aiosmtplibs_with_dots_found_one_by_one(body: bytes) -> None:
    """As above, with the dot-by-dot search for a line that starts with a dot
    (relay/mail/message.py `find_dot_line`, long buffers) on every body, long ones too."""
    from aiosmtplib.protocol import PERIOD_REGEX

    from relay.mail import message

    with mock.patch.object(message, "_SHORT", 0):
        assert transport.dot_stuffed(body) == PERIOD_REGEX.sub(b"..", body)
        assert transport.dot_stuffed(body, b"\r\n") == _crlf_stuffed(body)
    assert transport.dot_stuffed(body) == PERIOD_REGEX.sub(b"..", body)
    assert transport.dot_stuffed(body, b"\r\n") == _crlf_stuffed(body)


def _crlf_stuffed(block: bytes) -> bytes:
    """A stored body's block as the stream stuffed it before dot_stuffed took a line end: a
    dot doubled at the block's start and after every CRLF."""
    return (b"." + block if block.startswith(b".") else block).replace(b"\r\n.", b"\r\n..")


def test_a_body_with_no_line_that_starts_with_a_dot_goes_out_as_it_is() -> None:
    """No copy and no `replace` pass for such a body (base64 has no dot at all; text has them
    inside lines): the very object comes back. A dot at a line start deep inside a long
    body is still doubled, and the part before it kept."""
    base64ish = b"QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo=\r\n" * 3000
    text = b"Mr. Smith wrote: see example.org. Thanks.\r\n" * 3000
    for body in (base64ish, text):
        assert transport.dot_stuffed(body) is body
    deep = text + b".hidden\r\n" + text
    assert transport.dot_stuffed(deep) == text + b"..hidden\r\n" + text
