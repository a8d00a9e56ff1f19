"""The breaker in the operator's hands: `destination reset` closes a circuit, clears the
slow-down and the config-error flag; a `kick` (after `queue flush`, `destination resume`)
makes an open circuit half-open at once so the next attempt is its trial. Each change is
logged by the destinations (relay/delivery/destinations.py `breaker_changed`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.delivery.jobs import DestState
from relay.ops.logs import log_event

if TYPE_CHECKING:
    from relay.delivery.destinations import Destinations

log = logging.getLogger("relay.delivery.engine")


def command(
    dests: Destinations,
    spawn_workers: Callable[[DestState], None],
    action: str,
    name: str,
    now: float,
) -> None:
    for st in list(dests.values()) if name == "*" else [dests.dest(name)]:
        before = st.breaker.state(now)
        if action == "reset":
            st.breaker.reset()
            st.adaptive.reset()
            st.config_error = None
            dests.retune(st)
            spawn_workers(st)
        elif action == "kick":
            st.breaker.kick(now)
        dests.breaker_changed(st, before, now, f"operator {action}")
        if action == "reset":
            log_event(
                log,
                logging.INFO,
                "destination_reset",
                "circuit closed and slow-down cleared by the operator",
                destination=st.name,
            )
