"""The spool's operations: plain synchronous functions over one SQLite connection.

Rules:
- Every function here runs inside a transaction its caller opened: the daemon's group-commit
  writer batches many of them under one `BEGIN IMMEDIATE ... COMMIT` (one fsync for all), the
  CLI runs one at a time under its own. So they never commit and never open one themselves.
- The spool stores states; it never decides them. Callers pass the new state, the spool
  applies it only from the states the transition table allows (a conditional UPDATE), so an
  operator's `hold` or `delete` racing with a delivery never resurrects or loses a recipient.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.delivery.lanes import LANE_PRIORITY
from relay.spool import db, dedup
from relay.spool.model import (
    DEAD,
    FINAL,
    UNFINISHED,
    WAITING,
    MsgState,
    RcptState,
    can_move,
    message_state,
    sources_for,
    sql_in,
)
from relay.spool.schema import (
    INTAKE_COLUMNS,
    INTAKE_LIVE,
    OUTCOME_CHANGED,
    OUTCOME_COLUMNS,
    outcome_set,
)
from relay.spool.schema import attempt_ends as _attempt_ends

_DUE = sql_in(WAITING)
# recipients_due's WHERE exactly as migration 0 spells it: SQLite uses a partial index only
# for a query whose WHERE contains that same term
_DUE_INDEXED = "('pending', 'deferred')"
assert set(_DUE_INDEXED.strip("()").replace("'", "").split(", ")) == {s.value for s in WAITING}
_IN_QUEUE = sql_in(WAITING | {RcptState.SENDING})


_GIVEN_BACK = _attempt_ends(f"'{RcptState.DEFERRED}'")  # a crash, a lease, a lost claim
_UNFINISHED = sql_in(UNFINISHED)


def new_queue_id(now: float | None = None) -> str:
    """16 upper-case hex digits: milliseconds since the epoch (11), then 20 bits of a counter
    (5). Sortable by arrival. The counter starts at a random point in each process (and
    again in a forked child) and goes up by one per id, so one process never makes the same
    id twice (it would take 2^20 ids in one millisecond); processes sharing a spool (inbound
    processes, a fleet's nodes) collide only where their counters meet in the same
    millisecond, and then the primary key refuses the second (the client gets 451 and
    retries). 20 random bits per id, as before, collide by the birthday rule: at bursts of
    ~9 ids in a millisecond, about one run of 10,000 messages in 25 got a 451 (one seen in a
    fleet drain's fill, bench/README.md)."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{ms << 20 | (next(_sequence) & 0xFFFFF):016X}"  # f"{ms:011X}{bits:05X}"


def _new_sequence() -> None:
    """A counter from a random start (os.urandom, as `secrets` would): next() on it is one
    C call, safe from two threads at once."""
    global _sequence
    _sequence = itertools.count(int.from_bytes(os.urandom(3), "big") >> 4)


_sequence: Iterator[int] = itertools.count()
_new_sequence()
os.register_at_fork(after_in_child=_new_sequence)  # a forked child never follows our ids


# --- accepting ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewRecipient:
    address: str
    destination: str
    dedup_key: str
    content_hash: str | None = None  # with an Idempotency-Key: what the key stands for
    # with a Message-ID key: the content fingerprint (relay/spool/dedup.py), stored with the key;
    # None (an Idempotency-Key, the outbox, a DSN) keeps the plain rule: a hit is a duplicate
    fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class NewMessage:
    queue_id: str
    message_id: str
    sender: str
    size: int
    created_at: float
    client: str
    peer: str
    lane: str
    lane_prio: int
    identity: str
    body: bytes | None
    body_path: str | None
    recipients: tuple[NewRecipient, ...]
    listener: str | None = None  # the listener's name, for routes


@dataclass(frozen=True, slots=True)
class AcceptResult:
    queue_id: str | None  # None when every recipient was a duplicate
    queued: tuple[str, ...]
    duplicates: tuple[str, ...]
    conflicts: tuple[str, ...] = ()  # same Idempotency-Key, other content: nothing queued
    # queued although their Message-ID key was live: another content reused the Message-ID;
    # (recipient, the queue id that took the key first)
    reused: tuple[tuple[str, str], ...] = ()


def accept(conn: sqlite3.Connection, msg: NewMessage, dedup_window: float) -> AcceptResult:
    """Queue the recipients whose dedup key was not seen within the window. A key seen with
    another content hash (an Idempotency-Key reused for other content) queues nothing. A
    Message-ID key seen with another content fingerprint is not a duplicate: the recipient
    is queued under the key's variant for its fingerprint (a duplicate if that is live too)
    and reported in `reused`."""
    cutoff = msg.created_at - dedup_window
    fresh: list[tuple[NewRecipient, str]] = []  # with the key to take
    dupes: list[str] = []
    conflicts: list[str] = []
    reused: dict[str, str] = {}
    seen: set[str] = set()
    # every recipient's key in one statement (a message to 5 is not 5 round trips)
    wanted = list(dict.fromkeys(r.dedup_key for r in msg.recipients))
    rows: dict[str, tuple[Any, ...]] = (
        {
            row[0]: tuple(row[1:])
            for row in conn.execute(
                "SELECT key, created_at, content_hash, msg_id, fingerprint FROM dedup"
                f" WHERE key IN ({','.join('?' * len(wanted))})",
                wanted,
            )
        }
        if wanted
        else {}
    )
    for r in msg.recipients:
        if r.dedup_key in seen:
            dupes.append(r.address)
            continue
        seen.add(r.dedup_key)
        row = rows.get(r.dedup_key)
        if row is None or row[0] <= cutoff:
            fresh.append((r, r.dedup_key))
        elif r.content_hash is not None and row[1] is not None and row[1] != r.content_hash:
            conflicts.append(r.address)
        elif r.content_hash is None and r.fingerprint and row[3] and row[3] != r.fingerprint:
            # README "Dedup": same Message-ID, other content: a new message, never dropped
            variant = dedup.variant_key(r.dedup_key, r.fingerprint)
            seen_as = conn.execute(
                "SELECT created_at FROM dedup WHERE key = ?", (variant,)
            ).fetchone()
            if seen_as is not None and seen_as[0] > cutoff:
                dupes.append(r.address)  # a resubmission of that other message
            else:
                fresh.append((r, variant))
                reused[r.address] = str(row[2])
        else:
            dupes.append(r.address)
    if conflicts:
        return AcceptResult(None, (), tuple(dupes), tuple(conflicts))
    if not fresh:
        return AcceptResult(None, (), tuple(dupes))
    # Take the keys before queueing: on a database a fleet shares, another node may have
    # taken one since the read above. Its INSERT waits on ours (or ours on its) at the
    # unique key; the loser finds a live key, writes nothing and reports a duplicate.
    # one statement takes them all, in key order (one lock order for every node of a
    # fleet); RETURNING says which it took
    fresh.sort(key=lambda rk: rk[1])
    took: set[str] = {
        row[0]
        for row in conn.execute(
            "INSERT INTO dedup (key, msg_id, created_at, content_hash, fingerprint) VALUES "
            + ",".join(["(?,?,?,?,?)"] * len(fresh))
            + " ON CONFLICT (key) DO UPDATE SET msg_id = excluded.msg_id,"
            " created_at = excluded.created_at, content_hash = excluded.content_hash,"
            " fingerprint = excluded.fingerprint"
            " WHERE dedup.created_at <= ? RETURNING key",
            [
                *(
                    v
                    for r, key in fresh
                    for v in (key, msg.queue_id, msg.created_at, r.content_hash, r.fingerprint)
                ),
                cutoff,
            ],
        ).fetchall()
    }
    fresh_rcpts: list[NewRecipient] = []
    by_address = {r.address: (r, key) for r, key in fresh}
    for r in msg.recipients:  # in the message's order, as before
        hit = by_address.pop(r.address, None)
        if hit is None:
            continue
        if hit[1] in took:
            fresh_rcpts.append(r)
        else:
            dupes.append(r.address)
            reused.pop(r.address, None)
    if not fresh_rcpts:
        return AcceptResult(None, (), tuple(dupes))
    conn.execute(
        "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer, lane,"
        " identity, body, body_path, listener) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            msg.queue_id,
            msg.message_id,
            msg.sender,
            msg.size,
            msg.created_at,
            msg.client,
            msg.peer,
            msg.lane,
            msg.identity,
            msg.body,
            msg.body_path,
            msg.listener,
        ),
    )
    conn.executemany(
        "INSERT INTO recipients (msg_id, address, destination, lane_prio, state, attempts,"
        " next_attempt_at, dedup_key, updated_at) VALUES (?,?,?,?,?,0,?,?,?)",
        [
            (
                msg.queue_id,
                r.address,
                r.destination,
                msg.lane_prio,
                RcptState.PENDING.value,
                msg.created_at,
                r.dedup_key,
                msg.created_at,
            )
            for r in fresh_rcpts
        ],
    )
    return AcceptResult(
        msg.queue_id,
        tuple(r.address for r in fresh_rcpts),
        tuple(dupes),
        reused=tuple((r.address, reused[r.address]) for r in fresh_rcpts if r.address in reused),
    )


# accept_many's one statement: take every key (RETURNING which were taken) and, only if
# all of them were, insert the messages and their recipients (whose foreign key is checked
# at the statement's end, when the messages are there)
_ACCEPT_MANY = (
    "WITH t AS (INSERT INTO dedup (key, msg_id, created_at, content_hash, fingerprint)"
    " SELECT * FROM unnest(?::text[], ?::text[], ?::double precision[], ?::text[], ?::text[])"
    " ON CONFLICT (key) DO UPDATE SET msg_id = excluded.msg_id,"
    " created_at = excluded.created_at, content_hash = excluded.content_hash,"
    " fingerprint = excluded.fingerprint"
    " WHERE dedup.created_at <= excluded.created_at - ? RETURNING key),"
    " ok AS (SELECT count(*) = ? AS all_taken FROM t),"
    " m AS (INSERT INTO messages (id, message_id, sender, size, created_at, client, peer, lane,"
    " identity, body, body_path, listener) SELECT * FROM unnest(?::text[], ?::text[],"
    " ?::text[], ?::bigint[], ?::double precision[], ?::text[], ?::text[], ?::text[],"
    " ?::text[], ?::bytea[], ?::text[], ?::text[]) WHERE (SELECT all_taken FROM ok)),"
    " r AS (INSERT INTO recipients (msg_id, address, destination, lane_prio, state, attempts,"
    " next_attempt_at, dedup_key, updated_at) SELECT u.msg_id, u.address, u.destination,"
    f" u.lane_prio, '{RcptState.PENDING}', 0, u.at, u.dedup_key, u.at"
    " FROM unnest(?::text[], ?::text[], ?::text[], ?::integer[], ?::double precision[],"
    " ?::text[]) AS u(msg_id, address, destination, lane_prio, at, dedup_key)"
    " WHERE (SELECT all_taken FROM ok))"
    " SELECT key FROM t"
)


def accept_many(
    conn: sqlite3.Connection, items: Sequence[tuple[NewMessage, float]]
) -> list[AcceptResult]:
    """`accept` of several (message, dedup window) pairs, with the results they would have
    had accepted one after the other in this order (the writer's group of a batch,
    relay/spool/writer.py). The common case, where every key of the batch is
    new (or expired), is one statement whatever their number: take every key, and if every
    one was taken, insert the messages and their recipients. Otherwise (a key live within
    the window: a duplicate, an Idempotency-Key conflict, a Message-ID reused for other
    content, README "Dedup"; or one another node took meanwhile) that statement is rolled
    back to its savepoint and the batch runs as `accept` one by one, so those decisions live
    in one place; so does a batch with a key twice, with windows that differ or with a
    message without recipients. SQLite: the same rule, in one statement of its own
    (`_accept_many_sqlite`)."""
    if db.dialect(conn) != "postgresql":
        return _accept_many_sqlite(conn, items)
    windows = {w for _m, w in items}
    if len(windows) != 1:
        return [accept(conn, m, w) for m, w in items]
    window = windows.pop()
    # key -> (queue id, at, content hash, fingerprint)
    takes: dict[str, tuple[str, float, str | None, str | None]] = {}
    for msg, _w in items:
        if not msg.recipients:
            return [accept(conn, m, w) for m, w in items]
        for r in msg.recipients:
            if r.dedup_key in takes:  # twice in the batch: `accept` decides
                return [accept(conn, m, w) for m, w in items]
            takes[r.dedup_key] = (msg.queue_id, msg.created_at, r.content_hash, r.fingerprint)
    order = sorted(takes)  # one lock order for every node (a fleet's inserts never cross)
    msgs = [m for m, _w in items]
    rcpts = [(m, r) for m in msgs for r in m.recipients]
    conn.execute("SAVEPOINT take")  # sent with the statement (relay/spool/pg.py DEFERRED)
    taken = conn.execute(
        _ACCEPT_MANY,
        (
            order,
            [takes[k][0] for k in order],
            [takes[k][1] for k in order],
            [takes[k][2] for k in order],
            [takes[k][3] for k in order],
            window,
            len(order),
            [m.queue_id for m in msgs],
            [m.message_id for m in msgs],
            [m.sender for m in msgs],
            [m.size for m in msgs],
            [m.created_at for m in msgs],
            [m.client for m in msgs],
            [m.peer for m in msgs],
            [m.lane for m in msgs],
            [m.identity for m in msgs],
            [m.body for m in msgs],
            [m.body_path for m in msgs],
            [m.listener for m in msgs],
            [m.queue_id for m, _r in rcpts],
            [r.address for _m, r in rcpts],
            [r.destination for _m, r in rcpts],
            [m.lane_prio for m, _r in rcpts],
            [m.created_at for m, _r in rcpts],
            [r.dedup_key for _m, r in rcpts],
        ),
    ).fetchall()
    if len(taken) != len(order):  # a key is live: nothing of the batch stays written
        conn.execute("ROLLBACK TO take")
        return [accept(conn, m, w) for m, w in items]
    return [AcceptResult(m.queue_id, tuple(r.address for r in m.recipients), ()) for m in msgs]


# host parameters per statement where the SQLite library cannot say (`_sqlite_params`): its
# default limit before 3.32, so any build takes it
_SQLITE_PARAMS = 999


def _accept_many_sqlite(
    conn: sqlite3.Connection, items: Sequence[tuple[NewMessage, float]]
) -> list[AcceptResult]:
    """`accept_many` on SQLite: all of the batch or nothing (the writer runs it without a
    savepoint of its own: `Grouped(atomic=True)`, relay/spool/writer.py). The common case,
    every key new or expired and one window, is one INSERT into the connection's `intake`
    view (relay/spool/schema.py): a row per recipient, whose trigger takes the key and queues
    the message and the recipient. When a key is live within the window or is twice in the
    batch, the trigger RAISEs, SQLite backs the statement out whole, and the batch runs as
    `accept` one by one, so those decisions (a duplicate, an Idempotency-Key conflict, a
    Message-ID reused for other content: README "Dedup") live in one place; so does a batch
    with windows that differ. A batch past one statement's parameters (hundreds of
    recipients) is several statements under a savepoint."""
    windows = {w for _m, w in items}
    if len(windows) != 1:
        return _accept_each(conn, items)
    window = windows.pop()
    rows = [
        (
            r.dedup_key,
            m.queue_id,
            m.created_at,
            r.content_hash,
            r.fingerprint,
            window,
            i == 0,
            m.message_id,
            m.sender,
            m.size,
            m.client,
            m.peer,
            m.lane,
            m.identity,
            m.body if i == 0 else None,  # the message's row: bound once, not per recipient
            m.body_path,
            m.listener,
            r.address,
            r.destination,
            m.lane_prio,
        )
        for m, _w in items
        for i, r in enumerate(m.recipients)
    ]
    try:
        _into_view(conn, "intake", INTAKE_COLUMNS, rows)
    except sqlite3.IntegrityError as e:
        if INTAKE_LIVE not in str(e):
            raise  # a queue id taken twice (new_queue_id): the writer fails that job alone
        return _accept_each(conn, items)
    return [
        AcceptResult(m.queue_id, tuple(r.address for r in m.recipients), ())
        if m.recipients
        else AcceptResult(None, (), ())
        for m, _w in items
    ]


@functools.lru_cache(maxsize=128)
def _view_sql(view: str, width: int, rows: int) -> str:
    return f"INSERT INTO {view} VALUES " + ",".join(["(" + ",".join("?" * width) + ")"] * rows)


def _into_view(
    conn: sqlite3.Connection, view: str, columns: tuple[str, ...], rows: Sequence[tuple[Any, ...]]
) -> None:
    """`rows` into one of the connection's TEMP views (relay/spool/schema.py), whose trigger
    writes the tables: one statement, all or nothing; past one statement's parameters
    (hundreds of recipients) several under a savepoint, all or nothing too."""
    per = max(1, _sqlite_params(conn) // len(columns))
    if len(rows) <= per:
        if rows:
            conn.execute(_view_sql(view, len(columns), len(rows)), [v for r in rows for v in r])
        return
    with db.savepoint(conn, view):
        for i in range(0, len(rows), per):
            chunk = rows[i : i + per]
            conn.execute(_view_sql(view, len(columns), len(chunk)), [v for r in chunk for v in r])


def _sqlite_params(conn: sqlite3.Connection) -> int:
    """Host parameters one statement may have on this connection's SQLite (999 before
    3.32, 32,766 since)."""
    try:
        return int(conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    except (AttributeError, sqlite3.Error):
        return _SQLITE_PARAMS


def _accept_each(
    conn: sqlite3.Connection, items: Sequence[tuple[NewMessage, float]]
) -> list[AcceptResult]:
    """`accept` of each, in order, all or nothing (a savepoint: see `_accept_many_sqlite`)."""
    with db.savepoint(conn, "accept_each"):
        return [accept(conn, m, w) for m, w in items]


# --- claiming and recording -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claim:
    rcpt_id: int
    msg_id: str
    address: str
    destination: str
    attempts: int
    created_at: float
    lane: str
    identity: str
    dedup_key: str = ""


def claim_due(
    conn: sqlite3.Connection,
    now: float,
    limit: int,
    skip: Sequence[tuple[int, str | None]] = (),
    waiting: Sequence[tuple[int, str | None]] = (),
    expired_before: float = float("-inf"),
    owner: str | None = None,
    lease_until: float | None = None,
    envelopes: dict[str, Envelope] | None = None,
) -> list[Claim]:
    """Mark up to `limit` due recipients `sending`, transactional lane first. `skip` lists
    (lane priority, recipient domain) pairs not to claim now (a domain of None: every
    domain): the engine's queue for them is full, and claiming more would only park
    recipients in memory while other destinations wait (head-of-line blocking).
    `waiting` lists pairs whose destination takes no attempt now (circuit open,
    suspended): they stay in the spool untouched, rather than being claimed and written
    back each pass, except recipients older than `expired_before` (retry.max_age), which
    are claimed so that they fail as dead letters on time.

    A claim is a lease: `owner` (the node) holds it until `lease_until`, renewed while it
    works (renew_leases). On PostgreSQL the rows are selected FOR UPDATE SKIP LOCKED: the
    nodes of a fleet claim disjoint recipients without waiting for each other.

    `envelopes`: filled with the claimed messages' envelopes (load_envelopes), which
    PostgreSQL reads in the claim's own statement."""
    where = ""
    params: list[Any] = [now]
    closed = {p for p, d in [*skip, *waiting] if d is None}
    if closed >= set(LANE_PRIORITY.values()) and expired_before == float("-inf"):
        return []  # every lane waits or is full: nothing to claim
    for prio, domain in skip:
        if domain is None:
            where += " AND r.lane_prio != ?"
            params.append(prio)
        else:
            where += " AND NOT (r.lane_prio = ? AND r.destination = ?)"
            params.extend((prio, domain))
    for prio, domain in waiting:
        if domain is None:
            where += " AND NOT (r.lane_prio = ? AND coalesce(r.retry_base, m.created_at) > ?)"
            params.extend((prio, expired_before))
        else:
            where += (
                " AND NOT (r.lane_prio = ? AND r.destination = ?"
                " AND coalesce(r.retry_base, m.created_at) > ?)"
            )
            params.extend((prio, domain, expired_before))
    # one range of the recipients_due index per lane, in lane order: the partial index is
    # used only when the query spells its WHERE the same way, and without it every claim
    # scanned and sorted every due recipient (34 ms per claim, in the writer, at 100,000)
    full = {p for p, d in skip if d is None}
    if expired_before == float("-inf"):
        full |= {p for p, d in waiting if d is None}
    lanes = sorted(set(LANE_PRIORITY.values()) - full)
    if db.dialect(conn) == "postgresql":
        return _claim_pg(conn, lanes, where, params, limit, now, owner, lease_until, envelopes)
    rows: list[Any] = []
    for prio in lanes:
        if len(rows) >= limit:
            break
        rows += conn.execute(
            _CLAIM_SELECT.format(cols="") + where + " ORDER BY r.next_attempt_at LIMIT ?",
            [prio, *params, limit - len(rows)],
        ).fetchall()
    if not rows:
        return []
    conn.execute(  # one statement for the claim (each is a few releases of the GIL)
        f"UPDATE recipients SET state = '{RcptState.SENDING}', hold_after = 0, updated_at = ?,"
        " lease_owner = ?, lease_until = ? WHERE id IN (SELECT value FROM json_each(?))",
        (now, owner, lease_until, json.dumps([r[0] for r in rows])),
    )
    if envelopes is not None:
        envelopes.update(load_envelopes(conn, {r[1] for r in rows}))
    return [Claim(*r) for r in rows]


_CLAIM_SELECT = (
    "SELECT r.id, r.msg_id, r.address, r.destination, r.attempts,"
    " coalesce(r.retry_base, m.created_at) AS base, m.lane,"
    " m.identity, r.dedup_key{cols} FROM recipients r INDEXED BY recipients_due"
    " JOIN messages m ON m.id = r.msg_id"
    f" WHERE r.state IN {_DUE_INDEXED} AND r.lane_prio = ? AND r.next_attempt_at <= ?"
)
# the envelope's columns (load_envelopes), read by PostgreSQL's claim
_ENVELOPE_COLS = (
    ", m.message_id, m.sender, m.size, m.body, m.body_path, m.delay_warned_at, m.client, m.listener"
)


def _claim_pg(
    conn: sqlite3.Connection,
    lanes: list[int],
    where: str,
    params: list[Any],
    limit: int,
    now: float,
    owner: str | None,
    lease_until: float | None,
    envelopes: dict[str, Envelope] | None,
) -> list[Claim]:
    """claim_due on PostgreSQL: one statement (one round trip) for every lane and, with
    `envelopes`, the envelopes of the claimed messages. Lane by lane (a CTE each, each
    lane's LIMIT what the lanes before it left), the rows taken FOR UPDATE SKIP LOCKED,
    marked `sending` and returned in the order of the selects; a message's body comes in
    the first of its rows only."""
    if not lanes:
        return []
    ctes: list[str] = []
    args: list[Any] = []
    cols = _ENVELOPE_COLS if envelopes is not None else ""
    for k, prio in enumerate(lanes):
        left = "".join(f" - (SELECT count(*) FROM c{j})" for j in range(k))
        ctes.append(
            f"c{k} AS ("
            + _CLAIM_SELECT.format(cols=cols)
            + where
            + f" ORDER BY r.next_attempt_at LIMIT greatest(?{left}, 0) FOR UPDATE OF r SKIP LOCKED)"
        )
        args += [prio, *params, limit]
    union = " UNION ALL ".join(
        f"SELECT {k} AS k, row_number() OVER () AS n, c{k}.* FROM c{k}" for k in range(len(lanes))
    )
    env = (
        ", message_id, sender, size, CASE WHEN row_number() OVER (PARTITION BY msg_id"
        " ORDER BY k, n) = 1 THEN body END, body_path, delay_warned_at, client, listener"
        if envelopes is not None
        else ""
    )
    # each lane's rows marked by an UPDATE of their own: joined with one lane's CTE (whose
    # LIMIT a generic plan estimates at one row), the rows are found by the primary key
    # whatever the size of the spool when the plan was made; joined with the union of the
    # lanes (two rows), a generic plan made while the spool was small used a hash join over a
    # Seq Scan of every recipient, for good (bench/README.md, Issue 31)
    marks = "".join(
        f", u{k} AS (UPDATE recipients SET state = '{RcptState.SENDING}', hold_after = 0,"
        f" updated_at = ?, lease_owner = ?, lease_until = ? FROM c{k}"
        f" WHERE recipients.id = c{k}.id)"
        for k in range(len(lanes))
    )
    rows = conn.execute(
        "WITH " + ", ".join(ctes) + marks + f", c AS ({union})"
        " SELECT id, msg_id, address, destination, attempts, base, lane, identity, dedup_key"
        + env
        + " FROM c ORDER BY k, n",
        [*args, *[now, owner, lease_until] * len(lanes)],
    ).fetchall()
    if envelopes is not None:
        for r in rows:
            if r[1] not in envelopes:
                envelopes[r[1]] = Envelope(r[1], *r[9:])
    return [Claim(*r[:9]) for r in rows]


def renew_leases(conn: sqlite3.Connection, owner: str, until: float) -> int:
    """Extend every claim `owner` holds to `until` (its heartbeat), and its ceiling holds."""
    conn.execute("UPDATE ceiling_holds SET until = ? WHERE node = ?", (until, owner))
    return conn.execute(
        f"UPDATE recipients SET lease_until = ? WHERE lease_owner = ?"
        f" AND state = '{RcptState.SENDING}'",
        (until, owner),
    ).rowcount


def release_unclaimed(
    conn: sqlite3.Connection, owner: str, passes: Sequence[float], now: float
) -> int:
    """`owner`'s claims made by the claim passes whose `now` is in `passes` (each pass
    stamps it in `updated_at`) and whose commit `owner` never heard of: it never dispatched
    them, so they are due again (relay/delivery/engine.py's rules)."""
    marks = ", ".join("?" * len(passes))
    return conn.execute(
        f"UPDATE recipients SET {_GIVEN_BACK}, next_attempt_at = ?,"
        " updated_at = ?, reason = 'recovered: a claim whose commit was not confirmed',"
        " lease_owner = NULL, lease_until = NULL"
        f" WHERE state = '{RcptState.SENDING}' AND lease_owner = ? AND updated_at IN ({marks})",
        (now, now, owner, *passes),
    ).rowcount


def reclaim_expired(conn: sqlite3.Connection, now: float, owner: str, day: str) -> int:
    """Claims of other nodes whose lease ran out (the node died or lost the database) are
    due again. Never `owner`'s own: it renews them while it runs, so a late renewal of its
    own must not turn its work in flight into a second copy. The room such a node held
    under the daily ceilings counts as sent in window `day`: it may have sent before it
    died, and a fleet must never exceed a ceiling (the cost: up to its work in flight
    under-sent that day)."""
    dead = conn.execute(
        "SELECT node, scope, n FROM ceiling_holds WHERE until < ? AND node <> ?"
        " ORDER BY scope, node",  # daily_counts rows in scope order, as everywhere
        (now, owner),
    ).fetchall()
    for node, scope, n in dead:
        if n > 0:
            conn.execute(
                "INSERT INTO daily_counts (scope, day, count) VALUES (?, ?, ?)"
                " ON CONFLICT (scope, day) DO UPDATE SET count = daily_counts.count + ?",
                (scope, day, n, n),
            )
        conn.execute("DELETE FROM ceiling_holds WHERE node = ? AND scope = ?", (node, scope))
    return conn.execute(
        f"UPDATE recipients SET {_GIVEN_BACK}, next_attempt_at = ?,"
        " updated_at = ?, reason = 'recovered: lease of ' || coalesce(lease_owner, '?')"
        " || ' expired', lease_owner = NULL, lease_until = NULL"
        f" WHERE state = '{RcptState.SENDING}' AND lease_until < ?"
        " AND (lease_owner IS NULL OR lease_owner <> ?)",
        (now, now, now, owner),
    ).rowcount


@dataclass(frozen=True, slots=True)
class Envelope:
    msg_id: str
    message_id: str
    sender: str
    size: int
    body: bytes | None
    body_path: str | None
    delay_warned_at: float | None = None  # the once-per-message delay warning went out
    client: str = ""  # the dedup namespace: listener:NAME or user:LOGIN
    listener: str | None = None


def load_envelopes(conn: sqlite3.Connection, msg_ids: Iterable[str]) -> dict[str, Envelope]:
    ids = list(set(msg_ids))
    out: dict[str, Envelope] = {}
    if db.dialect(conn) == "postgresql":  # one text for any number, planned per call
        for row in conn.execute(
            db.CUSTOM_PLAN
            + "SELECT id, message_id, sender, size, body, body_path, delay_warned_at, client,"
            " listener FROM messages WHERE id = ANY(?::text[])",
            (ids,),
        ):
            out[row[0]] = Envelope(*row)
        return out
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        q = ",".join("?" * len(chunk))
        for row in conn.execute(
            f"SELECT id, message_id, sender, size, body, body_path, delay_warned_at, client,"
            f" listener FROM messages"
            f" WHERE id IN ({q})",
            chunk,
        ):
            out[row[0]] = Envelope(*row)
    return out


@dataclass(frozen=True, slots=True)
class AttemptLog:
    outcome: str
    reply: str | None
    destination: str
    host: str | None
    duration: float | None


@dataclass(frozen=True, slots=True)
class RcptUpdate:
    """What one attempt did to one recipient, as decided by the delivery engine."""

    rcpt_id: int
    msg_id: str
    state: RcptState
    count_attempt: bool  # False for shaping/circuit deferrals: they burn no attempt
    next_attempt_at: float | None
    last_reply: str | None
    reason: str | None = None
    log: AttemptLog | None = None
    suppress: tuple[str, str] | None = None  # (address, reason)
    counters: tuple[str, ...] = field(default=())  # daily_counts scopes to bump (with day)
    upstream_id: str | None = None  # the id the upstream gave at its 250 (delivered)


def record(
    conn: sqlite3.Connection,
    outcomes: Sequence[RcptUpdate],
    now: float,
    day: str | None = None,
    owner: str | None = None,
) -> int:
    """Apply outcomes of claimed recipients; returns how many rows changed. With `owner`,
    only over claims that node still holds: a node whose lease expired (and whose
    recipients another node may have claimed since) never records over someone else's.
    PostgreSQL: as `record_many` (a few statements for any number of outcomes)."""
    if db.dialect(conn) == "postgresql":
        return record_many(conn, [(outcomes, now, day)], owner)[0]
    return _record_each(conn, outcomes, now, day, owner)


# an outcome onto its recipient, if that is still `sending`, one outcome at a time
# (`_record_each`; a batch's records on SQLite go through the `outcome` view, whose trigger
# uses the same `outcome_set`); `_HELD` added when the claim has an owner. A `deferred`
# outcome of a recipient held during its attempt makes it `held`.
_RECORD_UPDATE = (
    f"UPDATE recipients SET {outcome_set(*'???????')}"  # the state's ? is read twice
    f" WHERE id = ? AND state = '{RcptState.SENDING}'"
)
# (a claim with no owner is one made before leases: nobody else holds it)
_HELD = " AND (lease_owner = ? OR lease_owner IS NULL)"


def _outcome_values(o: RcptUpdate, now: float) -> tuple[Any, ...]:
    """An outcome's values in `outcome_set`'s order (relay/spool/schema.py)."""
    return (
        o.state.value,
        1 if o.count_attempt else 0,
        o.next_attempt_at,
        o.last_reply,
        o.reason,
        now,
        o.upstream_id,
    )


def _record_update_args(o: RcptUpdate, now: float, owner: str | None) -> tuple[Any, ...]:
    return (
        o.state.value,  # attempt_ends('?') reads it twice
        *_outcome_values(o, now),
        o.rcpt_id,
        *(() if owner is None else (owner,)),
    )


def _record_each(
    conn: sqlite3.Connection,
    outcomes: Sequence[RcptUpdate],
    now: float,
    day: str | None,
    owner: str | None,
) -> int:
    """`record`, one outcome after the other (SQLite: no round trips to save)."""
    changed = 0
    held = "" if owner is None else _HELD
    # the counters every node bumps (the fleet's hot rows) go last, summed, in one order:
    # daily_counts by scope, then identity_hours; a node that locks them in another
    # order than its peer deadlocks with it (relay/spool/ops.py ceiling_take locks
    # daily_counts too)
    bumps: dict[str, int] = {}
    delivered_ids: list[str] = []
    for o in outcomes:
        if not can_move(RcptState.SENDING, o.state):  # the one transition table decides
            raise ValueError(f"an attempt cannot make a recipient {o.state}")
        cur = conn.execute(_RECORD_UPDATE + held, _record_update_args(o, now, owner))
        changed += cur.rowcount
        if cur.rowcount == 0:
            continue  # deleted or changed by an operator meanwhile
        if o.state is RcptState.DELIVERED:  # the denominator of bounce and complaint rates
            delivered_ids.append(o.msg_id)
        if o.log is not None:
            conn.execute(
                "INSERT INTO attempts (msg_id, rcpt_id, at, destination, host, outcome, reply,"
                " duration) VALUES (?,?,?,?,?,?,?,?)",
                (
                    o.msg_id,
                    o.rcpt_id,
                    now,
                    o.log.destination,
                    o.log.host,
                    o.log.outcome,
                    o.log.reply,
                    o.log.duration,
                ),
            )
        if o.suppress is not None:
            conn.execute(
                "INSERT INTO suppression (address, scope, reason, created_at, source)"
                " VALUES (?,'',?,?,'smtp') ON CONFLICT DO NOTHING",
                (o.suppress[0].lower(), o.suppress[1], now),
            )
        for scope in o.counters:
            bumps[scope] = bumps.get(scope, 0) + 1
    for scope in sorted(bumps):
        conn.execute(
            "INSERT INTO daily_counts (scope, day, count) VALUES (?, ?, ?)"
            " ON CONFLICT (scope, day) DO UPDATE SET count = daily_counts.count + ?",
            (scope, day or "", bumps[scope], bumps[scope]),
        )
    per_identity: dict[str, int] = {}
    for i in range(0, len(delivered_ids), 500):
        chunk = delivered_ids[i : i + 500]
        marks = ",".join("?" * len(chunk))
        by_id = dict(
            conn.execute(
                f"SELECT id, identity FROM messages WHERE id IN ({marks})", chunk
            ).fetchall()
        )
        for mid in chunk:
            if mid in by_id:
                per_identity[by_id[mid]] = per_identity.get(by_id[mid], 0) + 1
    add_counts = getattr(conn, "add_counts", None)  # PostgreSQL: with the COMMIT
    for identity in sorted(per_identity):
        n = per_identity[identity]
        if add_counts is not None:
            add_counts("identity_hours", (identity, int(now // 3600)), node=owner, delivered=n)
            continue
        conn.execute(
            "INSERT INTO identity_hours (identity, hour, delivered) VALUES (?, ?, ?)"
            " ON CONFLICT (identity, hour) DO UPDATE SET delivered = identity_hours.delivered + ?",
            (identity, int(now // 3600), n, n),
        )
    return changed


# `(state = 'sending') IS TRUE`, not `state = 'sending'`: the same test, but not one an index
# answers, so the rows are found by their ids (the primary key). Written plainly, PostgreSQL
# planned a scan of every recipient in flight through recipients_waiting (state is its
# first column) for each record, whatever their number: 3.5 ms against 0.7 ms per record
# of 20 outcomes with 400 in flight (bench/pg_writer.py, pg_stat_statements).
_RECORD_MANY = (
    f"UPDATE recipients r SET {_attempt_ends('u.state')}, attempts = r.attempts + u.inc,"
    " next_attempt_at = u.next_at, last_reply = coalesce(u.reply, r.last_reply),"
    " reason = u.reason, updated_at = u.at, upstream_id = coalesce(u.upstream_id, r.upstream_id),"
    " lease_owner = NULL, lease_until = NULL"
    " FROM unnest(?::bigint[], ?::text[], ?::integer[], ?::double precision[], ?::text[],"
    " ?::text[], ?::double precision[], ?::text[])"
    " AS u(id, state, inc, next_at, reply, reason, at, upstream_id)"
    f" WHERE r.id = u.id AND (r.state = '{RcptState.SENDING}') IS TRUE"
)
# the attempt log of the outcomes the UPDATE applied, in the same statement (a CTE: no
# round trip of its own), in the outcomes' order
_RECORD_LOG = (
    " a AS (INSERT INTO attempts (msg_id, rcpt_id, at, destination, host, outcome, reply,"
    " duration) SELECT l.msg_id, l.rcpt_id, l.at, l.destination, l.host, l.outcome, l.reply,"
    " l.duration FROM unnest(?::text[], ?::bigint[], ?::double precision[], ?::text[],"
    " ?::text[], ?::text[], ?::text[], ?::double precision[]) WITH ORDINALITY"
    " AS l(msg_id, rcpt_id, at, destination, host, outcome, reply, duration, ord)"
    " WHERE l.rcpt_id IN (SELECT id FROM w) ORDER BY l.ord)"
)


def record_many(
    conn: sqlite3.Connection,
    calls: Sequence[tuple[Sequence[RcptUpdate], float, str | None]],
    owner: str | None = None,
    ceilings: Collection[str] | None = None,
) -> list[int]:
    """`record` of several (outcomes, now, day) calls, each with the count it would have
    returned alone. PostgreSQL: one statement for the UPDATE of every outcome (RETURNING
    what changed and its identity) and the attempt log of those it changed, then at most
    one INSERT each for the suppression list, the daily counters and the hourly delivered
    counts, instead of a few statements per outcome (each a round trip). The counters are
    summed and locked in `record`'s order. SQLite: the same in its own statements
    (`_record_many_sqlite`; a lone call as `record`). One recipient twice among the
    outcomes: `record` one call after the other.

    `ceilings`: the scopes among the counters that are under a fleet's daily ceiling (a
    claim later in the same transaction reads them, ceiling_take): counted here. The other
    counters (a destination without a ceiling, the identities' hours: the rows every node
    bumps) are counted in the COMMIT's round trip (pg.COUNTER_TABLES says why). None: all
    daily counters here."""
    flat = [(i, o, now, day) for i, (outs, now, day) in enumerate(calls) for o in outs]
    ids = [o.rcpt_id for _i, o, _n, _d in flat]
    pg = db.dialect(conn) == "postgresql"
    if len(set(ids)) != len(ids) or (not pg and len(calls) < 2):
        return [_record_each(conn, outs, now, day, owner) for outs, now, day in calls]
    for _i, o, _n, _d in flat:
        if not can_move(RcptState.SENDING, o.state):  # the one transition table decides
            raise ValueError(f"an attempt cannot make a recipient {o.state}")
    if not flat:
        return [0] * len(calls)
    if not pg:
        return _record_many_sqlite(conn, calls, flat, owner)
    counts = [0] * len(calls)
    held = "" if owner is None else " AND (r.lease_owner = ? OR r.lease_owner IS NULL)"
    params: list[Any] = [
        ids,
        [o.state.value for _i, o, _n, _d in flat],
        [1 if o.count_attempt else 0 for _i, o, _n, _d in flat],
        [o.next_attempt_at for _i, o, _n, _d in flat],
        [o.last_reply for _i, o, _n, _d in flat],
        [o.reason for _i, o, _n, _d in flat],
        [now for _i, _o, now, _d in flat],
        [o.upstream_id for _i, o, _n, _d in flat],
        *(() if owner is None else (owner,)),
    ]
    logs = [(o, now) for _i, o, now, _d in flat if o.log is not None]
    log_cte = ""
    if logs:
        log_cte = "," + _RECORD_LOG
        params += [
            [o.msg_id for o, _n in logs],
            [o.rcpt_id for o, _n in logs],
            [now for _o, now in logs],
            *(
                [getattr(o.log, f) for o, _n in logs]
                for f in ("destination", "host", "outcome", "reply", "duration")
            ),
        ]
    # one statement: the outcomes, and the attempt log of those applied (planned per call:
    # db.CUSTOM_PLAN)
    rows = conn.execute(
        db.CUSTOM_PLAN
        + "WITH w AS ("
        + _RECORD_MANY
        + held
        + " RETURNING r.id, (SELECT m.identity FROM messages m WHERE m.id = r.msg_id) AS identity)"
        + log_cte
        + " SELECT id, identity FROM w",
        params,
    ).fetchall()
    identity_of = {int(r[0]): r[1] for r in rows}
    done = [(i, o, now, day) for i, o, now, day in flat if o.rcpt_id in identity_of]
    supp = [(o.suppress, now) for _i, o, now, _d in done if o.suppress is not None]
    if supp:
        conn.execute(
            "INSERT INTO suppression (address, scope, reason, created_at, source)"
            " SELECT a, '', r, t, 'smtp' FROM unnest(?::text[], ?::text[],"
            " ?::double precision[]) AS s(a, r, t) ON CONFLICT DO NOTHING",
            (
                [sp[0].lower() for sp, _n in supp],
                [sp[1] for sp, _n in supp],
                [now for _sp, now in supp],
            ),
        )
    bumps: dict[tuple[str, str], int] = {}
    hours: dict[tuple[str, int], int] = {}
    for i, o, now, day in done:
        counts[i] += 1
        for scope in o.counters:
            bumps[(scope, day or "")] = bumps.get((scope, day or ""), 0) + 1
        if o.state is RcptState.DELIVERED and identity_of[o.rcpt_id] is not None:
            key = (identity_of[o.rcpt_id], int(now // 3600))
            hours[key] = hours.get(key, 0) + 1
    add_counts = getattr(conn, "add_counts", None)
    if add_counts is not None and ceilings is not None:
        for scope_day in [k for k in bumps if k[0] not in ceilings]:
            add_counts("daily_counts", scope_day, node=owner, count=bumps.pop(scope_day))
    if add_counts is not None:
        for hour_key, n in hours.items():
            add_counts("identity_hours", hour_key, node=owner, delivered=n)
        hours = {}
    if bumps:  # the fleet's hot rows: in one order (see record)
        order = sorted(bumps)
        conn.execute(
            "INSERT INTO daily_counts (scope, day, count) SELECT * FROM unnest(?::text[],"
            " ?::text[], ?::integer[]) ON CONFLICT (scope, day)"
            " DO UPDATE SET count = daily_counts.count + excluded.count",
            ([k[0] for k in order], [k[1] for k in order], [bumps[k] for k in order]),
        )
    if hours:
        order_h = sorted(hours)
        conn.execute(
            "INSERT INTO identity_hours (identity, hour, delivered) SELECT * FROM"
            " unnest(?::text[], ?::bigint[], ?::integer[]) ON CONFLICT (identity, hour)"
            " DO UPDATE SET delivered = identity_hours.delivered + excluded.delivered",
            ([k[0] for k in order_h], [k[1] for k in order_h], [hours[k] for k in order_h]),
        )
    return counts


def _record_many_sqlite(
    conn: sqlite3.Connection,
    calls: Sequence[tuple[Sequence[RcptUpdate], float, str | None]],
    flat: list[tuple[int, RcptUpdate, float, str | None]],
    owner: str | None,
) -> list[int]:
    """`record_many` on SQLite (the writer's group of a batch: one SAVEPOINT for the batch's
    records, relay/spool/writer.py): one SELECT of the recipients still `sending` (and held
    by `owner`) with their messages' identities, then one INSERT into the connection's
    `outcome` view (relay/spool/schema.py: its trigger updates the recipient and writes its
    attempt-log row) for every outcome, and one prepared statement each for the suppression
    list, the daily counters and the hourly delivered counts, instead of a few statements
    per outcome. `+r.state`: the recipients are found by their ids (the primary key), not
    by scanning every one in flight through recipients_waiting (what SQLite's planner
    chose: 41 µs per record of one outcome in groups of 5 with 3,000 in flight, against 14
    by id and 24 one by one). Every row ends as `record` one call after the other would
    leave it: the
    same outcomes applied, the attempt log in the same order (the same ids), the counters
    summed. The writer holds the write lock from its BEGIN IMMEDIATE on, so nothing
    changes a recipient between the read and the update; should one change all the same
    (or an outcome name another message than its recipient's), this raises and the writer
    rolls the group back and runs its jobs one by one (as `record`). `record_many` has
    checked every outcome's state against the transition table, and that there is one."""
    counts = [0] * len(calls)
    held = "" if owner is None else " AND (r.lease_owner = ? OR r.lease_owner IS NULL)"
    found: dict[int, tuple[str, str | None]] = {
        row[0]: (row[1], row[2])
        for row in conn.execute(
            "SELECT r.id, r.msg_id, m.identity FROM recipients r"
            " LEFT JOIN messages m ON m.id = r.msg_id"
            " WHERE r.id IN (SELECT value FROM json_each(?))"
            f" AND +r.state = '{RcptState.SENDING}'" + held,
            (
                json.dumps([o.rcpt_id for _i, o, _n, _d in flat]),
                *(() if owner is None else (owner,)),
            ),
        )
    }
    done = [(i, o, now, day) for i, o, now, day in flat if o.rcpt_id in found]
    for _i, o, _n, _d in done:
        if found[o.rcpt_id][0] != o.msg_id:  # `record` reads the outcome's message: it decides
            raise RuntimeError(f"recipient {o.rcpt_id} is not one of {o.msg_id}")
    rows = [  # `outcome`'s columns (relay/spool/schema.py)
        (
            o.rcpt_id,
            *_outcome_values(o, now),
            owner is not None,
            owner,
            lg is not None,
            o.msg_id,
            *(
                (None,) * 5
                if lg is None
                else (lg.destination, lg.host, lg.outcome, lg.reply, lg.duration)
            ),
        )
        for _i, o, now, _d in done
        for lg in (o.log,)
    ]
    try:
        _into_view(conn, "outcome", OUTCOME_COLUMNS, rows)
    except sqlite3.IntegrityError as e:
        if OUTCOME_CHANGED not in str(e):
            raise
        raise RuntimeError("a recipient changed between the read and the update") from e
    conn.executemany(
        "INSERT INTO suppression (address, scope, reason, created_at, source)"
        " VALUES (?,'',?,?,'smtp') ON CONFLICT DO NOTHING",
        [(o.suppress[0].lower(), o.suppress[1], now) for _i, o, now, _d in done if o.suppress],
    )
    bumps: dict[tuple[str, str], int] = {}
    hours: dict[tuple[str, int], int] = {}
    for i, o, now, day in done:
        counts[i] += 1
        for scope in o.counters:
            bumps[(scope, day or "")] = bumps.get((scope, day or ""), 0) + 1
        identity = found[o.rcpt_id][1]
        if o.state is RcptState.DELIVERED and identity is not None:
            key = (identity, int(now // 3600))
            hours[key] = hours.get(key, 0) + 1
    conn.executemany(  # in `record`'s order (the fleet's hot rows: see there)
        "INSERT INTO daily_counts (scope, day, count) VALUES (?, ?, ?)"
        " ON CONFLICT (scope, day) DO UPDATE SET count = daily_counts.count + excluded.count",
        [(k[0], k[1], bumps[k]) for k in sorted(bumps)],
    )
    conn.executemany(
        "INSERT INTO identity_hours (identity, hour, delivered) VALUES (?, ?, ?)"
        " ON CONFLICT (identity, hour) DO UPDATE"
        " SET delivered = identity_hours.delivered + excluded.delivered",
        [(k[0], k[1], hours[k]) for k in sorted(hours)],
    )
    return counts


# --- the fleet: nodes on one database ----------------------------------------------------


def heartbeat(
    conn: sqlite3.Connection,
    node: str,
    started_at: float,
    now: float,
    inflight: int,
    info: dict[str, Any],
) -> None:
    """`node` is alive at `now` with `inflight` recipients in flight."""
    conn.execute(
        "INSERT INTO nodes (name, started_at, heartbeat_at, inflight, info) VALUES (?,?,?,?,?)"
        " ON CONFLICT (name) DO UPDATE SET started_at = excluded.started_at,"
        " heartbeat_at = excluded.heartbeat_at, inflight = excluded.inflight,"
        " info = excluded.info",
        (node, started_at, now, inflight, json.dumps(info, sort_keys=True)),
    )


def node_gone(conn: sqlite3.Connection, node: str) -> None:
    """`node` stopped cleanly: its claims went back first, so its holds go too."""
    conn.execute("DELETE FROM ceiling_holds WHERE node = ?", (node,))
    conn.execute("DELETE FROM nodes WHERE name = ?", (node,))


def ceiling_take(
    conn: sqlite3.Connection,
    node: str,
    day: str,
    wants: dict[str, tuple[int, int]],
    until: float,
) -> dict[str, int]:
    """Room under fleet-wide daily ceilings: for each scope, `wants[scope]` = (limit,
    recipients wanted); grants up to that many so that the window's count plus every
    node's holds stays within the limit, and holds the grant for `node` (lease `until`).
    The scope's counter row is locked (FOR UPDATE on PostgreSQL; SQLite's writer is
    alone) so two nodes cannot both take the last room; scopes in sorted order, so two
    passes never wait on each other's locks."""
    lock = " FOR UPDATE" if db.dialect(conn) == "postgresql" else ""
    granted: dict[str, int] = {}
    for scope in sorted(wants):
        limit, want = wants[scope]
        conn.execute(
            "INSERT INTO daily_counts (scope, day, count) VALUES (?, ?, 0)"
            " ON CONFLICT (scope, day) DO NOTHING",
            (scope, day),
        )
        count = conn.execute(
            "SELECT count FROM daily_counts WHERE scope = ? AND day = ?" + lock, (scope, day)
        ).fetchone()[0]
        # and what nodes counted in their own rows (before the scope had its ceiling)
        count += conn.execute(
            "SELECT coalesce(sum(count), 0) FROM daily_counts_node WHERE scope = ? AND day = ?",
            (scope, day),
        ).fetchone()[0]
        held = conn.execute(
            "SELECT coalesce(sum(n), 0) FROM ceiling_holds WHERE scope = ?", (scope,)
        ).fetchone()[0]
        g = max(0, min(want, limit - int(count) - int(held)))
        granted[scope] = g
        if g:
            conn.execute(
                "INSERT INTO ceiling_holds (node, scope, n, until) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (node, scope) DO UPDATE SET n = ceiling_holds.n + ?,"
                " until = ?",
                (node, scope, g, until, g, until),
            )
    return granted


def ceiling_release(conn: sqlite3.Connection, node: str, scopes: dict[str, int]) -> None:
    """`node`'s work of `scopes[scope]` recipients ended (its deliveries are counted in the
    same commit) or was not dispatched: that room is no longer held."""
    for scope, n in scopes.items():
        conn.execute(
            "UPDATE ceiling_holds SET n = CASE WHEN n > ? THEN n - ? ELSE 0 END"
            " WHERE node = ? AND scope = ?",
            (n, n, node, scope),
        )
    conn.execute("DELETE FROM ceiling_holds WHERE node = ? AND n <= 0", (node,))


def live_nodes(conn: sqlite3.Connection, now: float, within: float) -> int:
    """How many nodes beat within the last `within` seconds (at least 1: the caller)."""
    row = conn.execute("SELECT count(*) FROM nodes WHERE heartbeat_at >= ?", (now - within,))
    return max(1, int(row.fetchone()[0]))


def list_nodes(conn: sqlite3.Connection, now: float, within: float) -> list[dict[str, Any]]:
    """Every node of the fleet, live or not, with its claims in flight (for the CLI)."""
    held = dict(
        conn.execute(
            f"SELECT lease_owner, count(*) FROM recipients WHERE state = '{RcptState.SENDING}'"
            " AND lease_owner IS NOT NULL GROUP BY lease_owner"
        ).fetchall()
    )
    out = []
    for name, started, beat, inflight, info in conn.execute(
        "SELECT name, started_at, heartbeat_at, inflight, info FROM nodes ORDER BY name"
    ):
        out.append(
            {
                "node": name,
                "alive": beat >= now - within,
                "started_at": iso_utc(started),
                "heartbeat_at": iso_utc(beat),
                "heartbeat_age": round(max(0.0, now - beat), 3),
                "inflight": int(inflight),
                "claims": int(held.get(name, 0)),
                **json.loads(info),
            }
        )
    return out


def prune_nodes(conn: sqlite3.Connection, now: float, older_than: float) -> int:
    return conn.execute("DELETE FROM nodes WHERE heartbeat_at < ?", (now - older_than,)).rowcount


def recover(conn: sqlite3.Connection, now: float, owner: str | None = None) -> int:
    """After a crash: every claim that never recorded an outcome is due again (`owner`
    None: every claim, for the one engine of a SQLite spool at its start), or only the
    claims `owner` holds (a node of a fleet giving its work back as it stops)."""
    mine = "" if owner is None else " AND lease_owner = ?"
    return conn.execute(
        f"UPDATE recipients SET {_GIVEN_BACK}, next_attempt_at = ?,"
        " updated_at = ?, reason = 'recovered after restart', lease_owner = NULL,"
        f" lease_until = NULL WHERE state = '{RcptState.SENDING}'" + mine,
        (now, now) if owner is None else (now, now, owner),
    ).rowcount


FEEDBACK_EVENT_DAYS = 30
# finished messages one prune job deletes: the daemon repeats the job while a batch comes
# back full (relay/daemon.py _prune), each its own writer job, so a backlog is worked off
# without holding the writer for more than one batch (~0.1 s) at a time
PRUNE_BATCH = 1000


def prune(
    conn: sqlite3.Connection,
    now: float,
    dedup_window: float,
    retention: float,
    limit: int = PRUNE_BATCH,
) -> list[str]:
    """Forget expired dedup keys, the side tables' old rows and (at most `limit`) finished
    messages older than `retention`; returns the body files to delete (after the commit)."""
    prune_side_tables(conn, now, dedup_window, retention)
    return prune_finished(conn, now, retention, limit)[1]


def prune_side_tables(
    conn: sqlite3.Connection, now: float, dedup_window: float, retention: float
) -> None:
    """Expired dedup keys and the side tables' rows past their horizons (one statement
    each, whatever their number)."""
    conn.execute("DELETE FROM dedup WHERE created_at < ?", (now - dedup_window,))
    conn.execute("DELETE FROM engine_commands WHERE at < ?", (now - 86400,))
    # feedback: events are remembered 30 days (a provider's redelivery stays a no-op), the
    # hourly rates 8 days, feedback mail as long as finished messages
    conn.execute("DELETE FROM feedback_events WHERE at < ?", (now - FEEDBACK_EVENT_DAYS * 86400,))
    conn.execute("DELETE FROM identity_hours WHERE hour < ?", (int(now // 3600) - 8 * 24,))
    conn.execute("DELETE FROM identity_hours_node WHERE hour < ?", (int(now // 3600) - 8 * 24,))
    conn.execute("DELETE FROM feedback_mail WHERE at < ?", (now - max(retention, 86400),))
    conn.execute(
        "DELETE FROM alerts WHERE sent_at IS NOT NULL AND sent_at < ?",
        (now - max(retention, 86400),),
    )


def prune_finished(
    conn: sqlite3.Connection, now: float, retention: float, limit: int
) -> tuple[int, list[str]]:
    """At most `limit` finished messages older than `retention` deleted: (how many, the
    body files to delete after the commit). Fewer than `limit`: none is left. On
    PostgreSQL the nodes of a fleet skip each other's batches (SKIP LOCKED) instead of
    waiting to delete the same rows."""
    finals = ",".join(f"'{s.value}'" for s in FINAL)
    lock = " FOR UPDATE OF m SKIP LOCKED" if db.dialect(conn) == "postgresql" else ""
    old = [
        r[0]
        for r in conn.execute(
            f"SELECT m.id FROM messages m WHERE m.created_at < ? AND NOT EXISTS (SELECT 1 FROM"
            f" recipients r WHERE r.msg_id = m.id AND r.state NOT IN ({finals})) LIMIT ?{lock}",
            (now - retention, limit),
        )
    ]
    return len(old), delete_messages(conn, old)


def finished_before(conn: sqlite3.Connection, cutoff: float) -> list[str]:
    """Messages every recipient of which is done, created before `cutoff`."""
    finals = ",".join(f"'{s.value}'" for s in FINAL)
    return [
        r[0]
        for r in conn.execute(
            f"SELECT m.id FROM messages m WHERE m.created_at < ? AND NOT EXISTS (SELECT 1 FROM"
            f" recipients r WHERE r.msg_id = m.id AND r.state NOT IN ({finals}))",
            (cutoff,),
        )
    ]


def delete_messages(conn: sqlite3.Connection, ids: Sequence[str]) -> list[str]:
    paths: list[str] = []
    if db.dialect(conn) == "postgresql":
        # three statements for any number (a prune's 5,000 were 20,000 round trips, seconds
        # during which the writer took no other job), the body paths in the order of `ids`
        ids = list(dict.fromkeys(ids))
        conn.execute(db.CUSTOM_PLAN + "DELETE FROM attempts WHERE msg_id = ANY(?::text[])", (ids,))
        conn.execute(
            db.CUSTOM_PLAN + "DELETE FROM recipients WHERE msg_id = ANY(?::text[])", (ids,)
        )
        gone = dict(
            conn.execute(
                db.CUSTOM_PLAN
                + "DELETE FROM messages WHERE id = ANY(?::text[]) RETURNING id, body_path",
                (ids,),
            ).fetchall()
        )
        return [gone[qid] for qid in ids if gone.get(qid)]
    for qid in ids:
        row = conn.execute("SELECT body_path FROM messages WHERE id = ?", (qid,)).fetchone()
        if row is None:
            continue
        if row[0]:
            paths.append(row[0])
        conn.execute("DELETE FROM attempts WHERE msg_id = ?", (qid,))
        conn.execute("DELETE FROM recipients WHERE msg_id = ?", (qid,))
        conn.execute("DELETE FROM messages WHERE id = ?", (qid,))
    return paths


def body_paths(conn: sqlite3.Connection) -> set[str]:
    return {
        r[0] for r in conn.execute("SELECT body_path FROM messages WHERE body_path IS NOT NULL")
    }


# --- daily counters, destinations, runtime view -------------------------------------------


def daily_counts(conn: sqlite3.Connection, day: str) -> dict[str, int]:
    """Each scope's count on `day`: its shared row and every node's own (daily_counts_node,
    relay/spool/pg.py COUNTER_TABLES)."""
    return {
        r[0]: int(r[1])
        for r in conn.execute(
            "SELECT scope, sum(count) FROM (SELECT scope, count FROM daily_counts WHERE day = ?"
            " UNION ALL SELECT scope, count FROM daily_counts_node WHERE day = ?) AS c"
            " GROUP BY scope",
            (day, day),
        )
    }


def suspensions(conn: sqlite3.Connection, now: float) -> dict[str, tuple[float, str]]:
    return {
        r[0]: (r[1], r[2] or "")
        for r in conn.execute(
            "SELECT name, suspended_until, reason FROM destinations WHERE suspended_until > ?",
            (now,),
        )
    }


def suspend_destination(conn: sqlite3.Connection, name: str, until: float, reason: str) -> None:
    conn.execute(
        "INSERT INTO destinations (name, suspended_until, reason) VALUES (?,?,?)"
        " ON CONFLICT (name) DO UPDATE SET suspended_until = excluded.suspended_until,"
        " reason = excluded.reason",
        (name.lower(), until, reason),
    )


def resume_destination(conn: sqlite3.Connection, name: str, now: float) -> int:
    name = name.lower()
    conn.execute("DELETE FROM destinations WHERE name = ?", (name,))
    # an upstream (a name without a dot: smarthost, primary...) may carry any recipient
    return conn.execute(
        "UPDATE recipients SET next_attempt_at = ?, reason = NULL, updated_at = ?"
        f" WHERE (destination = ? OR ? NOT LIKE '%.%') AND state = '{RcptState.DEFERRED}'"
        " AND reason IS NOT NULL",
        (now, now, name, name),
    ).rowcount


def engine_command(conn: sqlite3.Connection, action: str, name: str, now: float) -> None:
    """A command for the running engine, read at its next claim (within a second):
    `reset` closes a destination's circuit and clears its slow-down; `kick` lets the next
    attempt through an open circuit (after `queue flush`, `destination resume`)."""
    conn.execute(
        "INSERT INTO engine_commands (at, action, name) VALUES (?,?,?)", (now, action, name.lower())
    )


def reset_destination(conn: sqlite3.Connection, name: str, now: float) -> int:
    """`destination reset`: the engine closes the circuit, and what waited for it is due."""
    name = name.lower()
    engine_command(conn, "reset", name, now)
    return conn.execute(
        "UPDATE recipients SET next_attempt_at = ?, reason = NULL, updated_at = ?"
        f" WHERE (destination = ? OR ? NOT LIKE '%.%') AND state = '{RcptState.DEFERRED}'"
        " AND reason LIKE 'circuit open%'",
        (now, now, name, name),
    ).rowcount


def engine_commands(conn: sqlite3.Connection, after: int) -> list[tuple[int, str, str]]:
    return [
        (r[0], r[1], r[2])
        for r in conn.execute(
            "SELECT id, action, name FROM engine_commands WHERE id > ? ORDER BY id", (after,)
        )
    ]


def pass_reads(
    conn: sqlite3.Connection, after: int, now: float
) -> tuple[list[tuple[int, str, str]], dict[str, tuple[float, str]]]:
    """`engine_commands(conn, after)` and `suspensions(conn, now)` in one statement: what
    every claim pass reads (relay/delivery/claims.py), one round trip on PostgreSQL, not
    two."""
    cmds: list[tuple[int, str, str]] = []
    susp: dict[str, tuple[float, str]] = {}
    for kind, cid, a, b, until in conn.execute(
        "SELECT 0, id, action, name, NULL FROM engine_commands WHERE id > ?"
        " UNION ALL SELECT 1, NULL, name, reason, suspended_until FROM destinations"
        " WHERE suspended_until > ? ORDER BY 1, 2",
        (after, now),
    ):
        if kind == 0:
            cmds.append((cid, a, b))
        else:
            susp[a] = (until, b or "")
    return cmds, susp


def last_engine_command(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT coalesce(max(id), 0) FROM engine_commands").fetchone()[0])


def mark_delay_warned(conn: sqlite3.Connection, msg_id: str, now: float) -> bool:
    """True for the first caller only: one delay warning per message."""
    return (
        conn.execute(
            "UPDATE messages SET delay_warned_at = ? WHERE id = ? AND delay_warned_at IS NULL",
            (now, msg_id),
        ).rowcount
        == 1
    )


def oldest_arrival(conn: sqlite3.Connection, states: str) -> float | None:
    """When the oldest message with a recipient in `states` (an `sql_in` list) arrived:
    arrival order from the messages_created index, stopping at the first match, instead of
    joining every waiting recipient (seconds at a million, in the writer)."""
    row = conn.execute(
        "SELECT m.created_at FROM messages m INDEXED BY messages_created WHERE EXISTS"
        " (SELECT 1 FROM recipients r WHERE r.msg_id = m.id"
        f" AND r.state IN {states}) ORDER BY m.created_at LIMIT 1"
    ).fetchone()
    return None if row is None else float(row[0])


def queue_health(
    conn: sqlite3.Connection, now: float, stall_after: float
) -> tuple[float | None, int]:
    """(age of the oldest waiting recipient, recipients overdue by more than `stall_after`:
    due and not taken, or taken and not finished). Held recipients are the operator's."""
    oldest = oldest_arrival(conn, _IN_QUEUE)  # runs in the writer every few seconds
    cutoff = now - stall_after
    due = sum(
        conn.execute(
            "SELECT count(*) FROM recipients INDEXED BY recipients_due"
            f" WHERE state IN {_DUE_INDEXED} AND lane_prio = ? AND next_attempt_at <= ?",
            (prio, cutoff),
        ).fetchone()[0]
        for prio in set(LANE_PRIORITY.values())
    )
    stuck = conn.execute(
        f"SELECT count(*) FROM recipients WHERE state = '{RcptState.SENDING}' AND updated_at <= ?",
        (cutoff,),
    ).fetchone()[0]
    return (None if oldest is None else max(0.0, now - oldest)), int(due) + int(stuck)


def unfinished_counts(conn: sqlite3.Connection) -> tuple[int, int]:
    """(unfinished recipients, how many of them held), over the recipients_state index:
    what a spool database deleted under the daemon still holds (its drain)."""
    row = conn.execute(
        f"SELECT count(*), coalesce(sum(CASE WHEN state = '{RcptState.HELD}' THEN 1 ELSE 0"
        f" END), 0) FROM recipients WHERE state IN {_UNFINISHED}"
    ).fetchone()
    return int(row[0]), int(row[1])


def waiting_recipients(
    conn: sqlite3.Connection,
) -> Iterator[tuple[str, str, str, str, str | None]]:
    """(destination, address, sender, client, listener) of every unfinished recipient,
    streamed from the cursor (`destination list` with routes: memory stays flat whatever the
    spool size)."""
    for r in conn.execute(
        "SELECT r.destination, r.address, m.sender, m.client, m.listener"
        f" FROM recipients r JOIN messages m ON m.id = r.msg_id WHERE r.state IN"
        f" {_UNFINISHED}"
    ):
        yield (r[0], r[1], r[2], r[3], r[4])


def waiting_per_destination(conn: sqlite3.Connection) -> dict[str, int]:
    """Unfinished recipients per stored destination (`destination list` without routes),
    counted in SQL over the recipients_waiting index."""
    return {
        dest: count
        for dest, count in conn.execute(
            "SELECT destination, count(*) FROM recipients INDEXED BY recipients_waiting"
            f" WHERE state IN {_UNFINISHED} GROUP BY destination"
        )
    }


def waiting_by_age(
    conn: sqlite3.Connection, now: float, limits: Sequence[float]
) -> dict[str, list[int]]:
    """Unfinished recipients per destination and message age bucket (`queue summary`):
    bucket i holds ages below limits[i] (the last limit may be infinite). Counted in SQL
    over covering indexes, so a million waiting recipients take a second, not a list."""
    cases = " ".join(
        f"WHEN m.created_at > {now - lim!r} THEN {i}" for i, lim in enumerate(limits[:-1])
    )
    out: dict[str, list[int]] = {}
    for dest, bucket, count in conn.execute(
        f"SELECT r.destination, CASE {cases} ELSE {len(limits) - 1} END, count(*)"
        " FROM recipients r INDEXED BY recipients_waiting"
        " JOIN messages m INDEXED BY messages_id_created ON m.id = r.msg_id"
        f" WHERE r.state IN {_UNFINISHED} GROUP BY 1, 2"
    ):
        out.setdefault(dest, [0] * len(limits))[bucket] += count
    return out


def put_runtime(conn: sqlite3.Connection, name: str, value: Any, now: float) -> None:
    conn.execute(
        "INSERT INTO runtime (name, value, updated_at) VALUES (?,?,?) ON CONFLICT (name)"
        " DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
        (name, json.dumps(value, sort_keys=True), now),
    )


def get_runtime(conn: sqlite3.Connection, name: str) -> tuple[Any, float] | None:
    row = conn.execute("SELECT value, updated_at FROM runtime WHERE name = ?", (name,)).fetchone()
    return None if row is None else (json.loads(row[0]), row[1])


def log_operator(conn: sqlite3.Connection, action: str, detail: Any, now: float) -> None:
    conn.execute(
        "INSERT INTO oplog (at, action, detail) VALUES (?,?,?)",
        (now, action, json.dumps(detail, sort_keys=True)),
    )


# --- suppression ----------------------------------------------------------------------------


GLOBAL = ""  # the scope of a suppression entry that holds for every sender


def suppression_list(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    return [
        dict(address=r[0], scope=r[1] or "global", reason=r[2], created_at=r[3], source=r[4])
        for r in conn.execute(
            "SELECT address, scope, reason, created_at, source FROM suppression"
            " ORDER BY created_at, address, scope"
        )
    ]


def suppression_get(
    conn: sqlite3.Connection, address: str, identity: str | None = None
) -> tuple[str, float] | None:
    """The entry that keeps `address` from mail of `identity`: a global one first, else one
    scoped to that identity (None: global entries only)."""
    row = conn.execute(
        "SELECT reason, created_at FROM suppression WHERE address = ? AND scope IN (?, ?)"
        " ORDER BY scope LIMIT 1",
        (address.lower(), GLOBAL, GLOBAL if identity is None else identity.lower()),
    ).fetchone()
    return None if row is None else (row[0], row[1])


def suppression_add(
    conn: sqlite3.Connection,
    address: str,
    reason: str,
    now: float,
    scope: str = GLOBAL,
    source: str = "operator",
) -> bool:
    return (
        conn.execute(
            "INSERT INTO suppression (address, scope, reason, created_at, source)"
            " VALUES (?,?,?,?,?) ON CONFLICT (address, scope) DO UPDATE SET"
            " reason = excluded.reason, created_at = excluded.created_at,"
            " source = excluded.source",
            (address.lower(), scope.lower(), reason, now, source),
        ).rowcount
        > 0
    )


def suppression_remove(conn: sqlite3.Connection, address: str, scope: str | None = None) -> bool:
    """Lift the entry of `scope` ('' global, an identity); None lifts every entry."""
    if scope is None:
        cur = conn.execute("DELETE FROM suppression WHERE address = ?", (address.lower(),))
    else:
        cur = conn.execute(
            "DELETE FROM suppression WHERE address = ? AND scope = ?",
            (address.lower(), scope.lower()),
        )
    return cur.rowcount > 0


def suppression_version(conn: sqlite3.Connection) -> tuple[int, int, float]:
    """A fingerprint of the suppression list that any add, re-add or removal changes (each
    stamps or drops a created_at), read from the table alone (both backends)."""
    row = conn.execute(
        "SELECT count(*), coalesce(sum(length(address) + length(scope)), 0),"
        " coalesce(sum(created_at), 0.0) FROM suppression"
    ).fetchone()
    return (int(row[0]), int(row[1]), float(row[2]))


# --- feedback (relay/feedback/apply.py writes; these read for the CLI) -----------------------


def feedback_events(conn: sqlite3.Connection, limit: int) -> list[dict[str, Any]]:
    cols = ("at", "provider", "type", "recipient", "outcome", "msg_id", "identity", "reason")
    return [
        dict(zip(cols, r, strict=True))
        for r in conn.execute(
            f"SELECT {', '.join(cols)} FROM feedback_events ORDER BY at DESC LIMIT ?", (limit,)
        )
    ]


def feedback_mail(conn: sqlite3.Connection, limit: int, unread: bool) -> list[dict[str, Any]]:
    cols = ("id", "at", "peer", "sender", "rcpt", "size", "events", "error", "stored", "truncated")
    where = " WHERE error IS NOT NULL" if unread else ""
    return [
        {**dict(zip(cols, r, strict=True)), "truncated": bool(r[9])}
        for r in conn.execute(
            f"SELECT {', '.join(cols)} FROM feedback_mail{where} ORDER BY id DESC LIMIT ?",
            (limit,),
        )
    ]


def feedback_mail_body(conn: sqlite3.Connection, mail_id: int) -> bytes | None:
    row = conn.execute("SELECT body FROM feedback_mail WHERE id = ?", (mail_id,)).fetchone()
    return None if row is None else bytes(row[0])


# --- operator queue changes ---------------------------------------------------------------


BULK_ACTIONS = ("hold", "release", "retry", "delete", "flush")
_CHUNK = 500  # message ids per statement: far below SQLite's and psycopg's parameter limits


@dataclass(frozen=True, slots=True)
class BulkResult:
    """What one operator action changed (or, dry, would change): the messages it touched
    (sorted), how many recipient rows, the messages left with no recipient and so removed
    whole (delete), and the body files to delete after the commit."""

    messages: tuple[str, ...]
    recipients: int
    removed: int = 0
    paths: tuple[str, ...] = ()
    # hold: recipients in their attempt now (`sending`), marked to be held when it ends
    # undelivered; release: such marks taken off (relay/spool/model.py)
    after_attempt: int = 0


def _retry_sources(failed_only: bool) -> tuple[str, ...]:
    if failed_only:
        return tuple(sorted(s.value for s in DEAD))
    return tuple(
        sorted(
            s.value
            for s in (
                RcptState.DEFERRED,
                RcptState.PENDING,
                RcptState.BOUNCED,
                RcptState.FAILED,
                RcptState.SUPPRESSED,
                RcptState.HELD,
            )
        )
    )


def _bulk_where(
    action: str,
    now: float,
    *,
    failed_only: bool,
    recipient: str | None,
    domain: str | None,
) -> tuple[list[str], list[Any]]:
    """The one WHERE of an action over `recipients` (unaliased: it serves SELECT, UPDATE and
    DELETE alike), so that a dry run counts exactly the rows the real run changes. Filters
    select recipients, never the other recipients of the same message."""
    conds: list[str] = []
    params: list[Any] = []

    def states(src: Iterable[str]) -> None:
        src = list(src)
        conds.append(f"state IN ({','.join('?' * len(src))})")
        params.extend(src)

    if action == "hold":
        states(sources_for(RcptState.HELD))
    elif action == "release":
        states([RcptState.HELD.value])
    elif action == "retry":
        states(_retry_sources(failed_only))
        # leaving the suppression list is a separate, explicit operator act: a recipient
        # whose address is still suppressed is left as it is (the CLI says so and how to
        # lift it). recipients.address, qualified: a bare `address` here is the suppression
        # row's own column, and one lower-case entry stopped every retry
        conds.append(
            "NOT EXISTS (SELECT 1 FROM suppression s"
            " WHERE s.address = lower(recipients.address) AND s.scope IN"
            " ('', (SELECT m.identity FROM messages m WHERE m.id = recipients.msg_id)))"
        )
    elif action == "flush":
        conds.append(f"state IN {_DUE} AND next_attempt_at > ?")
        params.append(now)
    elif action != "delete":  # delete: every recipient the filters select, in any state
        raise ValueError(f"not a bulk action: {action}")
    _filters(conds, params, recipient, domain)
    return conds, params


def _filters(
    conds: list[str], params: list[Any], recipient: str | None, domain: str | None
) -> None:
    """The recipient filters of a bulk action (every action's, and the hold mark's)."""
    if recipient:
        conds.append("lower(address) = ?")
        params.append(recipient.lower())
    if domain:  # recipients.destination is the recipient's domain, lower-case
        conds.append("destination = ?")
        params.append(domain.lower().strip().rstrip("."))


def _mark_in_attempt(
    conn: sqlite3.Connection,
    action: str,
    chunk: Sequence[str] | None,
    recipient: str | None,
    domain: str | None,
    dry_run: bool,
) -> list[Any]:
    """hold: mark the selected recipients that are in their attempt (`sending`) to be held
    when it ends undelivered; release: take such marks off. (msg_id, id) of each row."""
    conds = [f"state = '{RcptState.SENDING}'", f"hold_after = {0 if action == 'hold' else 1}"]
    params: list[Any] = []
    _filters(conds, params, recipient, domain)
    if chunk is not None:
        conds.append(f"msg_id IN ({','.join('?' * len(chunk))})")
        params.extend(chunk)
    where = " WHERE " + " AND ".join(conds)
    if dry_run:
        return conn.execute(f"SELECT msg_id, id FROM recipients{where}", params).fetchall()
    return conn.execute(
        f"UPDATE recipients SET hold_after = {1 if action == 'hold' else 0}{where}"
        " RETURNING msg_id, id",
        params,
    ).fetchall()


def _bulk_set(action: str, now: float) -> tuple[str, list[Any]]:
    if action == "hold":
        return "state = ?, updated_at = ?, reason = NULL", [RcptState.HELD.value, now]
    if action == "release":
        return (
            "state = ?, updated_at = ?, reason = NULL, next_attempt_at = ?",
            [RcptState.DEFERRED.value, now, now],
        )
    if action == "retry":
        # attempts reset and a fresh retry.max_age from now (retry_base)
        return (
            "state = ?, updated_at = ?, reason = NULL, next_attempt_at = ?, attempts = 0,"
            " retry_base = ?",
            [RcptState.DEFERRED.value, now, now, now],
        )
    return "next_attempt_at = ?, updated_at = ?", [now, now]  # flush


def bulk(
    conn: sqlite3.Connection,
    action: str,
    ids: Sequence[str] | None,
    now: float,
    *,
    recipient: str | None = None,
    domain: str | None = None,
    failed_only: bool = False,
    dry_run: bool = False,
) -> BulkResult:
    """One operator action (`BULK_ACTIONS`) over the recipients of messages `ids` (None:
    every message) that `recipient`/`domain` select and that the action can change from
    their state. A dry run runs the same WHERE as a SELECT, so its counts are the real
    run's. `delete` removes the selected recipient rows (and their attempt log); a message
    left with none is removed whole with its body, and any other recipient of a message
    stays queued as it was. `hold` also marks the selected recipients in their attempt
    (`sending`: the attempt cannot be taken back) to be held when it ends undelivered, and
    `release` takes such marks off: `after_attempt` counts them, apart from `recipients`."""
    conds, params = _bulk_where(
        action, now, failed_only=failed_only, recipient=recipient, domain=domain
    )
    chunks: list[Sequence[str] | None] = (
        [None] if ids is None else [ids[i : i + _CHUNK] for i in range(0, len(ids), _CHUNK)]
    )
    per_msg: dict[str, int] = {}
    marked: set[str] = set()
    after = 0
    for chunk in chunks:
        where, p = list(conds), list(params)
        if chunk is not None:
            where.append(f"msg_id IN ({','.join('?' * len(chunk))})")
            p.extend(chunk)
        where_sql = (" WHERE " + " AND ".join(where)) if where else ""
        if dry_run:
            rows = conn.execute(f"SELECT msg_id, id FROM recipients{where_sql}", p).fetchall()
        elif action == "delete":
            rows = conn.execute(
                f"DELETE FROM recipients{where_sql} RETURNING msg_id, id", p
            ).fetchall()
            gone = [r[1] for r in rows]
            for i in range(0, len(gone), _CHUNK):
                part = gone[i : i + _CHUNK]
                conn.execute(
                    f"DELETE FROM attempts WHERE rcpt_id IN ({','.join('?' * len(part))})", part
                )
        else:
            sets, sp = _bulk_set(action, now)
            rows = conn.execute(
                f"UPDATE recipients SET {sets}{where_sql} RETURNING msg_id, id", [*sp, *p]
            ).fetchall()
        for r in rows:
            per_msg[r[0]] = per_msg.get(r[0], 0) + 1
        if action in ("hold", "release"):
            rows = _mark_in_attempt(conn, action, chunk, recipient, domain, dry_run)
            after += len(rows)
            marked.update(r[0] for r in rows)
    touched = sorted(per_msg.keys() | marked)
    removed: list[str] = []
    paths: list[str] = []
    if action == "delete" and touched:
        for i in range(0, len(touched), _CHUNK):
            part = touched[i : i + _CHUNK]
            left = {
                r[0]: r[1]
                for r in conn.execute(
                    f"SELECT msg_id, count(*) FROM recipients"
                    f" WHERE msg_id IN ({','.join('?' * len(part))}) GROUP BY msg_id",
                    part,
                )
            }
            # dry: a message whose every row is selected; real: one with no row left
            removed.extend(q for q in part if left.get(q, 0) == (per_msg[q] if dry_run else 0))
        if not dry_run:
            paths = delete_messages(conn, removed)
    return BulkResult(
        tuple(touched), sum(per_msg.values()), len(removed), tuple(paths), after_attempt=after
    )


def retry(
    conn: sqlite3.Connection, ids: Sequence[str] | None, now: float, failed_only: bool = False
) -> int:
    """Make recipients due now with attempts reset. With `failed_only` (or ids None): the dead
    letters (bounced/failed) come back; their dedup keys stay, so nothing is sent twice to
    a recipient already delivered."""
    return bulk(conn, "retry", ids, now, failed_only=failed_only).recipients


def suppressed_recipients(
    conn: sqlite3.Connection, ids: Sequence[str] | None, failed_only: bool = False
) -> list[tuple[str, str, str]]:
    """(queue id, address, reason) of the recipients of these messages (or of every dead
    letter) whose address is on the suppression list: what `queue retry` leaves alone."""
    sql = (
        "SELECT r.msg_id, r.address, s.reason FROM recipients r JOIN messages m ON m.id = r.msg_id"
        " JOIN suppression s ON s.address = lower(r.address) AND s.scope IN ('', m.identity)"
        f" WHERE r.state != '{RcptState.DELIVERED}'"
    )
    params: list[Any] = []
    if failed_only or ids is None:
        sql += f" AND r.state IN {sql_in(FINAL - {RcptState.DELIVERED})}"
    if ids is not None:
        if not ids:
            return []
        sql += f" AND r.msg_id IN ({','.join('?' * len(ids))})"
        params.extend(ids)
    return [(r[0], r[1], r[2]) for r in conn.execute(sql, params)]


def hold(conn: sqlite3.Connection, ids: Sequence[str], now: float) -> int:
    return bulk(conn, "hold", ids, now).recipients


def release(conn: sqlite3.Connection, ids: Sequence[str], now: float) -> int:
    return bulk(conn, "release", ids, now).recipients


def flush(conn: sqlite3.Connection, now: float) -> int:
    return bulk(conn, "flush", None, now).recipients


def existing_ids(conn: sqlite3.Connection, ids: Sequence[str]) -> list[str]:
    return [i for i in ids if conn.execute("SELECT 1 FROM messages WHERE id = ?", (i,)).fetchone()]


# --- reading --------------------------------------------------------------------------------


def iso_utc(ts: float) -> str:
    """The one timestamp format of the CLI's JSON and the logs: ISO 8601, UTC, seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _iso(ts: float | None) -> str | None:
    return None if ts is None else iso_utc(ts)


def iter_messages(
    conn: sqlite3.Connection,
    *,
    state: str | None = None,
    include_finished: bool = False,
    recipient: str | None = None,
    domain: str | None = None,
    older_than: float | None = None,
    now: float | None = None,
    limit: int | None = None,
    queue_id: str | None = None,
    message_id: str | None = None,
    upstream_id: str | None = None,
    sender: str | None = None,
    after: str | None = None,
    page: int = 500,
) -> Iterator[dict[str, Any]]:
    """Messages matching the filters, oldest first, read a page at a time (keyset
    pagination on (created_at, id)): the first ones come at once and memory does not grow
    with the spool. `after` (a queue id) starts after that message (the console's pages)."""
    now = time.time() if now is None else now
    where = []
    params: list[Any] = []
    if queue_id is not None:
        where.append("m.id = ?")
        params.append(queue_id)
    if message_id is not None:  # as stored: normalized (relay/spool/dedup.py)
        where.append("m.message_id = ?")
        params.append(message_id)
    if upstream_id is not None:
        where.append(
            "EXISTS (SELECT 1 FROM recipients r WHERE r.msg_id = m.id AND r.upstream_id = ?)"
        )
        params.append(upstream_id)
    finals = ",".join(f"'{s.value}'" for s in FINAL)
    if not include_finished and state not in ("sent", "failed"):
        where.append(
            f"EXISTS (SELECT 1 FROM recipients r WHERE r.msg_id = m.id"
            f" AND r.state NOT IN ({finals}))"
        )
    if recipient:
        # the messages of this address first (recipients_address), not an EXISTS probe of
        # every message in date order: 2 s -> 5 ms at a million (the console's search)
        where.append("m.id IN (SELECT r.msg_id FROM recipients r WHERE lower(r.address) = ?)")
        params.append(recipient.lower())
    if domain:
        where.append(
            "EXISTS (SELECT 1 FROM recipients r WHERE r.msg_id = m.id AND r.destination = ?)"
        )
        params.append(domain.lower())
    if older_than is not None:
        where.append("m.created_at <= ?")
        params.append(now - older_than)
    if sender is not None:
        where.append("lower(m.sender) = ?")
        params.append(sender.strip().strip("<>").lower())
    base_where = list(where)
    cursor: tuple[float, str] | None = None
    if after is not None:  # the console's next page: after this message, in the same order
        row = conn.execute("SELECT created_at, id FROM messages WHERE id = ?", (after,)).fetchone()
        cursor = None if row is None else (row[0], row[1])
    emitted = 0
    while True:
        conds = list(base_where)
        page_params = list(params)
        if cursor is not None:  # keyset: strictly after the last row of the previous page
            conds.append("(m.created_at, m.id) > (?, ?)")  # a range of messages_created
            page_params.extend(cursor)
        sql = (
            "SELECT m.id, m.message_id, m.sender, m.size, m.created_at, m.lane, m.client,"
            " m.listener FROM messages m"
            + (" WHERE " + " AND ".join(conds) if conds else "")
            + " ORDER BY m.created_at, m.id LIMIT ?"
        )
        msgs = conn.execute(sql, [*page_params, page]).fetchall()
        if not msgs:
            return
        cursor = (msgs[-1][4], msgs[-1][0])
        rcpts_by: dict[str, list[sqlite3.Row]] = {}
        ids = [m[0] for m in msgs]
        for r in conn.execute(
            f"SELECT msg_id, address, state, attempts, last_reply, next_attempt_at, reason,"
            f" destination, upstream_id, hold_after FROM recipients"
            f" WHERE msg_id IN ({','.join('?' * len(ids))})"
            f" ORDER BY id",
            ids,
        ):
            rcpts_by.setdefault(r[0], []).append(r)
        for m in msgs:
            rc = rcpts_by.get(m[0], [])
            mstate = message_state(r[2] for r in rc)
            if state and mstate.value != state:
                continue
            yield _message_doc(m, rc, mstate)
            emitted += 1
            if limit is not None and emitted >= limit:
                return
        if len(msgs) < page:
            return


def _message_doc(m: sqlite3.Row, rc: list[sqlite3.Row], mstate: MsgState) -> dict[str, Any]:
    waiting = [r[5] for r in rc if r[2] in ("pending", "deferred") and r[5] is not None]
    return {
        "id": m[0],
        "state": mstate.value,
        "message_id": m[1],
        "sender": m[2],
        "size": m[3],
        "created_at": _iso(m[4]),
        "lane": m[5],
        "client": m[6],
        "listener": m[7],
        "attempts": max((r[3] for r in rc), default=0),
        "next_attempt_at": _iso(min(waiting)) if waiting else None,
        "recipients": [_recipient_doc(r) for r in rc],
    }


def _recipient_doc(r: sqlite3.Row) -> dict[str, Any]:
    doc = {
        "address": r[1],
        "state": r[2],
        "attempts": r[3],
        "last_reply": r[4],
        "destination": r[7],
        "next_attempt_at": _iso(r[5]) if r[2] in ("pending", "deferred") else None,
        "reason": r[6],
        "upstream_id": r[8],
    }
    if r[2] == RcptState.SENDING:  # held during its attempt? (relay/spool/model.py)
        doc["hold_after_attempt"] = bool(r[9])
    return doc


def list_messages(conn: sqlite3.Connection, **filters: Any) -> list[dict[str, Any]]:
    """`iter_messages` as a list (for small selections: one message, a find)."""
    return list(iter_messages(conn, **filters))


def show_message(conn: sqlite3.Connection, queue_id: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT id, client, peer, identity, body, body_path FROM messages WHERE id = ?", (queue_id,)
    ).fetchone()
    if row is None:
        return None
    base = list_messages(conn, include_finished=True, queue_id=queue_id)
    if not base:
        return None
    msg = base[0]
    msg["client"] = row[1]
    msg["peer"] = row[2]
    msg["identity"] = row[3]
    msg["attempt_log"] = [
        {
            "at": _iso(a[0]),
            "recipient": a[1],
            "destination": a[2],
            "host": a[3],
            "outcome": a[4],
            "reply": a[5],
            "duration": a[6],
        }
        for a in conn.execute(
            "SELECT a.at, r.address, a.destination, a.host, a.outcome, a.reply, a.duration"
            " FROM attempts a LEFT JOIN recipients r ON r.id = a.rcpt_id"
            " WHERE a.msg_id = ? ORDER BY a.id",
            (queue_id,),
        )
    ]
    return msg


def message_body(conn: sqlite3.Connection, queue_id: str) -> tuple[bytes | None, str | None]:
    row = conn.execute("SELECT body, body_path FROM messages WHERE id = ?", (queue_id,)).fetchone()
    return (None, None) if row is None else (row[0], row[1])


def queue_gauges(
    conn: sqlite3.Connection, now: float | None = None
) -> tuple[dict[str, int], float | None]:
    """(recipients by state, seconds since the oldest unfinished message arrived): the
    /metrics gauges, and the start of `stats`."""
    now = time.time() if now is None else now
    by_state = {s.value: 0 for s in RcptState}
    for r in conn.execute("SELECT state, count(*) FROM recipients GROUP BY state"):
        by_state[r[0]] = r[1]
    oldest = oldest_arrival(conn, _UNFINISHED)
    return by_state, None if oldest is None else round(now - oldest, 3)


def stats(conn: sqlite3.Connection, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    by_state, oldest_age = queue_gauges(conn, now)
    msgs = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
    supp = conn.execute("SELECT count(*) FROM suppression").fetchone()[0]
    dedup = conn.execute("SELECT count(*) FROM dedup").fetchone()[0]
    by_dest: dict[str, dict[str, int]] = {}
    for r in conn.execute(
        "SELECT destination, state, count(*) FROM recipients INDEXED BY recipients_waiting"
        " GROUP BY state, destination"
    ):
        by_dest.setdefault(r[0], {})[r[1]] = r[2]
    return {
        "messages": msgs,
        "recipients": by_state,
        "oldest_queued_age": oldest_age,
        "suppressed_addresses": supp,
        "dedup_keys": dedup,
        "destinations": by_dest,
    }
