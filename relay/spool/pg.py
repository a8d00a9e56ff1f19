"""The spool on PostgreSQL (`spool.backend: postgresql`): one connection that speaks to the
spool's code the way its SQLite connection does.

Rules:
- One spool interface: `relay.spool.ops`, the writer, the CLI and the feedback and alert
  code run the same statements on both backends. They are written in the SQL both engines
  share (`INSERT ... ON CONFLICT`, `RETURNING`, `coalesce(sum())`); what is left of
  SQLite's dialect is translated here, once per statement text (cached): `?` placeholders
  become `%s`, a literal `%` becomes `%%`, `INDEXED BY` (a SQLite planner hint) is dropped,
  `BEGIN IMMEDIATE` is `BEGIN`. Nothing else is rewritten: a statement this module cannot
  pass through unchanged must be made portable at its source.
- An array parameter with its cast (`?::text[]`, the batches of the hot path: unnest) is
  sent in binary (`%b`): psycopg dumps a list in text one element at a time with a regular
  expression over each (a 100 KiB body in a `bytea[]` was 1.5 ms of the writer's CPU, a
  batch of four 2 KiB messages 240 us; in binary 0.03 ms and 75 us). The cast names the
  type, so the server reads the same values either way.
- Such an array of numbers, text and NULLs is sent as the text of an array literal that
  this module writes (`array_literal`: each element quoted, `"` and `\\` escaped, no
  regular expression), which the cast reads on the server: psycopg's binary list dumper
  is Python per element and per list (it sniffs each list's type first): the writer's CPU
  per message fell by 20-42 us in an accept of five and by 32-52 us in a record of ten,
  the server's moved by -22 to +42 us, +15 on average (it parses the text)
  (bench/pg_arrays.py, bench/README.md, issue 31). A list of bytes (bodies) stays binary.
- The schema is the same migrations as SQLite's (relay/spool/schema.py), their column types
  mapped (REAL -> double precision, BLOB -> bytea, INTEGER PRIMARY KEY -> an identity
  column, TEXT -> text in the "C" collation so that ORDER BY sorts by code point as SQLite
  does). The version lives in `relay_schema`; migrating holds an advisory lock, so several
  relays starting on one database migrate it once.
- Durability is the same promise: `synchronous_commit = on` (a COMMIT returns after the
  WAL is flushed on the server), and the writer commits its batches as on SQLite.
- Errors come out as sqlite3's DB-API classes (`IntegrityError`, `OperationalError`), so
  the writer's and the CLI's handling is one: a failed statement or COMMIT fails the jobs
  of the batch and their callers answer 4xx. A connection the server dropped is replaced at
  the next BEGIN (the batch in flight fails; the next one runs on a new connection).
- The password comes from `spool.password_file` (read here, never logged) or from libpq's
  own mechanisms in the DSN (PGPASSWORD, ~/.pgpass, the URL); relay/config/redact.py `redact_dsn`
  hides a password written into the URL wherever a DSN is shown.
- Driver: psycopg 3 (sync). The writer is a thread that runs a batch of jobs per
  transaction, so a synchronous driver in that thread is the natural fit (asyncpg would
  need the event loop the writer keeps its batches away from); psycopg prepares a statement
  on the server after its fifth use (`prepare_threshold`), which covers the hot path, but
  for the statements marked `db.CUSTOM_PLAN` (lookups of a batch of keys): those are sent
  unprepared and planned for their parameters at every call.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from relay.config.redact import dsn_passwords as dsn_passwords  # the spool's callers use them
from relay.config.redact import redact_dsn
from relay.spool.schema import CUSTOM_PLAN, MIGRATIONS, statements

DIALECT = "postgresql"
# a lock key of our own for migrations (pg_advisory_xact_lock takes a bigint)
MIGRATE_LOCK = 0x72656C6179  # "relay"


class Row(tuple):  # type: ignore[type-arg]
    """A result row readable by position and by column name, like sqlite3.Row."""

    __slots__ = ()
    _names: tuple[str, ...] = ()

    def keys(self) -> list[str]:
        return list(self._names)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return tuple.__getitem__(self, self._names.index(key))
            except ValueError:
                raise IndexError(f"no such column: {key}") from None
        return tuple.__getitem__(self, key)


@lru_cache(maxsize=64)
def _row_class(names: tuple[str, ...]) -> type[Row]:
    return type("Row", (Row,), {"__slots__": (), "_names": names})


def _make_row(cursor: Any) -> Any:
    """psycopg's row factory: rows as Row, readable by position and by name. The names are
    read off the result itself: `cursor.description` builds a Column (with its type's
    lookup) per column per statement, 50-70 us for a claim's 17 (bench/README.md)."""
    res = cursor.pgresult
    if res is None or not res.nfields:
        return tuple
    return _row_class(tuple((res.fname(i) or b"").decode() for i in range(res.nfields)))


_INDEXED_BY = re.compile(r"\s+INDEXED\s+BY\s+\w+", re.IGNORECASE)
_ARRAY_CAST = re.compile(r"::[A-Za-z_][A-Za-z_ ]*\[\]")  # `?::double precision[]`


_INTEGER_TYPES = frozenset({"bigint", "integer", "smallint"})
# the positions of a statement's parameters that carry an array cast (`?::text[]`), each with
# whether its elements are integers: where _texts_for_arrays may send an array literal
Slots = tuple[tuple[int, bool], ...]


@lru_cache(maxsize=1024)
def _translated(sql: str) -> tuple[str, Slots]:
    """translate(sql) and the statement's array slots, found in the same pass."""
    sql = _INDEXED_BY.sub("", sql)
    if sql.strip().upper() == "BEGIN IMMEDIATE":
        return "BEGIN", ()
    out: list[str] = []
    slots: list[tuple[int, bool]] = []
    n = 0  # parameters so far
    quoted = False
    for i, ch in enumerate(sql):
        if ch == "'":
            quoted = not quoted  # '' inside a literal toggles twice: still inside
            out.append(ch)
        elif ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            cast = _ARRAY_CAST.match(sql, i + 1)
            if cast:
                slots.append((n, cast.group(0)[2:-2].strip().lower() in _INTEGER_TYPES))
            out.append("%b" if cast else "%s")
            n += 1
        else:
            out.append(ch)
    return "".join(out), tuple(slots)


def translate(sql: str) -> str:
    """SQLite's statement text as psycopg takes it (see the module's rules)."""
    return _translated(sql)[0]


def array_slots(sql: str) -> Slots:
    """The array slots of SQLite's statement text `sql` (see Slots)."""
    return _translated(sql)[1]


_TYPE_MAP = [
    (
        re.compile(r"\bINTEGER PRIMARY KEY\b", re.IGNORECASE),
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    ),
    (re.compile(r"\bREAL\b", re.IGNORECASE), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b", re.IGNORECASE), "BYTEA"),
    (re.compile(r"\bTEXT\b", re.IGNORECASE), 'TEXT COLLATE "C"'),
    (re.compile(r"\)\s*WITHOUT ROWID", re.IGNORECASE), ")"),
]


def array_literal(values: list[Any], integer: bool = False) -> str | None:
    """`values` as PostgreSQL's text of a one-dimensional array (`{1,"a b",NULL}`), which
    `?::type[]` reads as the same values; None when an element is not an int, float, str
    or None (bytes, bool, a nested list: psycopg dumps those), or is a float bound for an
    `integer` array (psycopg's cast rounds it; its text would not parse as an integer).
    Every text is quoted, so that none is read as NULL, trimmed or split: inside the quotes
    only `"` and `\\` are special (PostgreSQL, "Array Value Input")."""
    try:
        raw = "".join(values)  # a TypeError unless every element is a str
    except TypeError:
        pass
    else:
        if "\\" not in raw and '"' not in raw:  # nothing to escape: one join
            return '{"' + '","'.join(values) + '"}' if values else "{}"
    out: list[str] = []
    for v in values:
        t = type(v)
        if t is str:
            out.append('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif t is int:
            out.append(str(v))
        elif t is float and not integer:
            out.append(repr(v))  # the shortest text that reads back as the same double
        elif v is None:
            out.append("NULL")
        else:
            return None
    return "{" + ",".join(out) + "}"


def _texts_for_arrays(slots: Slots, params: Sequence[Any]) -> Sequence[Any]:
    """`params` with each list at an array slot that array_literal can write replaced by
    its text."""
    out = None
    for i, integer in slots:
        p = params[i]
        if type(p) is list and (lit := array_literal(p, integer)) is not None:
            if out is None:
                out = list(params)
            out[i] = lit
    return params if out is None else out


def ddl(stmt: str) -> str:
    """One statement of a SQLite migration in PostgreSQL's column types."""
    for pattern, repl in _TYPE_MAP:
        stmt = pattern.sub(repl, stmt)
    return stmt


redact = redact_dsn  # the DSN with its password hidden (relay/config/redact.py)


def _wrap(e: psycopg.Error) -> sqlite3.Error:
    cls = (
        sqlite3.IntegrityError
        if isinstance(e, pg_errors.IntegrityError)
        else (sqlite3.OperationalError)
    )
    err = cls(f"postgresql: {str(e).strip()}")
    err.__cause__ = e
    setattr(err, "sqlstate", e.sqlstate)  # noqa: B010 (the writer retries on it)
    return err


# statements whose answer nobody reads: sent with the next statement, in one round trip
# (`SAVEPOINT take`: ops.accept_many's, released with its job's)
DEFERRED = frozenset({"BEGIN", "SAVEPOINT job", "RELEASE job", "SAVEPOINT take"})

# Counters added at COMMIT (PgConnection.add_counts): per table, its key columns and types
# and its counter columns. The rows every node bumps (`dest:smarthost` today, an identity's
# hour) are a fleet's hot rows: an upsert in the middle of a batch held the row lock until
# the batch's COMMIT, through every later statement's round trip, and the other nodes'
# writers waited on it (measured: bench/README.md, Issue 31). Sent in the COMMIT's own
# round trip, the lock is held for the upsert and the WAL flush only. The tables in this
# order and each table's rows sorted: commit-time locks are taken in one global order, and
# nothing else locks these rows mid-transaction but a fleet's daily-ceiling scopes, which
# the spool's code keeps inline (ops.record_many) and never adds here.
# Counts a node adds (`add_counts(..., node=)`: its records) go to its own rows in the
# `_node` table: a row bumped by two nodes still made one node's COMMIT wait for the
# other's WAL flush on its lock (a drain of two nodes: 1.50x one; with no counters at all
# 1.61x, bench/README.md). Readers sum both tables (ops.daily_counts, feedback rates).
COUNTER_TABLES: dict[str, tuple[tuple[tuple[str, str], ...], tuple[str, ...]]] = {
    "daily_counts": ((("scope", "text"), ("day", "text")), ("count",)),
    "identity_hours": (
        (("identity", "text"), ("hour", "bigint")),
        ("delivered", "bounced", "complained"),
    ),
    "daily_counts_node": ((("scope", "text"), ("day", "text"), ("node", "text")), ("count",)),
    "identity_hours_node": (
        (("identity", "text"), ("hour", "bigint"), ("node", "text")),
        ("delivered", "bounced", "complained"),
    ),
}


@cache
def _counter_upsert(table: str) -> str:
    keys, cols = COUNTER_TABLES[table]
    names = [k for k, _t in keys] + list(cols)
    arrays = ", ".join([f"?::{t}[]" for _k, t in keys] + ["?::integer[]"] * len(cols))
    sets = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in cols)
    return (
        f"INSERT INTO {table} ({', '.join(names)}) SELECT * FROM unnest({arrays})"
        f" ON CONFLICT ({', '.join(k for k, _t in keys)}) DO UPDATE SET {sets}"
    )


class _Deferred:
    """What execute() returns for a DEFERRED statement (sent later, with the next)."""

    rowcount = -1
    statusmessage = None

    def fetchone(self) -> None:
        return None

    def fetchall(self) -> list[Any]:
        return []


class PgConnection:
    """The subset of sqlite3.Connection the spool uses, on a psycopg connection in
    autocommit mode (transactions are the explicit BEGIN ... COMMIT the spool issues).

    BEGIN and the writer's SAVEPOINT/RELEASE (DEFERRED) are not sent on their own: they
    wait for the next statement and go with it in one pipeline (psycopg's pipeline mode:
    one round trip), so a job costs the server no wake-up of its own for its savepoint and
    a batch none for its BEGIN. An error of a deferred statement surfaces at the statement
    it went with, where the writer handles it as that statement's own."""

    dialect = DIALECT

    def __init__(self, dsn: str, password: str | None = None) -> None:
        self.dsn = dsn
        self._password = password
        self._lock = threading.Lock()  # one statement at a time (CLI threads, tests)
        self._deferred: list[str] = []
        # add_counts of the open transaction, and as they were at the job's SAVEPOINT (a
        # job rolled back to it takes its counts back with it)
        self._counts: dict[str, dict[tuple[Any, ...], list[int]]] = {}
        self._counts_at_savepoint: dict[str, dict[tuple[Any, ...], list[int]]] = {}
        self._conn = self._open()

    def _open(self) -> psycopg.Connection[Any]:
        kwargs: dict[str, Any] = {"autocommit": True, "row_factory": _make_row}
        if self._password is not None:
            kwargs["password"] = self._password
        try:
            conn = psycopg.connect(self.dsn, **kwargs)
        except psycopg.Error as e:
            raise _wrap(e) from e
        conn.execute("SET synchronous_commit = on")
        conn.execute("SET lock_timeout = '5s'")
        return conn

    def add_counts(
        self, table: str, key: tuple[Any, ...], *, node: str | None = None, **counts: int
    ) -> None:
        """Add `counts` to the counter columns of `table`'s row `key` (made if absent) in
        the COMMIT of the open transaction, in its round trip (see COUNTER_TABLES); with
        `node`, to that node's own row of the table's `_node` twin."""
        if node is not None:
            table, key = f"{table}_node", (*key, node)
        cols = COUNTER_TABLES[table][1]
        if not self.in_transaction:  # autocommit (the CLI, tests): now
            values = [counts.get(c, 0) for c in cols]
            self.execute(_counter_upsert(table), [*([k] for k in key), *([v] for v in values)])
            return
        row = self._counts.setdefault(table, {}).setdefault(key, [0] * len(cols))
        for name, n in counts.items():
            row[cols.index(name)] += n

    def flush_counts(self) -> None:
        """Send the open transaction's counters now (a reader later in the same
        transaction, the tests): as its COMMIT would."""
        with self._lock:
            pending = self._track_counts("COMMIT")
        for q, p in pending:
            self.execute(q, p)

    def _counts_copy(self) -> dict[str, dict[tuple[Any, ...], list[int]]]:
        return {t: {k: list(v) for k, v in rows.items()} for t, rows in self._counts.items()}

    def _track_counts(self, query: str) -> list[tuple[str, list[Any]]]:
        """The transaction's counters at `query`; at COMMIT, the upserts to send with it."""
        if query in ("BEGIN", "ROLLBACK"):
            self._counts, self._counts_at_savepoint = {}, {}
        elif query == "SAVEPOINT job":
            self._counts_at_savepoint = self._counts_copy()
        elif query == "ROLLBACK TO job":
            self._counts = self._counts_at_savepoint
            self._counts_at_savepoint = self._counts_copy()
        elif query == "COMMIT" and self._counts:
            out: list[tuple[str, list[Any]]] = []
            for table in COUNTER_TABLES:  # one order of tables, and of rows in each
                rows = self._counts.get(table)
                if not rows:
                    continue
                keys = sorted(rows)
                width = len(COUNTER_TABLES[table][0])
                params: list[Any] = [[k[i] for k in keys] for i in range(width)]
                ncols = len(COUNTER_TABLES[table][1])
                params += [[rows[k][j] for k in keys] for j in range(ncols)]
                out.append((_counter_upsert(table), params))
            self._counts, self._counts_at_savepoint = {}, {}
            return out
        return []

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        query, slots = _translated(sql)
        with self._lock:
            if query == "BEGIN" and self._conn.broken:
                self._deferred.clear()
                self._conn = self._open()
            at_commit = self._track_counts(query) if not params else []
            if slots and not isinstance(params, dict):
                params = _texts_for_arrays(slots, params)
            # db.CUSTOM_PLAN: unprepared (an unnamed statement: planned for its parameters)
            prepare = False if query.startswith(CUSTOM_PLAN) else None
            if query in DEFERRED and not params:
                self._deferred.append(query)
                return _Deferred()
            try:
                if self._deferred or at_commit:
                    deferred, self._deferred = self._deferred, []
                    with self._conn.pipeline():
                        for q in deferred:
                            self._conn.execute(q)
                        for q, p in at_commit:
                            tq, ts = _translated(q)
                            self._conn.execute(tq, _texts_for_arrays(ts, p))
                        cur = self._conn.execute(query, params, prepare=prepare)
                else:
                    cur = self._conn.execute(query, params, prepare=prepare)
            except psycopg.Error as e:
                raise _wrap(e) from e
            if cur.statusmessage == "ROLLBACK" and query.strip().upper() == "COMMIT":
                # PostgreSQL answers COMMIT in a failed transaction with a ROLLBACK, not an
                # error: every job of the batch would be reported written, and none is
                raise sqlite3.OperationalError("postgresql: the transaction was rolled back")
            return cur

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> Any:
        query = translate(sql)
        with self._lock:
            cur = self._conn.cursor()
            try:
                deferred, self._deferred = self._deferred, []
                with self._conn.pipeline():
                    for q in deferred:
                        self._conn.execute(q)
                    cur.executemany(query, seq)
            except psycopg.Error as e:
                raise _wrap(e) from e
            return cur

    def close(self) -> None:
        self._deferred.clear()
        self._conn.close()

    @property
    def in_transaction(self) -> bool:
        if "BEGIN" in self._deferred:
            return True
        return self._conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE


def read_password(path: Path | None) -> str | None:
    if path is None:
        return None
    return path.read_text().rstrip("\r\n")


def connect(dsn: str, password_file: Path | None = None) -> PgConnection:
    conn = PgConnection(dsn, read_password(password_file))
    migrate(conn)
    return conn


def migrate(conn: PgConnection) -> int:
    conn.execute("BEGIN")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATE_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS relay_schema (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM relay_schema").fetchone()
        if row is None:
            conn.execute("INSERT INTO relay_schema (version) VALUES (0)")
            version = 0
        else:
            version = int(row[0])
        if version > len(MIGRATIONS):
            raise RuntimeError(
                f"spool schema version {version} is newer than this relay understands "
                f"({len(MIGRATIONS)}); upgrade relay"
            )
        while version < len(MIGRATIONS):
            for stmt in statements(MIGRATIONS[version]):
                conn.execute(ddl(stmt))
            for stmt in PG_MIGRATIONS.get(version, ()):
                conn.execute(stmt)
            version += 1
        conn.execute("UPDATE relay_schema SET version = ?", (version,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return version


# statements a migration needs on PostgreSQL only, after its shared ones (by version)
# the transactional outbox (relay/spool/outbox.py, README): an application writes these rows
OUTBOX_TABLE = (
    """
    CREATE TABLE relay_outbox (
        id              bigserial PRIMARY KEY,
        idempotency_key text NOT NULL UNIQUE,
        sender          text NOT NULL DEFAULT '',
        recipients      text[] NOT NULL,
        message         bytea NOT NULL,
        lane            text NOT NULL DEFAULT 'transactional',
        created_at      timestamptz NOT NULL DEFAULT now(),
        state           text NOT NULL DEFAULT 'pending' CHECK (state IN
                          ('pending', 'queued', 'delivered', 'failed', 'rejected', 'duplicate')),
        attempts        integer NOT NULL DEFAULT 0,
        next_attempt_at timestamptz,
        upstream_id     text,
        last_error      text,
        queue_id        text,
        updated_at      timestamptz
    )
    """,
    "CREATE INDEX relay_outbox_open ON relay_outbox (id) WHERE state IN ('pending', 'queued')",
)


# Every body of a PostgreSQL spool lives in its row (up to limits.max_message_size), and the
# server compresses a value past ~2 KB with pglz by default: 6% of the inbound's backend CPU
# at 2 KiB, and pglz reads a large body back (each claim) slower still. lz4 (PostgreSQL 14 and
# newer, built with it) compresses several times faster; a server without it keeps pglz.
# Only values written from now on take it (bench/README.md, issue 31).
BODY_LZ4 = (
    """
    DO $$
    BEGIN
        ALTER TABLE messages ALTER COLUMN body SET COMPRESSION lz4;
    EXCEPTION WHEN feature_not_supported OR syntax_error THEN
        RAISE NOTICE 'relay: lz4 is not available here; stored bodies keep pglz';
    END
    $$
    """,
)
PG_MIGRATIONS: dict[int, tuple[str, ...]] = {7: OUTBOX_TABLE, 12: BODY_LZ4}
