"""Which due recipients a claim takes: lanes in order, the oldest first, up to the limit;
never a (lane, destination) whose queue is full (`skip`), nor one whose destination takes
no attempt now (`waiting`) unless it is past retry.max_age (`expired_before`). On both
backends (the spool contract); each row below was a surviving mutant of claim_due."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from relay.spool import ops
from tests.pgserver import BACKENDS, open_backend
from tests.spool.test_ops import put, run

T0 = 1_700_000_000.0
INF = float("-inf")
OLD = T0 - 500  # expired_before: created before this is past retry.max_age

# one recipient per message, created at distinct instants: (address, lane, created_at)
QUEUE = [
    ("t-a2@a.test", "transactional", T0 - 1000),
    ("t-a1@a.test", "transactional", T0 - 10),
    ("t-b1@b.test", "transactional", T0 - 5),
    ("b-b2@b.test", "bulk", T0 - 1000),
    ("b-a1@a.test", "bulk", T0 - 10),
    ("b-b1@b.test", "bulk", T0 - 5),
]
T, B = 0, 1  # lane priorities


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    for i, (addr, lane, at) in enumerate(QUEUE):
        put(c, f"M{i}", [addr], created_at=at, lane=lane)
    yield c
    c.close()


@pytest.mark.parametrize(
    ("skip", "waiting", "expired_before", "want"),
    [
        ([], [], INF, ["t-a2", "t-a1", "t-b1", "b-b2", "b-a1", "b-b1"]),
        ([(T, None)], [], INF, ["b-b2", "b-a1", "b-b1"]),
        ([(B, None)], [], INF, ["t-a2", "t-a1", "t-b1"]),
        ([(T, "a.test")], [], INF, ["t-b1", "b-b2", "b-a1", "b-b1"]),
        ([(T, "b.test"), (B, "b.test")], [], INF, ["t-a2", "t-a1", "b-a1"]),
        ([(T, None), (B, None)], [], INF, []),
        ([(T, "b.test"), (B, None)], [], INF, ["t-a2", "t-a1"]),  # both kept
        ([(B, None), (T, "b.test")], [], INF, ["t-a2", "t-a1"]),
        ([(T, None), (B, None)], [], OLD, []),  # full queues: not even the expired
        ([], [(B, None)], INF, ["t-a2", "t-a1", "t-b1"]),
        ([], [(B, None)], OLD, ["t-a2", "t-a1", "t-b1", "b-b2"]),
        ([], [(T, "a.test")], OLD, ["t-a2", "t-b1", "b-b2", "b-a1", "b-b1"]),
        ([], [(T, "a.test")], INF, ["t-b1", "b-b2", "b-a1", "b-b1"]),
        ([], [(T, None), (B, None)], INF, []),
        ([], [(T, None), (B, None)], OLD, ["t-a2", "b-b2"]),
        ([(T, None)], [(B, None)], INF, []),
        ([(T, None)], [(B, None)], OLD, ["b-b2"]),
        ([(B, "b.test")], [(T, "a.test")], OLD, ["t-a2", "t-b1", "b-a1"]),
    ],
)
def test_what_a_claim_takes(
    conn: sqlite3.Connection,
    skip: list[tuple[int, str | None]],
    waiting: list[tuple[int, str | None]],
    expired_before: float,
    want: list[str],
) -> None:
    got = run(conn, ops.claim_due, T0 + 1, 10, skip, waiting, expired_before, "n", T0 + 30)
    assert [c.address.split("@")[0] for c in got] == want
    sending = {
        r[0].split("@")[0]
        for r in conn.execute("SELECT address FROM recipients WHERE state = 'sending'")
    }
    assert sending == set(want)


@pytest.mark.parametrize(
    ("limit", "want"),
    [
        (1, ["t-a2"]),
        (2, ["t-a2", "t-a1"]),
        (3, ["t-a2", "t-a1", "t-b1"]),
        (4, ["t-a2", "t-a1", "t-b1", "b-b2"]),  # the rest of the limit goes to the next lane
        (5, ["t-a2", "t-a1", "t-b1", "b-b2", "b-a1"]),
    ],
)
def test_a_claim_stops_at_its_limit_lane_by_lane(
    conn: sqlite3.Connection, limit: int, want: list[str]
) -> None:
    got = run(conn, ops.claim_due, T0 + 1, limit)
    assert [c.address.split("@")[0] for c in got] == want
    left = conn.execute("SELECT count(*) FROM recipients WHERE state <> 'sending'").fetchone()
    assert left[0] == len(QUEUE) - limit


@pytest.mark.parametrize("limit", [2, 4, 10])
def test_a_claim_reads_its_messages_envelopes_as_load_envelopes_does(
    conn: sqlite3.Connection, limit: int
) -> None:
    # a message with two recipients, claimed together with the others: its envelope once,
    # body and all (PostgreSQL sends the body in its first row only)
    put(conn, "MX", ["t-x1@a.test", "t-x2@b.test"], created_at=T0 - 2000, lane="transactional")
    envs: dict[str, ops.Envelope] = {}
    got = run(conn, ops.claim_due, T0 + 1, limit, envelopes=envs)
    assert len(got) == min(limit, len(QUEUE) + 2)
    assert [c.address for c in got][:2] == ["t-x1@a.test", "t-x2@b.test"]
    assert envs == ops.load_envelopes(conn, {c.msg_id for c in got})
    assert envs["MX"].body is not None or envs["MX"].body_path is not None
