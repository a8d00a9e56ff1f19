"""Stopping a process's own asyncio tasks at shutdown (the daemon's, an inbound process's).

Rules:
- Each task is cancelled and waited for. One still running a second after its cancel is
  cancelled again: a cancel can be lost (Python 3.11's `asyncio.wait_for` dropped one that
  came as its job finished, and the health loop ran on; docs/development.md), and a lost
  one is where a shutdown hangs.
- After `GRACE` seconds the tasks left are logged (`event: shutdown`, the task and where it
  waits: a bug to report) and left behind, so that the shutdown goes on to close the spool;
  the daemon's watchdog (relay/daemon.py) stays the last resort.
- A task that ended with an exception of its own is not an error of the shutdown: its
  exception is retrieved, not raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from relay.ops.logs import log_event

log = logging.getLogger(__name__)

GRACE = 5.0  # seconds a process's own tasks get to end once cancelled


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any]], grace: float = GRACE
) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait for them to end (see the rules); the ones left after `grace`
    seconds are logged and returned."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        done, pending = await asyncio.wait(
            pending, timeout=max(0.0, min(1.0, deadline - loop.time()))
        )
        for t in done:  # their exceptions were the task's own business: retrieved, not raised
            if not t.cancelled():
                t.exception()
        if loop.time() >= deadline:
            break
    for t in pending:
        frames = t.get_stack(limit=1)
        where = f"{frames[0].f_code.co_filename}:{frames[0].f_lineno}" if frames else "?"
        log_event(
            log,
            logging.ERROR,
            "shutdown",
            "a task did not end when cancelled: left behind",
            task=t.get_name(),
            at=where,
        )
    return pending
