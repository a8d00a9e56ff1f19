"""What a feedback event does to the spool (SQL; runs on the spool writer).

Rules:
- Once: an event is keyed by (provider, event_id, recipient); the same webhook delivered
  twice, or the same DSN mailed twice, is recorded once and does nothing the second time.
- Only what is tied to our own sending acts (anyone can mail the feedback address, and a
  report can name any address). Tied, most specific first: our queue id and recipient row
  (a valid VERP token: the service checked its MAC); the upstream's id with the event's
  address (or the only recipient of that id: a provider forwards); the original's
  Message-ID, or our queue id read from the report, with an address that is a recipient
  of THAT message. The address alone (a delivered or bounced recipient with that address,
  found through the `recipients_address` index, never a scan) is `unverified`: recorded,
  logged and counted, it suppresses nothing and never turns a row `bounced`. An event that
  matches nothing is `unmatched` and changes nothing either.
- At most one effect per recipient row in one call (a report that names an address twice,
  or a bounce and a complaint for one row, suppresses once): the rest are `repeat`.
- `apply_events` runs in the caller's transaction; the service calls it with at most
  EVENTS_PER_JOB events per writer job, so that one report or webhook batch never holds the
  spool writer for more than a few milliseconds at a time (sends interleave).
- A hard bounce suppresses the address for every sender and turns a `delivered` recipient
  `bounced` (the attempt log keeps both: the delivery and a `late_bounce` row). A
  recipient still waiting is left to delivery, which finds the address suppressed.
- A complaint suppresses the address for the sending identity of the mail complained
  about only (other identities may still mail that person); a soft bounce is recorded
  and logged, nothing more.
- Each bounce and complaint counts in `identity_hours` for the rates `relay stats` shows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from relay.feedback.events import FeedbackEvent
from relay.spool import ops
from relay.spool.dedup import normalize_message_id
from relay.spool.model import RcptState, can_move

MAX_REASON = 500
EVENTS_PER_JOB = 50  # events applied in one writer job (one transaction): see the rules
# what an event that acted on no recipient row came to (no alert, no suppression)
INERT = frozenset({"duplicate", "unmatched", "unverified", "repeat"})
ACTED = frozenset({"bounced", "suppressed", "complaint"})  # at most once per row and call


@dataclass(frozen=True, slots=True)
class Applied:
    event: FeedbackEvent
    # duplicate | unmatched | unverified | repeat | bounced | suppressed | complaint |
    # soft_bounce
    outcome: str
    queue_id: str | None = None
    rcpt_id: int | None = None
    identity: str | None = None
    address: str | None = None  # the matched recipient's address as we stored it
    matched_by: str | None = None  # verp | upstream_id | message_id | queue_id | address


@dataclass(frozen=True, slots=True)
class _Match:
    rcpt_id: int
    msg_id: str
    address: str
    state: str
    identity: str
    by: str


_SELECT = (
    "SELECT r.id, r.msg_id, r.address, r.state, m.identity FROM recipients r"
    " JOIN messages m ON m.id = r.msg_id"
)


def clean_id(value: str | None) -> str | None:
    """Upstream ids and Message-IDs compare without brackets and surrounding space."""
    if value is None:
        return None
    v = value.strip().strip("<>").strip()
    return v or None


def _match_of(row: Any, by: str) -> _Match:
    return _Match(int(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]), by)


def match(conn: sqlite3.Connection, ev: FeedbackEvent) -> _Match | None:
    """The recipient row an event is about; `by` says how it was found. Only "address" is
    not tied to our sending (see the rules). Every lookup is on an index: the primary key,
    `recipients_upstream`, `messages_message_id` and `recipients_msg`, `recipients_address`."""
    addr = ev.recipient.strip().strip("<>").lower()
    if ev.queue_id is not None and ev.rcpt_id is not None:
        row = conn.execute(
            _SELECT + " WHERE r.id = ? AND r.msg_id = ?", (ev.rcpt_id, ev.queue_id)
        ).fetchone()
        if row is not None:
            return _match_of(row, "verp")
    uid = clean_id(ev.upstream_id)
    if uid is not None:
        row = conn.execute(
            _SELECT + " WHERE r.upstream_id = ? AND lower(r.address) = ? ORDER BY r.id DESC"
            " LIMIT 1",
            (uid, addr),
        ).fetchone()
        if row is not None:
            return _match_of(row, "upstream_id")
        rows = conn.execute(_SELECT + " WHERE r.upstream_id = ? LIMIT 2", (uid,)).fetchall()
        if len(rows) == 1:  # forwarded on by the provider: the one recipient of that id
            return _match_of(rows[0], "upstream_id")
    mid = clean_id(ev.message_id)
    if mid is not None and addr:
        row = conn.execute(
            _SELECT + " WHERE m.message_id = ? AND lower(r.address) = ? ORDER BY r.id DESC LIMIT 1",
            (normalize_message_id(mid), addr),
        ).fetchone()
        if row is not None:
            return _match_of(row, "message_id")
    if ev.queue_id is not None and addr:  # our queue id read from the report
        row = conn.execute(
            _SELECT + " WHERE r.msg_id = ? AND lower(r.address) = ? ORDER BY r.id DESC LIMIT 1",
            (ev.queue_id, addr),
        ).fetchone()
        if row is not None:
            return _match_of(row, "queue_id")
    if addr:
        row = conn.execute(
            _SELECT + f" WHERE lower(r.address) = ? AND r.state IN ('{RcptState.DELIVERED}',"
            f" '{RcptState.BOUNCED}') ORDER BY r.updated_at DESC, r.id DESC LIMIT 1",
            (addr,),
        ).fetchone()
        if row is not None:
            return _match_of(row, "address")
    return None


def apply_events(
    conn: sqlite3.Connection,
    events: Sequence[FeedbackEvent],
    now: float,
    on_applied: Callable[[sqlite3.Connection, Applied], None] | None = None,
    acted: Iterable[int] = (),
) -> list[Applied]:
    """Apply events in the caller's transaction; `on_applied` runs in it too (the alert).
    `acted`: the recipient rows earlier chunks of this report or batch acted on (`acted_on`
    of their results; not updated here, so that a job the writer runs again after a lost
    lock race starts over from the same state)."""
    out: list[Applied] = []
    seen = set(acted)
    for ev in events:
        applied = _apply(conn, ev, now, seen)
        if on_applied is not None and applied.outcome not in INERT:
            on_applied(conn, applied)
        out.append(applied)
    return out


def acted_on(results: Iterable[Applied]) -> set[int]:
    """The recipient rows these results suppressed or counted (for `apply_events(acted=)`)."""
    return {a.rcpt_id for a in results if a.outcome in ACTED and a.rcpt_id is not None}


def _apply(conn: sqlite3.Connection, ev: FeedbackEvent, now: float, acted: set[int]) -> Applied:
    recipient = ev.recipient.strip().strip("<>").lower()
    reason = ev.reason[:MAX_REASON]
    fresh = conn.execute(
        "INSERT INTO feedback_events (provider, event_id, recipient, at, type,"
        " outcome, reason) VALUES (?,?,?,?,?,'pending',?) ON CONFLICT DO NOTHING",
        (ev.provider, ev.event_id, recipient, now, ev.type, reason),
    ).rowcount
    if not fresh:
        return Applied(ev, "duplicate")
    m = match(conn, ev)
    if m is None:
        outcome = "unmatched"
        applied = Applied(ev, outcome)
    elif m.by == "address":
        # not tied to our sending: anyone can name an address we delivered to
        outcome = "unverified"
        applied = Applied(ev, outcome, m.msg_id, m.rcpt_id, m.identity, m.address, m.by)
    elif m.rcpt_id in acted:
        outcome = "repeat"
        applied = Applied(ev, outcome, m.msg_id, m.rcpt_id, m.identity, m.address, m.by)
    elif ev.type == "bounce":
        acted.add(m.rcpt_id)
        text = f"late bounce ({ev.provider}): {reason or ev.status or 'permanent failure'}"
        ops.suppression_add(conn, m.address, text, now, ops.GLOBAL, f"feedback:{ev.provider}")
        outcome = "suppressed"
        if can_move(RcptState(m.state), RcptState.BOUNCED) and m.state == RcptState.DELIVERED:
            conn.execute(
                f"UPDATE recipients SET state = '{RcptState.BOUNCED}', last_reply = ?,"
                f" updated_at = ? WHERE id = ? AND state = '{RcptState.DELIVERED}'",
                (text, now, m.rcpt_id),
            )
            outcome = "bounced"
        _attempt(conn, m, now, "late_bounce", text)
        _count(conn, m.identity, now, "bounced")
        applied = Applied(ev, outcome, m.msg_id, m.rcpt_id, m.identity, m.address, m.by)
    elif ev.type == "complaint":
        acted.add(m.rcpt_id)
        text = f"complaint ({ev.provider}): {reason or 'marked as spam'}"
        ops.suppression_add(conn, m.address, text, now, m.identity, f"feedback:{ev.provider}")
        _attempt(conn, m, now, "complaint", text)
        _count(conn, m.identity, now, "complained")
        outcome = "complaint"
        applied = Applied(ev, outcome, m.msg_id, m.rcpt_id, m.identity, m.address, m.by)
    else:
        _attempt(conn, m, now, "soft_bounce", f"soft bounce ({ev.provider}): {reason}")
        outcome = "soft_bounce"
        applied = Applied(ev, outcome, m.msg_id, m.rcpt_id, m.identity, m.address, m.by)
    tied = outcome not in INERT
    conn.execute(
        "UPDATE feedback_events SET outcome = ?, msg_id = ?, rcpt_id = ?, identity = ?"
        " WHERE provider = ? AND event_id = ? AND recipient = ?",
        (
            outcome,
            applied.queue_id if tied else None,
            applied.rcpt_id if tied else None,
            applied.identity if tied else None,
            ev.provider,
            ev.event_id,
            recipient,
        ),
    )
    return applied


def _attempt(conn: sqlite3.Connection, m: _Match, now: float, outcome: str, text: str) -> None:
    conn.execute(
        "INSERT INTO attempts (msg_id, rcpt_id, at, destination, host, outcome, reply, duration)"
        " SELECT ?, ?, ?, destination, NULL, ?, ?, NULL FROM recipients WHERE id = ?",
        (m.msg_id, m.rcpt_id, now, outcome, text, m.rcpt_id),
    )


def _count(conn: sqlite3.Connection, identity: str, now: float, column: str) -> None:
    assert column in ("bounced", "complained")
    add_counts = getattr(conn, "add_counts", None)
    if add_counts is not None:  # PostgreSQL: with the COMMIT, as every node's (pg.py)
        add_counts("identity_hours", (identity, int(now // 3600)), **{column: 1})
        return
    conn.execute(
        f"INSERT INTO identity_hours (identity, hour, {column}) VALUES (?, ?, 1)"
        f" ON CONFLICT (identity, hour) DO UPDATE SET {column} = identity_hours.{column} + 1",
        (identity, int(now // 3600)),
    )


def rates(conn: sqlite3.Connection, now: float) -> list[dict[str, object]]:
    """Per sending identity, over the last 24 hours and 7 days: delivered, bounced,
    complained and the two rates (events / delivered; None with nothing delivered)."""
    hour = int(now // 3600)
    rows = conn.execute(
        "SELECT identity,"
        " coalesce(sum(CASE WHEN hour > ? THEN delivered END), 0),"
        " coalesce(sum(CASE WHEN hour > ? THEN bounced END), 0),"
        " coalesce(sum(CASE WHEN hour > ? THEN complained END), 0),"
        " sum(delivered), sum(bounced), sum(complained)"
        " FROM (SELECT identity, hour, delivered, bounced, complained FROM identity_hours"
        " WHERE hour > ? UNION ALL SELECT identity, hour, delivered, bounced, complained"
        " FROM identity_hours_node WHERE hour > ?) AS h"  # a fleet node's own rows (pg.py)
        " GROUP BY identity ORDER BY identity",
        (hour - 24, hour - 24, hour - 24, hour - 24 * 7, hour - 24 * 7),
    ).fetchall()
    out: list[dict[str, object]] = []
    for r in rows:
        doc: dict[str, object] = {"identity": r[0]}
        for name, (d, b, c) in (("24h", r[1:4]), ("7d", r[4:7])):
            doc[name] = {
                "delivered": int(d),
                "bounced": int(b),
                "complained": int(c),
                "bounce_rate": (b / d) if d else None,
                "complaint_rate": (c / d) if d else None,
            }
        out.append(doc)
    return out
