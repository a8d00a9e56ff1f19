"""The engine's workers: one task per connection of a destination, taking its jobs
transactional first, bulk within its share of connections.

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
from typing import TYPE_CHECKING

from relay.delivery import attempt, decide
from relay.delivery.jobs import DestState, Job
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import Connection, RcptResult
from relay.ops.logs import log_event
from relay.spool import ops

if TYPE_CHECKING:
    from relay.delivery.engine import Engine

log = logging.getLogger("relay.delivery.engine")

IDLE_CLOSE = 5.0  # seconds an idle connection stays open waiting for more work


def spawn_workers(e: Engine, st: DestState) -> None:
    want = min(st.adaptive.effective_connections(), st.queued())
    total = sum(len(d.workers) for d in e.dests.values())
    while len(st.workers) < want and total < e.config.delivery.workers:
        total += 1
        task = asyncio.get_running_loop().create_task(worker(e, st))
        st.workers.add(task)
        task.add_done_callback(st.workers.discard)


def next_job(e: Engine, st: DestState) -> Job | None:
    if st.queues["transactional"]:
        return st.queues["transactional"].popleft()
    if st.queues["bulk"]:
        share = e.config.lanes.shares.get("bulk", 0.5)
        cap = max(1, math.floor(st.adaptive.effective_connections() * share))
        if st.active["bulk"] < cap:
            return st.queues["bulk"].popleft()
    return None


async def worker(e: Engine, st: DestState) -> None:
    conn: Connection | None = None
    try:
        while not e.stopping:
            job = next_job(e, st)
            if job is None:
                st.wake.clear()
                try:
                    await asyncio.wait_for(st.wake.wait(), IDLE_CLOSE)
                except TimeoutError:
                    return
                continue
            if len(st.workers) > st.adaptive.effective_connections():
                # slowed down: this worker bows out after putting the job back
                st.queues[job.lane].appendleft(job)
                return
            st.active[job.lane] += 1
            try:
                conn = await attempt.deliver(e, st, job, conn)
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
                    reply = Reply(451, "4.3.0", f"internal error: {type(ex).__name__}")
                    v = Verdict(Outcome.TRANSIENT, True, False, Scope.TRANSACTION)
                    await attempt.apply(
                        e,
                        st,
                        job,
                        {c.address: RcptResult(v, reply, Phase.CONNECT) for c in job.claims},
                        host=None,
                        duration=0.0,
                        upstream_seen=False,
                    )
            finally:
                st.active[job.lane] -= 1
            if other_destination_starved(e, st):
                return  # hand this connection slot to a destination that has none
    finally:
        if conn is not None:
            await conn.quit()
        if not e.stopping:
            # this connection slot is free now: give it to whoever waits for one
            st.workers.discard(asyncio.current_task())
            # destinations with work and no connection at all come first
            for d in sorted(
                (d for d in e.dests.values() if d.queued()),
                key=lambda d: (bool(d.workers), d is not st),
            ):
                spawn_workers(e, d)


def other_destination_starved(e: Engine, st: DestState) -> bool:
    """With every connection slot (`delivery.workers`) taken, a destination with work
    and no worker at all gets the slot of a busy one after its current transaction."""
    if sum(len(d.workers) for d in e.dests.values()) < e.config.delivery.workers:
        return False
    return any(d is not st and d.queued() and not d.workers for d in e.dests.values())


async def wait_token(e: Engine, st: DestState) -> None:
    while st.bucket is not None:
        now = e.clock()
        if st.bucket.try_take(now):
            return
        await asyncio.sleep(max(0.001, st.bucket.wait_time(now)))


async def drain(e: Engine, timeout: float, hooks: list[asyncio.Task[None]]) -> None:
    """At stop: each worker finishes its current transaction (up to `timeout`), then the
    DSN hooks; jobs queued but not started go back to deferred, due now (then the engine
    gives back the claims still `sending`: relay/delivery/fleet.py `leave`)."""
    deadline = time.monotonic() + timeout
    for st in e.dests.values():
        st.wake.set()
    tasks = [t for st in e.dests.values() for t in st.workers]
    for i, group in enumerate((tasks, hooks)):
        if not group:
            continue
        _done, pending = await asyncio.wait(group, timeout=max(0.1, deadline - time.monotonic()))
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
    now = e.clock()
    for st in e.dests.values():
        for q in st.queues.values():
            while q:
                job = q.popleft()
                outs, dead = decide.wait(
                    job, job.claims, now, "daemon stopped", now=now, max_age=e.config.retry.max_age
                )
                e.recorder.emit_dead(dead)
                back.extend(outs)
    if back:
        await e.recorder.record(back)
