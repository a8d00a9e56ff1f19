"""Fault injection at the seams, so tests drive the failure paths of a real daemon without
patching the code under test.

Rules:
- A seam is one named call, `faults.hit("spool.commit")`, at the exact place where the real
  failure would surface. Unarmed (always, in production) it costs one dict lookup.
- Faults are armed in-process with `arm()` (unit tests), or for a daemon subprocess through
  `RELAY_FAULTS_FILE`: a file of lines `seam error [times=N] [after=N]`, re-read when it
  changes (at most every 50 ms), so a test can make the disk "full" and then "free" again
  while the daemon runs. `RELAY_FAULTS` holds the same lines for faults from the start.
- Seams: `spool.begin`, `spool.job` (inside a job's savepoint), `spool.commit` (instead of
  COMMIT), `body.write` (a body file write), `inbound.accept` (the DATA hook, before the
  spool), `engine.record` (recording an attempt's outcomes), `transport.body` (writing a
  body upstream, before the final dot), `engine.claim` (after a claim pass that claimed
  something committed: its answer lost, as when a PostgreSQL connection drops after its
  COMMIT), `dkim.sign` (signing a message on its way out),
  `clock` (see `offset()`). DNS failures need no
  seam: the tests' loopback name server answers SERVFAIL or nothing on request.
- Errors: `enospc` / `eio` (OSError for files; for the database the sqlite3 error SQLite
  gives: "database or disk is full" / "disk I/O error"), `locked` ("database is locked"),
  `reset` (ConnectionResetError), `error` (RuntimeError, an unexpected bug).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

ENV_FILE = "RELAY_FAULTS_FILE"
ENV_SPEC = "RELAY_FAULTS"


class InjectedFault(RuntimeError):
    """An `error` fault: stands for an unexpected exception (a bug) at the seam."""


@dataclass(slots=True)
class Fault:
    error: str
    times: int = -1  # -1: every hit
    after: int = 0  # let this many hits pass first
    value: float = 0.0  # for `clock`: seconds to add


_lock = threading.Lock()
_armed: dict[str, Fault] = {}
_file_state: tuple[str, float, float] | None = None  # (path, mtime, last check)
_file_path: str | None = None  # RELAY_FAULTS_FILE, read by load_env()


def arm(seam: str, error: str, times: int = -1, after: int = 0, value: float = 0.0) -> None:
    with _lock:
        _armed[seam] = Fault(error, times, after, value)


def disarm_all() -> None:
    global _file_state
    with _lock:
        _armed.clear()
        _file_state = None


def parse(text: str) -> dict[str, Fault]:
    """`seam error [times=N] [after=N] [value=X]` per line; `#` comments."""
    out: dict[str, Fault] = {}
    for raw in text.replace(";", "\n").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        seam, error, *opts = line.split()
        fault = Fault(error)
        for opt in opts:
            key, _, val = opt.partition("=")
            if key == "times":
                fault.times = int(val)
            elif key == "after":
                fault.after = int(val)
            elif key == "value":
                fault.value = float(val)
            else:
                raise ValueError(f"fault option {key!r} unknown in {line!r}")
        out[seam] = fault
    return out


def load_env() -> None:
    """Called once at daemon start."""
    global _file_path
    _file_path = os.environ.get(ENV_FILE) or None
    spec = os.environ.get(ENV_SPEC)
    if spec:
        with _lock:
            _armed.update(parse(spec))


def _refresh() -> None:
    global _file_state
    path = _file_path
    if not path:
        return
    now = time.monotonic()
    if _file_state is not None and now - _file_state[2] < 0.05:
        return
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = -1.0
    if _file_state is not None and _file_state[1] == mtime:
        _file_state = (path, mtime, now)
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    with _lock:
        _armed.clear()
        _armed.update(parse(text))
    _file_state = (path, mtime, now)


def _take(seam: str) -> Fault | None:
    _refresh()
    if not _armed:
        return None
    with _lock:
        fault = _armed.get(seam)
        if fault is None:
            return None
        if fault.after > 0:
            fault.after -= 1
            return None
        if fault.times == 0:
            return None
        if fault.times > 0:
            fault.times -= 1
        return fault


def hit(seam: str) -> None:
    """Raise the armed fault for this seam, if any."""
    if not _armed and _file_path is None:
        return
    fault = _take(seam)
    if fault is None:
        return
    kind = fault.error
    if seam.startswith("spool."):
        message = {
            "enospc": "database or disk is full",
            "eio": "disk I/O error",
            "locked": "database is locked",
        }.get(kind)
        if message is not None:
            raise sqlite3.OperationalError(message)
    if kind == "reset":
        raise ConnectionResetError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if kind == "eio":
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    raise InjectedFault(f"injected fault at {seam}")


def offset() -> float:
    """Seconds to add to the wall clock (`clock shift value=N`): lets a test age the queue
    without waiting."""
    if not _armed and _file_path is None:
        return 0.0
    _refresh()
    fault = _armed.get("clock")
    return fault.value if fault is not None else 0.0


def now() -> float:
    """The daemon's wall clock: time.time(), plus a test's `clock` offset."""
    return time.time() + offset()
