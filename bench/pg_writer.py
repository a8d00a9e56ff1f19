"""The spool writer alone on PostgreSQL: where a message's spool time goes (bench/README.md,
"Where the time goes on PostgreSQL").

    .venv/bin/python bench/pg_writer.py                      # 5,000 accepts, 20 at a time
    .venv/bin/python bench/pg_writer.py --profile            # and a cProfile of the writer
    .venv/bin/python bench/pg_writer.py --record             # claims and records as well

No SMTP: 20 (--concurrency) asyncio tasks each run the daemon's accept job for one 2 KiB
message with one recipient, --messages times in all, through one SpoolWriter on a fresh
schema (RELAY_TEST_PG, default postgresql://root@127.0.0.1:5432/test), as the inbound
sessions do. With --record, after the accepts, claim passes of 100 and one record job per
claimed recipient (delivered, with its attempt log and counters), 20 at a time, as the
engine's workers do. Prints messages/s, the writer's batches (jobs per batch, commit time),
the jobs it ran grouped, and the statements the server ran per message (from
pg_stat_statements when the server has it loaded, else psycopg's own count of the
statements sent, with their time in the driver). --profile: cProfile of the writer thread,
the top 25 functions by their own time. The same script runs on an older tree (it only
uses ops.accept / ops.record when the grouped jobs do not exist there).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from relay.config import PgSpool  # noqa: E402
from relay.spool import ops, pg  # noqa: E402
from relay.spool import writer as writer_mod  # noqa: E402

PG_BASE = os.environ.get("RELAY_TEST_PG", "postgresql://root@127.0.0.1:5432/test")
BODY = b"Subject: x\r\n\r\n" + b"x" * 2000 + b"\r\n"


class Counted:
    """psycopg statements sent by the writer's connection: count and time in execute."""

    def __init__(self) -> None:
        self.n = 0
        self.seconds = 0.0
        self.by: dict[str, list[float]] = {}


def instrument(counted: Counted) -> None:
    real = pg.PgConnection.execute

    def execute(self: pg.PgConnection, sql: str, params: Any = ()) -> Any:
        t0 = time.perf_counter()
        try:
            return real(self, sql, params)
        finally:
            dt = time.perf_counter() - t0
            counted.n += 1
            counted.seconds += dt
            key = " ".join(sql.split())[:60]
            slot = counted.by.setdefault(key, [0, 0.0])
            slot[0] += 1
            slot[1] += dt

    pg.PgConnection.execute = execute  # type: ignore[method-assign]


def message(i: int, run: str) -> ops.NewMessage:
    qid = ops.new_queue_id()
    return ops.NewMessage(
        queue_id=qid,
        message_id=f"<{run}.{i}@bench>",
        sender="from@bench.example",
        size=len(BODY),
        created_at=time.time(),
        client="listener:smtp",
        peer="127.0.0.1",
        lane="transactional",
        lane_prio=0,
        identity="bench.example",
        body=BODY,
        body_path=None,
        recipients=(ops.NewRecipient("to@dest.example", "dest.example", f"{run}:{i}"),),
        listener="smtp",
    )


def accept_job(msg: ops.NewMessage) -> Any:
    grouped = getattr(writer_mod, "Grouped", None)
    many = getattr(ops, "accept_many", None)
    if grouped is not None and many is not None:
        return grouped(many, (msg, 3600.0))
    return lambda c: ops.accept(c, msg, 3600.0)


def record_job(cl: ops.Claim) -> Any:
    log = ops.AttemptLog("delivered", "250 ok", cl.destination, "127.0.0.1", 0.01)
    out = ops.RcptUpdate(
        cl.rcpt_id,
        cl.msg_id,
        ops.RcptState.DELIVERED,
        True,
        None,
        "250 ok",
        None,
        log,
        counters=(f"dest:{cl.destination}",),
    )
    now, day = time.time(), "2026-12-04"
    try:
        from relay.delivery import attempt

        rec = attempt._Record((out,), now, day, "bench", None, [], 60.0, ())
        return writer_mod.Grouped(attempt.record_jobs, rec)
    except AttributeError:
        return lambda c: ops.record(c, [out], now, day, owner="bench")


async def run(w: writer_mod.SpoolWriter, args: argparse.Namespace) -> dict[str, float]:
    run_id = uuid.uuid4().hex[:8]
    sem = asyncio.Semaphore(args.concurrency)

    async def one(job: Any) -> None:
        async with sem:
            await w.run(job)

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    await asyncio.gather(*(one(accept_job(message(i, run_id))) for i in range(args.messages)))
    out["accept_s"] = time.perf_counter() - t0
    if args.record:
        t0 = time.perf_counter()
        tasks = []
        while True:
            claims = await w.run(
                lambda c: ops.claim_due(c, time.time(), 100, owner="bench", lease_until=1e12)
            )
            if not claims:
                break
            tasks += [asyncio.ensure_future(one(record_job(cl))) for cl in claims]
        await asyncio.gather(*tasks)
        out["record_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    schema = f"bench_writer_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_BASE, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
        has_pss = bool(
            c.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone()
        ) and "pg_stat_statements" in str(c.execute("SHOW shared_preload_libraries").fetchone())
    sep = "&" if "?" in PG_BASE else "?"
    dsn = f"{PG_BASE}{sep}options=-c%20search_path%3D{schema}"
    counted = Counted()
    instrument(counted)
    prof = cProfile.Profile()
    w = writer_mod.SpoolWriter(Path(f"/tmp/{schema}"), PgSpool(dsn))
    if args.profile:
        real_run = w._run

        def profiled() -> None:
            prof.enable()
            try:
                real_run()
            finally:
                prof.disable()

        w._run = profiled  # type: ignore[method-assign]
    w.start()
    try:
        if has_pss:
            with psycopg.connect(PG_BASE, autocommit=True) as c:
                c.execute("SELECT pg_stat_statements_reset()")
        counted.n, counted.seconds, counted.by = 0, 0.0, {}
        b0, j0, s0 = w.batches, w.jobs, w.commit_seconds_total
        t = asyncio.run(run(w, args))
        batches, jobs = w.batches - b0, w.jobs - j0
        busy = w.commit_seconds_total - s0
    finally:
        w.close()
        with psycopg.connect(PG_BASE, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")
    n = args.messages
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{n} messages, {args.concurrency} at a time; load average {load}")
    print(f"accept: {t['accept_s']:.2f} s = {n / t['accept_s']:,.0f} messages/s")
    if "record_s" in t:
        print(f"claim + record: {t['record_s']:.2f} s = {n / t['record_s']:,.0f} recipients/s")
    print(
        f"writer: {batches} batches, {jobs / max(batches, 1):.1f} jobs per batch,"
        f" {busy / max(batches, 1) * 1000:.2f} ms per batch,"
        f" busy {busy:.2f} s; grouped jobs: {getattr(w, 'grouped', 0)}"
    )
    print(
        f"statements sent by the writer: {counted.n} = {counted.n / n:.2f} per message;"
        f" time in psycopg's execute: {counted.seconds:.2f} s"
        f" ({counted.seconds / max(busy, 1e-9):.0%} of the writer's busy time)"
    )
    for key, (calls, secs) in sorted(counted.by.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {calls:7d} {secs:7.2f} s  {secs / calls * 1e6:7.0f} us  {key}")
    if has_pss:
        with psycopg.connect(PG_BASE, autocommit=True) as c:
            rows = c.execute(
                "SELECT calls, total_exec_time, rows, query FROM pg_stat_statements"
                " WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY total_exec_time DESC"
                " LIMIT 15"
            ).fetchall()
        print("pg_stat_statements (server execution time):")
        for calls, ms, nrows, q in rows:
            print(f"  {calls:7d} {ms / 1000:7.2f} s {nrows:8d} rows  {' '.join(q.split())[:70]}")
    if args.profile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    _ = threading  # the writer is a thread: cProfile above covers it alone


if __name__ == "__main__":
    main()
