"""Fewer round trips on PostgreSQL (issue 31): the writer's groups and the set-based spool
operations give every job the result it would have had alone, and one bad job still fails
alone."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest

from relay.config.tree import PgSpool
from relay.feedback import apply
from relay.spool import ops, pg
from relay.spool.model import RcptState
from relay.spool.writer import Grouped, SpoolWriter, plan
from tests.pgserver import pg_dsn  # noqa: F401 (fixture)

WINDOW = 3600.0


def _msg(qid: str, at: float, *rcpts: tuple[str, ...] | tuple[str, str, None]) -> ops.NewMessage:
    """Recipients as (address, dedup key, content hash[, content fingerprint])."""
    return ops.NewMessage(
        queue_id=qid,
        message_id=f"<{qid}@x>",
        sender="s@example.com",
        size=10,
        created_at=at,
        client="listener:smtp",
        peer="127.0.0.1",
        lane="transactional",
        lane_prio=0,
        identity="example.com",
        body=b"body " + qid.encode(),
        body_path=None,
        recipients=tuple(
            ops.NewRecipient(r[0], r[0].rpartition("@")[2], r[1], r[2], *r[3:]) for r in rcpts
        ),
        listener="smtp" if qid != "Q5" else None,
    )


def _dump(conn: Any) -> tuple[list[Any], ...]:
    return (
        [
            tuple(r)
            for r in conn.execute(
                "SELECT id, message_id, sender, size, created_at, client, peer, lane, identity,"
                " body, body_path, listener FROM messages ORDER BY id"
            )
        ],
        [
            tuple(r)
            for r in conn.execute(
                "SELECT msg_id, address, destination, lane_prio, state, attempts,"
                " next_attempt_at, dedup_key, updated_at FROM recipients ORDER BY msg_id, address"
            )
        ],
        [
            tuple(r)
            for r in conn.execute(
                "SELECT key, msg_id, created_at, content_hash, fingerprint FROM dedup ORDER BY key"
            )
        ],
    )


NOW = 1_800_000_000.0
# (seeded dedup rows, the batch): every case a sequence `accept` decides one by one
CASES: list[tuple[str, list[tuple[str, str, float, str | None]], list[ops.NewMessage]]] = [
    (
        "fresh messages, one with two recipients",
        [],
        [
            _msg("Q1", NOW, ("a@x.org", "k1", None)),
            _msg("Q2", NOW + 0.1, ("b@y.org", "k2", None), ("c@y.org", "k3", None)),
        ],
    ),
    (
        "a key repeated later in the batch and inside one message",
        [],
        [
            _msg("Q1", NOW, ("a@x.org", "k1", None)),
            _msg("Q2", NOW + 0.1, ("a@x.org", "k1", None), ("b@x.org", "k2", None)),
            _msg("Q3", NOW + 0.2, ("c@x.org", "k3", None), ("c@x.org", "k3", None)),
        ],
    ),
    (
        "live and expired keys in the database",
        [("k1", "OLD1", NOW - 10, None), ("k2", "OLD2", NOW - WINDOW - 5, None)],
        [
            _msg("Q1", NOW, ("a@x.org", "k1", None)),
            _msg("Q2", NOW + 0.1, ("b@x.org", "k2", None)),
            _msg("Q3", NOW + 0.2, ("c@x.org", "k1", None), ("d@x.org", "k4", None)),
        ],
    ),
    (
        "an idempotency key reused for other content queues nothing of its message",
        [("k1", "OLD1", NOW - 10, "h1")],
        [
            _msg("Q1", NOW, ("a@x.org", "k1", "h2"), ("b@x.org", "k2", "h2")),
            _msg("Q2", NOW + 0.1, ("a@x.org", "k1", "h1")),
            _msg("Q3", NOW + 0.2, ("b@x.org", "k2", "h3")),
            _msg("Q4", NOW + 0.3, ("e@x.org", "k5", "h5")),
            _msg("Q5", NOW + 0.4, ("e@x.org", "k5", "h6")),
        ],
    ),
    (
        "Message-IDs reused for other content (fingerprints): queued under the variant key",
        [],
        [
            _msg("Q1", NOW, ("a@x.org", "k1", None, "fpA"), ("b@x.org", "k2", None, "fpA")),
            _msg("Q2", NOW + 0.1, ("a@x.org", "k1", None, "fpB")),  # other content: queued
            _msg("Q3", NOW + 0.2, ("b@x.org", "k2", None, "fpA")),  # same content: duplicate
            _msg("Q4", NOW + 0.3, ("a@x.org", "k1", None, "fpB")),  # Q2 again: duplicate
        ],
    ),
    (
        "fresh keys stored with their fingerprints",
        [],
        [
            _msg("Q1", NOW, ("a@x.org", "k1", None, "fpA")),
            _msg("Q2", NOW + 0.1, ("b@x.org", "k2", None, "fpB")),
        ],
    ),
    ("one fresh message alone (one statement)", [], [_msg("Q1", NOW, ("a@x.org", "k1", None))]),
    (
        "one message alone whose second key is live: rolled back to `accept`",
        [("k2", "OLD2", NOW - 10, None)],
        [_msg("Q1", NOW, ("a@x.org", "k1", None), ("b@x.org", "k2", None))],
    ),
    (
        "every recipient a duplicate",
        [("k1", "OLD1", NOW - 10, None)],
        [_msg("Q1", NOW, ("a@x.org", "k1", None)), _msg("Q2", NOW, ("a@x.org", "k1", None))],
    ),
]


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[pg.PgConnection]:  # noqa: F811
    c = pg.connect(pg_dsn)
    yield c
    c.close()


def _run(
    conn: pg.PgConnection,
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
        return res, _dump(conn)
    finally:
        conn.execute("ROLLBACK")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_accept_many_decides_as_accept_one_by_one(
    conn: pg.PgConnection,
    case: tuple[str, list[tuple[str, str, float, str | None]], list[ops.NewMessage]],
) -> None:
    _name, seed, batch = case
    alone, state_alone = _run(conn, seed, batch, grouped=False)
    together, state_together = _run(conn, seed, batch, grouped=True)
    assert together == alone
    assert state_together == state_alone
    assert state_alone[0] or not any(r.queue_id for r in alone)  # the case queues something


def test_accept_many_falls_back_when_one_key_would_be_taken_twice(
    conn: pg.PgConnection,
) -> None:
    # a window shorter than the gap between two messages of the batch: the second takes
    # the key over again (one INSERT cannot), so they run one by one
    batch = [_msg("Q1", NOW, ("a@x.org", "k1", None)), _msg("Q2", NOW + 5, ("a@x.org", "k1", None))]
    conn.execute("BEGIN")
    try:
        res = ops.accept_many(conn, [(m, 1.0) for m in batch])
        rows = conn.execute("SELECT key, msg_id FROM dedup").fetchall()
    finally:
        conn.execute("ROLLBACK")
    assert [r.queue_id for r in res] == ["Q1", "Q2"]
    assert [tuple(r) for r in rows] == [("k1", "Q2")]


def test_a_key_another_node_took_after_the_read_is_a_duplicate(pg_dsn: str) -> None:  # noqa: F811
    """The take waits on the other node's uncommitted key; when it commits, the key is
    its own and this batch queues the rest."""
    a, b = pg.connect(pg_dsn), pg.connect(pg_dsn)
    try:
        b.execute("BEGIN")
        ops.accept(b, _msg("B1", NOW, ("z@x.org", "k9", None)), WINDOW)
        out: list[Any] = []

        def batch() -> None:
            a.execute("BEGIN")
            out.extend(
                ops.accept_many(
                    a,
                    [
                        (_msg("Q1", NOW, ("z@x.org", "k9", None), ("y@x.org", "k8", None)), WINDOW),
                        (_msg("Q2", NOW, ("w@x.org", "k9", None)), WINDOW),
                    ],
                )
            )
            a.execute("COMMIT")

        t = threading.Thread(target=batch)
        t.start()
        t.join(1.0)
        assert t.is_alive()  # waiting on B's key
        b.execute("COMMIT")
        t.join(10)
        assert out == [
            ops.AcceptResult("Q1", ("y@x.org",), ("z@x.org",)),
            ops.AcceptResult(None, (), ("w@x.org",)),
        ]
    finally:
        a.close()
        b.close()


def test_plan_groups_at_the_first_member_and_keeps_the_rest_in_order() -> None:
    def many(conn: Any, args: list[Any]) -> list[Any]:
        return args

    def other(conn: Any, args: list[Any]) -> list[Any]:
        return args

    def plain(conn: Any) -> None:
        return None

    fut: Any = None
    batch: list[Any] = [
        (plain, fut, None, False),
        (Grouped(many, 1), fut, None, False),
        (plain, fut, None, False),
        (Grouped(other, 2), fut, None, False),
        (Grouped(many, 3), fut, None, False),
    ]
    ids = [id(item) for item in batch]
    units = plan(batch, grouping=True)
    assert [[ids.index(id(i)) for i in u] for u in units] == [[0], [1, 4], [2], [3]]
    assert [[ids.index(id(i)) for i in u] for u in plan(batch, grouping=False)] == [
        [0],
        [1],
        [2],
        [3],
        [4],
    ]
    assert Grouped(many, 7)(None) == 7


def _writer(dsn: str, tmp_path: Path) -> SpoolWriter:
    w = SpoolWriter(tmp_path / "spool", PgSpool(dsn))
    w.start()
    return w


def _batched(w: SpoolWriter, jobs: list[Any]) -> list[Any]:
    """Run `jobs` in one batch of the writer (held until all are queued)."""
    gate = threading.Event()
    started = threading.Event()

    def hold(conn: Any) -> None:
        started.set()
        gate.wait(10)

    t0 = threading.Thread(target=lambda: w.run_sync(hold))
    t0.start()
    assert started.wait(10)

    async def main() -> list[Any]:
        tasks = [asyncio.ensure_future(w.run(j)) for j in jobs]
        for _ in range(1000):  # until every job waits in the queue behind `hold`
            if w._q.qsize() >= len(jobs):
                break
            await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        return asyncio.run(main())
    finally:
        gate.set()
        t0.join(10)


def test_the_writer_runs_accepts_of_a_batch_as_one_group(pg_dsn: str, tmp_path: Path) -> None:  # noqa: F811
    w = _writer(pg_dsn, tmp_path)
    try:
        msgs = [_msg(f"Q{i}", NOW + i, (f"r{i}@x.org", f"k{i}", None)) for i in range(20)]
        batches = w.batches
        res = _batched(w, [Grouped(ops.accept_many, (m, WINDOW)) for m in msgs])
        assert [r.queue_id for r in res] == [m.queue_id for m in msgs]
        assert w.batches == batches + 2 and w.grouped == 20
        n = w.run_sync(lambda c: c.execute("SELECT count(*) FROM recipients").fetchone()[0])
        assert n == 20
    finally:
        w.close()


def test_one_bad_job_of_a_group_fails_alone(pg_dsn: str, tmp_path: Path) -> None:  # noqa: F811
    """Q1 again (its queue id is taken): the group fails, is rolled back, and its jobs run
    one by one; only that one fails."""
    w = _writer(pg_dsn, tmp_path)
    try:
        w.run_sync(Grouped(ops.accept_many, (_msg("Q1", NOW, ("a@x.org", "k1", None)), WINDOW)))
        batch = [
            _msg("Q2", NOW + 1, ("b@x.org", "k2", None)),
            _msg("Q1", NOW + 2, ("c@x.org", "k3", None)),
            _msg("Q3", NOW + 3, ("d@x.org", "k4", None)),
        ]
        res = _batched(w, [Grouped(ops.accept_many, (m, WINDOW)) for m in batch])
        assert [type(r).__name__ for r in res] == ["AcceptResult", "SpoolError", "AcceptResult"]
        assert w.grouped == 0
        keys = w.run_sync(lambda c: [r[0] for r in c.execute("SELECT key FROM dedup ORDER BY key")])
        assert keys == ["k1", "k2", "k4"]  # the failed job's key rolled back with it
    finally:
        w.close()


def _record_state(conn: Any) -> tuple[list[Any], ...]:
    return (
        [
            tuple(r)
            for r in conn.execute(
                "SELECT msg_id, state, attempts, next_attempt_at, last_reply, reason,"
                " updated_at, upstream_id, lease_owner, lease_until FROM recipients ORDER BY id"
            )
        ],
        [
            tuple(r)
            for r in conn.execute(
                "SELECT a.msg_id, r.msg_id, a.at, a.destination, a.host, a.outcome, a.reply,"
                " a.duration FROM attempts a JOIN recipients r ON r.id = a.rcpt_id ORDER BY a.id"
            )
        ],
        [tuple(r) for r in conn.execute("SELECT * FROM suppression ORDER BY address")],
        # a node's counts are in its own rows (pg.COUNTER_TABLES): both tables, summed
        [
            tuple(r)
            for r in conn.execute(
                "SELECT scope, day, sum(count) FROM (SELECT scope, day, count FROM daily_counts"
                " UNION ALL SELECT scope, day, count FROM daily_counts_node) AS c"
                " GROUP BY scope, day ORDER BY scope, day"
            )
        ],
        [
            tuple(r)
            for r in conn.execute(
                "SELECT identity, hour, sum(delivered), sum(bounced), sum(complained) FROM"
                " (SELECT identity, hour, delivered, bounced, complained FROM identity_hours"
                " UNION ALL SELECT identity, hour, delivered, bounced, complained"
                " FROM identity_hours_node) AS h GROUP BY identity, hour ORDER BY identity, hour"
            )
        ],
    )


def _outcomes(ids: list[int], qids: list[str]) -> list[list[ops.RcptUpdate]]:
    log = ops.AttemptLog("delivered", "250 ok", "x.org", "mx.x.org", 0.5)
    return [
        [
            ops.RcptUpdate(
                ids[0],
                qids[0],
                ops.RcptState.DELIVERED,
                True,
                None,
                "250 ok",
                None,
                log,
                counters=("dest:x.org", "id:example.com"),
                upstream_id="UP1",
            ),
            ops.RcptUpdate(
                ids[1], qids[1], ops.RcptState.DEFERRED, False, NOW + 60, None, "circuit open"
            ),
        ],
        [
            ops.RcptUpdate(
                ids[2],
                qids[2],
                ops.RcptState.BOUNCED,
                True,
                None,
                "550 no",
                None,
                ops.AttemptLog("bounce", "550 no", "x.org", None, None),
                suppress=("C@X.org", "550 no"),
            ),
            ops.RcptUpdate(  # an operator held it meanwhile: not recorded
                ids[3],
                qids[3],
                ops.RcptState.DELIVERED,
                True,
                None,
                "250",
                None,
                log,
                counters=("dest:x.org",),
            ),
            ops.RcptUpdate(
                ids[4],
                qids[4],
                ops.RcptState.DELIVERED,
                True,
                None,
                "250 ok",
                None,
                None,
                counters=("dest:x.org",),
            ),
        ],
        [],
    ]


def _recorded(conn: pg.PgConnection, owner: str | None, grouped: bool) -> Any:
    conn.execute("BEGIN")
    try:
        msgs = [_msg(f"Q{i}", NOW, (f"r{i}@x.org", f"k{i}", None)) for i in range(5)]
        for m in msgs:
            ops.accept(conn, m, WINDOW)
        claims = ops.claim_due(conn, NOW, 10, owner="n1", lease_until=NOW + 30)
        ids = [c.rcpt_id for c in sorted(claims, key=lambda c: c.msg_id)]
        qids = [c.msg_id for c in sorted(claims, key=lambda c: c.msg_id)]
        ops.hold(conn, [qids[3]], NOW)
        conn.execute("UPDATE recipients SET state = 'sending' WHERE msg_id = ?", (qids[3],))
        conn.execute("UPDATE recipients SET lease_owner = 'n2' WHERE msg_id = ?", (qids[3],))
        calls = [
            (outs, NOW + 1 + k * 7200, f"day{k % 2}") for k, outs in enumerate(_outcomes(ids, qids))
        ]
        if grouped:
            counts = ops.record_many(conn, calls, owner)
        else:
            counts = [ops._record_each(conn, o, now, day, owner) for o, now, day in calls]
        conn.flush_counts()  # the counters the COMMIT would add (pg.COUNTER_TABLES)
        return counts, _record_state(conn)
    finally:
        conn.execute("ROLLBACK")


@pytest.mark.parametrize("owner", ["n1", None])
def test_record_many_records_as_record_one_outcome_after_the_other(
    conn: pg.PgConnection, owner: str | None
) -> None:
    alone = _recorded(conn, owner, grouped=False)
    together = _recorded(conn, owner, grouped=True)
    assert together == alone
    counts, state = alone
    assert counts == ([2, 3, 0] if owner is None else [2, 2, 0])
    assert state[1] and state[2] and state[3] and state[4]  # every table was written


def test_record_many_refuses_a_state_an_attempt_cannot_make(conn: pg.PgConnection) -> None:
    bad = ops.RcptUpdate(1, "Q1", ops.RcptState.HELD, True, None, None)
    with pytest.raises(ValueError, match="cannot make"):
        ops.record_many(conn, [([bad], NOW, None)])


def test_a_claim_pass_takes_its_ceiling_room_in_the_claims_own_commit(
    pg_dsn: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two recipients, a fleet-wide daily limit of 1: the pass claims both and takes the
    one unit of room in one writer batch (it took two before: claim, then room), and the
    recipient over the ceiling is deferred in the next; the room is held by this node."""
    import socket

    import yaml

    from relay.config.tree import load_config
    from relay.delivery.engine import Engine

    silent = socket.socket()  # an upstream that connects and never greets: the job waits
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    cfg_path = tmp_path / "relay.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "spool": {"path": "spool", "backend": "postgresql", "dsn": pg_dsn},
                "upstream": {
                    "mode": "smarthost",
                    "smarthost": {
                        "host": "127.0.0.1",
                        "port": silent.getsockname()[1],
                        "tls": "none",
                    },
                },
                "destinations": {"*": {"daily_limit": 1}},
                "fleet": {"node": "n1"},
            }
        )
    )
    cfg = load_config(str(cfg_path))
    assert cfg.spool_pg is not None
    w = SpoolWriter(cfg.spool_path, cfg.spool_pg)
    w.start()

    async def main() -> tuple[int, int, list[Any], list[Any]]:
        e = Engine(cfg, w)
        now = e.clock()
        for i in (1, 2):
            m = _msg(f"M{i}", now - 1, (f"u{i}@x.test", f"k{i}", None))
            await w.run(lambda c, m=m: ops.accept(c, m, 3600))
        before = w.batches
        claimed = await e.claims.claim_and_dispatch()
        batches = w.batches - before
        holds = await w.run(lambda c: c.execute("SELECT node, n FROM ceiling_holds").fetchall())
        states = await w.run(
            lambda c: c.execute("SELECT state, reason FROM recipients ORDER BY id").fetchall()
        )
        await e.stop(0.1)
        return claimed, batches, [tuple(h) for h in holds], [tuple(s) for s in states]

    try:
        claimed, batches, holds, states = asyncio.run(main())
    finally:
        w.close()
        silent.close()
    assert claimed == 2
    assert holds == [("n1", 1)], states
    assert sorted(s[0] for s in states) == ["deferred", "sending"]
    assert batches == 2  # the claim with its room, then the deferral of the other


def test_the_outbox_write_back_looks_at_touched_rows_and_at_all_every_full_pass(
    pg_dsn: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two queued rows delivered behind the outbox's back: an incremental pass writes back
    only the one the engine touched; the next full pass (FULL_PASS later) the other."""
    from relay.config.tree import load_config
    from relay.spool import outbox
    from tests.spool.test_outbox import MESSAGE, insert, outbox_rows

    path = tmp_path / "relay.yaml"
    path.write_text(
        f"spool: {{path: {tmp_path / 'spool'}, backend: postgresql, dsn: '{pg_dsn}'}}\n"
        "outbox: {enabled: true}\n"
    )
    cfg = load_config(path)
    assert cfg.spool_pg is not None
    w = SpoolWriter(cfg.spool_path, cfg.spool_pg)
    w.start()
    clock = {"t": 1000.0}

    def deliver(qid: str) -> None:
        w.run_sync(
            lambda c: c.execute(
                "UPDATE recipients SET state = 'delivered', attempts = 1 WHERE msg_id = ?",
                (qid,),
            )
        )

    async def main() -> list[dict[str, str]]:
        box = outbox.Outbox(lambda: cfg, w, lambda: None)
        box.clock = lambda: clock["t"]
        insert(pg_dsn, [("a", ["a@example.org"], MESSAGE), ("b", ["b@example.org"], MESSAGE)])
        await box.once(cfg)  # the first pass is a full one
        qid = {k: r["queue_id"] for k, r in outbox_rows(pg_dsn).items()}
        seen = []
        deliver(qid["a"])
        deliver(qid["b"])
        box.touched([qid["a"], "not-an-outbox-message"])
        clock["t"] += 1
        await box.once(cfg)
        seen.append({k: r["state"] for k, r in outbox_rows(pg_dsn).items()})
        clock["t"] += outbox.FULL_PASS
        await box.once(cfg)
        seen.append({k: r["state"] for k, r in outbox_rows(pg_dsn).items()})
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        w.close()
    assert seen == [
        {"a": "delivered", "b": "queued"},
        {"a": "delivered", "b": "delivered"},
    ]


def test_a_failed_write_back_keeps_what_it_was_to_look_at(
    pg_dsn: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    from relay.config.tree import load_config
    from relay.spool import outbox

    path = tmp_path / "relay.yaml"
    path.write_text(
        f"spool: {{path: {tmp_path / 'spool'}, backend: postgresql, dsn: '{pg_dsn}'}}\n"
        "outbox: {enabled: true}\n"
    )
    cfg = load_config(path)

    class Broken:
        calls = 0

        async def run(self, job: Any, lazy: bool = False) -> Any:
            self.calls += 1
            if self.calls == 1:  # take: nothing pending
                return outbox.Taken([], [], [])
            raise RuntimeError("the database is away")

    box = outbox.Outbox(lambda: cfg, cast(Any, Broken()), lambda: None)
    box._next_full = float("inf")  # incremental passes only
    box.touched(["Q1"])
    with pytest.raises(RuntimeError):
        asyncio.run(box.once(cfg))
    assert box._touched == {"Q1"}


def test_begin_and_savepoints_go_with_the_next_statement(conn: pg.PgConnection) -> None:
    """BEGIN and SAVEPOINT wait for the next statement (one round trip): the server sees no
    transaction until then; the transaction then behaves as if they had been sent alone."""
    pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]

    def state() -> str:
        with psycopg.connect(conn.dsn, autocommit=True) as c:
            row = c.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            return str(row[0]) if row else "?"

    conn.execute("BEGIN IMMEDIATE")
    conn.execute("SAVEPOINT job")
    assert conn.in_transaction and state() == "idle"  # nothing sent yet
    conn.execute("INSERT INTO runtime (name, value, updated_at) VALUES ('a', '1', 1)")
    assert state() == "idle in transaction"
    conn.execute("RELEASE job")
    conn.execute("SAVEPOINT job")
    with pytest.raises(sqlite3.IntegrityError):  # the savepoint went with it, and holds
        conn.execute("INSERT INTO runtime (name, value, updated_at) VALUES ('a', '2', 2)")
    conn.execute("ROLLBACK TO job")
    conn.execute("RELEASE job")
    conn.execute("COMMIT")
    assert not conn.in_transaction
    assert [tuple(r) for r in conn.execute("SELECT name, value FROM runtime")] == [("a", "1")]


def test_a_deferred_statement_that_fails_fails_the_commit_it_went_with(
    conn: pg.PgConnection,
) -> None:
    conn.execute("BEGIN")
    conn.execute("INSERT INTO runtime (name, value, updated_at) VALUES ('b', '1', 1)")
    conn.execute("RELEASE job")  # no such savepoint: the error comes with the COMMIT
    with pytest.raises(sqlite3.OperationalError):
        conn.execute("COMMIT")
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    assert conn.execute("SELECT count(*) FROM runtime WHERE name = 'b'").fetchone()[0] == 0


def test_a_record_finds_its_recipients_by_id_not_by_scanning_those_in_flight(
    conn: pg.PgConnection,
) -> None:
    """With 2,000 recipients in flight, the record statement's plan (the generic one
    psycopg's prepared statement ends up with) reaches the 20 it records by primary key;
    written plainly it scanned every recipient in flight through recipients_waiting."""
    conn.execute("BEGIN")
    ops.accept_many(
        conn, [(_msg(f"Q{i}", NOW, (f"r{i}@x.org", f"k{i}", None)), WINDOW) for i in range(2000)]
    )
    ids = [c.rcpt_id for c in ops.claim_due(conn, NOW, 2000, owner="n1", lease_until=NOW + 30)]
    conn.execute("COMMIT")
    assert len(ids) == 2000
    raw = conn._conn
    raw.execute("SET plan_cache_mode = force_generic_plan")
    held = " AND (r.lease_owner = ? OR r.lease_owner IS NULL) RETURNING r.id"
    numbers = iter(range(1, 100))
    sql = re.sub(r"%[sb]", lambda _m: f"${next(numbers)}", pg.translate(ops._RECORD_MANY + held))
    raw.execute(f"PREPARE rec AS {sql}")
    params = (
        "ARRAY[" + ",".join(map(str, ids[:20])) + "]::bigint[], '{}'::text[], '{}'::int[],"
        " '{}'::float8[], '{}'::text[], '{}'::text[], '{}'::float8[], '{}'::text[], 'n1'"
    )
    plan = "\n".join(r[0] for r in raw.execute(f"EXPLAIN EXECUTE rec({params})"))
    assert "recipients_pkey" in plan and "recipients_waiting" not in plan, plan


def _delivered(conn: pg.PgConnection, qid: str, node: str) -> list[tuple[list[Any], float, str]]:
    """One message accepted and claimed by `node`, and its delivered outcome (counted under
    `dest:smarthost`, no ceiling) as record_many takes it."""
    ops.accept(conn, _msg(qid, NOW, (f"{qid.lower()}@x.org", f"k-{qid}", None)), WINDOW)
    [cl] = [c for c in ops.claim_due(conn, NOW, 10, owner=node, lease_until=NOW + 30)]
    out = ops.RcptUpdate(
        cl.rcpt_id,
        cl.msg_id,
        ops.RcptState.DELIVERED,
        True,
        None,
        "250 ok",
        None,
        None,
        counters=("dest:smarthost",),
    )
    return [([out], NOW + 1, "day0")]


def _count(dsn: str, table: str, where: str) -> Any:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(f"SELECT * FROM {table} WHERE {where}").fetchone()
        return None if row is None else tuple(row)


def _two_nodes_recording(dsn: str) -> tuple[pg.PgConnection, pg.PgConnection]:
    """Nodes n-QA and n-QB, each in a batch that has recorded one delivery to the
    smarthost (not committed yet)."""
    a, b = pg.connect(dsn), pg.connect(dsn)
    for c, qid in ((a, "QA"), (b, "QB")):
        c.execute("BEGIN")
        calls = _delivered(c, qid, f"n-{qid}")
        c.execute("COMMIT")
        c.execute("BEGIN")
        ops.record_many(c, calls, owner=f"n-{qid}", ceilings=set())
    return a, b


def test_two_nodes_recording_into_one_counter_row_do_not_wait_for_each_other(
    pg_dsn: str,  # noqa: F811
) -> None:
    """The counters every node bumps (a destination's deliveries today, an identity's hour)
    are added in the COMMIT's round trip: a node whose batch is still open holds no lock on
    them. Before, the upsert in the middle of node A's batch locked the row until A's
    COMMIT, and node B's record waited for it (here: B's 1 s lock timeout fires)."""
    a, b = _two_nodes_recording(pg_dsn)
    try:
        a.execute("SELECT 1")  # A's batch goes on (other jobs, round trips), not committed
        b.execute("SET lock_timeout = '1s'")
        b.execute("COMMIT")  # B's counters and commit: not behind A's open transaction
        assert _count(pg_dsn, "daily_counts_node", "scope = 'dest:smarthost'") == (
            "dest:smarthost",
            "day0",
            "n-QB",
            1,
        )
        a.execute("COMMIT")
        assert ops.daily_counts(a, "day0") == {"dest:smarthost": 2}
        hour = int((NOW + 1) // 3600)
        assert _count(pg_dsn, "identity_hours_node", f"hour = {hour} AND node = 'n-QA'") == (
            "example.com",
            hour,
            "n-QA",
            1,
            0,
            0,
        )
    finally:
        a.close()
        b.close()


def test_two_nodes_committing_their_counters_at_once_share_no_row(
    pg_dsn: str,  # noqa: F811
) -> None:
    """Each node counts in its own rows (pg.COUNTER_TABLES, `_node` tables): while node A's
    counter upserts hold their row locks (sent, its COMMIT's WAL flush not done), node B
    commits the same destination's and identity's counts without waiting. Before, both
    bumped one row: B waited for A's commit (here: B's 1 s lock timeout fires)."""
    a, b = _two_nodes_recording(pg_dsn)
    try:
        a.flush_counts()  # A's upserts are in: it holds their rows until its COMMIT
        b.execute("SET lock_timeout = '1s'")
        b.execute("COMMIT")
        a.execute("COMMIT")
        assert ops.daily_counts(a, "day0") == {"dest:smarthost": 2}
        hour = int((NOW + 1) // 3600)
        rates = {r["identity"]: r["7d"] for r in apply.rates(a, (hour + 1) * 3600)}
        assert rates["example.com"]["delivered"] == 2
    finally:
        a.close()
        b.close()


def test_counters_at_commit_follow_the_savepoints_and_the_rollback(
    conn: pg.PgConnection,
) -> None:
    """A job rolled back to its savepoint takes its counts with it; a rolled-back batch
    counts nothing; a ceiling's scope is counted at once (a claim later in the same
    transaction reads it: ceiling_take)."""
    conn.execute("BEGIN")
    calls = _delivered(conn, "QS", "n1")
    conn.execute("COMMIT")
    conn.execute("BEGIN")
    conn.execute("SAVEPOINT job")
    conn.add_counts("daily_counts", ("dest:gone", "day0"), count=5)
    conn.execute("ROLLBACK TO job")
    conn.execute("RELEASE job")
    conn.execute("SAVEPOINT job")
    conn.add_counts("daily_counts", ("dest:kept", "day0"), count=2)
    conn.execute("RELEASE job")
    [([out], now, day)] = calls
    limited = dataclasses.replace(out, counters=("id:limited",))
    ops.record_many(conn, [([limited], now, day)], owner="n1", ceilings={"id:limited"})
    inside = dict(conn.execute("SELECT scope, count FROM daily_counts").fetchall())
    assert inside == {"id:limited": 1}  # the ceiling's row now; the others at COMMIT
    conn.execute("COMMIT")
    after = dict(conn.execute("SELECT scope, count FROM daily_counts").fetchall())
    assert after == {"id:limited": 1, "dest:kept": 2}
    conn.execute("BEGIN")
    conn.add_counts("daily_counts", ("dest:kept", "day0"), count=7)
    conn.execute("ROLLBACK")
    conn.execute("BEGIN")
    conn.execute("COMMIT")
    assert dict(conn.execute("SELECT scope, count FROM daily_counts").fetchall()) == after


def test_statements_of_batch_keys_are_planned_per_call_never_on_a_generic_plan(
    conn: pg.PgConnection,
) -> None:
    """db.CUSTOM_PLAN: a generic plan made while the spool was small scans the table whole
    for good (bench/README.md, Issue 31); such statements are sent unprepared, planned
    for their parameters each time, while the rest are prepared at their fifth use."""
    conn.execute("BEGIN")
    try:
        ops.accept_many(
            conn, [(_msg(f"Q{i}", NOW, (f"a{i}@x.org", f"k{i}", None)), WINDOW) for i in range(3)]
        )
        for _ in range(8):
            ops.load_envelopes(conn, ["Q0", "Q1"])
            gone = ops.RcptUpdate(10**9, "Q0", RcptState.DELIVERED, True, None, "250 ok")
            assert ops.record_many(conn, [([gone], NOW, None)]) == [0]
            conn.execute("SELECT count(*) FROM messages WHERE id = ?", ("Q0",))
        prepared = [r[0] for r in conn.execute("SELECT statement FROM pg_prepared_statements")]
    finally:
        conn.execute("ROLLBACK")
    assert any("count(*) FROM messages" in s for s in prepared)  # psycopg prepares
    assert not [s for s in prepared if "custom plan" in s or "FROM messages WHERE id = ANY" in s]


def test_array_parameters_with_their_cast_go_in_binary_the_rest_as_before() -> None:
    # psycopg dumps a list in text one element at a time with a regular expression over
    # each (a 100 KiB body: 1.5 ms); the cast names the array's type, so binary is exact
    sql = (
        "SELECT * FROM unnest(?::text[], ?::double precision[], ?::bytea[])"
        " WHERE x = ? AND y = ANY(?) AND z = '?::text[]' AND w LIKE 'a%'"
    )
    assert pg.translate(sql) == (
        "SELECT * FROM unnest(%b::text[], %b::double precision[], %b::bytea[])"
        " WHERE x = %s AND y = ANY(%s) AND z = '?::text[]' AND w LIKE 'a%%'"
    )


def test_a_batch_in_binary_stores_every_value_exactly(conn: pg.PgConnection) -> None:
    """Bodies of every octet (100 KiB), text with quotes, backslashes, braces, commas and
    non-ASCII, a NULL among the values: what accept_many stores is what it was given."""
    body = bytes(range(256)) * 400
    odd = 'ü "q" \\ {a,b} NULL ,'
    msgs = [
        dataclasses.replace(
            _msg("Q1", NOW, (f"{odd}@x.org", "k1", None)), body=body, sender=odd, size=len(body)
        ),
        dataclasses.replace(_msg("Q2", NOW, ("b@x.org", "k2", None)), body=b"", message_id=odd),
        dataclasses.replace(_msg("Q3", NOW, ("c@x.org", "k3", None)), size=2**31 - 1),
    ]
    conn.execute("BEGIN")
    try:
        res = ops.accept_many(conn, [(m, WINDOW) for m in msgs])
        messages, recipients, _keys = _dump(conn)
    finally:
        conn.execute("ROLLBACK")
    assert [r.queue_id for r in res] == ["Q1", "Q2", "Q3"]
    by_id = {m[0]: m for m in messages}
    assert bytes(by_id["Q1"][9]) == body and by_id["Q1"][2] == odd
    assert bytes(by_id["Q2"][9]) == b"" and by_id["Q2"][1] == odd
    assert by_id["Q3"][3] == 2**31 - 1 and by_id["Q3"][11] == "smtp" and by_id["Q3"][10] is None
    assert recipients[0][1] == f"{odd}@x.org"
