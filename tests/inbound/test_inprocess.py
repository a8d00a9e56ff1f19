"""Inbound SMTP in the test process: relay/inbound/transport.py InboundProtocol and
relay/inbound/handler.py InboundHandler on a
loopback port, over a real SpoolWriter on a tmp_path spool, spoken to by a small asyncio
SMTP client. What the daemon tests show end to end, here where mutation testing sees it
(tests/MUTANTS.md): the reply codes, the rows a 250 leaves, and nothing left by a 4xx."""

from __future__ import annotations

import asyncio
import errno
import re
import socket
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from relay.config.tree import Config, from_mapping
from relay.inbound import handler as inbound
from relay.inbound.handler import InboundHandler, InboundStats, Suppressions
from relay.inbound.session import Envelope, Session
from relay.ops import faults
from relay.spool import db, ops
from relay.spool.writer import SpoolError, SpoolWriter
from tests.harness import deep_merge

WAIT = 10.0  # seconds: a bound on every network wait, never a sleep
NS = "listener:127.0.0.1:2525"
UNAVAILABLE = "451 4.3.0 Spool unavailable; message not accepted, try again later"
FULL = "452 4.3.1 Insufficient system storage; try again later"
INTERNAL = "451 4.3.0 Internal error; message not accepted, try again later"
QUEUED = re.compile(r"^250 2\.0\.0 Ok: queued as ([0-9A-F]{16})$")


async def serve(
    handler: InboundHandler, ssl: Any = None, sndbuf: int | None = None
) -> tuple[asyncio.Server, int]:
    """The handler's protocol on a free loopback port (with `sndbuf`, a small send buffer
    that the accepted connections inherit)."""
    server = await asyncio.get_running_loop().create_server(
        handler.protocol, host="127.0.0.1", port=0, ssl=ssl
    )
    if sndbuf is not None:
        server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    return server, server.sockets[0].getsockname()[1]


async def shut_down(made: list[tuple[Relay, asyncio.Server]]) -> None:
    """Close what `serve` started: the clients, the listener, the guard and the writer."""
    for relay, server in made:
        for c in relay.clients:
            await c.close()
        server.close()
        await server.wait_closed()
        relay.handler.guard.close()
        relay.writer.close()


@pytest.fixture(autouse=True)
def _clean_faults() -> Iterator[None]:
    faults.disarm_all()
    yield
    faults.disarm_all()


class Client:
    """Just enough SMTP: one command, one (possibly multi-line) reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def reply(self) -> tuple[int, str]:
        lines: list[str] = []
        while True:
            raw = await asyncio.wait_for(self.reader.readline(), WAIT)
            if not raw:
                raise ConnectionError("closed: " + " | ".join(lines))
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            lines.append(line)
            if len(line) < 4 or line[3] != "-":
                return int(line[:3]), "\n".join(lines)

    async def cmd(self, line: str) -> tuple[int, str]:
        self.writer.write(line.encode("utf-8", "surrogateescape") + b"\r\n")
        await self.writer.drain()
        return await self.reply()

    async def data(self, content: bytes) -> str:
        code, text = await self.cmd("DATA")
        if code != 354:
            return text
        if not content.endswith(b"\r\n"):
            content += b"\r\n"
        stuffed = re.sub(rb"(?m)^\.", b"..", content)
        self.writer.write(stuffed + b".\r\n")
        await self.writer.drain()
        return (await self.reply())[1]

    async def send(self, sender: str, rcpts: list[str], content: bytes) -> str:
        """A whole transaction on this connection; the final reply's text."""
        code, text = await self.cmd(f"MAIL FROM:<{sender}>")
        if code != 250:
            return text
        ok = 0
        last = ""
        for r in rcpts:
            code, last = await self.cmd(f"RCPT TO:<{r}>")
            ok += code == 250
        if not ok:
            return last
        return await self.data(content)

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), WAIT)
        except (TimeoutError, ConnectionError):
            pass


@dataclass
class Relay:
    config: Config
    spool: Path
    writer: SpoolWriter
    handler: InboundHandler
    port: int
    queued: list[int] = field(default_factory=list)
    clients: list[Client] = field(default_factory=list)

    async def connect(self, ehlo: str | None = "client.test") -> Client:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), WAIT)
        c = Client(r, w)
        self.clients.append(c)
        code, text = await c.reply()
        assert code == 220, text
        if ehlo is not None:
            code, text = await c.cmd(f"EHLO {ehlo}")
            assert code == 250, text
        return c

    async def send(self, sender: str, rcpts: list[str], content: bytes) -> str:
        c = await self.connect()
        try:
            return await c.send(sender, rcpts, content)
        finally:
            await c.cmd("QUIT")
            await c.close()

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        conn = db.connect(self.spool, create=False)
        try:
            return [tuple(r) for r in conn.execute(sql, params)]
        finally:
            conn.close()

    def messages(self) -> list[tuple[Any, ...]]:
        return self.rows(
            "SELECT id, message_id, sender, size, client, peer, lane, identity, body, body_path,"
            " listener FROM messages ORDER BY id"
        )

    def recipients(self) -> list[tuple[Any, ...]]:
        return self.rows(
            "SELECT msg_id, address, destination, lane_prio, state, attempts, dedup_key"
            " FROM recipients ORDER BY id"
        )

    def body(self, qid: str) -> bytes:
        conn = db.connect(self.spool, create=False)
        try:
            inline, rel = ops.message_body(conn, qid)
        finally:
            conn.close()
        from relay.spool import bodies

        return bodies.load(self.spool, inline, rel)


MSG = (
    b"From: app@example.com\r\nTo: user@example.org\r\nSubject: hello\r\n"
    b"Date: Thu, 01 Jan 2026 00:00:00 +0000\r\nMessage-ID: <m1@app.example>\r\n\r\nbody\r\n"
)


def message(mid: str | None = "<m1@app.example>", body: bytes = b"body\r\n", **hdrs: str) -> bytes:
    head = [b"From: app@example.com", b"To: user@example.org", b"Subject: hello"]
    if "Date" not in hdrs:
        head.append(b"Date: Thu, 01 Jan 2026 00:00:00 +0000")
    if mid is not None:
        head.append(b"Message-ID: " + mid.encode())
    head += [f"{k.replace('_', '-')}: {v}".encode() for k, v in hdrs.items() if v]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


Start = Callable[..., Awaitable[Relay]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    made: list[tuple[Relay, asyncio.AbstractServer]] = []

    async def factory(
        cfg: dict[str, Any] | None = None,
        *,
        gate: Callable[[], str | None] = lambda: None,
        suppressions: Suppressions | None = None,
        stats: InboundStats | None = None,
    ) -> Relay:
        spool = tmp_path / f"spool{len(made)}"
        base: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(spool)}}
        config = from_mapping(deep_merge(base, cfg or {}), tmp_path)
        writer = SpoolWriter(config.spool_path)
        writer.start()
        queued: list[int] = []
        handler = InboundHandler(
            config,
            config.listen[0],
            writer,
            suppressions or Suppressions(),
            on_queued=lambda: queued.append(1),
            stats=stats,
            gate=gate,
        )
        server, port = await serve(handler)
        relay = Relay(config, config.spool_path, writer, handler, port, queued)
        made.append((relay, server))
        return relay

    yield factory
    await shut_down(made)


# --- the accept path ------------------------------------------------------------------------


async def test_a_message_is_committed_before_its_250(start: Start) -> None:
    r = await start()
    c = await r.connect()
    text = await c.send("app@example.com", ["user@example.org", "Other@Example.NET"], MSG)
    m = QUEUED.match(text)
    assert m, text
    qid = m.group(1)
    # the reply came after the commit: another connection sees every row at once
    [row] = r.messages()
    assert row[0] == qid
    assert row[1:8] == (
        "m1@app.example",
        "app@example.com",
        len(r.body(qid)),
        NS,
        "127.0.0.1",
        "transactional",
        "example.com",
    )
    assert row[9] is None and row[10] == "127.0.0.1:2525"  # inline, and the listener's name
    assert r.recipients() == [
        (qid, "user@example.org", "example.org", 0, "pending", 0, row_key(NS, "user@example.org")),
        (
            qid,
            "Other@Example.NET",
            "example.net",
            0,
            "pending",
            0,
            row_key(NS, "Other@Example.NET"),
        ),
    ]
    stored = r.body(qid)
    assert stored.endswith(MSG)
    received = stored[: -len(MSG)]
    assert received.startswith(b"Received: from client.test ([127.0.0.1])\r\n")
    assert f"\tby relay.test (relay) with ESMTP id {qid}".encode() in received
    assert b"for <" not in received  # two recipients: no `for` clause
    assert r.handler.stats.accepted == 1 and r.queued == [1]
    assert r.handler.in_flight == 0
    # the session goes on: a second message on the same connection
    text2 = await c.send("app@example.com", ["user@example.org"], message("<m2@app.example>"))
    m2 = QUEUED.match(text2)
    assert m2, text2
    stored2 = r.body(m2.group(1))
    assert b"\tfor <user@example.org>; " in stored2  # one recipient: named
    assert r.handler.stats.accepted == 2 and r.queued == [1, 1]


def row_key(namespace: str, rcpt: str, mid: str = "<m1@app.example>") -> str:
    from relay.spool import dedup

    return dedup.dedup_key(namespace, mid, rcpt)


async def test_a_resubmission_is_answered_250_and_not_queued_again(start: Start) -> None:
    r = await start()
    first = await r.send("app@example.com", ["a@example.org"], MSG)
    assert QUEUED.match(first), first
    again = await r.send("app@example.com", ["a@example.org"], MSG)
    assert again == "250 2.0.0 Ok: already queued (duplicate suppressed)"
    # one more recipient with the same Message-ID: only that one is queued
    more = await r.send("app@example.com", ["a@example.org", "b@example.org"], MSG)
    m = QUEUED.match(more)
    assert m, more
    assert [(x[0], x[1]) for x in r.recipients()] == [
        (QUEUED.match(first).group(1), "a@example.org"),  # type: ignore[union-attr]
        (m.group(1), "b@example.org"),
    ]
    assert len(r.messages()) == 2
    assert r.handler.stats.deduplicated == 1 and r.handler.stats.accepted == 2
    assert len(r.queued) == 2


async def test_a_message_without_message_id_gets_one_from_its_content(start: Start) -> None:
    r = await start()
    content = message(None, Date="")
    text = await r.send("app@example.com", ["a@example.org"], content)
    m = QUEUED.match(text)
    assert m, text
    stored = r.body(m.group(1))
    mid = r.messages()[0][1]
    assert re.fullmatch(r"[0-9a-f]{32}\.content@relay\.test", mid), mid
    # our prefix: Received, then the Message-ID, then a Date; the client's data after it
    assert stored.endswith(content)
    prefix = stored[: -len(content)]
    assert re.search(rb"\r\nMessage-ID: <" + mid.encode() + rb">\r\nDate: [^\r\n]+\r\n$", prefix)
    # the same content again is the same message
    again = await r.send("app@example.com", ["a@example.org"], content)
    assert again == "250 2.0.0 Ok: already queued (duplicate suppressed)"
    # a message that has a Date gets none added
    text2 = await r.send("app@example.com", ["a@example.org"], message(None, body=b"other\r\n"))
    m2 = QUEUED.match(text2)
    assert m2, text2
    assert b"\r\nDate: " not in r.body(m2.group(1)).split(b"\r\nFrom: ")[0]


async def test_the_null_sender_is_stored_empty_and_its_identity_is_the_null_path(
    start: Start,
) -> None:
    r = await start()
    c = await r.connect()
    assert await c.cmd("MAIL FROM:<>") == (250, "250 2.1.0 OK")
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    text = await c.data(MSG)
    assert QUEUED.match(text), text
    [row] = r.messages()
    assert row[2] == "" and row[7] == "<>"


async def test_identity_by_sender_is_the_whole_address_lower_case(start: Start) -> None:
    r = await start({"shaping": {"identity_by": "sender"}})
    text = await r.send("App@Example.COM", ["a@example.org"], MSG)
    assert QUEUED.match(text), text
    assert r.messages()[0][7] == "app@example.com"


async def test_a_listener_lane_and_lane_rules_set_the_lane(start: Start) -> None:
    r = await start({"listen": [{"address": "127.0.0.1:2525", "lane": "bulk"}]})
    text = await r.send("app@example.com", ["a@example.org"], MSG)
    assert QUEUED.match(text), text
    assert r.messages()[0][6] == "bulk"
    assert r.recipients()[0][3] == 1  # the bulk lane's priority
    r2 = await start({"lanes": {"rules": [{"lane": "bulk", "sender": "news@example.com"}]}})
    assert QUEUED.match(await r2.send("news@example.com", ["a@example.org"], MSG))
    assert r2.messages()[0][6] == "bulk"


# --- failures on the way to the spool: 4xx, and nothing kept ----------------------------------


@pytest.mark.parametrize(
    ("seam", "error", "reply"),
    [
        ("spool.commit", "enospc", FULL),
        ("spool.commit", "eio", UNAVAILABLE),
        ("spool.begin", "locked", UNAVAILABLE),
        ("spool.job", "enospc", FULL),
        ("inbound.accept", "error", INTERNAL),
    ],
)  # fmt: skip
async def test_a_spool_failure_answers_4xx_and_keeps_nothing(
    start: Start, seam: str, error: str, reply: str
) -> None:
    r = await start()
    c = await r.connect()
    faults.arm(seam, error, times=1)
    assert await c.send("app@example.com", ["a@example.org"], MSG) == reply
    assert r.messages() == [] and r.recipients() == []
    assert r.rows("SELECT count(*) FROM dedup") == [(0,)]
    assert r.handler.stats.accepted == 0 and r.queued == []
    assert r.handler.in_flight == 0
    if seam != "inbound.accept":
        assert r.handler.stats.by_reason == {"spool_error": 1}
    # the client retries on the same connection: now it is queued (nothing was remembered)
    assert QUEUED.match(await c.send("app@example.com", ["a@example.org"], MSG))


@pytest.mark.parametrize(
    ("error", "reply"),
    [
        ("enospc", FULL),
        ("eio", UNAVAILABLE),
    ],
)
async def test_a_large_body_that_cannot_be_written_answers_4xx_and_leaves_no_file(
    start: Start, error: str, reply: str
) -> None:
    r = await start({"spool": {"inline_max": "1KiB"}})
    c = await r.connect()
    faults.arm("body.write", error, times=1)
    big = message(body=(b"y" * 70 + b"\r\n") * 60)
    assert await c.send("app@example.com", ["a@example.org"], big) == reply
    assert r.messages() == []
    assert [p for p in (r.spool / "bodies").rglob("*") if p.is_file()] == []
    text = await c.send("app@example.com", ["a@example.org"], big)
    m = QUEUED.match(text)
    assert m, text
    qid = m.group(1)
    [row] = r.messages()
    assert row[9] == f"bodies/{qid[:2]}/{qid}"
    assert (r.spool / row[9]).read_bytes() == big  # the data as sent, unchanged
    assert row[8].startswith(b"Received: ") and row[3] == len(row[8]) + len(big)
    assert [p.name for p in (r.spool / "bodies").rglob("*") if p.is_file()] == [qid]


async def test_a_large_duplicate_leaves_no_body_file(start: Start) -> None:
    r = await start({"spool": {"inline_max": "1KiB"}})
    big = message(body=(b"z" * 70 + b"\r\n") * 60)
    first = QUEUED.match(await r.send("app@example.com", ["a@example.org"], big))
    assert first
    assert await r.send("app@example.com", ["a@example.org"], big) == (
        "250 2.0.0 Ok: already queued (duplicate suppressed)"
    )
    files = [p.name for p in (r.spool / "bodies").rglob("*") if p.is_file()]
    assert files == [first.group(1)]


async def test_a_large_body_whose_commit_fails_leaves_no_file(start: Start) -> None:
    r = await start({"spool": {"inline_max": "1KiB"}})
    c = await r.connect()
    faults.arm("spool.commit", "eio", times=1)
    big = message(body=(b"w" * 70 + b"\r\n") * 60)
    text = await c.send("app@example.com", ["a@example.org"], big)
    assert text == UNAVAILABLE
    assert [p for p in (r.spool / "bodies").rglob("*") if p.is_file()] == []


async def test_the_health_gate_refuses_mail_and_a_data_that_ends_while_it_is_closed(
    start: Start,
) -> None:
    refusal: list[str] = []
    gate_reply = "452 4.3.1 Insufficient system storage (spool disk full); try again later"
    r = await start(gate=lambda: refusal[0] if refusal else None)
    c = await r.connect()
    refusal.append(gate_reply)
    assert await c.cmd("MAIL FROM:<app@example.com>") == (452, gate_reply)
    assert r.handler.stats.by_reason == {"spool_unavailable": 1}
    refusal.clear()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    assert (await c.cmd("DATA"))[0] == 354
    refusal.append(gate_reply)  # the disk fills while the client sends its data
    c.writer.write(MSG + b".\r\n")
    assert (await c.reply())[1] == gate_reply
    assert r.messages() == []
    assert r.handler.stats.by_reason == {"spool_unavailable": 1, "spool_error": 1}


# --- limits -----------------------------------------------------------------------------------


async def test_too_much_data_is_552_and_the_session_goes_on(start: Start) -> None:
    r = await start({"limits": {"max_message_size": "2KiB"}})
    c = await r.connect()
    big = message(body=b"x" * 70 + b"\r\n") * 40
    assert await c.send("app@example.com", ["a@example.org"], big) == (
        "552 5.3.4 Message size exceeds fixed maximum message size"
    )
    assert r.messages() == []
    assert QUEUED.match(await c.send("app@example.com", ["a@example.org"], MSG))


async def test_a_declared_size_over_the_limit_is_refused_at_mail(start: Start) -> None:
    r = await start({"limits": {"max_message_size": "2KiB"}})
    c = await r.connect()
    assert await c.cmd("MAIL FROM:<app@example.com> SIZE=2049") == (
        552,
        "552 5.3.4 Message size exceeds fixed maximum message size",
    )
    assert await c.cmd("MAIL FROM:<app@example.com> SIZE=x1") == (
        501,
        "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]",
    )
    assert await c.cmd("MAIL FROM:<app@example.com> SIZE") == (
        501,
        "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]",
    )
    assert await c.cmd("MAIL FROM:<app@example.com> SIZE=2048") == (250, "250 2.1.0 OK")


async def test_an_over_long_line_is_500_and_nothing_is_kept(start: Start) -> None:
    r = await start({"limits": {"max_line_length": 200}})
    c = await r.connect()
    long = message(body=b"l" * 300 + b"\r\n")
    assert await c.send("app@example.com", ["a@example.org"], long) == (
        "500 5.5.2 Line too long (see RFC 5321 4.5.3.1.6)"
    )
    assert r.messages() == []
    assert not list((r.spool / "bodies").rglob("*.tmp")) if (r.spool / "bodies").exists() else True


async def test_lines_over_998_octets_are_reencoded_not_refused(start: Start) -> None:
    r = await start()
    long = message(body=b"q" * 1500 + b"\r\n")
    m = QUEUED.match(await r.send("app@example.com", ["a@example.org"], long))
    assert m
    stored = r.body(m.group(1))
    assert max(len(line) for line in stored.split(b"\r\n")) <= 998
    assert b"q" * 1500 not in stored


async def test_too_many_recipients_is_452(start: Start) -> None:
    r = await start({"limits": {"max_recipients": 2}})
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[1] == "250 2.1.5 OK"
    assert (await c.cmd("RCPT TO:<b@example.org>"))[1] == "250 2.1.5 OK"
    assert await c.cmd("RCPT TO:<c@example.org>") == (452, "452 4.5.3 Too many recipients")
    assert QUEUED.match(await c.data(MSG))
    assert [x[1] for x in r.recipients()] == ["a@example.org", "b@example.org"]
    assert r.handler.stats.by_reason == {"too_many_recipients": 1}


# --- MAIL and RCPT ----------------------------------------------------------------------------


async def test_relaying_needs_an_allowed_network(start: Start) -> None:
    r = await start({"listen": [{"address": "127.0.0.1:2525", "allow": ["10.0.0.0/8"]}]})
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert await c.cmd("RCPT TO:<a@example.org>") == (
        554,
        "554 5.7.1 Relay access denied: authenticate or connect from an allowed network",
    )
    assert await c.cmd("DATA") == (503, "503 5.5.1 Error: need RCPT command")
    assert r.handler.stats.by_reason == {"relay_denied": 1}
    assert r.handler.stats.rejected == 1


@pytest.mark.parametrize(
    ("rcpt", "reply"),
    [
        ("a@example.org", "250 2.1.5 OK"),
        ("a@-bad-.org", "553 5.1.3 Recipient address must be a fully qualified mailbox"),
        ("a@exa_mple.org", "553 5.1.3 Recipient address must be a fully qualified mailbox"),
    ],
)
async def test_rcpt_domains_are_checked(start: Start, rcpt: str, reply: str) -> None:
    r = await start()
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    code, text = await c.cmd(f"RCPT TO:<{rcpt}>")
    assert text == reply or (code == 501 and reply.startswith("553")), text


async def test_a_bare_local_part_is_qualified_and_aliases_expand(start: Start) -> None:
    r = await start(
        {
            "local": {
                "domain": "corp.test",
                "aliases": {
                    "root": ["ops@example.org", "dev@example.org"],
                    "one": ["x@example.org"],
                },
            }
        }
    )
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<cron>"))[0] == 250
    assert (await c.cmd("RCPT TO:<root>"))[1] == "250 2.1.5 OK (alias: 2 recipients)"
    assert (await c.cmd("RCPT TO:<one@corp.test>"))[1] == "250 2.1.5 OK (alias: 1 recipient)"
    assert (await c.cmd("RCPT TO:<OPS@example.org>"))[1] == "250 2.1.5 OK"  # already there
    assert (await c.cmd("RCPT TO:<nobody@corp.test>"))[1] == "250 2.1.5 OK"
    text = await c.data(MSG)
    assert QUEUED.match(text), text
    assert r.messages()[0][2] == "cron@corp.test"
    assert [x[1] for x in r.recipients()] == [
        "ops@example.org",
        "dev@example.org",
        "x@example.org",
        "nobody@corp.test",
    ]


async def test_a_suppressed_recipient_is_refused_with_the_reason_and_date(start: Start) -> None:
    supp = Suppressions()
    supp.add_local("Gone@Example.org", "bounced: 550 5.1.1 no such user\x07", 1_700_000_000.0)
    supp.add_local("scoped@example.org", "complaint", 1_700_000_000.0, scope="Example.COM")
    r = await start(suppressions=supp)
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    since = "2023-11-14T22:13:20Z"
    assert await c.cmd("RCPT TO:<gone@example.org>") == (
        550,
        f"550 5.1.1 Recipient is suppressed since {since}: bounced: 550 5.1.1 no such user?",
    )
    assert await c.cmd("RCPT TO:<scoped@example.org>") == (
        550,
        f"550 5.1.1 Recipient is suppressed since {since}: complaint",
    )
    assert r.handler.stats.by_reason == {"suppressed": 2}
    # another sending identity may still mail the scoped address
    assert await c.cmd("RSET") == (250, "250 2.0.0 OK")
    assert (await c.cmd("MAIL FROM:<app@other.example>"))[0] == 250
    assert (await c.cmd("RCPT TO:<scoped@example.org>"))[1] == "250 2.1.5 OK"


async def test_mail_parameters_and_sequence_errors(start: Start) -> None:
    r = await start()
    c = await r.connect()
    assert await c.cmd("RCPT TO:<a@example.org>") == (503, "503 5.5.1 Error: need MAIL command")
    assert await c.cmd("MAIL FROM:<app@example.com> BODY=BINARYMIME") == (
        501,
        "501 5.5.4 BODY can only be one of 7BIT, 8BITMIME",
    )
    assert await c.cmd("MAIL FROM:<app@example.com> SMTPUTF8=yes") == (
        501,
        "501 5.5.4 SMTPUTF8 takes no arguments",
    )
    assert await c.cmd("MAIL FROM:<app@example.com> FOO=1") == (
        555,
        "555 5.5.4 MAIL FROM parameters not recognized or not implemented",
    )
    assert await c.cmd("MAIL TO:<app@example.com>") == (
        501,
        "501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]",
    )
    code, text = await c.cmd("MAIL FROM:<app@@example.com>")
    assert code == 501 and text.startswith("501 5.1.7 Bad sender address syntax: "), text
    assert r.handler.stats.by_reason == {"bad_address": 1}
    assert await c.cmd("MAIL FROM:<app@example.com> BODY=8BITMIME") == (250, "250 2.1.0 OK")
    await c.cmd("QUIT")
    c = await r.connect()  # ten error replies close a session: go on in a new one
    assert await c.cmd("MAIL FROM:<app@example.com> BODY=7BIT") == (250, "250 2.1.0 OK")
    assert await c.cmd("MAIL FROM:<app@example.com>") == (
        503,
        "503 5.5.1 Error: nested MAIL command",
    )
    assert await c.cmd("RCPT TO:<a@example.org> NOTIFY=NEVER") == (
        555,
        "555 5.5.4 RCPT TO parameters not recognized or not implemented",
    )
    code, text = await c.cmd("RCPT TO:<a b@example.org>")
    assert code == 501 and text.startswith("501 5.1.3 Bad recipient address syntax: "), text
    assert await c.cmd("RCPT FROM:<a@example.org>") == (
        501,
        "501 5.5.4 Syntax: RCPT TO:<address> [SP <mail-parameters>]",
    )
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    assert await c.cmd("DATA now") == (501, "501 5.5.4 Syntax: DATA")


async def test_helo_sessions_take_no_parameters_and_say_smtp(start: Start) -> None:
    r = await start()
    c = await r.connect(ehlo=None)
    assert (await c.cmd("HELO old.client"))[0] == 250
    assert await c.cmd("MAIL FROM:<app@example.com> BODY=8BITMIME") == (
        501,
        "501 5.5.4 Syntax: MAIL FROM:<address>",
    )
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    m = QUEUED.match(await c.data(MSG))
    assert m
    assert b" (relay) with SMTP id " in r.body(m.group(1))


async def test_smtputf8_is_recorded_in_the_trace(start: Start) -> None:
    r = await start()
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com> SMTPUTF8"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    m = QUEUED.match(await c.data(MSG))
    assert m
    assert b" (relay) with UTF8SMTP id " in r.body(m.group(1))


async def test_ehlo_offers_pipelining_and_enhanced_codes_but_no_auth(start: Start) -> None:
    r = await start()
    c = await r.connect(ehlo=None)
    code, text = await c.cmd("EHLO client.test")
    lines = text.split("\n")
    assert code == 250 and lines[-3:] == ["250-PIPELINING", "250-ENHANCEDSTATUSCODES", "250 HELP"]
    assert not any("AUTH" in line for line in lines)


async def test_a_closing_relay_answers_421_and_closes(start: Start) -> None:
    r = await start()
    r.handler.closing = True
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    try:
        line = await asyncio.wait_for(reader.readline(), WAIT)
        assert line == b"421 4.3.2 relay.test shutting down\r\n"
        assert await asyncio.wait_for(reader.read(), WAIT) == b""
    finally:
        writer.close()
    assert r.handler.stats.sessions == 0


# --- Idempotency-Key --------------------------------------------------------------------------


async def test_an_idempotency_key_names_the_message(start: Start) -> None:
    r = await start()
    one = message("<a@app.example>", Idempotency_Key=" order-17 ")
    m = QUEUED.match(await r.send("app@example.com", ["a@example.org"], one))
    assert m
    stored = r.body(m.group(1))
    assert b"Idempotency-Key" not in stored  # ours, not the recipient's
    # another Message-ID, same key and content: the same message
    same = message("<b@app.example>", Idempotency_Key="order-17")
    assert await r.send("app@example.com", ["a@example.org"], same) == (
        "250 2.0.0 Ok: already queued (duplicate suppressed)"
    )
    # the same key for other content: refused, nothing queued
    other = message("<a@app.example>", body=b"changed\r\n", Idempotency_Key="order-17")
    assert await r.send("app@example.com", ["a@example.org"], other) == (
        "554 5.6.0 Idempotency-Key order-17 was already used for a message with other content;"
        " use a new key for a new message"
    )
    assert len(r.messages()) == 1
    assert r.handler.stats.by_reason == {"idempotency_conflict": 1}
    from relay.spool import dedup

    assert r.recipients()[0][6] == dedup.idempotency_dedup_key(NS, "order-17", "a@example.org")


async def test_a_malformed_idempotency_key_is_554(start: Start) -> None:
    r = await start()
    bad = message(Idempotency_Key="x" * 300)
    text = await r.send("app@example.com", ["a@example.org"], bad)
    assert text.startswith("554 5.6.0 Idempotency-Key must be 1 to "), text
    assert r.messages() == []
    assert r.handler.stats.by_reason == {"bad_idempotency_key": 1}


# --- the handler's parts, directly ------------------------------------------------------------


def _handler(tmp_path: Path, cfg: dict[str, Any] | None = None) -> InboundHandler:
    base: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(tmp_path / "s")}}
    config = from_mapping(deep_merge(base, cfg or {}), tmp_path)
    return InboundHandler(config, config.listen[0], SpoolWriter(tmp_path), Suppressions())


@pytest.mark.parametrize(
    ("error", "reply"),
    [
        (OSError(errno.ENOSPC, "No space left"), FULL),
        (OSError(errno.EDQUOT, "Quota"), FULL),
        (sqlite3.OperationalError("database or disk is FULL"), FULL),
        (OSError(errno.EIO, "I/O error"), UNAVAILABLE),
        (SpoolError("disk I/O error"), UNAVAILABLE),
        (SpoolError("452 4.3.1 the gate's own"), "452 4.3.1 the gate's own"),
        (SpoolError("451 4.3.0 the gate's own"), "451 4.3.0 the gate's own"),
        (SpoolError("450 4.3.0 not a gate reply"), UNAVAILABLE),
        (SpoolError("451-4.3.0 not a gate reply"), UNAVAILABLE),
    ],
)  # fmt: skip
def test_spool_failed_replies(tmp_path: Path, error: BaseException, reply: str) -> None:
    h = _handler(tmp_path)
    assert h.spool_failed("Q", error) == reply
    assert h.stats.by_reason == {"spool_error": 1} and h.stats.rejected == 1


def test_identity_of(tmp_path: Path) -> None:
    h = _handler(tmp_path)
    assert h.identity_of("App@Mail.Example.COM") == "mail.example.com"
    assert h.identity_of("") == "<>" and h.identity_of("<>") == "<>"
    h2 = _handler(tmp_path, {"shaping": {"identity_by": "sender"}})
    assert h2.identity_of("App@Example.COM") == "app@example.com"
    assert h2.identity_of("<>") == "<>"


def test_namespace_is_the_login_when_authenticated(tmp_path: Path) -> None:
    h = _handler(tmp_path)
    s: Any = Session()
    assert h._namespace(s) == NS
    s.authenticated = True
    s.auth_data = b"b\xc3\xa9b\xff"
    assert h._namespace(s) == "user:b\u00e9b\ufffd"

    class Login:
        login = b"alice"

    s.auth_data = Login()
    assert h._namespace(s) == "user:alice"
    s.auth_data = None
    assert h._namespace(s) == NS
    s.authenticated = False
    s.auth_data = b"mallory"
    assert h._namespace(s) == NS


def test_peer_allowed(tmp_path: Path) -> None:
    h = _handler(tmp_path, {"listen": [{"address": "127.0.0.1:2525", "allow": ["10.1.0.0/16"]}]})
    s: Any = Session()
    assert not h.peer_allowed(None)
    s.peer = ("10.1.2.3", 1)
    assert h.peer_allowed(s)
    s.peer = ("::ffff:10.1.2.3", 1, 0, 0)  # an IPv4 client on a dual-stack socket
    assert h.peer_allowed(s)
    s.peer = ("10.2.0.1", 1)
    assert not h.peer_allowed(s)
    s.peer = "not an address"
    assert not h.peer_allowed(s)
    s.peer = ""
    assert not h.peer_allowed(s)
    s.authenticated = True
    assert h.peer_allowed(s)


async def test_suppressions_refresh_only_when_the_spool_changed(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path / "s")
    w.start()
    try:
        await w.run(lambda c: ops.suppression_add(c, "A@x.test", "bounced", 5.0))
        await w.run(lambda c: ops.suppression_add(c, "b@x.test", "complaint", 6.0, "Id.Test"))
        s = Suppressions()
        await s.refresh(w)
        assert s.entries == {
            ("a@x.test", ""): ("bounced", 5.0),
            ("b@x.test", "id.test"): ("complaint", 6.0),
        }
        assert s.get("A@X.test") == ("bounced", 5.0)
        assert s.get("b@x.test") is None and s.get("b@x.test", "ID.test") == ("complaint", 6.0)
        assert s.get("a@x.test", "id.test") == ("bounced", 5.0)  # global first
        version = s.version
        assert version is not None
        s.entries[("c@x.test", "")] = ("local", 1.0)
        await s.refresh(w)  # same version: not reloaded
        assert ("c@x.test", "") in s.entries
        s.add_local("D@x.test", "smtp", 7.0, scope="ID.test")
        assert s.version is None and s.get("d@x.test", "id.test") == ("smtp", 7.0)
        await s.refresh(w)  # reloaded: the spool's entries only
        assert set(s.entries) == {("a@x.test", ""), ("b@x.test", "id.test")}
        assert s.version == version
    finally:
        w.close()


def test_small_helpers() -> None:
    assert inbound._strip_keyword("from:<a@b>", "FROM:") == "<a@b>"
    assert inbound._strip_keyword("FROM: <a@b>", "FROM:") == " <a@b>"
    assert inbound._strip_keyword("FRO", "FROM:") is None
    assert inbound._strip_keyword(None, "FROM:") is None
    assert inbound._strip_keyword("TO:<a@b>", "FROM:") is None
    assert inbound._printable("a\x1fb\x7fc~ d\u00e9") == "a?b?c~ d?"
    assert inbound._storable("a\udcffb") == "a\\xffb"
    assert inbound._utf8("a@b.c") and not inbound._utf8("a\udcff@b.c")
    assert inbound._valid_domain("example.org") and not inbound._valid_domain("-x.org")
    s: Any = Session()
    assert inbound._with_protocol(s) == "SMTP"
    s.extended_smtp = True
    assert inbound._with_protocol(s) == "ESMTP"
    assert inbound._with_protocol(s, True) == "UTF8SMTP"
    s.ssl = {}
    s.authenticated = True
    assert inbound._with_protocol(s) == "ESMTPSA"
    s.ssl = None
    assert inbound._with_protocol(s, True) == "UTF8SMTPA"


def test_inbound_stats_count_reasons() -> None:
    st = InboundStats()
    st.reject("a")
    st.reject("a")
    st.reject("b")
    assert st.rejected == 3 and st.by_reason == {"a": 2, "b": 1}


async def test_accept_stream_discards_the_body_when_the_hook_fails(tmp_path: Path) -> None:
    """A hook failure (here the spool writer is never started, so a job would wait
    forever: the accept is failed by a fault first) leaves no temporary file behind."""
    from relay.spool.incoming import IncomingBody

    h = _handler(tmp_path, {"spool": {"inline_max": "1KiB"}})
    incoming = IncomingBody(h.config.spool_path, h.config.inline_max)
    await incoming.add(message(body=(b"v" * 70 + b"\r\n") * 80))
    assert incoming.on_disk
    tmp = incoming.tmp_path
    assert tmp is not None and tmp.exists()
    faults.arm("inbound.accept", "error", times=1)
    s: Any = Session()
    s.peer = ("127.0.0.1", 1)
    env = Envelope()
    env.mail_from = "app@example.com"
    env.rcpt_tos = ["a@example.org"]
    with pytest.raises(faults.InjectedFault):
        await h.accept_stream(s, env, incoming, 0)
    assert not tmp.exists() and h.in_flight == 0


# --- the session: greeting, limits, timeouts, errors, AUTH --------------------------------------


async def closed(c: Client) -> bool:
    """True once the server has closed the connection (EOF), within WAIT."""
    return await asyncio.wait_for(c.reader.read(), WAIT) == b""


async def test_the_greeting_names_the_host(start: Start) -> None:
    r = await start()
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    try:
        assert await asyncio.wait_for(reader.readline(), WAIT) == (
            b"220 relay.test relay ESMTP\r\n"
        )
    finally:
        writer.close()


async def test_a_connection_over_the_limit_gets_421_and_a_closed_one_is_released(
    start: Start,
) -> None:
    r = await start({"limits": {"max_connections_per_ip_allowed": 1}})
    first = await r.connect()
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    try:
        assert await asyncio.wait_for(reader.readline(), WAIT) == (
            b"421 4.7.0 too many connections from your address, try again later\r\n"
        )
        assert await asyncio.wait_for(reader.read(), WAIT) == b""
    finally:
        writer.close()
    assert r.handler.stats.sessions == 1
    assert await first.cmd("QUIT") == (221, "221 2.0.0 Bye")
    assert await closed(first)
    for _ in range(int(WAIT * 100)):  # the server side of the close runs on the loop
        if r.handler.guard.connections.total == 0:
            break
        await asyncio.sleep(0.01)
    assert r.handler.guard.connections.total == 0
    again = await r.connect()
    assert (await again.cmd("NOOP"))[0] == 250
    assert r.handler.stats.sessions == 2


async def test_too_many_errors_close_the_session_with_421(start: Start) -> None:
    r = await start({"limits": {"max_errors": 3}})
    c = await r.connect()
    assert (await c.cmd("BOGUS"))[0] == 500
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 503
    assert await c.cmd("DATA") == (503, "503 5.5.1 Error: need RCPT command")
    assert await c.reply() == (421, "421 4.7.0 relay.test too many errors, closing connection")
    assert await closed(c)


async def test_an_idle_client_gets_421_after_the_command_timeout(start: Start) -> None:
    r = await start({"limits": {"command_timeout": "0.2s"}})
    c = await r.connect()
    assert await c.reply() == (
        421,
        "421 4.4.2 relay.test timeout waiting for a command, closing connection",
    )
    assert await closed(c)


async def test_a_bare_newline_in_a_command_closes_the_connection(start: Start) -> None:
    r = await start()
    c = await r.connect()
    c.writer.write(b"NOOP\nNOOP\r\n")
    assert await c.reply() == (
        500,
        "500 5.5.2 Syntax error: bare CR or LF in command line (RFC 5321 2.3.8)",
    )
    assert await closed(c)
    assert r.handler.stats.by_reason == {"bare_newline": 1}


async def test_auth_is_not_offered_on_a_listener_without_it(start: Start) -> None:
    r = await start()
    c = await r.connect()
    code, _text = await c.cmd("AUTH PLAIN AGFsaWNlAHB3")
    assert code in (502, 538)  # aiosmtpd's answer when no mechanism is offered
    assert r.handler.stats.accepted == 0


def _users(tmp_path: Path) -> Path:
    from relay.inbound import auth

    path = tmp_path / "users"
    path.write_text(f"alice:{auth.hash_password('right')}\n")
    return path


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


async def test_an_authenticated_client_relays_from_anywhere_in_its_own_namespace(
    start: Start, tmp_path: Path
) -> None:
    users = _users(tmp_path)
    r = await start(
        {
            "listen": [
                {
                    "address": "127.0.0.1:2525",
                    "allow": ["10.0.0.0/8"],
                    "auth": {"users_file": str(users), "allow_plaintext": True},
                }
            ],
            "auth": {"failure_delay": "0.01s", "max_failure_delay": "0.01s"},
            "local": {"domain": "corp.test"},
        }
    )
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 554  # not yet
    assert (await c.cmd("RSET"))[0] == 250
    code, text = await c.cmd("AUTH PLAIN " + _b64("\0alice\0right"))
    assert code == 235, text
    content = message(body=b"hi\r\n").replace(b"To: user@example.org", b"To: root")
    text = await c.send("app@example.com", ["a@example.org"], content)
    m = QUEUED.match(text)
    assert m, text
    row = r.messages()[0]
    assert row[4] == "user:alice"
    stored = r.body(m.group(1))
    assert b" (relay) with ESMTPA id " in stored
    assert b"\r\nTo: root@corp.test\r\n" in stored  # qualified like the envelope
    assert r.recipients()[0][6] == row_key("user:alice", "a@example.org")


async def test_auth_exchange_errors(start: Start, tmp_path: Path) -> None:
    users = _users(tmp_path)
    r = await start(
        {
            "listen": [
                {
                    "address": "127.0.0.1:2525",
                    "auth": {"users_file": str(users), "allow_plaintext": True},
                }
            ],
            "auth": {"failure_delay": "0.01s", "max_failure_delay": "0.01s"},
        }
    )
    c = await r.connect()
    assert await c.cmd("AUTH LOGIN") == (334, "334 VXNlciBOYW1lAA==")
    assert await c.cmd("*") == (501, "501 5.7.0 Auth aborted")
    assert (await c.cmd("AUTH LOGIN"))[0] == 334
    assert await c.cmd("not base64!") == (501, "501 5.5.2 Can't decode base64")
    assert (await c.cmd("AUTH LOGIN"))[0] == 334
    c.writer.write(b"A" * 70_000 + b"\r\n")
    assert await c.reply() == (500, "500 5.5.6 Authentication exchange line is too long")
    assert (await c.cmd("NOOP"))[0] == 250  # the over-long line was read to its end


async def test_three_wrong_passwords_close_the_connection(start: Start, tmp_path: Path) -> None:
    users = _users(tmp_path)
    r = await start(
        {
            "listen": [
                {
                    "address": "127.0.0.1:2525",
                    "auth": {"users_file": str(users), "allow_plaintext": True},
                }
            ],
            "auth": {"failure_delay": "0.01s", "max_failure_delay": "0.01s"},
        }
    )
    c = await r.connect()
    wrong = "AUTH PLAIN " + _b64("\0alice\0wrong")
    assert (await c.cmd(wrong))[0] == 535
    assert (await c.cmd(wrong))[0] == 535
    code, text = await c.cmd(wrong)
    assert code == 421 and text.startswith("421 4.7.0 too many authentication failures"), text
    assert await closed(c)


async def test_metrics_count_accepted_deduplicated_and_refused(start: Start) -> None:
    from relay.ops.metrics import Metrics

    metrics = Metrics()
    r = await start({"limits": {"max_recipients": 1}}, stats=InboundStats(metrics=metrics))
    assert QUEUED.match(await r.send("app@example.com", ["a@example.org"], MSG))
    dup = await r.send("app@example.com", ["a@example.org"], MSG)
    assert dup == "250 2.0.0 Ok: already queued (duplicate suppressed)"
    c = await r.connect()
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    assert (await c.cmd("RCPT TO:<b@example.org>"))[0] == 452

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("relay_accepted_messages_total", lane="transactional") == 1
    assert value("relay_deduplicated_messages_total") == 1
    assert value("relay_rejected_total", reason="too_many_recipients") == 1


async def test_reconfigure_takes_new_lane_rules(start: Start) -> None:
    r = await start()
    assert QUEUED.match(await r.send("news@example.com", ["a@example.org"], MSG))
    base: dict[str, Any] = {
        "hostname": "relay.test",
        "spool": {"path": str(r.spool)},
        "lanes": {"rules": [{"lane": "bulk", "sender": "news@example.com"}]},
    }
    r.handler.reconfigure(from_mapping(base, r.spool.parent))
    assert QUEUED.match(
        await r.send("news@example.com", ["a@example.org"], message("<m2@app.example>"))
    )
    assert [m[6] for m in r.messages()] == ["transactional", "bulk"]


async def test_nul_characters_are_stripped_and_logged(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start()
    m = QUEUED.match(
        await r.send("app@example.com", ["a@example.org"], message(body=b"a\0b\0\r\n"))
    )
    assert m
    assert r.body(m.group(1)).endswith(b"\r\n\r\nab\r\n")
    [rec] = [x for x in caplog.records if "NUL characters removed" in x.getMessage()]
    assert rec.levelname == "WARNING"


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (r.levelname, getattr(r, "event", ""), dict(getattr(r, "fields", {})))
        for r in caplog.records
        if r.name == "relay.inbound"
    ]


async def test_the_log_records_every_outcome_with_its_fields(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay.inbound")
    r = await start()
    m = QUEUED.match(await r.send("app@example.com", ["a@example.org", "b@example.org"], MSG))
    assert m
    qid = m.group(1)
    size = r.messages()[0][3]
    assert await r.send("app@example.com", ["a@example.org"], MSG) == (
        "250 2.0.0 Ok: already queued (duplicate suppressed)"
    )
    keyed = message("<k@app.example>", Idempotency_Key="key-1")
    assert QUEUED.match(await r.send("", ["c@example.org"], keyed))
    other = message("<k@app.example>", body=b"other\r\n", Idempotency_Key="key-1")
    assert (await r.send("app@example.com", ["c@example.org"], other)).startswith("554 ")
    faults.arm("spool.commit", "eio", times=1)
    assert await r.send("app@example.com", ["d@example.org"], MSG) == UNAVAILABLE
    got = events(caplog)
    accepted = [e for e in got if e[1] == "accepted"]
    assert accepted[0] == (
        "INFO",
        "accepted",
        {
            "queue_id": qid,
            "message_id": "<m1@app.example>",
            "idempotency_key": None,
            "sender": "app@example.com",
            "rcpts": ["a@example.org", "b@example.org"],
            "duplicates": 0,
            "size": size,
            "lane": "transactional",
            "client": NS,
        },
    )
    assert accepted[1][2]["sender"] == "<>" and accepted[1][2]["idempotency_key"] == "key-1"
    assert [e for e in got if e[1] == "deduplicated"] == [
        (
            "INFO",
            "deduplicated",
            {"message_id": "<m1@app.example>", "rcpts": ["a@example.org"], "client": NS},
        )
    ]
    assert [e for e in got if e[1] == "idempotency_conflict"] == [
        (
            "WARNING",
            "idempotency_conflict",
            {"idempotency_key": "key-1", "rcpts": ["c@example.org"], "client": NS},
        )
    ]
    [failed] = [e for e in got if e[1] == "spool_error"]
    assert failed[0] == "ERROR" and failed[2]["error"] == "disk I/O error"
    assert re.fullmatch(r"[0-9A-F]{16}", str(failed[2]["queue_id"]))


def test_an_inbound_processs_writer_leaves_the_checkpoints_to_the_main_process(
    tmp_path: Path,
) -> None:
    """relay/inbound/processes.py: the writer of an inbound process checkpoints only past
    CHECKPOINT_PAGES WAL pages, ten times SQLite's 1,000, so that the main process's commits
    (which no SMTP reply waits on) do the checkpoints (relay/spool/writer.py, the rules)."""
    from relay.inbound import processes

    spool = {"path": str(tmp_path / "s")}
    config = from_mapping({"hostname": "relay.test", "spool": spool}, tmp_path)
    proc = processes.InboundProcess(config, notify_fd=None, listen_backlog=16)
    assert proc.writer.checkpoint_pages == processes.CHECKPOINT_PAGES == 10_000
    proc.writer.start()
    try:
        got = proc.writer.run_sync(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
        assert got == 10_000
    finally:
        proc.writer.close()
