"""The admin endpoint of a live daemon: `GET /metrics` in the Prometheus text format (parsed
with prometheus_client's own parser), `GET /healthz`, and everything else refused."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import RelayProcess, make_message, send

pytestmark = pytest.mark.slow

N = 5


def get(r: RelayProcess, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", r.admin_port, timeout=10)
    try:
        c.request(method, path)
        resp = c.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        c.close()


def scrape(r: RelayProcess) -> dict[str, Any]:
    status, headers, body = get(r, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def total(families: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    """Sum of a family's samples (named `sample`, default: the family's own counter/gauge
    sample), optionally filtered by labels; 0 when the family has no samples yet."""
    f = families.get(family)
    if f is None:
        return 0.0
    want = sample or (family + "_total" if f.type == "counter" else family)
    return sum(
        s.value
        for s in f.samples
        if s.name == want and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_move_with_traffic(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    before = scrape(r)
    for fam in (
        "relay_accepted_messages",
        "relay_delivered_recipients",
        "relay_queue_recipients",
        "relay_spool_commit_seconds",
    ):
        assert fam in before, sorted(before)
    assert before["relay_accepted_messages"].type == "counter"
    assert before["relay_queue_recipients"].type == "gauge"
    assert before["relay_spool_commit_seconds"].type == "histogram"
    acc0 = total(before, "relay_accepted_messages")
    del0 = total(before, "relay_delivered_recipients")
    commits0 = total(before, "relay_spool_commit_seconds", "relay_spool_commit_seconds_count")

    for i in range(N):
        assert send(r.port, "app@example.com", [f"m{i}@example.org"], make_message(i)) == {}
    up.wait_for(N)
    r.wait_until(
        lambda: total(scrape(r), "relay_delivered_recipients") - del0 == N,
        timeout=15,
        what="the delivered counter",
    )
    after = scrape(r)
    assert total(after, "relay_accepted_messages") - acc0 == N
    assert total(after, "relay_delivered_recipients", destination="smarthost") - del0 == N
    # queue depth by state, from the spool
    r.wait_until(
        lambda: total(scrape(r), "relay_queue_recipients", state="delivered") == N,
        timeout=15,
        what="the queue gauge",
    )
    depth = scrape(r)
    assert total(depth, "relay_queue_recipients", state="pending") == 0
    assert total(depth, "relay_queue_recipients", state="sending") == 0
    # every accept and every delivery record is a group commit
    commits = total(after, "relay_spool_commit_seconds", "relay_spool_commit_seconds_count")
    assert commits - commits0 >= N
    buckets = [
        s
        for s in after["relay_spool_commit_seconds"].samples
        if s.name == "relay_spool_commit_seconds_bucket"
    ]
    assert buckets and buckets[-1].labels["le"] == "+Inf"
    assert buckets[-1].value == commits
    lat = total(after, "relay_delivery_latency_seconds", "relay_delivery_latency_seconds_count")
    assert lat == N


def test_deferrals_show_in_metrics(upstream, relay) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.3.0 try again later"
    r = relay(
        upstream=up, config={"retry": {"schedule": ["1h"], "min_delay": "10m", "max_age": "5d"}}
    )
    assert send(r.port, "app@example.com", ["d@example.org"], make_message(1)) == {}
    r.wait_until(
        lambda: total(scrape(r), "relay_deferred_recipients") == 1,
        timeout=15,
        what="the deferred counter",
    )
    fams = scrape(r)
    assert total(fams, "relay_queue_recipients", state="deferred") == 1
    assert total(fams, "relay_delivered_recipients") == 0
    assert total(fams, "relay_queue_oldest_age_seconds") > 0


def test_healthz_and_unknown_paths(upstream, relay) -> None:
    r = relay(upstream=upstream())
    status, headers, body = get(r, "/healthz")
    assert status == 200
    assert headers["content-type"] == "application/json"
    doc = json.loads(body)
    assert doc["status"] == "ok" and doc["problems"] == []
    assert get(r, "/nope")[0] == 404
    assert get(r, "/metrics/extra")[0] == 404
    assert get(r, "/metrics", method="POST")[0] == 405
    status, _h, body = get(r, "/healthz", method="HEAD")
    assert status == 200 and body == b""
    # the endpoint survives all that
    assert get(r, "/healthz")[0] == 200
