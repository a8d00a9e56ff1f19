"""The inbound's accepts of one writer batch on SQLite (issue 29): one group, one SAVEPOINT
and a few prepared statements, with every job given the result `accept` would have given
it one by one, and one bad job still failing alone."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay.spool import db, ops
from relay.spool.writer import Grouped, SpoolWriter
from tests.spool.test_batching import CASES, NOW, WINDOW, _batched, _dump, _msg


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = db.connect(tmp_path / "spool")
    yield c
    c.close()


def _run(
    conn: sqlite3.Connection,
    seed: list[tuple[str, str, float, str | None]],
    batch: list[ops.NewMessage],
    grouped: bool,
) -> tuple[list[ops.AcceptResult], tuple[list[Any], ...]]:
    conn.execute("BEGIN")
    try:
        for key, mid, at, h in seed:
            conn.execute(
                "INSERT INTO dedup (key, msg_id, created_at, content_hash) VALUES (?,?,?,?)",
                (key, mid, at, h),
            )
        items = [(m, WINDOW) for m in batch]
        if grouped:
            res = ops.accept_many(conn, items)
        else:
            res = [ops.accept(conn, m, w) for m, w in items]
        rcpt_ids = [r[0] for r in conn.execute("SELECT id FROM recipients ORDER BY msg_id, id")]
        return res, (*_dump(conn), rcpt_ids)
    finally:
        conn.execute("ROLLBACK")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_accept_many_on_sqlite_decides_as_accept_one_by_one(
    conn: sqlite3.Connection,
    case: tuple[str, list[tuple[str, str, float, str | None]], list[ops.NewMessage]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _name, seed, batch = case
    alone, state_alone = _run(conn, seed, batch, grouped=False)
    calls: list[str] = []
    accept = ops.accept

    def counted(c: Any, m: ops.NewMessage, w: float) -> ops.AcceptResult:
        calls.append(m.queue_id)
        return accept(c, m, w)

    monkeypatch.setattr(ops, "accept", counted)
    together, state_together = _run(conn, seed, batch, grouped=True)
    assert together == alone
    assert state_together == state_alone  # rows, and the recipients' ids in the same order
    assert state_alone[0] or not any(r.queue_id for r in alone)  # the case queues something
    # every key new and once: the batch's own statements; else accept one by one
    keys = [r.dedup_key for m in batch for r in m.recipients]
    all_new = not seed and len(set(keys)) == len(keys)
    assert calls == ([] if all_new else [m.queue_id for m in batch])


def test_accept_many_on_sqlite_takes_expired_keys_over(conn: sqlite3.Connection) -> None:
    seed = [("k1", "OLD1", NOW - WINDOW - 5, None)]
    batch = [
        _msg("Q1", NOW, ("a@x.org", "k1", None, "fpA")),
        _msg("Q2", NOW + 1, ("b@x.org", "k2", None)),
    ]
    alone, state_alone = _run(conn, seed, batch, grouped=False)
    together, state_together = _run(conn, seed, batch, grouped=True)
    assert (
        together
        == alone
        == [
            ops.AcceptResult("Q1", ("a@x.org",), ()),
            ops.AcceptResult("Q2", ("b@x.org",), ()),
        ]
    )
    assert state_together == state_alone


def test_accept_many_on_sqlite_falls_back_when_one_key_would_be_taken_twice(
    conn: sqlite3.Connection,
) -> None:
    batch = [_msg("Q1", NOW, ("a@x.org", "k1", None)), _msg("Q2", NOW + 5, ("a@x.org", "k1", None))]
    conn.execute("BEGIN")
    try:
        res = ops.accept_many(conn, [(m, 1.0) for m in batch])
        rows = conn.execute("SELECT key, msg_id FROM dedup").fetchall()
    finally:
        conn.execute("ROLLBACK")
    assert [r.queue_id for r in res] == ["Q1", "Q2"]
    assert [tuple(r) for r in rows] == [("k1", "Q2")]


class _Blind:
    """A connection whose read of the dedup keys finds none: as if a key were taken
    between the read and the take."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, args: Any = ()) -> Any:
        if sql.startswith("SELECT key, created_at FROM dedup"):
            return iter(())
        return self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: Any) -> Any:
        return self.conn.executemany(sql, rows)

    @property
    def total_changes(self) -> int:
        return self.conn.total_changes


def test_a_key_taken_behind_the_read_fails_the_group(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN")
    try:
        ops.accept(conn, _msg("B1", NOW, ("z@x.org", "k9", None)), WINDOW)
        batch = [_msg("Q1", NOW, ("y@x.org", "k8", None)), _msg("Q2", NOW, ("w@x.org", "k9", None))]
        with pytest.raises(RuntimeError):
            ops.accept_many(_Blind(conn), [(m, WINDOW) for m in batch])  # type: ignore[arg-type]
    finally:
        conn.execute("ROLLBACK")


def _accept(m: ops.NewMessage) -> Grouped[ops.AcceptResult]:
    return Grouped(ops.accept_many, (m, WINDOW), sqlite=True)


def test_the_sqlite_writer_runs_accepts_of_a_batch_as_one_group(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path / "spool")
    w.start()
    try:
        msgs = [_msg(f"Q{i:02}", NOW + i, (f"r{i}@x.org", f"k{i}", None)) for i in range(20)]
        res = _batched(w, [_accept(m) for m in msgs])
        assert [r.queue_id for r in res] == [m.queue_id for m in msgs]
        assert w.grouped == 20
        # a Grouped job without sqlite=True runs alone on SQLite
        plain = _batched(
            w,
            [Grouped(ops.accept_many, (_msg(q, NOW, (q, q, None)), WINDOW)) for q in ("P1", "P2")],
        )
        assert [r.queue_id for r in plain] == ["P1", "P2"] and w.grouped == 20
        n = w.run_sync(lambda c: c.execute("SELECT count(*) FROM recipients").fetchone()[0])
        assert n == 22
    finally:
        w.close()


def test_one_bad_accept_of_a_sqlite_group_fails_alone(tmp_path: Path) -> None:
    """Q1 again (its queue id is taken): the group fails, is rolled back, and its jobs run
    one by one; only that one fails."""
    w = SpoolWriter(tmp_path / "spool")
    w.start()
    try:
        w.run_sync(_accept(_msg("Q1", NOW, ("a@x.org", "k1", None))))
        batch = [
            _msg("Q2", NOW + 1, ("b@x.org", "k2", None)),
            _msg("Q1", NOW + 2, ("c@x.org", "k3", None)),
            _msg("Q3", NOW + 3, ("d@x.org", "k4", None)),
        ]
        res = _batched(w, [_accept(m) for m in batch])
        assert [type(r).__name__ for r in res] == ["AcceptResult", "SpoolError", "AcceptResult"]
        assert w.grouped == 0
        keys = w.run_sync(lambda c: [r[0] for r in c.execute("SELECT key FROM dedup ORDER BY key")])
        assert keys == ["k1", "k2", "k4"]  # the failed job's key rolled back with it
    finally:
        w.close()


def _big_batch(n: int, rcpts: int) -> list[ops.NewMessage]:
    return [
        _msg(
            f"B{i:03d}",
            NOW + i,
            *((f"r{j}@x{i}.org", f"k{i}-{j}", None, f"fp{i}") for j in range(rcpts)),
        )
        for i in range(n)
    ]


def test_accept_many_on_sqlite_past_one_statements_parameters(conn: sqlite3.Connection) -> None:
    """More rows than one statement's 999 parameters hold (90 messages x 5 recipients: 450
    recipient rows of 8 values, 450 keys of 5, 90 messages of 12): more statements, the
    same rows as one by one, and the keys taken over where expired."""
    batch = _big_batch(90, 5)
    seed = [("k7-3", "OLD", NOW - WINDOW - 1, None), ("k80-0", "OLD", NOW - WINDOW - 1, None)]
    alone, state_alone = _run(conn, seed, batch, grouped=False)
    together, state_together = _run(conn, seed, batch, grouped=True)
    assert together == alone
    assert state_together == state_alone
    assert len(state_together[1]) == 450


def test_accept_many_on_sqlite_is_one_step_per_table(conn: sqlite3.Connection) -> None:
    """The batch's rows go in one statement per table, not one per row (`executemany`):
    each statement lets go of the GIL and waits to have it back (the inbound's event loop
    runs meanwhile), so a row each was a hand-over of the GIL each."""
    batch = _big_batch(4, 3)
    inserts: list[str] = []
    conn.set_trace_callback(lambda sql: inserts.append(sql) if sql.startswith("INSERT") else None)
    try:
        res, _state = _run(conn, [], batch, grouped=True)
    finally:
        conn.set_trace_callback(None)
    assert [r.queue_id for r in res] == [m.queue_id for m in batch]
    assert [s.split(" (")[0] for s in inserts] == [
        "INSERT INTO dedup",
        "INSERT INTO messages",
        "INSERT INTO recipients",
    ], inserts
