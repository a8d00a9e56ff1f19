"""The inbound's accepts of one writer batch on SQLite (issue 29): one group, one INSERT into
the connection's `intake` view and no SAVEPOINT (`Grouped(atomic=True)`), with every job
given the result `accept` would have given it one by one, and one bad job still failing
alone."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.spool import db, ops
from relay.spool.schema import INTAKE_COLUMNS, INTAKE_LIVE
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


class _Counted:
    """A connection that counts the statements it is given (a trigger's own are not
    statements of the caller's)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.sql: list[str] = []

    def execute(self, sql: str, args: Any = ()) -> Any:
        self.sql.append(sql.split(" VALUES")[0])
        return self.conn.execute(sql, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def _rows(conn: sqlite3.Connection) -> tuple[int, int, int]:
    return (
        conn.execute("SELECT count(*) FROM messages").fetchone()[0],
        conn.execute("SELECT count(*) FROM recipients").fetchone()[0],
        conn.execute("SELECT count(*) FROM dedup").fetchone()[0],
    )


def test_a_live_key_backs_the_whole_intake_statement_out(conn: sqlite3.Connection) -> None:
    """The trigger RAISEs at the second message's live key: nothing of the first stays
    written (SQLite backs the statement out, the transaction goes on), and the batch is
    then decided by `accept` one by one."""
    conn.execute("BEGIN")
    try:
        ops.accept(conn, _msg("B1", NOW, ("z@x.org", "k9", None)), WINDOW)
        before = _rows(conn)
        batch = [_msg("Q1", NOW, ("y@x.org", "k8", None)), _msg("Q2", NOW, ("w@x.org", "k9", None))]
        items = [(m, WINDOW) for m in batch]
        with pytest.raises(sqlite3.IntegrityError, match=INTAKE_LIVE):
            rows = [row for m, w in items for row in _intake_rows(m, w)]
            ops._into_view(conn, "intake", INTAKE_COLUMNS, rows)
        assert _rows(conn) == before and conn.in_transaction
        res = ops.accept_many(conn, items)
        assert [(r.queue_id, r.queued, r.duplicates) for r in res] == [
            ("Q1", ("y@x.org",), ()),
            (None, (), ("w@x.org",)),
        ]
    finally:
        conn.execute("ROLLBACK")


def test_a_queue_id_taken_twice_fails_the_whole_intake(conn: sqlite3.Connection) -> None:
    """Not a live key but another constraint (the messages' primary key): the error goes to
    the writer (which fails that job alone), and nothing of the batch stays written."""
    conn.execute("BEGIN")
    try:
        ops.accept(conn, _msg("Q1", NOW, ("a@x.org", "k1", None)), WINDOW)
        before = _rows(conn)
        batch = [_msg("Q2", NOW, ("b@x.org", "k2", None)), _msg("Q1", NOW, ("c@x.org", "k3", None))]
        with pytest.raises(sqlite3.IntegrityError) as e:
            ops.accept_many(conn, [(m, WINDOW) for m in batch])
        assert INTAKE_LIVE not in str(e.value)
        assert _rows(conn) == before
    finally:
        conn.execute("ROLLBACK")


def _intake_rows(m: ops.NewMessage, window: float) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for i, r in enumerate(m.recipients):
        rows.append(
            (r.dedup_key, m.queue_id, m.created_at, r.content_hash, r.fingerprint, window, i == 0,
             m.message_id, m.sender, m.size, m.client, m.peer, m.lane, m.identity,
             m.body if i == 0 else None, m.body_path, m.listener, r.address, r.destination,
             m.lane_prio)
        )  # fmt: skip
    return rows


def _accept(m: ops.NewMessage, atomic: bool = True) -> Grouped[ops.AcceptResult]:
    return Grouped(ops.accept_many, (m, WINDOW), sqlite=True, atomic=atomic)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "savepoint"])
def test_the_sqlite_writer_runs_accepts_of_a_batch_as_one_group(
    tmp_path: Path, atomic: bool
) -> None:
    w = SpoolWriter(tmp_path / "spool")
    w.start()
    try:
        msgs = [_msg(f"Q{i:02}", NOW + i, (f"r{i}@x.org", f"k{i}", None)) for i in range(20)]
        res = _batched(w, [_accept(m, atomic) for m in msgs])
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


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "savepoint"])
def test_one_bad_accept_of_a_sqlite_group_fails_alone(tmp_path: Path, atomic: bool) -> None:
    """Q1 again (its queue id is taken): the group fails, is rolled back (atomic: SQLite
    backs its one statement out), and its jobs run one by one; only that one fails."""
    w = SpoolWriter(tmp_path / "spool")
    w.start()
    try:
        w.run_sync(_accept(_msg("Q1", NOW, ("a@x.org", "k1", None)), atomic))
        batch = [
            _msg("Q2", NOW + 1, ("b@x.org", "k2", None)),
            _msg("Q1", NOW + 2, ("c@x.org", "k3", None)),
            _msg("Q3", NOW + 3, ("d@x.org", "k4", None)),
        ]
        res = _batched(w, [_accept(m, atomic) for m in batch])
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


@pytest.mark.parametrize("limit", [None, 999], ids=["library", "999"])
def test_accept_many_on_sqlite_past_one_statements_parameters(
    conn: sqlite3.Connection, limit: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """90 messages x 5 recipients: 450 rows of 20 values, one statement under this SQLite's
    limit, 10 under the 999 of SQLite before 3.32 (under a savepoint): the same rows as
    one by one, and the keys taken over where expired."""
    if limit is not None:
        monkeypatch.setattr(ops, "_sqlite_params", lambda _c: limit)
    batch = _big_batch(90, 5)
    seed = [("k7-3", "OLD", NOW - WINDOW - 1, None), ("k80-0", "OLD", NOW - WINDOW - 1, None)]
    alone, state_alone = _run(conn, seed, batch, grouped=False)
    together, state_together = _run(conn, seed, batch, grouped=True)
    assert together == alone
    assert state_together == state_alone
    assert len(state_together[1]) == 450


def test_accept_many_on_sqlite_is_one_statement(conn: sqlite3.Connection) -> None:
    """The batch's rows go in one statement for the three tables, not one per table or per
    row: each statement lets go of the GIL a few times and waits to have it back (the
    inbound's event loop runs meanwhile), so each was a few hand-overs of the GIL."""
    batch = _big_batch(4, 3)
    counted = _Counted(conn)
    conn.execute("BEGIN")
    try:
        res = ops.accept_many(counted, [(m, WINDOW) for m in batch])  # type: ignore[arg-type]
        assert _rows(conn) == (4, 12, 12)
    finally:
        conn.execute("ROLLBACK")
    assert [r.queue_id for r in res] == [m.queue_id for m in batch]
    assert counted.sql == ["INSERT INTO intake"]


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "savepoint"])
def test_an_atomic_batch_of_accepts_is_three_statements(tmp_path: Path, atomic: bool) -> None:
    """The writer opens no SAVEPOINT around an atomic group, nor around an atomic job alone:
    a batch of accepts is BEGIN IMMEDIATE, the INSERT, COMMIT."""
    w = SpoolWriter(tmp_path / "spool")
    w.start()
    seen: list[str] = []
    try:
        assert w._conn is not None
        w._conn.set_trace_callback(lambda sql: seen.append(sql.split(" VALUES")[0]))
        res = _batched(
            w,
            [_accept(_msg(f"Q{i}", NOW, (f"r{i}@x.org", f"k{i}", None)), atomic) for i in range(5)],
        )
        assert [r.queue_id for r in res] == [f"Q{i}" for i in range(5)]
        w.run_sync(_accept(_msg("Q9", NOW, ("r9@x.org", "k9", None)), atomic))
    finally:
        w.close()
    statements = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]  # a trigger's
    # statements are traced as the INSERT that runs them
    ours = [s for s in statements if not s.startswith("SELECT")]  # _batched's gate
    saved = [] if atomic else ["SAVEPOINT job"]
    released = [] if atomic else ["RELEASE job"]
    one = ["BEGIN IMMEDIATE", *saved, "INSERT INTO intake", *released, "COMMIT"]
    assert ours[-2 * len(one) :] == one + one, statements


# --- random batches: the one statement decides as `accept` one by one ------------------------

_KEYS = ["k1", "k2", "k3", "k4"]
_ADDRS = ["a@x.org", "b@x.org", "c@y.org"]
_seed_rows = st.lists(
    st.tuples(
        st.sampled_from(_KEYS),
        # expired, at the window's edge (for Q0, Q1), or live
        st.sampled_from([-2 * WINDOW, -WINDOW - 1, -WINDOW, -WINDOW + 0.1, -WINDOW / 2, 0.0]),
        st.sampled_from([None, "h1"]),
        st.sampled_from([None, "fpA"]),
    ),
    max_size=4,
    unique_by=lambda r: r[0],
)
_rcpt = st.one_of(
    st.tuples(
        st.sampled_from(_ADDRS), st.sampled_from(_KEYS), st.none(), st.sampled_from(["fpA", "fpB"])
    ),
    st.tuples(st.sampled_from(_ADDRS), st.sampled_from(_KEYS), st.sampled_from(["h1", "h2"])),
)
# a message's recipients by address (its keys are made from them: one address has one key
# in a message, and `accept` keeps one row per address)
_batch = st.lists(
    st.lists(_rcpt, min_size=0, max_size=3, unique_by=lambda r: r[0]), min_size=1, max_size=5
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=_seed_rows, batch=_batch)
def test_accept_many_decides_random_batches_as_accept_one_by_one(
    conn: sqlite3.Connection,
    seed: list[tuple[str, float, str | None, str | None]],
    batch: list[list[tuple[Any, ...]]],
) -> None:
    """Keys live, expired, repeated in the batch or in one message, Idempotency-Keys with
    their content hashes, Message-IDs reused for other content (fingerprints), messages
    without recipients: the results, the rows and the recipients' ids of the one statement
    (or of its fall-back) are those of `accept` one message after the other."""
    msgs = [_msg(f"Q{i}", NOW + i * 0.1, *rcpts) for i, rcpts in enumerate(batch)]

    def run(grouped: bool) -> tuple[Any, ...]:
        conn.execute("BEGIN")
        try:
            for key, age, h, fp in seed:
                conn.execute(
                    "INSERT INTO dedup (key, msg_id, created_at, content_hash, fingerprint)"
                    " VALUES (?,?,?,?,?)",
                    (key, "OLD", NOW + age, h, fp),
                )
            items = [(m, WINDOW) for m in msgs]
            res = (
                ops.accept_many(conn, items)
                if grouped
                else [ops.accept(conn, m, w) for m, w in items]
            )
            ids = [r[0] for r in conn.execute("SELECT id FROM recipients ORDER BY msg_id, id")]
            return res, _dump(conn), ids
        finally:
            conn.execute("ROLLBACK")

    assert run(grouped=True) == run(grouped=False)
