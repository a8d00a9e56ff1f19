"""The engine's records of one writer batch on SQLite (issues 29 and 31): one group, one
SAVEPOINT, one INSERT into the connection's `outcome` view for every outcome and a few
prepared statements, leaving every row (recipients, attempt log, suppression list, daily
and hourly counters) as `record` one call after the other would, and one bad record still
failing alone; and a claim's mark as one statement."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.delivery import recorder
from relay.spool import db, ops
from relay.spool.writer import Grouped, SpoolWriter
from tests.spool.test_batching import NOW, WINDOW, _batched, _msg, _outcomes, _record_state

Calls = list[tuple[list[ops.RcptUpdate], float, str | None]]


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = db.connect(tmp_path / "spool")
    yield c
    c.close()


def _state(conn: Any) -> tuple[list[Any], ...]:
    """`_record_state`, with the attempt log's ids and rcpt ids (the same order, the same
    ids) and the ceiling holds."""
    return (
        *_record_state(conn),
        [tuple(r) for r in conn.execute("SELECT id, rcpt_id FROM attempts ORDER BY id")],
        [tuple(r) for r in conn.execute("SELECT * FROM ceiling_holds ORDER BY node, scope")],
    )


def _seed(conn: sqlite3.Connection, n: int) -> tuple[list[int], list[str]]:
    """`n` messages of one recipient each, claimed by n1; Q3 held by an operator meanwhile
    and then `sending` again under n2's lease; Q5 and on of another identity."""
    for i in range(n):
        m = _msg(f"Q{i}", NOW, (f"r{i}@x.org", f"k{i}", None))
        if i >= 5:
            m = dataclasses.replace(m, identity="other.org")
        ops.accept(conn, m, WINDOW)
    claims = sorted(
        ops.claim_due(conn, NOW, 2 * n, owner="n1", lease_until=NOW + 30), key=lambda c: c.msg_id
    )
    ids, qids = [c.rcpt_id for c in claims], [c.msg_id for c in claims]
    ops.hold(conn, [qids[3]], NOW)
    conn.execute("UPDATE recipients SET state = 'sending' WHERE msg_id = ?", (qids[3],))
    conn.execute("UPDATE recipients SET lease_owner = 'n2' WHERE msg_id = ?", (qids[3],))
    return ids, qids


def _cases(ids: list[int], qids: list[str]) -> dict[str, Calls]:
    base = _outcomes(ids, qids)
    log = ops.AttemptLog("delivered", "250 ok", "y.org", "mx.y.org", 0.25)
    more = [
        [
            ops.RcptUpdate(  # another identity, in the same hour as the first call
                ids[5], qids[5], ops.RcptState.DELIVERED, True, None, "250", None, log,
                counters=("dest:y.org", "id:other.org"), upstream_id="UP5",
            ),
            ops.RcptUpdate(  # the same address suppressed again: the first reason stays
                ids[6], qids[6], ops.RcptState.BOUNCED, True, None, "550 gone", None,
                ops.AttemptLog("bounce", "550 gone", "y.org", None, None),
                suppress=("c@x.ORG", "550 gone"),
            ),
        ],
        [
            ops.RcptUpdate(
                ids[7], qids[7], ops.RcptState.FAILED, True, None, "554 no", None, None,
                counters=("dest:y.org",),
            ),
        ],
    ]  # fmt: skip
    twice = [
        ops.RcptUpdate(ids[8], qids[8], ops.RcptState.DEFERRED, True, NOW + 300, "451", None),
    ]
    again = [
        ops.RcptUpdate(ids[8], qids[8], ops.RcptState.DELIVERED, True, None, "250", None, log),
    ]
    return {
        "record_many's cases": [
            (outs, NOW + 1 + k * 7200, f"day{k % 2}") for k, outs in enumerate(base)
        ],
        "counters summed over calls, days and hours": [
            (outs, NOW + 1 + k * 1800, f"day{k // 2}") for k, outs in enumerate(base + more)
        ],
        "one recipient in two calls": [(twice, NOW + 1, "d"), (again, NOW + 2, "d")],
        "nothing to record": [([], NOW + 1, "d"), ([], NOW + 2, "d")],
    }


CASE_NAMES = list(_cases(list(range(9)), ["q"] * 9))


def _recorded(conn: sqlite3.Connection, case: str, owner: str | None, grouped: bool) -> Any:
    return _record_run(conn, lambda ids, qids: _cases(ids, qids)[case], owner, grouped)


def _record_run(
    conn: sqlite3.Connection,
    make: Callable[[list[int], list[str]], Calls],
    owner: str | None,
    grouped: bool,
    prepare: Callable[[list[int]], None] = lambda _ids: None,
) -> Any:
    """The calls `make` gives for the nine seeded recipients (after `prepare`), recorded
    by `record_many` (`grouped`) or by `record` one call after the other: the counts and
    every row, rolled back."""
    conn.execute("BEGIN")
    try:
        ids, qids = _seed(conn, 9)
        prepare(ids)
        calls = make(ids, qids)
        if grouped:
            counts = ops.record_many(conn, calls, owner)
        else:
            counts = [ops.record(conn, o, now, day, owner) for o, now, day in calls]
        return counts, _state(conn)
    finally:
        conn.execute("ROLLBACK")


@pytest.mark.parametrize("owner", ["n1", None])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_record_many_on_sqlite_records_as_record_one_call_after_the_other(
    conn: sqlite3.Connection, case: str, owner: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _recorded(conn, case, owner, grouped=False)
    calls: list[int] = []
    each = ops._record_each

    def counted(c: Any, outs: Any, now: float, day: str | None, own: str | None) -> int:
        calls.append(len(outs))
        return each(c, outs, now, day, own)

    monkeypatch.setattr(ops, "_record_each", counted)
    together = _recorded(conn, case, owner, grouped=True)
    assert together == alone
    # the batch's own statements, unless one recipient is in it twice
    assert bool(calls) == (case == "one recipient in two calls")
    if case == "record_many's cases":
        counts, state = alone
        assert counts == ([2, 3, 0] if owner is None else [2, 2, 0])
        assert state[1] and state[2] and state[3] and state[4]  # every table was written


def test_record_many_on_sqlite_refuses_a_state_an_attempt_cannot_make(
    conn: sqlite3.Connection,
) -> None:
    bad = ops.RcptUpdate(1, "Q1", ops.RcptState.HELD, True, None, None)
    with pytest.raises(ValueError, match="cannot make"):
        ops.record_many(conn, [([], NOW, None), ([bad], NOW, None)])


class _Stale:
    """A connection whose read of the recipients to record finds them all `sending`: as if
    one changed between the read and the update."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, args: Any = ()) -> Any:
        if sql.startswith("SELECT r.id, r.msg_id, m.identity FROM recipients"):
            return self.conn.execute(
                "SELECT r.id, r.msg_id, m.identity FROM recipients r"
                " JOIN messages m ON m.id = r.msg_id"
            )
        return self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: Any) -> Any:
        return self.conn.executemany(sql, rows)

    @property
    def total_changes(self) -> int:
        return self.conn.total_changes


def test_a_recipient_changed_behind_the_read_fails_the_group(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN")
    try:
        ids, qids = _seed(conn, 9)
        calls = _cases(ids, qids)["record_many's cases"]
        with pytest.raises(RuntimeError, match="changed between"):
            ops.record_many(_Stale(conn), calls, "n1")  # type: ignore[arg-type]
    finally:
        conn.execute("ROLLBACK")


class _Counted:
    """A connection that counts the statements it is given, and their rows for
    `executemany` (a trigger's own statements are not the caller's)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.sql: list[str] = []

    def execute(self, sql: str, args: Any = ()) -> Any:
        self.sql.append(sql.split(" VALUES")[0].split(" WHERE")[0])
        return self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: Any) -> Any:
        rows = list(rows)
        self.sql += [sql.split(" VALUES")[0]] * len(rows)
        return self.conn.executemany(sql, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def test_the_outcomes_of_a_batch_are_one_statement(conn: sqlite3.Connection) -> None:
    """Every outcome of the batch (the recipient's update and its attempt-log row) in one
    INSERT: each statement lets go of the GIL a few times, and the engine's event loop
    runs the SMTP connections meanwhile. Then the suppression list and the counters, a row
    each (summed)."""
    conn.execute("BEGIN")
    try:
        ids, qids = _seed(conn, 9)
        calls = _cases(ids, qids)["counters summed over calls, days and hours"]
        counted = _Counted(conn)
        ops.record_many(counted, calls, "n1")  # type: ignore[arg-type]
        attempts = conn.execute("SELECT count(*) FROM attempts").fetchone()[0]
    finally:
        conn.execute("ROLLBACK")
    outcomes = [s for s in counted.sql if "outcome" in s]
    assert outcomes == ["INSERT INTO outcome"], counted.sql
    assert "UPDATE recipients SET" not in " ".join(counted.sql)
    assert attempts == sum(1 for outs, _n, _d in calls for o in outs if o.log is not None) - 1
    # (the held one, Q3 under n2's lease, is not n1's to record: nothing of it is written)


def test_a_claim_marks_its_recipients_in_one_statement(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN")
    try:
        for i in range(6):
            ops.accept(conn, _msg(f"Q{i}", NOW, (f"r{i}@x.org", f"k{i}", None)), WINDOW)
        counted = _Counted(conn)
        claims = ops.claim_due(counted, NOW, 10, owner="n1", lease_until=NOW + 30)  # type: ignore[arg-type]
        marked = conn.execute(
            "SELECT count(*) FROM recipients WHERE state = 'sending' AND lease_owner = 'n1'"
            " AND lease_until = ? AND updated_at = ?",
            (NOW + 30, NOW),
        ).fetchone()[0]
    finally:
        conn.execute("ROLLBACK")
    assert len(claims) == 6 and marked == 6
    assert [s for s in counted.sql if s.startswith("UPDATE")] == [
        "UPDATE recipients SET state = 'sending', hold_after = 0, updated_at = ?,"
        " lease_owner = ?, lease_until = ?"
    ], counted.sql


def test_an_outcome_of_another_message_fails_the_group(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN")
    try:
        ids, qids = _seed(conn, 9)
        wrong = ops.RcptUpdate(ids[0], qids[1], ops.RcptState.DELIVERED, True, None, "250")
        with pytest.raises(RuntimeError, match="not one of"):
            ops.record_many(conn, [([wrong], NOW, "d"), ([], NOW, "d")])
    finally:
        conn.execute("ROLLBACK")


# --- through the writer: the engine's record jobs -------------------------------------------


def _job(outs: list[ops.RcptUpdate], now: float, day: str | None, sqlite: bool) -> Any:
    rec = recorder._Record(tuple(outs), now, day, "n1", {"dest:x.org": 1}, [], 60.0, ())
    return Grouped(recorder.record_jobs, rec, sqlite=sqlite)


def _through_writer(tmp_path: Path, sqlite: bool, bad: bool = False) -> tuple[Any, ...]:
    w = SpoolWriter(tmp_path / ("grouped" if sqlite else "alone"))
    w.start()
    try:

        def seed(c: sqlite3.Connection) -> tuple[list[int], list[str]]:
            got = _seed(c, 9)
            c.execute(
                "INSERT INTO ceiling_holds (node, scope, n, until)"
                " VALUES ('n1', 'dest:x.org', 5, 0)"
            )
            return got

        ids, qids = w.run_sync(seed)
        calls = _cases(ids, qids)["counters summed over calls, days and hours"]
        if bad:  # a state an attempt cannot make: that job fails, alone
            held = ops.RcptUpdate(ids[7], qids[7], ops.RcptState.HELD, True, None, None)
            calls[3] = ([held], *calls[3][1:])
        res = _batched(w, [_job(o, now, day, sqlite) for o, now, day in calls])
        return [type(r).__name__ for r in res], w.grouped, w.run_sync(_state)
    finally:
        w.close()


@pytest.mark.parametrize("bad", [False, True])
def test_the_sqlite_writer_runs_the_records_of_a_batch_as_one_group(
    tmp_path: Path, bad: bool
) -> None:
    res_alone, grouped_alone, alone = _through_writer(tmp_path, sqlite=False, bad=bad)
    res_together, grouped, together = _through_writer(tmp_path, sqlite=True, bad=bad)
    assert together == alone
    assert res_together == res_alone
    assert grouped_alone == 0
    if bad:  # the group was rolled back and its jobs ran one by one: only that one failed
        assert res_alone == ["NoneType"] * 3 + ["ValueError", "NoneType"]
        assert grouped == 0
    else:
        assert res_alone == ["NoneType"] * 5
        assert grouped == 5
    assert together[1]  # the attempt log was written
    # 5 held, each job frees 1
    assert together[6] == ([] if not bad else [("n1", "dest:x.org", 1, 0.0)])


def test_the_group_finds_its_recipients_by_id_not_by_scanning_those_in_flight(
    conn: sqlite3.Connection,
) -> None:
    """SQLite's planner, left to itself, read every recipient `sending` through
    recipients_waiting and tested each against the batch's ids."""
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    conn.execute("BEGIN")
    try:
        ids, qids = _seed(conn, 9)
        ops.record_many(conn, _cases(ids, qids)["record_many's cases"], "n1")
        (select,) = [s for s in seen if s.startswith("SELECT r.id, r.msg_id, m.identity")]
        conn.set_trace_callback(None)
        plan = " | ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + select))
    finally:
        conn.set_trace_callback(None)
        conn.execute("ROLLBACK")
    assert "SEARCH r USING INTEGER PRIMARY KEY" in plan, plan


# --- random batches: the one statement records as `record` one call after the other -------

_outcome = st.tuples(
    st.integers(0, 8),  # which of the nine recipients (Q3's is n2's: not n1's to record)
    st.sampled_from(
        [ops.RcptState.DELIVERED, ops.RcptState.DEFERRED, ops.RcptState.BOUNCED,
         ops.RcptState.FAILED]
    ),
    st.booleans(),  # counts an attempt
    st.booleans(),  # logged
    st.sampled_from([(), ("dest:x.org",), ("dest:y.org", "id:example.com")]),
    st.booleans(),  # suppress
    st.sampled_from([None, "UP"]),
)  # fmt: skip
_calls = st.lists(st.lists(_outcome, max_size=3, unique_by=lambda o: o[0]), min_size=2, max_size=4)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=_calls, owner=st.sampled_from(["n1", None]), held=st.booleans())
def test_record_many_records_random_batches_as_record_one_call_after_the_other(
    conn: sqlite3.Connection, calls: list[list[tuple[Any, ...]]], owner: str | None, held: bool
) -> None:
    """Outcomes of every kind, logged or not, counted or not, with counters, suppressions and
    upstream ids, in calls of several outcomes, over recipients `sending` (one under another
    node's lease, one held by an operator during its attempt when `held`): the counts and
    every row of `record_many` (one statement for the outcomes) are those of `record` one
    call after the other, or of its fall-back when a recipient is in two calls."""
    log = ops.AttemptLog("delivered", "250 ok", "x.org", "mx.x.org", 0.5)

    def make(ids: list[int], qids: list[str]) -> Calls:
        return [
            (
                [
                    ops.RcptUpdate(
                        ids[i], qids[i], state, counted,
                        NOW + 60 if state is ops.RcptState.DEFERRED else None,
                        f"{state} reply", None, log if logged else None,
                        (f"r{i}@x.org", "550 gone") if suppress else None,
                        counters, upstream,
                    )
                    for i, state, counted, logged, counters, suppress, upstream in outs
                ],
                NOW + 1 + k * 1800,
                f"day{k // 2}",
            )
            for k, outs in enumerate(calls)
        ]  # fmt: skip

    def prepare(ids: list[int]) -> None:
        if held:  # an operator's hold during the attempt (relay/spool/model.py)
            conn.execute("UPDATE recipients SET hold_after = 1 WHERE id = ?", (ids[1],))

    def run(grouped: bool) -> Any:
        return _record_run(conn, make, owner, grouped, prepare)

    assert run(grouped=True) == run(grouped=False)
