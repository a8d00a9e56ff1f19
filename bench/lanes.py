"""Benchmark: transactional latency under a bulk backlog.

    python bench/lanes.py [--bulk 5000] [--transactional 20] [--rate 200/s] ...

Starts a real relay daemon (subprocess, its own temporary spool) and a real aiosmtpd
upstream sink on loopback (both from tests/harness.py). Queues N bulk messages
(`Precedence: bulk`) over a few persistent SMTP sessions, then M transactional messages
one every --tx-interval seconds, and measures for every message the time from the relay's
250 after DATA ("accepted", taken when smtplib returns) to its arrival at the upstream (the
upstream's reply to the final dot). Prints p50/p95/max per lane and the bulk drain time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harness import (  # noqa: E402
    RelayProcess,
    Upstream,
    make_message,
    smarthost_config,
    smtp_session,
)

_MID = re.compile(rb"^Message-ID: <([^>]+)>", re.MULTILINE | re.IGNORECASE)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def submit(
    port: int, items: list[tuple[str, bytes]], sessions: int, interval: float = 0.0
) -> dict[str, float]:
    accepted: dict[str, float] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(chunk: list[tuple[str, bytes]]) -> None:
        try:
            with smtp_session(port) as s:
                for mid, data in chunk:
                    refused = s.sendmail("app@example.com", ["user@example.org"], data)
                    if refused:
                        raise RuntimeError(f"refused: {refused}")
                    with lock:
                        accepted[mid] = time.time()
                    if interval:
                        time.sleep(interval)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(items[i::sessions],)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return accepted


def summary(latencies: list[float]) -> dict[str, float]:
    return {
        "n": len(latencies),
        "p50": round(percentile(latencies, 50), 3),
        "p95": round(percentile(latencies, 95), 3),
        "max": round(max(latencies), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bulk", type=int, default=5000, help="bulk messages queued first")
    ap.add_argument(
        "--transactional", type=int, default=20, help="transactional messages queued after the bulk"
    )
    ap.add_argument("--rate", default="200/s", help="destination rate (token bucket)")
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--max-connections", type=int, default=10)
    ap.add_argument("--bulk-share", type=float, default=0.5)
    ap.add_argument("--sessions", type=int, default=4, help="parallel SMTP submit sessions")
    ap.add_argument(
        "--tx-interval", type=float, default=0.1, help="seconds between transactional submissions"
    )
    ap.add_argument("--timeout", type=float, default=600, help="give up after this long")
    ap.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = ap.parse_args()

    up = Upstream().start()
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        cfg = smarthost_config(
            up,
            destinations={
                "*": {
                    "rate": args.rate,
                    "burst": args.burst,
                    "max_connections": args.max_connections,
                }
            },
            lanes={"bulk": {"share": args.bulk_share}},
        )
        r = RelayProcess(Path(tmp) / "relay", cfg)
        r.start()
        try:
            bulk = [
                (
                    f"bulk-{i}@bench",
                    make_message(i, message_id=f"<bulk-{i}@bench>", headers={"Precedence": "bulk"}),
                )
                for i in range(args.bulk)
            ]
            tx = [
                (
                    f"tx-{j}@bench",
                    make_message(j, message_id=f"<tx-{j}@bench>", subject=f"password reset {j}"),
                )
                for j in range(args.transactional)
            ]
            t0 = time.time()
            bulk_acc = submit(r.port, bulk, args.sessions)
            t_bulk_submitted = time.time()
            tx_acc = submit(r.port, tx, 1, args.tx_interval)
            up.wait_for(args.bulk + args.transactional, timeout=args.timeout)
            arrivals: dict[str, float] = {}
            for m in up.received:
                mm = _MID.search(m.data)
                if mm:
                    arrivals.setdefault(mm.group(1).decode(), m.at)
        finally:
            r.stop()
            up.stop()

    tx_lat = [arrivals[k] - v for k, v in tx_acc.items()]
    bulk_lat = [arrivals[k] - v for k, v in bulk_acc.items()]
    last_tx = max(arrivals[k] for k in tx_acc)
    bulk_arr = [arrivals[k] for k in bulk_acc]
    result = {
        "config": {
            k: getattr(args, k)
            for k in (
                "bulk",
                "transactional",
                "rate",
                "burst",
                "max_connections",
                "bulk_share",
                "sessions",
                "tx_interval",
            )
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        },
        "bulk_submit_seconds": round(t_bulk_submitted - t0, 2),
        "bulk_submit_rate": round(args.bulk / (t_bulk_submitted - t0), 1),
        "transactional_latency": summary(tx_lat),
        "bulk_latency": summary(bulk_lat),
        "bulk_drain_seconds": round(max(bulk_arr) - min(bulk_acc.values()), 2),
        "bulk_delivered_before_last_transactional": sum(a <= last_tx for a in bulk_arr),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m = result["machine"]
    print(f"machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, {m['date']}")
    print(f"config: {json.dumps(result['config'])}")
    print(
        f"bulk submission: {args.bulk} messages in {result['bulk_submit_seconds']} s "
        f"({result['bulk_submit_rate']}/s over {args.sessions} sessions)"
    )
    print(f"{'lane':<14} {'n':>6} {'p50 s':>8} {'p95 s':>8} {'max s':>8}   accept -> upstream")
    for lane, s in (
        ("transactional", result["transactional_latency"]),
        ("bulk", result["bulk_latency"]),
    ):
        print(f"{lane:<14} {s['n']:>6} {s['p50']:>8.3f} {s['p95']:>8.3f} {s['max']:>8.3f}")
    print(
        f"bulk drain (first bulk accepted -> last bulk at upstream): "
        f"{result['bulk_drain_seconds']} s"
    )
    print(
        f"bulk delivered when the last transactional arrived: "
        f"{result['bulk_delivered_before_last_transactional']}/{args.bulk}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
