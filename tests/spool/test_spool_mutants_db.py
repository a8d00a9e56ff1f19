"""Survivors of the spool mutation run (tests/MUTANTS.md) in `ops.record`, `ops.accept`,
`db.connect` and `db.open_spool`: the delivered counts of a pass larger than one 500-id
chunk, an outcome whose recipient an operator changed meanwhile amid others that still
count, a dedup key named twice in one message, a conflict's result, how a SQLite spool
directory is created (parents, mode) or refused, and the PostgreSQL password file. Spool
tests run on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from relay.config.tree import PgSpool
from relay.spool import db, ops
from relay.spool.model import RcptState
from relay.spool.pg import PgConnection
from tests.pgserver import BACKENDS, open_backend
from tests.spool.test_ops import T0, put, rcpt, run, set_rcpt
from tests.spool.test_spool_mutants_more import new_message


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    yield c
    c.close()


def delivered(claims: list[ops.Claim]) -> list[ops.RcptUpdate]:
    return [
        ops.RcptUpdate(c.rcpt_id, c.msg_id, RcptState.DELIVERED, True, None, "250 ok")
        for c in claims
    ]


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


# --- db.connect (SQLite) ---------------------------------------------------------------------


def test_connect_creates_missing_parents_with_mode_0750(tmp_path: Path) -> None:
    spool = tmp_path / "var" / "lib" / "relay"
    old = os.umask(0o022)  # the usual umask; under it mkdir's default mode gives 0755
    try:
        conn = db.connect(spool)
    finally:
        os.umask(old)
    conn.close()
    assert db.db_path(spool).exists()
    assert stat.S_IMODE(spool.stat().st_mode) == 0o750


def test_connect_without_create_names_the_missing_spool(tmp_path: Path) -> None:
    spool = tmp_path / "nothing-here"
    with pytest.raises(FileNotFoundError) as e:
        db.connect(spool, create=False)
    assert str(e.value) == f"no spool at {db.db_path(spool)}"
    assert not spool.exists()


def test_open_spool_without_create_refuses_a_missing_sqlite_spool(tmp_path: Path) -> None:
    spool = tmp_path / "gone"
    with pytest.raises(FileNotFoundError, match=r"^no spool at "):
        db.open_spool(spool, create=False)
    assert not spool.exists()


def test_open_spool_on_postgresql_logs_in_with_the_password_file(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The password comes from spool.password_file (the server here trusts loopback, so the
    password the connection was opened with is read back from libpq)."""
    secret = tmp_path / "pg.secret"
    secret.write_text("s3cret-from-file\n")
    conn = db.open_spool(tmp_path / "local", PgSpool(dsn=pg_dsn, password_file=secret))
    try:
        assert cast(PgConnection, conn)._conn.info.password == "s3cret-from-file"
        assert conn.execute("SELECT 1").fetchone()[0] == 1
    finally:
        conn.close()


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
