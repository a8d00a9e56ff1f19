"""relay/spool/ops.py's operator and reading functions, in-process, row by row: what
`queue retry/hold/release/flush/delete`, `destination suspend/resume/reset`, the
suppression list, the runtime view and the CLI's readers do to (and read from) a real
spool. The CLI's own tests run it as a subprocess, where mutation testing cannot see it
(tests/MUTANTS.md, "The spool and inbound")."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from relay.spool import db, ops
from relay.spool.model import RcptState
from tests.pgserver import BACKENDS, open_backend

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """The spool contract: each test that takes `conn` runs on SQLite and on PostgreSQL."""
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    yield c
    c.close()


def spool_message(
    qid: str,
    rcpts: list[str],
    *,
    created_at: float = T0,
    identity: str = "example.com",
    lane: str = "transactional",
    body: bytes | None = b"x",
    body_path: str | None = None,
    listener: str | None = "127.0.0.1:2525",
) -> ops.NewMessage:
    """A message as the spool takes it; each recipient's dedup key is `<qid>/<address>`."""
    return ops.NewMessage(
        queue_id=qid,
        message_id=f"{qid.lower()}@app.example",
        sender="app@example.com",
        size=10,
        created_at=created_at,
        client="listener:x",
        peer="127.0.0.1",
        lane=lane,
        lane_prio=0 if lane == "transactional" else 1,
        identity=identity,
        body=body,
        body_path=body_path,
        recipients=tuple(ops.NewRecipient(r, r.rpartition("@")[2], f"{qid}/{r}") for r in rcpts),
        listener=listener,
    )


def put(conn: sqlite3.Connection, qid: str, rcpts: list[str], **kw: Any) -> None:
    msg = spool_message(qid, rcpts, **kw)
    with db.transaction(conn):
        assert ops.accept(conn, msg, 60).queue_id == qid


def set_rcpt(conn: sqlite3.Connection, address: str, **cols: Any) -> None:
    sets = ", ".join(f"{k} = ?" for k in cols)
    conn.execute(f"UPDATE recipients SET {sets} WHERE address = ?", (*cols.values(), address))


def rcpt(conn: sqlite3.Connection, address: str) -> dict[str, Any]:
    row = conn.execute(
        "SELECT state, attempts, next_attempt_at, reason, updated_at, retry_base, last_reply"
        " FROM recipients WHERE address = ?",
        (address,),
    ).fetchone()
    return dict(row)


def run(conn: sqlite3.Connection, fn: Any, *args: Any, **kw: Any) -> Any:
    with db.transaction(conn):
        return fn(conn, *args, **kw)


EVERY_STATE = {s.value: f"{s.value}@example.org" for s in RcptState}


@pytest.fixture
def every_state(conn: sqlite3.Connection) -> sqlite3.Connection:
    """Message M1 with one recipient in each state (attempts 3, a reason, due later)."""
    put(conn, "M1", list(EVERY_STATE.values()))
    for state, addr in EVERY_STATE.items():
        set_rcpt(
            conn,
            addr,
            state=state,
            attempts=3,
            reason="why",
            next_attempt_at=T0 + 500,
            updated_at=T0,
        )
    return conn


def test_retry_brings_back_every_unfinished_and_dead_recipient_with_a_fresh_clock(
    every_state: sqlite3.Connection,
) -> None:
    c = every_state
    now = T0 + 100
    assert run(c, ops.retry, ["M1"], now) == 6
    fresh = {
        "state": "deferred",
        "attempts": 0,
        "next_attempt_at": now,
        "reason": None,
        "updated_at": now,
        "retry_base": now,
        "last_reply": None,
    }
    for state in ("pending", "deferred", "bounced", "failed", "suppressed", "held"):
        assert rcpt(c, EVERY_STATE[state]) == fresh, state
    # a delivered recipient is never sent again; a claimed one is the engine's
    for state in ("delivered", "sending"):
        assert rcpt(c, EVERY_STATE[state])["state"] == state
        assert rcpt(c, EVERY_STATE[state])["attempts"] == 3
    assert run(c, ops.retry, [], now) == 0
    assert run(c, ops.retry, ["OTHER"], now) == 0


def test_retry_failed_only_takes_the_dead_letters(every_state: sqlite3.Connection) -> None:
    c = every_state
    put(c, "M2", ["dead@example.net"])
    set_rcpt(c, "dead@example.net", state="failed", attempts=2)
    assert run(c, ops.retry, None, T0 + 7, failed_only=True) == 3  # every message
    assert {a for a, s in EVERY_STATE.items() if rcpt(c, s)["state"] == "deferred"} == {
        "deferred",
        "bounced",
        "failed",
    }
    assert rcpt(c, EVERY_STATE["deferred"])["attempts"] == 3  # it was not retried
    assert rcpt(c, "dead@example.net")["next_attempt_at"] == T0 + 7
    assert run(c, ops.retry, ["M2"], T0 + 8, failed_only=True) == 0


def test_suppressed_recipients_lists_what_retry_leaves(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["Gone@example.org", "scoped@example.org", "ok@example.org"], identity="id1")
    put(conn, "M2", ["scoped@example.org"], identity="id2")
    for a in ("Gone@example.org", "scoped@example.org", "ok@example.org"):
        set_rcpt(conn, a, state="bounced")
    assert run(conn, ops.suppression_add, "gone@EXAMPLE.org", "bounced", T0)
    assert run(conn, ops.suppression_add, "scoped@example.org", "complaint", T0, "ID1")
    assert ops.suppressed_recipients(conn, ["M1", "M2"]) == [
        ("M1", "Gone@example.org", "bounced"),
        ("M1", "scoped@example.org", "complaint"),
    ]
    assert ops.suppressed_recipients(conn, None) == [
        ("M1", "Gone@example.org", "bounced"),
        ("M1", "scoped@example.org", "complaint"),
    ]
    assert ops.suppressed_recipients(conn, []) == []
    assert ops.suppressed_recipients(conn, ["M2"]) == []


def test_retry_leaves_a_suppressed_address(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["Gone@example.org"])
    set_rcpt(conn, "Gone@example.org", state="bounced")
    assert run(conn, ops.suppression_add, "gone@example.org", "bounced", T0)
    assert run(conn, ops.retry, ["M1"], T0 + 1) == 0
    assert rcpt(conn, "Gone@example.org")["state"] == "bounced"
    assert run(conn, ops.suppression_remove, "gone@example.org")
    assert run(conn, ops.retry, ["M1"], T0 + 1) == 1


def test_retry_retries_what_is_not_suppressed_next_to_what_is(conn: sqlite3.Connection) -> None:
    """Regression: `s.address = lower(address)` compared the suppression row with itself,
    so one unrelated lower-case suppression entry stopped every `queue retry`."""
    put(conn, "M1", ["Gone@example.org", "scoped@example.org", "ok@example.org"], identity="id1")
    put(conn, "M2", ["scoped@example.org"], identity="id2")
    for a in ("Gone@example.org", "scoped@example.org", "ok@example.org"):
        set_rcpt(conn, a, state="bounced")
    assert run(conn, ops.suppression_add, "gone@EXAMPLE.org", "bounced", T0)
    assert run(conn, ops.suppression_add, "scoped@example.org", "complaint", T0, "ID1")
    assert run(conn, ops.retry, ["M1", "M2"], T0 + 1) == 2
    assert rcpt(conn, "Gone@example.org")["state"] == "bounced"
    assert rcpt(conn, "ok@example.org")["state"] == "deferred"
    states = dict(
        conn.execute("SELECT msg_id, state FROM recipients WHERE address = 'scoped@example.org'")
    )
    assert states == {"M1": "bounced", "M2": "deferred"}


def test_suppressed_recipients_of_pending_mail_only_with_ids(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org", "b@example.org", "c@example.org"])
    set_rcpt(conn, "b@example.org", state="failed")
    set_rcpt(conn, "c@example.org", state="delivered")
    for a in ("a@example.org", "b@example.org", "c@example.org"):
        run(conn, ops.suppression_add, a, "r", T0)
    # with ids: every recipient not delivered; with --failed or no ids: dead letters only
    assert [r[1] for r in ops.suppressed_recipients(conn, ["M1"])] == [
        "a@example.org",
        "b@example.org",
    ]
    assert [r[1] for r in ops.suppressed_recipients(conn, ["M1"], failed_only=True)] == [
        "b@example.org"
    ]
    assert [r[1] for r in ops.suppressed_recipients(conn, None)] == ["b@example.org"]


def test_hold_and_release(every_state: sqlite3.Connection) -> None:
    c = every_state
    assert run(c, ops.hold, ["M1"], T0 + 1) == 2  # pending and deferred
    for state in ("pending", "deferred"):
        assert rcpt(c, EVERY_STATE[state]) == {
            "state": "held",
            "attempts": 3,
            "next_attempt_at": T0 + 500,
            "reason": None,
            "updated_at": T0 + 1,
            "retry_base": None,
            "last_reply": None,
        }
    assert rcpt(c, EVERY_STATE["sending"])["state"] == "sending"
    assert run(c, ops.hold, [], T0 + 1) == 0
    assert run(c, ops.release, ["M1"], T0 + 2) == 3  # the two, and the one held already
    for state in ("pending", "deferred", "held"):
        assert rcpt(c, EVERY_STATE[state]) == {
            "state": "deferred",
            "attempts": 3,
            "next_attempt_at": T0 + 2,
            "reason": None,
            "updated_at": T0 + 2,
            "retry_base": None,
            "last_reply": None,
        }
    assert run(c, ops.release, ["M1"], T0 + 3) == 0


def test_flush_makes_waiting_recipients_due_now(every_state: sqlite3.Connection) -> None:
    c = every_state
    set_rcpt(c, EVERY_STATE["pending"], next_attempt_at=T0 + 10)  # due already at T0 + 10
    assert run(c, ops.flush, T0 + 10) == 1  # the deferred one; the pending one is due
    assert rcpt(c, EVERY_STATE["deferred"])["next_attempt_at"] == T0 + 10
    assert rcpt(c, EVERY_STATE["deferred"])["updated_at"] == T0 + 10
    assert rcpt(c, EVERY_STATE["pending"])["updated_at"] == T0
    assert rcpt(c, EVERY_STATE["held"])["next_attempt_at"] == T0 + 500
    assert run(c, ops.flush, T0 + 10) == 0


def test_delete_finished_before_existing_ids_and_body_paths(conn: sqlite3.Connection) -> None:
    put(conn, "OLD", ["a@example.org"], created_at=T0 - 100, body_path="bodies/OL/OLD")
    put(conn, "OLDW", ["b@example.org"], created_at=T0 - 100)
    put(conn, "NEW", ["c@example.org"], created_at=T0)
    set_rcpt(conn, "a@example.org", state="delivered")
    set_rcpt(conn, "c@example.org", state="failed")
    assert ops.finished_before(conn, T0) == ["OLD"]
    assert ops.finished_before(conn, T0 + 1) == ["OLD", "NEW"]
    assert ops.existing_ids(conn, ["NEW", "NOPE", "OLD"]) == ["NEW", "OLD"]
    assert ops.body_paths(conn) == {"bodies/OL/OLD"}
    conn.execute(
        "INSERT INTO attempts (msg_id, rcpt_id, at, destination, outcome) VALUES"
        " ('OLD', 1, 1, 'd', 'delivered'), ('NEW', 3, 1, 'd', 'failed')"
    )
    assert run(conn, ops.delete_messages, ["OLD", "NOPE", "NEW"]) == ["bodies/OL/OLD"]
    assert [r[0] for r in conn.execute("SELECT id FROM messages")] == ["OLDW"]
    assert [r[0] for r in conn.execute("SELECT msg_id FROM recipients")] == ["OLDW"]
    assert conn.execute("SELECT count(*) FROM attempts").fetchone()[0] == 0


def test_destination_suspend_resume_and_reset(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@dest.example", "b@dest.example", "c@other.example", "d@dest.example"])
    set_rcpt(conn, "a@dest.example", state="deferred", reason="suspended", next_attempt_at=T0 + 9)
    set_rcpt(conn, "b@dest.example", state="deferred", reason=None, next_attempt_at=T0 + 9)
    set_rcpt(conn, "c@other.example", state="deferred", reason="circuit open", next_attempt_at=9)
    set_rcpt(conn, "d@dest.example", state="held", reason="x", next_attempt_at=T0 + 9)
    run(conn, ops.suspend_destination, "Dest.Example", T0 + 60, "maintenance")
    run(conn, ops.suspend_destination, "late.example", T0 + 5, "")
    assert ops.suspensions(conn, T0) == {
        "dest.example": (T0 + 60, "maintenance"),
        "late.example": (T0 + 5, ""),
    }
    assert ops.suspensions(conn, T0 + 5) == {"dest.example": (T0 + 60, "maintenance")}
    run(conn, ops.suspend_destination, "dest.example", T0 + 90, "longer")  # replaced
    assert ops.suspensions(conn, T0 + 70) == {"dest.example": (T0 + 90, "longer")}
    assert run(conn, ops.resume_destination, "DEST.example", T0 + 1) == 1  # a: it waited
    assert ops.suspensions(conn, T0) == {"late.example": (T0 + 5, "")}
    assert rcpt(conn, "a@dest.example") | {"retry_base": 0} == {
        "state": "deferred",
        "attempts": 0,
        "next_attempt_at": T0 + 1,
        "reason": None,
        "updated_at": T0 + 1,
        "retry_base": 0,
        "last_reply": None,
    }
    assert rcpt(conn, "b@dest.example")["next_attempt_at"] == T0 + 9  # it did not wait
    assert rcpt(conn, "d@dest.example")["next_attempt_at"] == T0 + 9  # held: the operator's
    assert rcpt(conn, "c@other.example")["next_attempt_at"] == 9
    # an upstream's name (no dot) carries every recipient
    set_rcpt(conn, "a@dest.example", reason="suspended", next_attempt_at=T0 + 9)
    assert run(conn, ops.resume_destination, "smarthost", T0 + 2) == 2
    assert rcpt(conn, "c@other.example")["next_attempt_at"] == T0 + 2


def test_reset_destination_frees_what_waited_for_the_circuit(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@dest.example", "b@dest.example", "c@other.example"])
    set_rcpt(
        conn, "a@dest.example", state="deferred", reason="circuit open until x", next_attempt_at=9e9
    )
    set_rcpt(conn, "b@dest.example", state="deferred", reason="shaping", next_attempt_at=9e9)
    set_rcpt(conn, "c@other.example", state="deferred", reason="circuit open", next_attempt_at=9e9)
    assert ops.last_engine_command(conn) == 0
    assert run(conn, ops.reset_destination, "Dest.Example", T0) == 1
    assert (
        rcpt(conn, "a@dest.example")["next_attempt_at"],
        rcpt(conn, "a@dest.example")["reason"],
    ) == (T0, None)
    assert rcpt(conn, "a@dest.example")["updated_at"] == T0
    assert rcpt(conn, "b@dest.example")["next_attempt_at"] == 9e9
    assert rcpt(conn, "c@other.example")["next_attempt_at"] == 9e9
    run(conn, ops.engine_command, "kick", "*", T0 + 1)
    assert run(conn, ops.reset_destination, "primary", T0 + 2) == 1  # no dot: every one
    assert rcpt(conn, "c@other.example")["next_attempt_at"] == T0 + 2
    assert ops.engine_commands(conn, 0) == [
        (1, "reset", "dest.example"),
        (2, "kick", "*"),
        (3, "reset", "primary"),
    ]
    assert ops.engine_commands(conn, 2) == [(3, "reset", "primary")]
    assert ops.last_engine_command(conn) == 3
    # a claim pass's reads, in one statement: the commands and the suspensions
    run(conn, ops.suspend_destination, "dest.example", T0 + 60, "maintenance")
    run(conn, ops.suspend_destination, "late.example", T0 + 5, "")
    for after, now in ((0, T0), (2, T0), (3, T0 + 10), (0, T0 + 100)):
        assert ops.pass_reads(conn, after, now) == (
            ops.engine_commands(conn, after),
            ops.suspensions(conn, now),
        )
    assert ops.pass_reads(conn, 1, T0) == (
        [(2, "kick", "*"), (3, "reset", "primary")],
        {"dest.example": (T0 + 60, "maintenance"), "late.example": (T0 + 5, "")},
    )
    rows = [tuple(r) for r in conn.execute("SELECT at, action, name FROM engine_commands")]
    assert rows == [
        (T0, "reset", "dest.example"),
        (T0 + 1, "kick", "*"),
        (T0 + 2, "reset", "primary"),
    ]


def test_suppression_entries(conn: sqlite3.Connection) -> None:
    assert ops.suppression_version(conn) == (0, 0, 0.0)
    assert run(conn, ops.suppression_add, "A@X.test", "bounced", 5.0)
    assert run(conn, ops.suppression_add, "a@x.test", "complaint", 6.0, "ID.test", "feedback:p")
    assert run(conn, ops.suppression_add, "b@x.test", "unsub", 4.0, "id.test")
    assert ops.suppression_list(conn) == [
        {
            "address": "b@x.test",
            "scope": "id.test",
            "reason": "unsub",
            "created_at": 4.0,
            "source": "operator",
        },
        {
            "address": "a@x.test",
            "scope": "global",
            "reason": "bounced",
            "created_at": 5.0,
            "source": "operator",
        },
        {
            "address": "a@x.test",
            "scope": "id.test",
            "reason": "complaint",
            "created_at": 6.0,
            "source": "feedback:p",
        },
    ]
    # count, the lengths of the keys, the sum of the instants
    assert ops.suppression_version(conn) == (3, 38, 15.0)
    assert ops.suppression_get(conn, "A@x.test") == ("bounced", 5.0)
    assert ops.suppression_get(conn, "a@x.test", "ID.TEST") == ("bounced", 5.0)  # global first
    assert ops.suppression_get(conn, "b@x.test") is None
    assert ops.suppression_get(conn, "B@x.test", "Id.Test") == ("unsub", 4.0)
    assert ops.suppression_get(conn, "b@x.test", "other") is None
    # replacing an entry keeps one row per (address, scope)
    assert run(conn, ops.suppression_add, "a@x.test", "bounced again", 7.0)
    assert ops.suppression_get(conn, "a@x.test") == ("bounced again", 7.0)
    assert ops.suppression_version(conn) == (3, 38, 17.0)  # a re-add changes it too
    assert not run(conn, ops.suppression_remove, "a@x.test", "other.test")
    assert run(conn, ops.suppression_remove, "A@x.test", "ID.test")
    assert ops.suppression_get(conn, "a@x.test", "id.test") == ("bounced again", 7.0)
    assert run(conn, ops.suppression_remove, "a@X.test", "")
    assert ops.suppression_get(conn, "a@x.test", "id.test") is None
    assert run(conn, ops.suppression_add, "c@x.test", "r", 1.0, "s1")
    assert run(conn, ops.suppression_add, "c@x.test", "r", 1.0, "s2")
    assert run(conn, ops.suppression_remove, "C@x.test")  # every scope
    assert not run(conn, ops.suppression_remove, "c@x.test")
    assert [e["address"] for e in ops.suppression_list(conn)] == ["b@x.test"]


def test_runtime_view_oplog_and_delay_warning(conn: sqlite3.Connection) -> None:
    assert ops.get_runtime(conn, "engine") is None
    run(conn, ops.put_runtime, "engine", {"b": 1, "a": [1, 2]}, T0)
    run(conn, ops.put_runtime, "other", "x", T0)
    assert ops.get_runtime(conn, "engine") == ({"a": [1, 2], "b": 1}, T0)
    run(conn, ops.put_runtime, "engine", {"c": None}, T0 + 1)
    assert ops.get_runtime(conn, "engine") == ({"c": None}, T0 + 1)
    assert conn.execute("SELECT value FROM runtime WHERE name = 'other'").fetchone()[0] == '"x"'
    run(conn, ops.log_operator, "hold", {"ids": ["M1"], "all": False}, T0 + 2)
    assert [tuple(r) for r in conn.execute("SELECT at, action, detail FROM oplog")] == [
        (T0 + 2, "hold", json.dumps({"all": False, "ids": ["M1"]}))
    ]
    put(conn, "M1", ["a@example.org"])
    assert run(conn, ops.mark_delay_warned, "M1", T0 + 3) is True
    assert run(conn, ops.mark_delay_warned, "M1", T0 + 4) is False
    assert run(conn, ops.mark_delay_warned, "NOPE", T0 + 4) is False
    env = ops.load_envelopes(conn, ["M1", "M1", "NOPE"])
    assert env == {
        "M1": ops.Envelope(
            "M1", "m1@app.example", "app@example.com", 10, b"x", None, T0 + 3, "listener:x",
            "127.0.0.1:2525",
        )
    }  # fmt: skip


def test_load_envelopes_reads_more_than_one_chunk(conn: sqlite3.Connection) -> None:
    with db.transaction(conn):
        for i in range(1203):
            conn.execute(
                "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer,"
                " lane, identity) VALUES (?, 'm', 's', 1, 0, 'c', 'p', 'l', 'i')",
                (f"Q{i:05d}",),
            )
    ids = [f"Q{i:05d}" for i in range(1203)]
    env = ops.load_envelopes(conn, [*ids, "NOPE"])
    assert sorted(env) == ids
    assert env["Q01202"] == ops.Envelope("Q01202", "m", "s", 1, None, None, None, "c", None)


def test_daily_counts_and_record_counters(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org", "b@example.org"])
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, 10)
    ups = [
        ops.RcptUpdate(
            c.rcpt_id, "M1", RcptState.DELIVERED, True, None, "250 ok", counters=("dest:x", "id:y")
        )
        for c in claims
    ]
    assert run(conn, ops.record, ups, T0 + 5, "2023-11-14") == 2
    assert ops.daily_counts(conn, "2023-11-14") == {"dest:x": 2, "id:y": 2}
    assert ops.daily_counts(conn, "2023-11-15") == {}
    hour = int((T0 + 5) // 3600)
    assert [tuple(r) for r in conn.execute("SELECT * FROM identity_hours")] == [
        ("example.com", hour, 2, 0, 0)
    ]


def test_record_refuses_an_outcome_an_attempt_cannot_give(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org"])
    with db.transaction(conn):
        [claim] = ops.claim_due(conn, T0, 10)
    bad = ops.RcptUpdate(claim.rcpt_id, "M1", RcptState.HELD, True, None, None)
    with pytest.raises(ValueError, match="an attempt cannot make a recipient held"):
        run(conn, ops.record, [bad], T0)
    assert rcpt(conn, "a@example.org")["state"] == "sending"
    # a shaping deferral burns no attempt and keeps the last reply
    set_rcpt(conn, "a@example.org", last_reply="451 before")
    up = ops.RcptUpdate(claim.rcpt_id, "M1", RcptState.DEFERRED, False, T0 + 9, None, "shaping")
    assert run(conn, ops.record, [up], T0 + 1) == 1
    assert rcpt(conn, "a@example.org") == {
        "state": "deferred",
        "attempts": 0,
        "next_attempt_at": T0 + 9,
        "reason": "shaping",
        "updated_at": T0 + 1,
        "retry_base": None,
        "last_reply": "451 before",
    }
    assert conn.execute("SELECT count(*) FROM attempts").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM identity_hours").fetchone()[0] == 0


def test_record_keeps_the_upstream_id_and_the_attempt(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org"])
    with db.transaction(conn):
        [claim] = ops.claim_due(conn, T0, 10)
    log = ops.AttemptLog("delivered", "250 ok id=7", "smarthost", "up:25", 0.5)
    up = ops.RcptUpdate(
        claim.rcpt_id, "M1", RcptState.DELIVERED, True, None, "250 ok id=7", log=log,
        suppress=("X@Example.org", "why"), upstream_id="up-7",
    )  # fmt: skip
    assert run(conn, ops.record, [up], T0 + 3) == 1
    assert conn.execute("SELECT upstream_id FROM recipients").fetchone()[0] == "up-7"
    assert [tuple(r) for r in conn.execute("SELECT * FROM attempts")] == [
        (1, "M1", claim.rcpt_id, T0 + 3, "smarthost", "up:25", "delivered", "250 ok id=7", 0.5)
    ]
    assert [tuple(r) for r in conn.execute("SELECT * FROM suppression")] == [
        ("x@example.org", "", "why", T0 + 3, "smtp")
    ]
    assert ops.list_messages(conn, upstream_id="up-7", include_finished=True)[0]["id"] == "M1"


def test_show_message_and_message_body(conn: sqlite3.Connection) -> None:
    assert ops.show_message(conn, "NOPE") is None
    assert ops.message_body(conn, "NOPE") == (None, None)
    put(conn, "M1", ["a@example.org", "b@example.org"], body=b"prefix", body_path="bodies/M1/M1")
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, 10)
    log = ops.AttemptLog("transient", "451 later", "smarthost", "up:25", 0.25)
    ups = [
        ops.RcptUpdate(c.rcpt_id, "M1", RcptState.DEFERRED, True, T0 + 60, "451 later", log=log)
        for c in claims
    ]
    run(conn, ops.record, ups, T0 + 1)
    conn.execute(
        "INSERT INTO attempts (msg_id, rcpt_id, at, destination, outcome)"
        " VALUES ('M1', NULL, ?, 'd', 'x')",
        (T0 + 2,),
    )
    doc = ops.show_message(conn, "M1")
    assert doc is not None
    assert (doc["client"], doc["peer"], doc["identity"]) == (
        "listener:x",
        "127.0.0.1",
        "example.com",
    )
    assert doc["state"] == "deferred" and doc["attempts"] == 1
    assert doc["next_attempt_at"] == "2023-11-14T22:14:20Z"
    assert doc["attempt_log"] == [
        {
            "at": "2023-11-14T22:13:21Z",
            "recipient": addr,
            "destination": "smarthost",
            "host": "up:25",
            "outcome": "transient",
            "reply": "451 later",
            "duration": 0.25,
        }
        for addr in ("a@example.org", "b@example.org")
    ] + [
        {
            "at": "2023-11-14T22:13:22Z",
            "recipient": None,
            "destination": "d",
            "host": None,
            "outcome": "x",
            "reply": None,
            "duration": None,
        }
    ]
    assert ops.message_body(conn, "M1") == (b"prefix", "bodies/M1/M1")


def test_message_documents(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org", "b@example.org", "c@example.org"], listener=None, lane="bulk")
    set_rcpt(
        conn, "a@example.org", state="deferred", next_attempt_at=T0 + 120, attempts=2, reason="r"
    )
    set_rcpt(conn, "b@example.org", state="held", next_attempt_at=T0 + 1, attempts=5)
    set_rcpt(conn, "c@example.org", state="pending", next_attempt_at=T0 + 60)
    [doc] = ops.list_messages(conn)
    assert doc == {
        "id": "M1",
        "state": "queued",
        "message_id": "m1@app.example",
        "sender": "app@example.com",
        "size": 10,
        "created_at": "2023-11-14T22:13:20Z",
        "lane": "bulk",
        "client": "listener:x",
        "listener": None,
        "attempts": 5,
        "next_attempt_at": "2023-11-14T22:14:20Z",  # the earliest waiting one, not the held
        "recipients": [
            {
                "address": "a@example.org",
                "state": "deferred",
                "attempts": 2,
                "last_reply": None,
                "destination": "example.org",
                "next_attempt_at": "2023-11-14T22:15:20Z",
                "reason": "r",
                "upstream_id": None,
            },
            {
                "address": "b@example.org",
                "state": "held",
                "attempts": 5,
                "last_reply": None,
                "destination": "example.org",
                "next_attempt_at": None,
                "reason": None,
                "upstream_id": None,
            },
            {
                "address": "c@example.org",
                "state": "pending",
                "attempts": 0,
                "last_reply": None,
                "destination": "example.org",
                "next_attempt_at": "2023-11-14T22:14:20Z",
                "reason": None,
                "upstream_id": None,
            },
        ],
    }
    set_rcpt(conn, "a@example.org", state="held")
    set_rcpt(conn, "c@example.org", state="held")
    assert ops.list_messages(conn)[0]["next_attempt_at"] is None


def test_iter_messages_filters(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["A@One.example"], created_at=T0 - 100)
    put(conn, "M2", ["b@two.example"], created_at=T0 - 50)
    put(conn, "M3", ["c@one.example"], created_at=T0)
    set_rcpt(conn, "c@one.example", state="delivered")
    set_rcpt(conn, "b@two.example", state="failed")

    def ids(**kw: Any) -> list[str]:
        return [d["id"] for d in ops.iter_messages(conn, now=T0, **kw)]

    assert ids() == ["M1"]
    assert ids(include_finished=True) == ["M1", "M2", "M3"]
    assert ids(state="sent") == ["M3"]
    assert ids(state="failed") == ["M2"]
    assert ids(state="queued") == ["M1"]
    assert ids(recipient="a@one.EXAMPLE", include_finished=True) == ["M1"]
    assert ids(domain="ONE.example", include_finished=True) == ["M3"]  # destination as stored
    assert ids(older_than=50, include_finished=True) == ["M1", "M2"]
    assert ids(older_than=51, include_finished=True) == ["M1"]
    assert ids(queue_id="M2", include_finished=True) == ["M2"]
    assert ids(message_id="m3@app.example", include_finished=True) == ["M3"]
    assert ids(include_finished=True, limit=2) == ["M1", "M2"]
    assert ids(include_finished=True, limit=2, page=1) == ["M1", "M2"]
    assert ids(include_finished=True, page=2) == ["M1", "M2", "M3"]
    assert ids(include_finished=True, page=1, state="sent") == ["M3"]
    assert [d["id"] for d in ops.iter_messages(conn, include_finished=True)] == ["M1", "M2", "M3"]


def test_stats_and_waiting(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@one.example", "b@two.example"], created_at=T0 - 100)
    put(conn, "M2", ["c@one.example"], created_at=T0 - 10, identity="other")
    put(conn, "M3", ["d@one.example"], created_at=T0 - 300)
    set_rcpt(conn, "b@two.example", state="held")
    set_rcpt(conn, "d@one.example", state="delivered")
    run(conn, ops.suppression_add, "z@x", "r", 1.0)
    s = ops.stats(conn, now=T0)
    assert s == {
        "messages": 3,
        "recipients": {
            "pending": 2, "deferred": 0, "sending": 0, "delivered": 1, "bounced": 0,
            "failed": 0, "suppressed": 0, "held": 1,
        },
        "oldest_queued_age": 100.0,
        "suppressed_addresses": 1,
        "dedup_keys": 4,
        "destinations": {
            "one.example": {"pending": 2, "delivered": 1},
            "two.example": {"held": 1},
        },
    }  # fmt: skip
    w = ("app@example.com", "listener:x", "127.0.0.1:2525")
    assert sorted(ops.waiting_recipients(conn)) == [
        ("one.example", "a@one.example", *w),
        ("one.example", "c@one.example", *w),
        ("two.example", "b@two.example", *w),
    ]
    assert ops.waiting_per_destination(conn) == {"one.example": 2, "two.example": 1}
    assert ops.waiting_by_age(conn, T0, [60, 3600, float("inf")]) == {
        "one.example": [1, 1, 0],
        "two.example": [0, 1, 0],
    }
    assert ops.waiting_by_age(conn, T0, [10, 100, float("inf")]) == {
        "one.example": [0, 1, 1],  # exactly 10 s and 100 s old: the next bucket
        "two.example": [0, 0, 1],
    }
    empty = ops.stats(sqlite3_empty(conn), now=T0)
    assert empty["oldest_queued_age"] is None


def sqlite3_empty(conn: sqlite3.Connection) -> sqlite3.Connection:
    with db.transaction(conn):
        for t in ("attempts", "recipients", "messages"):
            conn.execute(f"DELETE FROM {t}")
    return conn


def test_feedback_readers(conn: sqlite3.Connection) -> None:
    conn.execute(
        "INSERT INTO feedback_events (provider, event_id, recipient, at, type, msg_id, rcpt_id,"
        " identity, outcome, reason) VALUES ('p', 'e1', 'a@x', 1, 'bounce', 'M1', 1, 'i',"
        " 'suppressed', 'r1'), ('p', 'e2', 'b@x', 2, 'complaint', NULL, NULL, NULL,"
        " 'unmatched', NULL)"
    )
    assert ops.feedback_events(conn, 10) == [
        {"at": 2, "provider": "p", "type": "complaint", "recipient": "b@x", "outcome": "unmatched",
         "msg_id": None, "identity": None, "reason": None},
        {"at": 1, "provider": "p", "type": "bounce", "recipient": "a@x", "outcome": "suppressed",
         "msg_id": "M1", "identity": "i", "reason": "r1"},
    ]  # fmt: skip
    assert [e["at"] for e in ops.feedback_events(conn, 1)] == [2]
    conn.execute(
        "INSERT INTO feedback_mail (at, peer, sender, rcpt, size, body, events, error) VALUES"
        " (1, 'p1', 's1', 'r1', 3, ?, 1, NULL), (2, 'p2', 's2', 'r2', 4, ?, 0,"
        " 'unreadable'), (3, 'p3', 's3', 'r3', 1, ?, 2, NULL)",
        (b"abc", b"defg", b"h"),
    )
    assert ops.feedback_mail(conn, 10, unread=True) == [
        {"id": 2, "at": 2, "peer": "p2", "sender": "s2", "rcpt": "r2", "size": 4, "events": 0,
         "error": "unreadable", "stored": 0, "truncated": False}
    ]  # fmt: skip
    assert [m["id"] for m in ops.feedback_mail(conn, 10, unread=False)] == [3, 2, 1]
    assert [m["id"] for m in ops.feedback_mail(conn, 2, unread=False)] == [3, 2]
    assert ops.feedback_mail(conn, 10, unread=False)[2] == {
        "id": 1, "at": 1, "peer": "p1", "sender": "s1", "rcpt": "r1", "size": 3, "events": 1,
        "error": None, "stored": 0, "truncated": False,
    }  # fmt: skip
    assert ops.feedback_mail_body(conn, 2) == b"defg"
    assert ops.feedback_mail_body(conn, 9) is None


def test_iso_utc_and_queue_ids() -> None:
    assert ops.iso_utc(T0) == "2023-11-14T22:13:20Z"
    assert ops.iso_utc(0) == "1970-01-01T00:00:00Z"
    qid = ops.new_queue_id(T0 + 0.0125)
    assert len(qid) == 16 and qid[:11] == f"{1_700_000_000_012:011X}"
    assert int(qid[11:], 16) < 1 << 20
    assert len({ops.new_queue_id(T0)[11:] for _ in range(20)}) > 1  # random low bits


# --- prune's side tables, the clock defaults, statement sizes (mutation survivors) ---------

DAY = 86400.0


def prune_side_tables(conn: sqlite3.Connection, now: float, retention: float) -> dict[str, Any]:
    """What prune left of the tables it trims by age alone (no message involved)."""
    with db.transaction(conn):
        assert ops.prune(conn, now, dedup_window=60, retention=retention) == []
    q = {
        "engine_commands": "SELECT at FROM engine_commands ORDER BY at",
        "feedback_events": "SELECT at FROM feedback_events ORDER BY at",
        "identity_hours": "SELECT hour FROM identity_hours ORDER BY hour",
        "identity_hours_node": "SELECT hour FROM identity_hours_node ORDER BY hour",
        "feedback_mail": "SELECT at FROM feedback_mail ORDER BY at",
        "alerts": "SELECT sent_at FROM alerts ORDER BY id",
    }
    return {t: [r[0] for r in conn.execute(sql)] for t, sql in q.items()}


def fill_side_tables(conn: sqlite3.Connection, now: float) -> int:
    hour = int(now // 3600)
    for at in (now - DAY - 1, now - DAY, now - 1):
        run(conn, ops.engine_command, "kick", "*", at)
    for i, at in enumerate((now - 30 * DAY - 1, now - 30 * DAY, now - 29 * DAY)):
        conn.execute(
            "INSERT INTO feedback_events (provider, event_id, recipient, at, type, outcome)"
            " VALUES ('p', ?, 'a@x', ?, 'bounce', 'logged')",
            (f"e{i}", at),
        )
    for h in (hour - 193, hour - 192, hour):
        conn.execute("INSERT INTO identity_hours (identity, hour) VALUES ('i', ?)", (h,))
        conn.execute(
            "INSERT INTO identity_hours_node (identity, hour, node) VALUES ('i', ?, 'n1')", (h,)
        )
    for at in (now - 10 * DAY - 1, now - 10 * DAY, now - DAY - 1, now - DAY, now):
        conn.execute(
            "INSERT INTO feedback_mail (at, peer, sender, rcpt, size, body, events)"
            " VALUES (?, 'p', 's', 'r', 1, ?, 0)",
            (at, b"a"),
        )
    for sent_at in (now - 10 * DAY - 1, now - 10 * DAY, now - DAY - 1, now - DAY, None):
        conn.execute(
            "INSERT INTO alerts (event, severity, key, count, first_at, last_at, send_at,"
            " summary, samples, sinks, next_try_at, sent_at)"
            " VALUES ('health', 'info', 'k', 1, 0, 0, 0, 's', '[]', '[]', 0, ?)",
            (sent_at,),
        )
    return hour


def test_prune_trims_each_side_table_at_its_own_horizon(conn: sqlite3.Connection) -> None:
    now = T0
    hour = fill_side_tables(conn, now)
    # retention shorter than a day: feedback mail and sent alerts are still kept a day;
    # a row exactly at a horizon stays, one a second (an hour) older goes
    assert prune_side_tables(conn, now, retention=3600) == {
        "engine_commands": [now - DAY, now - 1],
        "feedback_events": [now - 30 * DAY, now - 29 * DAY],
        "identity_hours": [hour - 192, hour],
        "identity_hours_node": [hour - 192, hour],
        "feedback_mail": [now - DAY, now],
        "alerts": [now - DAY, None],  # an alert not sent yet is never pruned
    }


def test_prune_keeps_feedback_mail_and_sent_alerts_as_long_as_messages(
    conn: sqlite3.Connection,
) -> None:
    now = T0
    hour = fill_side_tables(conn, now)
    assert prune_side_tables(conn, now, retention=10 * DAY) == {
        "engine_commands": [now - DAY, now - 1],
        "feedback_events": [now - 30 * DAY, now - 29 * DAY],
        "identity_hours": [hour - 192, hour],
        "identity_hours_node": [hour - 192, hour],
        "feedback_mail": [now - 10 * DAY, now - DAY - 1, now - DAY, now],
        "alerts": [now - 10 * DAY, now - DAY - 1, now - DAY, None],
    }


def test_hold_and_release_touch_the_given_messages_suppressed_or_not(
    conn: sqlite3.Connection,
) -> None:
    """Only `queue retry` leaves a suppressed address alone; hold and release move it."""
    put(conn, "M1", ["gone@example.org", "ok@example.org"])
    put(conn, "M2", ["other@example.org"])
    assert run(conn, ops.suppression_add, "gone@example.org", "bounced", T0)
    assert run(conn, ops.hold, ["M1", "M2"], T0 + 1) == 3
    assert run(conn, ops.release, ["M1"], T0 + 2) == 2
    for a in ("gone@example.org", "ok@example.org"):
        assert rcpt(conn, a) == {
            "state": "deferred",
            "attempts": 0,
            "next_attempt_at": T0 + 2,
            "reason": None,
            "updated_at": T0 + 2,
            "retry_base": None,
            "last_reply": None,
        }
    assert rcpt(conn, "other@example.org") == {
        "state": "held",
        "attempts": 0,
        "next_attempt_at": T0,
        "reason": None,
        "updated_at": T0 + 1,
        "retry_base": None,
        "last_reply": None,
    }


def test_a_message_without_recipients_reads_as_sent_with_no_attempts(
    conn: sqlite3.Connection,
) -> None:
    conn.execute(
        "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer, lane,"
        " identity) VALUES ('BARE', 'b@x', 's@x', 3, ?, 'c', 'p', 'bulk', 'i')",
        (T0,),
    )
    assert ops.list_messages(conn) == []  # nothing unfinished
    assert ops.list_messages(conn, include_finished=True) == [
        {
            "id": "BARE",
            "state": "sent",
            "message_id": "b@x",
            "sender": "s@x",
            "size": 3,
            "created_at": "2023-11-14T22:13:20Z",
            "lane": "bulk",
            "client": "c",
            "listener": None,
            "attempts": 0,
            "next_attempt_at": None,
            "recipients": [],
        }
    ]


def test_a_waiting_recipient_without_a_due_time_shows_none(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org", "b@example.org"])
    set_rcpt(conn, "a@example.org", state="deferred", next_attempt_at=None)
    set_rcpt(conn, "b@example.org", next_attempt_at=T0 + 60)
    [doc] = ops.list_messages(conn)
    assert doc["next_attempt_at"] == "2023-11-14T22:14:20Z"
    assert [(r["address"], r["state"], r["next_attempt_at"]) for r in doc["recipients"]] == [
        ("a@example.org", "deferred", None),
        ("b@example.org", "pending", "2023-11-14T22:14:20Z"),
    ]
    set_rcpt(conn, "b@example.org", next_attempt_at=None)
    assert ops.list_messages(conn)[0]["next_attempt_at"] is None


def test_show_message_of_a_finished_message_among_others(conn: sqlite3.Connection) -> None:
    put(conn, "M0", ["z@example.net"], created_at=T0 - 10)  # older, still queued
    put(conn, "M1", ["a@example.org"], listener=None)
    set_rcpt(conn, "a@example.org", state="delivered", attempts=1, last_reply="250 ok")
    conn.execute("UPDATE messages SET client = 'user:bob', peer = '192.0.2.7' WHERE id = 'M1'")
    assert ops.show_message(conn, "M1") == {
        "id": "M1",
        "state": "sent",
        "message_id": "m1@app.example",
        "sender": "app@example.com",
        "size": 10,
        "created_at": "2023-11-14T22:13:20Z",
        "lane": "transactional",
        "client": "user:bob",
        "listener": None,
        "attempts": 1,
        "next_attempt_at": None,
        "recipients": [
            {
                "address": "a@example.org",
                "state": "delivered",
                "attempts": 1,
                "last_reply": "250 ok",
                "destination": "example.org",
                "next_attempt_at": None,
                "reason": None,
                "upstream_id": None,
            }
        ],
        "peer": "192.0.2.7",
        "identity": "example.com",
        "attempt_log": [],
    }


def test_the_clock_is_read_when_no_instant_is_given(conn: sqlite3.Connection) -> None:
    import time

    before = time.time()
    qid = ops.new_queue_id()
    after = time.time()
    assert int(before * 1000) <= int(qid[:11], 16) <= int(after * 1000)
    put(conn, "PAST", ["a@example.org"], created_at=T0)
    put(conn, "FUTURE", ["b@example.org"], created_at=after + 3600)
    assert [d["id"] for d in ops.iter_messages(conn, older_than=0)] == ["PAST"]
    assert [d["id"] for d in ops.iter_messages(conn, older_than=3 * DAY)] == ["PAST"]
    lo = time.time() - T0
    age = ops.stats(conn)["oldest_queued_age"]
    hi = time.time() - T0
    assert round(lo, 3) <= age <= round(hi, 3)


def test_queue_health_ages(conn: sqlite3.Connection) -> None:
    assert run(conn, ops.queue_health, T0, 60) == (None, 0)
    put(conn, "M1", ["a@example.org"])
    assert run(conn, ops.queue_health, T0 + 0.25, 60) == (0.25, 0)
    assert run(conn, ops.queue_health, T0 - 5, 60) == (0.0, 0)  # the clock went back
    assert run(conn, ops.queue_health, T0 + 60, 60) == (60.0, 1)  # due for exactly 60 s


def test_stats_rounds_the_oldest_age_to_milliseconds(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@example.org"], created_at=T0 - 100)
    assert ops.stats(conn, now=T0 + 0.123456) == {
        "messages": 1,
        "recipients": {
            "pending": 1, "deferred": 0, "sending": 0, "delivered": 0, "bounced": 0,
            "failed": 0, "suppressed": 0, "held": 0,
        },
        "oldest_queued_age": 100.123,
        "suppressed_addresses": 0,
        "dedup_keys": 1,
        "destinations": {"example.org": {"pending": 1}},
    }  # fmt: skip


def test_put_runtime_stores_json_with_sorted_keys(conn: sqlite3.Connection) -> None:
    run(conn, ops.put_runtime, "engine", {"b": 1, "a": {"z": 2, "y": [3]}}, T0)
    assert conn.execute("SELECT value FROM runtime").fetchone()[0] == (
        '{"a": {"y": [3], "z": 2}, "b": 1}'
    )


class Recorder:
    """The connection, with every statement and its parameters written down."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.calls: list[tuple[str, list[Any]]] = []

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self.calls.append((sql, list(params)))
        return self.conn.execute(sql, params)


def test_load_envelopes_asks_each_id_once_at_most_500_per_statement(
    conn: sqlite3.Connection,
) -> None:
    ids = [f"Q{i:05d}" for i in range(1203)]
    with db.transaction(conn):
        conn.executemany(
            "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer,"
            " lane, identity) VALUES (?, 'm', 's', 1, 0, 'c', 'p', 'l', 'i')",
            [(i,) for i in ids],
        )
    rec = Recorder(conn)
    env = ops.load_envelopes(rec, [*ids, *ids[:10]])  # type: ignore[arg-type]
    assert sorted(env) == ids
    assert sorted(len(p) for _sql, p in rec.calls) == [203, 500, 500]
    assert sorted(i for _sql, p in rec.calls for i in p) == ids


def test_iter_messages_reads_pages_of_500(conn: sqlite3.Connection) -> None:
    ids = [f"Q{i:05d}" for i in range(1001)]
    with db.transaction(conn):
        conn.executemany(
            "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer,"
            " lane, identity) VALUES (?, 'm', 's', 1, ?, 'c', 'p', 'l', 'i')",
            [(q, T0 + n // 3) for n, q in enumerate(ids)],  # 3 messages a second
        )
        conn.executemany(
            "INSERT INTO recipients (msg_id, address, destination, lane_prio, state,"
            " dedup_key, updated_at) VALUES (?, 'a@x', 'x', 0, 'pending', ?, 0)",
            [(q, q) for q in ids],
        )
    rec = Recorder(conn)
    docs = ops.iter_messages(rec, now=T0)  # type: ignore[arg-type]
    assert next(docs)["id"] == "Q00000"
    assert len(rec.calls) == 2  # the first page and its recipients, nothing more yet
    assert [d["id"] for d in docs] == ids[1:]
    pages = [p for sql, p in rec.calls if "FROM messages m" in sql]
    assert [p[-1] for p in pages] == [500, 500, 500]  # the LIMIT of each page
    rcpt_reads = [len(p) for sql, p in rec.calls if sql.startswith("SELECT msg_id")]
    assert rcpt_reads == [500, 500, 1]


# More survivors of the spool mutation run, in-process (tests/MUTANTS.md; until issue 28 in
# tests/test_spool_mutants_more.py).
# --- the spool -----------------------------------------------------------------------------


def new_message(qid: str, address: str, key: str, created_at: float) -> ops.NewMessage:
    """One recipient under the dedup key `key`, arrived at `created_at`."""
    return dataclasses.replace(
        spool_message(qid, [address], created_at=created_at, listener=None),
        recipients=(ops.NewRecipient(address, address.rpartition("@")[2], key),),
    )


@pytest.mark.parametrize(
    ("age", "queued"),
    [(59.0, False), (60.0, True), (61.0, True)],
)
def test_the_dedup_window_ends_exactly_window_seconds_later(
    conn: sqlite3.Connection, age: float, queued: bool
) -> None:
    """A key seen `dedup_window` seconds ago or more is no longer a duplicate: the message
    is queued again (and takes the key); inside the window it is reported a duplicate."""
    run(conn, ops.accept, new_message("M1", "a@x.test", "k", T0), 60)
    res = run(conn, ops.accept, new_message("M2", "a@x.test", "k", T0 + age), 60)
    if queued:
        assert (res.queue_id, res.queued, res.duplicates) == ("M2", ("a@x.test",), ())
        row = conn.execute("SELECT msg_id, created_at FROM dedup WHERE key = 'k'").fetchone()
        assert tuple(row) == ("M2", T0 + age)
    else:
        assert (res.queue_id, res.queued, res.duplicates) == (None, (), ("a@x.test",))
    n = conn.execute("SELECT count(*) FROM recipients WHERE msg_id = 'M2'").fetchone()[0]
    assert n == (1 if queued else 0)


def test_hold_holds_the_given_messages_only(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@x.test"])
    put(conn, "M2", ["b@x.test"])
    assert run(conn, ops.hold, ["M1"], T0 + 5) == 1
    assert rcpt(conn, "a@x.test")["state"] == "held"
    assert rcpt(conn, "b@x.test")["state"] == "pending"
    assert run(conn, ops.release, ["M1"], T0 + 6) == 1
    assert rcpt(conn, "a@x.test")["state"] == "deferred"


def test_a_heartbeat_stores_the_nodes_info_with_sorted_keys(conn: sqlite3.Connection) -> None:
    """The nodes row's info is canonical JSON (sorted keys): the same facts always read
    the same in the table, whatever order the node built them in."""
    info: dict[str, Any] = {"pid": 7, "host": "h1", "version": "1", "addr": "10.0.0.1"}
    run(conn, ops.heartbeat, "n1", T0, T0 + 5, 2, info)
    stored = conn.execute("SELECT info FROM nodes WHERE name = 'n1'").fetchone()[0]
    assert stored == json.dumps(info, sort_keys=True)
    assert list(json.loads(stored)) == ["addr", "host", "pid", "version"]


# Survivors of the spool mutation run (tests/MUTANTS.md; until issue 28 in
# tests/test_spool_mutants_db.py). Spool tests run on SQLite and PostgreSQL.


def delivered(claims: list[ops.Claim]) -> list[ops.RcptUpdate]:
    return [
        ops.RcptUpdate(c.rcpt_id, c.msg_id, RcptState.DELIVERED, True, None, "250 ok")
        for c in claims
    ]


# --- ops.record: the delivered counts of a pass -------------------------------------------------


@pytest.mark.parametrize("n", [500, 501, 1001])
def test_a_pass_of_more_than_one_chunk_counts_every_delivery_once(
    conn: sqlite3.Connection, n: int
) -> None:
    """The delivered count per sending identity (the denominator of the bounce and
    complaint rates) is looked up 500 message ids at a time: the id at each chunk's edge
    is counted once, not skipped nor twice."""
    put(conn, "M1", [f"u{i}@example.org" for i in range(n - 100)], identity="a.example")
    put(conn, "M2", [f"v{i}@example.org" for i in range(100)], identity="b.example")
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, n + 10)
    assert len(claims) == n
    assert run(conn, ops.record, delivered(claims), T0 + 5) == n
    hour = int((T0 + 5) // 3600)
    rows = conn.execute(
        "SELECT identity, hour, delivered FROM identity_hours ORDER BY identity"
    ).fetchall()
    assert [tuple(r) for r in rows] == [("a.example", hour, n - 100), ("b.example", hour, 100)]


def test_an_outcome_whose_recipient_changed_meanwhile_skips_only_itself(
    conn: sqlite3.Connection,
) -> None:
    """An operator held the first recipient while its attempt ran: its outcome changes
    nothing, and the outcomes after it in the same pass are still recorded and counted."""
    put(conn, "M1", ["a@example.org", "b@example.org", "c@example.org"])
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, 10)
    by_addr = {c.address: c for c in claims}
    set_rcpt(conn, "a@example.org", state="held")
    order = [by_addr["a@example.org"], by_addr["b@example.org"], by_addr["c@example.org"]]
    assert run(conn, ops.record, delivered(order), T0 + 5) == 2
    assert rcpt(conn, "a@example.org")["state"] == "held"
    assert rcpt(conn, "b@example.org")["state"] == "delivered"
    assert rcpt(conn, "c@example.org")["state"] == "delivered"
    row = conn.execute("SELECT delivered FROM identity_hours").fetchone()
    assert row[0] == 2


# --- ops.accept: one message naming the same dedup key twice ----------------------------------


def message(
    qid: str, rcpts: list[tuple[str, str]], content_hash: str | None = None
) -> ops.NewMessage:
    return dataclasses.replace(
        new_message(qid, "unused@x.test", "unused", T0),
        recipients=tuple(
            ops.NewRecipient(a, a.rpartition("@")[2], k, content_hash) for a, k in rcpts
        ),
    )


def test_a_key_named_twice_in_one_message_queues_its_first_recipient_only(
    conn: sqlite3.Connection,
) -> None:
    """The second recipient with a key already taken by this message is a duplicate, in
    recipient order, and the recipients after it are still looked at."""
    run(conn, ops.accept, message("M0", [("old@x.test", "k-old")]), 60)
    res = run(
        conn,
        ops.accept,
        message(
            "M1",
            [("a@x.test", "k1"), ("b@x.test", "k1"), ("c@x.test", "k-old"), ("d@x.test", "k2")],
        ),
        60,
    )
    assert (res.queue_id, res.queued, res.duplicates) == (
        "M1",
        ("a@x.test", "d@x.test"),
        ("b@x.test", "c@x.test"),
    )


def test_a_conflict_queues_nothing_and_names_the_duplicates_too(
    conn: sqlite3.Connection,
) -> None:
    """An Idempotency-Key reused for other content: nothing of the message is queued; the
    result names the conflicting recipients and the plain duplicates apart."""
    run(conn, ops.accept, message("M0", [("a@x.test", "ka"), ("b@x.test", "kb")], "h1"), 60)
    res = run(
        conn,
        ops.accept,
        message("M1", [("a@x.test", "ka"), ("b@x.test", "kb")], "h2"),
        60,
    )
    assert res == ops.AcceptResult(None, (), (), ("a@x.test", "b@x.test"))
    res = run(conn, ops.accept, message("M2", [("b@x.test", "kb"), ("a@x.test", "ka")]), 60)
    assert res == ops.AcceptResult(None, (), ("b@x.test", "a@x.test"), ())
