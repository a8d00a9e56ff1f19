"""The spool writer alone on PostgreSQL: where a message's spool time goes (bench/README.md,
"Where the time goes on PostgreSQL").

    .venv/bin/python bench/pg_writer.py                      # 5,000 accepts, 20 at a time
    .venv/bin/python bench/pg_writer.py --profile            # and a cProfile of the writer
    .venv/bin/python bench/pg_writer.py --record             # claims and records as well

No SMTP: 20 (--concurrency) asyncio tasks per node each run the daemon's accept job for
one 2 KiB message with one recipient, --messages in all, through one SpoolWriter per node
(--nodes: writers of their own, one connection each, on one fresh schema of RELAY_TEST_PG,
default postgresql://root@127.0.0.1:5432/test), as the inbound sessions do. With --record,
after the accepts, each node runs claim passes of 100 and one record job per claimed
recipient (delivered, with its attempt log and counters), 20 at a time, at most 400
claimed and not recorded (the engine's delivery.batch 100, x 4).

Prints messages/s, the writers' batches (jobs per batch, time per batch), the jobs run
grouped, the WAL written per message, the statements the writers sent per message with
their time in psycopg's execute (by statement), the statements prepared on the server
with their generic and custom plans, and, when the server has pg_stat_statements loaded
(bench/pg_private.sh), the server's execution time by statement. --profile: cProfile of
the first writer's thread, the top 25 functions by their own time. The same script runs
on an older tree (it uses ops.accept / ops.record when the grouped jobs do not exist).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from relay.config.tree import PgSpool  # noqa: E402
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
    qid = f"{run.upper()}{i:08X}"  # unique: new_queue_id's 20 random bits collide here
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


def record_job(cl: ops.Claim, owner: str) -> Any:
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
        from relay.delivery import recorder

        rec = recorder._Record((out,), now, day, owner, None, [], 60.0, ())
        return writer_mod.Grouped(recorder.record_jobs, rec)
    except AttributeError:
        return lambda c: ops.record(c, [out], now, day, owner=owner)


async def run(ws: list[writer_mod.SpoolWriter], args: argparse.Namespace) -> dict[str, float]:
    """Accepts spread over the writers (the nodes), then each node's claim and record loop."""
    run_id = uuid.uuid4().hex[:8]
    sems = [asyncio.Semaphore(args.concurrency) for _ in ws]

    async def one(k: int, job: Any) -> None:
        async with sems[k]:
            await ws[k].run(job)

    async def node(k: int) -> None:
        w, owner = ws[k], f"bench{k}"
        tasks: list[asyncio.Future[None]] = []
        while True:  # at most 4 passes in flight, as the engine (delivery.batch x 4)
            claims = await w.run(
                lambda c: ops.claim_due(c, time.time(), 100, owner=owner, lease_until=1e12)
            )
            if not claims:
                break
            tasks += [asyncio.ensure_future(one(k, record_job(cl, owner))) for cl in claims]
            if len(tasks) >= 400:
                await asyncio.gather(*tasks[:100])
                tasks = tasks[100:]
        await asyncio.gather(*tasks)

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    await asyncio.gather(
        *(one(i % len(ws), accept_job(message(i, run_id))) for i in range(args.messages))
    )
    out["accept_s"] = time.perf_counter() - t0
    if args.record:
        t0 = time.perf_counter()
        await asyncio.gather(*(node(k) for k in range(len(ws))))
        out["record_s"] = time.perf_counter() - t0
    return out


async def child(args: argparse.Namespace) -> None:
    """One node of --procs: its writer on the shared schema, from the start time on."""
    sep = "&" if "?" in PG_BASE else "?"
    w = writer_mod.SpoolWriter(
        Path(f"/tmp/{args.child}-{os.getpid()}"),
        PgSpool(f"{PG_BASE}{sep}options=-c%20search_path%3D{args.child}"),
    )
    w.start()
    try:
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        t = await asyncio.to_thread(lambda: asyncio.run(run([w], args)))
        print(json.dumps({"accept_end": args.start_at + t["accept_s"], "end": time.time()}))
    finally:
        w.close()


def fleet(args: argparse.Namespace) -> None:
    """The simulation of a fleet on one database (bench/README.md, "Sizing"): for each
    process count P of --procs, P processes (nodes: a writer each, no SMTP) start at
    the same moment on one fresh schema, each accepts --messages / P messages, 20 at a
    time, then claims and records what it finds due (any node's, as a fleet does), until
    nothing is left. Rates: all messages over the time from the start to the last node's
    last accept (accept) and to the last node's end (accept + claim + record)."""
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| nodes | messages | accepts/s (all nodes) | accepted, claimed and recorded/s |")
    print("|---:|---:|---:|---:|")
    for procs in (int(p) for p in args.procs.split(",")):
        schema = f"bench_writer_{uuid.uuid4().hex[:12]}"
        sep = "&" if "?" in PG_BASE else "?"
        with psycopg.connect(PG_BASE, autocommit=True) as c:
            c.execute(f"CREATE SCHEMA {schema}")
        try:
            pg.connect(f"{PG_BASE}{sep}options=-c%20search_path%3D{schema}").close()  # migrate
            start = time.time() + 2.0 + 0.2 * procs
            each = args.messages // procs
            kids = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        schema,
                        "--start-at",
                        str(start),
                        "--messages",
                        str(each),
                        "--concurrency",
                        str(args.concurrency),
                        "--record",
                    ],
                    stdout=subprocess.PIPE,
                )
                for _ in range(procs)
            ]
            outs = [
                json.loads((k.communicate()[0] or b"{}").decode().strip().splitlines()[-1])
                for k in kids
            ]
        finally:
            with psycopg.connect(PG_BASE, autocommit=True) as c:
                c.execute(f"DROP SCHEMA {schema} CASCADE")
        n = each * procs
        acc = n / (max(o["accept_end"] for o in outs) - start)
        end = n / (max(o["end"] for o in outs) - start)
        print(f"| {procs} | {n:,} | {acc:,.0f} | {end:,.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--nodes", type=int, default=1, help="writers (nodes) on the one schema")
    ap.add_argument("--procs", default="", help="e.g. 1,2,4: a process per node (see fleet())")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # schema, for --procs
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.procs:
        fleet(args)
        return
    if args.child:
        asyncio.run(child(args))
        return
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
    ws = [
        writer_mod.SpoolWriter(Path(f"/tmp/{schema}-{k}"), PgSpool(dsn)) for k in range(args.nodes)
    ]
    w = ws[0]
    if args.profile:
        real_run = w._run

        def profiled() -> None:
            prof.enable()
            try:
                real_run()
            finally:
                prof.disable()

        w._run = profiled  # type: ignore[method-assign]
    for x in ws:
        x.start()
    try:
        if has_pss:
            with psycopg.connect(PG_BASE, autocommit=True) as c:
                c.execute("SELECT pg_stat_statements_reset()")
        counted.n, counted.seconds, counted.by = 0, 0.0, {}
        b0, j0, s0 = (
            sum(getattr(x, a) for x in ws) for a in ("batches", "jobs", "commit_seconds_total")
        )
        lsn0 = w.run_sync(lambda c: c.execute("SELECT pg_current_wal_lsn()").fetchone()[0])
        t = asyncio.run(run(ws, args))
        wal = w.run_sync(
            lambda c: c.execute("SELECT pg_current_wal_lsn() - ?::pg_lsn", (lsn0,)).fetchone()[0]
        )
        batches = sum(x.batches for x in ws) - b0
        jobs = sum(x.jobs for x in ws) - j0
        busy = sum(x.commit_seconds_total for x in ws) - s0
        prepared = w.run_sync(
            lambda c: c.execute(
                "SELECT generic_plans, custom_plans, statement FROM pg_prepared_statements"
                " ORDER BY generic_plans + custom_plans DESC"
            ).fetchall()
        )
    finally:
        for x in ws:
            x.close()
        with psycopg.connect(PG_BASE, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")
    n = args.messages
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{n} messages, {args.nodes} node(s), {args.concurrency} at a time each; load {load}")
    print(f"accept: {t['accept_s']:.2f} s = {n / t['accept_s']:,.0f} messages/s")
    if "record_s" in t:
        print(f"claim + record: {t['record_s']:.2f} s = {n / t['record_s']:,.0f} recipients/s")
    print(
        f"writer: {batches} batches, {jobs / max(batches, 1):.1f} jobs per batch,"
        f" {busy / max(batches, 1) * 1000:.2f} ms per batch,"
        f" busy {busy:.2f} s; grouped jobs: {sum(getattr(x, 'grouped', 0) for x in ws)}"
    )
    print(f"WAL written: {int(wal):,} bytes = {int(wal) / n:,.0f} per message")
    print(
        "statements the writers executed (BEGIN, SAVEPOINT, RELEASE: sent with the next):"
        f" {counted.n} = {counted.n / n:.2f} per message;"
        f" time in psycopg's execute: {counted.seconds:.2f} s"
        f" ({counted.seconds / max(busy, 1e-9):.0%} of the writer's busy time)"
    )
    for key, (calls, secs) in sorted(counted.by.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {calls:7d} {secs:7.2f} s  {secs / calls * 1e6:7.0f} us  {key}")
    print(f"prepared on the server (psycopg's prepare_threshold): {len(prepared)} statements")
    for generic, custom, stmt in prepared[:8]:
        print(f"  generic {generic:6d} custom {custom:6d}  {' '.join(stmt.split())[:60]}")
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
