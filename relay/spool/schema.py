"""The spool's schema: the migrations both backends run (SQLite: relay/spool/db.py,
PostgreSQL: relay/spool/pg.py, which maps the column types).

Rules:
- `MIGRATIONS[i]` brings schema version i to i+1. Never edit a released migration: append
  a new one.
- A migration is a script of SQL statements; `statements` splits it the way SQLite
  reads it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

from relay.spool.model import RcptState

MIGRATIONS: list[str] = [
    # 0 -> 1: the first schema.
    """
    CREATE TABLE messages (
        id          TEXT PRIMARY KEY,          -- queue id
        message_id  TEXT NOT NULL,             -- the Message-ID header, normalized
        sender      TEXT NOT NULL,             -- envelope sender, '' for the null sender
        size        INTEGER NOT NULL,
        created_at  REAL NOT NULL,
        client      TEXT NOT NULL,             -- dedup namespace: listener or AUTH user
        peer        TEXT NOT NULL,
        lane        TEXT NOT NULL,
        identity    TEXT NOT NULL,             -- sending identity for daily ceilings
        body        BLOB,                      -- small bodies live inline ...
        body_path   TEXT                       -- ... large ones in a file, fsync'd first
    );
    CREATE TABLE recipients (
        id              INTEGER PRIMARY KEY,
        msg_id          TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        address         TEXT NOT NULL,
        destination     TEXT NOT NULL,         -- 'smarthost' or the recipient domain
        lane_prio       INTEGER NOT NULL,
        state           TEXT NOT NULL,
        attempts        INTEGER NOT NULL DEFAULT 0,
        next_attempt_at REAL,
        last_reply      TEXT,
        reason          TEXT,                  -- why it waits (shaping, circuit, operator)
        dedup_key       TEXT NOT NULL,
        updated_at      REAL NOT NULL
    );
    CREATE INDEX recipients_msg ON recipients(msg_id);
    CREATE INDEX recipients_due ON recipients(lane_prio, next_attempt_at)
        WHERE state IN ('pending', 'deferred');
    CREATE INDEX recipients_state ON recipients(state);
    CREATE TABLE attempts (
        id          INTEGER PRIMARY KEY,
        msg_id      TEXT NOT NULL,
        rcpt_id     INTEGER,
        at          REAL NOT NULL,
        destination TEXT NOT NULL,
        host        TEXT,
        outcome     TEXT NOT NULL,     -- delivered, transient, bounce, fail, ambiguous, ...
        reply       TEXT,
        duration    REAL
    );
    CREATE INDEX attempts_msg ON attempts(msg_id);
    CREATE TABLE dedup (
        key         TEXT PRIMARY KEY,
        msg_id      TEXT NOT NULL,
        created_at  REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX dedup_age ON dedup(created_at);
    CREATE TABLE suppression (
        address     TEXT PRIMARY KEY,
        reason      TEXT NOT NULL,
        created_at  REAL NOT NULL
    );
    CREATE TABLE daily_counts (
        scope       TEXT NOT NULL,     -- 'dest:<name>' or 'id:<identity>'
        day         TEXT NOT NULL,
        count       INTEGER NOT NULL,
        PRIMARY KEY (scope, day)
    ) WITHOUT ROWID;
    CREATE TABLE destinations (
        name            TEXT PRIMARY KEY,
        suspended_until REAL,
        reason          TEXT
    );
    CREATE TABLE runtime (              -- the daemon's live view, for `relay stats`
        name        TEXT PRIMARY KEY,
        value       TEXT NOT NULL,
        updated_at  REAL NOT NULL
    );
    CREATE TABLE oplog (                -- operator actions, for the audit trail
        id          INTEGER PRIMARY KEY,
        at          REAL NOT NULL,
        action      TEXT NOT NULL,
        detail      TEXT NOT NULL
    );
    """,
    # 1 -> 2: an operator's `queue retry` restarts a recipient's max_age clock from the
    # retry (NULL: from the message's arrival).
    """
    ALTER TABLE recipients ADD COLUMN retry_base REAL;
    """,
    # 2 -> 3: the alert outbox (relay/ops/alerts.py), operator commands to the running engine
    # (`destination reset`, and the kick that `queue flush`/`destination resume` give an
    # open circuit), and the once-per-message delay warning.
    """
    CREATE TABLE alerts (
        id          INTEGER PRIMARY KEY,
        event       TEXT NOT NULL,             -- dead_letter, delayed, health, resolved, ...
        severity    TEXT NOT NULL,             -- info | warning | critical
        key         TEXT NOT NULL,             -- the destination or check it is about
        count       INTEGER NOT NULL,          -- events coalesced into this alert
        first_at    REAL NOT NULL,
        last_at     REAL NOT NULL,
        send_at     REAL NOT NULL,             -- when the coalescing window closes
        summary     TEXT NOT NULL,
        samples     TEXT NOT NULL,             -- JSON list, at most a few
        sinks       TEXT NOT NULL,             -- JSON list of sinks still to deliver to
        attempts    INTEGER NOT NULL DEFAULT 0,
        next_try_at REAL NOT NULL,
        last_error  TEXT,
        sent_at     REAL                       -- NULL until every sink has it
    );
    CREATE INDEX alerts_open ON alerts(event, key) WHERE sent_at IS NULL;
    CREATE TABLE engine_commands (
        id          INTEGER PRIMARY KEY,
        at          REAL NOT NULL,
        action      TEXT NOT NULL,             -- reset | kick
        name        TEXT NOT NULL              -- a destination, or '*' for all
    );
    ALTER TABLE messages ADD COLUMN delay_warned_at REAL;
    """,
    # 3 -> 4: the listener a message came in on (routes match on it).
    """
    ALTER TABLE messages ADD COLUMN listener TEXT;
    """,
    # 4 -> 5: feedback after the 250 (relay/feedback/): suppression entries get a scope
    # ('' = every sender, else one sending identity: a complaint or an unsubscribe) and a
    # source; the upstream's id of each delivered recipient; webhook and mail events, once
    # each; feedback mail that could not be read, kept for the operator; per identity and
    # hour, delivered / bounced / complained counts (rates in `relay stats`); and the
    # content hash behind an Idempotency-Key.
    """
    CREATE TABLE suppression_scoped (
        address     TEXT NOT NULL,
        scope       TEXT NOT NULL DEFAULT '',  -- '' = global, else a sending identity
        reason      TEXT NOT NULL,
        created_at  REAL NOT NULL,
        source      TEXT NOT NULL DEFAULT '',  -- smtp, operator, feedback:<provider>, ...
        PRIMARY KEY (address, scope)
    );
    INSERT INTO suppression_scoped (address, scope, reason, created_at)
        SELECT address, '', reason, created_at FROM suppression;
    DROP TABLE suppression;
    ALTER TABLE suppression_scoped RENAME TO suppression;
    ALTER TABLE recipients ADD COLUMN upstream_id TEXT;
    CREATE INDEX recipients_upstream ON recipients(upstream_id) WHERE upstream_id IS NOT NULL;
    CREATE INDEX messages_message_id ON messages(message_id);
    CREATE TABLE feedback_events (
        provider    TEXT NOT NULL,
        event_id    TEXT NOT NULL,
        recipient   TEXT NOT NULL,             -- lowercased
        at          REAL NOT NULL,
        type        TEXT NOT NULL,             -- bounce | soft_bounce | complaint
        msg_id      TEXT,                      -- the matched recipient, if any
        rcpt_id     INTEGER,
        identity    TEXT,
        outcome     TEXT NOT NULL,             -- what it did: suppressed, logged, unmatched
        reason      TEXT,
        PRIMARY KEY (provider, event_id, recipient)
    ) WITHOUT ROWID;
    CREATE INDEX feedback_events_at ON feedback_events(at);
    CREATE TABLE feedback_mail (
        id          INTEGER PRIMARY KEY,
        at          REAL NOT NULL,
        peer        TEXT NOT NULL,
        sender      TEXT NOT NULL,
        rcpt        TEXT NOT NULL,
        size        INTEGER NOT NULL,
        body        BLOB NOT NULL,
        events      INTEGER NOT NULL,          -- how many events it gave
        error       TEXT                       -- why it could not be read (kept), or NULL
    );
    CREATE TABLE identity_hours (
        identity    TEXT NOT NULL,
        hour        INTEGER NOT NULL,          -- unix time // 3600
        delivered   INTEGER NOT NULL DEFAULT 0,
        bounced     INTEGER NOT NULL DEFAULT 0,
        complained  INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (identity, hour)
    ) WITHOUT ROWID;
    ALTER TABLE dedup ADD COLUMN content_hash TEXT;
    """,
    # 5 -> 6: the CLI at a million rows (relay/spool/ops.py, `queue list`, `queue summary`,
    # `stats`). Keyset pages of `queue list` walk messages in arrival order; summary and
    # stats read covering indexes only (a message row holds its inline body: a lookup in
    # the table itself touches a page per message).
    """
    CREATE INDEX messages_created ON messages(created_at, id);
    CREATE INDEX messages_id_created ON messages(id, created_at);
    CREATE INDEX recipients_waiting ON recipients(state, destination, msg_id);
    DROP INDEX recipients_state;
    """,
    # 6 -> 7: a fleet of relays on one database (spool.backend: postgresql). A claim is a
    # lease: the node that holds it and until when; a node renews its leases while it
    # works, and records an outcome only over a claim it still holds. `nodes` is each
    # running daemon's heartbeat, its work in flight and its share of the fleet.
    """
    ALTER TABLE recipients ADD COLUMN lease_owner TEXT;
    ALTER TABLE recipients ADD COLUMN lease_until REAL;
    CREATE TABLE nodes (
        name         TEXT PRIMARY KEY,
        started_at   REAL NOT NULL,
        heartbeat_at REAL NOT NULL,
        inflight     INTEGER NOT NULL DEFAULT 0,
        info         TEXT NOT NULL DEFAULT '{}'   -- JSON: host, pid, version, listeners
    );
    -- room under the daily ceilings a node holds for its work in flight (ceiling_take),
    -- released when the outcome is recorded; a dead node's holds count as sent
    CREATE TABLE ceiling_holds (
        node  TEXT NOT NULL,
        scope TEXT NOT NULL,
        n     INTEGER NOT NULL,
        until REAL NOT NULL,   -- the node's lease: renewed by its heartbeat
        PRIMARY KEY (node, scope)
    );
    """,
    # 7 -> 8: the transactional outbox, `relay_outbox` (relay/spool/outbox.py): PostgreSQL only
    # (pg.PG_MIGRATIONS[7]); nothing on SQLite
    """
    """,
    # 8 -> 9: feedback matched by address (relay/feedback/apply.py: an address-only report
    # is looked up to be logged as `unverified`) through an index, never a scan of the
    # delivered rows (a forged report naming 1,000 addresses held the writer for 53 s)
    """
    CREATE INDEX recipients_address ON recipients(lower(address));
    """,
    # 9 -> 10: the content fingerprint of a Message-ID dedup key (relay/spool/dedup.py: another
    # message reusing the Message-ID is queued, not dropped; keys stored before keep NULL and
    # the old rule), and bounded feedback mail storage (relay/feedback/storage.py): the
    # octets kept of each mail (the budget sums them without reading a body) and whether
    # it was cut at `feedback.mail_max_stored`.
    """
    ALTER TABLE dedup ADD COLUMN fingerprint TEXT;
    ALTER TABLE feedback_mail ADD COLUMN stored INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE feedback_mail ADD COLUMN truncated INTEGER NOT NULL DEFAULT 0;
    UPDATE feedback_mail SET stored = length(body);
    CREATE INDEX feedback_mail_at ON feedback_mail(at, stored);
    """,
    # 10 -> 11: the console's per-minute series (relay/ops/console/rollup.py): one row a
    # minute, written by the daemon from the counters it keeps, pruned past 8 days
    """
    CREATE TABLE console_minutes (
        minute      INTEGER PRIMARY KEY,       -- unix time // 60
        accepted    INTEGER NOT NULL DEFAULT 0,
        delivered   INTEGER NOT NULL DEFAULT 0,
        deferred    INTEGER NOT NULL DEFAULT 0,
        bounced     INTEGER NOT NULL DEFAULT 0,
        suppressed  INTEGER NOT NULL DEFAULT 0,
        queue_depth INTEGER NOT NULL DEFAULT 0,
        p50         REAL,                      -- delivery latency percentiles, seconds
        p90         REAL,
        p99         REAL
    );
    """,
    # 11 -> 12: a fleet's counters per node (relay/spool/pg.py COUNTER_TABLES): the rows every
    # node bumped with its records (`dest:smarthost` today, an identity's hour) made two
    # nodes' record commits wait for each other's WAL flush on the row lock. The counts a
    # node adds at its COMMIT go to its own rows here; readers sum both tables. The fleet's
    # daily ceilings keep their one shared row in daily_counts (ops.ceiling_take locks it).
    # SQLite's single writer never writes these.
    """
    CREATE TABLE daily_counts_node (
        scope       TEXT NOT NULL,
        day         TEXT NOT NULL,
        node        TEXT NOT NULL,
        count       INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, day, node)
    ) WITHOUT ROWID;
    CREATE TABLE identity_hours_node (
        identity    TEXT NOT NULL,
        hour        INTEGER NOT NULL,
        node        TEXT NOT NULL,
        delivered   INTEGER NOT NULL DEFAULT 0,
        bounced     INTEGER NOT NULL DEFAULT 0,
        complained  INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (identity, hour, node)
    ) WITHOUT ROWID;
    """,
    # 12 -> 13: PostgreSQL compresses a stored body with lz4 (pg.PG_MIGRATIONS[12]); nothing
    # on SQLite
    """
    """,
    # 13 -> 14: an operator's hold of a recipient in its attempt (`sending`): marked, and the
    # attempt's end makes it `held` if it did not deliver or fail it for good (relay/spool/
    # model.py). Before, such a hold changed nothing and the recipient was retried.
    """
    ALTER TABLE recipients ADD COLUMN hold_after INTEGER NOT NULL DEFAULT 0;
    """,
]


def attempt_ends(state: str) -> str:
    """The SET of a recipient's attempt ending in `state` (an SQL expression: an outcome's
    parameter or column, or `deferred` for a claim given back undelivered): `held` instead
    of `deferred` when an operator held it during the attempt (relay/spool/model.py), and
    the mark cleared. Every claim clears it too (a mark left by a node of an older version,
    which ignores it, never holds a later attempt). Used by relay/spool/ops.py's records and
    give-backs on both backends, and by `outcome` below."""
    return (
        f"state = CASE WHEN hold_after = 1 AND {state} = '{RcptState.DEFERRED}'"
        f" THEN '{RcptState.HELD}' ELSE {state} END, hold_after = 0"
    )


def outcome_set(
    state: str, counted: str, next_at: str, reply: str, reason: str, now: str, upstream: str
) -> str:
    """The SET of an outcome recorded on SQLite (SQL expressions for its values): one
    outcome's UPDATE (ops.py `record`) and `outcome`'s trigger below."""
    return (
        f"{attempt_ends(state)}, attempts = attempts + {counted}, next_attempt_at = {next_at},"
        f" last_reply = coalesce({reply}, last_reply), reason = {reason}, updated_at = {now},"
        f" upstream_id = coalesce({upstream}, upstream_id), lease_owner = NULL,"
        " lease_until = NULL"
    )


# Every SQLite connection's temporary objects (relay/spool/db.py makes them at connect; they
# live in the connection's own `temp` schema, never in the spool file, so no migration).
# `intake`: a writer batch's accepts as one INSERT of a row per recipient (relay/spool/
# ops.py `_accept_many_sqlite`). Its trigger takes the recipient's dedup key (an expired one
# again), queues the message from the row of its first recipient (`first`), then the
# recipient: the three tables in one SQLite statement, one step of the writer for the batch.
# A key live within the window (or twice in the statement) RAISEs: SQLite backs the whole
# statement out (ABORT) and the transaction goes on, so the batch is decided again by
# `accept` one by one. `INTAKE_LIVE` is the error's text.
# `outcome`: a writer batch's records (ops.py `_record_many_sqlite`) as one INSERT of a row
# per outcome: its trigger applies the outcome to the recipient if it is still `sending`
# (and held by the row's `owner` when `held`), then writes its attempt-log row (`logged`).
# A recipient that changed since the record's read RAISEs (`OUTCOME_CHANGED`): the whole
# statement is backed out and the writer runs the records one by one.
INTAKE_LIVE = "relay: a dedup key is live"
# the views' columns: relay/spool/ops.py writes its rows in this order
INTAKE_COLUMNS = (
    "key", "msg_id", "created_at", "content_hash", "fingerprint", "window", "first",
    "message_id", "sender", "size", "client", "peer", "lane", "identity", "body", "body_path",
    "listener", "address", "destination", "lane_prio",
)  # fmt: skip
OUTCOME_COLUMNS = (
    "id", "state", "counted", "next_attempt_at", "last_reply", "reason", "now", "upstream_id",
    "held", "owner", "logged", "msg_id", "destination", "host", "outcome", "reply", "duration",
)  # fmt: skip


def _nulls(columns: tuple[str, ...]) -> str:
    return ", ".join(f"NULL AS {c}" for c in columns)


_NEW_OUTCOME = outcome_set(
    "NEW.state", "NEW.counted", "NEW.next_attempt_at", "NEW.last_reply", "NEW.reason",
    "NEW.now", "NEW.upstream_id",
)  # fmt: skip
OUTCOME_CHANGED = "relay: a recipient changed between the read and the update"
SQLITE_TEMP = f"""
    CREATE TEMP VIEW intake AS SELECT {_nulls(INTAKE_COLUMNS)};
    CREATE TEMP TRIGGER intake_row INSTEAD OF INSERT ON intake BEGIN
        INSERT INTO dedup (key, msg_id, created_at, content_hash, fingerprint)
            VALUES (NEW.key, NEW.msg_id, NEW.created_at, NEW.content_hash, NEW.fingerprint)
            ON CONFLICT (key) DO UPDATE SET msg_id = excluded.msg_id,
            created_at = excluded.created_at, content_hash = excluded.content_hash,
            fingerprint = excluded.fingerprint
            WHERE dedup.created_at <= excluded.created_at - NEW.window;
        SELECT RAISE(ABORT, '{INTAKE_LIVE}') WHERE changes() = 0;
        INSERT INTO messages (id, message_id, sender, size, created_at, client, peer, lane,
            identity, body, body_path, listener)
            SELECT NEW.msg_id, NEW.message_id, NEW.sender, NEW.size, NEW.created_at,
            NEW.client, NEW.peer, NEW.lane, NEW.identity, NEW.body, NEW.body_path,
            NEW.listener WHERE NEW.first;
        INSERT INTO recipients (msg_id, address, destination, lane_prio, state,
            next_attempt_at, dedup_key, updated_at)
            VALUES (NEW.msg_id, NEW.address, NEW.destination, NEW.lane_prio, 'pending',
            NEW.created_at, NEW.key, NEW.created_at);
    END;
    CREATE TEMP VIEW outcome AS SELECT {_nulls(OUTCOME_COLUMNS)};
    CREATE TEMP TRIGGER outcome_row INSTEAD OF INSERT ON outcome BEGIN
        UPDATE recipients SET {_NEW_OUTCOME}
            WHERE id = NEW.id AND state = '{RcptState.SENDING}'
            AND (NOT NEW.held OR lease_owner = NEW.owner OR lease_owner IS NULL);
        SELECT RAISE(ABORT, '{OUTCOME_CHANGED}') WHERE changes() = 0;
        INSERT INTO attempts (msg_id, rcpt_id, at, destination, host, outcome, reply, duration)
            SELECT NEW.msg_id, NEW.id, NEW.now, NEW.destination, NEW.host, NEW.outcome,
            NEW.reply, NEW.duration WHERE NEW.logged;
    END;
"""


def statements(script: str) -> Iterator[str]:
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                yield buf
            buf = ""


SQLITE_TEMP_STATEMENTS = tuple(statements(SQLITE_TEMP))  # split once, run at every connect


# PostgreSQL: a statement whose text starts with this is planned for its parameters at every
# call (relay/spool/pg.py sends it unprepared), never run on a cached generic plan. For
# lookups of a batch of keys (`= ANY(?)`, a join with unnest) on tables that grow: a generic
# plan is fixed at a statement's sixth use, and one made while the table was a few pages
# (a fresh spool) scans it whole (a Seq Scan on messages, a nested loop over every recipient)
# for the life of the connection, unless an ANALYZE (autovacuum) invalidates it: 1.8-4 ms
# a call at 12,000 messages where the index takes 0.05-0.3 ms (bench/README.md, Issue 31).
CUSTOM_PLAN = "/* custom plan */ "
