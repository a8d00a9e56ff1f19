"""The recorder part of the engine: outcomes into the spool, with the alerts they raise and
the hooks they run. Owns the alerts waiting for the next record, the dead-letter and delay
hooks still running, the dead letters of the last hour and the time of the last delivery.

Rules:
- Every dead letter is an ERROR line `event=dead_letter` (relay/delivery/deadletters.py),
  an alert recorded in the same commit as the outcome that makes it (a crash cannot
  record a dead letter and lose its alert), and the daemon's DSN hook, run in the
  background so a slow hook never holds a worker and its connection.
- A record the spool refuses (disk full, lock) is retried, 0.5 s doubling up to 30 s,
  until it is taken or the engine stops (then the claims stay `sending` and the next start
  makes them due again: at-least-once).
- The records of one writer batch are one `ops.record_many` per node (a few statements,
  on SQLite as on PostgreSQL), the room they release summed per scope.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from relay.config.tree import Config
from relay.delivery import deadletters
from relay.delivery.jobs import DeadLetter
from relay.delivery.ledger import Ledger
from relay.ops import alerts, faults
from relay.ops.logs import log_event
from relay.spool import ops
from relay.spool.writer import Grouped, SpoolWriter

log = logging.getLogger("relay.delivery.engine")

RECORD_RETRY_FIRST = 0.5  # seconds; doubles up to 30 s while the spool refuses an outcome

DeadLetterHook = Callable[[dict[str, Any]], Awaitable[None]]


@dataclasses.dataclass(frozen=True, slots=True)
class _Record:
    """One `record` job: outcomes, the room they release, the alerts they raise."""

    outcomes: tuple[ops.RcptUpdate, ...]
    now: float
    day: str
    node: str | None
    release: dict[str, int] | None
    evs: list[alerts.Event]
    coalesce: float
    sinks: Sequence[str]


def record_jobs(c: Any, recs: list[_Record]) -> list[None]:
    """The record jobs of one writer batch: their outcomes in one `ops.record_many`, the
    room they release summed per node and scope (releasing a then b is releasing a + b),
    then their alerts. Hot rows are locked in `record`'s order, then the node's holds."""
    by_node: dict[str | None, list[_Record]] = {}
    for r in recs:
        by_node.setdefault(r.node, []).append(r)
    for node, mine in by_node.items():
        release: dict[str, int] = {}
        for r in mine:
            for scope, n in (r.release or {}).items():
                release[scope] = release.get(scope, 0) + n
        # a fleet's ceiling scopes are exactly what its jobs release (finish: the scopes
        # they reserved); the other counters go with the COMMIT (ops.record_many)
        ops.record_many(
            c, [(r.outcomes, r.now, r.day) for r in mine], owner=node, ceilings=set(release)
        )
        if release and node is not None:
            ops.ceiling_release(c, node, dict(sorted(release.items())))
    for r in recs:
        for ev in r.evs:
            alerts.record(c, ev, r.now, r.coalesce, r.sinks)
    return [None] * len(recs)


class Recorder:
    def __init__(
        self,
        writer: SpoolWriter,
        *,
        config: Callable[[], Config],
        ledger: Ledger,
        node: str,
        clock: Callable[[], float],
        stopping: Callable[[], bool],
        on_dead_letter: DeadLetterHook | None = None,
        on_recorded: Callable[[Iterable[str]], None] | None = None,
    ) -> None:
        self.writer = writer
        self._config = config
        self.ledger = ledger
        self.node = node
        self.clock = clock
        self._stopping = stopping
        self.on_dead_letter = on_dead_letter
        # told the queue ids of every record committed (the outbox's incremental write-back)
        self.on_recorded = on_recorded
        self.hooks: set[asyncio.Task[None]] = set()  # dead-letter hooks still running
        self._alert_backlog: list[alerts.Event] = []  # recorded with the next outcomes
        self.dead_times: deque[float] = deque()  # dead letters of the last hour
        self.last_delivery_at: float | None = None

    # --- dead letters, hooks, alerts ------------------------------------------------------

    def emit_dead(self, dead: list[DeadLetter], host: str | None = None) -> None:
        """Log each dead letter, queue its alert for the next record, run the DSN hook."""
        for d in dead:
            self.dead_times.append(self.clock())
            self._alert_backlog.append(deadletters.alert(d))
            deadletters.log_lines(d, host)
            self.hook(d.as_doc())

    def hook(self, doc: dict[str, Any]) -> None:
        """The daemon's DSN hook, in the background: a slow one must not hold this worker,
        and with it the destination's connection."""
        if self.on_dead_letter is None:
            return
        task = asyncio.get_running_loop().create_task(self._run_hook(doc))
        self.hooks.add(task)
        task.add_done_callback(self.hooks.discard)

    async def _run_hook(self, doc: dict[str, Any]) -> None:
        assert self.on_dead_letter is not None
        try:
            await self.on_dead_letter(doc)
        except Exception as e:
            log_event(log, logging.ERROR, "alert_failed", "dead-letter hook failed", exc=e)

    def take_alerts(self) -> list[alerts.Event]:
        evs, self._alert_backlog = self._alert_backlog, []
        return evs

    def dead_letters_last_hour(self) -> int:
        cutoff = self.clock() - 3600
        while self.dead_times and self.dead_times[0] < cutoff:
            self.dead_times.popleft()
        return len(self.dead_times)

    # --- outcomes into the spool ----------------------------------------------------------

    async def record(
        self, outcomes: Sequence[ops.RcptUpdate], release: dict[str, int] | None = None
    ) -> None:
        now = self.clock()
        day = self.ledger.day_of(now)
        config = self._config()
        delay = min(RECORD_RETRY_FIRST, config.delivery.poll_interval)
        # the alerts of the dead letters these outcomes make, in the same commit: a crash
        # cannot record a dead letter and lose its alert
        evs = self.take_alerts()
        conf = config.alerts
        sinks = alerts.sinks_of(conf)

        # grouped: the records of one writer batch are a few statements (SQLite too: one
        # SAVEPOINT and a few prepared statements for the batch, ops.record_many)
        job = Grouped(
            record_jobs,
            _Record(tuple(outcomes), now, day, self.node, release, evs, conf.coalesce, sinks),
            sqlite=True,
        )

        while True:
            try:
                faults.hit("engine.record")
                await self.writer.run(job)
                if self.on_recorded is not None:
                    self.on_recorded(o.msg_id for o in outcomes)
                return
            except Exception as ex:
                log_event(
                    log, logging.ERROR, "spool_error", "could not record outcomes; retrying", exc=ex
                )
                if self._stopping():
                    # left `sending`: the next start makes them due again (at-least-once)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)  # until the spool takes it (disk full, lock)
