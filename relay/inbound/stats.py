"""The inbound counters: what `relay status` shows of the listeners, and the rejected
metric by reason. One object for every listener of a process (relay/daemon.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.ops.metrics import Metrics


@dataclass(slots=True)
class InboundStats:
    accepted: int = 0
    deduplicated: int = 0
    rejected: int = 0
    sessions: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    metrics: Metrics | None = None

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()
