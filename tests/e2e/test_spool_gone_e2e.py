"""A spool database deleted under the running daemon (issue 27 item 7): the daemon keeps
the old file open and keeps delivering from it, so the advice is to drain first, never
"restart relay" while mail is still queued in it (a restart would discard that mail)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relay.ops.monitor import HEALTH_FILE, spool_gone_advice
from relay.spool import db
from tests.harness import RelayProcess, Upstream, make_message, send

P = Path("/var/spool/relay/spool.db")


@pytest.mark.parametrize(
    ("how", "waiting", "held", "says", "never"),
    [
        ("deleted", 3, 0, ["was deleted", "3 recipients are still queued", "Do not restart"], []),
        ("replaced", 3, 0, ["was replaced", "3 recipients are still queued", "then restart"], []),
        ("deleted", 5, 2, ["5 recipients", "2 of them held", "a restart discards them"], []),
        ("deleted", -1, -1, ["an unknown number of recipients", "Do not restart"], ["held"]),
        (
            "deleted",
            0,
            0,
            ["every recipient in the old file is finished", "restart relay now"],
            ["Do not restart"],
        ),
    ],
)
def test_the_advice_says_drain_before_restart(
    how: str, waiting: int, held: int, says: list[str], never: list[str]
) -> None:
    text = spool_gone_advice(P, how, waiting, held)
    assert str(P) in text and "451 4.3.0" in text
    for s in says:
        assert s in text
    for s in never:
        assert s not in text
    if waiting:
        assert "relay status" in text  # how to see the drain


def _spool_detail(r: RelayProcess) -> str:
    doc: dict[str, Any] = json.loads((r.spool / HEALTH_FILE).read_text())
    return "".join(str(c["detail"]) for c in doc["checks"] if c["name"] == "spool")


@pytest.mark.slow
def test_a_deleted_spool_is_drained_then_restart_is_advised(
    upstream: Callable[..., Upstream], relay: Callable[..., RelayProcess]
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.3.0 try later"
    r = relay(upstream=up, config={"retry": {"schedule": ["1s"]}})
    for i in range(2):
        assert send(r.port, "app@example.com", [f"u{i}@example.org"], make_message(i)) == {}
    r.wait_until(lambda: len(r.queue()) == 2, what="two queued messages")
    db.db_path(r.spool).unlink()
    r.wait_until(lambda: "was deleted" in _spool_detail(r), what="the deletion detected")
    detail = _spool_detail(r)
    assert "2 recipients are still queued" in detail and "Do not restart" in detail
    up.rcpt_reply = lambda a: None  # the upstream is back: the old file drains
    r.wait_until(lambda: len(up.received) == 2, what="the queued mail delivered")
    r.wait_until(lambda: "restart relay now" in _spool_detail(r), what="the advice to restart")
