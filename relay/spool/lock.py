"""One daemon per SQLite spool: an flock on `<spool>/daemon.lock`, held for the life of the
process (the kernel drops it at exit).

Rules:
- A second daemon on the same SQLite spool would take the first one's claims in flight for
  a crash's leftovers and send them again: it does not start (`relay serve` exits 75).
- The lock file holds the holder's pid, for the log line of the one refused.
- A fleet shares a PostgreSQL spool through leases instead; more SMTP processes on one
  SQLite spool: relay/inbound/processes.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from relay.ops.logs import log_event

log = logging.getLogger(__name__)

DAEMON_LOCK = "daemon.lock"  # held by the one daemon of a SQLite spool


def lock_spool(path: Path) -> int | None:
    """The lock's file descriptor (keep it open), or None when another daemon holds it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o750)
    fd = os.open(path / DAEMON_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        log_event(
            log,
            logging.ERROR,
            "spool_locked",
            "another relay daemon runs on this spool; not starting a second one",
            spool=str(path),
            pid=holder,
        )
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
