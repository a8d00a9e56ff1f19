"""Benchmark: an allow-listed app's latency during a connection flood and during AUTH guessing.

    python bench/flood.py [--messages 300] [--flood 2000] [--guessers 50] [--phases ...]

Starts a real relay daemon (subprocess, its own temporary spool, the default limits) and a
real aiosmtpd upstream sink on loopback (both from tests/harness.py). The listener's `allow`
is 127.0.0.1/32: the app sends from 127.0.0.1, the attackers from other loopback addresses.
In each phase the app sends --messages messages one after the other, each on a new
connection (as PHP mail() or cron do), and the time from connect to the 250 after DATA is
measured. Phases:

- baseline: nothing else going on.
- flood: --flood connections from 127.0.0.2 at once, each reconnecting as soon as it is
  closed (a refused one gets `421 4.7.0` at once; the 50 admitted ones are held open).
- auth: --guessers clients, each from its own address (127.0.1.x), sending wrong AUTH PLAIN
  passwords as fast as the relay answers (three per connection, then reconnect), with the
  default per-IP delays and bans.
- auth-nodelay: the same with the per-IP delays and bans switched off
  (`auth: {failure_delay: 0, max_failures_per_ip: 0}`): every guess costs a scrypt, so this
  is the worst case for the CPU; only the thread pool keeps the event loop free.

The attackers run in a separate process (asyncio), so that they do not share the app's GIL.
Prints p50/p99/max per phase and what the attackers got.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import platform
import resource
import smtplib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.inbound import auth  # noqa: E402
from tests.harness import (  # noqa: E402
    RelayProcess,
    Upstream,
    deep_merge,
    make_message,
    smarthost_config,
)

APP = "127.0.0.1"


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- attackers (in their own process) -------------------------------------------------------


async def _flooder(port: int, source: str, stop: asyncio.Event, stats: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(0.05)
            continue
        stats["connections"] += 1
        try:
            first = await reader.readline()
            if first.startswith(b"421"):
                stats["refused_421"] += 1
            elif first.startswith(b"220"):
                stats["admitted"] += 1
            while not stop.is_set() and await reader.read(1024):  # hold it open
                pass
        except OSError:
            pass
        finally:
            writer.close()


async def _guesser(port: int, source: str, stop: asyncio.Event, stats: dict[str, int]) -> None:
    blob = base64.b64encode(b"\0alice\0wrong-password").decode()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(0.05)
            continue
        try:
            if not (await reader.readline()).startswith(b"220"):
                stats["refused_421"] += 1
                continue
            writer.write(b"EHLO guesser.test\r\n")
            while (await reader.readline())[3:4] == b"-":
                pass
            while not stop.is_set():
                writer.write(f"AUTH PLAIN {blob}\r\n".encode())
                reply = await reader.readline()
                if not reply:
                    break
                stats["guesses"] += 1
                if reply.startswith(b"421"):
                    break
        except OSError:
            pass
        finally:
            writer.close()


def attack(kind: str, port: int, n: int, ready: Any, stop_flag: Any, out: Any) -> None:
    raise_nofile()

    async def main() -> None:
        stop = asyncio.Event()
        stats = {
            "connections": 0,
            "admitted": 0,
            "refused_421": 0,
            "connect_errors": 0,
            "guesses": 0,
        }
        if kind == "flood":
            tasks = [
                asyncio.create_task(_flooder(port, "127.0.0.2", stop, stats)) for _ in range(n)
            ]
        else:
            tasks = [
                asyncio.create_task(_guesser(port, f"127.0.1.{1 + i % 250}", stop, stats))
                for i in range(n)
            ]
        ready.set()
        t0 = time.monotonic()
        # a multiprocessing.Event set by the parent process: wait for it off the loop
        await asyncio.to_thread(stop_flag.wait)
        stats["seconds"] = round(time.monotonic() - t0, 1)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out.put(stats)

    asyncio.run(main())


# --- the app --------------------------------------------------------------------------------


def app_latencies(port: int, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.monotonic()
        with smtplib.SMTP("127.0.0.1", port, timeout=60, source_address=(APP, 0)) as s:
            refused = s.sendmail("app@example.com", ["user@example.org"], make_message(i))
            if refused:
                raise RuntimeError(f"refused: {refused}")
        out.append(time.monotonic() - t0)
    return out


def run_phase(name: str, args: argparse.Namespace, up: Upstream, tmp: Path) -> dict[str, Any]:
    cfg = deep_merge(smarthost_config(up), {"destinations": {"*": {"rate": "unlimited"}}})
    if name == "auth-nodelay":
        cfg["auth"] = {"failure_delay": 0, "max_failures_per_ip": 0}
    r = RelayProcess(tmp / name, cfg)
    lst = r.config["listen"][0]
    lst["allow"] = [f"{APP}/32"]
    (r.workdir / "users").write_text(f"alice:{auth.hash_password('right-password')}\n")
    lst["auth"] = {"users_file": "users", "allow_plaintext": True}
    r.write_config()
    r.start()
    proc = None
    attackers: dict[str, int] = {}
    try:
        if name != "baseline":
            ctx = mp.get_context("spawn")
            ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
            kind = "flood" if name == "flood" else "auth"
            n = args.flood if kind == "flood" else args.guessers
            proc = ctx.Process(target=attack, args=(kind, r.port, n, ready, stop, out))
            proc.start()
            ready.wait(60)
            time.sleep(args.warmup)
        lat = app_latencies(r.port, args.messages)
        if proc is not None:
            stop.set()
            attackers = out.get(timeout=60)
            proc.join(30)
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
        r.stop(60)
    return {
        "phase": name,
        "n": len(lat),
        "p50_ms": round(percentile(lat, 50) * 1000, 1),
        "p99_ms": round(percentile(lat, 99) * 1000, 1),
        "max_ms": round(max(lat) * 1000, 1),
        "attackers": attackers,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=300, help="app messages per phase")
    ap.add_argument("--flood", type=int, default=2000, help="flood connections from one IP")
    ap.add_argument("--guessers", type=int, default=50, help="parallel AUTH guessers")
    ap.add_argument(
        "--warmup", type=float, default=2.0, help="seconds of attack before the app starts sending"
    )
    ap.add_argument("--phases", default="baseline,flood,auth,auth-nodelay")
    ap.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = ap.parse_args()
    raise_nofile()
    up = Upstream().start()
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="relay-flood-") as tmp:
            for name in args.phases.split(","):
                results.append(run_phase(name, args, up, Path(tmp)))
    finally:
        up.stop()
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps({"machine": machine, "phases": results}, indent=2))
        return 0
    print(
        f"machine: {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']},"
        f" {machine['date']}"
    )
    print(f"app: {args.messages} messages per phase, one connection each, from {APP} (allowed)")
    print(f"{'phase':<13} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}   attackers")
    for p in results:
        a = p["attackers"]
        desc = ", ".join(f"{k}={v}" for k, v in a.items() if v) if a else "-"
        print(
            f"{p['phase']:<13} {p['p50_ms']:>8.1f} {p['p99_ms']:>8.1f} {p['max_ms']:>8.1f}   {desc}"
        )
    worst = max(p["p99_ms"] for p in results)
    print(f"worst p99: {worst:.1f} ms ({'under' if worst < 1000 else 'OVER'} 1 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
