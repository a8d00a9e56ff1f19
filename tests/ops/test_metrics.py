"""relay/ops/metrics.py: another process's snapshot added to this one's samples (the
inbound processes' counters in the main process's /metrics), and kept when it exits."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from relay.inbound.stats import InboundStats
from relay.ops.metrics import Metrics


def values(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, as a Prometheus server would read it."""
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_snapshot_leaves_out_zeros_and_start_times() -> None:
    child = Metrics()
    child.accepted.labels("bulk").inc(2)
    rows = child.snapshot()
    names = {r[2] for r in rows}
    assert (
        "relay_accepted_messages",
        "counter",
        "relay_accepted_messages_total",
        (("lane", "bulk"),),
        2.0,
    ) in rows
    assert not any(n.endswith("_created") for n in names)
    assert all(r[4] for r in rows)  # no zero sample travels
    assert json.loads(json.dumps(rows))  # what the socket carries


def test_snapshots_add_to_own_samples_and_replace_their_previous_one() -> None:
    main, child = Metrics(), Metrics()
    main.accepted.labels("bulk").inc(1)
    child.accepted.labels("bulk").inc(2)
    child.accepted.labels("transactional").inc(5)  # a label set only the child has
    child.rejected.labels("bad_address").inc()
    child.connections_open.inc(3)
    main.absorb("inbound-0", json.loads(json.dumps(child.snapshot())))
    v = values(main)
    assert v[("relay_accepted_messages_total", (("lane", "bulk"),))] == 3
    assert v[("relay_accepted_messages_total", (("lane", "transactional"),))] == 5
    assert v[("relay_rejected_total", (("reason", "bad_address"),))] == 1
    assert v[("relay_connections_open", ())] == 3
    # the next snapshot replaces the last one (cumulative: never added twice)
    child.accepted.labels("bulk").inc(1)
    main.absorb("inbound-0", child.snapshot())
    assert values(main)[("relay_accepted_messages_total", (("lane", "bulk"),))] == 4
    # a second process adds its own
    other = Metrics()
    other.accepted.labels("bulk").inc(10)
    main.absorb("inbound-1", other.snapshot())
    assert values(main)[("relay_accepted_messages_total", (("lane", "bulk"),))] == 14
    # the registry itself is untouched: only what is exposed adds up
    assert main.accepted.labels("bulk")._value.get() == 1


def test_an_exited_process_keeps_its_counts_but_not_its_gauges() -> None:
    main, child = Metrics(), Metrics()
    child.accepted.labels("bulk").inc(2)
    child.connections_open.inc(4)
    main.absorb("inbound-0-100", child.snapshot())
    main.retire("inbound-0-100")
    v = values(main)
    assert v[("relay_accepted_messages_total", (("lane", "bulk"),))] == 2
    assert v[("relay_connections_open", ())] == 0
    # its successor counts from zero; the totals go on from where they were
    again = Metrics()
    again.accepted.labels("bulk").inc(1)
    main.absorb("inbound-0-101", again.snapshot())
    assert values(main)[("relay_accepted_messages_total", (("lane", "bulk"),))] == 3
    main.retire("inbound-0-101")
    main.retire("never-seen")  # nothing to keep: nothing changes
    assert values(main)[("relay_accepted_messages_total", (("lane", "bulk"),))] == 3


def test_histograms_add_bucket_by_bucket() -> None:
    main, child = Metrics(), Metrics()
    main.latency.observe(0.07)
    child.latency.observe(0.07)
    child.latency.observe(3)
    main.absorb("x", child.snapshot())
    v = values(main)
    bucket = "relay_delivery_latency_seconds_bucket"
    assert v[(bucket, (("le", "0.1"),))] == 2
    assert v[(bucket, (("le", "5.0"),))] == 3
    assert v[("relay_delivery_latency_seconds_count", ())] == 3


def test_inbound_stats_totals_add_other_processes_and_keep_exited_ones() -> None:
    main, child = InboundStats(), InboundStats()
    main.accepted = 1
    child.accepted, child.deduplicated, child.rejected, child.sessions = 4, 1, 2, 7
    main.absorb("inbound-0-1", json.loads(json.dumps(child.counts())))
    assert main.totals() == {"accepted": 5, "deduplicated": 1, "rejected": 2, "sessions": 7}
    main.retire("inbound-0-1")
    main.absorb("inbound-0-2", {"accepted": 1})
    assert main.totals() == {"accepted": 6, "deduplicated": 1, "rejected": 2, "sessions": 7}
    assert main.counts()["accepted"] == 1  # its own, as before


def test_inbound_stats_count_accepted_messages_by_lane_into_their_metrics() -> None:
    def by_lane(m: Metrics) -> dict[str, float]:
        return {
            s.labels["lane"]: s.value
            for fam in m.registry.collect()
            for s in fam.samples
            if s.name == "relay_accepted_messages_total"
        }

    first = Metrics()
    st = InboundStats(metrics=first)
    for lane in ("bulk", "transactional", "bulk"):
        st.accept(lane)
    assert st.accepted == 3
    assert by_lane(first) == {"bulk": 2.0, "transactional": 1.0}
    # new metrics (the children made once are theirs, not the old ones')
    st.metrics = second = Metrics()
    st.accept("bulk")
    assert by_lane(second) == {"bulk": 1.0} and by_lane(first)["bulk"] == 2.0
    st.metrics = None
    st.accept("bulk")
    assert st.accepted == 5
