"""PostgreSQL spool and fleet benchmarks (README "Running a fleet on PostgreSQL").

    .venv/bin/python bench/fleet.py                               # full run, ~5-8 min on 2 cores
    .venv/bin/python bench/fleet.py --messages 300 --rounds 1     # a quick check
    .venv/bin/python bench/fleet.py --only drain --drain 3000     # a part

Scenarios (names for --only):
  single  one relay, SQLite against PostgreSQL: N x 2 KiB over 20 parallel sessions, one
          message per session (as Postfix's smtp-source sends), with the upstream sink
          running. Acceptance = N / (time to the last 250); end to end = N / (time until
          the sink has counted all N). The backends alternate (A B, B A, ...) for --rounds
          rounds; medians, and PostgreSQL/SQLite ratios. Per round also the CPU per
          message (/proc) of the relay with its inbound processes and, on PostgreSQL,
          of the server processes serving it (found by application_name, which is the
          schema's name): where the extra CPU of the PostgreSQL spool goes.
  drain   PostgreSQL, 1, 2 and 3 relay processes (--procs; daemons, each with its own
          fleet.node, port and local spool dir) on one spool: all of them started,
          --drain messages (default 3/5 of --messages) submitted to the first one while
          the upstream is down (nothing listens on the sink's port: connections refused,
          recipients deferred with backoff, circuits open); then the sink starts, `relay
          queue flush` runs on the first node's CLI (every deferred recipient due now, and
          a kick through every node's open circuit), and the time until the sink has all
          of them. Rates: from the start of the flush to the last message, and over the
          steady part (10% to 90% of the messages at the sink); the time of the last 10%
          (stragglers); 2-proc/1-proc and 3-proc/1-proc ratios; the order rotates per
          round; medians. Messages per node are counted from the daemons' logs.

Every relay: `tls: none`, `rate: unlimited`, 20 connections, log level info, `admin.listen`
off, `inbound.processes: 1` (--inbound-processes; bench/suite.py's setting): the same
config for both backends but for `spool`/`fleet`. Load and sink: Postfix's smtp-source
and smtp-sink when both are installed (as bench/suite.py uses them), else Python
equivalents here (`--tools python`: an asyncio client sending one message per session,
and a minimal asyncio SMTP sink in a process of its own that counts messages); the same
tools for every measurement of a run, named in its output.

PostgreSQL: the server the tests use (RELAY_TEST_PG, default
postgresql://root@127.0.0.1:5432/test); every daemon set gets a fresh schema
(`bench_fleet_<hex>`, DSN with `options=-c search_path=...` as tests/pgserver.py builds
it), dropped afterwards. Ports: random free ones in 12000-19999 (below the ephemeral range
and the tests' 20000-32000); a port something already answers on is refused, and a daemon
that exits before it is ready stops the run. Every process started here is stopped on
exit (SIGTERM, then SIGKILL of its process group), also after an error or Ctrl-C.
Raw output: bench/results/fleet-<time>.txt and .json (with every round, the sink counts,
and the warnings/errors of every daemon's log).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shutil
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
from urllib.parse import quote

import psycopg
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RELAY_BIN = ROOT / ".venv" / "bin" / "relay"
PG_BASE = os.environ.get("RELAY_TEST_PG", "postgresql://root@127.0.0.1:5432/test")
PORTS = (12000, 20000)  # below the ephemeral range and below the tests' 20000-32000
SENDER, RCPT = "from@bench.example", "to@dest.example"

OUT: list[str] = []
DOC: dict[str, Any] = {}
LIVE: list[subprocess.Popen[bytes]] = []  # every process started here, stopped at exit
_taken: set[int] = set()


def say(line: str = "") -> None:
    print(line, flush=True)
    OUT.append(line)


# --- ports and processes ----------------------------------------------------------------------


def port_answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def refuse_taken(port: int) -> None:
    """A leftover daemon or sink on a bench port would be measured instead: refuse."""
    if port_answers(port):
        raise RuntimeError(f"127.0.0.1:{port} is already in use (a relay or sink left over?)")


def free_port() -> int:
    """A port nothing listens on nor answers on, not handed out before in this run."""
    rnd = random.Random()
    for _ in range(500):
        port = rnd.randrange(*PORTS)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port_answers(port):
            continue
        _taken.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS[0]}-{PORTS[1] - 1}")


def spawn(args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    """A child in a session (and process group) of its own: Ctrl-C reaches only us, and the
    whole group (a relay's inbound processes too) can be killed by its id."""
    p = subprocess.Popen(args, start_new_session=True, **kw)
    LIVE.append(p)
    return p


def stop(p: subprocess.Popen[bytes], timeout: float = 45.0) -> None:
    """SIGTERM to the process, then SIGKILL to its process group if it lingers."""
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            say(f"! pid {p.pid} ({' '.join(map(str, p.args))[:60]}) ignored SIGTERM: killed")
    try:
        os.killpg(p.pid, signal.SIGKILL)  # leftovers of its group (our own child's pgid)
    except (ProcessLookupError, PermissionError):
        pass
    if p.poll() is None:
        p.wait(10)
    if p in LIVE:
        LIVE.remove(p)


def stop_all() -> None:
    for p in list(LIVE):
        try:
            stop(p, 20)
        except Exception as e:  # cleanup goes on for the others
            print(f"! stopping pid {p.pid}: {e!r}", file=sys.stderr)


def _on_signal(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/lib/postfix/sbin")


# --- the upstream sink ------------------------------------------------------------------------

PY_SINK = r"""
import asyncio, os, sys
path, port = sys.argv[1], int(sys.argv[2])
try:
    import uvloop
except ImportError:
    uvloop = None
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
n = 0

async def session(reader, writer):
    global n
    writer.write(b"220 sink.bench ESMTP\r\n")
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            verb = line[:4].upper()
            if verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                await reader.readuntil(b"\r\n.\r\n")
                n += 1
                os.pwrite(fd, b"%12d" % n, 0)
                writer.write(b"250 2.0.0 Ok: queued\r\n")
            elif verb == b"EHLO":
                writer.write(b"250-sink.bench\r\n250-8BITMIME\r\n250 ENHANCEDSTATUSCODES\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 2.0.0 bye\r\n")
                break
            else:
                writer.write(b"250 2.0.0 Ok\r\n")
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(
        session, "127.0.0.1", port, backlog=1024, limit=64 << 20, reuse_address=True
    )
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

print("spawned", flush=True)
sys.stdin.readline()  # "go": listen from now on (nothing listened before: refused)
(uvloop.run if uvloop else asyncio.run)(main())
"""


class Sink:
    """The upstream: counts messages. `go()` makes it listen (until then connections to its
    port are refused: the upstream is down). Python's is spawned in advance, so that going
    live costs no interpreter start-up; smtp-sink starts at `go()`."""

    def __init__(self, work: Path, kind: str) -> None:
        self.kind = kind
        self.port = free_port()
        refuse_taken(self.port)
        self.file = work / f"sink-{self.port}-{uuid.uuid4().hex[:6]}.out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ticks: dict[str, tuple[int, int]] = {}  # machine_ticks() at track()'s marks
        if kind == "python":
            self.proc = spawn(
                [sys.executable, "-c", PY_SINK, str(self.file), str(self.port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() != b"spawned":
                raise RuntimeError("the Python sink did not start")

    def go(self) -> None:
        refuse_taken(self.port)
        if self.kind == "python":
            assert self.proc is not None and self.proc.stdin and self.proc.stdout
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.flush()
            if self.proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the Python sink did not listen on {self.port}")
        else:
            out = open(self.file, "wb")  # noqa: SIM115 - the child owns it
            user = ["-u", "nobody"] if os.geteuid() == 0 else []
            self.proc = spawn(
                [str(tool("smtp-sink")), *user, "-c", f"127.0.0.1:{self.port}", "512"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            out.close()
        wait_port(self.port, self.proc, 20)

    def count(self) -> int:
        """Python's: a 12-byte counter at the start of the file; smtp-sink's: the last
        `mesg=N` of its -c output (only the file's tail is read: it grows all the time)."""
        try:
            with open(self.file, "rb") as f:
                if self.kind == "python":
                    return int(f.read(12) or b"0")
                f.seek(max(0, os.fstat(f.fileno()).st_size - 300))
                found = re.findall(rb"mesg=(\d+)", f.read())
        except (OSError, ValueError):
            return 0
        return int(found[-1]) if found else 0

    def wait(self, n: int, timeout: float) -> float:
        """Until the sink has n (monotonic time it was seen); RuntimeError after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.count()
            if c >= n:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sink got {c} of {n} in {timeout:.0f} s")
            time.sleep(0.01)

    def track(self, n: int, timeout: float) -> dict[str, float]:
        """Until the sink has n: monotonic times of the first message, of 10% and 90% of n,
        and of all n; RuntimeError after timeout. `self.ticks`: machine_ticks() at each."""
        deadline = time.monotonic() + timeout
        marks: dict[str, float] = {}
        self.ticks = {}
        goals = (("first", 1), ("p10", max(1, n // 10)), ("p90", max(1, n * 9 // 10)))
        while True:
            c, now = self.count(), time.monotonic()
            for name, goal in goals:
                if c >= goal and name not in marks:
                    marks[name] = now
                    self.ticks[name] = machine_ticks()
            if c >= n:
                marks["all"] = now
                return marks
            if now > deadline:
                raise RuntimeError(f"the sink got {c} of {n} in {timeout:.0f} s")
            time.sleep(0.005)

    def settled_count(self, quiet: float = 1.0) -> int:
        """The count once it stopped moving for `quiet` seconds (duplicates show here)."""
        last, since = self.count(), time.monotonic()
        while time.monotonic() - since < quiet:
            time.sleep(0.1)
            c = self.count()
            if c != last:
                last, since = c, time.monotonic()
        return last

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, 10)


def wait_port(port: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not port_answers(port):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"pid {proc.pid} exited ({proc.returncode}) before listening")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")
        time.sleep(0.05)


# --- the load -------------------------------------------------------------------------------


def message(run: str, i: int, size: int) -> bytes:
    head = (
        f"From: <{SENDER}>\r\nTo: <{RCPT}>\r\nSubject: fleet bench {i}\r\n"
        f"Message-ID: <{run}-{i}@bench.example>\r\n\r\n"
    ).encode()
    line = b"x" * 76 + b"\r\n"
    return head + line * max(1, (size - len(head)) // len(line))


async def _pyload(port: int, n: int, sessions: int, size: int, errors: list[str]) -> int:
    run = uuid.uuid4().hex[:12]
    todo = iter(range(n))
    ok = 0

    async def reply(r: asyncio.StreamReader, want: bytes) -> None:
        while True:
            line = await r.readline()
            if not line:
                raise ConnectionError("connection closed")
            if line[3:4] != b"-":
                break
        if not line.startswith(want):
            raise RuntimeError(line.decode(errors="replace").strip())

    async def one(i: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            await reply(r, b"220")
            for cmd, want in (
                (b"EHLO load.bench.example", b"250"),
                (f"MAIL FROM:<{SENDER}>".encode(), b"250"),
                (f"RCPT TO:<{RCPT}>".encode(), b"250"),
                (b"DATA", b"354"),
            ):
                w.write(cmd + b"\r\n")
                await reply(r, want)
            w.write(message(run, i, size) + b".\r\n")
            await reply(r, b"250")
            w.write(b"QUIT\r\n")
            await reply(r, b"221")
        finally:
            w.close()

    async def worker() -> None:
        nonlocal ok
        for i in todo:  # one shared iterator: each session takes the next message
            try:
                await one(i)
                ok += 1
            except (OSError, RuntimeError, ConnectionError) as e:
                errors.append(f"message {i}: {e}")

    await asyncio.gather(*(worker() for _ in range(sessions)))
    return ok


def load(kind: str, port: int, n: int, sessions: int, size: int) -> tuple[float, int, list[str]]:
    """n messages of `size` bytes, one per session, `sessions` at a time: (seconds to the
    last reply, messages the relay said 250 to (smtp-source: n when it exits 0), errors)."""
    errors: list[str] = []
    t0 = time.monotonic()
    if kind == "python":
        try:
            import uvloop

            ok = uvloop.run(_pyload(port, n, sessions, size, errors))
        except ImportError:
            ok = asyncio.run(_pyload(port, n, sessions, size, errors))
        return time.monotonic() - t0, ok, errors
    args = [str(tool("smtp-source")), "-s", str(sessions), "-m", str(n), "-l", str(size)]
    args += ["-f", SENDER, "-t", RCPT, f"127.0.0.1:{port}"]
    p = subprocess.run(args, capture_output=True, check=False)
    took = time.monotonic() - t0
    if p.returncode != 0:
        errors.append(f"smtp-source exit {p.returncode}: {p.stderr.decode()[-300:]}")
    errors += [x for x in p.stderr.decode(errors="replace").splitlines() if x.strip()][:20]
    return took, (n if p.returncode == 0 else 0), errors


# --- PostgreSQL -----------------------------------------------------------------------------


def with_search_path(base: str, schema: str) -> str:
    """tests/pgserver.py's DSN for one schema; the schema's name is the connections'
    application_name, so that their server processes can be found (cpu_of_backends)."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-c search_path={schema}')}&application_name={schema}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (Linux /proc), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_of_tree(pid: int) -> float:
    """CPU of a process and of its children (the relay's inbound processes)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p)
        todo += kids.get(p, [])
    return total


def machine_ticks() -> tuple[int, int]:
    """The whole machine's CPU time from /proc/stat, in ticks: (busy, all). Busy is every
    core's time not idle and not waiting for I/O: the relays, PostgreSQL with its shared
    processes (WAL writer, checkpointer), the sink, the flush CLI, the kernel's softirqs,
    and anything else running."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]  # idle, iowait
    total = sum(f[:8])  # user nice system idle iowait irq softirq steal
    return total - idle, total


def cpu_of_backends(dsn: str) -> float:
    """CPU of the server processes serving connections of this DSN's schema (the server
    runs on this machine; its shared processes, WAL writer and checkpointer, not counted)."""
    name = dsn.rsplit("application_name=", 1)[-1]
    with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as c:
        pids = [
            r[0]
            for r in c.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
            )
        ]
    return sum(cpu_seconds(p) for p in pids)


def commits(dsn: str) -> int:
    """Transactions committed in the DSN's database so far (pg_stat_database; the server
    publishes a backend's counts within a second of its commit, so read it after a quiet
    second: the bench's sink waits for one)."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as c:
        row = c.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


@contextmanager
def pg_schema() -> Iterator[str]:
    """A fresh schema of this run's own, dropped afterwards; yields its DSN."""
    schema = f"bench_fleet_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    try:
        yield with_search_path(PG_BASE, schema)
    finally:
        with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")


def pg_rows(dsn: str, sql: str) -> tuple[Any, ...]:
    with psycopg.connect(dsn, connect_timeout=5) as c:
        row = c.execute(sql).fetchone()
        return tuple(row) if row else ()


def pg_info() -> dict[str, str]:
    out = {}
    with psycopg.connect(PG_BASE, connect_timeout=5) as c:
        for k in ("server_version", "fsync", "synchronous_commit", "shared_buffers"):
            out[k] = str(c.execute(f"SHOW {k}").fetchone()[0])  # type: ignore[index]
    return out


# --- the relay ------------------------------------------------------------------------------


class Relay:
    """One daemon on its own port and local spool dir; `dsn`: on that PostgreSQL spool."""

    def __init__(
        self,
        work: Path,
        name: str,
        sink_port: int,
        dsn: str | None,
        inbound: int,
        base: str | None = None,
    ) -> None:
        self.name = name
        # --base: the relay package of another tree, first on the path (PYTHONPATH)
        self.env = None if base is None else {**os.environ, "PYTHONPATH": base}
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.port = free_port()
        refuse_taken(self.port)
        conf: dict[str, Any] = {
            "hostname": "relay.bench.example",
            "listen": [{"address": f"127.0.0.1:{self.port}", "allow": ["127.0.0.0/8"]}],
            "spool": {"path": str(self.dir / "spool")},
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": sink_port, "tls": "none"},
            },
            "destinations": {"*": {"rate": "unlimited", "max_connections": 20}},
            "admin": {"listen": None},
            "log": {"level": "info"},
            "inbound": {"processes": inbound},
        }
        if dsn is not None:
            conf["spool"].update(backend="postgresql", dsn=dsn)
            conf["fleet"] = {"node": name}
        # RELAY_BENCH_CONFIG (as bench/suite.py): YAML whose sections are merged over these
        for key, value in (yaml.safe_load(os.environ.get("RELAY_BENCH_CONFIG", "")) or {}).items():
            if isinstance(value, dict) and isinstance(conf.get(key), dict):
                conf[key].update(value)
            else:
                conf[key] = value
        self.conf = self.dir / "relay.yaml"
        self.conf.write_text(yaml.safe_dump(conf, sort_keys=False))
        self.log = self.dir / "relay.log"
        out = open(self.log, "wb")  # noqa: SIM115 - the child owns it
        self.proc = spawn(
            [*relay_cmd(), "serve", "-c", str(self.conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=self.env,
        )
        out.close()
        try:
            wait_port(self.port, self.proc, 120)
            self._wait_ready(120)
        except RuntimeError as e:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"relay {name}: {e}; its log ends:\n{tail}") from None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while b"relay is ready" not in self.log.read_bytes():
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited ({self.proc.returncode}) before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s")
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        p = subprocess.run(
            [*relay_cmd(), *args, "-c", str(self.conf)],
            capture_output=True,
            check=False,
            env=self.env,
        )
        if p.returncode != 0:
            raise RuntimeError(
                f"relay {' '.join(args)}: exit {p.returncode}: {p.stderr.decode().strip()}"
            )
        return p.stdout.decode()

    def stop(self) -> dict[str, Any]:
        """Stop it; what its log says (warnings and errors by event, deliveries)."""
        stop(self.proc)
        return scan_log(self.log)


def relay_cmd() -> list[str]:
    return [str(RELAY_BIN)] if RELAY_BIN.exists() else [sys.executable, "-m", "relay"]


def scan_log(path: Path) -> dict[str, Any]:
    odd: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    delivered = 0
    other: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"missing": True}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            if line.strip():
                other.append(line.strip())
            continue
        if not isinstance(rec, dict):
            continue
        ev = str(rec.get("event"))
        if ev == "delivered":
            delivered += 1
        level = str(rec.get("level", ""))
        if level not in ("debug", "info"):
            key = f"{level}:{ev}"
            odd[key] += 1
            if key not in first:
                first[key] = " ".join(
                    f"{k}={rec[k]}" for k in ("msg", "check", "detail", "reason") if k in rec
                )[:300]
    out: dict[str, Any] = {
        "delivered_logged": delivered,
        "warnings_errors": dict(odd),
        "first_of_each": first,
    }
    if other:
        out["non_json_lines"] = len(other)
        out["non_json_sample"] = other[:10]
    return out


def note_logs(where: str, logs: dict[str, dict[str, Any]], odd: dict[str, int]) -> None:
    """Adds each log's warnings/errors to `odd`, and prints non-JSON output (tracebacks)."""
    for name, info in logs.items():
        for k, v in info.get("warnings_errors", {}).items():
            if k not in odd and not k.startswith("warning:"):
                say(f"  ! {where} {name}: {k}: {info['first_of_each'].get(k, '')}")
            odd[k] = odd.get(k, 0) + v
        if info.get("non_json_lines"):
            say(f"  ! {where} {name}: {info['non_json_lines']} non-JSON log lines, e.g.")
            for x in info["non_json_sample"][:3]:
                say(f"      {x[:150]}")


# --- scenarios ------------------------------------------------------------------------------


def single(work: Path, a: argparse.Namespace, backend: str, rnd: int) -> dict[str, Any]:
    """One node: acceptance and end to end of a.messages, with the sink up. A backend
    named `...-base` runs the tree of --base."""
    n = a.messages
    base = a.base if backend.endswith("-base") else None
    sink = Sink(work, a.tools)
    relay: Relay | None = None
    logs: dict[str, Any] = {}
    try:
        sink.go()
        with pg_schema() if backend.startswith("postgresql") else _no_schema() as dsn:
            relay = Relay(
                work, f"single-{backend}-r{rnd}", sink.port, dsn, a.inbound_processes, base
            )
            try:
                cpu0 = cpu_of_tree(relay.proc.pid), (cpu_of_backends(dsn) if dsn else 0.0)
                main0, xact0 = cpu_seconds(relay.proc.pid), (commits(dsn) if dsn else 0)
                t0 = time.monotonic()
                took, ok, errors = load(a.tools, relay.port, n, a.sessions, a.size)
                t_end = sink.wait(ok, max(120.0, n / 10))
                got = sink.settled_count()
                # CPU per message, read before the stop: the relay (and its inbound
                # processes), and on PostgreSQL its server processes
                cpu_relay = cpu_of_tree(relay.proc.pid) - cpu0[0]
                cpu_pg = (cpu_of_backends(dsn) if dsn is not None else 0.0) - cpu0[1]
                cpu_main = cpu_seconds(relay.proc.pid) - main0
                xacts = (commits(dsn) if dsn is not None else 0) - xact0
            finally:
                logs[relay.name] = relay.stop()
    finally:
        sink.stop()
    if errors:
        say(f"  ! {len(errors)} load errors, e.g. {errors[:3]}")
    res = {
        "backend": backend,
        "round": rnd,
        "accepted": ok,
        "sink_count": got,
        "accept_s": round(took, 3),
        "e2e_s": round(t_end - t0, 3),
        "accept_per_s": round(ok / took, 1),
        "e2e_per_s": round(ok / (t_end - t0), 1),
        "cpu_ms_relay": round(cpu_relay / max(ok, 1) * 1000, 3),
        "cpu_ms_pg": round(cpu_pg / max(ok, 1) * 1000, 3),
        # the daemon's own process alone (delivery, claims, records); the rest of
        # cpu_ms_relay is its inbound processes
        "cpu_ms_main": round(cpu_main / max(ok, 1) * 1000, 3),
        "commits_per_message": round(xacts / max(ok, 1), 3),
        "load_errors": errors[:20],
        "logs": logs,
    }
    if ok != n or got != ok:
        say(f"  ! {backend}: {ok} of {n} accepted, the sink counted {got}")
    return res


@contextmanager
def _no_schema() -> Iterator[None]:
    yield None


def drain(work: Path, a: argparse.Namespace, procs: int, rnd: int) -> dict[str, Any]:
    """`procs` daemons on one PostgreSQL spool; a.drain messages queued with the upstream
    down, then the sink up and `relay queue flush`: time until the sink has them all."""
    n = a.drain
    sink = Sink(work, a.tools)  # not listening yet: the upstream is down
    nodes: list[Relay] = []
    logs: dict[str, Any] = {}
    try:
        with pg_schema() as dsn:
            try:
                for k in range(procs):
                    nodes.append(
                        Relay(
                            work,
                            f"drain{procs}-r{rnd}-n{k}",
                            sink.port,
                            dsn,
                            a.inbound_processes,
                        )
                    )
                fill_s, ok, errors = load(a.tools, nodes[0].port, n, a.sessions, a.size)
                if errors:
                    say(f"  ! {len(errors)} load errors, e.g. {errors[:3]}")
                # settle: every message in the spool, no attempt in flight on any node
                deadline = time.monotonic() + 60
                while True:
                    total, sending, done = pg_rows(
                        dsn,
                        "SELECT count(*), count(*) FILTER (WHERE state = 'sending'),"
                        " count(*) FILTER (WHERE state = 'delivered') FROM recipients",
                    )
                    if (total >= ok and sending == 0) or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                if sending or done or total != ok:
                    say(f"  ! before the flush: {total} queued, {sending} sending, {done} done")
                with psycopg.connect(dsn, connect_timeout=5) as c:
                    states = {
                        str(k): int(v)
                        for k, v in c.execute(
                            "SELECT state, count(*) FROM recipients GROUP BY state"
                        ).fetchall()
                    }
                sink.go()
                before = sink.count()
                # CPU over the drain (flush to the last message): the relays, their server
                # processes, the sink; with the wall time, the cores they kept busy
                cpu0 = (
                    sum(cpu_of_tree(r.proc.pid) for r in nodes),
                    cpu_of_backends(dsn),
                    cpu_of_tree(sink.proc.pid) if sink.proc else 0.0,
                )
                m0 = machine_ticks()
                t0 = time.monotonic()
                nodes[0].cli("queue", "flush")
                t_cli = time.monotonic()
                marks = sink.track(ok, max(120.0, n / 10))
                t_end = marks["all"]
                m1 = machine_ticks()
                p10, p90 = sink.ticks["p10"], sink.ticks["p90"]
                cpu1 = (
                    sum(cpu_of_tree(r.proc.pid) for r in nodes),
                    cpu_of_backends(dsn),
                    cpu_of_tree(sink.proc.pid) if sink.proc else 0.0,
                )
                cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
                got = sink.settled_count()
                delivered = pg_rows(
                    dsn, "SELECT count(*) FROM recipients WHERE state = 'delivered'"
                )[0]
            finally:
                for r in nodes:
                    logs[r.name] = r.stop()
    finally:
        sink.stop()
    per_node = {name: info.get("delivered_logged", 0) for name, info in logs.items()}
    res = {
        "processes": procs,
        "round": rnd,
        "queued": ok,
        "fill_s": round(fill_s, 3),
        "fill_per_s": round(ok / fill_s, 1),
        "states_before_flush": states,
        "sink_before_flush": before,
        "flush_cli_s": round(t_cli - t0, 3),
        "first_delivery_s": round(marks["first"] - t0, 3),
        "drain_s": round(t_end - t0, 3),
        "drain_per_s": round(ok / (t_end - t0), 1),
        # the steady part: 10% -> 90% of the messages (no start-up, no stragglers)
        "steady_per_s": (
            round((ok * 9 // 10 - max(1, ok // 10)) / (marks["p90"] - marks["p10"]), 1)
            if marks["p90"] > marks["p10"]
            else None
        ),
        # the last 10%: stragglers (a node's claimed batch waiting behind its circuit)
        "last_tenth_s": round(t_end - marks["p90"], 3),
        "sink_count": got,
        # per message delivered, over the drain: relays, their PostgreSQL backends, the sink
        "cpu_ms": [round(x / max(ok, 1) * 1000, 3) for x in cpu],
        # cores kept busy over the drain by each of them (of os.cpu_count())
        "cores": [round(x / (t_end - t0), 2) for x in cpu],
        # the whole machine's cores busy over the drain, in % of all of them (from the flush
        # to the sink's last count, read a moment later): what a second node can add
        "machine_busy_pct": round(100 * (m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 1),
        # and over the steady part, 10% -> 90%
        "machine_busy_steady_pct": round(100 * (p90[0] - p10[0]) / max(1, p90[1] - p10[1]), 1),
        "delivered_in_spool": delivered,
        "delivered_per_node": per_node,
        "load_errors": errors[:20],
        "logs": logs,
    }
    if ok != n or got != ok or delivered != ok:
        say(f"  ! drain: {ok} of {n} queued, sink counted {got}, spool says {delivered} delivered")
    if before:
        say(f"  ! {before} delivered before the flush (a half-open trial as the sink came up)")
    return res


# --- main -----------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else 0.0


def ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=5000, help="messages per `single` run")
    ap.add_argument(
        "--drain", type=int, default=None, help="messages queued per `drain` run (3/5 of N)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="single,drain", help="single,drain")
    ap.add_argument("--procs", default="1,2,3", help="relay processes per `drain` run")
    ap.add_argument("--sessions", type=int, default=20, help="parallel SMTP sessions")
    ap.add_argument("--size", type=int, default=2048, help="message size in bytes")
    ap.add_argument("--tools", choices=("auto", "postfix", "python"), default="auto")
    ap.add_argument("--inbound-processes", type=int, default=1, help="of every daemon")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (configs, logs)")
    ap.add_argument(
        "--backends",
        default="sqlite,postgresql",
        help="of `single`, alternating: sqlite, postgresql, and with --base sqlite-base,"
        " postgresql-base",
    )
    ap.add_argument(
        "--base",
        default=None,
        help="another tree (e.g. `git archive REV | tar -x -C DIR`): the `...-base` backends"
        " run its relay package (PYTHONPATH), for before/after in one run",
    )
    a = ap.parse_args()
    a.backends = [b for b in a.backends.split(",") if b]
    known = {"sqlite", "postgresql"} | ({"sqlite-base", "postgresql-base"} if a.base else set())
    if not a.backends or set(a.backends) - known:
        ap.error(f"--backends: of {', '.join(sorted(known))} (the -base ones need --base)")
    a.drain = a.drain if a.drain is not None else max(1, a.messages * 3 // 5)
    only = set(a.only.split(","))
    try:
        a.procs = sorted({int(x) for x in a.procs.split(",")})
    except ValueError:
        ap.error("--procs: numbers, e.g. 1,2,3")
    if not a.procs or min(a.procs) < 1:
        ap.error("--procs: 1 or more")
    if only - {"single", "drain"} or not only:
        ap.error("--only: single, drain or both")
    have_pf = bool(tool("smtp-source") and tool("smtp-sink"))
    if a.tools == "auto":
        a.tools = "postfix" if have_pf else "python"
    elif a.tools == "postfix" and not have_pf:
        ap.error("--tools postfix: smtp-source and smtp-sink not found (Debian: postfix)")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    started = time.monotonic()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        "?",
    )
    pg = pg_info()
    DOC.update(
        started=stamp,
        commit=head + ("+dirty" if dirty else ""),
        cpus=os.cpu_count(),
        cpu=cpu,
        loadavg=os.getloadavg(),
        python=sys.version.split()[0],
        postgresql=pg,
        tools=a.tools,
        messages=a.messages,
        drain_messages=a.drain,
        rounds=a.rounds,
        sessions=a.sessions,
        size=a.size,
        inbound_processes=a.inbound_processes,
    )
    say(
        f"# bench/fleet.py {stamp} commit {DOC['commit']}; {os.cpu_count()} cpus ({cpu});"
        f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())};"
        f" Python {DOC['python']}; PostgreSQL {pg['server_version']} (fsync {pg['fsync']},"
        f" synchronous_commit {pg['synchronous_commit']}); load/sink: "
        + ("Postfix smtp-source/smtp-sink" if a.tools == "postfix" else "Python (asyncio)")
        + f"; {a.sessions} sessions, {a.size} B, inbound.processes {a.inbound_processes}"
    )
    work = Path(tempfile.mkdtemp(prefix="relay-fleet-bench-"))
    odd: dict[str, int] = {}
    try:
        if "single" in only:
            say()
            say(f"## single node, SQLite vs PostgreSQL: {a.messages} x {a.size} B, upstream up")
            rows: list[dict[str, Any]] = []
            DOC["single"] = {"runs": rows}
            t = time.monotonic()
            for rnd in range(1, a.rounds + 1):
                order = a.backends[:: 1 if rnd % 2 else -1]
                for backend in order:
                    r = single(work, a, backend, rnd)
                    rows.append(r)
                    note_logs(f"round {rnd}", r["logs"], odd)
                    say(
                        f"round {rnd} {backend:<10} accepted {r['accepted']} in"
                        f" {r['accept_s']:.2f} s = {r['accept_per_s']:.0f}/s; sink has"
                        f" {r['sink_count']} after {r['e2e_s']:.2f} s = {r['e2e_per_s']:.0f}/s;"
                        f" CPU per message: relay {r['cpu_ms_relay']:.2f} ms, its PostgreSQL"
                        f" backends {r['cpu_ms_pg']:.2f} ms (of the relay's, its main process"
                        f" {r['cpu_ms_main']:.2f} ms); commits per message"
                        f" {r['commits_per_message']:.2f}"
                    )
            med = {
                b: {
                    "accept_per_s": median([r["accept_per_s"] for r in rows if r["backend"] == b]),
                    "e2e_per_s": median([r["e2e_per_s"] for r in rows if r["backend"] == b]),
                }
                for b in a.backends
            }
            for b in a.backends:
                med[b]["cpu_ms_relay"] = [r["cpu_ms_relay"] for r in rows if r["backend"] == b]
                med[b]["cpu_ms_pg"] = [r["cpu_ms_pg"] for r in rows if r["backend"] == b]
            DOC["single"]["median"] = med
            if "sqlite" in med and "postgresql" in med:
                DOC["single"]["ratio_pg_sqlite"] = {
                    k: round(med["postgresql"][k] / med["sqlite"][k], 2)
                    if med["sqlite"][k]
                    else None
                    for k in ("accept_per_s", "e2e_per_s")
                }
            say(f"(single: {time.monotonic() - t:.0f} s)")
        if "drain" in only:
            say()
            say(
                f"## drain on PostgreSQL: {a.drain} x {a.size} B queued with the upstream down,"
                " then the sink up and `relay queue flush`;"
                f" {', '.join(map(str, a.procs))} relay processes on one spool"
            )
            drows: list[dict[str, Any]] = []
            DOC["drain"] = {"runs": drows}
            t = time.monotonic()
            for rnd in range(1, a.rounds + 1):
                k = rnd % len(a.procs)
                order = a.procs[k:] + a.procs[:k]
                order = order if rnd % 2 else order[::-1]
                for procs in order:
                    r = drain(work, a, procs, rnd)
                    drows.append(r)
                    note_logs(f"round {rnd}", r["logs"], odd)
                    say(
                        f"round {rnd} {procs} proc: filled {r['queued']} at"
                        f" {r['fill_per_s']:.0f}/s; after the flush: first delivery"
                        f" {r['first_delivery_s']} s (CLI {r['flush_cli_s']:.2f} s), all"
                        f" {r['sink_count']} in {r['drain_s']:.2f} s = {r['drain_per_s']:.0f}/s"
                        f" (10->90%: {r['steady_per_s'] or 0:.0f}/s; last 10%"
                        f" {r['last_tenth_s']:.2f} s); delivered per node"
                        f" {list(r['delivered_per_node'].values())}; CPU ms/message relays"
                        f" {r['cpu_ms'][0]:.2f}, PostgreSQL {r['cpu_ms'][1]:.2f}, sink"
                        f" {r['cpu_ms'][2]:.2f} (cores {r['cores']}; machine busy"
                        f" {r['machine_busy_pct']:.0f}%, 10->90%"
                        f" {r['machine_busy_steady_pct']:.0f}%);"
                        " load average"
                        f" {os.getloadavg()[0]:.1f}"
                    )
            keys = ("drain_per_s", "steady_per_s", "first_delivery_s", "last_tenth_s")
            dmed = {
                p: {
                    k: median([r[k] or 0.0 for r in drows if r["processes"] == p])
                    for k in (*keys, "fill_per_s", "machine_busy_pct", "machine_busy_steady_pct")
                }
                for p in a.procs
            }
            DOC["drain"]["median"] = dmed
            say(f"(drain: {time.monotonic() - t:.0f} s)")
    except BaseException as e:
        DOC["error"] = f"{type(e).__name__}: {e}"
        say(f"! the run stopped: {DOC['error']}")
        raise
    finally:
        stop_all()
        if a.keep or "error" in DOC:
            say(f"work dir kept (configs, daemon logs): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        summary(a, odd, started, stamp)
    return 0


def summary(a: argparse.Namespace, odd: dict[str, int], started: float, stamp: str) -> None:
    """The table, and the raw output files (also after a failed run: what it has)."""
    say()
    say(f"## summary (medians of {a.rounds} round(s); rates in messages/s)")
    if "median" in DOC.get("single", {}):
        med = DOC["single"]["median"]
        say(
            f"single node, {a.messages} x {a.size} B   accept/s   end-to-end/s"
            "   CPU ms/message: relay, its PostgreSQL backends (every round)"
        )
        names = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
        for b, m in med.items():
            name = names.get(b.removesuffix("-base"), b) + (
                " (base)" if b.endswith("-base") else ""
            )
            say(
                f"  {name:<27} {m['accept_per_s']:8.0f}   {m['e2e_per_s']:12.0f}"
                f"   {', '.join(f'{x:.2f}' for x in m['cpu_ms_relay'])};"
                f" {', '.join(f'{x:.2f}' for x in m['cpu_ms_pg'])}"
            )
        for x, y in (("postgresql", "sqlite"), ("postgresql", "postgresql-base")):
            if x in med and y in med:
                say(
                    f"  {x} / {y:<{26 - len(x)}}"
                    f"{ratio(med[x]['accept_per_s'], med[y]['accept_per_s']):>8}"
                    f"   {ratio(med[x]['e2e_per_s'], med[y]['e2e_per_s']):>12}"
                )
    if "median" in DOC.get("drain", {}):
        d = {int(p): v for p, v in DOC["drain"]["median"].items()}
        base = d[min(d)]  # 1 process, unless --procs left it out
        vs = f"vs {min(d)} proc"
        say(
            f"drain of {a.drain} on PostgreSQL  drain/s  {vs}  10->90%/s  {vs}"
            "  1st delivery s  last 10% s  fill/s  machine busy (10->90%)"
        )
        for p, m in sorted(d.items()):
            say(
                f"  {p} process{'es' if p > 1 else '  '}              "
                f"{m['drain_per_s']:8.0f}  {ratio(m['drain_per_s'], base['drain_per_s']):>9}"
                f"  {m['steady_per_s']:9.0f}  {ratio(m['steady_per_s'], base['steady_per_s']):>9}"
                f"  {m['first_delivery_s']:14.2f}  {m['last_tenth_s']:10.2f}"
                f"  {m['fill_per_s']:6.0f}  {m['machine_busy_pct']:5.0f}%"
                f" ({m['machine_busy_steady_pct']:.0f}%)"
            )
        DOC["drain"]["ratios"] = {
            f"{p}/{min(d)}": {
                k: round(m[k] / base[k], 2) if base[k] else None
                for k in ("drain_per_s", "steady_per_s")
            }
            for p, m in sorted(d.items())
            if p != min(d)
        }
        say(
            "  (drain/s: from the start of `relay queue flush` until the sink has all; 10->90%:"
            " the steady part; last 10%: stragglers; machine busy: all cores' time not idle over"
            " the drain, whoever used it)"
        )
    DOC["daemon_log_warnings_errors"] = odd
    say(
        "daemon logs, warnings/errors by event (all daemons): "
        + (", ".join(f"{k} {v}" for k, v in sorted(odd.items())) or "none")
    )
    say(f"# done in {time.monotonic() - started:.0f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"fleet-{stamp}.txt").write_text("\n".join(OUT) + "\n")
    (RESULTS / f"fleet-{stamp}.json").write_text(json.dumps(DOC, indent=2, default=str) + "\n")
    print(f"results: bench/results/fleet-{stamp}.txt and .json")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:  # everything was stopped and written in main's finally
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(130)
