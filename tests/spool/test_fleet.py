"""The fleet's spool primitives: leases on claims, outcomes only over a held lease, expired
leases reclaimed, heartbeats, and dedup keys taken once across nodes.

The lease rules run on both backends (the contract); what needs two connections writing at
once (SKIP LOCKED claims, two nodes racing for one dedup key) runs on PostgreSQL, where a
fleet lives."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from relay.delivery import fleet
from relay.spool import db, ops, pg
from relay.spool.model import RcptState
from tests.pgserver import BACKENDS, open_backend
from tests.spool.test_ops import put, rcpt, run

T0 = 1_700_000_000.0


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    yield c
    c.close()


def lease_of(conn: sqlite3.Connection, address: str) -> tuple[Any, Any, str]:
    row = conn.execute(
        "SELECT lease_owner, lease_until, state FROM recipients WHERE address = ?", (address,)
    ).fetchone()
    return row[0], row[1], row[2]


def test_a_claim_is_a_lease_and_only_its_holder_records(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@x.test", "b@x.test"])
    claims = run(conn, ops.claim_due, T0 + 1, 10, owner="node-a", lease_until=T0 + 31)
    assert sorted(c.address for c in claims) == ["a@x.test", "b@x.test"]
    assert lease_of(conn, "a@x.test") == ("node-a", T0 + 31, "sending")
    by = {c.address: c for c in claims}

    def done(addr: str) -> ops.RcptUpdate:
        return ops.RcptUpdate(by[addr].rcpt_id, "M1", RcptState.DELIVERED, True, None, "250 ok")

    # another node (its lease lost, say) cannot record over node-a's claim
    assert run(conn, ops.record, [done("a@x.test")], T0 + 2, owner="node-b") == 0
    assert lease_of(conn, "a@x.test") == ("node-a", T0 + 31, "sending")
    assert run(conn, ops.record, [done("a@x.test")], T0 + 2, owner="node-a") == 1
    assert lease_of(conn, "a@x.test") == (None, None, "delivered")
    assert run(conn, ops.renew_leases, "node-a", T0 + 60) == 1  # b is still held
    assert lease_of(conn, "b@x.test") == ("node-a", T0 + 60, "sending")
    assert run(conn, ops.renew_leases, "node-b", T0 + 90) == 0


def test_expired_leases_of_other_nodes_come_back_and_own_ones_do_not(
    conn: sqlite3.Connection,
) -> None:
    put(conn, "M1", ["a@x.test"])
    put(conn, "M2", ["b@x.test"])
    put(conn, "M3", ["c@x.test"])
    run(conn, ops.claim_due, T0 + 1, 1, owner="dead", lease_until=T0 + 10)
    run(conn, ops.claim_due, T0 + 1, 1, owner="me", lease_until=T0 + 10)
    run(conn, ops.claim_due, T0 + 1, 1, owner="alive", lease_until=T0 + 100)
    assert run(conn, ops.reclaim_expired, T0 + 9.9, "me", "2026-12-04") == 0  # nothing expired yet
    assert run(conn, ops.reclaim_expired, T0 + 11, "me", "2026-12-04") == 1  # dead's only
    states = {a: lease_of(conn, a) for a in ("a@x.test", "b@x.test", "c@x.test")}
    assert states["a@x.test"] == (None, None, "deferred")
    assert rcpt(conn, "a@x.test")["reason"] == "recovered: lease of dead expired"
    assert rcpt(conn, "a@x.test")["next_attempt_at"] == T0 + 11
    assert states["b@x.test"] == ("me", T0 + 10, "sending")  # renewed by its holder
    assert states["c@x.test"] == ("alive", T0 + 100, "sending")
    # a node stopping gives back its own claims only
    assert run(conn, ops.recover, T0 + 12, "me") == 1
    assert lease_of(conn, "b@x.test") == (None, None, "deferred")
    assert lease_of(conn, "c@x.test")[2] == "sending"
    # the one engine of a SQLite spool at start: every claim
    assert run(conn, ops.recover, T0 + 13) == 1
    assert lease_of(conn, "c@x.test") == (None, None, "deferred")


def test_heartbeats_list_the_fleet(conn: sqlite3.Connection) -> None:
    run(conn, ops.heartbeat, "n1", T0, T0 + 5, 3, {"host": "h1", "pid": 1})
    run(conn, ops.heartbeat, "n2", T0, T0 + 20, 0, {"host": "h2", "pid": 2})
    put(conn, "M1", ["a@x.test", "b@x.test"])
    run(conn, ops.claim_due, T0 + 20, 10, owner="n2", lease_until=T0 + 50)
    assert ops.live_nodes(conn, T0 + 30, 30) == 2
    assert ops.live_nodes(conn, T0 + 40, 30) == 1  # n1 beat 35 s ago
    assert ops.live_nodes(conn, T0 + 100, 30) == 1  # never less than the caller
    nodes = ops.list_nodes(conn, T0 + 40, 30)
    assert [(n["node"], n["alive"], n["inflight"], n["claims"], n["host"]) for n in nodes] == [
        ("n1", False, 3, 0, "h1"),
        ("n2", True, 0, 2, "h2"),
    ]
    assert nodes[0]["heartbeat_age"] == 35.0
    run(conn, ops.heartbeat, "n1", T0, T0 + 41, 0, {"host": "h1", "pid": 1})
    assert ops.live_nodes(conn, T0 + 41, 30) == 2
    assert run(conn, ops.prune_nodes, T0 + 41 + 86400, 86400) == 1  # n2 is older
    run(conn, ops.node_gone, "n1")
    assert ops.list_nodes(conn, T0 + 41, 30) == []


# --- two nodes at once: PostgreSQL ------------------------------------------------------------


@pytest.fixture
def two(pg_dsn: str) -> Iterator[tuple[pg.PgConnection, pg.PgConnection]]:
    a, b = pg.connect(pg_dsn), pg.connect(pg_dsn)
    yield a, b
    a.close()
    b.close()


def test_nodes_claim_disjoint_recipients_without_waiting(
    two: tuple[pg.PgConnection, pg.PgConnection],
) -> None:
    a, b = two
    ca, cb = cast(sqlite3.Connection, a), cast(sqlite3.Connection, b)
    for i in range(10):
        run(ca, put, f"M{i}", [f"u{i}@x.test"])
    ca.execute("BEGIN")
    first = ops.claim_due(ca, T0 + 1, 4, owner="A", lease_until=T0 + 30)
    # A's transaction is still open: B neither waits for A's rows nor takes them
    cb.execute("BEGIN")
    second = ops.claim_due(cb, T0 + 1, 10, owner="B", lease_until=T0 + 30)
    cb.execute("COMMIT")
    ca.execute("COMMIT")
    got_a, got_b = {c.address for c in first}, {c.address for c in second}
    assert len(got_a) == 4 and len(got_b) == 6 and not got_a & got_b
    owners = dict(ca.execute("SELECT address, lease_owner FROM recipients").fetchall())
    assert {a_ for a_, o in owners.items() if o == "A"} == got_a


def test_one_dedup_key_is_taken_by_one_node(two: tuple[pg.PgConnection, pg.PgConnection]) -> None:
    """Two nodes accept the same message at once: one queues it, the other reports a
    duplicate (its INSERT waits at the unique key until the first commits)."""
    from tests.spool.test_spool import new_message

    a, b = two
    ca, cb = cast(sqlite3.Connection, a), cast(sqlite3.Connection, b)
    ca.execute("BEGIN")
    ra = ops.accept(ca, new_message("QA", ["u@example.org"], message_id="<same@x>"), 3600)
    out: dict[str, Any] = {}

    def node_b() -> None:
        cb.execute("BEGIN")
        out["b"] = ops.accept(cb, new_message("QB", ["u@example.org"], message_id="<same@x>"), 3600)
        cb.execute("COMMIT")

    t = threading.Thread(target=node_b)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # B waits at the key A holds
    ca.execute("COMMIT")
    t.join(10)
    assert ra.queue_id == "QA" and ra.queued == ("u@example.org",)
    assert out["b"] == ops.AcceptResult(None, (), ("u@example.org",))
    assert [r[0] for r in ca.execute("SELECT id FROM messages")] == ["QA"]
    assert [r[0] for r in ca.execute("SELECT msg_id FROM dedup")] == ["QA"]


def test_a_rolled_back_key_is_free_for_the_other_node(
    two: tuple[pg.PgConnection, pg.PgConnection],
) -> None:
    from tests.spool.test_spool import new_message

    a, b = two
    ca, cb = cast(sqlite3.Connection, a), cast(sqlite3.Connection, b)
    ca.execute("BEGIN")
    ops.accept(ca, new_message("QA", ["u@example.org"], message_id="<same@x>"), 3600)
    out: dict[str, Any] = {}

    def node_b() -> None:
        cb.execute("BEGIN")
        out["b"] = ops.accept(cb, new_message("QB", ["u@example.org"], message_id="<same@x>"), 3600)
        cb.execute("COMMIT")

    t = threading.Thread(target=node_b)
    t.start()
    t.join(0.3)
    ca.execute("ROLLBACK")  # A's commit failed: B must queue it, or the mail is lost
    t.join(10)
    assert out["b"].queue_id == "QB"
    assert [r[0] for r in ca.execute("SELECT id FROM messages")] == ["QB"]


def test_the_schema_migrates_once_for_nodes_starting_together(pg_dsn: str) -> None:
    conns: list[pg.PgConnection] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            conns.append(pg.connect(pg_dsn))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    version = conns[0].execute("SELECT version FROM relay_schema").fetchone()[0]
    assert version == len(db.MIGRATIONS)
    assert conns[0].execute("SELECT count(*) FROM relay_schema").fetchone()[0] == 1
    for c in conns:
        c.close()


# --- daily ceilings counted fleet-wide ---------------------------------------------------------


def holds(conn: sqlite3.Connection) -> dict[tuple[str, str], int]:
    return {
        (r[0], r[1]): int(r[2])
        for r in conn.execute("SELECT node, scope, n FROM ceiling_holds").fetchall()
    }


def test_ceiling_room_is_granted_once_and_released_with_the_count(
    conn: sqlite3.Connection,
) -> None:
    day = "2026-12-04"
    run(conn, ops.heartbeat, "A", T0, T0, 0, {})
    want = {"dest:x.test": (10, 6), "id:news": (100, 6)}
    assert run(conn, ops.ceiling_take, "A", day, want, T0 + 30) == {
        "dest:x.test": 6,
        "id:news": 6,
    }
    # B wants 6 more: only 4 are left under the destination's 10 (A holds 6)
    assert run(conn, ops.ceiling_take, "B", day, {"dest:x.test": (10, 6)}, T0 + 30) == {
        "dest:x.test": 4
    }
    assert run(conn, ops.ceiling_take, "B", day, {"dest:x.test": (10, 1)}, T0 + 30) == {
        "dest:x.test": 0
    }
    assert holds(conn) == {("A", "dest:x.test"): 6, ("A", "id:news"): 6, ("B", "dest:x.test"): 4}
    # A's job of 6 ends with 5 delivered: the count takes 5, the hold lets go of 6
    put(conn, "M1", ["a@x.test"])
    (cl,) = run(conn, ops.claim_due, T0 + 1, 1, owner="A", lease_until=T0 + 30)
    upd = ops.RcptUpdate(
        cl.rcpt_id, "M1", RcptState.DELIVERED, True, None, "250", counters=("dest:x.test",)
    )
    with db.transaction(conn):
        ops.record(conn, [upd] * 1, T0 + 2, day, owner="A")
        ops.ceiling_release(conn, "A", {"dest:x.test": 6, "id:news": 6})
    assert holds(conn) == {("B", "dest:x.test"): 4}
    assert ops.daily_counts(conn, day)["dest:x.test"] == 1
    # 10 - 1 counted - 4 held by B = 5
    assert run(conn, ops.ceiling_take, "A", day, {"dest:x.test": (10, 9)}, T0 + 30) == {
        "dest:x.test": 5
    }
    # releasing more than held never goes below zero, and empty holds are dropped
    run(conn, ops.ceiling_release, "B", {"dest:x.test": 99})
    assert ("B", "dest:x.test") not in holds(conn)


def test_a_dead_nodes_holds_count_as_sent_and_a_clean_stop_frees_them(
    conn: sqlite3.Connection,
) -> None:
    day = "2026-12-04"
    run(conn, ops.ceiling_take, "dead", day, {"dest:x.test": (10, 3)}, T0 + 10)
    run(conn, ops.ceiling_take, "alive", day, {"dest:x.test": (10, 2)}, T0 + 10)
    run(conn, ops.ceiling_take, "me", day, {"dest:x.test": (10, 1)}, T0 + 10)
    assert run(conn, ops.renew_leases, "alive", T0 + 100) == 0  # renews its holds too
    assert run(conn, ops.renew_leases, "me", T0 + 100) == 0
    run(conn, ops.reclaim_expired, T0 + 11, "me", day)
    # the dead node may have sent its 3 before it died: they count, its hold is gone
    assert ops.daily_counts(conn, day) == {"dest:x.test": 3}
    assert holds(conn) == {("alive", "dest:x.test"): 2, ("me", "dest:x.test"): 1}
    assert run(conn, ops.ceiling_take, "me", day, {"dest:x.test": (10, 9)}, T0 + 30) == {
        "dest:x.test": 4
    }
    run(conn, ops.node_gone, "alive")
    assert holds(conn) == {("me", "dest:x.test"): 5}


def test_a_node_taking_room_waits_for_the_node_holding_the_counter(pg_dsn: str) -> None:
    """The counter row is locked while a node takes room: a second node's take waits for
    the first one's commit and then sees its hold (without the lock it would read the
    committed state from before, grant the same room again and pass the ceiling)."""
    day = "2026-12-04"
    a, b = pg.connect(pg_dsn), pg.connect(pg_dsn)
    got: dict[str, int] = {}
    try:
        # the day's counter row exists already (the usual case: only the first take of a
        # day creates it, and a row being inserted makes the other insert wait anyway)
        a.execute("BEGIN")
        assert ops.ceiling_take(a, "C", day, {"dest:x.test": (10, 0)}, T0 + 30) == {
            "dest:x.test": 0
        }
        a.execute("COMMIT")
        a.execute("BEGIN")
        assert ops.ceiling_take(a, "A", day, {"dest:x.test": (10, 10)}, T0 + 30) == {
            "dest:x.test": 10
        }

        def take_b() -> None:
            b.execute("BEGIN")
            got.update(ops.ceiling_take(b, "B", day, {"dest:x.test": (10, 10)}, T0 + 30))
            b.execute("COMMIT")

        t = threading.Thread(target=take_b)
        t.start()
        t.join(0.5)
        assert t.is_alive(), f"B took room while A held the counter: {got}"
        a.execute("COMMIT")
        t.join(10)
        assert not t.is_alive()
        assert got == {"dest:x.test": 0}
    finally:
        a.close()
        b.close()


def test_a_ceiling_counts_what_nodes_counted_in_their_own_rows(conn: sqlite3.Connection) -> None:
    """A scope without a ceiling is counted in each node's own rows (pg.COUNTER_TABLES); a
    ceiling set later that day (SIGHUP) still counts them: the room is the limit less both
    tables' counts, and every reader sums the two."""
    day = "2026-12-04"
    run(conn, ops.heartbeat, "A", T0, T0, 0, {})
    with db.transaction(conn):
        for node, n in (("A", 3), ("B", 4)):
            conn.execute(
                "INSERT INTO daily_counts_node (scope, day, node, count) VALUES (?, ?, ?, ?)",
                ("dest:x.test", day, node, n),
            )
        conn.execute(
            "INSERT INTO daily_counts (scope, day, count) VALUES ('dest:x.test', ?, 1)", (day,)
        )
    assert ops.daily_counts(conn, day) == {"dest:x.test": 8}
    assert run(conn, ops.ceiling_take, "A", day, {"dest:x.test": (10, 5)}, T0 + 30) == {
        "dest:x.test": 2
    }


def test_nodes_taking_room_at_once_never_exceed_the_ceiling(pg_dsn: str) -> None:
    """Four nodes race for room under one ceiling, a few recipients at a time, delivering
    some and releasing the rest as they go: the ceiling is met exactly, never passed."""
    limit = 200
    day = "2026-12-04"
    sent: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def node(name: str) -> None:
        c = cast(sqlite3.Connection, pg.connect(pg_dsn))
        try:
            while True:
                got = run(c, ops.ceiling_take, name, day, {"dest:x.test": (limit, 7)}, T0 + 60)
                g = got["dest:x.test"]
                if g == 0:
                    total = run(c, ops.daily_counts, day).get("dest:x.test", 0)
                    if total >= limit:
                        return
                    continue  # others hold the rest: it comes back or counts
                done = g - 1 if g > 1 else g  # one of each batch "fails"
                with db.transaction(c):
                    c.execute(
                        "UPDATE daily_counts SET count = count + ? WHERE scope = ? AND day = ?",
                        (done, "dest:x.test", day),
                    )
                    ops.ceiling_release(c, name, {"dest:x.test": g})
                with lock:
                    sent.append(done)
        except BaseException as e:
            errors.append(e)
        finally:
            c.close()

    pg.connect(pg_dsn).close()  # the schema, once, before the racers
    threads = [threading.Thread(target=node, args=(f"n{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sum(sent) == limit


# --- two nodes' transactions crossing: PostgreSQL's answers ------------------------------------


def test_a_deadlock_victim_job_runs_again_in_the_same_batch(pg_dsn: str, tmp_path: Path) -> None:
    """Two nodes lock two shared rows in opposite orders: PostgreSQL aborts one (here the
    writer's job, which waited first); the writer runs the job again after its savepoint,
    and it commits instead of failing (a failed record would have left its claims to expire
    and be sent a second time by another node)."""
    import psycopg

    from relay.config.tree import PgSpool
    from relay.spool.writer import SpoolWriter

    setup = cast(sqlite3.Connection, pg.connect(pg_dsn))
    run(setup, ops.put_runtime, "x", 0, T0)
    run(setup, ops.put_runtime, "y", 0, T0)
    setup.close()
    w = SpoolWriter(tmp_path / "spool", PgSpool(pg_dsn))
    w.start()
    other = psycopg.connect(pg_dsn, autocommit=False)
    try:
        # the backend whose deadlock_timeout runs out first checks for the cycle and aborts
        # itself: `other` waits 30 s, so the victim is the job's even on a starved machine
        # (with both at 1 s, a CI run's loaded backend let `other` check first)
        other.execute("SET deadlock_timeout = '30s'")
        other.execute("UPDATE runtime SET updated_at = 2 WHERE name = 'y'")  # holds y
        waiting = threading.Event()
        tries: list[int] = []

        def job(c: sqlite3.Connection) -> str:
            tries.append(1)
            c.execute("UPDATE runtime SET updated_at = 1 WHERE name = 'x'")
            waiting.set()
            c.execute("UPDATE runtime SET updated_at = 1 WHERE name = 'y'")  # waits for other
            return "done"

        fut: dict[str, Any] = {}
        t = threading.Thread(target=lambda: fut.setdefault("r", w.run_sync(job)))
        t.start()
        assert waiting.wait(10)
        threading.Event().wait(0.3)  # the job waits on y before `other` waits on x
        other.execute("UPDATE runtime SET updated_at = 2 WHERE name = 'x'")  # deadlock
        other.commit()
        t.join(30)
        assert fut.get("r") == "done"
        assert len(tries) == 2
    finally:
        other.close()
        w.close()
    check = cast(sqlite3.Connection, pg.connect(pg_dsn))
    got = dict(check.execute("SELECT name, updated_at FROM runtime").fetchall())
    check.close()
    assert got == {"x": 1, "y": 1}


def test_a_commit_postgresql_turned_into_a_rollback_is_a_failure(pg_dsn: str) -> None:
    """After an error PostgreSQL answers COMMIT with ROLLBACK, not with an error: the spool
    must not report a batch written when nothing was."""
    c = pg.connect(pg_dsn)
    c.execute("BEGIN")
    c.execute("INSERT INTO runtime (name, value, updated_at) VALUES ('a', '1', 1)")
    with pytest.raises(sqlite3.Error):
        c.execute("SELECT * FROM no_such_table")
    with pytest.raises(sqlite3.OperationalError, match="rolled back"):
        c.execute("COMMIT")
    assert c.execute("SELECT count(*) FROM runtime WHERE name = 'a'").fetchone()[0] == 0
    c.close()


def test_a_node_as_the_cli_shows_it(conn: sqlite3.Connection) -> None:
    """`relay fleet --json`: every field, the alive edge (a beat exactly `within` ago is
    alive), the age to the millisecond, never negative (a clock a little behind)."""
    run(conn, ops.heartbeat, "n1", T0, T0 + 10.12345, 2, {"pid": 7, "host": "h"})
    stored = conn.execute("SELECT info FROM nodes").fetchone()[0]
    assert stored == '{"host": "h", "pid": 7}'  # sorted keys: one text per state
    (node,) = ops.list_nodes(conn, T0 + 40.12345, 30)
    assert node == {
        "node": "n1",
        "alive": True,
        "started_at": ops.iso_utc(T0),
        "heartbeat_at": ops.iso_utc(T0 + 10.12345),
        "heartbeat_age": 30.0,
        "inflight": 2,
        "claims": 0,
        "pid": 7,
        "host": "h",
    }
    assert ops.list_nodes(conn, T0 + 40.2, 30)[0]["alive"] is False
    assert ops.list_nodes(conn, T0 + 10.5, 30)[0]["heartbeat_age"] == 0.377
    assert ops.list_nodes(conn, T0 + 10, 30)[0]["heartbeat_age"] == 0.0  # behind: not < 0


def test_a_node_starting_counts_a_dead_nodes_holds_in_todays_window(
    conn: sqlite3.Connection,
) -> None:
    """At engine start a fleet node takes back the claims of nodes whose lease ran out; the
    room they held under the ceilings counts as sent today (it may have been), in the same
    window the ledger then loads (before the fix: in a window named "", lost)."""
    day = "2026-12-04"
    run(conn, ops.ceiling_take, "dead", day, {"dest:x.test": (10, 4)}, T0 + 10)
    _, counts = run(conn, lambda c: fleet.start_up(T0 + 11, day, "me", True, c))
    assert counts == {"dest:x.test": 4}
    assert holds(conn) == {}


def test_a_dead_nodes_single_hold_counts_one(conn: sqlite3.Connection) -> None:
    day = "2026-12-04"
    run(conn, ops.ceiling_take, "dead", day, {"dest:x.test": (10, 1)}, T0 + 10)
    run(conn, ops.ceiling_take, "dead", day, {"dest:y.test": (10, 1)}, T0 + 10)
    conn.execute("BEGIN")
    conn.execute("UPDATE ceiling_holds SET n = 0 WHERE scope = 'dest:y.test'")
    conn.execute("COMMIT")
    run(conn, ops.reclaim_expired, T0 + 11, "me", day)
    # one recipient held counts as one sent; an empty hold adds nothing
    assert ops.daily_counts(conn, day) == {"dest:x.test": 1, "dest:y.test": 0}
    assert holds(conn) == {}


def test_a_stored_body_is_compressed_with_lz4_and_reads_back_byte_for_byte(pg_dsn: str) -> None:
    """Migration 12 -> 13: a body past PostgreSQL's ~2 KB toast threshold is compressed with
    lz4, not pglz (6% of the inbound's backend CPU at 2 KiB; bench/README.md, issue 31); the
    body comes back the same octets, and migrating again changes nothing."""
    import psycopg

    c = pg.connect(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as raw:
        has_lz4 = raw.execute(
            "SELECT count(*) FROM pg_settings WHERE name = 'default_toast_compression'"
            " AND 'lz4' = ANY(enumvals)"
        ).fetchone()[0]
    # a server without lz4 keeps pglz, and the migration does not fail
    want = ("lz4", "l") if has_lz4 else ("pglz", "")
    body = b"Subject: t\r\n\r\n" + b"the same line again and again\r\n" * 400  # compressible
    put(c, "M1", ["a@x.test"], body=body)
    with psycopg.connect(pg_dsn, autocommit=True) as raw:
        method = raw.execute(
            "SELECT pg_column_compression(body), octet_length(body) FROM messages"
        ).fetchone()
        assert method == (want[0], len(body))
        assert (
            raw.execute(
                "SELECT attcompression FROM pg_attribute WHERE attrelid = 'messages'::regclass"
                " AND attname = 'body'"
            ).fetchone()[0]
            == want[1]
        )
    assert pg.migrate(c) == len(db.MIGRATIONS)
    assert c.execute("SELECT body FROM messages WHERE id = 'M1'").fetchone()[0] == body
    c.close()
