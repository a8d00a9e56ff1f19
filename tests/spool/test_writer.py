"""The group-commit writer (relay/spool/writer.py), in-process: what each caller gets back,
which jobs share a batch, the counters and the commit hook, lazy batches, cancelled callers,
the cross-process lock, and shutdown. Every wait is on a condition with a bound (a mutated
writer that never answers fails its test in seconds, not at pytest-timeout's limit)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.config.tree import PgSpool
from relay.spool import db, pg
from relay.spool import writer as writer_mod
from relay.spool.writer import JOB_TRIES, RETRY_PAUSE, Grouped, SpoolError, SpoolWriter

WAIT = 10.0


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[SpoolWriter]:
    w = SpoolWriter(tmp_path)
    w.start()
    w.run_sync(lambda c: c.execute("CREATE TABLE t (v TEXT)"))
    yield w
    w.close()


def insert(v: str) -> Callable[[sqlite3.Connection], str]:
    def job(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES (?)", (v,))
        return v

    return job


def rows(path: Path) -> list[str]:
    c = db.connect(path, create=False)
    try:
        return [r[0] for r in c.execute("SELECT v FROM t ORDER BY v")]
    finally:
        c.close()


class Gate:
    """A job that holds the writer thread until opened: what is queued meanwhile is the
    next batch."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, _c: sqlite3.Connection) -> str:
        self.started.set()
        assert self.release.wait(WAIT)
        return "gate"


def hold(w: SpoolWriter) -> tuple[Gate, Future[str]]:
    gate = Gate()
    fut: Future[str] = Future()

    def submit() -> None:
        try:
            fut.set_result(w.run_sync(gate))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=submit, daemon=True).start()
    assert gate.started.wait(WAIT)
    return gate, fut


async def queued(w: SpoolWriter, n: int) -> None:
    """Until n items wait in the writer's queue."""
    for _ in range(int(WAIT * 200)):
        if w._q.qsize() >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{w._q.qsize()} queued, not {n}")


def test_run_sync_returns_the_result_and_raises_the_jobs_error(
    writer: SpoolWriter, tmp_path: Path
) -> None:
    assert writer.run_sync(insert("a")) == "a"
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        writer.run_sync(lambda c: c.execute("INSERT INTO nope VALUES (1)"))
    with pytest.raises(KeyError):
        writer.run_sync(lambda c: dict[str, int]()["x"])
    assert rows(tmp_path) == ["a"]
    assert writer.healthy and writer.failures == 0


async def test_run_wraps_database_errors_only(writer: SpoolWriter, tmp_path: Path) -> None:
    assert await writer.run(insert("b")) == "b"
    with pytest.raises(SpoolError, match="no such table: nope") as info:
        await writer.run(lambda c: c.execute("INSERT INTO nope VALUES (1)"))
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    with pytest.raises(ZeroDivisionError):  # a bug is not a spool failure
        await writer.run(lambda c: 1 // 0)
    assert rows(tmp_path) == ["b"]


async def test_counters_and_the_commit_hook(writer: SpoolWriter) -> None:
    seen: list[tuple[float, int]] = []
    writer.on_commit = lambda elapsed, n: seen.append((elapsed, n))
    base_batches, base_jobs = writer.batches, writer.jobs
    gate, held = hold(writer)
    futs = [asyncio.ensure_future(writer.run(insert(str(i)))) for i in range(3)]
    await queued(writer, 3)
    gate.release.set()
    assert await asyncio.gather(*futs) == ["0", "1", "2"]
    assert held.result(WAIT) == "gate"
    assert writer.batches == base_batches + 2 and writer.jobs == base_jobs + 4
    assert [n for _e, n in seen] == [1, 3]
    assert all(0 < e < 60 for e, _n in seen)  # seconds the batch took, not a clock reading
    assert writer.last_commit_seconds == seen[-1][0]
    assert writer.commit_seconds_total >= seen[0][0] + seen[1][0] > 0

    # a failing hook never fails the spool
    def broken(_elapsed: float, _n: int) -> None:
        raise RuntimeError("metrics bug")

    writer.on_commit = broken
    assert await writer.run(insert("x")) == "x"
    assert writer.healthy and writer.batches == base_batches + 3


async def test_a_batch_is_at_most_max_batch_jobs(
    writer: SpoolWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_mod, "MAX_BATCH", 4)
    seen: list[int] = []
    writer.on_commit = lambda _e, n: seen.append(n)
    gate, held = hold(writer)
    futs = [asyncio.ensure_future(writer.run(insert(str(i)))) for i in range(10)]
    await queued(writer, 10)
    gate.release.set()
    assert len(await asyncio.gather(*futs)) == 10
    held.result(WAIT)
    assert seen == [1, 4, 4, 2]


async def test_lazy_batches_commit_without_fsync_and_restore_it(writer: SpoolWriter) -> None:
    def sync(c: sqlite3.Connection) -> int:
        return int(c.execute("PRAGMA synchronous").fetchone()[0])

    assert await writer.run(sync) == 2  # FULL
    assert await writer.run(sync, lazy=True) == 1  # NORMAL: a batch of lazy jobs only
    assert await writer.run(sync) == 2
    gate, held = hold(writer)
    mixed = [
        asyncio.ensure_future(writer.run(sync, lazy=True)),
        asyncio.ensure_future(writer.run(sync)),
    ]
    await queued(writer, 2)
    gate.release.set()
    assert await asyncio.gather(*mixed) == [2, 2]  # one durable job: the batch is durable
    held.result(WAIT)
    # a lazy batch that fails to begin leaves the connection durable too
    from relay.ops import faults

    faults.arm("spool.begin", "locked", times=1)
    try:
        with pytest.raises(SpoolError, match="locked"):
            await writer.run(sync, lazy=True)
    finally:
        faults.disarm_all()
    assert await writer.run(sync) == 2


def gathering(path: Path, seconds: float) -> SpoolWriter:
    w = SpoolWriter(path, gather=lambda: seconds)
    w.start()
    w.run_sync(lambda c: c.execute("CREATE TABLE t (v TEXT)"))  # a batch of one job
    return w


def _insert_many(c: sqlite3.Connection, values: list[str]) -> list[str]:
    c.executemany("INSERT INTO t VALUES (?)", [(v,) for v in values])
    return values


def accept(v: str) -> Grouped[str]:
    """A job like the inbound's accepts: grouped, and gathered for (spool.gather)."""
    return Grouped(_insert_many, v, sqlite=True, gather=True)


async def shared_batch(w: SpoolWriter, *values: str) -> None:
    """A batch of accepts of `values` (queued behind a gate, so they share it)."""
    gate, held = hold(w)
    futs = [asyncio.ensure_future(w.run(accept(v))) for v in values]
    await queued(w, len(values))
    gate.release.set()
    held.result(WAIT)
    assert await asyncio.gather(*futs) == list(values)


async def test_after_a_shared_batch_the_writer_gathers_for_spool_gather(tmp_path: Path) -> None:
    """After a batch of several jobs, a batch that an accept opens waits `gather` for more:
    an accept that comes 0.1 s after the first one still joins its batch."""
    w = gathering(tmp_path, 0.5)
    try:
        await shared_batch(w, "a", "b")
        batches = w.batches
        t0 = time.monotonic()
        c = asyncio.ensure_future(w.run(accept("c")))
        await asyncio.sleep(0.1)
        d = asyncio.ensure_future(w.run(accept("d")))
        assert await asyncio.wait_for(asyncio.gather(c, d), WAIT) == ["c", "d"]
        assert w.batches == batches + 1  # one batch: the writer waited for "d"
        assert time.monotonic() - t0 >= 0.45
    finally:
        w.close()
    assert rows(tmp_path) == ["a", "b", "c", "d"]


async def test_a_lone_client_and_the_engines_jobs_never_wait_for_the_gathering(
    tmp_path: Path,
) -> None:
    """A batch after a batch of one job (a lone client: the serial case) does not wait, nor
    does a batch opened by a job that is not an accept (the engine's records and claims: a
    delivery waits for its record), nor any batch with `gather` 0."""
    w = gathering(tmp_path, 30.0)  # a wait would show: each step below is bounded by WAIT
    try:
        for v in ("x1", "x2", "x3"):  # one job a batch: no gathering
            assert await asyncio.wait_for(w.run(accept(v)), WAIT) == v
        await shared_batch(w, "a", "b")
        assert await asyncio.wait_for(w.run(insert("record")), WAIT) == "record"
        await shared_batch(w, "c", "d")
        assert await asyncio.wait_for(w.run(insert("claim"), lazy=True), WAIT) == "claim"
        await shared_batch(w, "e", "f")
        w.gather = lambda: 0.0  # spool.gather: 0 (a reload takes effect at the next batch)
        assert await asyncio.wait_for(w.run(accept("g")), WAIT) == "g"
    finally:
        w.close()


async def test_a_caller_that_gave_up_is_not_run_and_does_not_stop_the_others(
    writer: SpoolWriter, tmp_path: Path
) -> None:
    gate, held = hold(writer)
    gone = asyncio.ensure_future(writer.run(insert("gone")))
    kept = asyncio.ensure_future(writer.run(insert("kept")))
    await queued(writer, 2)
    gone.cancel()
    gate.release.set()
    assert await kept == "kept"
    held.result(WAIT)
    assert rows(tmp_path) == ["kept"]


async def test_a_caller_cancelled_while_its_job_runs_does_not_lose_the_others_results(
    writer: SpoolWriter, tmp_path: Path
) -> None:
    running, release = threading.Event(), threading.Event()

    def slow(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES ('slow')")
        running.set()
        assert release.wait(WAIT)
        return "slow"

    gate, held = hold(writer)
    first = asyncio.ensure_future(writer.run(slow))
    second = asyncio.ensure_future(writer.run(insert("second")))
    await queued(writer, 2)
    gate.release.set()
    assert await asyncio.to_thread(running.wait, WAIT)
    first.cancel()  # taken already: it commits, its caller just does not wait
    release.set()
    assert await asyncio.wait_for(second, WAIT) == "second"
    held.result(WAIT)
    assert rows(tmp_path) == ["second", "slow"]


async def test_a_job_whose_caller_gave_up_while_it_ran_gives_its_result_to_its_orphan_hook(
    writer: SpoolWriter, tmp_path: Path
) -> None:
    """The inbound's accept whose client hung up during the commit: the writer had taken the
    job up, so it ran and committed, and its result goes to the job's `orphan` hook, on the
    caller's loop (the message gets its line); a job cancelled before the writer took it is
    not run and not orphaned; a job whose caller waits gets its result, not the hook."""
    running, release = threading.Event(), threading.Event()
    orphaned: list[tuple[str, bool]] = []
    loop_thread = threading.get_ident()

    def many(c: sqlite3.Connection, args: list[str]) -> list[str]:
        if args == ["taken"]:
            running.set()
            assert release.wait(WAIT)
        for a in args:
            c.execute("INSERT INTO t VALUES (?)", (a,))
        return args

    def hook(res: str) -> None:
        orphaned.append((res, threading.get_ident() == loop_thread))

    def job(arg: str) -> Grouped[str]:
        return Grouped(many, arg, orphan=hook)

    gate, held = hold(writer)
    taken = asyncio.ensure_future(writer.run(job("taken")))
    skipped = asyncio.ensure_future(writer.run(job("skipped")))
    answered = asyncio.ensure_future(writer.run(job("answered")))
    await queued(writer, 3)
    skipped.cancel()  # before the writer takes it up: not run
    gate.release.set()
    assert await asyncio.to_thread(running.wait, WAIT)
    taken.cancel()  # taken up already: it commits, and its result goes to the hook
    release.set()
    assert await asyncio.wait_for(answered, WAIT) == "answered"
    held.result(WAIT)
    for _ in range(200):
        if orphaned:
            break
        await asyncio.sleep(0.005)
    assert orphaned == [("taken", True)]
    assert taken.cancelled() and skipped.cancelled()
    assert rows(tmp_path) == ["answered", "taken"]


async def test_an_orphan_hook_that_raises_is_logged_and_costs_no_other_waiter(
    writer: SpoolWriter, caplog: pytest.LogCaptureFixture
) -> None:
    running, release = threading.Event(), threading.Event()

    def many(c: sqlite3.Connection, args: list[str]) -> list[str]:
        if args == ["taken"]:
            running.set()
            assert release.wait(WAIT)
        return args

    def hook(_res: str) -> None:
        raise RuntimeError("hook bug")

    gate, held = hold(writer)
    taken = asyncio.ensure_future(writer.run(Grouped(many, "taken", orphan=hook)))
    other = asyncio.ensure_future(writer.run(Grouped(many, "other", orphan=hook)))
    await queued(writer, 2)
    gate.release.set()
    assert await asyncio.to_thread(running.wait, WAIT)
    taken.cancel()
    with caplog.at_level(logging.ERROR, logger="relay.spool.writer"):
        release.set()
        assert await asyncio.wait_for(other, WAIT) == "other"
        held.result(WAIT)
        for _ in range(200):
            if caplog.records:
                break
            await asyncio.sleep(0.005)
    [rec] = caplog.records
    assert rec.getMessage() == "orphan hook failed" and str(rec.exc_info[1]) == "hook bug"  # type: ignore[index]


def test_callers_on_several_event_loops_share_a_batch(writer: SpoolWriter) -> None:
    gate, held = hold(writer)
    results: dict[int, Any] = {}

    def caller(i: int) -> None:
        async def main() -> str:
            return await writer.run(insert(f"loop{i}"))

        results[i] = asyncio.run(main())

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in range(int(WAIT * 200)):
        if writer._q.qsize() >= 3:
            break
        threading.Event().wait(0.005)
    batches = writer.batches
    gate.release.set()
    for t in threads:
        t.join(WAIT)
    assert results == {0: "loop0", 1: "loop1", 2: "loop2"}
    assert held.result(WAIT) == "gate"
    assert writer.batches == batches + 2  # the gate's batch; the three shared one


def test_close_runs_what_was_queued_then_stops(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path)
    w.start()
    w.run_sync(lambda c: c.execute("CREATE TABLE t (v TEXT)"))
    gate, held = hold(w)
    futs: list[Future[str]] = []
    for v in ("p", "q"):
        f: Future[str] = Future()
        w._q.put((insert(v), f, None, False))
        futs.append(f)
    closer = threading.Thread(target=w.close)
    closer.start()
    gate.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert [f.result(WAIT) for f in futs] == ["p", "q"]
    assert held.result(WAIT) == "gate"
    assert rows(tmp_path) == ["p", "q"]
    assert w._thread is None and w._conn is None and w._lock_fd is None
    w.close()  # twice: nothing left to close


def test_the_lock_file_serialises_writers_of_several_processes(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path)
    w.start()
    try:
        lock = tmp_path / writer_mod.LOCK_NAME
        assert stat.S_IMODE(lock.stat().st_mode) == 0o640 & ~_umask()
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another process's writer is in a batch
            done: Future[int] = Future()
            threading.Thread(
                target=lambda: done.set_result(w.run_sync(lambda c: 7)), daemon=True
            ).start()
            with pytest.raises(TimeoutError):
                done.result(0.3)
            fcntl.flock(fd, fcntl.LOCK_UN)
            assert done.result(WAIT) == 7
            # and the writer lets go of it after each batch (before it answers: below)
            for _ in range(int(WAIT * 100)):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    threading.Event().wait(0.01)
            else:
                raise AssertionError("the writer kept the lock")
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        w.close()


def test_a_writer_made_to_checkpoint_later_leaves_the_checkpoints_to_the_others(
    tmp_path: Path,
) -> None:
    """`checkpoint_pages` (an inbound process's writer, relay/inbound/processes.py): its
    commits copy no WAL page into the database until the WAL holds that many; a writer with
    SQLite's default checkpoints at 1,000 pages, after which the WAL is written from its
    start again. So after ~3,000 pages of commits the late writer's WAL holds them all and
    the other's stays near 1,000 pages."""
    late = SpoolWriter(tmp_path / "late", checkpoint_pages=10_000)
    usual = SpoolWriter(tmp_path / "usual")
    frame = 4096 + 24  # a WAL frame: its header and a page of the default size
    rows = [(b"x" * 3500,)] * 60  # about a page each
    sizes = {}
    for w in (late, usual):
        w.start()
        try:
            setting = w.run_sync(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
            assert setting == (10_000 if w is late else 1_000)
            w.run_sync(lambda c: c.execute("CREATE TABLE b (v BLOB)"))
            for _ in range(50):  # 50 commits
                w.run_sync(lambda c: c.executemany("INSERT INTO b VALUES (?)", rows))
            sizes[w is late] = (w.spool_dir / "relay.sqlite-wal").stat().st_size
        finally:
            w.close()
    assert sizes[True] > 2_500 * frame, sizes
    assert sizes[False] < 1_500 * frame, sizes


async def test_the_lock_is_let_go_before_the_results_are_handed_over(
    writer: SpoolWriter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-over wakes the caller's event loop, whose thread may run in the writer's
    place: the other processes' writers must not wait for that (see the rules)."""
    fd = os.open(tmp_path / writer_mod.LOCK_NAME, os.O_RDWR)
    free: list[bool] = []
    real = writer_mod._resolve_all

    def resolve(results: Any) -> None:
        try:  # another open file description: as another process's writer sees the lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            free.append(True)
        except BlockingIOError:
            free.append(False)
        real(results)

    monkeypatch.setattr(writer_mod, "_resolve_all", resolve)
    try:
        assert await writer.run(insert("a")) == "a"
        assert await writer.run(insert("b"), lazy=True) == "b"
    finally:
        os.close(fd)
    assert free == [True, True]
    assert rows(tmp_path) == ["a", "b"]


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_a_closed_loop_is_not_an_error_for_the_writer(writer: SpoolWriter) -> None:
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    loop.close()
    writer_mod._resolve_all([((insert("z"), fut, loop, False), "z", None)])
    assert writer.run_sync(lambda c: 1) == 1


def test_a_new_writer_reports_nothing_yet_and_closes_without_starting(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path)
    assert (w.batches, w.jobs, w.failures) == (0, 0, 0)
    assert w.last_commit_seconds == 0.0 and w.commit_seconds_total == 0.0
    assert w.healthy is True and w.on_commit is None
    w.close()  # never started: nothing to stop, close or unlock
    assert not (tmp_path / writer_mod.LOCK_NAME).exists()


def test_the_writer_thread_and_its_connection(writer: SpoolWriter) -> None:
    t = writer._thread
    assert t is not None and t.name == "spool-writer" and t.daemon  # never blocks exit
    # the daemon's one writer gets the large page cache; CLI connections keep SQLite's
    cache = writer.run_sync(lambda c: c.execute("PRAGMA cache_size").fetchone()[0])
    assert cache == -db.WRITER_CACHE_KIB
    # its statement journals in memory (no temp file per batch); a CLI connection's in files
    assert writer.run_sync(lambda c: c.execute("PRAGMA temp_store").fetchone()[0]) == 2
    cli = db.connect(writer.spool_dir, create=False)
    try:
        assert cli.execute("PRAGMA temp_store").fetchone()[0] == 0
    finally:
        cli.close()
    # run_sync's jobs are durable (never lazy)
    assert writer.run_sync(lambda c: c.execute("PRAGMA synchronous").fetchone()[0]) == 2


async def test_failures_are_counted_logged_and_cleared_by_the_next_commit(
    writer: SpoolWriter, caplog: pytest.LogCaptureFixture
) -> None:
    from relay.ops import faults

    caplog.set_level(logging.ERROR, logger="relay.spool.writer")
    try:
        faults.arm("spool.begin", "locked", times=2)
        for _ in range(2):
            with pytest.raises(SpoolError, match="database is locked"):
                await writer.run(insert("b"))
        assert writer.failures == 2 and writer.healthy is False
        assert [r.getMessage() for r in caplog.records] == [
            "spool transaction could not start: database is locked"
        ] * 2
        assert await writer.run(insert("ok")) == "ok"
        assert writer.healthy is True and writer.failures == 2
        caplog.clear()
        faults.arm("spool.commit", "eio", times=1)
        with pytest.raises(SpoolError, match="disk I/O error"):
            await writer.run(insert("c"))
        assert writer.failures == 3 and writer.healthy is False
        assert [r.getMessage() for r in caplog.records] == ["spool commit failed: disk I/O error"]
    finally:
        faults.disarm_all()
    caplog.clear()

    def broken(_elapsed: float, _n: int) -> None:
        raise RuntimeError("metrics bug")

    writer.on_commit = broken
    assert await writer.run(insert("d")) == "d"
    assert writer.healthy is True
    [rec] = caplog.records
    assert rec.getMessage() == "on_commit hook failed" and rec.exc_info is not None
    assert str(rec.exc_info[1]) == "metrics bug"


# Where the writer's mutation survivors pointed (tests/MUTANTS.md; until issue 28 in
# tests/test_spool_mutants_writer.py): a job that loses a lock race on PostgreSQL (a real
# lock_timeout, SQLSTATE 55P03, against a second connection holding the row) runs again in the
# same batch, up to JOB_TRIES times: losing JOB_TRIES - 1 times still commits, losing JOB_TRIES
# times fails with the lock error, and its caller is answered either way (never left waiting);
# a writer given a PostgreSQL spool writes to PostgreSQL, and its `start()` still makes the
# local spool directory (parents included, mode 0o750 under umask 022) but no SQLite file and
# no flock file there; a thread caller's job is marked running once the writer takes it
# (concurrent.futures), so the caller can no longer cancel it under the writer's feet. Every
# wait has a bound (a mutant that never answers fails in seconds).
# --- PostgreSQL: a job that lost a lock race runs again, JOB_TRIES times at most ------------


@pytest.fixture
def pg_writer(pg_dsn: str, tmp_path: Path) -> Iterator[tuple[SpoolWriter, psycopg.Connection[Any]]]:
    """A started writer on PostgreSQL with a row `x` in `runtime`, and a second connection
    (another node) holding that row's lock for the whole test."""
    setup = pg.connect(pg_dsn)
    setup.execute("INSERT INTO runtime (name, value, updated_at) VALUES ('x', '0', 0)")
    setup.close()
    w = SpoolWriter(tmp_path / "spool", PgSpool(pg_dsn))
    w.start()
    other = psycopg.connect(pg_dsn, autocommit=False)
    other.execute("SELECT name FROM runtime WHERE name = 'x' FOR UPDATE")  # holds x
    try:
        yield w, other
    finally:
        other.rollback()
        other.close()
        w.close()


def losing(times: int, tries: list[int]) -> Callable[[sqlite3.Connection], int]:
    """A job that waits for the held row (and gives up after 50 ms: PostgreSQL's
    lock_timeout, SQLSTATE 55P03) on its first `times` runs, and then writes elsewhere."""

    def job(c: sqlite3.Connection) -> int:
        tries.append(1)
        if len(tries) <= times:
            c.execute("SET LOCAL lock_timeout = '50ms'")
            c.execute("UPDATE runtime SET value = 'lost' WHERE name = 'x'")
            raise AssertionError("the row was not locked")  # pragma: no cover
        c.execute(
            "INSERT INTO runtime (name, value, updated_at) VALUES (?, ?, 1)",
            (f"won-{len(tries)}", str(len(tries))),
        )
        return len(tries)

    return job


def runtime_rows(pg_dsn: str) -> dict[str, str]:
    check = pg.connect(pg_dsn)
    try:
        return {r[0]: r[1] for r in check.execute("SELECT name, value FROM runtime")}
    finally:
        check.close()


async def test_a_job_that_loses_the_lock_race_one_try_short_of_the_limit_commits(
    pg_writer: tuple[SpoolWriter, psycopg.Connection[Any]], pg_dsn: str
) -> None:
    w, _other = pg_writer
    assert JOB_TRIES == 3
    tries: list[int] = []
    assert await asyncio.wait_for(w.run(losing(JOB_TRIES - 1, tries)), WAIT) == JOB_TRIES
    assert len(tries) == JOB_TRIES
    assert w.healthy is True and w.failures == 0
    assert runtime_rows(pg_dsn) == {"x": "0", "won-3": "3"}
    # once is the common case: the second run commits
    once: list[int] = []
    assert await asyncio.wait_for(w.run(losing(1, once)), WAIT) == 2
    assert len(once) == 2
    assert runtime_rows(pg_dsn) == {"x": "0", "won-3": "3", "won-2": "2"}


@pytest.mark.parametrize("jitter", [0.0, 1.0])
async def test_a_job_that_lost_the_lock_race_waits_before_it_runs_again(
    pg_writer: tuple[SpoolWriter, psycopg.Connection[Any]],
    pg_dsn: str,
    jitter: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer that won a lock race is woken when the job's savepoint rolls back, but must
    still be scheduled to take the row: run again at once, the job can take it first and
    deadlock with the same peer again (a CI run saw a third try). So each run again comes
    RETRY_PAUSE times its try number after the failure, and up to half as much again at
    random (here the random draw at its least and at its most)."""
    monkeypatch.setattr(writer_mod.random, "random", lambda: jitter)
    w, _other = pg_writer
    lost: list[float] = []
    started: list[float] = []
    inner = losing(JOB_TRIES - 1, [])

    def job(c: sqlite3.Connection) -> int:
        started.append(time.monotonic())
        try:
            return inner(c)
        except Exception:
            lost.append(time.monotonic())
            raise

    assert await asyncio.wait_for(w.run(job), WAIT) == JOB_TRIES
    assert len(started) == JOB_TRIES and len(lost) == JOB_TRIES - 1
    for n, failed in enumerate(lost, 1):
        assert started[n] - failed >= RETRY_PAUSE * n * (1 + jitter / 2)


async def test_a_job_that_loses_the_lock_race_every_time_fails_after_the_limit(
    pg_writer: tuple[SpoolWriter, psycopg.Connection[Any]], pg_dsn: str
) -> None:
    w, _other = pg_writer
    tries: list[int] = []
    with pytest.raises(SpoolError, match="lock") as info:
        await asyncio.wait_for(w.run(losing(JOB_TRIES, tries)), WAIT)
    assert len(tries) == JOB_TRIES
    assert getattr(info.value.__cause__, "sqlstate", None) == "55P03"
    # the job failed alone: the batch committed, the writer is healthy and keeps working
    assert w.healthy is True and w.failures == 0
    assert await asyncio.wait_for(w.run(lambda c: 7), WAIT) == 7
    assert runtime_rows(pg_dsn) == {"x": "0"}


async def test_an_error_that_is_not_a_lost_lock_race_runs_once(
    pg_writer: tuple[SpoolWriter, psycopg.Connection[Any]], pg_dsn: str
) -> None:
    w, _other = pg_writer
    tries: list[int] = []

    def dup(c: sqlite3.Connection) -> None:
        tries.append(1)
        c.execute("INSERT INTO runtime (name, value, updated_at) VALUES ('x', 'dup', 1)")

    with pytest.raises(SpoolError, match="duplicate key") as info:
        await asyncio.wait_for(w.run(dup), WAIT)
    assert getattr(info.value.__cause__, "sqlstate", None) == "23505"
    assert len(tries) == 1
    assert runtime_rows(pg_dsn) == {"x": "0"}


# --- PostgreSQL: the writer's backend and its local spool directory ------------------------


def test_a_postgresql_writer_writes_to_postgresql_and_leaves_no_sqlite_behind(
    pg_dsn: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    w = SpoolWriter(spool, PgSpool(pg_dsn))
    assert w.pg == PgSpool(pg_dsn)
    w.start()
    try:
        assert w.run_sync(db.dialect) == "postgresql"
        w.run_sync(
            lambda c: c.execute(
                "INSERT INTO runtime (name, value, updated_at) VALUES ('via', 'writer', 1)"
            )
        )
    finally:
        w.close()
    assert runtime_rows(pg_dsn) == {"via": "writer"}
    assert sorted(p.name for p in spool.iterdir()) == []  # no relay.sqlite, no write.lock


def test_a_postgresql_writer_makes_its_local_spool_dir_with_parents_and_mode_0750(
    pg_dsn: str, tmp_path: Path
) -> None:
    spool = tmp_path / "missing" / "parents" / "spool"
    old = os.umask(0o022)
    try:
        w = SpoolWriter(spool, PgSpool(pg_dsn))
        w.start()
    finally:
        os.umask(old)
    try:
        assert spool.is_dir()
        assert stat.S_IMODE(spool.stat().st_mode) == 0o750
        assert list(spool.iterdir()) == []
        assert not (spool / writer_mod.LOCK_NAME).exists() and w._lock_fd is None
        assert w.run_sync(db.dialect) == "postgresql"
    finally:
        w.close()


# --- a thread caller's future: taken means running ------------------------------------------


def test_a_thread_callers_job_is_running_once_taken_and_cannot_be_cancelled(
    tmp_path: Path,
) -> None:
    w = SpoolWriter(tmp_path)
    w.start()
    started, release = threading.Event(), threading.Event()

    def job(_c: sqlite3.Connection) -> str:
        started.set()
        assert release.wait(WAIT)
        return "ran"

    try:
        fut: Future[str] = Future()
        w._q.put((job, fut, None, False))  # what run_sync queues
        assert started.wait(WAIT)
        assert fut.running() is True
        assert fut.cancel() is False  # too late: the writer has it
        release.set()
        assert fut.result(WAIT) == "ran"
        assert w.run_sync(lambda c: 5) == 5  # and the writer still answers
    finally:
        release.set()
        w.close()
