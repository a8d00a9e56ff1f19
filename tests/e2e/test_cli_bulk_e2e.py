"""postsuper-style bulk operations (`--all` with filters, `--dry-run`), and `queue retry` of
a suppressed recipient saying so instead of quietly doing nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness import RelayProcess, Upstream, make_message, send

pytestmark = pytest.mark.slow


def test_bulk_hold_release_delete_with_filters(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    up = upstream()
    r = relay(upstream=up)
    r.cli("destination", "suspend", "smarthost", check=True)
    for i, dom in enumerate(["a.example", "a.example", "b.example"]):
        assert (
            send(
                r.port,
                "app@example.com",
                [f"u{i}@{dom}"],
                make_message(message_id=f"<bulk-{i}@cli>"),
            )
            == {}
        )
    dry = r.cli("queue", "hold", "--all", "--domain", "a.example", "--dry-run", check=True)
    assert "hold: would change 2 recipients of 2 messages" in dry.stdout
    assert all(m["state"] != "held" for m in r.queue())
    out = r.cli_json("queue", "hold", "--all", "--domain", "a.example")
    assert out["recipients_changed"] == 2 and len(out["ids"]) == 2
    held = {m["id"] for m in r.queue() if m["state"] == "held"}
    assert held == set(out["ids"])
    r.cli("queue", "release", "--all", "--state", "held", check=True)
    assert not any(m["state"] == "held" for m in r.queue())
    out = r.cli_json("queue", "delete", "--all", "--recipient", "u2@b.example")
    assert out["recipients_changed"] == 1
    assert {m["message_id"] for m in r.queue()} == {"bulk-0@cli", "bulk-1@cli"}
    # usage errors: ids with --all, filters without --all
    assert r.cli("queue", "delete", "--all", out["ids"][0]).returncode == 2
    assert r.cli("queue", "hold", "--domain", "a.example").returncode == 2
    assert r.cli("queue", "delete").returncode == 2


def test_retry_of_a_suppressed_recipient_says_how_to_lift_it(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("gone") else None
    r = relay(upstream=up, config={"retry": {"schedule": ["1s"]}})
    assert send(r.port, "app@example.com", ["gone@example.org"], make_message(31)) == {}
    r.wait_until(
        lambda: r.queue(all=True) and r.queue(all=True)[0]["recipients"][0]["state"] == "bounced",
        what="bounced and suppressed",
    )
    qid = r.queue(all=True)[0]["id"]
    res = r.cli("queue", "retry", qid, check=True)
    assert "gone@example.org is on the suppression list" in res.stderr
    assert "relay suppression remove gone@example.org" in res.stderr
    assert r.queue(all=True)[0]["recipients"][0]["state"] == "bounced"  # not quietly "sent"
    r.cli("suppression", "remove", "gone@example.org", check=True)
    res = r.cli("queue", "retry", qid, check=True)
    assert "suppression" not in res.stderr
    assert r.queue(all=True)[0]["recipients"][0]["state"] in ("deferred", "sending", "bounced")


def test_queue_json_names_the_destination_as_logs_and_stats_do(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    up = upstream()
    r = relay(upstream=up)
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(41)) == {}
    up.wait_for(1)
    r.wait_until(lambda: r.queue(all=True)[0]["state"] == "sent", what="sent")
    msg = r.queue(all=True)[0]
    assert msg["recipients"][0]["destination"] == "smarthost"
    shown = r.cli_json("queue", "show", msg["id"])
    assert {a["destination"] for a in shown["attempt_log"]} == {"smarthost"}
    assert shown["recipients"][0]["destination"] == "smarthost"
    delivered = [e for e in r.events() if e.get("event") == "delivered"]
    assert delivered and delivered[0]["destination"] == "smarthost"
