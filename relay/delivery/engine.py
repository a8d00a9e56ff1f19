"""The delivery engine: composes its parts and runs the claim loop (start-up, passes,
backoff, stop). The parts, each owning its state and given what it needs by constructor
(none imports this module), all in relay/delivery/:
- destinations.py: buckets, breakers, AIMD, suspensions, queues, the daily ledger;
- connect.py (Connector): the MX and MTA-STS resolvers, OAuth2 tokens, failover;
- recorder.py: outcomes into the spool, alerts, dead-letter and delay hooks;
- workers.py (WorkerPool): the workers per destination, the recipients in memory;
- fleet.py: this node's name, leases, heartbeat, the fleet's size;
- claims.py (Claimer): the claim pass, operator commands, dispatch (dispatch.py).
The decisions are relay/delivery/decide.py's, one attempt is relay/delivery/attempt.py's
(`Attempt`: the parts an attempt works with).

Rules:
- The spool is the queue. The engine claims due recipients (`sending`, transactional lane
  first), routes each (relay/config/routes.py), groups them into jobs (one message x one
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
import logging
import random
import time
import zoneinfo
from collections.abc import Callable, Iterable
from typing import Any

from relay.authenticity import mtasts
from relay.config.tree import Config
from relay.delivery import attempt, views
from relay.delivery.claims import Claimer
from relay.delivery.connect import Connector
from relay.delivery.destinations import Destinations
from relay.delivery.fleet import Fleet
from relay.delivery.mx import Resolver
from relay.delivery.recorder import DeadLetterHook, Recorder
from relay.delivery.workers import WorkerPool
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool.writer import SpoolWriter

CLAIM_BACKOFF_MAX = 10.0  # seconds: the longest wait after failed claim passes (disk full)

log = logging.getLogger(__name__)


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
        metrics = metrics or Metrics()
        rng = rng or random.Random()
        self.clock = clock
        self.dests = Destinations(config, metrics=metrics, clock=clock)
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()  # stop(): `stopping`, and ends a gather at once
        self._loop_exited = asyncio.Event()
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
            metrics=metrics,
            clock=clock,
            rng=rng,
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
            on_recorded=on_recorded,  # the outbox's write-back (the daemon's)
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
            rng=rng,
            metrics=metrics,
            dests=self.dests,
            connector=self.connector,
            recorder=self.recorder,
            pool=self.pool,
            fleet=self.membership.enabled,
            on_suppressed=on_suppressed,
        )
        self.claims = Claimer(
            writer,
            config=lambda: self.config,
            clock=clock,
            dests=self.dests,
            pool=self.pool,
            recorder=self.recorder,
            membership=self.membership,
            metrics=metrics,
            is_suppressed=is_suppressed,
            wake=self.wake,
            verp_sender=verp_sender,  # feedback.verp (the daemon's)
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

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

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
                self._wake.clear()  # before the pass: a wake that comes during it is kept
                try:
                    claimed = await self.claims.claim_and_dispatch()
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
                if claimed >= self.claims.last_cap > 0 and (
                    self.pool.inflight < self.claims.max_inflight()
                ):
                    continue  # a full pass: more may be due now
                # a pass that claimed less took all that was due and not held back (full
                # queues, open circuits): another pass now would find nothing and only take
                # the spool's write lock from the inbound processes' commits; new mail,
                # operator commands and finished jobs wake it, or poll_interval does
                try:
                    async with asyncio.timeout(self.config.delivery.poll_interval):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                else:
                    await self._gather()  # woken (a wait that timed out skips this)
        finally:
            beat.cancel()
            self._loop_exited.set()

    async def _gather(self) -> None:
        """After a wake (new mail, a finished job, an operator command): `delivery.gather`
        more before the pass, so that a trickle of messages is claimed, sent and recorded
        a few at a time. Each pass is two spool commits (its claim, its outcomes) that take
        the spool's write lock from the SMTP side's commits and reset their page cache: one
        session sending mail one message at a time waited 1.7-1.8 ms (p50) for each `250`
        with a pass per message, 1.1-1.3 ms with 10 ms of gathering (bench/README.md; more
        gathering makes bigger bursts of delivery work, and the p99 grows). A stop ends the
        wait at once."""
        gather = self.config.delivery.gather
        if gather <= 0 or self.stopping:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(gather):
                await self._stopped.wait()

    async def _backoff(self, failures: int) -> None:
        """After the n-th failed claim pass in a row: wait poll_interval * 2**(n-1), at
        most CLAIM_BACKOFF_MAX seconds (a stop still ends the wait at once)."""
        poll = self.config.delivery.poll_interval
        wait = min(CLAIM_BACKOFF_MAX, poll * 2.0 ** min(failures - 1, 16))
        deadline = time.monotonic() + wait
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._wake.wait()

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let the deliveries under way finish up to `timeout`; put the rest
        back (relay/delivery/workers.py)."""
        self._stopped.set()
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.1, timeout)):
                await self._loop_exited.wait()
        await self.pool.drain(timeout)
        await self.membership.leave(self.clock())

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

    # --- the daemon's hooks: the VERP sender, the outbox's write-back --------------------

    @property
    def verp_sender(self) -> Callable[[str, int], str | None]:
        """feedback.verp: (queue id, recipient row) -> the envelope sender, or None."""
        return self.claims.verp_sender

    @property
    def last_delivery_at(self) -> float | None:
        return self.recorder.last_delivery_at

    @property
    def on_recorded(self) -> Callable[[Iterable[str]], None] | None:
        """Told the queue ids of every record committed (the outbox's write-back)."""
        return self.recorder.on_recorded

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
