"""The group-commit writer (relay/spool/writer.py) where its mutation survivors pointed:

- a job that loses a lock race on PostgreSQL (a real lock_timeout, SQLSTATE 55P03, against a
  second connection holding the row) runs again in the same batch, up to JOB_TRIES times:
  losing JOB_TRIES - 1 times still commits, losing JOB_TRIES times fails with the lock error,
  and its caller is answered either way (never left waiting);
- a writer given a PostgreSQL spool writes to PostgreSQL, and its `start()` still makes the
  local spool directory (parents included, mode 0o750 under umask 022) but no SQLite file and
  no flock file there;
- a thread caller's job is marked running once the writer takes it (concurrent.futures), so
  the caller can no longer cancel it under the writer's feet.

Every wait has a bound (a mutant that never answers fails in seconds)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.config.tree import PgSpool
from relay.spool import db, pg
from relay.spool import writer as writer_mod
from relay.spool.writer import JOB_TRIES, SpoolError, SpoolWriter

WAIT = 10.0


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
