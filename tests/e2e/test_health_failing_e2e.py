"""A dead smarthost is a WARNING within seconds, end to end (issue 26 item 5): a real daemon
whose smarthost port refuses connections, `health.failing_after` short; `relay status`
exits 1 naming the destination while nothing is due, an alert is raised, and an aiosmtpd
upstream started on that port brings it back to OK after the first success. A restart
in between keeps the failing time (the spool's runtime row)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import Upstream, free_port, make_message, send

pytestmark = pytest.mark.slow


def _status(r: Any) -> tuple[int, str]:
    res = r.cli("status")
    return res.returncode, res.stdout


def test_a_refusing_smarthost_warns_within_seconds_and_clears_after_a_success(relay) -> None:
    up = Upstream(port=free_port())  # nothing listens there yet: connections are refused
    r = relay(
        upstream=up,
        config={
            # after the first failure nothing is due for an hour: the warning must not
            # depend on due mail (health.stall_after sees only that)
            "retry": {"schedule": ["1h"], "max_age": "5h", "min_delay": "0.2s"},
            "health": {"failing_after": "4s"},
        },
    )
    try:
        assert _status(r)[0] == 0  # nothing tried yet: ok
        assert send(r.port, "app@example.com", ["user@example.org"], make_message(1)) == {}
        r.wait_until(lambda: _status(r)[0] == 1, timeout=15, what="the start-up warning")
        _code, out = _status(r)
        assert out.startswith("WARNING: destination:smarthost: smarthost: "), out
        # nothing is due, and still, after failing_after, the duration is what it says
        r.wait_until(
            lambda: "every attempt has failed for" in _status(r)[1],
            timeout=15,
            what="the failing_after warning",
        )
        assert _status(r)[0] == 1
        assert r.recipient_states() == {"user@example.org": "deferred"}
        changed = [
            e
            for e in r.events()
            if e.get("event") == "health_changed" and e.get("check") == "destination:smarthost"
        ]
        assert changed and changed[0]["level"] == "warning", changed
        # the first warning came before failing_after: the smarthost never answered
        assert "has not answered since start" in changed[0]["detail"], changed
        # the transition raised an alert (the outbox holds it; no sink is configured here)
        raised = r.cli_json("alerts")
        assert any(
            a["key"] == "destination:smarthost" and a["severity"] == "warning" for a in raised
        ), raised
        # a restart does not reset the clock: with nothing due (no new attempt), the
        # warning is there again at the first health pass
        r.restart()
        r.wait_until(
            lambda: "every attempt has failed for" in _status(r)[1],
            timeout=10,
            what="the warning after a restart",
        )
        # the upstream comes up on that port; an attempt now (flush) succeeds
        up.start()
        try:
            r.cli("queue", "flush", check=True)
            up.wait_for(1)
            r.wait_until(lambda: _status(r)[0] == 0, timeout=15, what="OK after the success")
            assert _status(r)[1].startswith("OK: all checks ok"), _status(r)[1]
        finally:
            up.stop()
    finally:
        r.stop()
