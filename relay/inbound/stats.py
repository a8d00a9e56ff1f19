"""The inbound counters: what `relay status` shows of the listeners, and the rejected
metric by reason. One object for every listener of a process (relay/daemon.py).

With inbound processes (`inbound.processes`), each keeps its own and sends them to the main
process once a second with its metrics (relay/ops/metrics.py's rules): `totals` is the
main process's own counts plus the last ones of each inbound process (`absorb`), and those
of exited ones (`retire`: a restarted process counts from zero, the totals never go down).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relay.ops.metrics import Remote

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
    remote: Remote[str] = field(default_factory=Remote)  # the other processes' counts

    # the accepted counter's child per lane, made once (`labels()` checks and looks it up:
    # 1.2 of its 1.7 us a message), with the Metrics it belongs to
    _accepted: dict[str, tuple[Metrics, Any]] = field(default_factory=dict, repr=False)

    def accept(self, lane: str) -> None:
        """A message queued on `lane`."""
        self.accepted += 1
        metrics = self.metrics
        if metrics is None:
            return
        hit = self._accepted.get(lane)
        if hit is None or hit[0] is not metrics:
            if len(self._accepted) >= 64:  # lanes are the config's few
                self._accepted.clear()
            hit = self._accepted[lane] = (metrics, metrics.accepted.labels(lane))
        hit[1].inc()

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def counts(self) -> dict[str, int]:
        """This process's own counts (what an inbound process sends)."""
        return {
            "accepted": self.accepted,
            "deduplicated": self.deduplicated,
            "rejected": self.rejected,
            "sessions": self.sessions,
        }

    def absorb(self, source: str, counts: dict[str, Any]) -> None:
        self.remote.absorb(source, {k: float(counts.get(k, 0)) for k in self.counts()})

    def retire(self, source: str) -> None:
        self.remote.retire(source)

    def totals(self) -> dict[str, int]:
        """Own counts plus every other process's (what `relay status` shows)."""
        remote = self.remote.totals()
        return {k: v + int(remote.get(k, 0)) for k, v in self.counts().items()}
