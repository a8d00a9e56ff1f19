"""The delivery engine's shell: claims due recipients, dispatches them to destinations,
runs the workers; the decisions are relay/delivery/decide.py's, one attempt is
relay/delivery/attempt.py's.

Rules:
- The spool is the queue. The engine claims due recipients (`sending`, transactional lane
  first), routes each (relay/delivery/routes.py), groups them into jobs (one message x one
  destination = one transaction), and hands each job to its destination. A crash loses
  nothing: unrecorded claims come back at start.
- A destination is an upstream (by name; "smarthost" for the classic single one) or, in MX
  mode, the recipient domain. Each has a token bucket (rate, burst), a connection limit, a
  daily ceiling (relay/delivery/ledger.py), an adaptive (AIMD) multiplier, a circuit
  breaker and an operator/rule suspension. Waiting on any of these burns no attempt.
  A route with several upstreams goes to the first whose circuit is not open.
- Connections are reused for up to `max_messages_per_connection` messages. Transactional
  jobs are always taken before bulk ones; bulk may use at most its share of connections,
  so a campaign never takes the last connection from a password reset.
- Every dead letter is an ERROR line `event=dead_letter`, an alert recorded with its
  outcome, and a DSN if enabled (the daemon's hook). A recipient still deferred
  `retry.warn_after` after arrival raises one `delayed` alert and DSN per message.
- Every change of a circuit is a log line (circuit_open / circuit_half_open /
  circuit_closed). Operator commands reach the engine through the spool
  (`engine_commands`): `reset` closes a circuit and clears the slow-down; `kick` (after
  `queue flush` or `destination resume`) lets the next attempt through an open circuit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import random
import socket
import time
import zoneinfo
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from relay import __version__
from relay.authenticity import mtasts
from relay.config.tree import Config
from relay.delivery import (
    attempt,
    deadletters,
    dispatch,
    operator,
    outbound,
    shaping,
    views,
    workers,
)
from relay.delivery.jobs import DeadLetter, DestState, Job
from relay.delivery.lanes import LANE_PRIORITY
from relay.delivery.ledger import Ledger
from relay.delivery.mx import Resolver
from relay.delivery.oauth import TokenSource
from relay.delivery.routes import Route, UpstreamHost
from relay.ops import alerts
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import ops
from relay.spool.model import RcptState
from relay.spool.writer import SpoolWriter

EXPIRY_PASS = 30.0  # seconds between claims of expired recipients that wait
CLAIM_BACKOFF_MAX = 10.0  # seconds: the longest wait after failed claim passes (disk full)

log = logging.getLogger(__name__)

DeadLetterHook = Callable[[dict[str, Any]], Awaitable[None]]
# one claim transaction: operator commands, claims, their envelopes, suspensions, and the
# spool's suppression entries of claimed addresses
_Claimed = tuple[
    list[tuple[int, str, str]],
    list[ops.Claim],
    dict[str, ops.Envelope],
    dict[str, tuple[float, str]],
    dict[tuple[str, str], tuple[str, float] | None],  # (address, identity)
    list[tuple[str, Route | None]],  # each claim's destination and route
    dict[str, int] | None,  # fleet: the ceiling room taken for the pass
]


def _destination(
    conf: Config, cl: ops.Claim, env: ops.Envelope | None, via: dict[tuple[str, ...], str]
) -> tuple[str, Route | None]:
    """Where a claimed recipient goes this pass: its domain on an MX route, else the
    upstream `via` chose for its route; (its domain, None) without an envelope (skipped)."""
    if env is None:
        return cl.destination, None
    route = conf.routing.match(
        sender=env.sender, recipient=cl.address, client=env.client, listener=env.listener
    )
    return (cl.destination if route.mx else via[route.via]), route


def _retry_later(job: Job, now: float, e: Exception) -> list[ops.RcptUpdate]:
    """A job the engine could not dispatch: due again in a minute, no attempt spent."""
    return [
        ops.RcptUpdate(
            rcpt_id=cl.rcpt_id,
            msg_id=job.msg_id,
            state=RcptState.DEFERRED,
            count_attempt=False,
            next_attempt_at=now + 60,
            last_reply=None,
            reason=f"internal error: {type(e).__name__}",
        )
        for cl in job.claims
    ]


def _start_up(now: float, day: str, node: str, fleet: bool, c: Any) -> tuple[int, dict[str, int]]:
    if not fleet:  # the one engine of a SQLite spool: every claim in the spool was ours
        return ops.recover(c, now), ops.daily_counts(c, day)
    # a fleet: claims of this node's previous life (a stable fleet.node), and those of any
    # node whose lease ran out; live nodes' claims are theirs
    n = ops.recover(c, now, owner=node) + ops.reclaim_expired(c, now, node, day)
    return n, ops.daily_counts(c, day)


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
        is_suppressed: Callable[[str, str | None], tuple[str, float] | None] = lambda a, i: None,
        on_suppressed: Callable[[str, str, float], None] = lambda a, r, t: None,
        verp_sender: Callable[[str, int], str | None] = lambda q, r: None,
        on_recorded: Callable[[Iterable[str]], None] | None = None,
    ) -> None:
        self.writer = writer
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_dead_letter = on_dead_letter
        # told the queue ids of every record committed (the outbox's incremental write-back)
        self.on_recorded = on_recorded
        self.is_suppressed = is_suppressed
        # feedback.verp: (queue id, recipient row) -> the envelope sender to use, or None
        self.verp_sender = verp_sender
        self.on_suppressed = on_suppressed
        self.dests: dict[str, DestState] = {}
        self._wake = asyncio.Event()
        self.stopping = False
        self._inflight = 0
        self._loop_exited = asyncio.Event()
        self._hooks: set[asyncio.Task[None]] = set()  # dead-letter hooks still running
        self._alert_backlog: list[alerts.Event] = []  # recorded with the next outcomes
        self._tokens: dict[str, tuple[UpstreamHost, TokenSource]] = {}
        self.dead_times: deque[float] = deque()  # dead letters of the last hour
        self.last_delivery_at: float | None = None
        self._cmd_seen: int | None = None  # engine_commands read so far
        self._next_expiry_pass = 0.0  # when _claim_and_dispatch next claims expired waits
        self.resolver = resolver
        self._ns: object = None
        self.mta_sts: mtasts.MtaStsResolver | None = None  # MX mode, upstream.mx.mta_sts
        self._sts_conf: object = None
        self.sts_hosts: dict[str, str] = {}  # mta-sts.<domain> -> address (nameservers set)
        self.sts_seen: dict[tuple[str, str], int] = {}  # failures already in the metric
        # the fleet (spool.backend: postgresql): this node's name, its leases, and how many
        # nodes share each destination's rate (README "Running a fleet")
        self.fleet = config.spool_pg is not None
        self.node = config.fleet.node or f"{socket.gethostname()}:{os.getpid()}"
        self.fleet_size = 1
        self.fleet_nodes: list[dict[str, Any]] = []  # at the last heartbeat (a fleet only)
        self.started_at = clock()
        self.apply_config(config)

    # --- configuration ------------------------------------------------------------------

    def apply_config(self, config: Config) -> None:
        # everything that can fail first, into locals: a bad reload changes nothing
        tz = zoneinfo.ZoneInfo(config.shaping.window_tz)
        operator_rules = list(config.shaping.rules)
        resolver = self.resolver
        ns = config.upstream.mx.nameservers
        if resolver is None or ns != self._ns:
            resolver = Resolver(
                nameservers=list(ns) if ns else None,
                timeout=config.upstream.mx.dns_timeout,
                rng=self.rng,
            )
        self.config = config
        old = getattr(self, "ledger", None)
        self.ledger = Ledger(tz, config.shaping.window_length)
        if old is not None:
            self.ledger.day, self.ledger.counts, self.ledger.reserved = (
                old.day,
                old.counts,
                old.reserved,
            )
        self.rules = [*operator_rules, *shaping.DEFAULT_RULES]
        self.resolver = resolver
        self._ns = ns
        mx = config.upstream.mx
        sts_conf = (mx.mta_sts, ns, mx.dns_timeout, mx.ca_file, mx.mta_sts_port, config.spool_path)
        if sts_conf != self._sts_conf:
            self.mta_sts = (
                mtasts.MtaStsResolver(
                    nameservers=list(ns) if ns else None,
                    timeout=mx.dns_timeout,
                    https_port=mx.mta_sts_port,
                    ca_file=str(mx.ca_file) if mx.ca_file else None,
                    # with upstream.mx.nameservers, the policy host is looked up there too
                    connect_host=(lambda h: self.sts_hosts.get(h, h)) if ns else None,
                    cache_path=config.spool_path / "mta-sts.json",
                    clock=self.clock,
                )
                if mx.mta_sts
                else None
            )
            self._sts_conf = sts_conf
        for name, st in self.dests.items():
            conf = config.destination(name)
            st.conf = conf
            if st.upstream is not None:
                st.upstream = config.routing.upstreams.get(name, st.upstream)
            st.adaptive.base_rate = conf.rate or shaping.UNLIMITED
            st.adaptive.base_connections = conf.max_connections
            st.adaptive.cooldown = conf.slowdown_cooldown
            st.breaker.threshold = conf.circuit_failures
            st.breaker.cooldown = conf.circuit_cooldown
            self.retune(st)

    def reconfigure(self, config: Config) -> None:
        self.apply_config(config)
        self.wake()

    def dest(self, name: str) -> DestState:
        st = self.dests.get(name)
        if st is None:
            conf = self.config.destination(name)
            bucket = None
            if conf.rate:
                bucket = shaping.TokenBucket(rate=conf.rate, burst=conf.burst, updated=self.clock())
            st = DestState(
                name=name,
                conf=conf,
                bucket=bucket,
                adaptive=shaping.Adaptive(
                    base_rate=conf.rate or shaping.UNLIMITED,
                    base_connections=conf.max_connections,
                    cooldown=conf.slowdown_cooldown,
                ),
                breaker=shaping.Breaker(
                    threshold=conf.circuit_failures, cooldown=conf.circuit_cooldown
                ),
                upstream=self.config.routing.upstreams.get(name),
            )
            self.dests[name] = st
            if self.fleet_size > 1:
                self.retune(st)
        return st

    def token_source(self, up: UpstreamHost) -> TokenSource | None:
        """One OAuth2 token cache per upstream, kept while its OAuth settings stay."""
        if up.oauth is None:
            return None
        have = self._tokens.get(up.name)
        if have is None or have[0].oauth != up.oauth:
            have = (up, TokenSource(up.oauth, clock=self.clock))
            self._tokens[up.name] = have
        return have[1]

    def retune(self, st: DestState) -> None:
        rate = st.adaptive.effective_rate()
        burst = st.conf.burst
        if rate and self.fleet_size > 1:  # each live node sends its share of the rate
            rate = rate / self.fleet_size
            burst = max(1, math.ceil(burst / self.fleet_size))
        now = self.clock()
        if not rate:
            st.bucket = None
        elif st.bucket is None:
            st.bucket = shaping.TokenBucket(rate=rate, burst=burst, updated=now)
        else:
            st.bucket.burst = burst
            st.bucket.set_rate(rate, now)
        self.metrics.effective_rate.labels(st.name).set(rate or 0)
        self.metrics.effective_connections.labels(st.name).set(st.adaptive.effective_connections())

    # --- main loop ------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        # a spool that fails right at start (disk full, I/O error) must not leave the
        # daemon accepting mail with no engine: the start-up reads are retried until they
        # work, like every later pass
        while True:
            now = self.clock()
            day = self.ledger.day_of(now)
            try:
                recovered, counts = await self.writer.run(
                    functools.partial(_start_up, now, day, self.node, self.fleet)
                )
                break
            except Exception as e:
                log_event(log, logging.ERROR, "engine_error", "start-up pass failed", exc=e)
                if self.stopping:
                    self._loop_exited.set()
                    return
                await asyncio.sleep(self.config.delivery.poll_interval)
        if recovered:
            log_event(
                log,
                logging.WARNING,
                "recovered",
                "claims left by a crash are due again",
                count=recovered,
            )
        self.ledger.load(day, counts)
        beat = asyncio.create_task(self._heartbeat_loop(), name="fleet-heartbeat")
        failures = 0  # claim passes failed in a row (a full disk, a spool that is away)
        try:
            while not self.stopping:
                try:
                    claimed = await self._claim_and_dispatch()
                except Exception as e:
                    # logged once, then retried with backoff (never a tight loop of errors)
                    if not failures:
                        log_event(log, logging.ERROR, "engine_error", "claim loop failed", exc=e)
                    failures += 1
                    await self._backoff(failures)
                    continue
                if failures:
                    log_event(
                        log,
                        logging.WARNING,
                        "engine_recovered",
                        "claim loop works again",
                        failed_passes=failures,
                    )
                    failures = 0
                if self.stopping:
                    break
                if claimed and self._inflight < self._max_inflight():
                    continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.delivery.poll_interval)
        finally:
            beat.cancel()
            self._loop_exited.set()

    async def _backoff(self, failures: int) -> None:
        """After the n-th failed claim pass in a row: wait poll_interval * 2**(n-1), at
        most CLAIM_BACKOFF_MAX seconds (a stop still ends the wait at once)."""
        poll = self.config.delivery.poll_interval
        wait = min(CLAIM_BACKOFF_MAX, poll * 2.0 ** min(failures - 1, 16))
        deadline = time.monotonic() + wait
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    @property
    def lease(self) -> float:
        return self.config.fleet.lease

    async def _heartbeat_loop(self) -> None:
        """Every lease/3: renew this node's leases and heartbeat; in a fleet, also give the
        claims of nodes whose lease ran out back to the queue, and learn how many nodes
        share each destination's rate."""
        while True:
            now = self.clock()
            day = self.ledger.day_of(now)
            try:
                size, counts, self.fleet_nodes = await self.writer.run(
                    functools.partial(self._beat, now, day, self._inflight)
                )
            except Exception as e:
                log_event(log, logging.ERROR, "engine_error", "fleet heartbeat failed", exc=e)
            else:
                if counts is not None:  # the fleet's deliveries today, for stats and _waiting
                    self.ledger.load(day, counts)
                if size != self.fleet_size:  # each node's share of the rates changed
                    self.fleet_size = size
                    for st in self.dests.values():
                        self.retune(st)
            await asyncio.sleep(self.lease / 3)

    def _beat(
        self, now: float, day: str, inflight: int, c: Any
    ) -> tuple[int, dict[str, int] | None, list[dict[str, Any]]]:
        ops.renew_leases(c, self.node, now + self.lease)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "version": __version__}
        ops.heartbeat(c, self.node, self.started_at, now, inflight, info)
        if not self.fleet:
            return 1, None, []
        n = ops.reclaim_expired(c, now, self.node, day)
        if n:
            log_event(
                log,
                logging.WARNING,
                "recovered",
                "claims of a node whose lease expired are due again",
                count=n,
            )
        ops.prune_nodes(c, now, 86400.0)
        nodes = ops.list_nodes(c, now, self.lease)
        live = max(1, sum(1 for n in nodes if n["alive"]))
        return live, ops.daily_counts(c, day), nodes

    def _max_inflight(self) -> int:
        # a memory bound over all destinations; each destination is bounded on its own by
        # _queue_cap, so one slow destination cannot fill this and starve the others
        return max(self.config.delivery.batch, 1) * 4

    def _queue_cap(self, st: DestState) -> int:
        """How many jobs of one lane a destination may hold in memory: enough to keep its
        connections busy, and about two seconds of its rate."""
        rate = st.adaptive.effective_rate()
        return max(4, 2 * st.adaptive.effective_connections(), math.ceil((rate or 0) * 2))

    def _waiting(self, now: float) -> list[tuple[int, str | None]]:
        """(lane priority, domain) pairs whose destination takes no attempt now (circuit
        open): not claimed, so that a backlog behind a dead upstream is not
        claimed and written back as deferred on every pass. Upstream routing: only when
        every upstream waits (a route fails over to the next one). MX: per domain. With MX
        and upstream routes mixed, nothing is skipped (a domain may go either way)."""
        routes = self.config.routing.routes
        prios = sorted(set(LANE_PRIORITY.values()))

        def waits(st: DestState) -> bool:
            # a suspension (operator, rule) is left to dispatch: it defers each recipient
            # once, until the suspension ends, with the reason `queue list` shows
            return st.breaker.state(now) == "open"

        if all(r.mx for r in routes):
            return [
                (p, st.name)
                for st in self.dests.values()
                if st.upstream is None and waits(st)
                for p in prios
            ]
        if any(r.mx for r in routes):
            return []
        names = {n for r in routes for n in r.via}
        if names and all(waits(self.dest(n)) for n in names):
            return [(p, None) for p in prios]
        return []

    def _full_queues(self) -> list[tuple[int, str | None]]:
        skip: list[tuple[int, str | None]] = []
        for st in self.dests.values():
            cap = self._queue_cap(st)
            for lane, q in st.queues.items():
                if len(q) >= cap:  # an upstream takes every domain: skip the whole lane
                    domain = None if st.upstream is not None else st.name
                    skip.append((LANE_PRIORITY.get(lane, 0), domain))
        return skip

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let the deliveries under way finish up to `timeout`; put the rest
        back (relay/delivery/workers.py)."""
        self.stopping = True
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._loop_exited.wait(), max(0.1, timeout))
        await workers.drain(self, timeout, list(self._hooks))

    # --- claiming and dispatch ------------------------------------------------------------

    async def _claim_and_dispatch(self) -> int:
        cap = min(self._max_inflight() - self._inflight, self.config.delivery.batch)
        if cap <= 0:
            return 0
        now = self.clock()
        skip = self._full_queues()
        waiting = self._waiting(now)
        expired_before = float("-inf")
        if waiting and now >= self._next_expiry_pass:
            # what waits stays in the spool, but what is past retry.max_age is claimed
            # (and dead-lettered by dispatch) on time, in a pass every 30 seconds
            self._next_expiry_pass = now + EXPIRY_PASS
            expired_before = now - self.config.retry.max_age

        # the upstream each route sends through now, chosen once for this pass: the claim
        # takes its ceiling room for it and dispatch sends there (one choice, two places)
        conf = self.config
        via = {
            r.via: dispatch.first_open(self, r.via, now) for r in conf.routing.routes if not r.mx
        }
        day = self.ledger.day_of(now)
        until = now + self.lease

        def claim(c: Any) -> _Claimed:
            # operator commands in the same transaction: a `queue flush` makes recipients
            # due and kicks the circuit in one commit, and the kick is applied (below)
            # before those recipients are dispatched
            if self._cmd_seen is None:  # at start: only what comes from now on
                self._cmd_seen = ops.last_engine_command(c)
                cmds: list[tuple[int, str, str]] = []
            else:
                cmds = ops.engine_commands(c, self._cmd_seen)
            claims = ops.claim_due(
                c, now, cap, skip, waiting, expired_before, self.node, now + self.lease
            )
            envs = ops.load_envelopes(c, {cl.msg_id for cl in claims}) if claims else {}
            # The in-memory suppression list lags the spool by up to one refresh: before a
            # recipient is made `suppressed` (final), ask the spool, so that an operator's
            # `suppression remove` followed at once by `queue retry` is not undone.
            stored = {
                (cl.address, cl.identity): ops.suppression_get(c, cl.address, cl.identity)
                for cl in claims
                if self.is_suppressed(cl.address, cl.identity) is not None
            }
            dests = [_destination(conf, cl, envs.get(cl.msg_id), via) for cl in claims]
            grants = None
            if self.fleet:
                # a fleet's daily ceilings: the room this pass may use, taken in the claim's
                # own transaction (relay/delivery/ledger.py); if it fails, nothing is claimed
                wants = self._ceiling_wants(conf, claims, dests, now)
                if wants:
                    grants = ops.ceiling_take(c, self.node, day, wants, until)
            return cmds, claims, envs, ops.suspensions(c, now), stored, dests, grants

        # lazy: a claim lost in a power cut leaves its recipients due (no fsync of its own)
        cmds, claims, envs, susp, stored, dests, grants = await self.writer.run(claim, lazy=True)
        self.ledger.grants = grants
        for cid, action, name in cmds:
            self._cmd_seen = max(self._cmd_seen or 0, cid)
            operator.command(self, action, name, now)
        if cmds:
            self.wake()  # a kick or reset may open what this pass skipped: claim again
        for name, (until, reason) in susp.items():
            st = self.dest(name)
            if until > st.suspended_until or st.suspend_reason.startswith("operator"):
                st.suspended_until, st.suspend_reason = until, f"operator: {reason}"
        for st in self.dests.values():
            if st.suspend_reason.startswith("operator") and st.name not in susp:
                st.suspended_until, st.suspend_reason = 0.0, ""
        jobs: dict[tuple[str, str, int], Job] = {}
        for cl, (dname, route) in zip(claims, dests, strict=True):
            env = envs.get(cl.msg_id)
            if env is None or route is None:
                continue
            # feedback.verp: an envelope sender per recipient, so one transaction each
            verp = self.verp_sender(cl.msg_id, cl.rcpt_id) if env.sender else None
            # ... and so does a List-Unsubscribe that names its one recipient
            alone = verp or outbound.one_per_recipient(self.config, cl.lane, cl.identity)
            key = (cl.msg_id, dname, cl.rcpt_id if alone else 0)
            job = jobs.get(key)
            if job is None:
                job = jobs[key] = Job(
                    msg_id=cl.msg_id,
                    destination=dname,
                    lane=cl.lane,
                    identity=cl.identity,
                    sender=verp or env.sender,
                    claims=[],
                    envelope=env,
                    route=route,
                )
            job.claims.append(cl)
        immediate: list[ops.RcptUpdate] = []
        for job in jobs.values():
            try:
                immediate.extend(dispatch.dispatch(self, job, now, stored))
            except Exception as e:  # never strand a claim: wait a minute and try again
                log_event(
                    log,
                    logging.ERROR,
                    "engine_error",
                    "dispatch failed",
                    queue_id=job.msg_id,
                    exc=e,
                )
                immediate.extend(_retry_later(job, now, e))
        left: dict[str, int] | None = None
        if self.ledger.grants is not None:
            # room taken for this pass and not used (suppressed, suspended, split) goes back,
            # in the commit of this pass's immediate outcomes when there are any
            left = {s: n for s, n in self.ledger.grants.items() if n > 0} or None
            self.ledger.grants = None
        if immediate:
            await attempt.record(self, immediate, left)
        elif left:
            await self.writer.run(
                functools.partial(ops.ceiling_release, node=self.node, scopes=left)
            )
        return len(claims)

    def _ceiling_wants(
        self,
        conf: Config,
        claims: Sequence[ops.Claim],
        dests: Sequence[tuple[str, Route | None]],
        now: float,
    ) -> dict[str, tuple[int, int]]:
        """(limit, recipients) per fleet-wide ceiling scope for the claims of a pass, each
        under the destination it goes to (pure over the config: runs in the writer)."""
        wants: dict[str, tuple[int, int]] = {}
        for cl, (dname, route) in zip(claims, dests, strict=True):
            if route is None:
                continue
            ident = conf.identity(cl.identity)
            for scope, _name, limit in self.ledger.limits(
                dname, conf.destination(dname).daily_limit, cl.identity, ident, now
            ):
                wants[scope] = (limit, wants.get(scope, (limit, 0))[1] + 1)
        return wants

    def job_queued(self, n: int) -> None:
        self._inflight += n

    def job_done(self, n: int) -> None:
        self._inflight = max(0, self._inflight - n)
        self.wake()

    # --- dead letters, hooks, alerts --------------------------------------------------------

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
        self._hooks.add(task)
        task.add_done_callback(self._hooks.discard)

    async def _run_hook(self, doc: dict[str, Any]) -> None:
        assert self.on_dead_letter is not None
        try:
            await self.on_dead_letter(doc)
        except Exception as e:
            log_event(log, logging.ERROR, "alert_failed", "dead-letter hook failed", exc=e)

    def take_alerts(self) -> list[alerts.Event]:
        evs, self._alert_backlog = self._alert_backlog, []
        return evs

    def breaker_changed(self, st: DestState, before: str, now: float, why: str) -> None:
        operator.breaker_changed(self, st, before, now, why)

    # --- delegated: workers (relay/delivery/workers.py), views (relay/delivery/views.py) --

    def spawn_workers(self, st: DestState) -> None:
        workers.spawn_workers(self, st)

    async def wait_token(self, st: DestState) -> None:
        await workers.wait_token(self, st)

    def health(self) -> list[views.DestHealth]:
        return views.health(self)

    def dead_letters_last_hour(self) -> int:
        return views.dead_letters_last_hour(self)

    def snapshot(self) -> views.Snapshot:
        return views.snapshot(self)

    @property
    def inflight(self) -> int:
        return self._inflight
