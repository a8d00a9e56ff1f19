"""Maintenance: the daemon's housekeeping every two seconds.

Rules:
- Every MAINTENANCE_EVERY: the suppression list is read again (a CLI change takes effect
  within one tick), the runtime snapshot is written to the spool (what `relay status` and
  `relay queue` show of the running daemon: <= 2 s old), and the engine is woken (a CLI
  retry, release or flush is picked up promptly).
- Every PRUNE_EVERY (and at start): finished messages past `spool.retention`, expired
  dedup keys, and body files no row names are removed. `spool.retention: 0` prunes every
  tick: a finished message (and its body: reset links, one-time codes) is gone within one
  tick of its last recipient.
- A failed pass is logged and the next one runs: maintenance never stops.
- SQLite: each upstream's failing time is kept in the runtime row FAILING_SINCE, so a
  restart does not reset the clock of `health.failing_after` (`restore` at start). A fleet
  on PostgreSQL writes each node's own snapshot (`node:<name>`) instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relay.delivery import views
from relay.ops.logs import log_event
from relay.spool import bodies, ops

if TYPE_CHECKING:
    from relay.config.tree import Config
    from relay.delivery.engine import Engine
    from relay.inbound.handler import Suppressions
    from relay.inbound.stats import InboundStats
    from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

MAINTENANCE_EVERY = 2.0  # seconds: suppression refresh, runtime snapshot (CLI sees <= 2 s)
PRUNE_EVERY = 600.0
# one prune pass deletes finished messages in batches (ops.PRUNE_BATCH, each its own writer
# job) until a batch comes back short, for at most this long; a pass cut short resumes at
# the next maintenance tick (MAINTENANCE_EVERY), not PRUNE_EVERY later, so the prune keeps
# up with any rate the writer sustains (it was 5,000 messages per 600 s, ~8.3/s)
PRUNE_BUDGET = 10.0
FAILING_SINCE = "failing_since"  # runtime row: upstream -> first failure since its answer


class Maintenance:
    def __init__(
        self,
        config: Callable[[], Config],
        writer: SpoolWriter,
        engine: Engine,
        suppressions: Suppressions,
        stats: InboundStats,
        started_at: float,
    ) -> None:
        self.config = config
        self.writer = writer
        self.engine = engine
        self.suppressions = suppressions
        self.stats = stats
        self.started_at = started_at

    async def restore(self) -> None:
        """At start (SQLite): the failing time of each upstream, as the last run left it."""
        if self.config().spool_pg is not None:
            return
        left = await self.writer.run(lambda c: ops.get_runtime(c, FAILING_SINCE))
        if left is not None and isinstance(left[0], dict):
            views.seed_failing_since(self.engine.dests, left[0])

    async def run(self) -> None:
        last_prune = -PRUNE_EVERY  # first pass at start: expired keys, orphan bodies
        behind = False  # the last prune pass ran out of its budget: go on at the next tick
        while True:
            try:
                await self.suppressions.refresh(self.writer)
                await self.write_runtime()
                # spool.retention 0: a finished message (and its body: reset links, one-time
                # codes) is gone within one maintenance tick of its last recipient
                if (
                    behind
                    or time.monotonic() - last_prune > PRUNE_EVERY
                    or self.config().retention == 0
                ):
                    last_prune = time.monotonic()
                    behind = False
                    behind = not await self.prune()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event(log, logging.ERROR, "maintenance_error", "maintenance pass failed", exc=e)
            await asyncio.sleep(MAINTENANCE_EVERY)
            self.engine.wake()  # pick up CLI changes (retry, release, flush) promptly

    async def write_runtime(self) -> None:
        """The runtime snapshot of this daemon, for the CLI (also once more at shutdown)."""
        snap = self.engine.snapshot().as_json()
        snap["pid"] = os.getpid()
        snap["host"] = socket.gethostname()
        snap["node"] = self.engine.node
        snap["fleet_size"] = self.engine.fleet_size
        snap["started_at"] = ops.iso_utc(self.started_at)
        snap["inbound"] = self.stats.totals()  # with the inbound processes' counts
        now = time.time()
        node = self.engine.node
        pg = self.config().spool_pg is not None

        failing = views.failing_since(self.engine.dests)

        def put(c: Any) -> None:
            # a fleet: the last node's view as `daemon`, and each node's own view
            ops.put_runtime(c, "daemon", snap, now)
            if pg:
                ops.put_runtime(c, f"node:{node}", snap, now)
            else:  # for the next start (relay/delivery/views.py failing_since)
                ops.put_runtime(c, FAILING_SINCE, failing, now)

        await self.writer.run(put)

    async def prune(self) -> bool:
        """One prune pass; False: finished messages are left over (the budget ran out)."""
        cfg = self.config()
        now = time.time()
        window = cfg.dedup_window
        retention = cfg.retention
        spool = cfg.spool_path
        await self.writer.run(lambda c: ops.prune_side_tables(c, now, window, retention))
        deadline = time.monotonic() + PRUNE_BUDGET
        messages = 0
        while True:
            n, paths = await self.writer.run(
                lambda c: ops.prune_finished(c, now, retention, ops.PRUNE_BATCH)
            )
            messages += n
            if paths:  # after their rows' commit: a crash between leaves orphans (swept)
                await asyncio.to_thread(bodies.delete_bodies, spool, paths)
            done = n < ops.PRUNE_BATCH
            if done or time.monotonic() >= deadline:
                break
        known = await self.writer.run(ops.body_paths)
        removed = await asyncio.to_thread(bodies.sweep, spool, known)
        if messages or removed:
            log_event(
                log,
                logging.INFO,
                "pruned",
                "finished messages and orphan bodies removed",
                messages=messages,
                orphan_bodies=len(removed),
                caught_up=done,
            )
        return done
