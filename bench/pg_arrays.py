"""Writer-thread CPU of the hot PostgreSQL statements with their arrays sent as text literals
(relay/spool/pg.py `array_literal`) or as psycopg's binary lists, alternated batch by batch
on one fresh schema of RELAY_TEST_PG (bench/README.md, issue 31):

    .venv/bin/python bench/pg_arrays.py [MESSAGES]

Accepts of five 2 KiB messages, then claims of ten and records of ten (two calls of five),
each transaction timed with time.thread_time(); the server backend's CPU from /proc (clock
ticks, summed per mode over the run)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import cpu_seconds  # the CPU of a process, from /proc

from relay.spool import ops, pg
from relay.spool.model import RcptState
from tests.pgserver import own_schema
from tests.spool.test_ops import spool_message

TEXT = pg._texts_for_arrays
MODES = {"text": TEXT, "binary": lambda _slots, p: p}


def main(n: int) -> None:
    cpu: dict[str, dict[str, list[float]]] = {
        m: {"accept": [], "claim": [], "record": []} for m in MODES
    }
    server = dict.fromkeys(MODES, 0.0)
    msgs = dict.fromkeys(MODES, 0)
    body = b"Subject: x\r\n\r\n" + b"y" * 2000
    with own_schema() as dsn:
        c = pg.connect(dsn)
        bpid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        try:
            for b in range(n // 5):
                mode = "text" if b % 2 else "binary"
                pg._texts_for_arrays = MODES[mode]  # type: ignore[assignment]
                items = [
                    (
                        spool_message(f"Q{5 * b + i:07d}", [f"r{5 * b + i}@x{i}.test"], body=body),
                        60.0,
                    )
                    for i in range(5)
                ]
                t, s0 = time.thread_time(), cpu_seconds(bpid)
                c.execute("BEGIN")
                ops.accept_many(c, items)
                c.execute("COMMIT")
                cpu[mode]["accept"].append((time.thread_time() - t) / 5)
                server[mode] += cpu_seconds(bpid) - s0
                msgs[mode] += 5
            now = 1_700_000_100.0
            for b in range(n // 10):
                mode = "text" if b % 2 else "binary"
                pg._texts_for_arrays = MODES[mode]  # type: ignore[assignment]
                t, s0 = time.thread_time(), cpu_seconds(bpid)
                envs: dict[str, Any] = {}
                c.execute("BEGIN")
                claims = ops.claim_due(c, now, 10, owner="n", lease_until=now + 60, envelopes=envs)
                c.execute("COMMIT")
                t1 = time.thread_time()
                if not claims:
                    break
                outs = [
                    ops.RcptUpdate(
                        cl.rcpt_id,
                        cl.msg_id,
                        RcptState.DELIVERED,
                        True,
                        None,
                        "250 2.0.0 Ok: queued as X",
                        log=ops.AttemptLog("delivered", "250 2.0.0 Ok", cl.destination, "h", 0.004),
                        counters=(f"dest:{cl.destination}",),
                    )
                    for cl in claims
                ]
                day = "2026-12-06"
                c.execute("BEGIN")
                ops.record_many(c, [(outs[:5], now, day), (outs[5:], now, day)], owner="n")
                c.execute("COMMIT")
                t2 = time.thread_time()
                cpu[mode]["claim"].append((t1 - t) / len(claims))
                cpu[mode]["record"].append((t2 - t1) / len(claims))
                server[mode] += cpu_seconds(bpid) - s0
                msgs[mode] += len(claims)
        finally:
            pg._texts_for_arrays = TEXT
            c.close()
    for what in ("accept", "claim", "record"):
        a, t_ = cpu["binary"][what], cpu["text"][what]
        print(
            f"{what:7} writer CPU per message: binary lists {statistics.mean(a) * 1e6:6.1f} us,"
            f" text literals {statistics.mean(t_) * 1e6:6.1f} us ({len(a)}/{len(t_)} batches)"
        )
    per = {m: round(server[m] / max(msgs[m], 1) * 1e6, 1) for m in MODES}
    print(f"server backend CPU per message, everything: {per} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
