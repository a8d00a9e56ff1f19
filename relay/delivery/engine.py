"""The delivery engine: composes its parts and runs the claim loop. The parts, each owning
its state: the destinations (relay/delivery/destinations.py: buckets, breakers, AIMD,
suspensions, the daily ledger), the connector (connect.py: resolver, MTA-STS, tokens),
the recorder (recorder.py: outcomes into the spool, alerts, hooks), the worker pool
(workers.py), the fleet (fleet.py: node, leases, heartbeat). The decisions are
relay/delivery/decide.py's, one attempt is relay/delivery/attempt.py's.

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
import random
import time
import zoneinfo
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from relay.authenticity import mtasts
from relay.config.tree import Config
from relay.delivery import attempt, dispatch, operator, outbound, views
from relay.delivery.connect import Connector
from relay.delivery.destinations import Destinations
from relay.delivery.fleet import Fleet
from relay.delivery.jobs import Job
from relay.delivery.mx import Resolver
from relay.delivery.recorder import DeadLetterHook, Recorder
from relay.delivery.routes import Route
from relay.delivery.workers import WorkerPool
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import ops
from relay.spool.model import RcptState
from relay.spool.writer import SpoolWriter

EXPIRY_PASS = 30.0  # seconds between claims of expired recipients that wait
CLAIM_BACKOFF_MAX = 10.0  # seconds: the longest wait after failed claim passes (disk full)

log = logging.getLogger(__name__)

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
    ) -> None:
        self.writer = writer
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.rng = rng or random.Random()
        self.is_suppressed = is_suppressed
        # feedback.verp: (queue id, recipient row) -> the envelope sender to use, or None
        self.verp_sender: Callable[[str, int], str | None] = lambda q, r: None
        self.dests = Destinations(config, metrics=self.metrics, clock=clock)
        self._wake = asyncio.Event()
        self.stopping = False
        self._loop_exited = asyncio.Event()
        self._cmd_seen: int | None = None  # engine_commands read so far
        self._next_expiry_pass = 0.0  # when _claim_and_dispatch next claims expired waits
        # the fleet (spool.backend: postgresql): this node's name, its leases, and how many
        # nodes share each destination's rate (README "Running a fleet")
        self.membership = Fleet(
            config,
            writer,
            get_config=lambda: self.config,
            ledger=self.dests.ledger,
            clock=clock,
            inflight=lambda: self.pool.inflight,
            on_share=self.dests.set_share,
        )
        self.connector = Connector(
            self.dests,
            metrics=self.metrics,
            clock=clock,
            rng=self.rng,
            fleet=self.membership.enabled,
            resolver=resolver,
        )
        self.recorder = Recorder(
            writer,
            config=lambda: self.config,
            ledger=self.dests.ledger,
            node=self.membership.node,
            clock=clock,
            stopping=lambda: self.stopping,
            on_dead_letter=on_dead_letter,
        )
        self.pool = WorkerPool(
            self.dests,
            self.recorder,
            config=lambda: self.config,
            clock=clock,
            stopping=lambda: self.stopping,
            deliver=lambda st, job, conn: attempt.deliver(self.attempt, st, job, conn),
            failed=lambda st, job, ex: attempt.internal_error(self.attempt, st, job, ex),
            on_done=self.wake,
        )
        self.attempt = attempt.Attempt(
            get_config=lambda: self.config,
            clock=clock,
            rng=self.rng,
            metrics=self.metrics,
            dests=self.dests,
            connector=self.connector,
            recorder=self.recorder,
            pool=self.pool,
            fleet=self.membership.enabled,
            on_suppressed=on_suppressed,
        )
        self.apply_config(config)

    # --- configuration ------------------------------------------------------------------

    def apply_config(self, config: Config) -> None:
        # everything that can fail first, into locals: a bad reload changes nothing
        tz = zoneinfo.ZoneInfo(config.shaping.window_tz)
        resolver = self.connector.resolver_for(config)
        self.config = config
        self.dests.apply_config(config, tz)
        self.connector.apply_config(config, resolver)

    def reconfigure(self, config: Config) -> None:
        self.apply_config(config)
        self.wake()

    # --- main loop ------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        # a spool that fails right at start (disk full, I/O error) must not leave the
        # daemon accepting mail with no engine: the start-up reads are retried until they
        # work, like every later pass
        while True:
            now = self.clock()
            day = self.dests.ledger.day_of(now)
            try:
                recovered, counts = await self.membership.start(now, day)
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
        self.dests.ledger.load(day, counts)
        beat = asyncio.create_task(self.membership.heartbeat_loop(), name="fleet-heartbeat")
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
                if claimed and self.pool.inflight < self._max_inflight():
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

    def _max_inflight(self) -> int:
        # a memory bound over all destinations; each destination is bounded on its own by
        # its queue cap (Destinations.queue_cap), so one slow destination cannot fill this
        # and starve the others
        return max(self.config.delivery.batch, 1) * 4

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let the deliveries under way finish up to `timeout`; put the rest
        back (relay/delivery/workers.py)."""
        self.stopping = True
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._loop_exited.wait(), max(0.1, timeout))
        await self.pool.drain(timeout)
        await self.membership.leave(self.clock())

    # --- claiming and dispatch ------------------------------------------------------------

    async def _claim_and_dispatch(self) -> int:
        cap = min(self._max_inflight() - self.pool.inflight, self.config.delivery.batch)
        if cap <= 0:
            return 0
        now = self.clock()
        skip = self.dests.full_queues()
        waiting = self.dests.waiting(now)
        expired_before = float("-inf")
        if waiting and now >= self._next_expiry_pass:
            # what waits stays in the spool, but what is past retry.max_age is claimed
            # (and dead-lettered by dispatch) on time, in a pass every 30 seconds
            self._next_expiry_pass = now + EXPIRY_PASS
            expired_before = now - self.config.retry.max_age

        # the upstream each route sends through now, chosen once for this pass: the claim
        # takes its ceiling room for it and dispatch sends there (one choice, two places)
        conf = self.config
        via = {r.via: self.dests.first_open(r.via, now) for r in conf.routing.routes if not r.mx}
        day = self.dests.ledger.day_of(now)
        until = now + self.membership.lease

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
                c,
                now,
                cap,
                skip,
                waiting,
                expired_before,
                self.membership.node,
                now + self.membership.lease,
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
            if self.membership.enabled:
                # a fleet's daily ceilings: the room this pass may use, taken in the claim's
                # own transaction (relay/delivery/ledger.py); if it fails, nothing is claimed
                wants = self._ceiling_wants(conf, claims, dests, now)
                if wants:
                    grants = ops.ceiling_take(c, self.membership.node, day, wants, until)
            return cmds, claims, envs, ops.suspensions(c, now), stored, dests, grants

        # lazy: a claim lost in a power cut leaves its recipients due (no fsync of its own)
        cmds, claims, envs, susp, stored, dests, grants = await self.writer.run(claim, lazy=True)
        self.dests.ledger.grants = grants
        for cid, action, name in cmds:
            self._cmd_seen = max(self._cmd_seen or 0, cid)
            operator.command(self.dests, self.pool.spawn_workers, action, name, now)
        if cmds:
            self.wake()  # a kick or reset may open what this pass skipped: claim again
        self.dests.apply_suspensions(susp)
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
                immediate.extend(
                    dispatch.dispatch(
                        job,
                        now,
                        stored,
                        dests=self.dests,
                        pool=self.pool,
                        recorder=self.recorder,
                        config=self.config,
                        metrics=self.metrics,
                        is_suppressed=self.is_suppressed,
                    )
                )
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
        if self.dests.ledger.grants is not None:
            # room taken for this pass and not used (suppressed, suspended, split) goes back,
            # in the commit of this pass's immediate outcomes when there are any
            left = {s: n for s, n in self.dests.ledger.grants.items() if n > 0} or None
            self.dests.ledger.grants = None
        if immediate:
            await self.recorder.record(immediate, left)
        elif left:
            await self.writer.run(
                functools.partial(ops.ceiling_release, node=self.membership.node, scopes=left)
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
            for scope, _name, limit in self.dests.ledger.limits(
                dname, conf.destination(dname).daily_limit, cl.identity, ident, now
            ):
                wants[scope] = (limit, wants.get(scope, (limit, 0))[1] + 1)
        return wants

    # --- what the daemon reads: views (relay/delivery/views.py), the recorder, the fleet --

    def health(self) -> list[views.DestHealth]:
        return views.health(self.dests)

    def dead_letters_last_hour(self) -> int:
        return self.recorder.dead_letters_last_hour()

    def snapshot(self) -> views.Snapshot:
        return views.snapshot(self.dests, self.pool.inflight)

    @property
    def inflight(self) -> int:
        return self.pool.inflight

    # --- what the daemon reads and sets of the recorder -----------------------------------

    @property
    def last_delivery_at(self) -> float | None:
        return self.recorder.last_delivery_at

    @property
    def on_recorded(self) -> Callable[[Iterable[str]], None] | None:
        """Told the queue ids of every record committed (the outbox's write-back)."""
        return self.recorder.on_recorded

    @on_recorded.setter
    def on_recorded(self, fn: Callable[[Iterable[str]], None] | None) -> None:
        self.recorder.on_recorded = fn

    # --- what the daemon reads of the fleet -----------------------------------------------

    @property
    def fleet(self) -> bool:
        """A fleet node (spool.backend: postgresql)."""
        return self.membership.enabled

    @property
    def node(self) -> str:
        return self.membership.node

    @property
    def fleet_size(self) -> int:
        """Live nodes at the last heartbeat."""
        return self.membership.size

    @property
    def fleet_nodes(self) -> list[dict[str, Any]]:
        """The node list at the last heartbeat (a fleet only)."""
        return self.membership.nodes

    @property
    def mta_sts(self) -> mtasts.MtaStsResolver | None:
        """The MTA-STS resolver (MX mode, upstream.mx.mta_sts): the daemon closes it."""
        return self.connector.mta_sts
