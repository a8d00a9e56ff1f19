"""The spool, in-process, on real SQLite files: schema and pragmas, the recipient state
transitions, dedup, large bodies on disk, pruning, the group-commit writer, and the JSON the
operator CLI prints from it."""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from relay.config.tree import from_mapping
from relay.inbound.handler import InboundHandler, Suppressions
from relay.inbound.session import Envelope, Session
from relay.spool import bodies, db, dedup, ops, schema
from relay.spool.incoming import IncomingBody
from relay.spool.model import RcptState
from relay.spool.writer import Grouped, SpoolError, SpoolWriter
from tests.bodyfiles import write_body
from tests.harness import ROOT
from tests.pgserver import BACKENDS, backend_writer, open_backend

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
NS = "listener:127.0.0.1:2525"
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, spool: Path) -> Iterator[sqlite3.Connection]:
    """The spool contract: each test that takes `conn` runs on SQLite and on PostgreSQL."""
    c = cast(sqlite3.Connection, open_backend(request, spool))
    yield c
    c.close()


def new_message(
    qid: str,
    rcpts: list[str],
    *,
    message_id: str = "<m@app.example>",
    created_at: float = T0,
    body: bytes | None = b"Subject: s\r\n\r\nhi\r\n",
    body_path: str | None = None,
    lane: str = "transactional",
    sender: str = "app@example.com",
    namespace: str = NS,
) -> ops.NewMessage:
    return ops.NewMessage(
        queue_id=qid,
        message_id=dedup.normalize_message_id(message_id),
        sender=sender,
        size=len(body or b""),
        created_at=created_at,
        client=namespace,
        peer="127.0.0.1",
        lane=lane,
        lane_prio=0 if lane == "transactional" else 1,
        identity="example.com",
        body=body,
        body_path=body_path,
        recipients=tuple(
            ops.NewRecipient(r, r.rpartition("@")[2], dedup.dedup_key(namespace, message_id, r))
            for r in rcpts
        ),
    )


def accept(
    conn: sqlite3.Connection, msg: ops.NewMessage, window: float = 7 * 86400
) -> ops.AcceptResult:
    with db.transaction(conn):
        return ops.accept(conn, msg, window)


def states(conn: sqlite3.Connection, qid: str) -> dict[str, str]:
    return {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT address, state FROM recipients WHERE msg_id = ? ORDER BY id", (qid,)
        )
    }


# --- schema, migrations, pragmas -----------------------------------------------------------


def test_migrations_set_user_version_and_reopen_idempotently(spool: Path) -> None:
    c = db.connect(spool)
    assert c.execute("PRAGMA user_version").fetchone()[0] == len(db.MIGRATIONS) >= 1
    tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"messages", "recipients", "attempts", "dedup", "suppression"} <= tables
    accept(c, new_message("Q1", ["a@example.org"]))
    c.close()
    schema = sorted(
        tuple(r)
        for r in sqlite3.connect(spool / db.DB_NAME).execute(
            "SELECT type, name, sql FROM sqlite_master"
        )
    )
    for _ in range(2):  # reopening neither re-runs nor breaks a migration
        c = db.connect(spool)
        assert c.execute("PRAGMA user_version").fetchone()[0] == len(db.MIGRATIONS)
        assert db.migrate(c) == len(db.MIGRATIONS)
        assert states(c, "Q1") == {"a@example.org": "pending"}
        assert (
            sorted(tuple(r) for r in c.execute("SELECT type, name, sql FROM sqlite_master"))
            == schema
        )
        c.close()


def test_a_newer_schema_is_refused_and_a_missing_spool_is_not_created(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with pytest.raises(FileNotFoundError):
        db.connect(spool, create=False)
    assert not spool.exists()
    c = db.connect(spool)
    c.execute(f"PRAGMA user_version={len(db.MIGRATIONS) + 1}")
    c.close()
    with pytest.raises(RuntimeError, match="newer than this relay understands"):
        db.connect(spool)


def test_every_connection_is_wal_and_synchronous_full(spool: Path) -> None:
    conns = [db.connect(spool), db.connect(spool, create=False)]
    try:
        for c in conns:
            assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert c.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
            assert c.execute("PRAGMA foreign_keys").fetchone()[0] == 1
            assert c.execute("PRAGMA busy_timeout").fetchone()[0] == db.BUSY_TIMEOUT_MS
    finally:
        for c in conns:
            c.close()
    assert (spool / "relay.sqlite").exists()


def test_transaction_rolls_back_on_error(conn: sqlite3.Connection) -> None:
    with pytest.raises(ZeroDivisionError), db.transaction(conn):
        ops.accept(conn, new_message("Q1", ["a@example.org"]), 60)
        _ = 1 / 0
    assert conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 0
    assert not conn.in_transaction


def test_one_process_never_makes_the_same_queue_id_twice() -> None:
    # 200,000 ids in one millisecond: 20 random bits each collided by the birthday rule
    # (a burst of 9 in a millisecond: 1 in 30,000; a fleet drain's fill met one)
    ids = [ops.new_queue_id(T0) for _ in range(200_000)]
    assert len(set(ids)) == len(ids)


def test_a_forked_child_starts_its_queue_ids_elsewhere() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id's low bits, then out without cleanup
        os.write(write, ops.new_queue_id(T0)[11:].encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 16).decode()
    os.close(read)
    os.waitpid(pid, 0)
    mine = ops.new_queue_id(T0)[11:]
    # the parent's next id follows its own counter; the child's started at random (equal
    # by chance once in 2^20, before the parent moved on by one)
    assert child != mine


def test_queue_ids_sort_by_arrival() -> None:
    ids = [ops.new_queue_id(T0 + i / 1000) for i in range(200)]
    assert all(re.fullmatch(r"[0-9A-Z]{16}", i) for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert ops.new_queue_id(T0) < ops.new_queue_id(T0 + 0.001) < ops.new_queue_id(T0 + 86400)


# --- accept, claim, record, recover ---------------------------------------------------------


def test_recipient_lifecycle(conn: sqlite3.Connection) -> None:
    res = accept(
        conn,
        new_message("Q1", ["a@example.org", "b@example.org", "c@example.org", "d@example.org"]),
    )
    assert res == ops.AcceptResult(
        "Q1", ("a@example.org", "b@example.org", "c@example.org", "d@example.org"), ()
    )
    assert set(states(conn, "Q1").values()) == {"pending"}
    assert conn.execute("SELECT count(*) FROM dedup").fetchone()[0] == 4

    # not due before created_at
    with db.transaction(conn):
        assert ops.claim_due(conn, T0 - 1, 10) == []
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, 10)
    assert [c.address for c in claims] == [
        "a@example.org",
        "b@example.org",
        "c@example.org",
        "d@example.org",
    ]
    assert set(states(conn, "Q1").values()) == {"sending"}
    with db.transaction(conn):  # a claimed recipient is not claimed twice
        assert ops.claim_due(conn, T0 + 10, 10) == []
    by = {c.address: c for c in claims}

    def out(addr: str, state: RcptState, **kw: Any) -> ops.RcptUpdate:
        c = by[addr]
        return ops.RcptUpdate(
            rcpt_id=c.rcpt_id,
            msg_id="Q1",
            state=state,
            count_attempt=True,
            log=ops.AttemptLog(
                state.value, kw.get("last_reply"), "smarthost", "up[127.0.0.1]:25", 0.1
            ),
            **{"next_attempt_at": None, "last_reply": None, **kw},
        )

    with db.transaction(conn):
        changed = ops.record(
            conn,
            [
                out("a@example.org", RcptState.DELIVERED, last_reply="250 2.0.0 ok"),
                out(
                    "b@example.org",
                    RcptState.DEFERRED,
                    next_attempt_at=T0 + 60,
                    last_reply="451 4.3.0 later",
                ),
                out(
                    "c@example.org",
                    RcptState.BOUNCED,
                    last_reply="550 5.1.1 no such user",
                    suppress=("C@Example.org", "550 5.1.1 no such user"),
                ),
            ],
            T0 + 1,
            "2023-11-14",
        )
    assert changed == 3
    assert states(conn, "Q1") == {
        "a@example.org": "delivered",
        "b@example.org": "deferred",
        "c@example.org": "bounced",
        "d@example.org": "sending",
    }
    assert ops.suppression_get(conn, "c@example.org") == ("550 5.1.1 no such user", T0 + 1)
    assert conn.execute("SELECT count(*) FROM attempts WHERE msg_id='Q1'").fetchone()[0] == 3
    row = conn.execute(
        "SELECT attempts, next_attempt_at, last_reply FROM recipients WHERE address='b@example.org'"
    ).fetchone()
    assert tuple(row) == (1, T0 + 60, "451 4.3.0 later")

    # an outcome for a recipient that is no longer `sending` changes nothing
    with db.transaction(conn):
        assert ops.record(conn, [out("a@example.org", RcptState.FAILED)], T0 + 2) == 0
    assert states(conn, "Q1")["a@example.org"] == "delivered"

    # the deferred one is due at its time, not before
    with db.transaction(conn):
        assert ops.claim_due(conn, T0 + 59, 10) == []
    with db.transaction(conn):
        again = ops.claim_due(conn, T0 + 60, 10)
    assert [(c.address, c.attempts) for c in again] == [("b@example.org", 1)]

    # a crash: every `sending` comes back deferred, due now
    with db.transaction(conn):
        assert ops.recover(conn, T0 + 100) == 2
    assert states(conn, "Q1") == {
        "a@example.org": "delivered",
        "b@example.org": "deferred",
        "c@example.org": "bounced",
        "d@example.org": "deferred",
    }
    rows = conn.execute(
        "SELECT next_attempt_at, reason FROM recipients WHERE state = 'deferred'"
    ).fetchall()
    assert [tuple(r) for r in rows] == [(T0 + 100, "recovered after restart")] * 2
    with db.transaction(conn):
        assert ops.recover(conn, T0 + 101) == 0
    with db.transaction(conn):
        assert {c.address for c in ops.claim_due(conn, T0 + 100, 10)} == {
            "b@example.org",
            "d@example.org",
        }


def _outcome(c: ops.Claim, state: RcptState, qid: str) -> ops.RcptUpdate:
    return ops.RcptUpdate(
        rcpt_id=c.rcpt_id,
        msg_id=qid,
        state=state,
        count_attempt=True,
        next_attempt_at=T0 + 60 if state is RcptState.DEFERRED else None,
        last_reply="451 4.3.0 later" if state is RcptState.DEFERRED else None,
    )


def test_a_hold_during_the_attempt_holds_the_recipient_when_it_ends_undelivered(
    conn: sqlite3.Connection,
) -> None:
    """A `queue hold` that meets recipients in their attempt (`sending`) cannot take them
    out of it: it marks them, and the attempt's end makes a deferred one `held` (on both
    paths of a record: one call alone, and the writer's group of several), while a delivery
    or a bounce stands. A release before the end takes the mark off. Before, such a hold
    changed nothing and the recipient was retried."""
    rcpts = [f"{c}@example.org" for c in "abcdef"]
    accept(conn, new_message("H1", rcpts))
    with db.transaction(conn):
        by = {c.address: c for c in ops.claim_due(conn, T0, 10)}
    with db.transaction(conn):  # the dry run counts what the hold then does
        dry = ops.bulk(conn, "hold", ["H1"], T0, dry_run=True)
    assert (dry.messages, dry.recipients, dry.after_attempt) == (("H1",), 0, 6)
    with db.transaction(conn):
        res = ops.bulk(conn, "hold", ["H1"], T0)
    assert (res.messages, res.recipients, res.after_attempt) == (("H1",), 0, 6)
    assert set(states(conn, "H1").values()) == {"sending"}  # the attempts go on
    with db.transaction(conn):  # holding again marks nothing more
        assert ops.bulk(conn, "hold", ["H1"], T0).after_attempt == 0
    with db.transaction(conn):  # f: released before its attempt ends
        res = ops.bulk(conn, "release", ["H1"], T0, recipient="f@example.org")
    assert (res.recipients, res.after_attempt) == (0, 1)
    with db.transaction(conn):  # one call alone (SQLite: one by one)
        n = ops.record(
            conn,
            [
                _outcome(by["a@example.org"], RcptState.DELIVERED, "H1"),
                _outcome(by["b@example.org"], RcptState.DEFERRED, "H1"),
                _outcome(by["c@example.org"], RcptState.BOUNCED, "H1"),
            ],
            T0 + 1,
        )
    assert n == 3
    with db.transaction(conn):  # the writer's group of two calls (SQLite: one statement)
        counts = ops.record_many(
            conn,
            [
                ([_outcome(by["d@example.org"], RcptState.DEFERRED, "H1")], T0 + 2, None),
                ([_outcome(by["f@example.org"], RcptState.DEFERRED, "H1")], T0 + 2, None),
            ],
        )
    assert counts == [1, 1]
    assert states(conn, "H1") == {
        "a@example.org": "delivered",
        "b@example.org": "held",
        "c@example.org": "bounced",
        "d@example.org": "held",
        "e@example.org": "sending",
        "f@example.org": "deferred",  # its mark was taken off
    }
    # the attempt was counted and its reply kept, as for any deferral
    row = conn.execute(
        "SELECT attempts, last_reply FROM recipients WHERE address = 'b@example.org'"
    ).fetchone()
    assert tuple(row) == (1, "451 4.3.0 later")
    with db.transaction(conn):  # a crash during e's attempt: it comes back held
        assert ops.recover(conn, T0 + 3) == 1
    assert states(conn, "H1")["e@example.org"] == "held"
    assert conn.execute("SELECT count(*) FROM recipients WHERE hold_after <> 0").fetchone()[0] == 0
    with db.transaction(conn):  # nothing held is claimed (f is); a release brings them back
        assert [c.address for c in ops.claim_due(conn, T0 + 100, 10)] == ["f@example.org"]
        assert ops.bulk(conn, "release", ["H1"], T0 + 100).recipients == 3
    with db.transaction(conn):  # a stale mark (an older node ignored it) dies with a claim
        conn.execute("UPDATE recipients SET hold_after = 1 WHERE address = 'b@example.org'")
        again = {c.address: c for c in ops.claim_due(conn, T0 + 100, 10)}
    assert set(again) == {"b@example.org", "d@example.org", "e@example.org"}
    with db.transaction(conn):
        ops.record(conn, [_outcome(again["b@example.org"], RcptState.DEFERRED, "H1")], T0 + 101)
    assert states(conn, "H1")["b@example.org"] == "deferred"


def test_an_expired_lease_of_a_held_recipient_gives_it_back_held(
    conn: sqlite3.Connection,
) -> None:
    """A node that dies during an attempt its operator held: the claim comes back `held`
    when its lease runs out, not due (and so does a claim the node never dispatched)."""
    accept(conn, new_message("H2", ["a@example.org", "b@example.org"]))
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, 10, owner="node-a", lease_until=T0 + 30)
    assert len(claims) == 2
    with db.transaction(conn):
        ops.bulk(conn, "hold", ["H2"], T0 + 1, recipient="a@example.org")
    with db.transaction(conn):
        assert ops.reclaim_expired(conn, T0 + 31, "node-b", "2023-11-14") == 2
    assert states(conn, "H2") == {"a@example.org": "held", "b@example.org": "deferred"}
    accept(conn, new_message("H3", ["c@example.org"], message_id="<h3@app.example>"))
    with db.transaction(conn):  # b (due again) and c, in one claim pass stamped T0 + 40
        claims = ops.claim_due(conn, T0 + 40, 10, owner="node-a", lease_until=T0 + 70)
    assert {c.address for c in claims} == {"b@example.org", "c@example.org"}
    with db.transaction(conn):
        ops.bulk(conn, "hold", ["H3"], T0 + 41)
    with db.transaction(conn):  # the pass's commit was never confirmed: both given back
        assert ops.release_unclaimed(conn, "node-a", [T0 + 40], T0 + 42) == 2
    assert states(conn, "H3") == {"c@example.org": "held"}
    assert states(conn, "H2")["b@example.org"] == "deferred"


def test_claim_takes_transactional_before_bulk_and_respects_the_limit(
    conn: sqlite3.Connection,
) -> None:
    accept(
        conn,
        new_message("B1", ["x@example.org"], message_id="<b1@x>", lane="bulk", created_at=T0 - 10),
    )
    accept(conn, new_message("T1", ["y@example.org"], message_id="<t1@x>", created_at=T0))
    accept(conn, new_message("T2", ["z@example.org"], message_id="<t2@x>", created_at=T0 - 5))
    with db.transaction(conn):
        first = ops.claim_due(conn, T0, 2)
    assert [c.msg_id for c in first] == ["T2", "T1"]
    assert [(c.lane, c.identity) for c in first] == [("transactional", "example.com")] * 2
    with db.transaction(conn):
        assert [c.msg_id for c in ops.claim_due(conn, T0, 2)] == ["B1"]


def test_claim_leaves_waiting_destinations_in_the_spool_except_expired(
    conn: sqlite3.Connection,
) -> None:
    """A destination whose circuit is open is not claimed and written back on every pass
    (the churn that slowed acceptance behind a dead upstream); only what is past max_age
    is claimed, to be dead-lettered on time."""
    accept(conn, new_message("OLD", ["a@dead.example"], message_id="<o@x>", created_at=T0 - 900))
    accept(conn, new_message("NEW", ["b@dead.example"], message_id="<n@x>", created_at=T0 - 10))
    accept(conn, new_message("LIVE", ["c@live.example"], message_id="<l@x>", created_at=T0 - 5))
    waiting = [(0, "dead.example"), (1, "dead.example")]
    with db.transaction(conn):
        got = ops.claim_due(conn, T0, 10, waiting=waiting)
    assert [c.msg_id for c in got] == ["LIVE"]
    with db.transaction(conn):  # an expiry pass: max_age 600 s -> only OLD is due to die
        got = ops.claim_due(conn, T0, 10, waiting=waiting, expired_before=T0 - 600)
    assert [c.msg_id for c in got] == ["OLD"]
    with db.transaction(conn):  # every lane of every domain waits: nothing, no query
        assert ops.claim_due(conn, T0, 10, waiting=[(0, None), (1, None)]) == []
        got = ops.claim_due(conn, T0, 10, waiting=[(0, None)], expired_before=T0 - 600)
        assert got == []  # NEW is in the waiting transactional lane and not expired
        got = ops.claim_due(conn, T0, 10, waiting=[(1, None)])
    assert [c.msg_id for c in got] == ["NEW"]  # only bulk waits now
    states = dict(conn.execute("SELECT msg_id, state FROM recipients").fetchall())
    assert states == {"OLD": "sending", "NEW": "sending", "LIVE": "sending"}


def test_summary_and_stats_aggregates(conn: sqlite3.Connection) -> None:
    accept(conn, new_message("A", ["a@one.example"], message_id="<a@x>", created_at=T0 - 10))
    accept(conn, new_message("B", ["b@one.example"], message_id="<b@x>", created_at=T0 - 400))
    accept(conn, new_message("C", ["c@two.example"], message_id="<c@x>", created_at=T0 - 5000))
    accept(conn, new_message("D", ["d@two.example"], message_id="<d@x>", created_at=T0 - 300))
    with db.transaction(conn):  # C is finished: neither counted nor the oldest
        (cl,) = [c for c in ops.claim_due(conn, T0, 10) if c.msg_id == "C"] or [None]
        conn.execute("UPDATE recipients SET state = 'deferred' WHERE msg_id != 'C'")
        assert cl is not None
        ops.record(conn, [ops.RcptUpdate(cl.rcpt_id, "C", RcptState.DELIVERED, True, None, "")], T0)
    limits = [300.0, 3600.0, float("inf")]
    # bucket i: age < limits[i]; D is exactly 300 s old: the second bucket
    assert ops.waiting_by_age(conn, T0, limits) == {
        "one.example": [1, 1, 0],
        "two.example": [0, 1, 0],
    }
    st = ops.stats(conn, T0)
    assert st["oldest_queued_age"] == 400.0
    assert st["destinations"] == {
        "one.example": {"deferred": 2},
        "two.example": {"delivered": 1, "deferred": 1},
    }


def test_message_state_is_derived_from_recipients(conn: sqlite3.Connection) -> None:
    accept(conn, new_message("Q1", ["a@example.org", "b@example.org"]))
    assert ops.list_messages(conn, now=T0)[0]["state"] == "queued"
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0, 1)
    assert ops.list_messages(conn, now=T0)[0]["state"] == "sending"
    with db.transaction(conn):
        ops.record(
            conn,
            [ops.RcptUpdate(claims[0].rcpt_id, "Q1", RcptState.DELIVERED, True, None, "250 ok")],
            T0,
        )
    assert ops.list_messages(conn, now=T0)[0]["state"] == "queued"  # b still pending
    with db.transaction(conn):
        c2 = ops.claim_due(conn, T0, 1)
        ops.record(
            conn, [ops.RcptUpdate(c2[0].rcpt_id, "Q1", RcptState.FAILED, True, None, "554 no")], T0
        )
    assert ops.list_messages(conn, now=T0) == []  # finished: not listed by default
    assert ops.list_messages(conn, include_finished=True, now=T0)[0]["state"] == "failed"


# --- dedup -------------------------------------------------------------------------------------


def test_accept_dedups_per_recipient(conn: sqlite3.Connection) -> None:
    assert accept(conn, new_message("Q1", ["a@example.org"])).queue_id == "Q1"
    # same Message-ID and recipient: nothing queued
    res = accept(conn, new_message("Q2", ["A@Example.org"], created_at=T0 + 5))
    assert res == ops.AcceptResult(None, (), ("A@Example.org",))
    assert conn.execute("SELECT count(*) FROM messages WHERE id='Q2'").fetchone()[0] == 0
    # same Message-ID, one old and one new recipient: only the new one
    res = accept(conn, new_message("Q3", ["a@example.org", "b@example.org"], created_at=T0 + 6))
    assert res == ops.AcceptResult("Q3", ("b@example.org",), ("a@example.org",))
    assert states(conn, "Q3") == {"b@example.org": "pending"}
    # the same recipient twice in one envelope is queued once
    res = accept(
        conn,
        new_message(
            "Q4", ["c@example.org", "C@example.org"], message_id="<other@x>", created_at=T0 + 7
        ),
    )
    assert res.queued == ("c@example.org",) and res.duplicates == ("C@example.org",)
    # another namespace (listener or user) is not a duplicate
    res = accept(
        conn, new_message("Q5", ["a@example.org"], namespace="user:bob", created_at=T0 + 8)
    )
    assert res.queue_id == "Q5"


def test_dedup_window_expiry(conn: sqlite3.Connection) -> None:
    window = 2.0
    assert accept(conn, new_message("Q1", ["a@example.org"]), window).queue_id == "Q1"
    assert (
        accept(conn, new_message("Q2", ["a@example.org"], created_at=T0 + 1.9), window).queue_id
        is None
    )
    # past the window the key is forgotten: queued again, and remembered anew from then
    assert (
        accept(conn, new_message("Q3", ["a@example.org"], created_at=T0 + 2.5), window).queue_id
        == "Q3"
    )
    assert (
        accept(conn, new_message("Q4", ["a@example.org"], created_at=T0 + 4.0), window).queue_id
        is None
    )
    assert (
        accept(conn, new_message("Q5", ["a@example.org"], created_at=T0 + 4.6), window).queue_id
        == "Q5"
    )
    # prune forgets expired keys only
    with db.transaction(conn):
        ops.prune(conn, T0 + 5.0, window, retention=86400)
    assert [r[0] for r in conn.execute("SELECT msg_id FROM dedup")] == ["Q5"]


# --- bodies on disk ----------------------------------------------------------------------------


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every os.fsync, as the path of the file or folder it synced."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


async def test_large_body_file_is_on_disk_before_its_row(spool: Path, fsyncs: list[str]) -> None:
    """Through the real inbound hook: a body above inline_max goes to a file that is
    written and fsync'd before the job that inserts its row runs."""
    cfg = from_mapping(
        {"hostname": "relay.test", "spool": {"path": str(spool), "inline_max": "1KiB"}}, spool
    )
    at_insert: list[dict[str, Any]] = []

    class Watching(SpoolWriter):
        async def run(self, job: Any) -> Any:
            def watched(c: sqlite3.Connection) -> Any:
                files = (
                    {
                        str(p.relative_to(spool)): p.read_bytes()
                        for p in (spool / "bodies").glob("*/*")
                    }
                    if (spool / "bodies").exists()
                    else {}
                )
                at_insert.append({"files": files, "fsyncs": list(fsyncs)})
                return job(c)

            return await super().run(watched)

    writer = Watching(spool)
    writer.start()
    try:
        handler = InboundHandler(cfg, cfg.listen[0], writer, Suppressions())

        async def deliver(content: bytes) -> str:
            """What the inbound does with the data once the parser has it (accept_stream)."""
            session = Session()
            session.peer = ("127.0.0.1", 40000)
            session.host_name = "client.test"
            session.extended_smtp = True
            env = Envelope()
            env.mail_from = "app@example.com"
            env.rcpt_tos = ["user@example.org"]
            incoming = IncomingBody(cfg.spool_path, cfg.inline_max)
            for i in range(0, len(content), 4096):
                await incoming.add(content[i : i + 4096])
            return await handler.accept_stream(session, env, incoming, 0)

        big = b"Subject: big\r\nMessage-ID: <big@app.example>\r\n\r\n" + b"y" * 50_000 + b"\r\n"
        status = await deliver(big)
        assert status.startswith("250 2.0.0 Ok: queued as ")
        qid = status.rsplit(" ", 1)[1]
        small = b"Subject: small\r\nMessage-ID: <small@app.example>\r\n\r\nhi\r\n"
        status2 = await deliver(small)
        assert status2.startswith("250 2.0.0 Ok: queued as ")
        qid2 = status2.rsplit(" ", 1)[1]
    finally:
        writer.close()

    c = db.connect(spool)
    try:
        raw, rel = ops.message_body(c, qid)
        raw2, rel2 = ops.message_body(c, qid2)
    finally:
        c.close()
    # the row holds our prefix, the file exactly the data (never copied to prepend it)
    assert raw is not None and raw.startswith(b"Received: ") and rel == f"bodies/{qid[:2]}/{qid}"
    stored = (spool / rel).read_bytes()
    assert stored == big
    assert bodies.load(spool, raw, rel) == raw + big
    # when the accept job ran, the file was complete and both it and its folder fsync'd
    insert = next(s for s in at_insert if rel in s["files"])
    assert insert["files"][rel] == stored
    folder = str((spool / rel).parent.resolve())
    assert folder in insert["fsyncs"]
    assert any("/bodies/tmp/" in f for f in insert["fsyncs"])  # the file itself, before rename
    # the small one stayed inline: no file
    assert rel2 is None and raw2 is not None and raw2.endswith(small)
    assert not list((spool / "bodies").glob(f"*/{qid2}"))


def test_orphan_sweep(spool: Path) -> None:
    keep = write_body(spool, "KEEP0001", b"referenced")
    orphan = write_body(spool, "ORPH0001", b"nobody names me")
    fresh = write_body(spool, "FRSH0001", b"a write in flight")
    tmp = spool / "bodies" / "OR" / ".ORPH0002.tmp"  # a crash in the middle of a write
    tmp.write_bytes(b"half")
    old = time.time() - 3600
    for p in (keep, orphan):
        os.utime(spool / p, (old, old))
    os.utime(tmp, (old, old))
    removed = bodies.sweep(spool, known={keep}, grace=60)
    assert sorted(removed) == sorted([orphan, str(tmp.relative_to(spool))])
    assert (spool / keep).read_bytes() == b"referenced"
    assert (spool / fresh).exists()  # younger than the grace period
    assert not (spool / orphan).exists() and not tmp.exists()
    assert bodies.sweep(spool / "nothing-here", known=set()) == []


def test_prune_removes_old_finished_messages_and_expired_dedup_keys(
    conn: sqlite3.Connection, spool: Path
) -> None:
    day = 86400.0
    now = T0 + 30 * day
    rel = write_body(spool, "OLDDONE1", b"big old body")
    accept(
        conn,
        new_message(
            "OLDDONE1",
            ["a@example.org"],
            message_id="<1@x>",
            created_at=now - 10 * day,
            body=None,
            body_path=rel,
        ),
    )
    accept(
        conn,
        new_message("OLDWAIT1", ["b@example.org"], message_id="<2@x>", created_at=now - 10 * day),
    )
    accept(
        conn,
        new_message("NEWDONE1", ["c@example.org"], message_id="<3@x>", created_at=now - 1 * day),
    )
    # finish OLDDONE1 and NEWDONE1 (delivered, with an attempt logged); OLDWAIT1 deferred
    with db.transaction(conn):
        claims = ops.claim_due(conn, now, 10)
        ops.record(
            conn,
            [
                ops.RcptUpdate(
                    c.rcpt_id,
                    c.msg_id,
                    RcptState.DEFERRED if c.msg_id == "OLDWAIT1" else RcptState.DELIVERED,
                    True,
                    now + 60 if c.msg_id == "OLDWAIT1" else None,
                    "reply",
                    log=ops.AttemptLog("x", "reply", "smarthost", None, 0.0),
                )
                for c in claims
            ],
            now,
        )
    with db.transaction(conn):
        paths = ops.prune(conn, now, dedup_window=7 * day, retention=7 * day)
    assert paths == [rel]
    left = {r[0] for r in conn.execute("SELECT id FROM messages")}
    assert left == {"OLDWAIT1", "NEWDONE1"}
    for table in ("recipients", "attempts"):
        assert (
            conn.execute(f"SELECT count(*) FROM {table} WHERE msg_id = 'OLDDONE1'").fetchone()[0]
            == 0
        )
    # dedup keys older than the window are gone, the fresh one stays
    assert [r[0] for r in conn.execute("SELECT msg_id FROM dedup")] == ["NEWDONE1"]
    assert ops.body_paths(conn) == set()


def test_prune_finished_deletes_at_most_its_limit_and_says_how_many(
    conn: sqlite3.Connection,
) -> None:
    """The daemon repeats the batch while it comes back full (relay/daemon.py _prune)."""
    day = 86400.0
    now = T0 + 30 * day
    for i in range(5):
        accept(conn, new_message(f"DONE{i}", [f"u{i}@example.org"], message_id=f"<{i}@x>"))
    conn.execute("UPDATE recipients SET state = 'delivered'")
    with db.transaction(conn):
        assert ops.prune_finished(conn, now, 7 * day, limit=2) == (2, [])
    with db.transaction(conn):
        assert ops.prune_finished(conn, now, 7 * day, limit=2)[0] == 2
    with db.transaction(conn):
        assert ops.prune_finished(conn, now, 7 * day, limit=2)[0] == 1  # short: none left
    assert conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 0


# --- the group-commit writer ------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def writer(request: pytest.FixtureRequest, spool: Path) -> Iterator[SpoolWriter]:
    w = cast(SpoolWriter, backend_writer(request, spool))
    w.start()
    yield w
    w.close()


class Blocker:
    """A job that holds the writer thread until `release` is set: what is queued meanwhile
    shares the next batch."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, _c: sqlite3.Connection) -> str:
        self.started.set()
        assert self.release.wait(30)
        return "blocked"


async def test_accepts_gather_after_a_shared_batch_on_either_backend(writer: SpoolWriter) -> None:
    """spool.gather (relay/spool/writer.py) on SQLite and on PostgreSQL: after a batch of
    several jobs, a batch an accept opens waits for more; one that comes 0.1 s later joins."""
    writer.gather = lambda: 0.5

    def same(_c: sqlite3.Connection, args: list[str]) -> list[str]:
        return args

    def accept(v: str) -> Grouped[str]:
        return Grouped(same, v, sqlite=True, gather=True)

    blocker = Blocker()
    gate = asyncio.ensure_future(writer.run(blocker))
    assert await asyncio.to_thread(blocker.started.wait, 30)
    shared = [asyncio.ensure_future(writer.run(accept(v))) for v in ("a", "b")]
    await asyncio.sleep(0.05)
    blocker.release.set()
    assert await gate == "blocked" and await asyncio.gather(*shared) == ["a", "b"]
    batches = writer.batches
    c = asyncio.ensure_future(writer.run(accept("c")))
    await asyncio.sleep(0.1)
    d = asyncio.ensure_future(writer.run(accept("d")))
    assert await asyncio.wait_for(asyncio.gather(c, d), 30) == ["c", "d"]
    assert writer.batches == batches + 1  # "d" joined the batch "c" opened


async def test_a_failing_job_fails_alone_and_the_batch_commits(
    writer: SpoolWriter, spool: Path
) -> None:
    blocker = Blocker()
    first = asyncio.ensure_future(writer.run(blocker))
    assert await asyncio.to_thread(blocker.started.wait, 30)
    # queued while the thread is busy: these three share the next batch
    good1 = asyncio.ensure_future(
        writer.run(
            lambda c: ops.accept(c, new_message("G1", ["a@example.org"], message_id="<g1@x>"), 60)
        )
    )

    def bad(c: sqlite3.Connection) -> None:
        ops.accept(c, new_message("BAD", ["b@example.org"], message_id="<bad@x>"), 60)
        # the same queue id again: a constraint violation after a successful insert
        ops.accept(c, new_message("BAD", ["c@example.org"], message_id="<bad2@x>"), 60)

    failing = asyncio.ensure_future(writer.run(bad))
    good2 = asyncio.ensure_future(
        writer.run(
            lambda c: ops.accept(c, new_message("G2", ["d@example.org"], message_id="<g2@x>"), 60)
        )
    )
    await asyncio.sleep(0.05)
    blocker.release.set()
    assert await first == "blocked"
    assert (await good1).queue_id == "G1"
    assert (await good2).queue_id == "G2"
    with pytest.raises(SpoolError, match=r"UNIQUE constraint failed|duplicate key value"):
        await failing
    assert writer.batches == 2 and writer.jobs == 4
    assert writer.healthy
    # what another connection sees: both good jobs committed, nothing of the bad one
    other = db.open_spool(spool, writer.pg)
    try:
        assert {r[0] for r in other.execute("SELECT id FROM messages")} == {"G1", "G2"}
        assert {r[0] for r in other.execute("SELECT address FROM recipients")} == {
            "a@example.org",
            "d@example.org",
        }
        assert other.execute("SELECT count(*) FROM dedup").fetchone()[0] == 2
    finally:
        other.close()


async def test_group_commit_batches_concurrent_accepts(writer: SpoolWriter, spool: Path) -> None:
    n = 200
    results = await asyncio.gather(
        *(
            writer.run(
                lambda c, i=i: ops.accept(
                    c, new_message(f"Q{i:04d}", [f"u{i}@example.org"], message_id=f"<{i}@x>"), 60
                )
            )
            for i in range(n)
        )
    )
    assert [r.queue_id for r in results] == [f"Q{i:04d}" for i in range(n)]
    assert writer.jobs == n
    assert 1 <= writer.batches < n
    other = db.open_spool(spool, writer.pg)
    try:
        assert other.execute("SELECT count(*) FROM messages").fetchone()[0] == n
        assert other.execute("SELECT count(*) FROM recipients").fetchone()[0] == n
    finally:
        other.close()


async def test_a_locked_spool_fails_the_job_and_the_writer_recovers(
    spool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "BUSY_TIMEOUT_MS", 300)  # the daemon waits 5 s; keep this quick
    w = SpoolWriter(spool)
    w.start()
    try:
        locker = sqlite3.connect(spool / db.DB_NAME, isolation_level=None, timeout=10)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(SpoolError, match="locked"):
                await w.run(lambda c: ops.accept(c, new_message("L1", ["a@example.org"]), 60))
            assert not w.healthy and w.failures >= 1
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        res = await w.run(lambda c: ops.accept(c, new_message("L2", ["a@example.org"]), 60))
        assert res.queue_id == "L2"  # nothing of L1 was kept: no dedup hit
        assert w.healthy
        assert w.run_sync(lambda c: c.execute("SELECT count(*) FROM messages").fetchone()[0]) == 1
    finally:
        w.close()


# --- the operator CLI's JSON over this spool -------------------------------------------------


def _cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "relay", *args, "-c", str(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def populated(tmp_path: Path, spool: Path) -> Path:
    """A config over a spool with a deferred message (one attempt logged), a delivered one,
    and a held one; returns the config path."""
    cfg = tmp_path / "relay.yaml"
    cfg.write_text(yaml.safe_dump({"spool": {"path": "spool"}}))
    now = time.time()
    c = db.connect(spool)
    try:
        body = (
            b"From: app@example.com\r\nSubject: Deferred one\r\n"
            b"Message-ID: <def@app.example>\r\n\r\nSECRET BODY TEXT\r\n"
        )
        accept(
            c,
            new_message(
                "DEFER0000000001",
                ["a@example.org", "b@example.org"],
                message_id="<def@app.example>",
                created_at=now - 120,
                body=body,
            ),
        )
        accept(
            c,
            new_message(
                "SENT00000000001", ["c@example.org"], message_id="<sent@x>", created_at=now - 60
            ),
        )
        accept(
            c,
            new_message(
                "HELD00000000001",
                ["d@example.org"],
                message_id="<held@x>",
                created_at=now - 30,
                sender="",
            ),
        )
        with db.transaction(c):
            claims = {cl.address: cl for cl in ops.claim_due(c, now, 10)}
            ops.record(
                c,
                [
                    ops.RcptUpdate(
                        claims["a@example.org"].rcpt_id,
                        "DEFER0000000001",
                        RcptState.DEFERRED,
                        True,
                        now + 300,
                        "451 4.7.1 try later",
                        log=ops.AttemptLog(
                            "transient",
                            "451 4.7.1 try later",
                            "smarthost",
                            "up[127.0.0.1]:25",
                            0.25,
                        ),
                    ),
                    ops.RcptUpdate(
                        claims["b@example.org"].rcpt_id,
                        "DEFER0000000001",
                        RcptState.DELIVERED,
                        True,
                        None,
                        "250 2.0.0 ok",
                        log=ops.AttemptLog(
                            "delivered", "250 2.0.0 ok", "smarthost", "up[127.0.0.1]:25", 0.2
                        ),
                    ),
                    ops.RcptUpdate(
                        claims["c@example.org"].rcpt_id,
                        "SENT00000000001",
                        RcptState.DELIVERED,
                        True,
                        None,
                        "250 2.0.0 ok",
                    ),
                    ops.RcptUpdate(
                        claims["d@example.org"].rcpt_id,
                        "HELD00000000001",
                        RcptState.DEFERRED,
                        False,
                        now + 60,
                        None,
                    ),
                ],
                now,
            )
            ops.hold(c, ["HELD00000000001"], now)
    finally:
        c.close()
    return cfg


def test_queue_list_json_shape(populated: Path) -> None:
    res = _cli(populated, "queue", "list", "--json")
    assert res.returncode == 0, res.stderr
    msgs = json.loads(res.stdout)
    assert isinstance(msgs, list)
    assert [m["id"] for m in msgs] == ["DEFER0000000001", "HELD00000000001"]  # unfinished
    required = {
        "id",
        "state",
        "message_id",
        "sender",
        "size",
        "created_at",
        "attempts",
        "next_attempt_at",
        "recipients",
    }
    for m in msgs:
        assert required <= set(m), m
        assert m["state"] in {"queued", "deferred", "sending", "held", "sent", "failed"}
        assert ISO.match(m["created_at"])
        assert m["next_attempt_at"] is None or ISO.match(m["next_attempt_at"])
        assert isinstance(m["size"], int) and isinstance(m["attempts"], int)
        for r in m["recipients"]:
            assert {"address", "state", "attempts", "last_reply"} <= set(r), r
    d, h = msgs
    assert d["state"] == "deferred" and d["message_id"] == "def@app.example"
    assert d["sender"] == "app@example.com" and d["attempts"] == 1
    assert d["size"] == len(
        b"From: app@example.com\r\nSubject: Deferred one\r\n"
        b"Message-ID: <def@app.example>\r\n\r\nSECRET BODY TEXT\r\n"
    )
    assert d["recipients"] == [
        {
            **d["recipients"][0],
            "address": "a@example.org",
            "state": "deferred",
            "attempts": 1,
            "last_reply": "451 4.7.1 try later",
        },
        {
            **d["recipients"][1],
            "address": "b@example.org",
            "state": "delivered",
            "attempts": 1,
            "last_reply": "250 2.0.0 ok",
        },
    ]
    created = calendar.timegm(time.strptime(d["created_at"], "%Y-%m-%dT%H:%M:%SZ"))
    assert abs(created - (time.time() - 120)) < 60  # UTC, not local time
    assert d["next_attempt_at"] is not None
    assert h["state"] == "held" and h["sender"] == "" and h["next_attempt_at"] is None
    assert h["recipients"][0]["attempts"] == 0

    everything = json.loads(_cli(populated, "queue", "list", "--all", "--json").stdout)
    assert [m["id"] for m in everything] == [
        "DEFER0000000001",
        "SENT00000000001",
        "HELD00000000001",
    ]
    assert everything[1]["state"] == "sent" and everything[1]["next_attempt_at"] is None
    held = json.loads(_cli(populated, "queue", "list", "--state", "held", "--json").stdout)
    assert [m["id"] for m in held] == ["HELD00000000001"]
    sent = json.loads(_cli(populated, "queue", "list", "--state", "sent", "--json").stdout)
    assert [m["id"] for m in sent] == ["SENT00000000001"]


def test_queue_show_json(populated: Path) -> None:
    res = _cli(populated, "queue", "show", "DEFER0000000001", "--json")
    assert res.returncode == 0, res.stderr
    msg = json.loads(res.stdout)
    assert msg["id"] == "DEFER0000000001" and msg["state"] == "deferred"
    log = msg["attempt_log"]
    assert [(a["recipient"], a["outcome"], a["reply"]) for a in log] == [
        ("a@example.org", "transient", "451 4.7.1 try later"),
        ("b@example.org", "delivered", "250 2.0.0 ok"),
    ]
    assert all(ISO.match(a["at"]) for a in log)
    assert log[0]["host"] == "up[127.0.0.1]:25"
    assert "Subject: Deferred one" in msg["headers"]
    assert "SECRET BODY TEXT" not in res.stdout
    assert "body" not in msg

    res = _cli(populated, "queue", "show", "DEFER0000000001", "--json", "--body")
    assert res.returncode == 0, res.stderr
    msg = json.loads(res.stdout)
    assert msg["body"] == "SECRET BODY TEXT\r\n"
    assert "Subject: Deferred one" in msg["headers"]

    res = _cli(populated, "queue", "show", "NOSUCHID0000000", "--json")
    assert res.returncode == 1
    assert "NOSUCHID0000000" in res.stderr


def test_migration_from_version_1_keeps_the_queue(tmp_path: Path) -> None:
    """A spool written by the first release (schema 1) is upgraded in place at open."""
    import sqlite3

    path = tmp_path / "old"
    path.mkdir()
    c = sqlite3.connect(db.db_path(path), isolation_level=None)
    for stmt in schema.statements(schema.MIGRATIONS[0]):
        c.execute(stmt)
    c.execute("PRAGMA user_version=1")
    c.execute(
        "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer,"
        " lane, identity, body) VALUES ('Q1', 'm@x', 'a@x', 1, 1.0, 'c', 'p',"
        " 'transactional', 'x', x'00')"
    )
    c.execute(
        "INSERT INTO recipients (msg_id, address, destination, lane_prio, state,"
        " next_attempt_at, dedup_key, updated_at) VALUES ('Q1', 'u@x', 'x', 0,"
        " 'deferred', 1.0, 'k', 1.0)"
    )
    c.close()
    conn = db.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(db.MIGRATIONS)
        row = conn.execute("SELECT state, retry_base FROM recipients").fetchone()
        assert tuple(row) == ("deferred", None)
    finally:
        conn.close()


def test_queue_health_counts_overdue_in_both_lanes_and_stuck_claims(
    conn: sqlite3.Connection,
) -> None:
    accept(conn, new_message("T", ["t@example.org"], message_id="<t@x>", created_at=T0 - 700))
    accept(
        conn,
        new_message("B", ["b@example.org"], message_id="<b@x>", lane="bulk", created_at=T0 - 650),
    )
    accept(conn, new_message("N", ["n@example.org"], message_id="<n@x>", created_at=T0 - 10))
    # oldest in the queue: T (700 s); overdue by 600 s: T and B (both lanes), not N
    assert ops.queue_health(conn, T0, 600) == (700.0, 2)
    with db.transaction(conn):
        claims = ops.claim_due(conn, T0 - 640, 1)  # T claimed (sending) 640 s ago: stuck
    assert [c.msg_id for c in claims] == ["T"]
    assert ops.queue_health(conn, T0, 600) == (700.0, 2)  # B due + T stuck
    assert ops.queue_health(conn, T0 - 100, 600) == (600.0, 0)


async def test_lazy_jobs_commit_without_fsync_only_in_a_batch_of_their_own(
    writer: SpoolWriter,
) -> None:
    """A batch of lazy jobs (the engine's claims) commits with synchronous=NORMAL; one
    durable job in the batch makes it FULL; FULL is back afterwards. On PostgreSQL every
    commit is durable (synchronous_commit stays on: 2 here)."""

    def mode(c: sqlite3.Connection) -> int:
        if db.dialect(c) == "postgresql":
            return 2 if c.execute("SHOW synchronous_commit").fetchone()[0] == "on" else 0
        return int(c.execute("PRAGMA synchronous").fetchone()[0])

    normal = 1 if writer.pg is None else 2
    assert await writer.run(mode, lazy=True) == normal  # NORMAL
    assert await writer.run(mode) == 2  # FULL again
    started, release = threading.Event(), threading.Event()

    def blocker(c: sqlite3.Connection) -> int:
        started.set()
        assert release.wait(30)
        return mode(c)

    first = asyncio.ensure_future(writer.run(blocker, lazy=True))
    assert await asyncio.to_thread(started.wait, 30)
    # queued while the first batch runs: one batch of a lazy and a durable job
    lazy = asyncio.ensure_future(writer.run(mode, lazy=True))
    durable = asyncio.ensure_future(writer.run(mode))
    await asyncio.sleep(0.05)
    release.set()
    assert await first == normal
    assert (await lazy, await durable) == (2, 2)
