"""Every operator CLI verb against a live daemon (real subprocesses, real spool): what it
prints (table and --json), what it changes, that the running daemon acts on the change
(the contract: within 2 seconds; waited for generously here), and its exit status
(0 ok, 1 failure such as an unknown id, 2 usage, 78 bad config)."""

from __future__ import annotations

import calendar
import json
import re
import smtplib
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import RelayProcess, Upstream, make_message, send

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
# deferrals that stay deferred for the whole test: every delay is between 10 min and 1 h
LONG_RETRY = {"retry": {"schedule": ["1h"], "min_delay": "10m", "max_age": "5d"}}
EFFECT = 6.0  # seconds: generous wait for the contract's "within 2 seconds"


def mid_of(i: int) -> str:
    return f"cli-{i}@app.example.com"


def submit(r: RelayProcess, i: int, rcpts: list[str], **kw: Any) -> str:
    """Send message i; returns its queue id (from the 250 reply)."""
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(SENDER)
        for a in rcpts:
            code, msg = s.rcpt(a)
            assert code == 250, (a, code, msg)
        code, msg = s.data(make_message(i, message_id=f"<{mid_of(i)}>", **kw))
        assert code == 250, msg
        found = re.search(rb"queued as (\w+)", msg)
        assert found is not None, msg
        return found.group(1).decode()


def rcpt_rows(r: RelayProcess) -> dict[str, dict[str, Any]]:
    return {rc["address"]: {**rc, "queue_id": m["id"]} for m in r.queue() for rc in m["recipients"]}


def ids(rows: list[dict[str, Any]]) -> list[str]:
    return sorted(m["id"] for m in rows)


def received_ids(up: Upstream) -> list[str]:
    out = []
    for m in list(up.received):
        found = re.search(rb"Message-ID:\s*<([^>]+)>", m.data, re.I)
        assert found is not None
        out.append(found.group(1).decode())
    return sorted(out)


def oplog(r: RelayProcess) -> list[tuple[str, dict[str, Any]]]:
    with sqlite3.connect(r.spool / "relay.sqlite") as db:
        return [
            (a, json.loads(d))
            for a, d in db.execute("SELECT action, detail FROM oplog ORDER BY id")
        ]


# --- inspection, with deferred mail ----------------------------------------------------------


def test_inspection_verbs_and_flush(upstream, relay) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.3.0 mailbox temporarily unavailable"
    r = relay(upstream=up, config=LONG_RETRY)
    q1 = submit(r, 1, ["a@one.example"])
    q2 = submit(r, 2, ["b@two.example", "c@one.example"])
    r.wait_until(
        lambda: (
            all(x["state"] == "deferred" and x["attempts"] == 1 for x in rcpt_rows(r).values())
            and len(rcpt_rows(r)) == 3
        ),
        what="three deferred recipients",
    )

    # queue list --json: the contract's fields
    rows = r.cli_json("queue", "list")
    assert ids(rows) == sorted([q1, q2])
    by_id = {m["id"]: m for m in rows}
    m2 = by_id[q2]
    for key in (
        "id",
        "state",
        "message_id",
        "sender",
        "size",
        "created_at",
        "attempts",
        "next_attempt_at",
        "recipients",
    ):
        assert key in m2, key
    assert m2["state"] == "deferred" and m2["message_id"] == mid_of(2)
    assert m2["sender"] == SENDER and m2["size"] > 0 and m2["attempts"] == 1
    assert ISO.match(m2["created_at"]) and ISO.match(m2["next_attempt_at"])
    assert [(x["address"], x["state"], x["attempts"]) for x in m2["recipients"]] == [
        ("b@two.example", "deferred", 1),
        ("c@one.example", "deferred", 1),
    ]
    assert all(x["last_reply"].startswith("451 4.3.0") for x in m2["recipients"])

    # the default table, like mailq
    res = r.cli("queue", "list", check=True)
    out = res.stdout
    assert out.splitlines()[0].startswith("-Queue ID-")
    assert q1 in out and q2 in out and SENDER in out
    assert "c@one.example [deferred]" in out and "(451 4.3.0 mailbox temporarily" in out
    assert re.search(r"-- \d+ Kbytes in 2 Requests\.", out)

    # filters
    assert ids(r.cli_json("queue", "list", "--state", "deferred")) == sorted([q1, q2])
    assert r.cli_json("queue", "list", "--state", "held") == []
    assert ids(r.cli_json("queue", "list", "--recipient", "A@ONE.example")) == [q1]
    assert ids(r.cli_json("queue", "list", "--domain", "two.example")) == [q2]
    assert ids(r.cli_json("queue", "list", "--domain", "one.example")) == sorted([q1, q2])
    assert r.cli_json("queue", "list", "--older-than", "1h") == []
    time.sleep(1.1)
    assert ids(r.cli_json("queue", "list", "--older-than", "1s")) == sorted([q1, q2])

    # queue show: table and json, with the attempt log
    shown = r.cli_json("queue", "show", q2)
    assert shown["id"] == q2 and shown["message_id"] == mid_of(2)
    log = shown["attempt_log"]
    assert sorted(a["recipient"] for a in log) == ["b@two.example", "c@one.example"]
    assert all(a["reply"].startswith("451 4.3.0") and ISO.match(a["at"]) for a in log)
    assert f"<{mid_of(2)}>" in shown["headers"]
    text = r.cli("queue", "show", q2, check=True).stdout
    assert "attempt log:" in text and "451 4.3.0" in text and "id:" in text and q2 in text
    assert "b@two.example" in text

    # summary: destination x age
    summ = r.cli_json("queue", "summary")
    assert summ["buckets"][0] == "5m"
    assert summ["destinations"]["one.example"]["total"] == 2
    assert summ["destinations"]["one.example"]["by_age"][0] == 2
    assert summ["destinations"]["two.example"]["total"] == 1
    text = r.cli("queue", "summary", check=True).stdout
    assert re.search(r"^one\.example\s+2\s+2\b", text, re.M), text
    assert re.search(r"^TOTAL\s+3\s+3\b", text, re.M), text

    # stats
    st = r.cli_json("stats")
    assert st["messages"] == 2 and st["recipients"]["deferred"] == 3
    r.wait_until(
        lambda: (r.cli_json("stats")["daemon"] or {}).get("pid") == r.proc.pid,
        timeout=EFFECT,
        what="the daemon's snapshot",
    )
    text = r.cli("stats", check=True).stdout
    assert "deferred 3" in text and f"daemon pid {r.proc.pid}" in text

    # flush: every deferred recipient due now, although the schedule says >= 10 minutes
    soonest = min(
        calendar.timegm(time.strptime(m["next_attempt_at"], "%Y-%m-%dT%H:%M:%SZ"))
        for m in r.cli_json("queue", "list")
    )
    assert soonest > time.time() + 500
    up.rcpt_reply = lambda a: None
    res = r.cli("queue", "flush", check=True)
    assert res.stdout.strip() == "flush: 3 recipients of 2 messages changed"
    r.wait_until(
        lambda: received_ids(up) == sorted([mid_of(1), mid_of(2)]),
        timeout=EFFECT,
        what="flushed mail upstream",
    )
    r.wait_until(
        lambda: {x["state"] for x in rcpt_rows(r).values()} == {"delivered"}, what="delivered"
    )
    assert r.cli("queue", "list", check=True).stdout.strip() == "Mail queue is empty"
    assert r.cli_json("queue", "list") == []
    # --all and --state sent show finished mail
    assert ids(r.cli_json("queue", "list", "--all")) == sorted([q1, q2])
    assert ids(r.cli_json("queue", "list", "--state", "sent")) == sorted([q1, q2])
    assert [a for a, _d in oplog(r)] == ["flush"]


# --- changing the queue -------------------------------------------------------------------


def test_hold_release_delete_and_destinations(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    res = r.cli(
        "destination", "suspend", "smarthost", "--for", "1h", "--reason", "maint", check=True
    )
    assert res.stdout.startswith("suspended smarthost until ")
    q = [submit(r, i, [f"h{i}@example.org"]) for i in range(3)]
    r.wait_until(
        lambda: (
            len(rcpt_rows(r)) == 3
            and all(
                x["state"] == "deferred" and "suspended" in (x["reason"] or "")
                for x in rcpt_rows(r).values()
            )
        ),
        timeout=EFFECT,
        what="suspended deferrals",
    )
    assert up.received == []

    dl = r.cli_json("destination", "list")
    sm = [d for d in dl if d["name"] == "smarthost"]
    assert len(sm) == 1 and ISO.match(sm[0]["suspended_until"])
    assert "maint" in sm[0]["suspend_reason"]
    assert sum(d["queued_recipients"] for d in dl) == 3
    text = r.cli("destination", "list", check=True).stdout
    assert re.search(r"^smarthost\s", text, re.M) and "suspended" in text.splitlines()[0]

    # hold one
    res = r.cli("queue", "hold", q[0], check=True)
    assert res.stdout.strip() == "hold: 1 recipient of 1 message changed"
    assert "event=operator_action" in res.stderr and "hold" in res.stderr
    assert ids(r.cli_json("queue", "list", "--state", "held")) == [q[0]]
    assert r.cli_json("queue", "show", q[0])["recipients"][0]["state"] == "held"

    # delete one
    res = r.cli("queue", "delete", q[2], check=True)
    assert res.stdout.strip() == (
        "delete: 1 recipient of 1 message deleted (1 message left with no recipient was removed)"
    )
    assert "event=operator_action" in res.stderr and "delete" in res.stderr
    assert r.cli("queue", "show", q[2]).returncode == 1
    assert q[2] not in ids(r.cli_json("queue", "list", "--all"))
    assert ("delete", {"ids": [q[2]], "result": {"messages": 1, "recipients": 1}}) in oplog(r)

    # resume: the deferred one goes, the held one stays put while the upstream is up
    res = r.cli("destination", "resume", "smarthost", check=True)
    assert res.stdout.startswith("resumed smarthost")
    r.wait_until(
        lambda: received_ids(up) == [mid_of(1)],
        timeout=EFFECT,
        what="the released destination's mail",
    )
    assert not [
        d
        for d in r.cli_json("destination", "list")
        if d["name"] == "smarthost" and d.get("suspended_until")
    ]
    time.sleep(3.0)  # longer than the contract's 2 s: a held message must not move
    assert received_ids(up) == [mid_of(1)]
    assert r.cli_json("queue", "show", q[0])["recipients"][0]["state"] == "held"

    # release: delivered promptly
    res = r.cli("queue", "release", q[0], check=True)
    assert res.stdout.strip() == "release: 1 recipient of 1 message changed"
    r.wait_until(
        lambda: received_ids(up) == sorted([mid_of(0), mid_of(1)]),
        timeout=EFFECT,
        what="the released message upstream",
    )
    r.wait_until(lambda: r.cli_json("queue", "list") == [], what="empty queue")
    actions = [a for a, _d in oplog(r)]
    assert actions == ["destination_suspend", "hold", "delete", "destination_resume", "release"]
    # the deleted message never went anywhere
    assert mid_of(2) not in received_ids(up)


def test_retry_brings_back_a_failed_message(upstream, relay) -> None:
    up = upstream()
    up.data_reply = lambda env: (
        "554 5.6.0 content rejected" if b"reject-me" in (env.original_content or b"") else None
    )
    r = relay(upstream=up)
    qf = submit(r, 1, ["f@example.org"], subject="reject-me")
    r.wait_until(
        lambda: rcpt_rows(r).get("f@example.org", {}).get("state") == "failed",
        what="the failed recipient",
    )
    # finished: not in the default list, but in --state failed and --all
    assert r.cli_json("queue", "list") == []
    assert ids(r.cli_json("queue", "list", "--state", "failed")) == [qf]
    shown = r.cli_json("queue", "show", qf)
    assert shown["state"] == "failed"
    assert shown["attempt_log"][0]["reply"].startswith("554 5.6.0")
    assert any(e.get("event") == "dead_letter" for e in r.events())

    up.data_reply = lambda env: None  # fixed upstream-side
    res = r.cli("queue", "retry", qf, check=True)
    assert res.stdout.strip() == "retry: 1 recipient of 1 message changed"
    r.wait_until(
        lambda: received_ids(up) == [mid_of(1)], timeout=EFFECT, what="the retried message upstream"
    )
    r.wait_until(
        lambda: rcpt_rows(r)["f@example.org"]["state"] == "delivered", what="delivered state"
    )
    row = rcpt_rows(r)["f@example.org"]
    assert row["attempts"] == 1  # reset by retry, then one successful attempt
    assert r.cli_json("queue", "show", qf)["state"] == "sent"

    # --failed with nothing failed changes nothing; a delivered recipient never goes again
    assert r.cli_json("queue", "retry", "--failed")["recipients_changed"] == 0
    assert r.cli_json("queue", "retry", qf)["recipients_changed"] == 0
    time.sleep(1.0)
    assert received_ids(up) == [mid_of(1)]


# --- suppression ------------------------------------------------------------------------------


def rcpt_code(r: RelayProcess, address: str) -> tuple[int, bytes]:
    with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as s:
        s.ehlo("client.test")
        s.mail(SENDER)
        reply = s.rcpt(address)
        s.rset()
        return reply


def test_suppression_verbs(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    assert r.cli_json("suppression", "list") == []
    assert "-- 0 suppressed addresses" in r.cli("suppression", "list", check=True).stdout
    res = r.cli(
        "suppression", "add", "<Spam.Trap@Example.org>", "--reason", "complained", check=True
    )
    assert res.stdout.strip() == "add: Spam.Trap@Example.org"
    rows = r.cli_json("suppression", "list")
    assert len(rows) == 1
    assert set(rows[0]) >= {"address", "reason", "created_at"}
    assert rows[0]["address"] == "spam.trap@example.org"
    assert rows[0]["reason"] == "complained" and ISO.match(rows[0]["created_at"])
    text = r.cli("suppression", "list", check=True).stdout
    assert "spam.trap@example.org" in text and "complained" in text

    # the running daemon refuses it at RCPT
    r.wait_until(
        lambda: rcpt_code(r, "spam.trap@example.org")[0] == 550,
        timeout=EFFECT,
        what="the suppression in the daemon",
    )
    code, msg = rcpt_code(r, "SPAM.TRAP@example.org")
    assert code == 550 and msg.startswith(b"5.1.1") and b"complained" in msg

    res = r.cli("suppression", "remove", "spam.trap@example.org", check=True)
    assert res.stdout.strip() == "remove: spam.trap@example.org"
    assert r.cli_json("suppression", "list") == []
    r.wait_until(
        lambda: rcpt_code(r, "spam.trap@example.org")[0] == 250,
        timeout=EFFECT,
        what="the removal in the daemon",
    )
    assert send(r.port, SENDER, ["spam.trap@example.org"], make_message(1)) == {}
    assert up.wait_for(1)[0].rcpt_tos == ["spam.trap@example.org"]

    # failures
    res = r.cli("suppression", "remove", "spam.trap@example.org")
    assert res.returncode == 1 and "not on the suppression list" in res.stderr
    res = r.cli("suppression", "add", "not-an-address")
    assert res.returncode == 2 and "not an email address" in res.stderr
    assert [a for a, _d in oplog(r)] == [
        "suppression_add",
        "suppression_remove",
        "suppression_remove",
    ]


# --- exit codes ----------------------------------------------------------------------------


def test_exit_codes(upstream, relay, tmp_path: Path) -> None:
    r = relay(upstream=upstream())
    for verb in (
        ("queue", "show"),
        ("queue", "hold"),
        ("queue", "release"),
        ("queue", "delete"),
        ("queue", "retry"),
    ):
        res = r.cli(*verb, "NOSUCHQUEUEID000")
        assert res.returncode == 1, (verb, res)
        assert "NOSUCHQUEUEID000" in res.stderr
    for bad in (
        ("queue", "frobnicate"),
        ("frobnicate",),
        ("queue", "list", "--state", "x"),
        ("queue", "retry"),
        ("queue", "hold"),
        ("destination", "suspend"),
    ):
        res = r.cli(*bad)
        assert res.returncode == 2, (bad, res)
        assert res.stderr.strip()
    # a bad config file: 78, naming the key
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("retry:\n  schedule: [1m, 5x]\n")
    for args in (["queue", "list"], ["stats"], ["suppression", "list"], ["check-config"]):
        res = subprocess.run(
            [sys.executable, "-m", "relay", *args, "-c", str(bad_cfg)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 78, (args, res)
        assert "retry.schedule[1]" in res.stderr
    assert r.cli("queue", "list").returncode == 0
