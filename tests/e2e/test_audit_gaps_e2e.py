"""Tests an audit found missing (issue 26), against the daemon as a real subprocess: each
pins a line whose one-line break survived the suite before (tests/MUTANTS.md).

- a spool error during `POST /feedback/<provider>` answers 503 (the provider retries), and
  the retry is applied once; over the wire, so it holds whatever serves HTTP;
- failover: when every upstream of a route fails, each one's breaker counts it; a backup
  suspended by a shaping rule is skipped; jobs already queued on a primary whose circuit
  then opens go to the backup.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    RelayProcess,
    deep_merge,
    fast_config,
    free_port,
    make_message,
    send,
)

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
TOKEN = "generic-token-123"


def events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


# --- feedback: a spool error is 503, the retry is applied once ------------------------------


def _post(r: RelayProcess, doc: dict[str, Any]) -> tuple[int, bytes]:
    auth = base64.b64encode(f"generic:{TOKEN}".encode()).decode()
    c = http.client.HTTPConnection("127.0.0.1", r.admin_port, timeout=10)
    try:
        c.request(
            "POST",
            "/feedback/generic",
            body=json.dumps(doc).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Basic {auth}"},
        )
        resp = c.getresponse()
        return resp.status, resp.read()
    finally:
        c.close()


def test_a_spool_error_during_a_feedback_post_is_503_and_the_retry_is_applied_once(
    upstream, relay, tmp_path: Path
) -> None:
    up = upstream(ok_reply=lambda e: "250 2.0.0 Ok: queued as 4FAUDIT01")
    token = tmp_path / "generic.token"
    token.write_text(TOKEN + "\n")
    faults = tmp_path / "faults"
    faults.write_text("")
    r = relay(
        upstream=up,
        config=deep_merge(
            fast_config("2s"),
            {"feedback": {"providers": {"generic": {"token_file": str(token)}}}},
        ),
        env={"RELAY_FAULTS_FILE": str(faults)},
    )
    rcpt = "gone@example.org"
    assert send(r.port, SENDER, [rcpt], make_message(1)) == {}
    up.wait_for(1)
    r.wait_until(lambda: r.recipient_states() == {rcpt: "delivered"}, what="delivered")
    doc = {"type": "bounce", "recipient": rcpt, "upstream_id": "4FAUDIT01", "id": "evt-audit-1"}
    metric = 'relay_feedback_events_total{provider="generic",type="bounce"}'
    faults.write_text("spool.commit locked\n")  # every commit fails: "database is locked"
    # relay/ops/faults.py rereads the file at most every 50 ms: a POST sent sooner could still
    # commit (and then be a duplicate, not a 503, afterwards)
    time.sleep(0.3)
    r.wait_until(lambda: _post(r, doc)[0] == 503, timeout=10, what="503 while the spool fails")
    assert r.metric(metric) == 0
    faults.write_text("")  # the spool works again; the provider retries
    r.wait_until(lambda: _post(r, doc)[0] != 503, timeout=10, what="the spool back")
    assert r.metric(metric) == 1
    status, body = _post(r, doc)  # and again: the same event is not applied twice
    assert status == 200 and json.loads(body)["duplicates"] == 1, body
    assert r.metric(metric) == 1
    assert r.recipient_states() == {rcpt: "bounced"}
    entries = [e for e in r.cli_json("suppression", "list") if e["address"] == rcpt]
    assert len(entries) == 1


# --- failover -------------------------------------------------------------------------------


def plain(port: int) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": port, "tls": "none"}


def test_when_every_upstream_of_a_route_fails_each_breaker_counts_it(relay) -> None:
    r = relay(
        config=deep_merge(
            fast_config("2s"),
            {
                "upstreams": {"primary": plain(free_port()), "backup": plain(free_port())},
                "routes": [{"via": ["primary", "backup"]}],
                "destinations": {
                    "primary": {"circuit_failures": 1, "circuit_cooldown": "1h"},
                    "backup": {"circuit_failures": 1, "circuit_cooldown": "1h"},
                },
                "retry": {"schedule": ["1h"]},
            },
        )
    )
    assert send(r.port, SENDER, ["a@example.org"], make_message(1)) == {}
    r.wait_until(lambda: len(events(r, "circuit_open")) >= 2, timeout=15, what="both open")
    assert sorted(e["destination"] for e in events(r, "circuit_open")) == ["backup", "primary"]
    assert r.recipient_states() == {"a@example.org": "deferred"}


def test_a_backup_suspended_by_a_shaping_rule_is_skipped(upstream, relay) -> None:
    backup, third = upstream(), upstream()
    # Yahoo's [TS04]: the built-in rule suspends the upstream for 2 hours
    backup.rcpt_reply = lambda a: "451 4.7.0 [TS04] Messages from 192.0.2.1 temporarily deferred"
    r = relay(
        config=deep_merge(
            fast_config("2s"),
            {
                "upstreams": {
                    "primary": plain(free_port()),  # refuses: every message fails over
                    "backup": plain(backup.port),
                    "third": plain(third.port),
                },
                "routes": [{"via": ["primary", "backup", "third"]}],
            },
        )
    )
    assert send(r.port, SENDER, ["a@example.org"], make_message(1)) == {}
    r.wait_until(lambda: events(r, "destination_suspended"), timeout=15, what="suspended")
    assert events(r, "destination_suspended")[0]["destination"] == "backup"
    tried = backup.connections
    assert send(r.port, SENDER, ["b@example.org"], make_message(2)) == {}
    got = third.wait_for(2)  # the second, and the first again at its retry
    assert sorted(m.rcpt_tos[0] for m in got) == ["a@example.org", "b@example.org"]
    assert backup.connections == tried  # suspended: not even a connection
    skipped = [e for e in events(r, "failover") if "suspended" in e.get("msg", "")]
    assert any(e["destination"] == "backup" for e in skipped), events(r, "failover")


def test_jobs_queued_on_a_primary_whose_circuit_then_opens_go_to_the_backup(
    upstream, relay
) -> None:
    primary, backup = upstream(), upstream()
    # the primary takes the connection, holds MAIL, then refuses it: a failing upstream
    primary.stall = {"mail": 2.0}
    primary.mail_reply = lambda s: "421 4.3.0 primary.test not taking mail"
    r = relay(
        config=deep_merge(
            fast_config("5s"),
            {
                "upstreams": {"primary": plain(primary.port), "backup": plain(backup.port)},
                "routes": [{"via": ["primary", "backup"]}],
                "destinations": {
                    "primary": {
                        "max_connections": 1,
                        "circuit_failures": 1,
                        "circuit_cooldown": "1h",
                    }
                },
                "retry": {"schedule": ["1h"]},
            },
        )
    )
    assert send(r.port, SENDER, ["first@example.org"], make_message(1)) == {}
    r.wait_until(lambda: "MAIL" in " ".join(primary.commands).upper(), what="primary at MAIL")
    # queued behind the primary's one connection while its circuit is still closed
    for i in range(2, 5):
        assert send(r.port, SENDER, [f"m{i}@example.org"], make_message(i)) == {}
    got = backup.wait_for(3, timeout=20)
    assert sorted(m.rcpt_tos[0] for m in got) == [f"m{i}@example.org" for i in range(2, 5)]
    assert events(r, "circuit_open")[0]["destination"] == "primary"
    states = r.recipient_states()
    assert states["first@example.org"] == "deferred"  # its attempt was the primary's
    assert [states[f"m{i}@example.org"] for i in range(2, 5)] == ["delivered"] * 3
