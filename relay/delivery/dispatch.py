"""Dispatch: a claimed job goes on its destination's queue, or is answered at once
(suppressed, suspended, circuit open, over a daily ceiling: none of these burns an attempt).

Rules:
- The in-memory suppression list lags the spool by up to one refresh: the spool's entry,
  read in the claim's transaction, has the last word.
- A route with several upstreams is dispatched to the first whose circuit is not open and
  that is not suspended; when all are, the job waits on the first.
- What fits under the daily ceilings goes now; the rest waits for the next window. What
  goes reserves its room (relay/delivery/ledger.py) until the attempt ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from relay.config.tree import Config
from relay.delivery import decide
from relay.delivery.destinations import Destinations
from relay.delivery.jobs import Job
from relay.delivery.outcomes import ROWS, Kind
from relay.delivery.recorder import Recorder
from relay.delivery.workers import WorkerPool
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import ops

log = logging.getLogger("relay.delivery.engine")

_SUPPRESSED = ROWS[Kind.SUPPRESSED]  # answered here, before any attempt


def dispatch(
    job: Job,
    now: float,
    stored: dict[tuple[str, str], tuple[str, float] | None] | None = None,
    *,
    dests: Destinations,
    pool: WorkerPool,
    recorder: Recorder,
    config: Config,
    metrics: Metrics,
    is_suppressed: Callable[[str, str | None], tuple[str, float] | None],
) -> list[ops.RcptUpdate]:
    """Queue a job on its destination, or answer at once (suppressed, suspended, circuit
    open, over the daily ceiling): those outcomes burn no attempt. `stored`: the spool's
    suppression entries for addresses the in-memory list calls suppressed."""
    out: list[ops.RcptUpdate] = []
    keep: list[ops.Claim] = []
    for cl in job.claims:
        supp = is_suppressed(cl.address, cl.identity)
        if supp is not None and stored is not None and (cl.address, cl.identity) in stored:
            supp = stored[(cl.address, cl.identity)]
        if supp is None:
            keep.append(cl)
            continue
        metrics.count_outcome(_SUPPRESSED.metric, job.destination, _SUPPRESSED.reason)
        log_event(
            log,
            _SUPPRESSED.level,
            _SUPPRESSED.event,
            _SUPPRESSED.message,
            queue_id=job.msg_id,
            rcpt=cl.address,
            reason=supp[0],
        )
        out.append(
            ops.RcptUpdate(
                rcpt_id=cl.rcpt_id,
                msg_id=job.msg_id,
                state=_SUPPRESSED.state,
                count_attempt=False,
                next_attempt_at=None,
                last_reply=f"suppressed: {supp[0]}",
                # no attempt: the attempt log says the kind (outcomes.ATTEMPTLESS)
                log=ops.AttemptLog(Kind.SUPPRESSED.value, supp[0], job.destination, None, None),
            )
        )
    job.claims = keep
    if not keep:
        return out
    st = dests.dest(job.destination)
    limits = dests.ledger.limits(
        st.name, st.conf.daily_limit, job.identity, config.identity(job.identity), now
    )
    # state(), not allow(): allow() hands out the one half-open trial, which belongs to
    # the worker that will actually connect, not to this check
    circuit = None
    if st.breaker.state(now) == "open":
        circuit = st.breaker.reopens_at(now)
    verdict = decide.admit(
        len(keep),
        name=st.name,
        now=now,
        suspended_until=st.suspended_until,
        suspend_reason=st.suspend_reason,
        circuit_until=circuit,
        room=dests.ledger.room(limits, now) if limits else None,
    )
    if isinstance(verdict, decide.Wait):
        outs, dead = decide.wait(
            job, keep, verdict.until, verdict.reason, now=now, max_age=config.retry.max_age
        )
        recorder.emit_dead(dead)
        return out + outs
    if isinstance(verdict, decide.Split):
        # what fits goes now; the rest of the recipients waits for the next window
        rest, job.claims = keep[verdict.fit :], keep[: verdict.fit]
        metrics.count_outcome(ROWS[Kind.DEFERRED].metric, st.name, "daily_limit", len(rest))
        log_event(
            log,
            logging.INFO,
            "deferred",
            verdict.reason,
            queue_id=job.msg_id,
            destination=st.name,
            rcpts=[c.address for c in rest],
        )
        outs, dead = decide.wait(
            job, rest, verdict.until, verdict.reason, now=now, max_age=config.retry.max_age
        )
        recorder.emit_dead(dead)
        out.extend(outs)
        if not job.claims:
            return out
    n = len(job.claims)
    st.reserved += n
    job.reserved = tuple(scope for scope, _name, _limit in limits)
    dests.ledger.reserve(job.reserved, n)
    st.queues.get(job.lane, st.queues["transactional"]).append(job)
    pool.job_queued(n)
    pool.spawn_workers(st)
    st.wake.set()
    return out
