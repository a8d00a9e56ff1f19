"""The worker pool part of the engine: one task per connection of a destination, taking its
jobs transactional first, bulk within its share of connections. Owns the count of
recipients in memory (queued or being sent); the attempt itself is the `deliver` it is
given (relay/delivery/attempt.py).

Rules:
- A destination gets as many workers as its (adaptive) connection limit allows and it has
  jobs, within `delivery.workers` in all. A worker keeps its connection for the next job
  and closes it after `IDLE_CLOSE` seconds without one.
- A slowed-down destination (fewer connections allowed) loses workers after their
  current transaction; with every slot taken, a destination with work and no worker at all
  gets the slot of a busy one after its current transaction (no starvation).
- A bug in one attempt never strands its claims: they are recorded as a transient failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from relay.config.tree import Config
from relay.delivery import decide
from relay.delivery.destinations import Destinations
from relay.delivery.jobs import DestState, Job
from relay.delivery.recorder import Recorder
from relay.delivery.transport import Connection
from relay.ops.logs import log_event
from relay.spool import ops

log = logging.getLogger("relay.delivery.engine")

IDLE_CLOSE = 5.0  # seconds an idle connection stays open waiting for more work

# one job through a destination on the worker's connection -> the connection to keep
Deliver = Callable[[DestState, Job, Connection | None], Awaitable[Connection | None]]
# a job whose attempt raised: its claims recorded as a transient failure
Failed = Callable[[DestState, Job, Exception], Awaitable[None]]


class WorkerPool:
    def __init__(
        self,
        dests: Destinations,
        recorder: Recorder,
        *,
        config: Callable[[], Config],
        clock: Callable[[], float],
        stopping: Callable[[], bool],
        deliver: Deliver,
        failed: Failed,
        on_done: Callable[[], None],
    ) -> None:
        self.dests = dests
        self.recorder = recorder
        self._config = config
        self.clock = clock
        self._stopping = stopping
        self._deliver = deliver
        self._failed = failed
        self._on_done = on_done  # room in memory again: the claim loop may claim more
        self.inflight = 0  # recipients queued in memory or being sent

    def job_queued(self, n: int) -> None:
        self.inflight += n

    def job_done(self, n: int) -> None:
        self.inflight = max(0, self.inflight - n)
        self._on_done()

    def spawn_workers(self, st: DestState) -> None:
        want = min(st.adaptive.effective_connections(), st.queued())
        total = sum(len(d.workers) for d in self.dests.values())
        while len(st.workers) < want and total < self._config().delivery.workers:
            total += 1
            task = asyncio.get_running_loop().create_task(self._worker(st))
            st.workers.add(task)
            task.add_done_callback(st.workers.discard)

    def _next_job(self, st: DestState) -> Job | None:
        if st.queues["transactional"]:
            return st.queues["transactional"].popleft()
        if st.queues["bulk"]:
            share = self._config().lanes.shares.get("bulk", 0.5)
            cap = max(1, math.floor(st.adaptive.effective_connections() * share))
            if st.active["bulk"] < cap:
                return st.queues["bulk"].popleft()
        return None

    async def _worker(self, st: DestState) -> None:
        conn: Connection | None = None
        try:
            while not self._stopping():
                job = self._next_job(st)
                if job is None:
                    st.wake.clear()
                    try:
                        async with asyncio.timeout(IDLE_CLOSE):
                            await st.wake.wait()
                    except TimeoutError:
                        return
                    continue
                if len(st.workers) > st.adaptive.effective_connections():
                    # slowed down: this worker bows out after putting the job back
                    st.queues[job.lane].appendleft(job)
                    return
                st.active[job.lane] += 1
                try:
                    conn = await self._deliver(st, job, conn)
                except Exception as ex:
                    # a bug or an unforeseen error must not strand the claim in memory
                    # (`sending` until restart): record it as a transient failure
                    log_event(
                        log,
                        logging.ERROR,
                        "engine_error",
                        "delivery attempt failed",
                        queue_id=job.msg_id,
                        destination=st.name,
                        exc=ex,
                    )
                    if conn is not None:
                        conn.close()
                        conn = None
                    if not job.done:
                        await self._failed(st, job, ex)
                finally:
                    st.active[job.lane] -= 1
                if self._other_destination_starved(st):
                    return  # hand this connection slot to a destination that has none
        finally:
            if conn is not None:
                await conn.quit()
            if not self._stopping():
                # this connection slot is free now: give it to whoever waits for one
                st.workers.discard(asyncio.current_task())
                # destinations with work and no connection at all come first
                for d in sorted(
                    (d for d in self.dests.values() if d.queued()),
                    key=lambda d: (bool(d.workers), d is not st),
                ):
                    self.spawn_workers(d)

    def _other_destination_starved(self, st: DestState) -> bool:
        """With every connection slot (`delivery.workers`) taken, a destination with work
        and no worker at all gets the slot of a busy one after its current transaction."""
        dests = self.dests.values()
        if sum(len(d.workers) for d in dests) < self._config().delivery.workers:
            return False
        return any(d is not st and d.queued() and not d.workers for d in dests)

    async def wait_token(self, st: DestState) -> None:
        while st.bucket is not None:
            now = self.clock()
            if st.bucket.try_take(now):
                return
            await asyncio.sleep(max(0.001, st.bucket.wait_time(now)))

    async def drain(self, timeout: float) -> None:
        """At stop: each worker finishes its current transaction (up to `timeout`), then
        the DSN hooks; jobs queued but not started go back to deferred, due now (then the
        engine gives back the claims still `sending`: relay/delivery/fleet.py `leave`)."""
        deadline = time.monotonic() + timeout
        for st in self.dests.values():
            st.wake.set()
        tasks = [t for st in self.dests.values() for t in st.workers]
        hooks = list(self.recorder.hooks)
        for i, group in enumerate((tasks, hooks)):
            if not group:
                continue
            _done, pending = await asyncio.wait(
                group, timeout=max(0.1, deadline - time.monotonic())
            )
            if pending and i == 0:
                log_event(
                    log,
                    logging.WARNING,
                    "shutdown",
                    "deliveries still running at shutdown_timeout; they will be retried",
                    connections=len(pending),
                )
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        back: list[ops.RcptUpdate] = []
        now = self.clock()
        max_age = self._config().retry.max_age
        for st in self.dests.values():
            for q in st.queues.values():
                while q:
                    job = q.popleft()
                    outs, dead = decide.wait(
                        job, job.claims, now, "daemon stopped", now=now, max_age=max_age
                    )
                    self.recorder.emit_dead(dead)
                    back.extend(outs)
        if back:
            await self.recorder.record(back)
