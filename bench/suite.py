"""The benchmark suite: the relay against Postfix, side by side, one command.

    python bench/suite.py [--rounds 3] [--only NAME,...] [--backlog 100000] [--rows 1000000]
    make bench

Scenarios (names for --only):
  small     N x 2 KiB, 20 sessions, end to end (and the acceptance time of the same run)
  large     N x 100 KiB, 20 sessions, end to end
  rcpts     N x 2 KiB with 5 recipients each, 20 sessions, end to end
  serial    one session, messages one after another: accept latency p50 / p99
  backlog   the upstream down while N messages are queued (acceptance rate as the queue
            fills), then the upstream back and a flush: first delivery, drain rate
  cpu       the inbound process's CPU per 2 KiB message (utime+stime from /proc), this
            tree against --base (default d23213b, aiosmtpd's inbound: issue 29's reference),
            both under the same smtp-source load, alternated; no Postfix involved
  cli       the CLI and the daemon on a spool of --rows queued messages: time to the first
            line of `queue list`, `queue list --json`, `queue show`, `stats`, `queue
            summary`, each command's peak RSS, and the daemon's

Every comparison runs Postfix and the relay alternately (A B A B), on this machine, in the
same run: Postfix 3.7 from Debian set up by ../shared/bench/postfix-peer.sh (127.0.0.1:25
relaying to an smtp-sink on :2526), the relay on 127.0.0.1:2525 relaying to an smtp-sink on
:2527 with `rate: unlimited` and 20 connections (Postfix's default concurrency), fsync on as
always, and `inbound.processes: 1` (--processes: one process takes SMTP, the main one
delivers; README "Using every core"). Load comes from Postfix's own smtp-source. Ratios
are relay speed / Postfix speed (> 1: the relay is faster), per round and the median.
Results: bench/results/suite-<time>.txt and .json. Needs root (it installs and starts
Postfix). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SHARED_BENCH", ROOT.parent / "shared" / "bench"))
RELAY = ROOT / ".venv" / "bin" / "relay"
PYTHON = ROOT / ".venv" / "bin" / "python"
PF_PORT, PF_SINK = 25, 2526
RELAY_PORT, RELAY_SINK = 2525, 2527
os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin"

TICK = os.sysconf("SC_CLK_TCK")
OUT: list[str] = []
PROCESSES = 1  # inbound.processes of every relay started here (--processes)


def say(line: str = "") -> None:
    print(line, flush=True)
    OUT.append(line)


# --- the two systems ----------------------------------------------------------------------


def port_free(port: int) -> None:
    """A stale relay or sink left on a bench port would be measured instead: refuse."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return
    raise RuntimeError(f"127.0.0.1:{port} is already in use (a relay or smtp-sink left over?)")


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.05)


def sh(*args: str, check: bool = True) -> str:
    try:
        r = subprocess.run(args, capture_output=True, text=True, check=False)
    except FileNotFoundError:  # e.g. postconf before postfix-peer.sh installed Postfix
        if check:
            raise
        return ""
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def postfix_setup() -> None:
    sh("bash", str(SHARED / "postfix-peer.sh"), str(PF_SINK))
    postfix_defer(False)


def postfix_defer(on: bool) -> None:
    sh("postconf", "-e", f"defer_transports={'smtp' if on else ''}")
    sh("postfix", "reload", check=False)


def postfix_purge() -> None:
    sh("postsuper", "-d", "ALL", check=False)


def postfix_queued() -> int:
    out = sh("postqueue", "-j", check=False)
    return sum(1 for line in out.splitlines() if line.strip())


class Relay:
    """A relay daemon on a fresh spool (or a given one)."""

    def __init__(
        self, extra: str = "", spool: Path | None = None, tree: Path | None = None
    ) -> None:
        """`tree`: run the relay from another source tree (this venv's packages, the
        tree on PYTHONPATH) instead of this one."""
        self.dir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
        self.spool = spool or self.dir / "spool"
        self.conf = self.dir / "relay.yaml"
        self.conf.write_text(
            f"""listen:
  - address: 127.0.0.1:{RELAY_PORT}
spool:
  path: {self.spool}
{os.environ.get("RELAY_BENCH_SPOOL_EXTRA", "")}
upstream:
  mode: smarthost
  smarthost: {{host: 127.0.0.1, port: {RELAY_SINK}, tls: none}}
destinations:
  "*": {{rate: unlimited, max_connections: 20}}
admin: {{listen: null}}
log: {{level: info}}
inbound: {{processes: {PROCESSES}}}
{extra}
{os.environ.get("RELAY_BENCH_CONFIG", "")}
"""
        )
        port_free(RELAY_PORT)
        self.log = open(self.dir / "relay.log", "wb")  # noqa: SIM115
        cmd, env = [str(RELAY), "serve", "-c", str(self.conf)], None
        if tree is not None:
            cmd = [str(PYTHON), "-m", "relay", "serve", "-c", str(self.conf)]
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        # cwd: `python -m` puts the current folder first on sys.path, before PYTHONPATH (run
        # from the repository, `-m relay` would import this tree's package, not `tree`'s)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, env=env, cwd=self.dir)
        wait_port(RELAY_PORT, 120)

    def settled_cpu(self, quiet: float = 0.5, timeout: float = 30.0) -> tuple[float, float]:
        """`cpu` once the processes have stopped working (no tick for `quiet` seconds):
        work left after the last reply (log records still queued for a writer thread,
        as d23213b's were) counts for the messages that made it."""
        last = self.cpu()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(quiet)
            now = self.cpu()
            if sum(now) - sum(last) < 2 / TICK:
                return now
            last = now
        return last

    def cpu(self) -> tuple[float, float]:
        """CPU seconds (user + system) so far: (the main process, its inbound children)."""
        kids = [
            int(x)
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir()
            for x in (task / "children").read_text().split()
        ]
        return cpu_seconds(self.proc.pid), sum(cpu_seconds(k) for k in kids)

    def cli(self, *args: str) -> str:
        return sh(str(RELAY), *args, "-c", str(self.conf))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return 0

    def stop(self, keep: bool = False) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def settled(pid: int, quiet: float = 0.5, timeout: float = 30.0) -> float:
    """`cpu_seconds(pid)` once it has stopped working (no tick for `quiet` seconds): work
    left after the last reply (log records queued for a writer thread, as d23213b's were)
    counts for the messages that made it."""
    last = cpu_seconds(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = cpu_seconds(pid)
        if now - last < 2 / TICK:
            return now
        last = now
    return last


def export(commit: str, dest: Path) -> Path:
    """The tree of `commit` (git archive: the repository is not touched)."""
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as t:
        t.extractall(dest, filter="data")
    return dest


class Sink:
    """Postfix's smtp-sink with its running counter (-c) read from a file."""

    def __init__(self, port: int) -> None:
        port_free(port)
        self.out = tempfile.NamedTemporaryFile(prefix="sink-", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["smtp-sink", "-u", "nobody", "-c", f"127.0.0.1:{port}", "512"],
            stdout=self.out,
            stderr=subprocess.STDOUT,
        )
        wait_port(port)

    def count(self) -> int:
        data = Path(self.out.name).read_bytes()[-200:]
        found = re.findall(rb"mesg=(\d+)", data)
        return int(found[-1]) if found else 0

    def wait(self, n: int, timeout: float) -> tuple[int, float]:
        """Until n messages arrived (or timeout): (count, monotonic time it was seen)."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.count()
            if c >= n or time.monotonic() > deadline:
                return c, time.monotonic()
            time.sleep(0.02)

    def first(self, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count() > 0:
                return time.monotonic()
            time.sleep(0.005)
        return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        os.unlink(self.out.name)


def source(port: int, n: int, sessions: int, size: int, rcpts: int = 1) -> float:
    """smtp-source: n messages over `sessions` parallel sessions; seconds it took."""
    args = ["smtp-source", "-s", str(sessions), "-m", str(n), "-l", str(size)]
    if rcpts > 1:
        args += ["-r", str(rcpts)]
    args += ["-f", "from@bench.example", "-t", "to@dest.example", f"127.0.0.1:{port}"]
    t0 = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # say why (a refusal, a timeout), not just the exit status
        raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - t0


def ratio(pf: list[float], rl: list[float]) -> tuple[list[float], float]:
    """Speed ratios per round (relay / Postfix) from seconds, and their median."""
    r = [p / q for p, q in zip(pf, rl, strict=False) if q > 0]
    return [round(x, 2) for x in r], round(statistics.median(r), 2) if r else 0.0


RESULTS: dict[str, Any] = {}


# --- scenarios ------------------------------------------------------------------------------


def e2e(name: str, n: int, size: int, rounds: int, rcpts: int = 1) -> None:
    say(f"## {name}: {n} x {size} bytes, {rcpts} recipient(s), 20 sessions, {rounds} rounds")
    relay = Relay()
    rows: dict[str, list[tuple[float, float, int]]] = {"postfix": [], "relay": []}
    cpus: list[tuple[float, float]] = []  # the relay's (inbound, main) CPU ms per message
    try:
        for _ in range(rounds):
            for who, port, sinkport in (
                ("postfix", PF_PORT, PF_SINK),
                ("relay", RELAY_PORT, RELAY_SINK),
            ):
                sink = Sink(sinkport)
                cpu0 = relay.settled_cpu()
                t0 = time.monotonic()
                acc = source(port, n, 20, size, rcpts)
                count, t1 = sink.wait(n, 300)
                sink.stop()
                rows[who].append((acc, t1 - t0, count))
                cpu = ""
                if who == "relay":
                    done = relay.settled_cpu()
                    main_s, inbound_s = (b - a for a, b in zip(cpu0, done, strict=True))
                    cpu = (
                        f" cpu_ms_per_msg: inbound={inbound_s / n * 1000:.3f}"
                        f" main={main_s / n * 1000:.3f}"
                    )
                    cpus.append((inbound_s / n * 1000, main_s / n * 1000))
                say(
                    f"{who:<8} delivered={count} accept_s={acc:.2f} e2e_s={t1 - t0:.2f}"
                    f" msgs_per_s={count / (t1 - t0):.0f}{cpu}"
                )
            postfix_purge()
        rss = relay.rss_kib()
    finally:
        relay.stop()
    acc_r, acc_m = ratio([r[0] for r in rows["postfix"]], [r[0] for r in rows["relay"]])
    e2e_r, e2e_m = ratio([r[1] for r in rows["postfix"]], [r[1] for r in rows["relay"]])
    lost = [r[2] for r in rows["relay"]]
    say(f"accept ratio per round {acc_r} median {acc_m}")
    say(f"end-to-end ratio per round {e2e_r} median {e2e_m}")
    say(f"relay delivered per round {lost}; relay peak RSS {rss // 1024} MiB")
    inbound_ms = round(statistics.median(c[0] for c in cpus), 3)
    main_ms = round(statistics.median(c[1] for c in cpus), 3)
    say(f"relay CPU per message (medians): inbound process {inbound_ms} ms, main {main_ms} ms")
    RESULTS[name] = {
        "inbound_cpu_ms": inbound_ms,
        "main_cpu_ms": main_ms,
        "n": n,
        "size": size,
        "rcpts": rcpts,
        "accept_ratio": acc_m,
        "e2e_ratio": e2e_m,
        "accept_ratios": acc_r,
        "e2e_ratios": e2e_r,
        "relay_delivered": lost,
        "relay_rss_mib": rss // 1024,
        "rounds": rows,
    }


def inbound_cpu(n: int, rounds: int, base: str) -> None:
    """The inbound process's CPU per 2 KiB message, this tree against `base`, alternated:
    each round a fresh relay of each tree, smtp-source's `small` load (one message per
    session, 20 sessions) after a warm-up of 500, the inbound child's CPU over the n."""
    say(f"## cpu: inbound process CPU per message, {n} x 2 KiB, this tree vs {base}")
    per: dict[str, list[float]] = {base: [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="relay-bench-base-") as tmp:
        trees: list[tuple[str, Path | None]] = [
            (base, export(base, Path(tmp))),
            ("this tree", None),
        ]
        sink = Sink(RELAY_SINK)
        try:
            for _ in range(rounds):
                for name, tree in trees:
                    relay = Relay(tree=tree)
                    try:
                        first = sink.count()
                        source(RELAY_PORT, 500, 20, 2048)
                        before = relay.settled_cpu()[1]
                        took = source(RELAY_PORT, n, 20, 2048)
                        ms = (relay.settled_cpu()[1] - before) / n * 1000
                        got, _t = sink.wait(first + n + 500, 120)
                    finally:
                        relay.stop()
                    per[name].append(ms)
                    say(
                        f"{name:<10} inbound_cpu_ms_per_msg={ms:.3f} accept_per_s={n / took:.0f}"
                        f" delivered={got - first}"
                    )
        finally:
            sink.stop()
    med = {k: statistics.median(v) for k, v in per.items()}
    r = med["this tree"] / med[base] if med[base] else 0.0
    say(
        f"inbound CPU per message (medians): {base} {med[base]:.3f} ms, this tree"
        f" {med['this tree']:.3f} ms: {r:.2f} of {base}"
    )
    RESULTS["cpu"] = {
        "n": n,
        "base": base,
        "base_ms": round(med[base], 3),
        "this_ms": round(med["this tree"], 3),
        "ratio": round(r, 2),
        "rounds": per,
    }


def _serial_latencies(port: int, n: int, size: int) -> list[float]:
    """One SMTP session; per message the time from MAIL to the 250 after the final dot."""
    s = socket.create_connection(("127.0.0.1", port))
    f = s.makefile("rb")

    def reply() -> bytes:
        while True:
            line = f.readline()
            if not line:
                raise RuntimeError("connection closed")
            if line[3:4] != b"-":
                return line

    reply()
    s.sendall(b"EHLO bench.example\r\n")
    reply()
    body = b"Subject: serial\r\n\r\n" + (b"x" * 76 + b"\r\n") * (size // 78)
    out = []
    for i in range(n):
        msg = f"Message-ID: <serial-{time.time_ns()}-{i}@bench.example>\r\n".encode() + body
        t0 = time.perf_counter()
        s.sendall(b"MAIL FROM:<from@bench.example>\r\n")
        r1 = reply()
        s.sendall(b"RCPT TO:<to@dest.example>\r\n")
        r2 = reply()
        s.sendall(b"DATA\r\n")
        r3 = reply()
        s.sendall(msg + b".\r\n")
        r4 = reply()
        out.append(time.perf_counter() - t0)
        if not (r1[:1] == r2[:1] == b"2" and r3[:3] == b"354" and r4[:1] == b"2"):
            raise RuntimeError(f"refused: {r1!r} {r2!r} {r3!r} {r4!r}")
    s.sendall(b"QUIT\r\n")
    s.close()
    return out


def pct(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(p / 100 * len(ys) + 0.5) - 1))]


def serial(n: int, rounds: int) -> None:
    say(f"## serial: one session, {n} x 2 KiB one after another, {rounds} rounds")
    relay = Relay()
    lat: dict[str, list[float]] = {"postfix": [], "relay": []}
    try:
        for _ in range(rounds):
            for who, port, sinkport in (
                ("postfix", PF_PORT, PF_SINK),
                ("relay", RELAY_PORT, RELAY_SINK),
            ):
                sink = Sink(sinkport)
                xs = _serial_latencies(port, n, 2048)
                sink.wait(n, 60)
                sink.stop()
                lat[who].extend(xs)
                say(f"{who:<8} p50_ms={pct(xs, 50) * 1000:.2f} p99_ms={pct(xs, 99) * 1000:.2f}")
            postfix_purge()
    finally:
        relay.stop()
    res = {
        who: {"p50_ms": round(pct(v, 50) * 1000, 2), "p99_ms": round(pct(v, 99) * 1000, 2)}
        for who, v in lat.items()
    }
    say(
        f"all rounds: relay p50 {res['relay']['p50_ms']} ms p99 {res['relay']['p99_ms']} ms;"
        f" postfix p50 {res['postfix']['p50_ms']} ms p99 {res['postfix']['p99_ms']} ms"
    )
    RESULTS["serial"] = {"n": n, **res}


def backlog(n: int, pf_n: int, window: float, chunks: int = 10) -> None:
    """The upstream is down (nothing listens on the sink port: connections refused) while
    messages are queued in `chunks` smtp-source runs; then the sink starts and the queue is
    flushed (`relay queue flush`, `postqueue -f`). The relay queues n; Postfix queues pf_n
    and its drain is timed over at most `window` seconds: flushing a large deferred queue
    is Postfix's slow path (its qmgr warns against it), and waiting for it to finish would
    take most of the suite's time."""
    say("## backlog: 2 KiB messages queued with the upstream down, then flushed")
    res: dict[str, Any] = {}
    for who, total in (("postfix", pf_n), ("relay", n)):
        per = total // chunks
        relay = Relay() if who == "relay" else None
        port, sinkport = (PF_PORT, PF_SINK) if who == "postfix" else (RELAY_PORT, RELAY_SINK)
        try:
            if who == "postfix":
                postfix_purge()
            times = [source(port, per, 20, 2048) for _ in range(chunks)]
            rates = [per / t for t in times]
            sink = Sink(sinkport)
            t0 = time.monotonic()
            if relay is not None:
                relay.cli("queue", "flush")
            else:
                sh("postqueue", "-f")
            first = sink.first(120)
            limit = 900 if relay is not None else window
            count, t1 = sink.wait(per * chunks, limit)
            sink.stop()
            rss = relay.rss_kib() if relay else 0
        finally:
            if relay is not None:
                relay.stop()
            else:
                postfix_purge()
        first_s = None if first is None else round(first - t0, 2)
        drain = count / (t1 - t0)
        res[who] = {
            "queued": per * chunks,
            "accept_rates": [round(r) for r in rates],
            "fill_ratio": round(rates[-1] / rates[0], 2),
            "first_delivery_s": first_s,
            "drain_per_s": round(drain),
            "delivered": count,
            "drain_seconds": round(t1 - t0, 1),
            "rss_mib": rss // 1024,
        }
        say(
            f"{who:<8} queued {per * chunks}; accept/s per {per}: {[round(r) for r in rates]}"
            f" (last/first {rates[-1] / rates[0]:.2f}); first delivery {first_s} s after flush;"
            f" delivered {count} in {t1 - t0:.1f} s: {drain:.0f}/s"
            + (f"; peak RSS {rss // 1024} MiB" if rss else "")
        )
    res["drain_ratio"] = round(
        res["relay"]["drain_per_s"] / max(1, res["postfix"]["drain_per_s"]), 2
    )
    say(f"drain ratio relay/postfix {res['drain_ratio']}")
    RESULTS["backlog"] = {"n": n, **res}


# --- the CLI at a million rows --------------------------------------------------------------


def fill_spool(spool: Path, rows: int) -> None:
    """A spool of `rows` waiting messages, one recipient each, over 200 recipient domains,
    2 KiB bodies inline (as the daemon keeps small mail), a tenth of them deferred and due
    now. The schema is the daemon's own (relay.spool.db); the rows are written in one
    transaction without fsync (a bench fixture, not mail)."""
    sys.path.insert(0, str(ROOT))
    from relay.spool import db

    db.connect(spool).close()
    con = sqlite3.connect(spool / db.DB_NAME, isolation_level=None)
    con.execute("PRAGMA journal_mode=DELETE")
    con.execute("PRAGMA synchronous=OFF")
    now = time.time()
    body = b"Subject: x\r\n\r\n" + b"y" * 2000
    con.execute("BEGIN")
    con.execute(
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ? - 1)"
        " INSERT INTO messages (id, message_id, sender, size, created_at, client, peer, lane,"
        " identity, body, listener)"
        " SELECT printf('B%011d', i), printf('m%d@bench.example', i), 'from@bench.example',"
        " 2048, ? - ? + i * 0.01, 'listener:default', '127.0.0.1', 'bulk', 'default', ?,"
        " 'default' FROM n",
        (rows, now, rows * 0.01 + 60, body),
    )
    con.execute(
        "INSERT INTO recipients (msg_id, address, destination, lane_prio, state, attempts,"
        " next_attempt_at, dedup_key, updated_at)"
        " SELECT id, 'to' || substr(id, 2) || '@d' || (rowid % 200) || '.example',"
        " 'd' || (rowid % 200) || '.example', 0,"
        " CASE WHEN rowid % 10 = 0 THEN 'deferred' ELSE 'pending' END,"
        " CASE WHEN rowid % 10 = 0 THEN 1 ELSE 0 END,"
        " CASE WHEN rowid % 10 = 0 THEN ? ELSE ? + 3600 END, 'k' || id, created_at"
        " FROM messages WHERE id LIKE 'B%'",
        (now, now),
    )
    con.execute(
        "INSERT INTO dedup (key, msg_id, created_at) SELECT 'k' || id, id, created_at"
        " FROM messages WHERE id LIKE 'B%'"
    )
    con.execute("COMMIT")
    con.execute("PRAGMA journal_mode=WAL")
    con.close()


def timed_cli(conf: Path, *args: str, budget: float = 15.0) -> tuple[float, float, int, int]:
    """Run `relay ARGS` and read its output for at most `budget` seconds: (seconds to its
    first line, seconds read, peak RSS KiB while it ran, lines read). A listing of a
    million messages is stopped after the budget: what is measured is the first page and
    that memory stays flat while it streams."""
    t0 = time.monotonic()
    p = subprocess.Popen(
        [str(RELAY), *args, "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert p.stdout is not None
    first = None
    lines = 0
    rss = 0
    status_file = Path(f"/proc/{p.pid}/status")
    for _line in p.stdout:
        if first is None:
            first = time.monotonic() - t0
        lines += 1
        if lines % 5000 == 0 or time.monotonic() - t0 > budget:
            rss = max(rss, _hwm(status_file))
            if time.monotonic() - t0 > budget:
                p.kill()
                break
    _pid, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    total = time.monotonic() - t0
    if p.returncode not in (0, 1, -signal.SIGKILL):
        raise RuntimeError(f"relay {' '.join(args)}: exit {p.returncode}")
    return first if first is not None else total, total, max(rss, usage.ru_maxrss), lines


def _hwm(status_file: Path) -> int:
    try:
        for line in status_file.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cli(rows: int) -> None:
    say(f"## cli: a spool of {rows} waiting messages (one recipient each)")
    work = Path(tempfile.mkdtemp(prefix="relay-bench-cli-"))
    t0 = time.monotonic()
    fill_spool(work / "spool", rows)
    say(f"filled in {time.monotonic() - t0:.1f} s")
    res: dict[str, Any] = {"rows": rows}
    # the daemon on that spool, its upstream down (nothing listens on the sink port): it
    # claims what is due, fails to connect, opens the circuit, defers
    daemon = Relay(spool=work / "spool")
    conf = daemon.conf
    for label, args in (
        ("queue list", ("queue", "list")),
        ("queue list --json", ("queue", "list", "--json")),
        ("queue show", ("queue", "show", f"B{rows // 2:011d}")),
        ("stats", ("stats",)),
        ("queue summary", ("queue", "summary")),
    ):
        first, total, rss, lines = timed_cli(conf, *args)
        res[label] = {
            "first_line_s": round(first, 2),
            "read_s": round(total, 2),
            "rss_mib": rss // 1024,
            "lines": lines,
        }
        say(
            f"{label:<20} first line {first:6.2f} s; {lines} lines in {total:6.2f} s;"
            f" peak RSS {rss // 1024:5d} MiB"
        )
    time.sleep(max(0.0, 30 - (time.monotonic() - t0)))
    rss = daemon.rss_kib()
    daemon.stop()
    shutil.rmtree(work, ignore_errors=True)
    res["daemon_rss_mib"] = rss // 1024
    say(f"daemon peak RSS on that spool (upstream down, a tenth due): {rss // 1024} MiB")
    RESULTS["cli"] = res


# --- main -----------------------------------------------------------------------------------


@contextmanager
def postfix_peer() -> Iterator[None]:
    postfix_setup()
    try:
        yield
    finally:
        postfix_purge()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="cpu,small,large,rcpts,serial,backlog,cli")
    ap.add_argument("--base", default="d23213b", help="the tree `cpu` compares with")
    ap.add_argument("--cpu", type=int, default=5000, help="messages per round in `cpu`")
    ap.add_argument("--small", type=int, default=10000, help="messages in `small`")
    ap.add_argument("--large", type=int, default=2000, help="messages in `large`")
    ap.add_argument("--rcpts", type=int, default=2000, help="messages in `rcpts`")
    ap.add_argument("--serial", type=int, default=1000, help="messages per round in `serial`")
    ap.add_argument("--backlog", type=int, default=100000, help="messages in `backlog`")
    ap.add_argument("--backlog-postfix", type=int, default=20000, help="Postfix's backlog")
    ap.add_argument("--drain-window", type=float, default=60, help="Postfix's drain, seconds")
    ap.add_argument("--rows", type=int, default=1000000, help="spool rows in `cli`")
    ap.add_argument(
        "--processes", type=int, default=1, help="the relay's inbound.processes (default 1)"
    )
    a = ap.parse_args()
    global PROCESSES
    PROCESSES = a.processes
    if not RELAY.exists():
        subprocess.run(["make", "-C", str(ROOT), ".venv/.installed"], check=True)
    only = set(a.only.split(","))
    started = time.monotonic()
    head = sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD", check=False).strip()
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        "?",
    )
    say(
        f"# relay bench suite {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} commit {head}"
        f"; {os.cpu_count()} cores ({cpu}); Python {sys.version.split()[0]};"
        f" {sh('postconf', '-d', 'mail_version', check=False).strip() or 'postfix ?'};"
        f" relay inbound.processes={PROCESSES}"
    )
    plan: list[tuple[str, Callable[[], None]]] = [
        ("small", lambda: e2e("small", a.small, 2048, a.rounds)),
        ("large", lambda: e2e("large", a.large, 102400, a.rounds)),
        ("rcpts", lambda: e2e("rcpts", a.rcpts, 2048, a.rounds, rcpts=5)),
        ("serial", lambda: serial(a.serial, a.rounds)),
        ("backlog", lambda: backlog(a.backlog, a.backlog_postfix, a.drain_window)),
    ]
    if "cpu" in only:
        if shutil.which("smtp-sink") is None:  # Debian's postfix package brings smtp-sink
            sh("bash", str(SHARED / "postfix-peer.sh"), str(PF_SINK))
        t = time.monotonic()
        inbound_cpu(a.cpu, a.rounds, a.base)
        say(f"(cpu: {time.monotonic() - t:.0f} s)")
        say()
    if only - {"cli", "cpu"}:
        with postfix_peer():
            for name, run in plan:
                if name in only:
                    t = time.monotonic()
                    run()
                    say(f"({name}: {time.monotonic() - t:.0f} s)")
                    say()
    if "cli" in only:
        t = time.monotonic()
        cli(a.rows)
        say(f"(cli: {time.monotonic() - t:.0f} s)")
    say(f"# suite done in {time.monotonic() - started:.0f} s")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"suite-{stamp}.txt").write_text("\n".join(OUT) + "\n")
    (out / f"suite-{stamp}.json").write_text(json.dumps(RESULTS, indent=2) + "\n")
    print(f"results: bench/results/suite-{stamp}.txt and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
