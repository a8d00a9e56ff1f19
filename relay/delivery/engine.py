"""The delivery engine: claims due recipients, shapes traffic per destination, sends, and
records every outcome.

Rules:
- The spool is the queue. The engine claims due recipients (`sending`, transactional lane
  first), groups them into jobs (one message x one destination = one transaction), and hands
  each job to its destination. A crash loses nothing: unrecorded claims come back at start.
- A destination is "smarthost" in smarthost mode, the recipient domain in MX mode. Each has a
  token bucket (rate, burst), a connection limit, a daily ceiling, an adaptive (AIMD)
  multiplier, a circuit breaker and an operator/rule suspension. Waiting on any of these
  burns no attempt: the recipient is deferred with a reason, or simply waits its turn.
- Connections are reused for up to `max_messages_per_connection` messages. Transactional
  jobs are always taken before bulk ones; bulk may use at most its share of connections,
  so a campaign never takes the last connection from a password reset.
- Outcomes: delivered; transient -> deferred per retry schedule (or failed when expired);
  bounce -> bounced + suppressed; fail -> failed. Every bounced/failed/expired recipient is a
  dead letter: an ERROR line `event=dead_letter`, an alert in the spool's outbox (recorded
  in the same commit as the outcome: relay/alerts.py), and a DSN if enabled. A recipient
  still deferred `retry.warn_after` after its message arrived raises one `delayed` alert
  (and a delay DSN) per message.
- The circuit breaker's every change is a log line (circuit_open / circuit_half_open /
  circuit_closed). Connection-level failures count, and so does an upstream that answers
  4xx to MAIL (it accepts connections but takes no mail). An AUTH, TLS-verification or
  STARTTLS refusal is an `upstream_config_error` the health model shows as critical.
- Operator commands reach the engine through the spool (`engine_commands`): `reset`
  closes a circuit and clears the slow-down; `kick` (after `queue flush` or `destination
  resume`) lets the next attempt through an open circuit at once.
- Ambiguous (connection lost after the final "."): logged as `ambiguous`; retried by default
  (at-least-once), or counted delivered with `ambiguous: assume-delivered`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import math
import random
import time
import zoneinfo
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay import alerts, faults, retry, shaping
from relay.config import Config, Destination, Identity
from relay.delivery.errors import DnsPermanentError, DnsTransientError
from relay.delivery.mx import MxHost, Resolver
from relay.delivery.transport import (
    ConnectFailed,
    Connection,
    RcptResult,
    Timeouts,
    TlsPolicy,
    TransactionResult,
)
from relay.lanes import LANE_PRIORITY
from relay.logs import log_event
from relay.metrics import Metrics
from relay.model import RcptState
from relay.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.spool import bodies, ops
from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

RECORD_RETRY_FIRST = 0.5  # seconds; doubles up to 30 s while the spool refuses an outcome

IDLE_CLOSE = 5.0  # seconds an idle connection stays open waiting for more work


@dataclass(slots=True)
class Job:
    msg_id: str
    destination: str  # effective destination name
    lane: str
    identity: str
    sender: str
    created_at: float
    claims: list[ops.Claim]
    envelope: ops.Envelope
    enqueued_at: float = 0.0
    reserved: tuple[str, ...] = ()  # ceiling counters reserved at dispatch
    done: bool = False  # its outcomes are recorded (or being recorded)


@dataclass(slots=True)
class DestState:
    name: str
    conf: Destination
    bucket: shaping.TokenBucket | None
    adaptive: shaping.Adaptive
    breaker: shaping.Breaker
    queues: dict[str, deque[Job]] = field(
        default_factory=lambda: {"transactional": deque(), "bulk": deque()})
    workers: set[asyncio.Task[None]] = field(default_factory=set)
    active: dict[str, int] = field(default_factory=lambda: {"transactional": 0, "bulk": 0})
    suspended_until: float = 0.0
    suspend_reason: str = ""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0
    reserved: int = 0
    config_error: str | None = None  # AUTH/TLS refused our configuration; cleared on success

    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())


DeadLetterHook = Callable[[dict[str, Any]], Awaitable[None]]


class Engine:
    def __init__(
        self,
        config: Config,
        writer: SpoolWriter,
        *,
        metrics: Metrics | None = None,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_dead_letter: DeadLetterHook | None = None,
        is_suppressed: Callable[[str], tuple[str, float] | None] = lambda a: None,
        on_suppressed: Callable[[str, str, float], None] = lambda a, r, t: None,
    ) -> None:
        self.writer = writer
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_dead_letter = on_dead_letter
        self.is_suppressed = is_suppressed
        self.on_suppressed = on_suppressed
        self.dests: dict[str, DestState] = {}
        self.counts: dict[str, int] = {}
        self.counts_day = ""
        self._wake = asyncio.Event()
        self._stopping = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop_exited = asyncio.Event()
        self._pending_records: list[ops.Outcome] = []
        self._hooks: set[asyncio.Task[None]] = set()  # dead-letter hooks still running
        self._alert_backlog: list[alerts.Event] = []  # recorded with the next outcomes
        self.dead_times: deque[float] = deque()  # dead letters of the last hour
        self.last_delivery_at: float | None = None
        self._cmd_seen: int | None = None  # engine_commands read so far
        self.config = config
        self.resolver = resolver
        self._apply_config(config)

    # --- configuration ------------------------------------------------------------------

    def _apply_config(self, config: Config) -> None:
        # everything that can fail first, into locals: a bad reload changes nothing
        tz = zoneinfo.ZoneInfo(config.shaping.window_tz)
        operator_rules = [shaping.parse_rule(r) for r in (config.shaping.rules or [])]
        resolver = self.resolver
        ns = config.upstream.mx.nameservers
        if resolver is None or ns != getattr(self, "_ns", None):
            resolver = Resolver(nameservers=list(ns) if ns else None,
                                timeout=config.upstream.mx.dns_timeout, rng=self.rng)
        self.config = config
        self.tz = tz
        self.rules = [*operator_rules, *shaping.DEFAULT_RULES]
        self.resolver = resolver
        self._ns = ns
        for name, st in self.dests.items():
            conf = config.destination(name)
            st.conf = conf
            st.adaptive.base_rate = conf.rate or shaping.UNLIMITED
            st.adaptive.base_connections = conf.max_connections
            st.adaptive.cooldown = conf.slowdown_cooldown
            st.breaker.threshold = conf.circuit_failures
            st.breaker.cooldown = conf.circuit_cooldown
            self._retune(st)

    def reconfigure(self, config: Config) -> None:
        self._apply_config(config)
        self.wake()

    def dest(self, name: str) -> DestState:
        st = self.dests.get(name)
        if st is None:
            conf = self.config.destination(name)
            now = self.clock()
            bucket = None
            if conf.rate:
                bucket = shaping.TokenBucket(rate=conf.rate, burst=conf.burst, updated=now)
            st = DestState(
                name=name, conf=conf, bucket=bucket,
                adaptive=shaping.Adaptive(base_rate=conf.rate or shaping.UNLIMITED,
                                          base_connections=conf.max_connections,
                                          cooldown=conf.slowdown_cooldown),
                breaker=shaping.Breaker(threshold=conf.circuit_failures,
                                        cooldown=conf.circuit_cooldown),
            )
            self.dests[name] = st
        return st

    def _retune(self, st: DestState) -> None:
        rate = st.adaptive.effective_rate()
        now = self.clock()
        if not rate:
            st.bucket = None
        elif st.bucket is None:
            st.bucket = shaping.TokenBucket(rate=rate, burst=st.conf.burst, updated=now)
        else:
            st.bucket.burst = st.conf.burst
            st.bucket.set_rate(rate, now)
        self.metrics.effective_rate.labels(st.name).set(rate or 0)
        self.metrics.effective_connections.labels(st.name).set(
            st.adaptive.effective_connections())

    def destination_of(self, domain: str) -> str:
        return "smarthost" if self.config.upstream.mode == "smarthost" else domain

    # --- main loop ------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        now = self.clock()
        recovered = await self.writer.run(lambda c: ops.recover(c, now))
        if recovered:
            log_event(log, logging.WARNING, "recovered",
                      "claims left by a crash are due again", count=recovered)
        await self._load_counts()
        try:
            await self._loop()
        finally:
            self._loop_exited.set()

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                claimed = await self._claim_and_dispatch()
            except Exception as e:
                log_event(log, logging.ERROR, "engine_error", "claim loop failed", exc=e)
                claimed = 0
            if self._stopping:
                break
            if claimed and self._inflight < self._max_inflight():
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.delivery.poll_interval)
            except TimeoutError:
                pass

    def _max_inflight(self) -> int:
        # a memory bound over all destinations; each destination is bounded on its own by
        # _queue_cap, so one slow destination cannot fill this and starve the others
        return max(self.config.delivery.batch, 1) * 4

    def _queue_cap(self, st: DestState) -> int:
        """How many jobs of one lane a destination may hold in memory: enough to keep its
        connections busy, and about two seconds of its rate."""
        rate = st.adaptive.effective_rate()
        return max(4, 2 * st.adaptive.effective_connections(), math.ceil((rate or 0) * 2))

    def _full_queues(self) -> list[tuple[int, str | None]]:
        skip: list[tuple[int, str | None]] = []
        for st in self.dests.values():
            cap = self._queue_cap(st)
            for lane, q in st.queues.items():
                if len(q) >= cap:
                    domain = None if st.name == "smarthost" else st.name
                    skip.append((LANE_PRIORITY.get(lane, 0), domain))
        return skip

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let the deliveries under way finish up to `timeout` (each worker
        finishes its current transaction and takes no new one); put the rest back."""
        self._stopping = True
        self._wake.set()
        for st in self.dests.values():
            st.wake.set()
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._loop_exited.wait(), max(0.1, timeout))
        tasks = [t for st in self.dests.values() for t in st.workers]
        if tasks:
            _done, pending = await asyncio.wait(
                tasks, timeout=max(0.0, deadline - time.monotonic()))
            if pending:
                log_event(log, logging.WARNING, "shutdown",
                          "deliveries still running at shutdown_timeout; they will be retried",
                          connections=len(pending))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        if self._hooks:  # alerts and DSNs of the last dead letters, up to the same deadline
            _done, pending = await asyncio.wait(
                set(self._hooks), timeout=max(0.1, deadline - time.monotonic()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # queued but not started: back to deferred, due now
        back: list[ops.Outcome] = []
        for st in self.dests.values():
            for q in st.queues.values():
                while q:
                    job = q.popleft()
                    back.extend(self._outcomes_wait(job, self.clock(), "daemon stopped"))
        if back:
            now = self.clock()
            await self.writer.run(lambda c: ops.record(c, back, now))
        now = self.clock()
        await self.writer.run(lambda c: ops.recover(c, now))

    async def _load_counts(self) -> None:
        now = self.clock()
        day = self._day(now)
        self.counts = await self.writer.run(lambda c: ops.daily_counts(c, day))
        self.counts_day = day

    def _day(self, now: float) -> str:
        return shaping.day_key(now, self.tz, self.config.shaping.window_length)

    async def _claim_and_dispatch(self) -> int:
        cap = min(self._max_inflight() - self._inflight, self.config.delivery.batch)
        if cap <= 0:
            return 0
        now = self.clock()
        skip = self._full_queues()

        def claim(c: Any) -> tuple[list[ops.Claim], dict[str, ops.Envelope], dict[str, Any],
                                   dict[str, tuple[str, float] | None]]:
            claims = ops.claim_due(c, now, cap, skip)
            envs = ops.load_envelopes(c, {cl.msg_id for cl in claims}) if claims else {}
            # The in-memory suppression list lags the spool by up to one refresh: before a
            # recipient is made `suppressed` (final), ask the spool, so that an operator's
            # `suppression remove` followed at once by `queue retry` is not undone.
            stored = {cl.address: ops.suppression_get(c, cl.address) for cl in claims
                      if self.is_suppressed(cl.address) is not None}
            return claims, envs, ops.suspensions(c, now), stored

        def commands(c: Any) -> list[tuple[int, str, str]]:
            if self._cmd_seen is None:  # at start: only what comes from now on
                self._cmd_seen = ops.last_engine_command(c)
                return []
            return ops.engine_commands(c, self._cmd_seen)

        # commands first: a `queue flush` makes recipients due and kicks the circuit in one
        # transaction, and the kick must be seen before those recipients are dispatched
        for cid, action, name in await self.writer.run(commands):
            self._cmd_seen = max(self._cmd_seen or 0, cid)
            self._command(action, name, now)
        claims, envs, susp, stored = await self.writer.run(claim)
        for name, (until, reason) in susp.items():
            st = self.dest(name)
            if until > st.suspended_until or st.suspend_reason.startswith("operator"):
                st.suspended_until, st.suspend_reason = until, f"operator: {reason}"
        for st in self.dests.values():
            if st.suspend_reason.startswith("operator") and st.name not in susp:
                st.suspended_until, st.suspend_reason = 0.0, ""
        if not claims:
            return 0
        jobs: dict[tuple[str, str], Job] = {}
        for cl in claims:
            env = envs.get(cl.msg_id)
            dname = self.destination_of(cl.destination)
            if env is None:
                continue
            key = (cl.msg_id, dname)
            job = jobs.get(key)
            if job is None:
                job = jobs[key] = Job(
                    msg_id=cl.msg_id, destination=dname, lane=cl.lane, identity=cl.identity,
                    sender=env.sender, created_at=cl.created_at, claims=[], envelope=env,
                    enqueued_at=now)
            job.claims.append(cl)
        immediate: list[ops.Outcome] = []
        for job in jobs.values():
            try:
                immediate.extend(self._dispatch(job, now, stored))
            except Exception as e:  # never strand a claim: wait a minute and try again
                log_event(log, logging.ERROR, "engine_error", "dispatch failed",
                          queue_id=job.msg_id, exc=e)
                immediate.extend(ops.Outcome(
                    rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.DEFERRED,
                    count_attempt=False, next_attempt_at=now + 60, last_reply=None,
                    reason=f"internal error: {type(e).__name__}") for cl in job.claims)
        if immediate:
            await self._record(immediate)
        return len(claims)

    def _command(self, action: str, name: str, now: float) -> None:
        targets = list(self.dests.values()) if name == "*" else [self.dest(name)]
        for st in targets:
            before = st.breaker.state(now)
            if action == "reset":
                st.breaker.on_success(now)
                st.adaptive.reset()
                st.config_error = None
                self._retune(st)
                self._spawn_workers(st)
            elif action == "kick":
                st.breaker.kick(now)
            self._breaker_changed(st, before, now, f"operator {action}")
            if action == "reset":
                log_event(log, logging.INFO, "destination_reset",
                          "circuit closed and slow-down cleared by the operator",
                          destination=st.name)

    def _breaker_changed(self, st: DestState, before: str, now: float, why: str) -> None:
        """A log line for every change of a destination's circuit."""
        after = st.breaker.state(now)
        self.metrics.circuit_open.labels(st.name).set(0 if after == "closed" else 1)
        if after == before:
            return
        if after == "open":
            until = (st.breaker.opened_at or now) + st.breaker.cooldown
            log_event(log, logging.WARNING, "circuit_open",
                      "destination failing: no new connections until the cooldown ends",
                      destination=st.name, reason=why, failures=st.breaker.failures,
                      retry_at=_iso(until))
        elif after == "closed":
            log_event(log, logging.INFO, "circuit_closed", "destination working again",
                      destination=st.name, reason=why)
        else:
            log_event(log, logging.INFO, "circuit_half_open",
                      "cooldown over: one trial connection allowed", destination=st.name,
                      reason=why)

    def health(self) -> list[tuple[str, str, int, str | None, str | None]]:
        """(destination, circuit, consecutive failures, config error, reopen time)."""
        now = self.clock()
        out: list[tuple[str, str, int, str | None, str | None]] = []
        for st in self.dests.values():
            circuit = st.breaker.state(now)
            reopen = None
            if circuit == "open":
                reopen = _iso((st.breaker.opened_at or now) + st.breaker.cooldown)
            out.append((st.name, circuit, st.breaker.failures, st.config_error, reopen))
        return out

    def dead_letters_last_hour(self) -> int:
        cutoff = self.clock() - 3600
        while self.dead_times and self.dead_times[0] < cutoff:
            self.dead_times.popleft()
        return len(self.dead_times)

    def _dispatch(self, job: Job, now: float,
                  stored: dict[str, tuple[str, float] | None] | None = None
                  ) -> list[ops.Outcome]:
        """Queue a job on its destination, or answer at once (suppressed, suspended, circuit
        open, over the daily ceiling): those outcomes burn no attempt. `stored`: the spool's
        suppression entries for addresses the in-memory list calls suppressed."""
        out: list[ops.Outcome] = []
        keep: list[ops.Claim] = []
        for cl in job.claims:
            supp = self.is_suppressed(cl.address)
            if supp is not None and stored is not None and cl.address in stored:
                supp = stored[cl.address]
            if supp is not None:
                self.metrics.suppressed.labels(job.destination).inc()
                log_event(log, logging.WARNING, "suppressed", "recipient is suppressed",
                          queue_id=job.msg_id, rcpt=cl.address, reason=supp[0])
                out.append(ops.Outcome(
                    rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.SUPPRESSED,
                    count_attempt=False, next_attempt_at=None,
                    last_reply=f"suppressed: {supp[0]}",
                    log=ops.AttemptLog("suppressed", supp[0], job.destination, None, None)))
            else:
                keep.append(cl)
        job.claims = keep
        if not keep:
            return out
        st = self.dest(job.destination)
        if st.suspended_until > now:
            out.extend(self._outcomes_wait(job, st.suspended_until,
                                           f"destination {st.name} suspended until "
                                           f"{_iso(st.suspended_until)} ({st.suspend_reason})"))
            return out
        # state(), not allow(): allow() hands out the one half-open trial, which belongs to
        # the worker that will actually connect (_deliver), not to this check.
        if st.breaker.state(now) == "open":
            until = (st.breaker.opened_at or now) + st.breaker.cooldown
            out.extend(self._outcomes_wait(
                job, until, f"circuit open for {st.name} until {_iso(until)}"))
            return out
        room = self._ceiling_room(job, st, now)
        if room is not None and room[0] < len(job.claims):
            left, until, reason = room
            # what fits goes now; the rest of the recipients waits for the next window
            wait = dataclasses.replace(job, claims=job.claims[left:])
            job.claims = job.claims[:left]
            self.metrics.deferred.labels(st.name, "daily_limit").inc(len(wait.claims))
            log_event(log, logging.INFO, "deferred", reason, queue_id=job.msg_id,
                      destination=st.name, rcpts=[c.address for c in wait.claims])
            out.extend(self._outcomes_wait(wait, until, reason))
            if not job.claims:
                return out
        n = len(job.claims)
        st.reserved += n
        self._reserve(job, n)
        st.queues.get(job.lane, st.queues["transactional"]).append(job)
        self._inflight += n
        self._idle.clear()
        self._spawn_workers(st)
        st.wake.set()
        return out

    def _outcomes_wait(self, job: Job, until: float, reason: str) -> list[ops.Outcome]:
        """Wait without burning an attempt, but never past `retry.max_age`: a message that
        is too old when it would wait again expires (failed, dead letter) like any other."""
        now = self.clock()
        deadline = job.created_at + self.config.retry.max_age
        if now < deadline:
            return [ops.Outcome(rcpt_id=cl.rcpt_id, msg_id=job.msg_id,
                                state=RcptState.DEFERRED, count_attempt=False,
                                next_attempt_at=min(until, deadline), last_reply=None,
                                reason=reason) for cl in job.claims]
        text = (f"expired after {_human(self.config.retry.max_age)} in queue;"
                f" still waiting: {reason}")
        self.metrics.failed.labels(job.destination).inc(len(job.claims))
        self._emit_dead([self._dead(job, cl, "expired", text, job.destination)
                         for cl in job.claims])
        return [ops.Outcome(rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.FAILED,
                            count_attempt=False, next_attempt_at=None, last_reply=text,
                            log=ops.AttemptLog("expired", text, job.destination, None, None))
                for cl in job.claims]

    # --- daily ceilings -------------------------------------------------------------------

    def _limits_for(self, job: Job, st: DestState, now: float) -> list[tuple[str, str, int]]:
        """(counter scope, display name, limit) for each ceiling that applies."""
        out = []
        if st.conf.daily_limit is not None:
            out.append((f"dest:{st.name}", st.name, st.conf.daily_limit))
        ident = self.config.identity(job.identity)
        if ident is not None:
            lim = shaping.effective_daily_limit(ident.daily_limit, self._warmup_limit(ident, now))
            if lim is not None:
                out.append((f"id:{job.identity}", job.identity, lim))
        return out

    def _warmup_limit(self, ident: Identity, now: float) -> int | None:
        """Today's warm-up ceiling of an identity (None: no warm-up)."""
        w = ident.warmup
        if w is None:
            return None
        today = dt.datetime.fromtimestamp(now, self.tz).date()
        return shaping.warmup_limit(shaping.Warmup(
            start=dt.date.fromisoformat(w.start), schedule=w.schedule, initial=w.initial,
            factor=w.factor, ceiling=w.ceiling), today)

    def _roll_day(self, now: float) -> None:
        """A new window: today's counts start from zero (they are counted in the spool by
        the day of each delivery); reservations of jobs in flight carry over."""
        day = self._day(now)
        if day != self.counts_day:
            self.counts = {k: v for k, v in self.counts.items() if k.startswith("reserved:")}
            self.counts_day = day

    def _ceiling_room(self, job: Job, st: DestState, now: float
                      ) -> tuple[int, float, str] | None:
        """How many recipients of `job` fit under every ceiling now, with the next window
        and the reason for the rest; None when no ceiling applies."""
        self._roll_day(now)
        room: tuple[int, float, str] | None = None
        for scope, name, limit in self._limits_for(job, st, now):
            used = self.counts.get(scope, 0) + self.counts.get("reserved:" + scope, 0)
            left = max(0, limit - used)
            if room is None or left < room[0]:
                nxt = shaping.next_window(now, self.tz, self.config.shaping.window_length)
                room = (left, nxt, shaping.ceiling_reason(limit, name, nxt))
        return room

    def _reserve(self, job: Job, n: int) -> None:
        st = self.dests[job.destination]
        scopes = tuple(scope for scope, _n, _l in self._limits_for(job, st, self.clock()))
        for scope in scopes:
            k = "reserved:" + scope
            self.counts[k] = self.counts.get(k, 0) + n
        job.reserved = scopes

    def _unreserve(self, job: Job, n: int, delivered: int) -> tuple[str, ...]:
        st = self.dests[job.destination]
        self._roll_day(self.clock())
        scopes = []
        for scope in job.reserved:
            k = "reserved:" + scope
            self.counts[k] = max(0, self.counts.get(k, 0) - n)
            self.counts[scope] = self.counts.get(scope, 0) + delivered
            scopes.append(scope)
        if st.conf.daily_limit is None:
            # count deliveries per destination anyway, for `relay stats`
            self.counts[f"dest:{st.name}"] = self.counts.get(f"dest:{st.name}", 0) + delivered
            scopes.append(f"dest:{st.name}")
        return tuple(dict.fromkeys(scopes))

    # --- workers --------------------------------------------------------------------------

    def _spawn_workers(self, st: DestState) -> None:
        limit = st.adaptive.effective_connections()
        want = min(limit, st.queued())
        total = sum(len(d.workers) for d in self.dests.values())
        while len(st.workers) < want and total < self.config.delivery.workers:
            total += 1
            task = asyncio.get_running_loop().create_task(self._worker(st))
            st.workers.add(task)
            task.add_done_callback(st.workers.discard)

    def _next_job(self, st: DestState) -> Job | None:
        if st.queues["transactional"]:
            return st.queues["transactional"].popleft()
        if st.queues["bulk"]:
            share = self.config.lanes.shares.get("bulk", 0.5)
            cap = max(1, math.floor(st.adaptive.effective_connections() * share))
            if st.active["bulk"] < cap:
                return st.queues["bulk"].popleft()
        return None

    async def _worker(self, st: DestState) -> None:
        conn: Connection | None = None
        try:
            while not self._stopping:
                job = self._next_job(st)
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
                    conn = await self._deliver(st, job, conn)
                except Exception as e:
                    # a bug or an unforeseen error must not strand the claim in memory
                    # (`sending` until restart): record it as a transient failure
                    log_event(log, logging.ERROR, "engine_error", "delivery attempt failed",
                              queue_id=job.msg_id, destination=st.name, exc=e)
                    if conn is not None:
                        conn.close()
                        conn = None
                    if not job.done:
                        reply = Reply(451, "4.3.0", f"internal error: {type(e).__name__}")
                        v = Verdict(Outcome.TRANSIENT, True, False, Scope.TRANSACTION)
                        await self._apply(st, job, {c.address: RcptResult(v, reply, Phase.CONNECT)
                                                    for c in job.claims},
                                          host=None, duration=0.0, upstream_seen=False)
                finally:
                    st.active[job.lane] -= 1
                if self._other_destination_starved(st):
                    return  # hand this connection slot to a destination that has none
        finally:
            if conn is not None:
                await conn.quit()
            if not self._stopping:
                # this connection slot is free now: give it to whoever waits for one
                st.workers.discard(asyncio.current_task())
                # destinations with work and no connection at all come first
                waiting = sorted((d for d in self.dests.values() if d.queued()),
                                 key=lambda d: (bool(d.workers), d is not st))
                for d in waiting:
                    self._spawn_workers(d)

    def _other_destination_starved(self, st: DestState) -> bool:
        """With every connection slot (`delivery.workers`) taken, a destination with work
        and no worker at all gets the slot of a busy one after its current transaction."""
        if sum(len(d.workers) for d in self.dests.values()) < self.config.delivery.workers:
            return False
        return any(d is not st and d.queued() and not d.workers for d in self.dests.values())

    async def _wait_token(self, st: DestState) -> None:
        while st.bucket is not None:
            now = self.clock()
            if st.bucket.try_take(now):
                return
            await asyncio.sleep(max(0.001, st.bucket.wait_time(now)))

    async def _deliver(self, st: DestState, job: Job, conn: Connection | None
                       ) -> Connection | None:
        now = self.clock()
        before = st.breaker.state(now)
        if st.suspended_until > now or (not st.breaker.allow(now)):
            until = max(st.suspended_until,
                        (st.breaker.opened_at or now) + st.breaker.cooldown)
            # half-open with the trial still out: the cooldown is already over, so do not
            # make the job due at once again (a busy loop until the trial reports)
            until = max(until, now + self.config.retry.min_delay)
            reason = (f"destination {st.name} suspended until {_iso(until)}"
                      if st.suspended_until > now else
                      f"circuit open for {st.name} until {_iso(until)}")
            await self._finish(job, self._outcomes_wait(job, until, reason), delivered=0)
            return conn
        if before == "half-open":
            log_event(log, logging.INFO, "circuit_half_open",
                      "cooldown over: this connection is the trial", destination=st.name)
        await self._wait_token(st)
        body: bytes | bodies.StoredBody | None = job.envelope.body
        if job.envelope.body_path:
            try:  # streamed from the file by the transport; here only checked to be there
                body = await asyncio.to_thread(bodies.StoredBody.open, self.config.spool_path,
                                               job.envelope.body, job.envelope.body_path)
            except OSError as e:
                reply = Reply(451, "4.3.0", f"spool body unreadable: {e.strerror}")
                await self._apply(st, job, {c.address: RcptResult(
                    Verdict(Outcome.TRANSIENT, False, False, Scope.TRANSACTION), reply,
                    Phase.CONNECT) for c in job.claims}, host=None, duration=0.0,
                    upstream_seen=False)
                return conn
        assert body is not None
        sender = job.sender
        rcpts = [c.address for c in job.claims]
        if conn is not None and (not conn.usable or conn.messages >=
                                 st.conf.max_messages_per_connection):
            await conn.quit()
            conn = None
        result: TransactionResult | None = None
        if conn is None:
            conn, failure = await self._connect(st, job)
            if conn is None:
                assert failure is not None
                await self._apply(st, job, failure, host=None, duration=0.0,
                                  connection_failed=True)
                return None
        result = await conn.send(sender, rcpts, body)
        await self._apply(st, job, result.results, host=conn.label,
                          duration=result.duration,
                          connection_failed=result.connection_failed)
        if not conn.usable:
            conn.close()
            return None
        return conn

    async def _connect(self, st: DestState, job: Job
                       ) -> tuple[Connection | None, dict[str, RcptResult] | None]:
        cfg = self.config
        up = cfg.upstream
        dc = st.conf
        timeouts = Timeouts(connect=dc.connect_timeout, command=dc.command_timeout,
                            data=dc.data_timeout)
        rcpts = [c.address for c in job.claims]
        if up.mode == "smarthost":
            sh = up.smarthost
            hosts = [MxHost(name=sh.host, preference=0, addresses=(sh.host,))]
            port = sh.port
            tls = TlsPolicy(sh.tls, sh.verify, sh.ca_file)
            user, pw = sh.username, sh.password
        else:
            port = up.mx.port
            tls = TlsPolicy(up.mx.tls, up.mx.verify, None)
            user = pw = None
            assert self.resolver is not None
            try:
                hosts = await self.resolver.resolve(job.destination)
            except (DnsPermanentError, DnsTransientError) as e:
                permanent = isinstance(e, DnsPermanentError)
                v = Verdict(Outcome.BOUNCE if permanent else Outcome.TRANSIENT, True, False,
                            Scope.TRANSACTION)
                return None, {r: RcptResult(v, e.reply, Phase.CONNECT) for r in rcpts}
        last: ConnectFailed | None = None
        for h in hosts:
            for addr in h.addresses:
                c = Connection(host=h.name, address=addr, port=port, helo=up.helo, tls=tls,
                               timeouts=timeouts, username=user, password=pw)
                try:
                    await c.open()
                    if st.config_error is not None:
                        log_event(log, logging.INFO, "upstream_config_ok",
                                  "upstream accepts our configuration again",
                                  destination=st.name, host=c.label)
                    st.config_error = None
                    return c, None
                except ConnectFailed as e:
                    last = e
                    if e.operator_fault:
                        st.config_error = f"{c.label}: {e.reply}"
                        log_event(log, logging.ERROR, "upstream_config_error",
                                  "upstream refused our configuration (credentials, TLS);"
                                  " mail is kept and retried, fix the config",
                                  destination=st.name, host=c.label, reply=str(e.reply))
                    if e.verdict.outcome is not Outcome.TRANSIENT:
                        # a permanent greeting/EHLO refusal: no point trying siblings
                        return None, {r: RcptResult(e.verdict, e.reply, e.phase)
                                      for r in rcpts}
        assert last is not None
        # every host failed transiently: connection-level transient for all
        return None, {r: RcptResult(last.verdict, last.reply, last.phase) for r in rcpts}

    # --- outcomes -------------------------------------------------------------------------

    async def _apply(self, st: DestState, job: Job, results: dict[str, RcptResult], *,
                     host: str | None, duration: float,
                     connection_failed: bool = False, upstream_seen: bool = True) -> None:
        """Record one attempt's results. `upstream_seen` False: the attempt never reached
        the upstream (our own error), so it says nothing about the destination's health."""
        now = self.clock()
        outcomes: list[ops.Outcome] = []
        dead: list[dict[str, Any]] = []
        delivered = 0
        throttled = False
        rule_hit: shaping.ShapingRule | None = None
        delayed: tuple[ops.Claim, str] | None = None
        for cl in job.claims:
            res = results.get(cl.address)
            if res is None:
                res = RcptResult(Verdict(Outcome.TRANSIENT, False, False, Scope.TRANSACTION),
                                 Reply(451, "4.3.0", "no reply recorded"), Phase.MAIL)
            reply_s = str(res.reply)
            outcome = res.verdict.outcome
            logged = outcome.value
            if res.ambiguous:
                logged = "ambiguous"
                log_event(log, logging.WARNING, "ambiguous",
                          "connection lost after the final dot: the upstream may have the"
                          " message", queue_id=job.msg_id, rcpt=cl.address,
                          destination=st.name, policy=st.conf.ambiguous)
                if st.conf.ambiguous == "assume-delivered":
                    outcome = Outcome.DELIVERED
            attempt = ops.AttemptLog(logged, reply_s, st.name, host, round(duration, 4))
            self.metrics.attempts.labels(st.name, logged).inc()
            if res.verdict.throttled:
                throttled = True
                rule_hit = rule_hit or shaping.match_rules(self.rules, reply_s)
            if outcome is Outcome.DELIVERED:
                delivered += 1
                self.last_delivery_at = now
                outcomes.append(ops.Outcome(
                    rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.DELIVERED,
                    count_attempt=True, next_attempt_at=None, last_reply=reply_s, log=attempt))
                self.metrics.delivered.labels(st.name).inc()
                self.metrics.latency.observe(max(0.0, now - job.created_at))
                log_event(log, logging.INFO, "delivered", "recipient delivered",
                          queue_id=job.msg_id, dedup_key=cl.dedup_key, rcpt=cl.address,
                          destination=st.name, host=host, reply=reply_s,
                          duration=round(duration, 3))
            elif outcome is Outcome.TRANSIENT:
                # the recipient's own clock (coalesce(retry_base, created_at)): after
                # `queue retry`, recipients sharing a job may have different ones
                nxt = retry.next_attempt_at(
                    now, cl.created_at, cl.attempts + 1, self.config.retry.schedule,
                    self.config.retry.max_age, self.rng, self.config.retry.min_delay)
                if nxt is None:
                    expired = f"expired after {_human(self.config.retry.max_age)} in queue;" \
                              f" last reply: {reply_s}"
                    outcomes.append(ops.Outcome(
                        rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.FAILED,
                        count_attempt=True, next_attempt_at=None, last_reply=expired,
                        log=attempt))
                    self.metrics.failed.labels(st.name).inc()
                    dead.append(self._dead(job, cl, "expired", expired, st.name))
                else:
                    outcomes.append(ops.Outcome(
                        rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.DEFERRED,
                        count_attempt=True, next_attempt_at=nxt, last_reply=reply_s,
                        log=attempt))
                    self.metrics.deferred.labels(st.name, "transient").inc()
                    warn = self.config.retry.warn_after
                    if (warn and now - cl.created_at >= warn and delayed is None
                            and job.envelope.delay_warned_at is None):
                        delayed = (cl, reply_s)
                    log_event(log, logging.WARNING, "deferred", "recipient deferred",
                              queue_id=job.msg_id, dedup_key=cl.dedup_key,
                              rcpt=cl.address, destination=st.name, host=host,
                              reply=reply_s, next_attempt_at=_iso(nxt),
                              attempts=cl.attempts + 1)
            elif outcome is Outcome.BOUNCE:
                outcomes.append(ops.Outcome(
                    rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.BOUNCED,
                    count_attempt=True, next_attempt_at=None, last_reply=reply_s, log=attempt,
                    suppress=(cl.address, reply_s)))
                self.on_suppressed(cl.address, reply_s, now)
                self.metrics.bounced.labels(st.name).inc()
                dead.append(self._dead(job, cl, "bounced", reply_s, st.name))
            else:
                outcomes.append(ops.Outcome(
                    rcpt_id=cl.rcpt_id, msg_id=job.msg_id, state=RcptState.FAILED,
                    count_attempt=True, next_attempt_at=None, last_reply=reply_s, log=attempt))
                self.metrics.failed.labels(st.name).inc()
                dead.append(self._dead(job, cl, "failed", reply_s, st.name))
        # destination health
        before = st.breaker.state(now)
        if not upstream_seen:
            st.breaker.release()  # a half-open trial that never tried goes back
        elif connection_failed:
            st.breaker.on_failure(now)
        elif refused_mail(results, delivered):
            st.breaker.on_failure(now)  # it answers, but takes no mail: failing too
        else:
            st.breaker.on_success(now)
        self._breaker_changed(st, before, now, _first_reply(results))
        if throttled:
            hold = 0.0
            if rule_hit is not None and rule_hit.action == "suspend":
                st.suspended_until = max(st.suspended_until, now + rule_hit.duration)
                st.suspend_reason = f"rule: {rule_hit.pattern.pattern}"
                log_event(log, logging.WARNING, "destination_suspended",
                          "a shaping rule matched the reply", destination=st.name,
                          until=_iso(st.suspended_until))
            elif rule_hit is not None:
                hold = rule_hit.duration
            if st.adaptive.on_throttle(now, hold):
                log_event(log, logging.WARNING, "slowdown",
                          "destination asked us to slow down", destination=st.name,
                          rate=st.adaptive.effective_rate(),
                          connections=st.adaptive.effective_connections())
            self._retune(st)
        elif delivered and st.adaptive.on_success(now):
            self._retune(st)
            self._spawn_workers(st)
        self._emit_dead(dead, host)  # before the record: its alerts go in the same commit
        await self._finish(job, outcomes, delivered)
        if delayed is not None:
            await self._delay_warning(st, job, *delayed)

    async def _delay_warning(self, st: DestState, job: Job, cl: ops.Claim, reply: str
                             ) -> None:
        """Once per message: a `delayed` alert, and (by the hook) a delay DSN."""
        now = self.clock()
        conf = self.config.alerts
        age = _human_round(now - cl.created_at)
        ev = alerts.Event("delayed", "warning", st.name,
                          f"mail to {st.name} delayed {age}: {reply}",
                          alerts.sample(job.msg_id, cl.address, reply))

        def mark(c: Any) -> bool:
            if not ops.mark_delay_warned(c, job.msg_id, now):
                return False
            alerts.record(c, ev, now, conf.coalesce, alerts.sinks_of(conf))
            return True

        try:
            first = await self.writer.run(mark)
        except Exception as e:
            log_event(log, logging.ERROR, "spool_error", "could not record a delay warning",
                      queue_id=job.msg_id, exc=e)
            return
        if not first:
            return
        log_event(log, logging.WARNING, "delayed", "message delayed", queue_id=job.msg_id,
                  rcpt=cl.address, destination=st.name, age=age, reply=reply)
        if self.on_dead_letter is not None:
            doc = {"event": "delayed", "queue_id": job.msg_id, "recipient": cl.address,
                   "sender": job.sender, "reply": reply, "destination": st.name,
                   "retry_until": _iso(cl.created_at + self.config.retry.max_age)}
            task = asyncio.get_running_loop().create_task(self._dead_letter_hook(doc))
            self._hooks.add(task)
            task.add_done_callback(self._hooks.discard)

    def _emit_dead(self, dead: list[dict[str, Any]], host: str | None = None) -> None:
        for d in dead:
            self.dead_times.append(self.clock())
            self._alert_backlog.append(alerts.Event(
                "dead_letter", "warning", d["destination"],
                f"{d['state']}: {d['reply']}",
                alerts.sample(d["queue_id"], d["recipient"], d["reply"])))
            # the outcome itself (standard events bounced / failed / expired, see relay.logs),
            # then the dead letter it makes
            log_event(log, logging.WARNING, d["state"], "", queue_id=d["queue_id"],
                      rcpt=d["recipient"], destination=d["destination"], host=host,
                      reply=d["reply"], attempts=d["attempts"])
            log_event(log, logging.ERROR, "dead_letter", d["reason"], queue_id=d["queue_id"],
                      rcpt=d["recipient"], destination=d["destination"], reply=d["reply"],
                      state=d["state"], dedup_key=d["dedup_key"])
            if self.on_dead_letter is not None:
                # in the background: a slow or hanging alert command (up to alerts.timeout)
                # must not hold this worker, and with it the destination's connection
                task = asyncio.get_running_loop().create_task(self._dead_letter_hook(d))
                self._hooks.add(task)
                task.add_done_callback(self._hooks.discard)

    async def _dead_letter_hook(self, d: dict[str, Any]) -> None:
        assert self.on_dead_letter is not None
        try:
            await self.on_dead_letter(d)
        except Exception as e:
            log_event(log, logging.ERROR, "alert_failed", "dead-letter hook failed", exc=e)

    def _dead(self, job: Job, cl: ops.Claim, state: str, reply: str, dest: str
              ) -> dict[str, Any]:
        return {
            "event": "dead_letter", "queue_id": job.msg_id, "recipient": cl.address,
            "sender": job.sender, "message_id": job.envelope.message_id, "state": state,
            "reply": reply, "destination": dest, "attempts": cl.attempts + 1,
            "reason": {"bounced": "permanent address failure; address suppressed",
                       "failed": "permanent failure", "expired": "gave up: max_age reached"
                       }[state],
            "dedup_key": cl.dedup_key, "at": _iso(self.clock()),
        }

    async def _finish(self, job: Job, outcomes: Sequence[ops.Outcome], delivered: int) -> None:
        if job.done:
            return
        job.done = True
        n = len(job.claims)
        scopes = self._unreserve(job, n, delivered)
        st = self.dests[job.destination]
        st.reserved = max(0, st.reserved - n)
        st.sent += delivered
        if delivered:
            outcomes = [dataclasses.replace(o, counters=scopes)
                        if o.state is RcptState.DELIVERED else o for o in outcomes]
        try:
            await self._record(outcomes)
        finally:
            self._inflight -= n
            if self._inflight <= 0:
                self._inflight = 0
                self._idle.set()
            self.wake()

    async def _record(self, outcomes: Sequence[ops.Outcome]) -> None:
        now = self.clock()
        day = self._day(now)
        delay = min(RECORD_RETRY_FIRST, self.config.delivery.poll_interval)
        # the alerts of the dead letters these outcomes make, in the same commit: a crash
        # cannot record a dead letter and lose its alert
        evs, self._alert_backlog = self._alert_backlog, []
        conf = self.config.alerts
        sinks = alerts.sinks_of(conf)

        def job(c: Any) -> None:
            ops.record(c, outcomes, now, day)
            for ev in evs:
                alerts.record(c, ev, now, conf.coalesce, sinks)

        while True:
            try:
                faults.hit("engine.record")
                await self.writer.run(job)
                return
            except Exception as e:
                log_event(log, logging.ERROR, "spool_error",
                          "could not record outcomes; retrying", exc=e)
                if self._stopping:
                    # left `sending`: the next start makes them due again (at-least-once)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)  # until the spool takes it (disk full, lock)

    # --- views ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        out: dict[str, Any] = {}
        for name, st in self.dests.items():
            limits = {}
            if st.conf.daily_limit is not None:
                limits[name] = {"limit": st.conf.daily_limit,
                                "today": self.counts.get(f"dest:{name}", 0)}
            out[name] = {
                "effective_rate": st.adaptive.effective_rate() or None,
                "configured_rate": st.conf.rate,
                "effective_connections": st.adaptive.effective_connections(),
                "max_connections": st.conf.max_connections,
                "active_connections": len(st.workers),
                "queued_in_memory": st.queued(),
                "circuit": st.breaker.state(now),
                "suspended_until": _iso(st.suspended_until)
                if st.suspended_until > now else None,
                "suspend_reason": st.suspend_reason if st.suspended_until > now else None,
                "delivered_today": self.counts.get(f"dest:{name}", 0),
                "daily_limit": st.conf.daily_limit,
            }
        idents = {}
        for key, ident in self.config.identities.items():
            warm = self._warmup_limit(ident, now)
            idents[key] = {"today": self.counts.get(f"id:{key}", 0),
                           "limit": shaping.effective_daily_limit(ident.daily_limit, warm),
                           "warmup_limit": warm}
        return {"destinations": out, "identities": idents, "day": self.counts_day,
                "inflight": self._inflight, "updated_at": _iso(now)}


def _iso(ts: float) -> str:
    return ops.iso_utc(ts)


def refused_mail(results: dict[str, RcptResult], delivered: int) -> bool:
    """An upstream that answered but refused the transaction at MAIL with a 4xx: it takes
    no mail, so for the breaker it is failing like a refused connection. (A 4xx later in
    the transaction, e.g. a 421 to DATA, is throttling: the AIMD slow-down handles it.)"""
    if delivered or not results:
        return False
    return all(r.verdict.outcome is Outcome.TRANSIENT and not r.ambiguous
               and r.phase is Phase.MAIL for r in results.values())


def _first_reply(results: dict[str, RcptResult]) -> str:
    for r in results.values():
        return str(r.reply)
    return ""


def _human_round(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
