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

from relay.model import RcptState
from relay.spool import db, ops, pg
from tests.pgserver import BACKENDS, open_backend
from tests.test_spool_mutation_ops import put, rcpt, run

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
    assert run(conn, ops.reclaim_expired, T0 + 9.9, "me") == 0  # nothing expired yet
    assert run(conn, ops.reclaim_expired, T0 + 11, "me") == 1  # dead's only
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
    from tests.test_spool import new_message

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
    assert out["b"].queue_id is None and out["b"].duplicates == ("u@example.org",)
    assert [r[0] for r in ca.execute("SELECT id FROM messages")] == ["QA"]
    assert [r[0] for r in ca.execute("SELECT msg_id FROM dedup")] == ["QA"]


def test_a_rolled_back_key_is_free_for_the_other_node(
    two: tuple[pg.PgConnection, pg.PgConnection],
) -> None:
    from tests.test_spool import new_message

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
