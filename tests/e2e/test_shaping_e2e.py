"""Traffic shaping end to end: a real daemon subprocess relaying to a real upstream.

Covers the token bucket (rate/burst), daily ceilings per destination and per identity,
AIMD slow-down on a 421 storm, a reply-text shaping rule (Yahoo [TS04]) and operator
suspend/resume. Timing is the feature under test, so timings are asserted as lower bounds
(with tolerance); upper bounds are only generous "it did happen" limits.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from typing import Any

import pytest

from tests.harness import RelayProcess, make_message, smtp_session

pytestmark = pytest.mark.slow

# --- helpers ------------------------------------------------------------------------------


def submit(
    port: int,
    n: int,
    *,
    sender: str = "app@example.com",
    start: int = 0,
    subject: str | None = None,
) -> list[float]:
    """Queue `n` one-recipient messages over one SMTP session; returns accept times."""
    accepted = []
    with smtp_session(port) as s:
        for i in range(start, start + n):
            data = make_message(i, subject=subject and f"{subject} {i}")
            assert s.sendmail(sender, [f"user{i}@example.org"], data) == {}
            accepted.append(time.time())
    return accepted


def daemon_dest(r: RelayProcess, name: str = "smarthost") -> dict[str, Any] | None:
    d = r.cli_json("stats")["daemon"]
    if not d:
        return None
    dest: dict[str, Any] | None = d.get("destinations", {}).get(name)
    return dest


def recipients(r: RelayProcess) -> list[dict[str, Any]]:
    return [rc for m in r.queue() for rc in m["recipients"]]


def wait_all_delivered(r: RelayProcess, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    r.wait_until(
        lambda: sum(rc["state"] == "delivered" for rc in recipients(r)) == n,
        timeout=timeout,
        what=f"{n} recipients delivered",
    )
    rcs = recipients(r)
    assert len(rcs) == n
    assert {rc["state"] for rc in rcs} == {"delivered"}
    return rcs


def max_in_window(times: list[float], width: float) -> int:
    """The most arrivals in any half-open window [t, t + width) starting at an arrival."""
    ts = sorted(times)
    return max(bisect.bisect_left(ts, t + width) - i for i, t in enumerate(ts))


def wait_window_start(length: float, margin: float = 0.3) -> float:
    """Sleep until just after an epoch-aligned window of `length` seconds begins, so a
    test has (almost) the whole window; returns the end of that window."""
    now = time.time()
    start = math.floor(now / length) * length
    if now - start > margin:
        start += length
        time.sleep(start - now + 0.05)
    return start + length


def minute_z(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(ts))


# --- token bucket -------------------------------------------------------------------------


def test_rate_and_burst_pace_deliveries(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up, config={"destinations": {"*": {"rate": "5/s", "burst": 5}}})
    t0 = time.time()
    accepted = submit(r.port, 30)
    # the queue filled much faster than the rate allows, so the spread below is the bucket's
    assert accepted[-1] - t0 < 2.5, f"submission too slow to test pacing: {accepted[-1] - t0}"
    got = up.wait_for(30, timeout=30)
    times = sorted(m.at for m in got)
    span = times[-1] - times[0]
    # burst 5 go at once, the other 25 at 5/s: 5 s (minus a little scheduling slack)
    assert span >= 4.5, f"30 messages at 5/s burst 5 arrived within {span:.2f}s"
    busiest = max_in_window(times, 1.0)
    assert busiest <= 10, f"{busiest} arrivals in one second (burst 5 + rate 5/s)"
    rcs = wait_all_delivered(r, 30)
    # waiting for a token never burns an attempt
    assert [rc["attempts"] for rc in rcs] == [1] * 30
    assert sorted(up.recipients()) == sorted(f"user{i}@example.org" for i in range(30))
    assert r.stop() == 0


# --- daily ceilings -----------------------------------------------------------------------


def test_destination_daily_limit_defers_until_next_window(upstream, relay) -> None:
    up = upstream()
    r = relay(
        upstream=up,
        config={
            "destinations": {"*": {"daily_limit": 5}},
            "shaping": {"window_length": "6s"},
        },
    )
    window_end = wait_window_start(6.0)
    submit(r.port, 10)
    up.wait_for(5, timeout=4)

    def deferred() -> list[dict[str, Any]]:
        return [rc for rc in recipients(r) if rc["state"] == "deferred"]

    r.wait_until(lambda: len(deferred()) == 5, timeout=4, what="5 deferred by the ceiling")
    assert time.time() < window_end, "the test lost its window; timing assumptions broken"
    assert len(up.received) == 5
    want = re.compile(
        r"^daily limit 5 reached for smarthost; next window "
        + re.escape(minute_z(window_end))
        + "$"
    )
    for rc in deferred():
        assert want.match(rc["reason"] or ""), rc
        assert rc["attempts"] == 0, rc  # a ceiling burns no attempt
        assert rc["last_reply"] is None, rc
    # `relay queue show` prints the same reason for a waiting recipient
    waiting_id = next(
        m["id"] for m in r.queue() if any(rc["state"] == "deferred" for rc in m["recipients"])
    )
    shown = r.cli("queue", "show", waiting_id, check=True).stdout
    assert re.search(
        r"waiting: daily limit 5 reached for smarthost; next window "
        r"\d{4}-\d\d-\d\dT\d\d:\d\dZ",
        shown,
    ), shown
    # the daemon's live view counts today's deliveries against the ceiling
    r.wait_until(
        lambda: (daemon_dest(r) or {}).get("delivered_today") == 5,
        timeout=5,
        what="stats showing 5 delivered today",
    )
    dest = daemon_dest(r)
    assert dest is not None and dest["daily_limit"] == 5
    # the remaining five go in the next window, and not before it
    got = up.wait_for(10, timeout=15)
    late = sorted(m.at for m in got)[5:]
    assert min(late) >= window_end - 0.05, (min(late), window_end)
    rcs = wait_all_delivered(r, 10)
    assert sorted(rc["attempts"] for rc in rcs) == [1] * 10
    assert r.stop() == 0


def test_identity_daily_limit(upstream, relay) -> None:
    up = upstream()
    r = relay(
        upstream=up,
        config={
            "identities": {"example.com": {"daily_limit": 3}},
            "shaping": {"window_length": "6s"},
        },
    )
    window_end = wait_window_start(6.0)
    submit(r.port, 5, sender="app@example.com")
    submit(r.port, 2, sender="app@other.org", start=100)  # another identity: not limited
    up.wait_for(5, timeout=4)
    r.wait_until(
        lambda: sum(rc["state"] == "deferred" for rc in recipients(r)) == 2,
        timeout=4,
        what="2 deferred by the identity ceiling",
    )
    assert time.time() < window_end, "the test lost its window; timing assumptions broken"
    first = list(up.received)
    assert len(first) == 5
    assert sum(m.mail_from == "app@example.com" for m in first) == 3
    assert sum(m.mail_from == "app@other.org" for m in first) == 2
    want = re.compile(
        r"^daily limit 3 reached for example\.com; next window "
        + re.escape(minute_z(window_end))
        + "$"
    )
    for m in r.queue():
        for rc in m["recipients"]:
            if rc["state"] == "deferred":
                assert m["sender"] == "app@example.com"
                assert want.match(rc["reason"] or ""), rc
                assert rc["attempts"] == 0
    r.wait_until(
        lambda: (
            (r.cli_json("stats")["daemon"] or {}).get("identities", {}).get("example.com")
            == {"today": 3, "limit": 3, "warmup_limit": None}
        ),
        timeout=5,
        what="stats showing the identity at 3/3",
    )
    got = up.wait_for(7, timeout=15)
    late = [m for m in got if m.at >= window_end - 0.05]
    assert len(late) == 2 and {m.mail_from for m in late} == {"app@example.com"}
    wait_all_delivered(r, 7)
    assert r.stop() == 0


# --- adaptive slow-down and shaping rules -------------------------------------------------


def test_421_storm_halves_the_rate_then_everything_is_delivered(upstream, relay) -> None:
    up = upstream()
    storm = {"on": True}
    up.data_reply = lambda env: (
        "421 4.7.0 Try again later, closing connection" if storm["on"] else None
    )
    r = relay(upstream=up, config={"destinations": {"*": {"rate": "20/s"}}})
    submit(r.port, 20)
    r.wait_until(
        lambda: any(e.get("event") == "slowdown" for e in r.events()),
        timeout=10,
        what="a slowdown event",
    )
    ev = next(e for e in r.events() if e.get("event") == "slowdown")
    assert ev["destination"] == "smarthost"
    assert ev["rate"] <= 10.0
    r.wait_until(
        lambda: ((daemon_dest(r) or {}).get("effective_rate") or 99) <= 10.0,
        timeout=6,
        what="stats: effective_rate at most half of 20/s",
    )
    dest = daemon_dest(r)
    assert dest is not None and dest["configured_rate"] == 20.0
    assert dest["effective_connections"] <= 5  # connections shrink with the rate
    # the storm passes: every message still gets through (attempts were real failures)
    storm["on"] = False
    up.wait_for(20, timeout=30)
    rcs = wait_all_delivered(r, 20)
    assert any(rc["attempts"] >= 2 for rc in rcs)
    assert all(rc["last_reply"].startswith("250") for rc in rcs)
    # recovery waits out slowdown_cooldown (60 s by default): still slowed
    dest = daemon_dest(r)
    assert dest is not None and dest["effective_rate"] <= 10.0
    assert r.stop() == 0


def test_rate_recovers_after_the_slowdown_cooldown(upstream, relay) -> None:
    """Additive increase: after `slowdown_cooldown`, every 20 clean deliveries add 10% of
    the configured rate back."""
    up = upstream()
    storm = {"on": True}
    up.data_reply = lambda env: (
        "421 4.7.0 Try again later, closing connection" if storm["on"] else None
    )
    r = relay(
        upstream=up,
        config={"destinations": {"*": {"rate": "40/s", "slowdown_cooldown": "1s"}}},
    )
    submit(r.port, 5)
    r.wait_until(
        lambda: ((daemon_dest(r) or {}).get("effective_rate") or 99) <= 20.0,
        timeout=10,
        what="slowed down to at most half of 40/s",
    )
    slowed = (daemon_dest(r) or {})["effective_rate"]
    storm["on"] = False
    time.sleep(1.2)  # the cooldown passes
    submit(r.port, 120, start=5)
    up.wait_for(125, timeout=60)
    r.wait_until(
        lambda: ((daemon_dest(r) or {}).get("effective_rate") or 0) > slowed,
        timeout=10,
        what="effective rate climbing back after clean deliveries",
    )
    assert r.stop() == 0


def test_ts04_rule_suspends_the_destination(upstream, relay) -> None:
    up = upstream()
    yahoo = {"on": True}
    up.rcpt_reply = lambda a: (
        "421 4.7.0 [TS04] Messages from 127.0.0.1 temporarily deferred"
        " due to unexpected volume or user complaints - 4.16.55.1;"
        " see https://postmaster.yahooinc.com/error-codes"
        if yahoo["on"]
        else None
    )
    r = relay(
        upstream=up,
        config={
            "shaping": {"rules": [{"match": "\\[TS04\\]", "action": "suspend", "for": "8s"}]},
        },
    )
    submit(r.port, 1)
    r.wait_until(
        lambda: any(e.get("event") == "destination_suspended" for e in r.events()),
        timeout=10,
        what="destination_suspended event",
    )
    suspended_at = time.time()
    yahoo["on"] = False  # the upstream would accept now; the relay must still hold off
    submit(r.port, 3, start=1)

    def held() -> list[dict[str, Any]]:
        return [
            rc
            for rc in recipients(r)
            if rc["state"] == "deferred"
            and re.search(
                r"destination smarthost suspended until "
                r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(rule: .*TS04",
                rc["reason"] or "",
            )
        ]

    r.wait_until(lambda: len(held()) >= 3, timeout=5, what="new mail held by the suspension")
    for rc in held():
        if rc["address"] != "user0@example.org":
            assert rc["attempts"] == 0, rc  # waiting out a suspension burns no attempt
    r.wait_until(
        lambda: (daemon_dest(r) or {}).get("suspended_until") is not None,
        timeout=5,
        what="stats: suspended_until",
    )
    dest = daemon_dest(r)
    assert dest is not None and "TS04" in (dest["suspend_reason"] or "")
    assert up.received == []
    got = up.wait_for(4, timeout=30)
    # not before the rule's 8 s (less the second or so it took to see the event)
    assert min(m.at for m in got) >= suspended_at + 6.0
    wait_all_delivered(r, 4)
    assert r.stop() == 0


# --- operator controls --------------------------------------------------------------------


def test_operator_suspend_and_resume(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    out = r.cli_json("destination", "suspend", "smarthost", "--for", "1h")
    assert out["action"] == "suspend" and out["name"] == "smarthost"
    time.sleep(2.0)  # the contract: a CLI change reaches the daemon within 2 s
    submit(r.port, 2)
    r.wait_until(
        lambda: [rc["state"] for rc in recipients(r)] == ["deferred", "deferred"],
        timeout=5,
        what="both recipients deferred",
    )
    for rc in recipients(r):
        assert re.search(
            r"destination smarthost suspended until \S+Z \(operator: "
            r"suspended by operator\)",
            rc["reason"] or "",
        ), rc
        assert rc["attempts"] == 0
    listed = {d["name"]: d for d in r.cli_json("destination", "list")}
    assert listed["smarthost"]["suspended_until"] is not None
    # smarthost mode: every recipient counts against the one destination
    assert set(listed) == {"smarthost"}
    assert listed["smarthost"]["queued_recipients"] == 2
    time.sleep(1.0)
    assert up.received == []
    resumed_at = time.time()
    res = r.cli_json("destination", "resume", "smarthost")
    assert res["recipients_due_now"] == 2
    listed = {d["name"]: d for d in r.cli_json("destination", "list")}
    assert listed["smarthost"]["suspended_until"] is None  # at once, not at the next snapshot
    got = up.wait_for(2, timeout=10)
    assert max(m.at for m in got) - resumed_at < 5.0
    wait_all_delivered(r, 2)
    assert r.stop() == 0


def test_bad_shaping_rule_is_a_config_error(relay) -> None:
    r = relay(
        config={
            "shaping": {
                "rules": [
                    {"match": "x", "action": "suspend", "for": "2h"},
                    {"match": "y", "action": "suspend", "for": "5x"},
                ]
            }
        },
        start=False,
    )
    res = r.cli("check-config")
    assert res.returncode == 78
    assert "shaping.rules[1].for: '5x' is not a duration" in res.stderr
    r.config["shaping"]["rules"][1] = {"match": "y", "action": "pause"}
    r.write_config()
    res = r.cli("check-config")
    assert res.returncode == 78 and "shaping.rules[1]: 'action' must be" in res.stderr
    r.start(wait=False)
    assert r.proc is not None and r.proc.wait(20) == 78  # a config error, not a crash
