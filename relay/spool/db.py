"""Opening the spool database: pragmas on every connection, and versioned migrations.

Rules:
- WAL journal and `synchronous=FULL` on every connection: a commit returns only after the
  WAL is fsync'd, so a `250` sent after a commit survives a power cut.
- Writes use `BEGIN IMMEDIATE` (take the write lock up front, wait `busy_timeout` for it)
  so that the daemon and the CLI never deadlock upgrading a read lock.
- The schema is versioned with `PRAGMA user_version`; `MIGRATIONS[i]` (relay/spool/schema.py)
  brings version i to i+1. Never edit a released migration: append a new one.
- Every connection then makes its temporary objects (schema.py `SQLITE_TEMP`: `intake`, `outcome`),
  in its own `temp` schema: nothing of them is in the spool file.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from relay.spool.schema import CUSTOM_PLAN as CUSTOM_PLAN  # ops.py's statements use it
from relay.spool.schema import MIGRATIONS, SQLITE_TEMP_STATEMENTS, statements

if TYPE_CHECKING:
    from relay.config.tree import PgSpool

DB_NAME = "relay.sqlite"
BUSY_TIMEOUT_MS = 5000
DEFAULT_CACHE_KIB = 2000  # SQLite's own default: the CLI, one query each
# the daemon's writer: the dedup keys (hashes: random b-tree inserts) and the recipient
# indexes of a deep queue outgrow 2 MiB, and every miss is a read (SpoolWriter)
WRITER_CACHE_KIB = 32768


def db_path(spool_dir: Path) -> Path:
    return spool_dir / DB_NAME


def connect(
    spool_dir: Path,
    *,
    create: bool = True,
    cache_kib: int = DEFAULT_CACHE_KIB,
    temp_in_memory: bool = False,
) -> sqlite3.Connection:
    """Open the spool with the durability pragmas, migrating it if needed. `temp_in_memory`
    (the writers): statement journals in memory. An INSERT into a TEMP view (schema.py) is
    a statement of many rows that may RAISE, so SQLite keeps a statement journal for it;
    with temp_store FILE one past 64 KiB (a batch of accepts with their bodies) spilled to
    a file made in /var/tmp, written and unlinked for every batch (seven syscalls a message
    in the inbound). Other connections keep FILE: a big sort of theirs (the CLI over a deep
    queue) spills to disk, not to memory."""
    if create:
        spool_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    elif not db_path(spool_dir).exists():
        raise FileNotFoundError(f"no spool at {db_path(spool_dir)}")
    conn = sqlite3.connect(
        db_path(spool_dir),
        timeout=BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,
        check_same_thread=False,
    )
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute(f"PRAGMA cache_size=-{cache_kib}")
    if temp_in_memory:
        conn.execute("PRAGMA temp_store=MEMORY")
    migrate(conn)
    for stmt in SQLITE_TEMP_STATEMENTS:  # the connection's own (schema.py), after the tables
        conn.execute(stmt)
    return conn


def open_spool(
    spool_dir: Path,
    pg: PgSpool | None = None,
    *,
    create: bool = True,
    cache_kib: int = DEFAULT_CACHE_KIB,
    temp_in_memory: bool = False,
) -> sqlite3.Connection:
    """The configured spool: SQLite under `spool_dir`, or PostgreSQL at `pg.dsn` (whose
    connection speaks the subset of sqlite3.Connection the spool uses: relay/spool/pg.py)."""
    if pg is None:
        return connect(spool_dir, create=create, cache_kib=cache_kib, temp_in_memory=temp_in_memory)
    from relay.spool import pg as pgmod

    return cast(sqlite3.Connection, pgmod.connect(pg.dsn, pg.password_file))


# a job that lost a lock race on PostgreSQL (deadlock victim, serialization failure,
# lock_timeout; relay/spool/pg.py keeps the SQLSTATE): the writer runs it again at once
RETRYABLE = frozenset({"40P01", "40001", "55P03"})


def retryable(e: BaseException) -> bool:
    return getattr(e, "sqlstate", None) in RETRYABLE


def refuses_writes(e: BaseException) -> bool:
    """A PostgreSQL error that says the database takes no writes now, whatever the statement:
    insufficient resources (class 53: disk full, out of memory, too many connections), a
    system error (class 58: I/O), a read-only transaction (25006: a standby after a
    failover, `default_transaction_read_only`). A constraint or a lost lock race is not."""
    state = str(getattr(e, "sqlstate", None) or "")
    return state[:2] in ("53", "58") or state == "25006"


def dialect(conn: sqlite3.Connection) -> str:
    """'sqlite' or 'postgresql': for the few statements that differ (pragmas, locks)."""
    return str(getattr(conn, "dialect", "sqlite"))


def migrate(conn: sqlite3.Connection) -> int:
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > len(MIGRATIONS):
        raise RuntimeError(
            f"spool schema version {version} is newer than this relay understands "
            f"({len(MIGRATIONS)}); upgrade relay"
        )
    while version < len(MIGRATIONS):
        with transaction(conn):
            # re-check under the write lock: another process may have migrated meanwhile
            current: int = conn.execute("PRAGMA user_version").fetchone()[0]
            if current == version:
                for stmt in statements(MIGRATIONS[version]):
                    conn.execute(stmt)
                conn.execute(f"PRAGMA user_version={version + 1}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    return version


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextmanager
def savepoint(conn: sqlite3.Connection, name: str) -> Iterator[None]:
    """The block inside `SAVEPOINT name`: released when it ends, rolled back to when it
    raises (the error goes on; a failure of the rollback itself does not hide it)."""
    conn.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        try:
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
        except sqlite3.Error:
            pass
        raise
    conn.execute(f"RELEASE {name}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
