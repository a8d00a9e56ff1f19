"""Issue 27 items 3 and 4: feedback that outsiders cannot steer, applied in bounded writer
jobs, parsed off the event loop within bounds.

- A report suppresses only what is tied to our sending (VERP, upstream id, our Message-ID or
  queue id with a recipient of THAT message); an address alone is `unverified`: counted,
  logged, nothing suppressed, no row flipped (relay/feedback/apply.py).
- One report or webhook batch is applied at most EVENTS_PER_JOB events per writer job, and
  every lookup runs on an index (relay/feedback/service.py, relay/spool/db.py migration 9).
- Feedback mail is parsed in a child process (relay/feedback/worker.py); a message past the
  MIME bounds or the time budget is kept unread (relay/feedback/bounces.py PastBound)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from relay.config.tree import from_mapping
from relay.feedback import bounces, worker
from relay.feedback.apply import EVENTS_PER_JOB, acted_on, apply_events
from relay.feedback.bounces import PastBound, parse_feedback_mail
from relay.feedback.events import FeedbackEvent
from relay.feedback.service import FeedbackService
from relay.ops.metrics import Metrics
from relay.spool import db, ops, schema
from relay.spool.writer import SpoolWriter
from tests.feedback.test_apply import T0, ev, queue, run, state
from tests.pgserver import BACKENDS, open_backend

BOUNCES = "bounces@relay.test"
T = TypeVar("T")


def dsn(
    rcpts: list[str],
    *,
    original_mid: str | None = None,
    received_qid: str | None = None,
    report_id: str = "<r1@mx.example.org>",
) -> bytes:
    """An RFC 3464 report from a stranger: one failed block per address, and the original's
    headers with its Message-ID and our Received line when given."""
    blocks = "".join(
        f"Final-Recipient: rfc822; {r}\r\nAction: failed\r\nStatus: 5.1.1\r\n"
        f"Diagnostic-Code: smtp; 550 5.1.1 <{r}>: no such user\r\n\r\n"
        for r in rcpts
    )
    original = "From: app@example.com\r\nSubject: hi\r\n"
    if original_mid is not None:
        original += f"Message-ID: {original_mid}\r\n"
    if received_qid is not None:
        original = (
            "Received: from app ([127.0.0.1])\r\n"
            f"\tby relay.test (relay) with ESMTP id {received_qid}\r\n"
            "\tfor <x@y.z>; Thu, 3 Dec 2026 10:00:00 +0000\r\n" + original
        )
    return (
        "From: MAILER-DAEMON@mx.example.org (Mail Delivery System)\r\n"
        f"To: {BOUNCES}\r\nSubject: Undelivered Mail Returned to Sender\r\n"
        f"Message-ID: {report_id}\r\nMIME-Version: 1.0\r\n"
        'Content-Type: multipart/report; report-type=delivery-status; boundary="B1"\r\n\r\n'
        "--B1\r\nContent-Type: text/plain\r\n\r\nYour message could not be delivered.\r\n"
        "--B1\r\nContent-Type: message/delivery-status\r\n\r\n"
        "Reporting-MTA: dns; mx.example.org\r\n\r\n" + blocks + "--B1\r\n"
        "Content-Type: text/rfc822-headers\r\n\r\n" + original + "--B1--\r\n"
    ).encode()


def many_parts(n: int, boundary_param: str = "boundary=b") -> bytes:
    parts = b"".join(b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n" for _ in range(n))
    return (
        b"From: MAILER-DAEMON@x.example\r\nSubject: Undelivered Mail\r\n"
        b"Content-Type: multipart/mixed; " + boundary_param.encode() + b"\r\n\r\n" + parts
    ) + b"--b--\r\n"


# --- the matching rule, on both backends --------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    yield c
    c.close()


def suppressed(c: sqlite3.Connection) -> list[str]:
    return sorted(e["address"] for e in ops.suppression_list(c))


def test_an_address_alone_suppresses_nothing_and_flips_no_row(conn: sqlite3.Connection) -> None:
    ids = queue(conn, "Q1", ["u@dest.org"], delivered={"u@dest.org": "U1"})
    for n, kind in enumerate(("bounce", "complaint", "soft_bounce")):
        (res,) = run(conn, ev(type=kind, event_id=f"e{n}", recipient="U@dest.org"))
        assert (res.outcome, res.matched_by) == ("unverified", "address")
    assert suppressed(conn) == []
    assert state(conn, ids["u@dest.org"]) == "delivered"
    rows = conn.execute("SELECT outcome, msg_id, rcpt_id FROM feedback_events").fetchall()
    assert [tuple(r) for r in rows] == [("unverified", None, None)] * 3  # recorded, not tied
    assert (
        conn.execute("SELECT count(*) FROM attempts WHERE outcome != 'delivered'").fetchone()[0]
        == 0
    )


def test_a_report_naming_many_addresses_acts_on_recipients_of_that_message_only(
    conn: sqlite3.Connection,
) -> None:
    ids = queue(conn, "Q1", ["r@dest.org"], mid="m1@app.example", delivered={"r@dest.org": "U"})
    # other delivered addresses the report names, of other messages: untouched
    queue(conn, "Q2", ["o@dest.org"], mid="m2@app.example", delivered={"o@dest.org": "V"})
    events = parse_feedback_mail(
        dsn(["o@dest.org"] + [f"n{i}@dest.org" for i in range(998)] + ["r@dest.org"],
            original_mid="<m1@app.example>")
    )  # fmt: skip
    assert len(events) == 1000
    with db.transaction(conn):
        out = apply_events(conn, events, T0 + 10)
    assert [a.outcome for a in out].count("bounced") == 1
    assert {a.outcome for a in out} == {"bounced", "unverified", "unmatched"}
    assert suppressed(conn) == ["r@dest.org"]
    assert state(conn, ids["r@dest.org"]) == "bounced"
    assert state(conn, queue_ids(conn, "Q2")["o@dest.org"]) == "delivered"


def queue_ids(c: sqlite3.Connection, qid: str) -> dict[str, int]:
    rows = c.execute("SELECT id, address FROM recipients WHERE msg_id=?", (qid,))
    return {r[1]: r[0] for r in rows}


def test_our_queue_id_in_the_returned_headers_ties_a_report(conn: sqlite3.Connection) -> None:
    qid = "0123456789ABCDEF"
    ids = queue(conn, qid, ["q@dest.org", "p@dest.org"], delivered={"q@dest.org": "U"})
    events = parse_feedback_mail(dsn(["q@dest.org"], received_qid=qid.lower()))
    assert [e.queue_id for e in events] == [qid]
    (res,) = run(conn, *events)
    assert (res.outcome, res.matched_by, res.rcpt_id) == ("bounced", "queue_id", ids["q@dest.org"])
    # a queue id names the message, not any address: a stranger's address is no recipient
    (res,) = run(conn, ev(event_id="x", recipient="q2@dest.org", queue_id=qid))
    assert res.outcome == "unmatched"


def test_one_effect_per_recipient_row_across_chunks(conn: sqlite3.Connection) -> None:
    ids = queue(conn, "Q1", ["a@x.org"], delivered={"a@x.org": "U"})
    first = run(conn, ev(event_id="b", recipient="a@x.org", upstream_id="U"))
    assert [a.outcome for a in first] == ["bounced"]
    # the next chunk of the same report knows the row was acted on
    with db.transaction(conn):
        later = apply_events(
            conn,
            [ev(event_id="c", type="complaint", recipient="a@x.org", upstream_id="U")],
            T0 + 10,
            acted=acted_on(first),
        )
    assert [a.outcome for a in later] == ["repeat"]
    assert suppressed(conn) == ["a@x.org"]  # the global one only, no identity entry
    n = conn.execute("SELECT count(*) FROM attempts WHERE rcpt_id=? AND outcome != 'delivered'",
                     (ids["a@x.org"],)).fetchone()[0]  # fmt: skip
    assert n == 1


def test_address_lookups_use_the_index_not_the_delivered_rows(tmp_path: Path) -> None:
    c = db.connect(tmp_path / "spool")
    queue(c, "Q1", [f"d{i}@dest.org" for i in range(300)],
          delivered={f"d{i}@dest.org": f"U{i}" for i in range(300)})  # fmt: skip
    c.execute("ANALYZE")
    statements: list[str] = []
    c.set_trace_callback(statements.append)
    with db.transaction(c):
        apply_events(
            c,
            [
                ev(event_id="1", recipient="d1@dest.org"),
                ev(event_id="2", recipient="nobody@dest.org", message_id="<m@app.example>"),
                ev(event_id="3", recipient="d3@dest.org", upstream_id="U3"),
                ev(event_id="4", recipient="d4@dest.org", queue_id="Q1"),
            ],
            T0 + 10,
        )
    c.set_trace_callback(None)
    selects = [s for s in statements if s.lstrip().startswith("SELECT r.id")]
    assert selects
    for s in selects:
        plan = " | ".join(str(r[3]) for r in c.execute("EXPLAIN QUERY PLAN " + s))
        assert "SCAN r" not in plan and "SCAN recipients" not in plan, (s, plan)
        if "lower(r.address) = " in s and "r.state IN" in s:
            assert "recipients_address" in plan, plan
    c.close()


def test_the_address_index_is_added_to_an_existing_spool(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    # a spool at schema version 8: every migration before the index
    c = sqlite3.connect(db.db_path(spool), isolation_level=None)
    for version, script in enumerate(schema.MIGRATIONS[:8]):
        for stmt in schema.statements(script):
            c.execute(stmt)
        c.execute(f"PRAGMA user_version={version + 1}")
    c.close()
    c = db.connect(spool)
    names = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "recipients_address" in names
    c.close()


# --- the service: feedback mail and webhook batches ---------------------------------------------


@dataclass
class Jobs:
    """The writer jobs the service ran: feedback events inserted and statements, per job."""

    events: list[int]
    statements: list[int]


class _Counting:
    def __init__(self, conn: sqlite3.Connection, jobs: Jobs) -> None:
        self._conn, self._jobs = conn, jobs

    def execute(self, sql: str, params: Any = ()) -> Any:
        self._jobs.statements[-1] += 1
        if sql.startswith("INSERT INTO feedback_events"):
            self._jobs.events[-1] += 1
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class CountingWriter:
    def __init__(self, writer: SpoolWriter) -> None:
        self.writer, self.jobs = writer, Jobs([], [])

    async def run(self, job: Callable[[sqlite3.Connection], T], lazy: bool = False) -> T:
        def counted(c: sqlite3.Connection) -> T:
            self.jobs.events.append(0)
            self.jobs.statements.append(0)
            return job(cast(sqlite3.Connection, _Counting(c, self.jobs)))

        return await self.writer.run(counted, lazy)


@dataclass
class World:
    spool: Path
    service: FeedbackService
    writer: SpoolWriter
    counting: CountingWriter
    metrics: Metrics

    def sync(self, job: Callable[[sqlite3.Connection], T]) -> T:
        return self.writer.run_sync(lambda c: job(c))

    def not_applied(self, reason: str, provider: str = "mail") -> float:
        value = self.metrics.registry.get_sample_value(
            "relay_feedback_not_applied_total", {"provider": provider, "reason": reason}
        )
        return value or 0.0


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    config = from_mapping(
        {"hostname": "relay.test", "spool": {"path": str(tmp_path / "spool")},
         "feedback": {"address": BOUNCES}},
        tmp_path,
    )  # fmt: skip
    writer = SpoolWriter(config.spool_path)
    writer.start()
    counting = CountingWriter(writer)
    metrics = Metrics()
    service = FeedbackService(
        lambda: config,
        cast(SpoolWriter, counting),
        metrics,
        lambda: (0.0, []),
        lambda *a: None,
    )
    await service.start()
    yield World(config.spool_path, service, writer, counting, metrics)
    await service.close()
    writer.close()


def deliver(w: World, qid: str, rcpts: list[str], mid: str) -> dict[str, int]:
    c = db.connect(w.spool)  # a second connection, as the CLI's (tests.feedback.test_apply.queue)
    try:
        return queue(c, qid, rcpts, mid=mid, delivered={r: qid for r in rcpts})
    finally:
        c.close()


async def test_a_forged_dsn_for_a_delivered_address_suppresses_nothing(world: World) -> None:
    ids = deliver(world, "Q1", ["u@dest.org"], "m1@app.example")
    n = await world.service.mail(
        dsn(["u@dest.org"]), peer="203.0.113.9", sender="", rcpts=[BOUNCES]
    )
    assert n == 1
    assert world.sync(suppressed) == []
    assert world.sync(lambda c: state(c, ids["u@dest.org"])) == "delivered"
    assert world.not_applied("unverified") == 1.0
    events = world.sync(lambda c: ops.feedback_events(c, 10))
    assert [e["outcome"] for e in events] == ["unverified"]


async def test_a_dsn_with_our_message_id_suppresses_that_recipient_once(world: World) -> None:
    ids = deliver(world, "Q1", ["u@dest.org", "v@dest.org"], "m1@app.example")
    # the address twice (in two cases): one event (bounces.py reads an address once)
    report = dsn(["u@dest.org", "U@DEST.ORG"], original_mid="<m1@app.example>")
    assert await world.service.mail(report, peer="203.0.113.9", sender="", rcpts=[BOUNCES]) == 1
    # the same report mailed again: nothing more (a duplicate event)
    assert await world.service.mail(report, peer="203.0.113.9", sender="", rcpts=[BOUNCES]) == 1
    entries = world.sync(ops.suppression_list)
    assert [(e["address"], e["scope"]) for e in entries] == [("u@dest.org", "global")]
    assert world.sync(lambda c: state(c, ids["u@dest.org"])) == "bounced"
    assert world.sync(lambda c: state(c, ids["v@dest.org"])) == "delivered"
    late = world.sync(
        lambda c: c.execute("SELECT count(*) FROM attempts WHERE outcome='late_bounce'").fetchone()
    )
    assert late[0] == 1


async def test_a_report_naming_1000_addresses_is_applied_in_bounded_jobs(world: World) -> None:
    deliver(world, "Q1", ["r@dest.org"], "m1@app.example")
    deliver(world, "Q2", [f"d{i}@dest.org" for i in range(500)], "m2@app.example")
    names = [f"d{i}@dest.org" for i in range(500)] + [f"n{i}@dest.org" for i in range(499)]
    report = dsn([*names, "r@dest.org"], original_mid="<m1@app.example>")
    world.counting.jobs = Jobs([], [])
    assert await world.service.mail(report, peer="203.0.113.9", sender="", rcpts=[BOUNCES]) == 1000
    assert world.sync(suppressed) == ["r@dest.org"]
    jobs = world.counting.jobs
    applying = [n for n in jobs.events if n]
    assert sum(applying) == 1000 and len(applying) == 1000 // EVENTS_PER_JOB
    assert max(applying) <= EVENTS_PER_JOB
    # each event costs a bounded number of statements: no job grows with the spool or the batch
    assert max(jobs.statements) <= EVENTS_PER_JOB * 8
    assert world.not_applied("unverified") == 500.0
    assert world.not_applied("unmatched") == 499.0


async def test_300_unmatched_webhook_events_are_applied_in_bounded_jobs(world: World) -> None:
    deliver(world, "Q1", [f"d{i}@dest.org" for i in range(200)], "m1@app.example")
    events = [
        FeedbackEvent("generic", "bounce", f"x{i}@nowhere.example", f"id{i}") for i in range(300)
    ]
    world.counting.jobs = Jobs([], [])
    results = await world.service.apply(events)
    assert [a.outcome for a in results] == ["unmatched"] * 300
    assert world.counting.jobs.events == [EVENTS_PER_JOB] * (300 // EVENTS_PER_JOB)
    assert world.not_applied("unmatched", "generic") == 300.0


async def test_a_100k_part_message_is_kept_unread_and_the_loop_keeps_answering(
    world: World,
) -> None:
    """Bounded before the parser builds the parts (the declared boundary's delimiters are
    counted): past MAX_PARTS it is kept unread, in a few milliseconds of the child's time."""
    data = many_parts(100_000)
    gaps = await _gaps_while(world.service.mail(data, peer="p", sender="", rcpts=[BOUNCES]))
    assert max(gaps) < 0.5, max(gaps)
    (kept,) = world.sync(lambda c: ops.feedback_mail(c, 10, unread=True))
    assert kept["error"] == f"past a bound: more than {bounces.MAX_PARTS} MIME parts"
    assert kept["size"] == len(data)
    assert world.not_applied("past_bound") == 1.0


async def _gaps_while(work: Any) -> list[float]:
    """The gaps between the wake-ups of a 10 ms ticker on the loop while `work` runs."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)  # ticking before the work's first step runs
    try:
        await work
    finally:
        done = True
        await task
    return gaps


# --- the worker process -------------------------------------------------------------------------


async def test_a_parse_past_the_budget_is_killed_while_the_loop_answers() -> None:
    """A structure the pre-count does not see (an RFC 2231 `boundary*0=`: the stdlib parser
    builds all 100k parts, 2.7 s of CPU) runs in the child: the loop keeps its 10 ms ticks
    and the child is killed at the budget; the next message gets a new child."""
    w = worker.ParserWorker(budget=0.5)
    try:
        # a boundary the pre-count does not see (the stdlib takes any spaces before "=")
        data = many_parts(100_000, "boundary" + " " * 30 + "=b")
        assert bounces.mime_bound(data) is None
        started = time.monotonic()
        result: list[worker.Parsed] = []

        async def parse() -> None:
            result.append(await w.parse(data))

        gaps = await _gaps_while(parse())
        assert result[0].past_bound and "longer than 0.5 s" in (result[0].error or "")
        assert time.monotonic() - started < 5.0
        assert max(gaps) < 0.5, max(gaps)
        assert (w.started, w.killed) == (1, 1)
        ok = await w.parse(dsn(["a@b.example"]))
        assert [e.recipient for e in ok.events] == ["a@b.example"] and w.started == 2
    finally:
        await w.close()


async def test_the_child_exits_when_idle_and_a_new_one_takes_over() -> None:
    w = worker.ParserWorker(idle_exit=0.2)
    try:
        first = await w.parse(dsn(["a@b.example"]))
        assert first.error is None and w.started == 1
        await asyncio.sleep(0.6)
        again = await w.parse(dsn(["a@b.example"]))
        assert again == first and w.started == 2
    finally:
        await w.close()


def test_results_cross_the_pipe_unchanged() -> None:
    for data in (
        dsn(["a@b.example", "cafX@b.example"]).replace(b"cafX", b"caf\xe9"),  # not UTF-8
        b"From: someone@else.example\r\n\r\nnot a bounce\r\n",
        many_parts(300),
    ):  # fmt: skip
        parsed = worker.parse(data)
        assert worker.decode(worker.encode(parsed)) == parsed


# --- the bounds, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "bound"),
    [
        (many_parts(bounces.MAX_PARTS - 1), None),
        (many_parts(2 * bounces.MAX_PARTS + 1), "more than 100 MIME parts"),
        (
            b"".join(b"Content-Type: multipart/mixed; boundary=b%d\r\n\r\n--b%d\r\n" % (i, i)
                     for i in range(bounces.MAX_PARTS + 1)),
            "more than 100 multipart boundaries declared",
        ),
        (b"Content-Type: text/plain\r\n\r\n" + b"--b\r\n" * 100_000, None),  # none declared
        (b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n' + b"--b  \r\n" * 201,
         "more than 100 MIME parts"),
        (many_parts(2 * bounces.MAX_PARTS + 1, "boundary*0=b"), "more than 100 MIME parts"),
        (many_parts(2 * bounces.MAX_PARTS + 1, "boundary*=utf-8''b"), "more than 100 MIME parts"),
        (many_parts(2 * bounces.MAX_PARTS + 1, "boundary=\r\n b"), "more than 100 MIME parts"),
    ],
    ids=["99 parts", "201 parts", "101 boundaries", "undeclared", "quoted, padded", "2231",
         "2231 encoded", "folded"],
)  # fmt: skip
def test_mime_bound_counts_declared_delimiters(data: bytes, bound: str | None) -> None:
    assert bounces.mime_bound(data) == bound


def test_more_than_max_parts_or_depth_is_past_a_bound() -> None:
    with pytest.raises(PastBound, match="more than 100 MIME parts"):
        parse_feedback_mail(many_parts(bounces.MAX_PARTS + 1))
    nested = b"".join(
        b"Content-Type: multipart/mixed; boundary=n%d\r\n\r\n--n%d\r\n" % (i, i)
        for i in range(bounces.MAX_DEPTH + 2)
    )
    with pytest.raises(PastBound, match="nested deeper than 10"):
        parse_feedback_mail(b"From: MAILER-DAEMON@x\r\n" + nested + b"\r\nx\r\n")
    # a report within the bounds, whatever the number of recipient blocks, is read
    assert len(parse_feedback_mail(dsn([f"u{i}@x.example" for i in range(300)]))) == 300
