"""One delivery attempt, the engine's async shell around the pure core: connect (with
failover along the route), send, turn the results into outcomes (relay/delivery/decide.py),
update the destination's breaker and slow-down, record, and raise dead letters and delay
warnings.

Rules:
- Failover (routes with several upstreams in `via`): a connection-level failure, a 421
  greeting, an AUTH or TLS failure, or an open circuit on one upstream sends the
  transaction to the next upstream within the same attempt. Each upstream's own breaker and
  config-error flag see its own failure. Once an upstream answered the transaction, its
  per-recipient replies are final for this attempt.
- A connection opened by failover carries this one transaction and is closed: the
  worker's reusable connection stays with its own destination.
- Dead letters' alerts are recorded in the same commit as the outcomes that make them.
- What one recipient's outcome does here (its counter, its log line, a delivery's count, a
  suppression, a dead letter, the delay warning) is its row of the outcome table
  (relay/delivery/outcomes.py): `apply` reads the row's data and flags, never the kind's name.

`Attempt` is what an attempt reads of the engine's parts: the destinations, the connector,
the recorder and the worker pool, each given by the engine that composes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from relay.delivery import decide, outbound, rewrite, shaping
from relay.delivery.jobs import DeadLetter, DestState, Job
from relay.delivery.outcomes import ROWS, Kind
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import Connection, RcptResult
from relay.delivery.upstream_ids import upstream_id
from relay.ops import alerts
from relay.ops.logs import held_lines, log_event
from relay.spool import bodies, ops
from relay.spool.model import RcptState

if TYPE_CHECKING:
    from relay.config.tree import Config
    from relay.delivery.connect import Connector
    from relay.delivery.destinations import Destinations
    from relay.delivery.recorder import Recorder
    from relay.ops.metrics import Metrics

log = logging.getLogger("relay.delivery.engine")


class Workers(Protocol):
    """What an attempt asks of the worker pool (relay/delivery/workers.py)."""

    def spawn_workers(self, st: DestState) -> None: ...

    async def wait_token(self, st: DestState) -> None: ...

    def job_done(self, n: int) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """The parts one attempt works with (the engine composes it once)."""

    get_config: Callable[[], Config]
    clock: Callable[[], float]
    rng: random.Random
    metrics: Metrics
    dests: Destinations
    connector: Connector
    recorder: Recorder
    pool: Workers
    fleet: bool  # a fleet releases the ceiling room it held in the commit that counts
    on_suppressed: Callable[[str, str, float], None]  # a hard bounce: suppress the address

    @property
    def config(self) -> Config:
        return self.get_config()


async def deliver(
    e: Attempt, st: DestState, job: Job, conn: Connection | None
) -> Connection | None:
    """One job through `st` (the worker's destination), reusing `conn` when it can.
    Returns the connection to keep for the next job (None: none)."""
    now = e.clock()
    before = st.breaker.state(now)
    allowed = True
    if st.suspended_until > now or (not st.breaker.allow(now)):
        if not (job.route and len(job.route.via) > 1):
            until = max(st.suspended_until, st.breaker.reopens_at(now))
            # half-open with the trial still out: the cooldown is already over, so do not
            # make the job due at once again (a busy loop until the trial reports)
            until = max(until, now + e.config.retry.min_delay)
            reason = (
                f"destination {st.name} suspended until {ops.iso_utc(until)}"
                if st.suspended_until > now
                else f"circuit open for {st.name} until {ops.iso_utc(until)}"
            )
            outs, dead = decide.wait(
                job, job.claims, until, reason, now=now, max_age=e.config.retry.max_age
            )
            e.recorder.emit_dead(dead)
            await finish(e, job, outs, delivered=0)
            return conn
        allowed = False  # failover routes: the next upstream may take it
        await _drop(conn)
        conn = None
    elif before == "half-open":
        log_event(
            log,
            logging.INFO,
            "circuit_half_open",
            "cooldown over: this connection is the trial",
            destination=st.name,
        )
    await e.pool.wait_token(st)
    body: bytes | bodies.StoredBody | None = job.envelope.body
    if job.envelope.body_path:
        try:  # streamed from the file by the transport; here only checked to be there
            body = await asyncio.to_thread(
                bodies.StoredBody.open,
                e.config.spool_path,
                job.envelope.body,
                job.envelope.body_path,
            )
        except OSError as ex:
            reply = Reply(451, "4.3.0", f"spool body unreadable: {ex.strerror}")
            await _not_sent(e, st, job, reply)
            return conn
    assert body is not None
    sender = job.sender
    rw = job.route.rewrite if job.route is not None else None
    if rw is not None:
        sender, body = await rewrite.apply(rw, sender, body)
    try:  # one-click unsubscribe headers, DKIM signatures: over the bytes that go out
        body = await outbound.prepare(e.config, job, body)
    except outbound.OutboundError as ex:
        log_event(
            log,
            logging.ERROR,
            "dkim_failed" if "DKIM" in str(ex) else "outbound_failed",
            "message not sent unsigned: deferred",
            queue_id=job.msg_id,
            destination=st.name,
            error=str(ex),
        )
        await _not_sent(e, st, job, Reply(451, "4.7.0", str(ex)))
        return conn
    rcpts = [c.address for c in job.claims]
    if conn is not None and (
        not conn.usable or conn.messages >= st.conf.max_messages_per_connection
    ):
        await _drop(conn)
        conn = None
    used = st
    if conn is None:
        conn, used, failure, tried = await e.connector.open_for(st, job, first_allowed=allowed)
        if conn is None:
            assert failure is not None
            await apply(
                e,
                used,
                job,
                failure,
                host=None,
                duration=0.0,
                connection_failed=tried,
                upstream_seen=tried,
            )
            return None
    result = await conn.send(sender, rcpts, body)
    await apply(
        e,
        used,
        job,
        result.results,
        host=conn.label,
        duration=result.duration,
        connection_failed=result.connection_failed,
    )
    if used is not st or not conn.usable:  # a failover connection: this transaction only
        await _drop(conn)
        return None
    return conn


async def _not_sent(e: Attempt, st: DestState, job: Job, reply: Reply) -> None:
    """Our own failure before the upstream saw anything: every recipient deferred with
    `reply`; the destination's health is not touched."""
    await apply(
        e,
        st,
        job,
        {
            c.address: RcptResult(
                Verdict(Outcome.TRANSIENT, False, False, Scope.TRANSACTION),
                reply,
                Phase.CONNECT,
            )
            for c in job.claims
        },
        host=None,
        duration=0.0,
        upstream_seen=False,
    )


async def internal_error(e: Attempt, st: DestState, job: Job, ex: Exception) -> None:
    """An attempt that raised (a bug, an unforeseen error): every recipient is recorded as
    a transient failure, so no claim stays stranded in memory."""
    reply = Reply(451, "4.3.0", f"internal error: {type(ex).__name__}")
    v = Verdict(Outcome.TRANSIENT, True, False, Scope.TRANSACTION)
    await apply(
        e,
        st,
        job,
        {c.address: RcptResult(v, reply, Phase.CONNECT) for c in job.claims},
        host=None,
        duration=0.0,
        upstream_seen=False,
    )


async def _drop(conn: Connection | None) -> None:
    if conn is not None:
        await conn.quit()


@dataclasses.dataclass(slots=True)
class _Tally:
    """One attempt's outcomes as `apply` gathers them, recipient by recipient."""

    outcomes: list[ops.RcptUpdate] = dataclasses.field(default_factory=list)
    upstream_ids: dict[int, str] = dataclasses.field(default_factory=dict)  # by rcpt_id
    dead: list[DeadLetter] = dataclasses.field(default_factory=list)
    delivered: int = 0
    throttled: bool = False
    rule_hit: shaping.ShapingRule | None = None
    delayed: tuple[ops.Claim, str] | None = None  # the message's delay warning is due
    # recipients by (attempts' label, outcome metric, its reason): counted once per attempt
    counts: dict[tuple[str, str, str | None], int] = dataclasses.field(default_factory=dict)


async def apply(
    e: Attempt,
    st: DestState,
    job: Job,
    results: dict[str, RcptResult],
    *,
    host: str | None,
    duration: float,
    connection_failed: bool = False,
    upstream_seen: bool = True,
) -> None:
    """Record one attempt's results. `st` is the destination that carried it (after any
    failover). `upstream_seen` False: the attempt never reached the upstream (our own
    error), so it says nothing about the destination's health."""
    now = e.clock()
    policy = decide.Policy(
        e.config.retry.schedule,
        e.config.retry.max_age,
        e.config.retry.min_delay,
        st.conf.ambiguous,
        e.config.retry.warn_after,
    )
    t = _Tally()
    # the recipients' lines in one write (a 5-recipient message: one system call, not five)
    with held_lines():
        try:
            for cl in job.claims:
                res = results.get(cl.address)
                d = decide.decide(
                    job,
                    cl,
                    res,
                    now=now,
                    policy=policy,
                    rng=e.rng,
                    dest=st.name,
                    host=host,
                    duration=duration,
                )
                _tally(e, st, job, cl, res, d, t, now=now, host=host, duration=duration)
        finally:
            for (logged, metric, reason), n in t.counts.items():  # a counter's labels once
                e.metrics.attempts.labels(st.name, logged).inc(n)
                e.metrics.count_outcome(metric, st.name, reason, n)
        _health(
            e, st, results, t, now, upstream_seen=upstream_seen, connection_failed=connection_failed
        )
        e.recorder.emit_dead(t.dead, host)  # before the record: its alerts go in the same commit
    await finish(e, job, t.outcomes, t.delivered, t.upstream_ids)
    if t.delayed is not None:
        await delay_warning(e, st, job, *t.delayed)


def _tally(
    e: Attempt,
    st: DestState,
    job: Job,
    cl: ops.Claim,
    res: RcptResult | None,
    d: decide.Decision,
    t: _Tally,
    *,
    now: float,
    host: str | None,
    duration: float,
) -> None:
    """One recipient's decision: what its row of the outcome table says (the counter, the
    log line, the flags' effects), and what the attempt's reply says on top."""
    row = ROWS[d.kind]
    reply = str(res.reply) if res is not None else str(decide.NO_REPLY.reply)
    uid = upstream_id(reply) if row.counts else None
    t.outcomes.append(d.outcome)
    if uid is not None:  # set with the day's counters, in finish (one replace, not two)
        t.upstream_ids[cl.rcpt_id] = uid
    key = (d.logged, row.metric, row.reason)
    t.counts[key] = t.counts.get(key, 0) + 1
    if d.logged == "ambiguous":
        log_event(
            log,
            logging.WARNING,
            "ambiguous",
            "connection lost after the final dot: the upstream may have the message",
            queue_id=job.msg_id,
            rcpt=cl.address,
            destination=st.name,
            policy=st.conf.ambiguous,
        )
    if res is not None and res.verdict.throttled:
        t.throttled = True
        t.rule_hit = t.rule_hit or shaping.match_rules(e.dests.rules, reply)
    if row.counts:
        t.delivered += 1
        e.recorder.last_delivery_at = now
        e.metrics.latency.observe(max(0.0, now - cl.created_at))
    if row.suppresses:
        e.on_suppressed(cl.address, reply, now)
    if not row.dead:  # a dead letter's line is its own (relay/delivery/deadletters.py)
        log_event(
            log,
            row.level,
            row.event,
            row.message,
            queue_id=job.msg_id,
            dedup_key=cl.dedup_key,
            rcpt=cl.address,
            destination=st.name,
            host=host,
            reply=reply,
            **{f: _DETAILS[f](d, cl, uid, duration, now) for f in row.log_fields},
        )
    if d.warn_delay and t.delayed is None:
        t.delayed = (cl, reply)
    if d.dead is not None:
        t.dead.append(d.dead)


def _health(
    e: Attempt,
    st: DestState,
    results: dict[str, RcptResult],
    t: _Tally,
    now: float,
    *,
    upstream_seen: bool,
    connection_failed: bool,
) -> None:
    """What the attempt tells the destination: its breaker, its slow-down, shaping rules."""
    before = st.breaker.state(now)
    action = decide.breaker_action(
        results, t.delivered, upstream_seen=upstream_seen, connection_failed=connection_failed
    )
    if action == "release":
        st.breaker.release()
    elif action == "failure":
        st.breaker.on_failure(now)
    else:
        st.breaker.on_success(now)
    e.dests.breaker_changed(st, before, now, next((str(r.reply) for r in results.values()), ""))
    if t.throttled:
        hold = 0.0
        rule_hit = t.rule_hit
        if rule_hit is not None and rule_hit.action == "suspend":
            st.suspended_until = max(st.suspended_until, now + rule_hit.duration)
            st.suspend_reason = f"rule: {rule_hit.pattern.pattern}"
            log_event(
                log,
                logging.WARNING,
                "destination_suspended",
                "a shaping rule matched the reply",
                destination=st.name,
                until=ops.iso_utc(st.suspended_until),
            )
        elif rule_hit is not None:
            hold = rule_hit.duration
        if st.adaptive.on_throttle(now, hold):
            log_event(
                log,
                logging.WARNING,
                "slowdown",
                "destination asked us to slow down",
                destination=st.name,
                rate=st.adaptive.effective_rate(),
                connections=st.adaptive.effective_connections(),
            )
        e.dests.retune(st)
    elif t.delivered and st.adaptive.on_success(now):
        e.dests.retune(st)
        e.pool.spawn_workers(st)


# the fields a row's log line adds after the ones every outcome line has (`Row.log_fields`)
_DETAILS: dict[str, Callable[[decide.Decision, ops.Claim, str | None, float, float], object]] = {
    "upstream_id": lambda d, cl, uid, duration, now: uid,
    "duration": lambda d, cl, uid, duration, now: round(duration, 3),
    "next_attempt_at": lambda d, cl, uid, duration, now: ops.iso_utc(
        d.outcome.next_attempt_at or now
    ),
    "attempts": lambda d, cl, uid, duration, now: cl.attempts + 1,
}


async def delay_warning(e: Attempt, st: DestState, job: Job, cl: ops.Claim, reply: str) -> None:
    """Once per message: a `delayed` alert, and (by the hook) a delay DSN."""
    now = e.clock()
    conf = e.config.alerts
    age = _age(now - cl.created_at)
    name = ROWS[Kind.DEFERRED].alert  # the deferral's alert: once per message
    assert name is not None
    ev = alerts.Event(
        name,
        "warning",
        st.name,
        f"mail to {st.name} delayed {age}: {reply}",
        alerts.sample(job.msg_id, cl.address, reply),
    )

    def mark(c: Any) -> bool:
        if not ops.mark_delay_warned(c, job.msg_id, now):
            return False
        alerts.record(c, ev, now, conf.coalesce, alerts.sinks_of(conf))
        return True

    try:
        first = await e.recorder.writer.run(mark)
    except Exception as ex:
        log_event(
            log,
            logging.ERROR,
            "spool_error",
            "could not record a delay warning",
            queue_id=job.msg_id,
            exc=ex,
        )
        return
    if not first:
        return
    log_event(
        log,
        logging.WARNING,
        "delayed",
        "message delayed",
        queue_id=job.msg_id,
        rcpt=cl.address,
        destination=st.name,
        age=age,
        reply=reply,
    )
    e.recorder.hook(
        {
            "event": "delayed",
            "queue_id": job.msg_id,
            "recipient": cl.address,
            "sender": job.sender,
            "reply": reply,
            "destination": st.name,
            "retry_until": ops.iso_utc(cl.created_at + e.config.retry.max_age),
        }
    )


async def finish(
    e: Attempt,
    job: Job,
    outcomes: Sequence[ops.RcptUpdate],
    delivered: int,
    upstream_ids: dict[int, str] | None = None,
) -> None:
    """Record a job's outcomes; a delivered one gets the daily counters it bumps and the
    upstream's id (`upstream_ids`, by rcpt_id: only a delivery has one, `_tally`)."""
    if job.done:
        return
    job.done = True
    n = len(job.claims)
    st = e.dests[job.destination]
    by = e.dests[job.carrier] if job.carrier is not None else st  # after a hand-over
    scopes = e.dests.ledger.release(
        job.reserved, n, delivered, e.clock(), by.name, by.conf.daily_limit is not None
    )
    st.reserved = max(0, st.reserved - n)
    st.sent += delivered
    if delivered or upstream_ids:
        ids = upstream_ids or {}
        outcomes = [_delivery(o, scopes if delivered else None, ids) for o in outcomes]
    # a fleet releases the room it held under the ceilings in the commit that counts
    release = {scope: n for scope in job.reserved} if e.fleet and job.reserved else None
    try:
        await e.recorder.record(outcomes, release)
    finally:
        e.pool.job_done(n)


def _delivery(
    o: ops.RcptUpdate, scopes: tuple[str, ...] | None, ids: dict[int, str]
) -> ops.RcptUpdate:
    """`o` with the daily counters a delivery bumps and the upstream's id, in one replace
    (a frozen record: each replace builds it anew)."""
    uid = ids.get(o.rcpt_id)
    if scopes is not None and o.state is RcptState.DELIVERED:
        if uid is None:
            return dataclasses.replace(o, counters=scopes)
        return dataclasses.replace(o, counters=scopes, upstream_id=uid)
    return o if uid is None else dataclasses.replace(o, upstream_id=uid)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
