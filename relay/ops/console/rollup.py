"""The console's per-minute series: what the daemon's counters did each minute, kept in the
spool (`console_minutes`) so a chart of the last day reads at most 1,440 small rows instead
of the attempt log.

Rules:
- Once a minute the daemon takes a `Sample` of counters it already keeps (relay/ops/metrics.py:
  accepted, delivered, deferred, bounced, suppressed, and the delivery latency histogram's
  buckets); the row of that minute is the difference from the previous sample (`delta`,
  pure), plus the queue depth then. A counter that went down (a restart) counts from zero.
- Rows add up on conflict (a fleet on PostgreSQL: every node adds its own counts to the
  same minute); the queue depth and the percentiles are the last writer's.
- Rows older than KEEP_MINUTES (8 days) are pruned by the same job: the table is bounded.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relay.ops.metrics import Metrics

KEEP_MINUTES = 8 * 24 * 60
SERIES = ("accepted", "delivered", "deferred", "bounced", "suppressed")
_COUNTERS = {
    "accepted": "relay_accepted_messages",
    "delivered": "relay_delivered_recipients",
    "deferred": "relay_deferred_recipients",
    "bounced": "relay_bounced_recipients",
    "suppressed": "relay_suppressed_recipients",
}
_LATENCY = "relay_delivery_latency_seconds"


@dataclass(frozen=True, slots=True)
class Sample:
    counts: Mapping[str, float]
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), sorted


@dataclass(frozen=True, slots=True)
class Minute:
    minute: int
    counts: Mapping[str, int]
    queue_depth: int
    p50: float | None
    p90: float | None
    p99: float | None


def sample(metrics: Metrics) -> Sample:
    """The counters now (summed over their labels) and the latency buckets."""
    counts = dict.fromkeys(SERIES, 0.0)
    names = {v: k for k, v in _COUNTERS.items()}
    buckets: dict[float, float] = {}
    for fam in metrics.collect():  # with the inbound processes' counts
        key = names.get(fam.name)
        for s in fam.samples:
            if key is not None and s.name.endswith("_total"):
                counts[key] += s.value
            elif fam.name == _LATENCY and s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return Sample(counts, tuple(sorted(buckets.items())))


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear within its bucket (as Prometheus's
    histogram_quantile); None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le  # past the last finite bound: the bound is what we know
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def delta(prev: Sample | None, cur: Sample, minute: int, queue_depth: int) -> Minute:
    """The minute's row: what the counters did since `prev` (None: since zero)."""

    def diff(a: float, b: float | None) -> float:
        return a if b is None or a < b else a - b  # a counter that went down restarted

    counts = {
        k: round(diff(cur.counts.get(k, 0.0), None if prev is None else prev.counts.get(k, 0.0)))
        for k in SERIES
    }
    before = dict(prev.buckets) if prev is not None else {}
    reset = any(n < before.get(le, 0.0) for le, n in cur.buckets)
    buckets = [(le, n if reset else n - before.get(le, 0.0)) for le, n in cur.buckets]
    return Minute(
        minute,
        counts,
        queue_depth,
        quantile(buckets, 0.5),
        quantile(buckets, 0.9),
        quantile(buckets, 0.99),
    )


def write_minute(conn: sqlite3.Connection, m: Minute) -> None:
    """Add the minute's counts to its row (made if absent) and prune old rows."""
    conn.execute(
        "INSERT INTO console_minutes (minute, accepted, delivered, deferred, bounced,"
        " suppressed, queue_depth, p50, p90, p99) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (minute) DO UPDATE SET"
        " accepted = console_minutes.accepted + excluded.accepted,"
        " delivered = console_minutes.delivered + excluded.delivered,"
        " deferred = console_minutes.deferred + excluded.deferred,"
        " bounced = console_minutes.bounced + excluded.bounced,"
        " suppressed = console_minutes.suppressed + excluded.suppressed,"
        " queue_depth = excluded.queue_depth,"
        " p50 = coalesce(excluded.p50, console_minutes.p50),"
        " p90 = coalesce(excluded.p90, console_minutes.p90),"
        " p99 = coalesce(excluded.p99, console_minutes.p99)",
        (
            m.minute,
            *(m.counts.get(k, 0) for k in SERIES),
            m.queue_depth,
            m.p50,
            m.p90,
            m.p99,
        ),
    )
    conn.execute("DELETE FROM console_minutes WHERE minute < ?", (m.minute - KEEP_MINUTES,))


def as_row(m: Minute) -> dict[str, Any]:
    """A minute as `read_series` gives it (the console's current, unwritten minute)."""
    return {
        "minute": m.minute,
        **m.counts,
        "queue_depth": m.queue_depth,
        "p50": m.p50,
        "p90": m.p90,
        "p99": m.p99,
    }


def read_series(conn: sqlite3.Connection, since_minute: int) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT minute, accepted, delivered, deferred, bounced, suppressed, queue_depth,"
        " p50, p90, p99 FROM console_minutes WHERE minute >= ? ORDER BY minute",
        (since_minute,),
    ).fetchall()
    keys = ("minute", *SERIES, "queue_depth", "p50", "p90", "p99")
    return [dict(zip(keys, r, strict=True)) for r in rows]
