"""What the nodes of a draining fleet wait on: bench/fleet.py's drain (N messages queued with
the upstream down, then the sink up and `relay queue flush`) with the relays' PostgreSQL
backends sampled from pg_stat_activity every ~3 ms while they drain (bench/README.md,
"Two processes draining").

    .venv/bin/python bench/fleet_waits.py --procs 2 --n 3000

Prints one JSON line (rates, the cores the relays, their backends and the sink kept
busy), one with the shares of the busy samples (a row lock, idle in transaction, the
COMMIT's WAL flush), and the most frequent (state, wait type, wait event, statement).
Another tree (the code before a change): run this file from that tree's bench/ with
PYTHONPATH set to it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet as F  # bench/fleet.py, beside this file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--n", type=int, default=3000)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relay-fleet-waits-"))
    sink = F.Sink(work, "python")
    nodes: list[F.Relay] = []
    waits: collections.Counter[tuple[Any, ...]] = collections.Counter()
    done = threading.Event()
    try:
        with F.pg_schema() as dsn:
            for k in range(a.procs):
                nodes.append(F.Relay(work, f"waits{a.procs}-n{k}", sink.port, dsn, 1))
            _took, ok, errors = F.load("python", nodes[0].port, a.n, 20, 2048)
            if errors:
                print(f"! {len(errors)} load errors, e.g. {errors[:3]}")
            while True:  # settled: everything queued, nothing in flight
                total, sending = F.pg_rows(
                    dsn,
                    "SELECT count(*), count(*) FILTER (WHERE state = 'sending') FROM recipients",
                )
                if total >= ok and not sending:
                    break
                time.sleep(0.1)
            name = dsn.rsplit("application_name=", 1)[-1]

            def sample() -> None:
                with psycopg.connect(F.PG_BASE, autocommit=True) as c:
                    while not done.is_set():
                        for st, wt, we, q in c.execute(
                            "SELECT state, wait_event_type, wait_event, left(query, 60)"
                            " FROM pg_stat_activity WHERE application_name = %s",
                            (name,),
                        ):
                            if st == "idle":
                                waits[("idle", None, None, None)] += 1
                            else:
                                show = wt == "Lock" or st == "active"
                                waits[(st, wt, we, q if show else None)] += 1
                        time.sleep(0.003)

            sampler = threading.Thread(target=sample, daemon=True)
            sink.go()
            sampler.start()
            assert sink.proc is not None
            cpu0 = (
                sum(F.cpu_of_tree(r.proc.pid) for r in nodes),
                F.cpu_of_backends(dsn),
                F.cpu_of_tree(sink.proc.pid),
            )
            t0 = time.monotonic()
            nodes[0].cli("queue", "flush")
            t_cli = time.monotonic()
            marks = sink.track(ok, 120)
            cpu1 = (
                sum(F.cpu_of_tree(r.proc.pid) for r in nodes),
                F.cpu_of_backends(dsn),
                F.cpu_of_tree(sink.proc.pid),
            )
            done.set()
            sampler.join()
    finally:
        done.set()
        for r in nodes:
            r.stop()
        sink.stop()
        shutil.rmtree(work, ignore_errors=True)
    took = marks["all"] - t0
    steady = (ok * 9 // 10 - ok // 10) / max(1e-9, marks["p90"] - marks["p10"])
    print(
        json.dumps(
            {
                "procs": a.procs,
                "messages": ok,
                "cli_s": round(t_cli - t0, 2),
                "drain_s": round(took, 2),
                "drain_per_s": round(ok / took),
                "steady_per_s": round(steady),
                "cores_relays_pg_sink": [
                    round((y - x) / took, 2) for x, y in zip(cpu0, cpu1, strict=True)
                ],
                "loadavg": os.getloadavg()[0],
            }
        )
    )
    busy = sum(v for k, v in waits.items() if k[0] != "idle")
    share = {
        "row_lock": sum(
            v for k, v in waits.items() if k[1] == "Lock" and k[2] in ("transactionid", "tuple")
        ),
        "idle_in_transaction": sum(v for k, v in waits.items() if k[0] == "idle in transaction"),
        "wal_flush": sum(v for k, v in waits.items() if k[2] == "WALSync"),
    }
    print(
        json.dumps(
            {"busy_samples": busy, **{k: round(v / max(busy, 1), 3) for k, v in share.items()}}
        )
    )
    for k, v in waits.most_common(10):
        print(v, k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
