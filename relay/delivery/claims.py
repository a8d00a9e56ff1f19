"""The claim pass of the engine: claims due recipients from the spool, groups them into
jobs (one message x one destination = one transaction) and dispatches each to its
destination. Owns what it has read of the spool's operator commands (`engine_commands`),
when expired waits are next claimed, and the VERP sender hook (feedback.verp).

Rules:
- The spool is the queue: a claim marks recipients `sending` under this node's lease; a
  crash loses nothing (unrecorded claims come back at start, relay/delivery/fleet.py).
- Nothing is claimed for a destination whose circuit is open (its backlog stays in the
  spool) or whose lane is full in memory, except, every 30 seconds, what is past
  retry.max_age (dead-lettered on time by dispatch).
- Operator commands are read in the claim's transaction and applied before its
  recipients are dispatched (a `queue flush` then kicks the circuit first).
- A fleet takes the daily ceilings' room for the pass in the claim's transaction; what
  the pass does not use goes back at its end.
- A job that cannot be dispatched (a bug) waits a minute; no claim is stranded.
- A claim pass whose commit the engine never heard of (on PostgreSQL, a connection lost
  after its COMMIT was sent: it may have committed) leaves claims this node holds but
  never dispatched, which its own heartbeat would renew for as long as it runs. Each pass
  stamps its claims' `updated_at` with its `now`; the `now` of a failed pass is kept and
  the next pass, in its own transaction, makes this node's `sending` claims of those
  passes due again (`ops.release_unclaimed`; none, if the failed pass did not commit).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from relay.config.routes import Route
from relay.config.tree import Config
from relay.delivery import dispatch, operator, outbound
from relay.delivery.destinations import Destinations
from relay.delivery.fleet import Fleet
from relay.delivery.jobs import Job
from relay.delivery.recorder import Recorder
from relay.delivery.workers import WorkerPool
from relay.ops import faults
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import ops
from relay.spool.model import RcptState
from relay.spool.writer import SpoolWriter

EXPIRY_PASS = 30.0  # seconds between claims of expired recipients that wait
MAX_UNCONFIRMED = 256  # claim passes whose commit is unknown, kept (see the rules)

log = logging.getLogger("relay.delivery.engine")

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


class Claimer:
    def __init__(
        self,
        writer: SpoolWriter,
        *,
        config: Callable[[], Config],
        clock: Callable[[], float],
        dests: Destinations,
        pool: WorkerPool,
        recorder: Recorder,
        membership: Fleet,
        metrics: Metrics,
        is_suppressed: Callable[[str, str | None], tuple[str, float] | None],
        wake: Callable[[], None],
        verp_sender: Callable[[str, int], str | None] = lambda q, r: None,
    ) -> None:
        self.writer = writer
        self._config = config
        self.clock = clock
        self.dests = dests
        self.pool = pool
        self.recorder = recorder
        self.membership = membership
        self.metrics = metrics
        self.is_suppressed = is_suppressed
        self.wake = wake  # claim again at once (a kick or reset may open what was skipped)
        # feedback.verp: (queue id, recipient row) -> the envelope sender to use, or None
        self.verp_sender = verp_sender
        self._cmd_seen: int | None = None  # engine_commands read so far
        self._next_expiry_pass = 0.0  # when claim_and_dispatch next claims expired waits
        self._unconfirmed: list[float] = []  # the `now` of claim passes that failed
        self.last_cap = 0  # how many the last pass could claim (fewer: it took all it could)

    @property
    def config(self) -> Config:
        return self._config()

    def max_inflight(self) -> int:
        """How many recipients may be in memory (queued or being sent) in all."""
        # a memory bound over all destinations; each destination is bounded on its own by
        # its queue cap (Destinations.queue_cap), so one slow destination cannot fill this
        # and starve the others
        return max(self.config.delivery.batch, 1) * 4

    async def claim_and_dispatch(self) -> int:
        """One pass: claim what is due and fits, dispatch it; the number claimed."""
        cap = min(self.max_inflight() - self.pool.inflight, self.config.delivery.batch)
        self.last_cap = cap  # a pass that claims fewer took all that was claimable
        if cap <= 0:
            return 0
        now = self.clock()
        cmds, claims, envs, susp, stored, dests, grants = await self._claim(now, cap)
        self.dests.ledger.grants = grants
        for cid, action, name in cmds:
            self._cmd_seen = max(self._cmd_seen or 0, cid)
            operator.command(self.dests, self.pool.spawn_workers, action, name, now)
        if cmds:
            self.wake()  # a kick or reset may open what this pass skipped: claim again
        self.dests.apply_suspensions(susp)
        immediate = self._dispatch(self._jobs(claims, dests, envs), now, stored)
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

    async def _claim(self, now: float, cap: int) -> _Claimed:
        """The pass's one spool transaction: operator commands, the claims (at most `cap`)
        with their envelopes, suspensions, stored suppressions, each claim's destination
        and route, and the fleet's ceiling room (see the rules)."""
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
        unconfirmed = tuple(self._unconfirmed)

        def claim(c: Any) -> _Claimed:
            if unconfirmed:  # (see the rules): due again, and claimable by this very pass
                released = ops.release_unclaimed(c, self.membership.node, unconfirmed, now)
                if released:
                    log_event(
                        log,
                        logging.WARNING,
                        "recovered",
                        "claims of a pass whose commit was not confirmed are due again",
                        count=released,
                    )
            # operator commands in the same transaction: a `queue flush` makes recipients
            # due and kicks the circuit in one commit, and the kick is applied (below)
            # before those recipients are dispatched
            # and the suspensions, in the same statement (one round trip on PostgreSQL)
            if self._cmd_seen is None:  # at start: only what comes from now on
                self._cmd_seen = ops.last_engine_command(c)
                cmds: list[tuple[int, str, str]] = []
                susp = ops.suspensions(c, now)
            else:
                cmds, susp = ops.pass_reads(c, self._cmd_seen, now)
            envs: dict[str, ops.Envelope] = {}  # the claims' envelopes, read with them
            claims = ops.claim_due(
                c,
                now,
                cap,
                skip,
                waiting,
                expired_before,
                self.membership.node,
                now + self.membership.lease,
                envs,
            )
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
            return cmds, claims, envs, susp, stored, dests, grants

        # lazy: a claim lost in a power cut leaves its recipients due (no fsync of its own)
        try:
            claimed = await self.writer.run(claim, lazy=True)
            if claimed[1]:  # a claim committed whose answer is lost (see the rules)
                faults.hit("engine.claim")
        except Exception:
            # bounded: a database away for hours fails a pass every CLAIM_BACKOFF_MAX
            # seconds; such passes did not commit (no connection), only the last few can
            self._unconfirmed = [*self._unconfirmed[-(MAX_UNCONFIRMED - 1) :], now]
            raise
        self._unconfirmed = [t for t in self._unconfirmed if t not in unconfirmed]
        return claimed

    def _jobs(
        self,
        claims: Sequence[ops.Claim],
        dests: Sequence[tuple[str, Route | None]],
        envs: dict[str, ops.Envelope],
    ) -> list[Job]:
        """The claims as jobs: one per message and destination (one per recipient where
        the envelope sender or a header names the recipient)."""
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
        return list(jobs.values())

    def _dispatch(
        self,
        jobs: Sequence[Job],
        now: float,
        stored: dict[tuple[str, str], tuple[str, float] | None],
    ) -> list[ops.RcptUpdate]:
        """Each job to its destination's queue (relay/delivery/dispatch.py); the outcomes
        decided at once (suppressed, expired, no route), to be recorded by the pass."""
        immediate: list[ops.RcptUpdate] = []
        for job in jobs:
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
        return immediate

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
