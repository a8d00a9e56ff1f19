"""The spool's disk reserve (`spool.reserve`): free space that new mail may not take.

Rules:
- Below `reserve` free octets on the spool's filesystem (what an unprivileged process may
  use: `f_bavail`), new mail is answered `452 4.3.1` (RFC 3463: insufficient system
  storage; RFC 5321 §4.2.5: the client keeps it and retries) at MAIL and at the end of DATA,
  feedback and unsubscribe mail included. What is queued keeps being claimed and delivered:
  the reserve is what its claims, attempt rows and the health file write into.
- The daemon measures it in its health pass (every second: relay/ops/health.py's `disk`, which
  makes it the `disk` check, critical); an inbound process (`inbound.processes`) has no
  health pass and watches it with `ReserveGate`, the same rule at the same pace.
- 0 turns the reserve off (the `health.disk_free_critical` percentage still applies in the
  daemon).
- A filesystem that cannot be measured is not taken for a full one here (the daemon's disk
  check says critical and refuses then); the gate keeps its last verdict.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from relay.ops.logs import log_event

log = logging.getLogger(__name__)

REFUSAL = "452 4.3.1 Insufficient system storage; try again later"
EVERY = 1.0  # seconds between measurements


def free_bytes(path: Path) -> int:
    v = os.statvfs(path)
    return v.f_bavail * v.f_frsize


def low(free: int, reserve: int) -> bool:
    """Below the reserve (0: no reserve)."""
    return reserve > 0 and free < reserve


class ReserveGate:
    """`refusal()` for an InboundHandler's gate, kept current by `watch()`."""

    def __init__(self, where: Callable[[], tuple[Path, int]]) -> None:
        self.where = where  # (the spool folder, spool.reserve) of the config now
        self.low = False

    async def check(self) -> None:
        import asyncio  # the gate's alone: `relay status` reads `low` (relay/ops/health.py)

        path, reserve = self.where()
        try:
            free = await asyncio.to_thread(free_bytes, path)
        except OSError:
            return
        now_low = low(free, reserve)
        if now_low != self.low:
            log_event(
                log,
                logging.WARNING if now_low else logging.INFO,
                "disk_reserve",
                "free space below spool.reserve: new mail gets 452 4.3.1"
                if now_low
                else "free space above spool.reserve again: new mail is taken",
                free=free,
                reserve=reserve,
            )
        self.low = now_low

    def refusal(self) -> str | None:
        return REFUSAL if self.low else None

    async def watch(self) -> None:
        import asyncio

        while True:
            await self.check()
            await asyncio.sleep(EVERY)
