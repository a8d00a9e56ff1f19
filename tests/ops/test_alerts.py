"""relay/ops/alerts.py: the alert outbox's coalescing on a real SQLite spool, a restart's retries,
the webhook signature, and the command sink (failures reported, a hanging command killed with
its children)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from pathlib import Path

import pytest

from relay.ops import alerts
from relay.spool import db

# --- the alert outbox ----------------------------------------------------------------------


@pytest.fixture
def conn(tmp_path: Path):
    c = db.connect(tmp_path)
    db.migrate(c)
    yield c
    c.close()


def dead(i: int, key: str = "example.org") -> alerts.Event:
    return alerts.Event(
        "dead_letter",
        "warning",
        key,
        f"bounced: 550 #{i}",
        alerts.sample(f"Q{i}", f"user{i}@{key}", f"550 5.1.1 #{i}"),
    )


def test_events_in_one_window_coalesce_into_one_alert(conn) -> None:
    for i in range(200):
        alerts.record(conn, dead(i), 100.0 + i * 0.1, 300.0, ["webhook"])
    alerts.record(conn, dead(0, "other.test"), 101.0, 300.0, ["webhook"])
    assert alerts.due(conn, 399.0) == []  # held until the window closes
    rows = alerts.due(conn, 400.0)
    assert [(r["key"], r["count"]) for r in rows] == [("example.org", 200)]
    r = rows[0]
    assert len(r["samples"]) == alerts.MAX_SAMPLES
    assert r["samples"][0] == {
        "queue_id": "Q0",
        "recipient": "u***@example.org",
        "reply": "550 5.1.1 #0",
    }
    assert r["first_at"] == 100.0 and r["last_at"] == pytest.approx(119.9)
    doc = alerts.document(r, "relay.test")
    assert doc["version"] == 1 and doc["count"] == 200
    assert doc["summary"].startswith("200 dead_letter events for example.org; latest:")
    assert doc["first_at"] == "1970-01-01T00:01:40Z"
    assert set(doc) >= {
        "event",
        "severity",
        "key",
        "count",
        "first_at",
        "last_at",
        "summary",
        "samples",
        "id",
    }
    # an event after the window opens a new alert
    alerts.record(conn, dead(999), 401.0, 300.0, ["webhook"])
    assert alerts.due(conn, 701.0)[-1]["count"] == 1


def test_state_changes_go_at_once_and_a_taken_alert_is_never_given_again(conn) -> None:
    ev = alerts.Event("health", "critical", "spool", "spool critical: gone")
    a = alerts.record(conn, ev, 10.0, 300.0, ["command", "webhook"])
    b = alerts.record(conn, ev, 11.0, 300.0, ["command", "webhook"])
    assert a != b  # transitions are never merged: each is news
    assert [r["id"] for r in alerts.due(conn, 11.0)] == [a, b]
    # the command took it, the webhook did not: only the webhook is retried
    alerts.mark(conn, a, ["webhook"], 12.0, "webhook: refused", 20.0)
    assert [r["id"] for r in alerts.due(conn, 19.0)] == [b]
    row = alerts.due(conn, 20.0)[0]
    assert row["id"] == a and row["sinks"] == ["webhook"] and row["attempts"] == 1
    alerts.mark(conn, a, [], 21.0, None, 0.0)
    assert [r["id"] for r in alerts.due(conn, 1e9)] == [b]
    # with no sink configured the log line is the alert: nothing to send
    c = alerts.record(conn, ev, 30.0, 300.0, [])
    assert c not in [r["id"] for r in alerts.due(conn, 1e9)]


def test_severity_is_the_worst_of_the_coalesced_events(conn) -> None:
    alerts.record(conn, alerts.Event("delayed", "warning", "k", "a"), 1.0, 10.0, ["command"])
    alerts.record(conn, alerts.Event("delayed", "critical", "k", "b"), 2.0, 10.0, ["command"])
    alerts.record(conn, alerts.Event("delayed", "warning", "k", "c"), 3.0, 10.0, ["command"])
    r = alerts.due(conn, 11.0)[0]
    assert r["severity"] == "critical" and r["count"] == 3 and r["summary"] == "c"


def test_signature_is_the_github_convention() -> None:
    body = b'{"event": "x"}'
    want = "sha256=" + hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert alerts.sign(b"k", body) == want


def test_run_command_reports_failures() -> None:
    doc = {"event": "x"}
    assert asyncio.run(alerts.run_command("cat >/dev/null", doc, 5.0)) is None
    err = asyncio.run(alerts.run_command("echo boom >&2; exit 3", doc, 5.0))
    assert err == "alert command exited 3: boom"
    err = asyncio.run(alerts.run_command("sleep 5", doc, 0.2))
    assert err is not None and "timed out" in err


def test_a_hanging_alert_command_is_killed_with_its_children(tmp_path: Path) -> None:
    import os

    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    err = asyncio.run(alerts.run_command(f"sleep 30 & echo $! > {pidfile}; wait", {}, 0.5))
    # alerts.timeout is the bound (0.5 s here; 10 s of margin for a loaded 2-core machine),
    # not the child's own 30 s
    assert time.monotonic() - t0 < 10.0
    assert err is not None and "timed out" in err
    child = int(pidfile.read_text())
    for _ in range(50):  # the orphan is reaped by init shortly after the kill
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the command's child {child} outlived the timeout")


def test_a_restart_retries_refused_alerts_at_once_but_keeps_open_windows(conn) -> None:
    refused = alerts.record(conn, dead(1), 10.0, 0.0, ["webhook"])
    alerts.mark(conn, refused, ["webhook"], 11.0, "webhook: refused", 71.0)  # backoff 60 s
    window = alerts.record(conn, dead(2, "other.test"), 12.0, 300.0, ["webhook"])
    assert alerts.retry_now(conn, 20.0) == 1
    assert [r["id"] for r in alerts.due(conn, 20.0)] == [refused]
    assert window not in [r["id"] for r in alerts.due(conn, 299.0)]
