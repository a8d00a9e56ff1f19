"""The destinations part of the engine: owns every destination's state (token bucket,
connection limit, adaptive slow-down, circuit breaker, suspension, in-memory queues) and
the daily ledger of the ceilings; nothing else creates or retunes a `DestState`.

Rules:
- A destination is created on first use from its config (`Config.destination`); a reload
  updates the settings of every one that exists, keeping its runtime state.
- In a fleet each live node sends its share of a destination's rate (`set_share`).
- Every change of a circuit is a log line (circuit_open / circuit_half_open /
  circuit_closed) and the `circuit_open` gauge.
- What waits (circuit open) and what is full (queues at their cap) are read here for the
  claim pass, so that the spool keeps what the engine cannot take now.
"""

from __future__ import annotations

import logging
import math
import zoneinfo
from collections.abc import Callable, Iterator, Mapping

from relay.config.tree import Config
from relay.delivery import shaping
from relay.delivery.jobs import DestState
from relay.delivery.lanes import LANE_PRIORITY
from relay.delivery.ledger import Ledger
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import ops

log = logging.getLogger("relay.delivery.engine")


class Destinations(Mapping[str, DestState]):
    """Every destination by name (a read-only mapping), with the ledger of the ceilings."""

    def __init__(self, config: Config, *, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.clock = clock
        self._states: dict[str, DestState] = {}
        self.share = 1  # live nodes sharing each rate (1: a single engine)
        tz = zoneinfo.ZoneInfo(config.shaping.window_tz)
        self.ledger = Ledger(tz, config.shaping.window_length)
        self.apply_config(config, tz)

    # --- the mapping --------------------------------------------------------------------

    def __getitem__(self, name: str) -> DestState:
        return self._states[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    # --- configuration ------------------------------------------------------------------

    def apply_config(self, config: Config, tz: zoneinfo.ZoneInfo) -> None:
        """The new settings for every destination (`tz`: the checked window time zone)."""
        rules = [*config.shaping.rules, *shaping.DEFAULT_RULES]
        self.config = config
        # the counts and reservations of the window carry over a reload
        self.ledger.tz, self.ledger.window_length = tz, config.shaping.window_length
        self.rules = rules
        for name, st in self._states.items():
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

    def dest(self, name: str) -> DestState:
        st = self._states.get(name)
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
            self._states[name] = st
            if self.share > 1:
                self.retune(st)
        return st

    def set_share(self, live: int) -> None:
        """How many live nodes share each destination's rate (the fleet's heartbeat)."""
        if live != self.share:
            self.share = live
            for st in self._states.values():
                self.retune(st)

    def retune(self, st: DestState) -> None:
        rate = st.adaptive.effective_rate()
        burst = st.conf.burst
        if rate and self.share > 1:  # each live node sends its share of the rate
            rate = rate / self.share
            burst = max(1, math.ceil(burst / self.share))
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

    # --- suspensions ----------------------------------------------------------------------

    def apply_suspensions(self, susp: dict[str, tuple[float, str]]) -> None:
        """The operator's suspensions as the spool holds them now (read with each claim)."""
        for name, (until, reason) in susp.items():
            st = self.dest(name)
            if until > st.suspended_until or st.suspend_reason.startswith("operator"):
                st.suspended_until, st.suspend_reason = until, f"operator: {reason}"
        for st in self._states.values():
            if st.suspend_reason.startswith("operator") and st.name not in susp:
                st.suspended_until, st.suspend_reason = 0.0, ""

    # --- what the claim pass leaves in the spool ------------------------------------------

    def first_open(self, via: tuple[str, ...], now: float) -> str:
        """The first upstream of a route that is not waiting (circuit, suspension); the
        first one when all are (the job then waits on it)."""
        for name in via:
            st = self.dest(name)
            if st.suspended_until <= now and st.breaker.state(now) != "open":
                return name
        return via[0]

    def queue_cap(self, st: DestState) -> int:
        """How many jobs of one lane a destination may hold in memory: enough to keep its
        connections busy, and about two seconds of its rate."""
        rate = st.adaptive.effective_rate()
        return max(4, 2 * st.adaptive.effective_connections(), math.ceil((rate or 0) * 2))

    def waiting(self, now: float) -> list[tuple[int, str | None]]:
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
                for st in self._states.values()
                if st.upstream is None and waits(st)
                for p in prios
            ]
        if any(r.mx for r in routes):
            return []
        names = {n for r in routes for n in r.via}
        if names and all(waits(self.dest(n)) for n in names):
            return [(p, None) for p in prios]
        return []

    def full_queues(self) -> list[tuple[int, str | None]]:
        skip: list[tuple[int, str | None]] = []
        for st in self._states.values():
            cap = self.queue_cap(st)
            for lane, q in st.queues.items():
                if len(q) >= cap:  # an upstream takes every domain: skip the whole lane
                    domain = None if st.upstream is not None else st.name
                    skip.append((LANE_PRIORITY.get(lane, 0), domain))
        return skip

    # --- the circuit in the log -----------------------------------------------------------

    def breaker_changed(self, st: DestState, before: str, now: float, why: str) -> None:
        """A log line for every change of a destination's circuit."""
        after = st.breaker.state(now)
        self.metrics.circuit_open.labels(st.name).set(0 if after == "closed" else 1)
        if after == before:
            return
        if after == "open":
            until = st.breaker.reopens_at(now)
            log_event(
                log,
                logging.WARNING,
                "circuit_open",
                "destination failing: no new connections until the cooldown ends",
                destination=st.name,
                reason=why,
                failures=st.breaker.failures,
                retry_at=ops.iso_utc(until),
            )
        elif after == "closed":
            log_event(
                log,
                logging.INFO,
                "circuit_closed",
                "destination working again",
                destination=st.name,
                reason=why,
            )
        else:
            log_event(
                log,
                logging.INFO,
                "circuit_half_open",
                "cooldown over: one trial connection allowed",
                destination=st.name,
                reason=why,
            )
