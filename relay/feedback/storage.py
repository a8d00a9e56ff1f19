"""Feedback mail kept in the spool (`feedback_mail`), within bounds an outsider cannot push.

Rules:
- One mail keeps at most `feedback.mail_max_stored` octets: the rest is cut off before the
  row is written (it was read whole, and parsed, first); the row says so (`truncated`, with
  `size` the octets received and `stored` the octets kept). A report's headers and its
  machine-readable parts come first, so what an operator needs is in the first few KiB.
- All rows together keep at most `feedback.mail_budget` octets: after each insert the
  oldest rows (by arrival) are dropped until the total fits; the count is returned, so the
  caller counts it in a metric and logs it. The new row always fits (the config checks
  that `mail_max_stored` <= `mail_budget`).
- The total is `sum(stored)` over the index on (at, stored): never a read of the bodies.
- `relay feedback purge` deletes by age or everything (`purge`); the daemon's prune still
  forgets mail older than max(spool.retention, 1 day).
- These functions run inside a transaction their caller opened (relay/spool/ops.py's rule).
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass

from relay.ops.logs import log_event
from relay.ops.metrics import Metrics

log = logging.getLogger(__name__)

DROP_BATCH = 256  # oldest rows read at a time while making room


@dataclass(frozen=True, slots=True)
class Mail:
    at: float
    peer: str
    sender: str
    rcpt: str
    data: bytes  # as received (its first octets, when the inbound read no more: `size`)
    events: int
    error: str | None
    size: int | None = None  # octets received; None: len(data)

    @property
    def received(self) -> int:
        return len(self.data) if self.size is None else max(self.size, len(self.data))


@dataclass(frozen=True, slots=True)
class Kept:
    mail_id: int
    size: int  # octets received
    stored: int  # octets kept
    dropped: int = 0  # older rows dropped to stay within the budget
    dropped_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.stored < self.size


def cut(data: bytes, cap: int) -> bytes:
    """The octets of a mail that are kept: all of it up to `cap`, else the first `cap`."""
    return data if len(data) <= cap else data[:cap]


def total(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT coalesce(sum(stored), 0) FROM feedback_mail").fetchone()[0])


def keep(conn: sqlite3.Connection, mail: Mail, cap: int, budget: int) -> Kept:
    """Insert one mail, cut at `cap`; then drop the oldest others until all fit `budget`."""
    body = cut(mail.data, cap)
    row = conn.execute(
        "INSERT INTO feedback_mail (at, peer, sender, rcpt, size, body, events, error, stored,"
        " truncated) VALUES (?,?,?,?,?,?,?,?,?,?) RETURNING id",
        (
            mail.at,
            mail.peer,
            mail.sender,
            mail.rcpt,
            mail.received,
            body,
            mail.events,
            mail.error,
            len(body),
            int(len(body) < mail.received),
        ),
    ).fetchone()
    mail_id = int(row[0])
    over = total(conn) - budget
    dropped = dropped_bytes = 0
    while over > 0:
        oldest = conn.execute(
            "SELECT id, stored FROM feedback_mail WHERE id <> ? ORDER BY at LIMIT ?",
            (mail_id, DROP_BATCH),
        ).fetchall()
        if not oldest:
            break
        ids: list[int] = []
        for r in oldest:
            if over <= 0:
                break
            ids.append(int(r[0]))
            over -= int(r[1])
            dropped_bytes += int(r[1])
        conn.executemany("DELETE FROM feedback_mail WHERE id = ?", [(i,) for i in ids])
        dropped += len(ids)
    return Kept(mail_id, mail.received, len(body), dropped, dropped_bytes)


def purge(conn: sqlite3.Connection, before: float | None) -> tuple[int, int]:
    """Delete stored feedback mail that arrived before `before` (None: all of it); returns
    (mails, octets stored)."""
    where, args = ("", ()) if before is None else (" WHERE at < ?", (before,))
    n, size = conn.execute(
        f"SELECT count(*), coalesce(sum(stored), 0) FROM feedback_mail{where}", args
    ).fetchone()
    conn.execute(f"DELETE FROM feedback_mail{where}", args)
    return int(n), int(size)


def report(kept: Kept, metrics: Metrics, peer: str) -> None:
    """The log lines and metrics of one stored mail (after its commit)."""
    if kept.truncated:
        metrics.feedback_mail_truncated.inc()
        log_event(
            log,
            logging.INFO,
            "feedback_truncated",
            "feedback mail stored truncated (feedback.mail_max_stored)",
            mail_id=kept.mail_id,
            size=kept.size,
            stored=kept.stored,
            peer=peer,
        )
    if kept.dropped:
        metrics.feedback_mail_dropped.inc(kept.dropped)
        log_event(
            log,
            logging.WARNING,
            "feedback_dropped",
            "oldest stored feedback mail dropped to stay within feedback.mail_budget",
            count=kept.dropped,
            octets=kept.dropped_bytes,
        )
