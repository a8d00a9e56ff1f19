"""Prometheus metrics (prometheus-client: the reference exposition format, no hand-rolled
text). One registry per daemon so tests can run several in one process.

Rules (the inbound processes' counters, `inbound.processes`):
- An inbound process keeps its own `Metrics`; once a second it sends the main process a
  `snapshot` of it (relay/inbound/processes.py, relay/inbound/supervisor.py). The main
  process keeps the last snapshot of each (`absorb`), and what it exposes (`collect`,
  `exposition`: /metrics, the console's per-minute series) is its own values plus theirs,
  sample by sample: counters and histograms add up, and so do gauges (connections open).
- When an inbound process exits, its counters and histograms stay in the totals (`retire`:
  its restart counts from zero again, the sum never goes down); its gauges go with it.
- `_created` samples (a counter's start time) are never added: the main process's own stay.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

# (family name, family type, sample name, labels as sorted pairs, value): one sample of a
# snapshot, as sent between processes (JSON: lists)
SnapshotRow = tuple[str, str, str, tuple[tuple[str, str], ...], float]

# The recipients counters by outcome: (name, help, labels). Each row of the outcome table
# (relay/delivery/outcomes.py) names the one it moves and its `reason` label; this module
# imports nothing of ours (it is below every room), so the table names these, not the
# other way round.
OUTCOME_COUNTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("relay_delivered_recipients", "Recipients delivered", ("destination",)),
    ("relay_deferred_recipients", "Recipients deferred", ("destination", "reason")),
    (
        "relay_bounced_recipients",
        "Recipients bounced (permanent address failure)",
        ("destination",),
    ),
    (
        "relay_failed_recipients",
        "Recipients failed (other permanent failure or expired)",
        ("destination",),
    ),
    ("relay_suppressed_recipients", "Recipients skipped because suppressed", ("destination",)),
)


_Key = tuple[str, str, tuple[tuple[str, str], ...]]  # family, sample name, labels
K = TypeVar("K", bound=Hashable)


class Remote(Generic[K]):
    """Other processes' counts (see the rules): the last snapshot of each process, and the
    sums of those that exited. One mechanism for the metrics and for InboundStats."""

    def __init__(self) -> None:
        self._last: dict[str, dict[K, float]] = {}
        self._gone: dict[K, float] = {}

    def absorb(self, source: str, values: dict[K, float]) -> None:
        """`source`'s latest snapshot, replacing its previous one."""
        self._last[source] = values

    def retire(self, source: str, keep: Callable[[K], bool] = lambda _k: True) -> None:
        """`source` exited: its values that `keep` says are counts stay in the sums."""
        for key, value in self._last.pop(source, {}).items():
            if keep(key):
                self._gone[key] = self._gone.get(key, 0.0) + value

    def totals(self) -> dict[K, float]:
        """Every process's values summed, key by key."""
        out = dict(self._gone)
        for snap in self._last.values():
            for key, value in snap.items():
                out[key] = out.get(key, 0.0) + value
        return out


class Metrics:
    def __init__(self) -> None:
        # other processes' samples (absorb, retire); the type of each sample's family
        self._remote: Remote[_Key] = Remote()
        self._kinds: dict[str, str] = {}
        r = self.registry = CollectorRegistry()
        self.accepted = Counter(
            "relay_accepted_messages", "Messages accepted and spooled", ["lane"], registry=r
        )
        self.feedback_events = Counter(
            "relay_feedback_events",
            "Bounces and complaints received after the 250 (webhooks, feedback mail)",
            ["provider", "type"],
            registry=r,
        )
        self.feedback_not_applied = Counter(
            "relay_feedback_not_applied",
            "Feedback that suppressed nothing: events not tied to our sending (unverified:"
            " an address alone), for no recipient of ours (unmatched), and feedback mail kept"
            " unread (unreadable, past_bound)",
            ["provider", "reason"],
            registry=r,
        )
        self.feedback_mail_truncated = Counter(
            "relay_feedback_mail_truncated",
            "Feedback mail stored truncated at feedback.mail_max_stored",
            registry=r,
        )
        self.feedback_mail_dropped = Counter(
            "relay_feedback_mail_dropped",
            "Stored feedback mail dropped, oldest first, to stay within feedback.mail_budget",
            registry=r,
        )
        self.mta_sts_failures = Counter(
            "relay_mta_sts_failures",
            "MTA-STS failures per policy domain: policy lookups/fetches that failed, MX hosts"
            " refused by an enforce policy, TLS that could not be verified",
            ["domain", "reason"],
            registry=r,
        )
        self.deduplicated = Counter(
            "relay_deduplicated_messages",
            "Resubmissions answered 250 and not queued again",
            registry=r,
        )
        self.message_id_reused = Counter(
            "relay_message_id_reused",
            "Messages queued although their Message-ID was seen within dedup.window: the"
            " content differed (a reused Message-ID, not a resubmission)",
            registry=r,
        )
        self.rejected = Counter(
            "relay_rejected", "Inbound commands refused", ["reason"], registry=r
        )
        self.outcomes: dict[str, Counter] = {
            name: Counter(name, doc, list(labels), registry=r)
            for name, doc, labels in OUTCOME_COUNTERS
        }
        self.delivered = self.outcomes["relay_delivered_recipients"]
        self.deferred = self.outcomes["relay_deferred_recipients"]
        self.bounced = self.outcomes["relay_bounced_recipients"]
        self.failed = self.outcomes["relay_failed_recipients"]
        self.suppressed = self.outcomes["relay_suppressed_recipients"]
        self.attempts = Counter(
            "relay_delivery_attempts",
            "Delivery attempts by outcome",
            ["destination", "outcome"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "relay_queue_recipients", "Recipients in the spool by state", ["state"], registry=r
        )
        self.oldest_age = Gauge(
            "relay_queue_oldest_age_seconds", "Age of the oldest unfinished message", registry=r
        )
        self.latency = Histogram(
            "relay_delivery_latency_seconds",
            "From accept to delivery",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400),
            registry=r,
        )
        self.effective_rate = Gauge(
            "relay_destination_effective_rate",
            "Current messages/s allowed (after adaptive slow-down; 0 = unlimited)",
            ["destination"],
            registry=r,
        )
        self.effective_connections = Gauge(
            "relay_destination_effective_connections",
            "Current connection limit",
            ["destination"],
            registry=r,
        )
        self.health_status = Gauge(
            "relay_health_status",
            "Health check status: 0 ok, 1 warning, 2 critical",
            ["check"],
            registry=r,
        )
        self.circuit_open = Gauge(
            "relay_destination_circuit_open",
            "1 when the circuit breaker is open or half-open",
            ["destination"],
            registry=r,
        )
        self.commit_latency = Histogram(
            "relay_spool_commit_seconds",
            "Spool group-commit latency (one fsync each)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.commit_batch = Histogram(
            "relay_spool_commit_batch_jobs",
            "Jobs per group commit",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.connections_open = Gauge(
            "relay_connections_open", "Inbound SMTP connections open now", registry=r
        )
        self.connections_refused = Counter(
            "relay_connections_refused",
            "Inbound connections refused with 421 4.7.0 (total, per_ip, auth_ban)",
            ["reason"],
            registry=r,
        )
        self.sessions_closed = Counter(
            "relay_sessions_closed",
            "Inbound sessions we closed with a 421 (max_errors,"
            " command_timeout, data_rate, auth_failures, 421)",
            ["reason"],
            registry=r,
        )
        self.auth_failures = Counter(
            "relay_auth_failures", "AUTH attempts with wrong credentials", registry=r
        )
        self.auth_bans = Counter(
            "relay_auth_bans", "Client IPs banned for AUTH failures", registry=r
        )
        # the HTTP listeners (admin, feedback): relay/ops/http.py
        self.http_connections_open = Gauge(
            "relay_http_connections_open",
            "HTTP connections open now, per listener",
            ["listener"],
            registry=r,
        )
        self.http_connections_refused = Counter(
            "relay_http_connections_refused",
            "HTTP connections refused with 503 (total, per_ip)",
            ["listener", "reason"],
            registry=r,
        )
        self.http_bad_requests = Counter(
            "relay_http_bad_requests",
            "HTTP requests refused before a route (malformed, ambiguous framing, too big,"
            " too slow)",
            ["listener"],
            registry=r,
        )

    # --- the inbound processes' values (see the rules) ---------------------------------

    def snapshot(self) -> list[SnapshotRow]:
        """This registry's samples that are not zero, `_created` left out."""
        rows: list[SnapshotRow] = []
        for fam in self.registry.collect():
            for smp in fam.samples:
                if smp.value and not smp.name.endswith("_created"):
                    labels = tuple(sorted(smp.labels.items()))
                    rows.append((fam.name, fam.type, smp.name, labels, float(smp.value)))
        return rows

    def absorb(self, source: str, rows: Sequence[Sequence[Any]]) -> None:
        """The latest snapshot of another process (`source`), replacing its previous one."""
        values: dict[_Key, float] = {}
        for fam, kind, name, labels, value in rows:
            key = (str(fam), str(name), tuple((str(k), str(v)) for k, v in labels))
            values[key] = float(value)
            self._kinds[key[0]] = str(kind)
        self._remote.absorb(source, values)

    def retire(self, source: str) -> None:
        """`source` exited: its counters and histograms stay in the totals, its gauges go."""
        self._remote.retire(source, lambda key: self._kinds.get(key[0]) != "gauge")

    def collect(self) -> Iterator[Metric]:
        """This registry's families with the other processes' samples added."""
        extra: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for (fam_name, name, labels), value in self._remote.totals().items():
            extra.setdefault(fam_name, {})[(name, labels)] = value
        for fam in self.registry.collect():
            add = extra.get(fam.name)
            if add:
                samples: list[Sample] = []
                for smp in fam.samples:
                    key = (smp.name, tuple(sorted(smp.labels.items())))
                    more = add.pop(key, 0.0)
                    samples.append(smp._replace(value=smp.value + more) if more else smp)
                samples += [
                    Sample(name, dict(labels), value) for (name, labels), value in add.items()
                ]
                fam.samples = samples
            yield fam

    def exposition(self) -> bytes:
        """The Prometheus text of `collect` (what /metrics serves)."""
        return bytes(generate_latest(_View(self)))

    def count_outcome(self, metric: str, destination: str, reason: str | None, n: int = 1) -> None:
        """One outcome's recipients counter (a row of relay/delivery/outcomes.py)."""
        c = self.outcomes[metric]
        (c.labels(destination) if reason is None else c.labels(destination, reason)).inc(n)


class _View:
    """What prometheus-client's `generate_latest` needs of a registry: `collect`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()
