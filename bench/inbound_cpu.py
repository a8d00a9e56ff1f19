"""Inbound CPU per message: the relay's SMTP process only, from /proc, two source trees side
by side (issue 29: our own SMTP server against aiosmtpd's).

    .venv/bin/python bench/inbound_cpu.py --base d23213b --rounds 3
    .venv/bin/python bench/inbound_cpu.py --base d23213b --base <commit> --rcpts 5 --size 102400

Each tree runs the daemon from its own source (`PYTHONPATH`, this venv's packages) with
`inbound.processes: 1`, so one child process takes SMTP and nothing else; its upstream is a
closed port, so the main process's delivery attempts never share that child's CPU. A simple
asyncio client (here, in this process) sends `--messages` messages of `--size` octets, one
message per connection (EHLO, MAIL, `--rcpts` RCPTs, DATA, QUIT: no pipelining),
`--sessions` at a time, after a warm-up of 200. The figure is the inbound child's
user+system CPU (utime+stime in /proc/<pid>/stat) over the measured messages, divided by
their number; rounds alternate the trees (every `--base` given, then the working tree).
Not part of `make test`; it needs no root and no Postfix.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from suite import export, settled  # bench/suite.py, beside this file

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


class Daemon:
    def __init__(self, tree: Path, work: Path) -> None:
        self.tree = tree
        self.work = work
        work.mkdir(parents=True)
        self.port = free_port()
        cfg = {
            "hostname": "relay.test",
            "listen": [{"address": f"127.0.0.1:{self.port}", "allow": ["127.0.0.0/8"]}],
            "spool": {"path": str(work / "spool")},
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
            "log": {"level": "info", "format": "json"},
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": free_port(), "tls": "none"},
            },
            "inbound": {"processes": 1},
            "retry": {"schedule": ["1h"], "max_age": "2h"},
            "limits": {"max_connections": 1000},
        }
        (work / "relay.yaml").write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        self.log = open(work / "relay.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "-c", str(work / "relay.yaml")],
            cwd=work,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError((work / "relay.log").read_text()[-2000:]) from None
                time.sleep(0.1)
        kids = children(self.proc.pid)
        assert len(kids) == 1, kids
        self.inbound = kids[0]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


async def one(port: int, body: bytes, i: int, rcpts: int = 1) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)

    async def reply() -> bytes:
        while True:
            line = await r.readline()
            if not line:
                raise ConnectionError("closed")
            if line[3:4] != b"-":
                return line

    await reply()
    to = [
        b"RCPT TO:<u%d@example.org>" % k if k else b"RCPT TO:<u@example.org>" for k in range(rcpts)
    ]
    for cmd in (b"EHLO bench.test", b"MAIL FROM:<app@example.com>", *to):
        w.write(cmd + b"\r\n")
        assert (await reply()).startswith(b"250"), cmd
    w.write(b"DATA\r\n")
    assert (await reply()).startswith(b"354")
    w.write(b"Message-ID: <b%d@bench.test>\r\n" % i + body + b".\r\n")
    got = await reply()
    assert got.startswith(b"250 2.0.0 Ok: queued"), got
    w.write(b"QUIT\r\n")
    await reply()
    w.close()
    await w.wait_closed()


async def load(port: int, n: int, sessions: int, size: int, start: int, rcpts: int = 1) -> float:
    line = b"x" * 76 + b"\r\n"
    head = b"From: app@example.com\r\nTo: u@example.org\r\nSubject: bench\r\n\r\n"
    body = head + line * max(1, (size - len(head)) // len(line))
    queue = iter(range(start, start + n))

    async def worker() -> None:
        for i in queue:
            await one(port, body, i, rcpts)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(sessions)))
    return time.perf_counter() - t


def measure(tree: Path, work: Path, a: argparse.Namespace) -> tuple[float, float]:
    d = Daemon(tree, work)
    try:
        asyncio.run(load(d.port, 200, a.sessions, a.size, 0, a.rcpts))  # warm-up
        before = settled(d.inbound)
        wall = asyncio.run(load(d.port, a.messages, a.sessions, a.size, 10_000, a.rcpts))
        used = settled(d.inbound) - before
    finally:
        d.stop()
    return used / a.messages * 1000, a.messages / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--base",
        action="append",
        help="commit to compare with (git archive); repeat for more (default 062d7a2)",
    )
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--rcpts", type=int, default=1, help="recipients per message")
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    bases = a.base or ["062d7a2"]
    results: dict[str, list[tuple[float, float]]] = {b: [] for b in bases}
    results["this tree"] = []
    with tempfile.TemporaryDirectory(prefix="inbound-cpu-") as tmp:
        trees = [(b, export(b, Path(tmp) / f"base-{k}")) for k, b in enumerate(bases)]
        trees.append(("this tree", ROOT))
        for n in range(a.rounds):
            for k, (name, tree) in enumerate(trees):
                ms, rate = measure(tree, Path(tmp) / f"run-{k}-{n}", a)
                results[name].append((ms, rate))
                print(f"round {n + 1} {name:9}: {ms:.3f} ms CPU/message, {rate:.0f} msg/s")
    print(
        f"\n{a.messages} x {a.size} B x {a.rcpts} recipient(s), {a.sessions} sessions, one"
        f" message per connection, medians of {a.rounds}:"
    )
    for name, rows in results.items():
        ms = statistics.median(r[0] for r in rows)
        rate = statistics.median(r[1] for r in rows)
        print(f"  {name:9}: {ms:.3f} ms CPU/message, {rate:.0f} msg/s")
    t = statistics.median(r[0] for r in results["this tree"])
    for b in bases:
        ms = statistics.median(r[0] for r in results[b])
        print(f"  inbound CPU per message, this tree / {b}: {t / ms:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
