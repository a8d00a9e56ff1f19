"""The group-commit writer (relay/spool/writer.py), in-process: what each caller gets back,
which jobs share a batch, the counters and the commit hook, lazy batches, cancelled callers,
the cross-process lock, and shutdown. Every wait is on a condition with a bound (a mutated
writer that never answers fails its test in seconds, not at pytest-timeout's limit)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from relay.spool import db
from relay.spool import writer as writer_mod
from relay.spool.writer import SpoolError, SpoolWriter

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
    assert all(e > 0 for e, _n in seen)
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
    from relay import faults

    faults.arm("spool.begin", "locked", times=1)
    try:
        with pytest.raises(SpoolError, match="locked"):
            await writer.run(sync, lazy=True)
    finally:
        faults.disarm_all()
    assert await writer.run(sync) == 2


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
            # and the writer lets go of it after each batch (just after it answers)
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
