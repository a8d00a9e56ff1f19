"""Delivery CPU per message: the relay's main process only, from /proc, two source trees side
by side (issues 29 and 31: with `inbound.processes: 1` the main process delivers while a
child takes SMTP, so the main process's CPU per delivered message bounds the drain rate).

    .venv/bin/python bench/delivery_cpu.py --base a6192d2 --rounds 3

Each tree runs the daemon from its own source (`PYTHONPATH`, this venv's packages) with
`inbound.processes: 1`, relaying to Postfix's `smtp-sink` (which offers PIPELINING) as its
smarthost. Postfix's `smtp-source` sends `--messages` messages of `--size` octets over
`--sessions` sessions, after a warm-up of 500. The figure is the main process's user+system
CPU (utime+stime in /proc/<pid>/stat, all its threads: the event loop and the spool writer)
from the start of the load until the sink has counted every message, divided by their
number, and the same per thread (/proc/<pid>/task: the event loop's, and the busiest other
one, the spool writer's); rounds alternate the trees (every `--base` given, then the
working tree). Not part of `make test`; it needs Postfix's smtp-sink and smtp-source
(Debian: postfix).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from inbound_cpu import ROOT, cpu_seconds, export, free_port
from suite import TICK


def thread_cpu(pid: int) -> dict[int, float]:
    """utime+stime of each thread of `pid` (/proc/<pid>/task), seconds."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


class Sink:
    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.out = open(work / "sink.log", "wb")  # noqa: SIM115
        self.path = work / "sink.log"
        self.proc = subprocess.Popen(
            ["/usr/sbin/smtp-sink", "-u", "nobody", "-c", f"127.0.0.1:{self.port}", "512"],
            stdout=self.out,
            stderr=subprocess.STDOUT,
        )

    def count(self) -> int:
        found = re.findall(rb"mesg=(\d+)", self.path.read_bytes()[-300:])
        return int(found[-1]) if found else 0

    def wait(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.count() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sink saw {self.count()} of {n}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.out.close()


class Daemon:
    def __init__(self, tree: Path, work: Path, sink: int) -> None:
        self.port = free_port()
        cfg = {
            "hostname": "relay.test",
            "listen": [{"address": f"127.0.0.1:{self.port}", "allow": ["127.0.0.0/8"]}],
            "spool": {"path": str(work / "spool")},
            "admin": {"listen": None},
            "log": {"level": "info"},
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": sink, "tls": "none"},
            },
            "destinations": {"*": {"rate": "unlimited", "max_connections": 20}},
            "inbound": {"processes": 1},
        }
        (work / "relay.yaml").write_text(yaml.safe_dump(cfg))
        env = {"PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"}
        self.log = open(work / "relay.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "-c", str(work / "relay.yaml")],
            cwd=work,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        import socket

        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError((work / "relay.log").read_text()[-2000:]) from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def source(port: int, n: int, sessions: int, size: int) -> None:
    subprocess.run(
        [
            *("/usr/sbin/smtp-source", "-s", str(sessions), "-l", str(size), "-m", str(n)),
            *("-f", "a@example.com", "-t", "b@example.org", f"127.0.0.1:{port}"),
        ],
        check=True,
    )


def measure(tree: Path, work: Path, a: argparse.Namespace) -> tuple[float, float, float, float]:
    """ms of CPU per message: the main process, its event-loop thread, and its busiest
    other thread (the spool writer); and the rate."""
    work.mkdir(parents=True)
    sink = Sink(work)
    try:
        d = Daemon(tree, work, sink.port)
        try:
            source(d.port, 500, a.sessions, a.size)  # warm-up
            sink.wait(500)
            time.sleep(0.5)
            before = cpu_seconds(d.proc.pid)
            threads_before = thread_cpu(d.proc.pid)
            t = time.perf_counter()
            try:
                source(d.port, a.messages, a.sessions, a.size)
            except subprocess.CalledProcessError:
                print((work / "relay.log").read_text()[-3000:], file=sys.stderr)
                raise
            sink.wait(500 + a.messages)
            wall = time.perf_counter() - t
            used = cpu_seconds(d.proc.pid) - before
            threads = thread_cpu(d.proc.pid)
        finally:
            d.stop()
    finally:
        sink.stop()
    per = {t: (v - threads_before.get(t, 0.0)) / a.messages * 1000 for t, v in threads.items()}
    loop = per.pop(d.proc.pid, 0.0)
    return used / a.messages * 1000, a.messages / wall, loop, max(per.values(), default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", action="append", help="commit to compare with (repeatable)")
    p.add_argument("--messages", type=int, default=5000)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    bases = a.base or ["a6192d2"]
    results: dict[str, list[tuple[float, float, float, float]]] = {b: [] for b in bases}
    results["this tree"] = []
    with tempfile.TemporaryDirectory(prefix="delivery-cpu-") as tmp:
        trees = [(b, export(b, Path(tmp) / f"base-{k}")) for k, b in enumerate(bases)]
        trees.append(("this tree", ROOT))
        for n in range(a.rounds):
            for k, (name, tree) in enumerate(trees):
                ms, rate, loop, writer = measure(tree, Path(tmp) / f"run-{k}-{n}", a)
                results[name].append((ms, rate, loop, writer))
                print(
                    f"round {n + 1} {name:9}: {ms:.3f} ms CPU/message (loop thread {loop:.3f},"
                    f" writer thread {writer:.3f}), {rate:.0f} msg/s",
                    flush=True,
                )
    print(
        f"\n{a.messages} x {a.size} B, {a.sessions} sessions, smtp-source -> relay -> smtp-sink,"
        f" main process CPU, medians of {a.rounds}:"
    )
    for name, rows in results.items():
        ms = statistics.median(r[0] for r in rows)
        rate = statistics.median(r[1] for r in rows)
        loop = statistics.median(r[2] for r in rows)
        writer = statistics.median(r[3] for r in rows)
        print(
            f"  {name:9}: {ms:.3f} ms CPU/message (loop thread {loop:.3f}, writer thread"
            f" {writer:.3f}), {rate:.0f} msg/s"
        )
    t = statistics.median(r[0] for r in results["this tree"])
    for b in bases:
        ms = statistics.median(r[0] for r in results[b])
        print(f"  main-process CPU per delivered message, this tree / {b}: {t / ms:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
