"""What the engine shows of its destinations (relay/delivery/destinations.py): their
health for the daemon's health model, and the runtime snapshot `relay stats` and
`relay destination list` read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from relay.delivery import shaping
from relay.spool import ops

if TYPE_CHECKING:
    from relay.delivery.destinations import Destinations
    from relay.delivery.jobs import DestState


def _reopens(st: DestState, now: float) -> str | None:
    """When an open circuit allows a trial again (ISO 8601 UTC); None unless open."""
    return ops.iso_utc(st.breaker.reopens_at(now)) if st.breaker.state(now) == "open" else None


@dataclass(frozen=True, slots=True)
class DestHealth:
    """One destination as the health model judges it (relay/ops/health.py `destination`)."""

    name: str
    circuit: str
    failures: int  # consecutive connection failures
    config_error: str | None
    reopen_at: str | None
    failing_for: float | None  # seconds since the first failure after the last success
    answered: bool  # answered at least once since the daemon started
    upstream: bool  # an upstream (smarthost, a route's); False: a recipient domain (MX)


def health(dests: Destinations) -> list[DestHealth]:
    now = dests.clock()
    out: list[DestHealth] = []
    for st in dests.values():
        b = st.breaker
        out.append(
            DestHealth(
                st.name,
                b.state(now),
                b.failures,
                st.config_error,
                _reopens(st, now),
                None if b.failing_since is None else max(0.0, now - b.failing_since),
                b.answered,
                st.upstream is not None,
            )
        )
    return out


def failing_since(dests: Destinations) -> dict[str, float]:
    """Each upstream failing since when (its first failure after its last answer): kept in
    the spool's `runtime` table so a restart does not reset the clock of the health
    model's `health.failing_after` (a single daemon; a fleet's nodes each start fresh)."""
    return {
        name: st.breaker.failing_since
        for name, st in dests.items()
        if st.upstream is not None and st.breaker.failing_since is not None
    }


def seed_failing_since(dests: Destinations, since: dict[str, Any]) -> None:
    """At start: the failing time of each upstream still configured, as the last run left
    it (an upstream that answered since has no entry)."""
    for name, at in since.items():
        if name in dests.config.routing.upstreams and isinstance(at, int | float):
            b = dests.dest(name).breaker
            if b.failing_since is None:
                b.failing_since = float(at)


@dataclass(frozen=True, slots=True)
class DestinationView:
    """One destination as `relay stats` and `relay destination list` show it."""

    effective_rate: float | None
    configured_rate: float | None
    effective_connections: int
    max_connections: int
    active_connections: int
    queued_in_memory: int
    circuit: str
    circuit_reopens_at: str | None  # open: when the cooldown ends and a trial is allowed
    suspended_until: str | None
    suspend_reason: str | None
    delivered_today: int
    daily_limit: int | None
    upstream: str | None  # host:port of an upstream; None for an MX destination
    config_error: str | None


@dataclass(frozen=True, slots=True)
class IdentityView:
    today: int
    limit: int | None
    warmup_limit: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The engine's runtime view, written to the spool's `runtime` table every 2 s."""

    destinations: dict[str, DestinationView]
    identities: dict[str, IdentityView]
    day: str
    inflight: int
    updated_at: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def snapshot(destinations: Destinations, inflight: int) -> Snapshot:
    now = destinations.clock()
    ledger = destinations.ledger
    dests = {}
    for name, st in destinations.items():
        up = st.upstream
        suspended = st.suspended_until > now
        dests[name] = DestinationView(
            effective_rate=st.adaptive.effective_rate() or None,
            configured_rate=st.conf.rate,
            effective_connections=st.adaptive.effective_connections(),
            max_connections=st.conf.max_connections,
            active_connections=len(st.workers),
            queued_in_memory=st.queued(),
            circuit=st.breaker.state(now),
            circuit_reopens_at=_reopens(st, now),
            suspended_until=ops.iso_utc(st.suspended_until) if suspended else None,
            suspend_reason=st.suspend_reason if suspended else None,
            delivered_today=ledger.today(f"dest:{name}"),
            daily_limit=st.conf.daily_limit,
            upstream=None if up is None else f"{up.host}:{up.port}",
            config_error=st.config_error,
        )
    idents = {}
    for key, ident in destinations.config.identities.items():
        warm = ledger.warmup_limit(ident, now)
        idents[key] = IdentityView(
            today=ledger.today(f"id:{key}"),
            limit=shaping.effective_daily_limit(ident.daily_limit, warm),
            warmup_limit=warm,
        )
    return Snapshot(dests, idents, ledger.day, inflight, ops.iso_utc(now))
