"""PostgreSQL spool and fleet benchmarks (README "Running a fleet on PostgreSQL"):

1. one node, SQLite against PostgreSQL: acceptance (messages/s until the last 250) and end
   to end (until the sink has them all), N x 2 KiB, the same load for both, alternated;
2. the drain rate of a PostgreSQL queue with 1, 2 and 3 relay processes on one machine:
   N messages queued while the destination is suspended, then `relay destination resume`
   and the time until the sink has them all.

Load: an asyncio client (aiosmtplib) with 20 sessions, each sending its share of messages
over one connection; the sink: aiosmtpd in a process of its own, counting. Postfix's
smtp-source is not used here: this compares the relay's two backends with each other,
not with a peer (bench/suite.py does that).

    .venv/bin/python bench/fleet.py                  # ~4 min on 2 cores
    .venv/bin/python bench/fleet.py --messages 1000 --rounds 1   # a quick look

Raw output: bench/results/fleet-<time>.txt and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiosmtplib
import psycopg
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PG_BASE = os.environ.get("RELAY_TEST_PG", "postgresql://root@127.0.0.1:5432/test")
SESSIONS = 20
SIZE = 2048

SINK = r"""
import asyncio, os, sys
from aiosmtpd.controller import Controller
path, port = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
n = 0
class H:
    async def handle_DATA(self, server, session, envelope):
        global n
        n += len(envelope.rcpt_tos)
        os.pwrite(fd, f"{n:>12}".encode(), 0)
        return "250 2.0.0 Ok: queued"
c = Controller(H(), hostname="127.0.0.1", port=port)
c.start()
print("ready", flush=True)
asyncio.new_event_loop().run_forever()
"""

out_lines: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    out_lines.append(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Sink:
    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.count_file = work / f"sink-{self.port}.count"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SINK, str(self.count_file), str(self.port)],
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self.proc.stdout.readline()
        wait_port(self.port)

    def count(self) -> int:
        try:
            return int(self.count_file.read_bytes() or b"0")
        except (OSError, ValueError):
            return 0

    def wait(self, n: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while self.count() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sink got {self.count()} of {n}")
            time.sleep(0.02)
        return time.monotonic()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@contextmanager
def pg_schema() -> Iterator[str]:
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_BASE, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG_BASE else "?"
    try:
        yield f"{PG_BASE}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_BASE, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")


class Relay:
    def __init__(self, work: Path, name: str, sink: Sink, dsn: str | None) -> None:
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.port = free_port()
        conf: dict[str, Any] = {
            "hostname": "relay.bench",
            "listen": [{"address": f"127.0.0.1:{self.port}", "allow": ["127.0.0.0/8"]}],
            "spool": {"path": str(self.dir / "spool")},
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
            "log": {"level": "info", "format": "json"},
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": sink.port, "tls": "none"},
            },
            "destinations": {"*": {"rate": "unlimited", "max_connections": 20}},
        }
        if dsn is not None:
            conf["spool"].update(backend="postgresql", dsn=dsn)
            conf["fleet"] = {"node": name}
        self.conf = self.dir / "relay.yaml"
        self.conf.write_text(yaml.safe_dump(conf))
        log = open(self.dir / "relay.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "-c", str(self.conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
        )
        log.close()
        wait_port(self.port)

    def cli(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "relay", *args, "-c", str(self.conf)],
            check=True,
            capture_output=True,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def message(i: int) -> bytes:
    head = (
        f"From: bench@example.com\r\nTo: u{i}@example.org\r\nSubject: bench {i}\r\n"
        f"Message-ID: <bench-{i}-{uuid.uuid4().hex}@example.com>\r\n\r\n"
    ).encode()
    line = b"x" * 76 + b"\r\n"
    return head + line * ((SIZE - len(head)) // len(line))


async def _load(ports: list[int], n: int) -> None:
    async def session(k: int) -> None:
        port = ports[k % len(ports)]
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=120)
        await smtp.connect()
        for i in range(k, n, SESSIONS):
            await smtp.sendmail("bench@example.com", [f"u{i}@example.org"], message(i))
        await smtp.quit()

    await asyncio.gather(*(session(k) for k in range(SESSIONS)))


def load(ports: list[int], n: int) -> float:
    t0 = time.monotonic()
    asyncio.run(_load(ports, n))
    return time.monotonic() - t0


def single(work: Path, backend: str, n: int) -> tuple[float, float]:
    """(acceptance /s, end to end /s) of one node."""
    sink = Sink(work)
    with pg_schema() if backend == "postgresql" else _none() as dsn:
        r = Relay(work, f"{backend}-{uuid.uuid4().hex[:6]}", sink, dsn)
        try:
            t0 = time.monotonic()
            accept = load([r.port], n)
            done = sink.wait(n, 600) - t0
        finally:
            r.stop()
            sink.stop()
    return n / accept, n / done


@contextmanager
def _none() -> Iterator[None]:
    yield None


def drain(work: Path, processes: int, n: int) -> float:
    """Recipients/s: n queued behind a suspension, then resumed with `processes` nodes."""
    sink = Sink(work)
    with pg_schema() as dsn:
        nodes = [Relay(work, f"drain{processes}-{k}", sink, dsn) for k in range(processes)]
        try:
            nodes[0].cli("destination", "suspend", "smarthost", "--for", "1h")
            load([nodes[0].port], n)
            assert sink.count() == 0, "the suspension let mail through"
            time.sleep(2.5)  # every node has seen the suspension and waits
            t0 = time.monotonic()
            nodes[0].cli("destination", "resume", "smarthost")
            done = sink.wait(n, 600) - t0
        finally:
            for r in nodes:
                r.stop()
            sink.stop()
    return n / done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--drain", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="single,drain")
    args = ap.parse_args()
    only = set(args.only.split(","))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"messages": args.messages, "rounds": args.rounds}
    say(f"# bench/fleet.py {stamp}: {os.cpu_count()} cpus, commit {_commit()}")
    with tempfile.TemporaryDirectory(prefix="relay-fleet-bench-") as tmp:
        work = Path(tmp)
        if "single" in only:
            rows: dict[str, list[tuple[float, float]]] = {"sqlite": [], "postgresql": []}
            for rnd in range(args.rounds):
                order = ["sqlite", "postgresql"] if rnd % 2 == 0 else ["postgresql", "sqlite"]
                for backend in order:
                    acc, e2e = single(work, backend, args.messages)
                    rows[backend].append((acc, e2e))
                    say(f"round {rnd + 1} {backend:<10} accept {acc:7.0f}/s  e2e {e2e:7.0f}/s")
            med = {
                b: (statistics.median(a for a, _ in v), statistics.median(e for _, e in v))
                for b, v in rows.items()
            }
            say(
                f"single node, {args.messages} x 2 KiB, median of {args.rounds}:"
                f" SQLite accept {med['sqlite'][0]:.0f}/s e2e {med['sqlite'][1]:.0f}/s;"
                f" PostgreSQL accept {med['postgresql'][0]:.0f}/s e2e {med['postgresql'][1]:.0f}/s;"
                f" PostgreSQL/SQLite accept {med['postgresql'][0] / med['sqlite'][0]:.2f}x,"
                f" e2e {med['postgresql'][1] / med['sqlite'][1]:.2f}x"
            )
            doc["single"] = {"rounds": rows, "median": med}
        if "drain" in only:
            rates: dict[int, float] = {}
            for k in (1, 2, 3):
                rates[k] = drain(work, k, args.drain)
                say(f"drain {args.drain} on PostgreSQL with {k} process(es): {rates[k]:.0f}/s")
            say(
                f"drain: 2/1 = {rates[2] / rates[1]:.2f}x, 3/1 = {rates[3] / rates[1]:.2f}x"
                f" ({os.cpu_count()} cpus)"
            )
            doc["drain"] = rates
    (RESULTS / f"fleet-{stamp}.txt").write_text("\n".join(out_lines) + "\n")
    (RESULTS / f"fleet-{stamp}.json").write_text(json.dumps(doc, indent=2))
    return 0


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
