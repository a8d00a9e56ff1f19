"""relay/feedback/apply.py on a real SQLite spool: matching order, what each event type does,
once-only, and the rates behind `relay stats`."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from relay.feedback.apply import Applied, apply_events, match, rates
from relay.feedback.events import FeedbackEvent
from relay.spool import db, ops
from relay.spool.dedup import dedup_key
from relay.spool.model import RcptState
from tests.pgserver import BACKENDS, open_backend

T0 = 1_800_000_000.0


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    yield c
    c.close()


def queue(
    c: sqlite3.Connection,
    qid: str,
    rcpts: list[str],
    *,
    mid: str = "m@app.example",
    identity: str = "example.com",
    delivered: dict[str, str] | None = None,
    at: float = T0,
) -> dict[str, int]:
    """Queue a message; `delivered` maps recipient -> upstream id for those delivered."""
    msg = ops.NewMessage(
        queue_id=qid,
        message_id=mid,
        sender=f"app@{identity}",
        size=10,
        created_at=at,
        client="listener:x",
        peer="127.0.0.1",
        lane="transactional",
        lane_prio=0,
        identity=identity,
        body=b"Subject: x\r\n\r\nx\r\n",
        body_path=None,
        recipients=tuple(
            ops.NewRecipient(r, r.rpartition("@")[2], dedup_key("listener:x", mid + qid, r))
            for r in rcpts
        ),
    )
    with db.transaction(c):
        ops.accept(c, msg, 86400)
    ids = {
        r[1]: r[0] for r in c.execute("SELECT id, address FROM recipients WHERE msg_id=?", (qid,))
    }
    for r, uid in (delivered or {}).items():
        with db.transaction(c):
            c.execute("UPDATE recipients SET state='sending' WHERE id=?", (ids[r],))
            ops.record(
                c,
                [
                    ops.RcptUpdate(
                        rcpt_id=ids[r],
                        msg_id=qid,
                        state=RcptState.DELIVERED,
                        count_attempt=True,
                        next_attempt_at=None,
                        last_reply="250 ok",
                        log=ops.AttemptLog("delivered", "250 ok", "smarthost", "h", 0.1),
                        upstream_id=uid,
                    )
                ],
                at + 1,
            )
    return ids


def ev(**kw: object) -> FeedbackEvent:
    base: dict[str, object] = {"provider": "generic", "type": "bounce", "event_id": "e1"}
    base.update(kw)
    return FeedbackEvent(**base)  # type: ignore[arg-type]


def run(c: sqlite3.Connection, *events: FeedbackEvent, now: float = T0 + 10) -> list[Applied]:
    with db.transaction(c):
        return apply_events(c, list(events), now)


def state(c: sqlite3.Connection, rid: int) -> str:
    return str(c.execute("SELECT state FROM recipients WHERE id=?", (rid,)).fetchone()[0])


def test_match_order_verp_then_upstream_id_then_message_id_then_address(
    conn: sqlite3.Connection,
) -> None:
    a = queue(conn, "Q1", ["a@x.org", "b@x.org"], delivered={"a@x.org": "U1", "b@x.org": "U1"})
    b = queue(conn, "Q2", ["a@x.org"], mid="other@app.example", delivered={"a@x.org": "U2"})
    # VERP names the row, whatever else the event says
    m = match(conn, ev(recipient="zzz@x.org", queue_id="Q1", rcpt_id=a["b@x.org"]))
    assert m is not None and (m.rcpt_id, m.by) == (a["b@x.org"], "verp")
    # the upstream id with the address: of two recipients of U1, the one named
    m = match(conn, ev(recipient="B@X.ORG", upstream_id="<U1>"))
    assert m is not None and (m.rcpt_id, m.by) == (a["b@x.org"], "upstream_id")
    # an upstream id of one recipient: the provider's address may differ (forwarding)
    m = match(conn, ev(recipient="forwarded@y.org", upstream_id="U2"))
    assert m is not None and (m.rcpt_id, m.by) == (b["a@x.org"], "upstream_id")
    # ... but not of several: falls through to the address, which matches nobody
    assert match(conn, ev(recipient="forwarded@y.org", upstream_id="U1")) is None
    # the Message-ID (normalised: brackets, domain case) with the address
    m = match(conn, ev(recipient="a@x.org", message_id="<other@APP.example>"))
    assert m is not None and (m.rcpt_id, m.by) == (b["a@x.org"], "message_id")
    # the address alone: its most recent delivery
    m = match(conn, ev(recipient="a@x.org"))
    assert m is not None and m.by == "address" and m.rcpt_id == b["a@x.org"]
    # a waiting recipient is not matched by address alone
    queue(conn, "Q3", ["w@x.org"])
    assert match(conn, ev(recipient="w@x.org")) is None


def test_hard_bounce_marks_delivered_bounced_suppresses_globally_once(
    conn: sqlite3.Connection,
) -> None:
    ids = queue(conn, "Q1", ["a@x.org"], delivered={"a@x.org": "U1"})
    (res,) = run(conn, ev(recipient="a@x.org", upstream_id="U1", reason="550 5.1.1 gone"))
    assert res.outcome == "bounced" and res.identity == "example.com"
    assert state(conn, ids["a@x.org"]) == "bounced"
    assert ops.suppression_get(conn, "A@x.org") is not None
    (entry,) = ops.suppression_list(conn)
    assert entry["scope"] == "global" and entry["source"] == "feedback:generic"
    assert "550 5.1.1 gone" in entry["reason"]
    log = [r[0] for r in conn.execute("SELECT outcome FROM attempts ORDER BY id")]
    assert log == ["delivered", "late_bounce"]
    # the same event again: nothing
    (again,) = run(conn, ev(recipient="a@x.org", upstream_id="U1", reason="550 5.1.1 gone"))
    assert again.outcome == "duplicate"
    assert [r[0] for r in conn.execute("SELECT outcome FROM attempts")] == log
    # the same id from another provider, or for another recipient, is another event
    (other,) = run(conn, ev(provider="ses", recipient="a@x.org", upstream_id="U1"))
    assert other.outcome == "suppressed"  # already bounced: suppressed, not bounced again


def test_complaint_is_scoped_to_the_identity_soft_bounce_only_logged(
    conn: sqlite3.Connection,
) -> None:
    ids = queue(conn, "Q1", ["a@x.org", "s@x.org"], delivered={"a@x.org": "U", "s@x.org": "U"})
    (res,) = run(conn, ev(type="complaint", recipient="a@x.org", upstream_id="U"))
    assert res.outcome == "complaint"
    assert state(conn, ids["a@x.org"]) == "delivered"
    assert ops.suppression_get(conn, "a@x.org") is None  # not global
    assert ops.suppression_get(conn, "a@x.org", "example.com") is not None
    assert ops.suppression_get(conn, "a@x.org", "other.example") is None
    # by the upstream id: an address alone acts on nothing (test_feedback_matching.py)
    soft_ev = ev(type="soft_bounce", event_id="e2", recipient="s@x.org", upstream_id="U")
    (soft,) = run(conn, soft_ev)
    assert soft.outcome == "soft_bounce"
    assert ops.suppression_get(conn, "s@x.org", "example.com") is None
    assert state(conn, ids["s@x.org"]) == "delivered"


def test_unmatched_event_is_recorded_and_changes_nothing(conn: sqlite3.Connection) -> None:
    (res,) = run(conn, ev(recipient="stranger@x.org"))
    assert res.outcome == "unmatched"
    assert ops.suppression_list(conn) == []
    assert [e["outcome"] for e in ops.feedback_events(conn, 10)] == ["unmatched"]
    (again,) = run(conn, ev(recipient="stranger@x.org"))
    assert again.outcome == "duplicate"


def test_a_waiting_recipient_is_left_to_delivery_but_the_address_is_suppressed(
    conn: sqlite3.Connection,
) -> None:
    ids = queue(conn, "Q1", ["a@x.org"])
    (res,) = run(conn, ev(recipient="a@x.org", queue_id="Q1", rcpt_id=ids["a@x.org"]))
    assert res.outcome == "suppressed"
    assert state(conn, ids["a@x.org"]) == "pending"
    assert ops.suppression_get(conn, "a@x.org") is not None


def test_rates_per_identity_over_24h_and_7d(conn: sqlite3.Connection) -> None:
    now = T0 + 3 * 86400
    # 4 delivered three days ago, 2 delivered now; one bounce and one complaint now
    queue(conn, "Q1", [f"o{i}@x.org" for i in range(4)], at=T0,
          delivered={f"o{i}@x.org": f"O{i}" for i in range(4)})  # fmt: skip
    queue(conn, "Q2", ["n1@x.org", "n2@x.org"], at=now - 100,
          delivered={"n1@x.org": "N1", "n2@x.org": "N2"})  # fmt: skip
    run(conn, ev(recipient="n1@x.org", upstream_id="N1"), now=now)
    run(conn, ev(type="complaint", event_id="c", recipient="n2@x.org", upstream_id="N2"), now=now)
    (doc,) = rates(conn, now)
    assert doc["identity"] == "example.com"
    assert doc["24h"] == {
        "delivered": 2,
        "bounced": 1,
        "complained": 1,
        "bounce_rate": 0.5,
        "complaint_rate": 0.5,
    }
    week = doc["7d"]
    assert isinstance(week, dict)
    assert (week["delivered"], week["bounced"], week["complained"]) == (6, 1, 1)
    # eight days later: gone from both windows
    assert rates(conn, now + 8 * 86400) == []


def test_every_field_of_what_an_event_did_is_recorded(conn: sqlite3.Connection) -> None:
    """The whole record, not only the outcome: the Applied value the daemon logs and alerts
    from, the attempt log rows, the event row, the suppression entry (found by mutation
    testing: each of these could be broken without a failing test)."""
    ids = queue(conn, "Q1", ["a@x.org", "c@x.org", "s@x.org"],
                delivered={"a@x.org": "U", "c@x.org": "U", "s@x.org": "U"})  # fmt: skip
    seen: list[tuple[sqlite3.Connection, Applied]] = []
    with db.transaction(conn):
        out = apply_events(
            conn,
            [
                ev(event_id="b", recipient=" <A@X.ORG> ", upstream_id="U", status="5.1.1"),
                ev(event_id="c", type="complaint", recipient="c@x.org", upstream_id="U"),
                ev(
                    event_id="s",
                    type="soft_bounce",
                    recipient="s@x.org",
                    upstream_id="U",
                    reason="452 mailbox full",
                ),
                ev(event_id="n", recipient="nobody@x.org"),
                ev(event_id="b", recipient="a@x.org", upstream_id="U", status="5.1.1"),
            ],
            T0 + 10,
            lambda c, a: seen.append((c, a)),
        )
    bounce, complaint, soft, unmatched, dup = out
    assert bounce == Applied(
        bounce.event, "bounced", "Q1", ids["a@x.org"], "example.com", "a@x.org", "upstream_id"
    )
    assert [a.event.event_id for a in out] == ["b", "c", "s", "n", "b"]
    assert complaint == Applied(
        complaint.event, "complaint", "Q1", ids["c@x.org"], "example.com", "c@x.org",
        "upstream_id",
    )  # fmt: skip
    assert soft == Applied(
        soft.event, "soft_bounce", "Q1", ids["s@x.org"], "example.com", "s@x.org", "upstream_id"
    )
    assert (unmatched.outcome, unmatched.queue_id, unmatched.event.event_id) == (
        "unmatched",
        None,
        "n",
    )
    assert (dup.outcome, dup.event.event_id) == ("duplicate", "b")
    # the callback runs in the same transaction for what acted, not for the rest
    assert [a.outcome for _c, a in seen] == ["bounced", "complaint", "soft_bounce"]
    assert all(c is conn for c, _a in seen)
    # the attempt log: what each event did, with its text
    log = conn.execute(
        "SELECT rcpt_id, outcome, reply FROM attempts WHERE outcome != 'delivered' ORDER BY id"
    ).fetchall()
    assert [tuple(r) for r in log] == [
        (ids["a@x.org"], "late_bounce", "late bounce (generic): 5.1.1"),
        (ids["c@x.org"], "complaint", "complaint (generic): marked as spam"),
        (ids["s@x.org"], "soft_bounce", "soft bounce (generic): 452 mailbox full"),
    ]
    # the bounced recipient's last reply says why
    last = conn.execute("SELECT last_reply FROM recipients WHERE id=?", (ids["a@x.org"],))
    assert last.fetchone()[0] == "late bounce (generic): 5.1.1"
    # the event rows: lowercased recipient, outcome and match
    rows = {
        r[0]: tuple(r[1:])
        for r in conn.execute(
            "SELECT event_id, recipient, type, outcome, msg_id, rcpt_id, identity"
            " FROM feedback_events"
        )
    }
    assert rows["b"] == ("a@x.org", "bounce", "bounced", "Q1", ids["a@x.org"], "example.com")
    assert rows["c"][2:] == ("complaint", "Q1", ids["c@x.org"], "example.com")
    assert rows["n"] == ("nobody@x.org", "bounce", "unmatched", None, None, None)
    # the suppression entries: scope, source and reason
    entries = {(e["address"], e["scope"]): e for e in ops.suppression_list(conn)}
    assert set(entries) == {("a@x.org", "global"), ("c@x.org", "example.com")}
    assert entries[("a@x.org", "global")]["source"] == "feedback:generic"
    assert entries[("a@x.org", "global")]["reason"] == "late bounce (generic): 5.1.1"
    assert entries[("c@x.org", "example.com")]["source"] == "feedback:generic"
    assert entries[("c@x.org", "example.com")]["reason"] == "complaint (generic): marked as spam"


def test_verp_needs_both_queue_id_and_row(conn: sqlite3.Connection) -> None:
    ids = queue(conn, "Q1", ["a@x.org"], delivered={"a@x.org": "U"})
    queue(conn, "Q2", ["b@x.org"])
    # a row id of another message, or a queue id alone, is no VERP match
    assert match(conn, ev(recipient="zz@x.org", queue_id="Q2", rcpt_id=ids["a@x.org"])) is None
    assert match(conn, ev(recipient="zz@x.org", queue_id="Q1")) is None
    assert match(conn, ev(recipient="zz@x.org", rcpt_id=ids["a@x.org"])) is None
    # angle brackets and case in the event's address do not matter
    m = match(conn, ev(recipient="<A@X.org>", message_id="m@app.example"))
    assert m is not None and m.by == "message_id"


def test_rate_windows_are_exact_to_the_hour_and_no_delivery_means_no_rate(
    conn: sqlite3.Connection,
) -> None:
    now = T0 + 100 * 3600 + 1800  # half past the hour
    hour = int(now // 3600)
    with db.transaction(conn):
        for identity, h, delivered, bounced, complained in (
            ("a.example", hour - 23, 10, 1, 0),  # inside the last 24 hours
            ("a.example", hour - 24, 100, 7, 7),  # just outside: in the 7 days only
            ("a.example", hour - 24 * 7 + 1, 1000, 0, 0),  # the oldest hour of the 7 days
            ("a.example", hour - 24 * 7, 5000, 0, 0),  # just outside the 7 days
            ("b.example", hour, 0, 2, 1),  # feedback for an identity with no delivery
        ):
            conn.execute(
                "INSERT INTO identity_hours (identity, hour, delivered, bounced, complained)"
                " VALUES (?,?,?,?,?)",
                (identity, h, delivered, bounced, complained),
            )
    a, b = rates(conn, now)
    assert a["identity"] == "a.example"
    assert a["24h"] == {
        "delivered": 10,
        "bounced": 1,
        "complained": 0,
        "bounce_rate": 0.1,
        "complaint_rate": 0.0,
    }
    week = a["7d"]
    assert isinstance(week, dict)
    assert (week["delivered"], week["bounced"], week["complained"]) == (1110, 8, 7)
    assert b["24h"] == {
        "delivered": 0,
        "bounced": 2,
        "complained": 1,
        "bounce_rate": None,
        "complaint_rate": None,
    }


def test_a_recipient_being_sent_is_not_turned_bounced(conn: sqlite3.Connection) -> None:
    ids = queue(conn, "Q1", ["a@x.org"])
    with db.transaction(conn):
        conn.execute("UPDATE recipients SET state='sending' WHERE id=?", (ids["a@x.org"],))
    (res,) = run(conn, ev(recipient="a@x.org", queue_id="Q1", rcpt_id=ids["a@x.org"]))
    assert res.outcome == "suppressed"  # the address; the attempt under way records its own
    assert state(conn, ids["a@x.org"]) == "sending"


def test_addresses_and_ids_keep_their_letters(conn: sqlite3.Connection) -> None:
    """Only angle brackets and spaces are trimmed: an address or id that starts or ends
    with any other character (here X) still matches."""
    ids = queue(conn, "Q1", ["Xavier@x.org"], delivered={"Xavier@x.org": "XU1X"})
    m = match(conn, ev(recipient="<Xavier@x.org>"))
    assert m is not None and (m.rcpt_id, m.by) == (ids["Xavier@x.org"], "address")
    m = match(conn, ev(recipient="someone.else@y.org", upstream_id=" <XU1X> "))
    assert m is not None and m.by == "upstream_id"
    (res,) = run(conn, ev(recipient="XAVIER@X.ORG", upstream_id="XU1X"))  # no reason, no status
    assert res.outcome == "bounced"
    (entry,) = ops.suppression_list(conn)
    assert entry["address"] == "xavier@x.org"
    assert entry["reason"] == "late bounce (generic): permanent failure"
