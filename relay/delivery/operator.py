"""The breaker in the operator's hands, and in the log: every change of a circuit is a
line (circuit_open at WARNING with the reason and the retry time, circuit_half_open,
circuit_closed); `destination reset` closes a circuit, clears the slow-down and the
config-error flag; a `kick` (after `queue flush`, `destination resume`) makes an open
circuit half-open at once so the next attempt is its trial."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from relay.delivery.jobs import DestState
from relay.ops.logs import log_event
from relay.spool import ops

if TYPE_CHECKING:
    from relay.delivery.engine import Engine

log = logging.getLogger("relay.delivery.engine")


def command(e: Engine, action: str, name: str, now: float) -> None:
    for st in list(e.dests.values()) if name == "*" else [e.dest(name)]:
        before = st.breaker.state(now)
        if action == "reset":
            st.breaker.reset()
            st.adaptive.reset()
            st.config_error = None
            e.retune(st)
            e.spawn_workers(st)
        elif action == "kick":
            st.breaker.kick(now)
        breaker_changed(e, st, before, now, f"operator {action}")
        if action == "reset":
            log_event(
                log,
                logging.INFO,
                "destination_reset",
                "circuit closed and slow-down cleared by the operator",
                destination=st.name,
            )


def breaker_changed(e: Engine, st: DestState, before: str, now: float, why: str) -> None:
    """A log line for every change of a destination's circuit."""
    after = st.breaker.state(now)
    e.metrics.circuit_open.labels(st.name).set(0 if after == "closed" else 1)
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
