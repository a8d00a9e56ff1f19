"""The daemon's one writer: a thread that owns the spool connection and commits in groups.

Rules:
- Every daemon read and write of the spool is a job: a plain function `(conn) -> result`
  from `relay.spool.ops`. Jobs queue up; the thread takes everything queued, runs it under
  one `BEGIN IMMEDIATE ... COMMIT` (one WAL fsync for the whole batch), then resolves each
  job's future. Concurrent SMTP sessions therefore share fsyncs instead of queueing behind
  one fsync each: durability does not cap throughput.
- Each job runs inside its own SAVEPOINT, so one failing job (a constraint, a bug) rolls
  back alone and fails only its own caller; the rest of the batch commits.
- A failed COMMIT (disk full, I/O error) fails every job of the batch: their callers answer
  4xx (the client keeps the message and retries), never 250.
- A job that fails because the database takes no writes (PostgreSQL: disk full, read-only,
  I/O; `db.refuses_writes`) fails alone as any job, but the batch's COMMIT still works (the
  job's savepoint was rolled back), so it is remembered: `refused_at` and `refused` (the
  error), which the daemon's health reads (a spool that commits reads but refuses every
  write is critical, not ok).
- Why not aiosqlite: it runs one statement per round trip to its thread, which would defeat
  the batching; this thread runs the whole batch in one hop.
- Several processes may write one spool (`inbound.processes`): each batch holds an flock
  on `<spool>/write.lock` from BEGIN to COMMIT, so writers queue in the kernel and wake the
  moment the lock is free, instead of SQLite's busy handler sleeping and polling. From
  BEGIN to COMMIT and no longer: a lazy batch's pragmas (two statements, each of which may
  wait for this process's event loop to let go of the GIL) and the hand-over of the
  results are outside it. The hand-over wakes the event loop's thread, which on a busy
  machine may run in the place of the writer that woke it while that still holds the
  lock, and whatever the holder waits for, the other processes' writers wait out too. The
  main process's claims held the lock 2.3 ms at p90 where BEGIN to COMMIT took 0.7 ms;
  with the hand-over after the lock a lone client's p99 was 7-10% lower, its p50 3-5%
  higher (bench/README.md, "A twelfth machine").
- Reads that may take long and need no write (`read()`: the /metrics gauges over a deep
  queue) run beside the writer on a read-only connection of their own, so they never hold
  up a commit (SQLite's WAL lets readers and the writer run at once). PostgreSQL: through
  the writer as any job.
- Grouped jobs (PostgreSQL): a job made as `Grouped(many, arg)` may run together with the
  other jobs of the batch built on the same `many`, in one call `many(conn, [args...])`
  under one SAVEPOINT, at the place of the first of them: a batch of accepted messages is
  a few statements, not a few per message (each statement is a round trip to the server).
  `many` must give each job the result it would have had run alone, in order. If the
  group fails, it is rolled back and its jobs run one by one as any job (so one bad job
  still fails alone). On SQLite only jobs made with `sqlite=True` are grouped (the
  inbound's accepts and the engine's records: one SAVEPOINT and a few prepared statements
  for the batch instead of a few statements per message and a SAVEPOINT/RELEASE per job);
  the others run alone (their statements are calls in this thread, there is no round trip
  to save).
- A job that writes all or nothing by itself (`Grouped(atomic=True)`: the inbound's accepts,
  one INSERT of SQLite for the batch, relay/spool/ops.py `_accept_many_sqlite`) runs without
  a SAVEPOINT of its own on SQLite, alone or in its group: a batch of accepts is BEGIN, one
  INSERT, COMMIT. Each statement is a few releases of the GIL by Python's sqlite3 module
  (five around each `execute`: its reset, step and change counts), and each release while
  the event loop runs is a hand-over of the GIL and back (two wake-ups of a thread): the
  inbound writer's releases per message went from 4.3 to 1.8, its process's CPU per
  message -5 to -10% (bench/README.md, "A ninth machine").
- Gathering (`spool.gather`, 3 ms): when the job that opens a batch is an accept
  (`Grouped(..., gather=True)`) and the batch before held more than one job, the thread
  waits that long for more before it starts the batch. Under concurrent SMTP sessions that
  makes fewer, larger batches: fewer commits and fsyncs per message, and far fewer
  hand-overs of the GIL between the writer and the event loop (the inbound's `futex` calls
  per message 13.6 -> 5.3). Measured on smtp-source's 20 sessions: the inbound's CPU per
  message -21% and acceptance +8% (bench/README.md, "A seventh machine"). A lone client's
  batches hold one job each, so it never waits: the serial latency is unchanged. Not for
  the engine's jobs (its records gathered too cost a drain of 100,000 messages a fifth of
  its speed: a delivery waits for its record). On PostgreSQL too: a node's relay CPU per
  message -16%, its server backends' -20%, acceptance +14% (bench/fleet.py, same run; the
  2 ms gathering of every batch tried before gave no speed).
- Checkpoints (SQLite: the WAL's pages copied into the database file, which is then
  fsync'd) run inside the COMMIT that takes the WAL past `wal_autocheckpoint` pages, with
  the flock held: every job of that batch waits for them, and every other process's writer
  too. An inbound process's writer is made with `checkpoint_pages` ten times SQLite's
  1,000 (relay/inbound/processes.py), so the main process's commits, which no SMTP reply
  waits on, do the checkpoints; an inbound process takes one only when the WAL has grown
  that far without them (the main process committing nothing: every destination held,
  say). Measured on 2,000 x 100 KiB: acceptance +7%, the inbound's CPU -10% and the main
  process's +15% (the same total); 2 KiB and a lone client's latency unchanged
  (bench/README.md, "A fifteenth machine").
- A job whose caller gave up after the writer took it up (an asyncio waiter cancelled while
  its batch ran: the inbound's client hung up during the commit) has run and committed all
  the same; its result goes to the job's `orphan` hook, on the waiter's loop, if it is a
  `Grouped` job with one (the inbound logs and announces such a message as any queued
  one), and is dropped otherwise. A job cancelled before the writer took it is not run.
- Results go back to the event loop in one hop per batch (one `call_soon_threadsafe`, one
  wake-up of the loop), not one per job: at a few hundred messages a second, a wake-up per
  job cost the loop a syscall each and the writer a fight for the GIL.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from relay.ops import faults
from relay.spool import db

if TYPE_CHECKING:
    from relay.config.tree import PgSpool

log = logging.getLogger(__name__)

T = TypeVar("T")
Job = Callable[[sqlite3.Connection], Any]
# a job, its waiter (an asyncio future and its loop, or a thread's concurrent future and
# None), and whether it is lazy (run(lazy=True))
Item = tuple[Job, "asyncio.Future[Any] | Future[Any]", "asyncio.AbstractEventLoop | None", bool]

MAX_BATCH = 512
JOB_TRIES = 3  # a job that lost a lock race on PostgreSQL runs again (db.retryable)
# ... after a pause (this times its try number, and up to half as much again at random, so
# two nodes that lost to each other do not come back in step): the peer that won is woken
# when the job's savepoint rolls back but must still be scheduled to take the row; a job
# run again at once can take the row first and deadlock with the same peer again (a CI
# run's third try)
RETRY_PAUSE = 0.02
LOCK_NAME = "write.lock"


@dataclass(frozen=True, slots=True)
class Grouped(Generic[T]):
    """A job the writer may run with the other jobs of its batch on the same `many` (see
    the rules); alone it is `many(conn, [arg])[0]`. `sqlite`: grouped on SQLite too.
    `gather`: a batch it opens after a shared batch waits `spool.gather` for more (the
    inbound's accepts; see the rules). `atomic`: on SQLite, `many` writes all of its group
    or nothing (one statement, or a savepoint of its own), so the writer opens no SAVEPOINT
    around it, alone or grouped (see the rules). `orphan`: given the job's result, on its
    waiter's loop, when the waiter gave up after the writer had taken the job up (the job
    ran and committed; see the rules)."""

    many: Callable[[Any, list[Any]], list[T]]
    arg: Any
    sqlite: bool = False
    gather: bool = False
    atomic: bool = False
    orphan: Callable[[T], None] | None = None

    def __call__(self, conn: Any) -> T:
        return self.many(conn, [self.arg])[0]


def plan(batch: list[Item], grouping: bool) -> list[list[Item]]:
    """The batch in the order its units run: a unit is one job, or every Grouped job on
    one `many` (at the place of the first of them) when `grouping` or the job says
    `sqlite`."""
    units: list[list[Item]] = []
    groups: dict[Any, list[Item]] = {}
    for item in batch:
        job = item[0]
        if isinstance(job, Grouped) and (grouping or job.sqlite):
            unit = groups.get(job.many)
            if unit is None:
                unit = groups[job.many] = []
                units.append(unit)
            unit.append(item)
        else:
            units.append([item])
    return units


class SpoolError(Exception):
    """The spool could not durably take a write (the caller answers 4xx)."""


class SpoolWriter:
    def __init__(
        self,
        spool_dir: Path,
        pg: PgSpool | None = None,
        on_commit: Callable[[float, int], None] | None = None,
        gather: Callable[[], float] = lambda: 0.0,
        checkpoint_pages: int | None = None,
    ) -> None:
        self.spool_dir = spool_dir
        self.gather = gather  # seconds: spool.gather, read for each batch (see the rules)
        # SQLite: the connection's wal_autocheckpoint (None: SQLite's 1,000 pages; see the rules)
        self.checkpoint_pages = checkpoint_pages
        self._last_batch = 1  # jobs in the batch before: more than one, and it gathers
        self.pg = pg
        self._q: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self.batches = 0
        self.jobs = 0
        self.last_commit_seconds = 0.0
        self.commit_seconds_total = 0.0
        self.failures = 0
        self.grouped = 0  # jobs run in a group, for tests and the bench
        self.healthy = True
        self.refused_at = float("-inf")  # monotonic: the last job the database refused
        self.refused = ""
        self.on_commit = on_commit
        self._reader: sqlite3.Connection | None = None  # read(): opened at first use
        self._reader_lock = threading.Lock()

    def start(self) -> None:
        self._conn = db.open_spool(
            self.spool_dir, self.pg, cache_kib=db.WRITER_CACHE_KIB, temp_in_memory=True
        )
        if self.pg is not None:  # the local state beside the database (health, caches)
            self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        if self.pg is None:  # PostgreSQL has row locks of its own, across machines
            self._lock_fd = os.open(self.spool_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o640)
            if self.checkpoint_pages is not None:
                self._conn.execute(f"PRAGMA wal_autocheckpoint={int(self.checkpoint_pages)}")
        self._thread = threading.Thread(target=self._run, name="spool-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def run(self, job: Callable[[sqlite3.Connection], T], lazy: bool = False) -> T:
        """Run `job` in the next batch. `lazy`: the job's writes need no fsync of their
        own (a batch of lazy jobs only commits with synchronous=NORMAL): what it writes may
        be lost in a power cut only together with everything after it, and losing it must
        be harmless (the engine's claims: a lost claim leaves the recipient due, as the
        start-up recovery would make it). Any later durable commit fsyncs it too (the WAL
        is one file, written in order)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._q.put((job, fut, loop, lazy))
        try:
            return await fut
        except sqlite3.Error as e:
            raise SpoolError(str(e)) from e

    async def read(self, job: Callable[[sqlite3.Connection], T]) -> T:
        """Run the read-only `job` beside the writer (see the rules): a worker thread and a
        connection with `query_only`, one such read at a time."""
        if self.pg is not None:
            return await self.run(job)
        try:
            return await asyncio.to_thread(self._read, job)
        except sqlite3.Error as e:
            raise SpoolError(str(e)) from e

    def _read(self, job: Callable[[sqlite3.Connection], T]) -> T:
        with self._reader_lock:
            if self._reader is None:
                conn = db.connect(self.spool_dir, create=False)
                conn.execute("PRAGMA query_only=ON")
                self._reader = conn
            return job(self._reader)

    def run_sync(self, job: Callable[[sqlite3.Connection], T]) -> T:
        """For code that is not on the event loop (start-up, tests)."""
        fut: Future[T] = Future()
        self._q.put((job, fut, None, False))
        return fut.result()

    def _run(self) -> None:
        conn = self._conn
        assert conn is not None
        stop = False
        while not stop:
            first = self._q.get()
            if first is None:
                break
            batch = [first]
            # gather (see the rules): once, after a batch shared by several jobs
            job = first[0]
            gathered = self._last_batch < 2 or not (isinstance(job, Grouped) and job.gather)
            while len(batch) < MAX_BATCH:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    if gathered:
                        break
                    gathered = True
                    wait = self.gather()
                    if wait > 0:
                        time.sleep(wait)  # lets go of the GIL: the loop runs meanwhile
                    continue
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._last_batch = len(batch)
            self._commit(conn, batch)

    def _commit(self, conn: sqlite3.Connection, batch: list[Item]) -> None:
        """The flock is held from BEGIN to COMMIT and no longer (see the rules): a lazy
        batch's pragmas (they take no lock) come before and after it, the results' hand-over
        after it."""
        lazy = all(item[3] for item in batch) and db.dialect(conn) == "sqlite"
        if lazy:
            conn.execute("PRAGMA synchronous=NORMAL")
        try:
            lock = self._lock_fd
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the other processes' writers (GIL released)
            try:
                results = self._run_batch(conn, batch)
            finally:
                if lock is not None:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            _resolve_all(results)
        finally:
            if lazy:
                conn.execute("PRAGMA synchronous=FULL")

    def _run_batch(
        self, conn: sqlite3.Connection, batch: list[Item]
    ) -> list[tuple[Item, Any, BaseException | None]]:
        """BEGIN, the jobs, COMMIT; what each job's waiter is to get (a failed BEGIN or
        COMMIT fails every job of the batch)."""
        started = time.monotonic()
        results: list[tuple[Item, Any, BaseException | None]] = []
        try:
            faults.hit("spool.begin")
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            log.error("spool transaction could not start: %s", e)
            self.failures += 1
            self.healthy = False
            return [(item, None, e) for item in batch if _take(item)]
        grouping = db.dialect(conn) == "postgresql"
        for unit in plan(batch, grouping):
            taken = [item for item in unit if _take(item)]  # not run: its caller gave up
            if len(taken) > 1 and self._run_group(conn, taken, results, grouping):
                continue
            for item in taken:
                self._run_one(conn, item, results, grouping)
        try:
            faults.hit("spool.commit")
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            log.error("spool commit failed: %s", e)
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.failures += 1
            self.healthy = False
            return [(item, None, e) for item, _res, _err in results]
        self.healthy = True
        elapsed = time.monotonic() - started
        self.batches += 1
        self.jobs += len(batch)
        self.last_commit_seconds = elapsed
        self.commit_seconds_total += elapsed
        if self.on_commit is not None:
            try:
                self.on_commit(elapsed, len(batch))
            except Exception:  # metrics must never break the spool
                log.exception("on_commit hook failed")
        return results

    def _run_group(
        self,
        conn: sqlite3.Connection,
        items: list[Item],
        results: list[tuple[Item, Any, BaseException | None]],
        grouping: bool,
    ) -> bool:
        """Run Grouped jobs in one call; False (nothing done) when it failed."""
        first = items[0][0]
        many = first.many  # type: ignore[attr-defined]
        try:
            with _job_savepoint(conn, first, grouping):
                faults.hit("spool.job")
                res = many(conn, [item[0].arg for item in items])  # type: ignore[attr-defined]
                if len(res) != len(items):
                    raise RuntimeError(f"{many!r} gave {len(res)} results for {len(items)} jobs")
        except Exception as e:
            log.debug("a group of %d jobs failed (%s); running them one by one", len(items), e)
            return False
        results.extend((item, r, None) for item, r in zip(items, res, strict=True))
        self.grouped += len(items)
        return True

    def _run_one(
        self,
        conn: sqlite3.Connection,
        item: Item,
        results: list[tuple[Item, Any, BaseException | None]],
        grouping: bool,
    ) -> None:
        job = item[0]
        for attempt in range(JOB_TRIES):
            try:
                with _job_savepoint(conn, job, grouping):
                    faults.hit("spool.job")
                    res = job(conn)
                results.append((item, res, None))
                return
            except Exception as e:
                if attempt + 1 < JOB_TRIES and db.retryable(e):
                    # the peer takes its locks first
                    time.sleep(RETRY_PAUSE * (attempt + 1) * (1 + random.random() / 2))
                    continue  # a deadlock victim
                if db.refuses_writes(e):
                    self.refused_at, self.refused = time.monotonic(), str(e)
                results.append((item, None, e))
                return


def _job_savepoint(
    conn: sqlite3.Connection, job: Any, grouping: bool
) -> AbstractContextManager[Any]:
    """`SAVEPOINT job` around a job or a group (released when it ends, rolled back to when it
    fails), unless it writes all or nothing by itself on SQLite (`Grouped.atomic`)."""
    if not grouping and isinstance(job, Grouped) and job.atomic:
        return nullcontext()
    return db.savepoint(conn, "job")


def _take(item: Item) -> bool:
    """Mark a job as taken; False if its caller already gave up on it."""
    fut, loop = item[1], item[2]
    if loop is None:
        assert isinstance(fut, Future)
        return fut.set_running_or_notify_cancel()
    return not fut.cancelled()


def _resolve_all(results: list[tuple[Item, Any, BaseException | None]]) -> None:
    """Hand every result to its waiter: one call per event loop, whatever the batch size."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None, Job]]] = {}
    for (job, fut, loop, _lazy), res, err in results:
        if loop is None:
            assert isinstance(fut, Future)
            if err is None:
                fut.set_result(res)
            else:
                fut.set_exception(err)
        else:
            by_loop.setdefault(loop, []).append((fut, res, err, job))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, items)
        except RuntimeError:  # the loop is closed (shutdown): nobody waits any more
            pass


def _settle(items: list[tuple[Any, Any, BaseException | None, Job]]) -> None:
    for fut, res, err, job in items:
        if fut.cancelled():  # after the writer took the job up: it ran all the same
            if err is None and isinstance(job, Grouped) and job.orphan is not None:
                try:
                    job.orphan(res)
                except Exception:  # one hook's bug must not cost the batch's other waiters
                    log.exception("orphan hook failed")
            continue
        if err is None:
            fut.set_result(res)
        else:
            fut.set_exception(err)
