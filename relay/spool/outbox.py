"""The transactional outbox (`outbox.enabled`, PostgreSQL spool): mail an application
writes as a row of `relay_outbox` in the same transaction as its business change, so the
mail exists if and only if the change committed, and no SMTP call sits in its request path.

Rules:
- The table is the relay's (created by the spool's migrations) and documented in the README
  ("The transactional outbox"); an application needs INSERT and SELECT on it, nothing else.
  It writes idempotency_key, recipients, message and optionally sender and lane; the status
  columns (state, attempts, next_attempt_at, upstream_id, last_error, queue_id, updated_at)
  are the relay's.
- Each pass takes up to `outbox.batch` rows in state `pending` (`FOR UPDATE SKIP LOCKED`:
  several relays drain one outbox), queues each like submitted mail and marks it `queued`
  with its queue id, in one transaction of the spool writer: a crash leaves the rows
  pending and nothing queued. The dedup key of a recipient is the row's idempotency key in
  the namespace `outbox` (as the `Idempotency-Key` header is for SMTP clients), so a key
  inserted again after its row was deleted is queued once within `dedup.window`.
- A message is made ready as SMTP input is: line ends made CRLF, NULs removed, lines over
  998 octets re-encoded, Message-ID (derived from the idempotency key, so it is stable) and
  Date added when missing, a Received trace naming the row.
- A row the relay cannot send (a bad address, no recipient, too big, an unknown lane, an
  invalid key) is `rejected` with last_error, logged at ERROR (`outbox_rejected`), alerted
  (event `outbox_rejected`, recorded in the same transaction), and never retried: the
  application fixes it and inserts a new row.
- Write-back: each pass, the `queued` rows whose recipients changed get their progress:
  attempts (the most of any recipient), next_attempt_at (the soonest), upstream_id (the ids
  the upstream gave), last_error (per recipient not delivered); `delivered` when every
  recipient is, `failed` when every recipient is final and one is not delivered (bounced,
  failed, suppressed) or the message was deleted from the queue by an operator.
- The write-back is incremental: a pass looks only at the rows of the messages this node
  queued or recorded outcomes for since the last pass (the engine tells it, `touched`), and
  every FULL_PASS seconds (and at the start) at every queued row, for what other nodes,
  the CLI and expired leases changed. Looking at every queued row each pass joined and
  aggregated the whole open outbox every poll_interval, whatever had changed.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from relay.config.tree import Config
from relay.delivery import shaping
from relay.delivery.lanes import LANE_PRIORITY
from relay.inbound import longlines
from relay.mail.address import AddressError, check_mailbox
from relay.mail.message import date_header, header, parse_headers
from relay.ops import alerts
from relay.ops.logs import log_event
from relay.spool import db, dedup, ops
from relay.spool.model import FINAL, RcptState
from relay.spool.writer import SpoolWriter

log = logging.getLogger("relay.spool.outbox")

NAMESPACE = "outbox"  # the dedup namespace of outbox rows (SMTP clients: listener:/user:)
FULL_PASS = 30.0  # seconds between write-back passes over every queued row


class Rejected(ValueError):
    """A row the relay will not send; the text goes to last_error."""


@dataclass(frozen=True, slots=True)
class Taken:
    accepted: list[tuple[int, str, int]]  # (row id, queue id, recipients queued)
    rejected: list[tuple[int, str]]
    duplicates: list[int]


def prepare(
    config: Config, row_id: int, key: str, sender: str, rcpts: list[str], data: bytes, lane: str
) -> tuple[ops.NewMessage, str]:
    """The spool's message for one outbox row (raises Rejected); also returns its lane."""
    now = time.time()
    if not dedup.valid_idempotency_key(key):
        raise Rejected(
            f"idempotency_key must be 1 to {dedup.IDEMPOTENCY_KEY_MAX} printable ASCII characters"
        )
    if lane not in LANE_PRIORITY:
        raise Rejected(f"lane must be one of {', '.join(sorted(LANE_PRIORITY))}, not {lane!r}")
    if sender:
        try:
            check_mailbox(sender)
        except AddressError as e:
            raise Rejected(f"sender {sender!r}: {e}") from None
    if not rcpts:
        raise Rejected("no recipients")
    if len(rcpts) > config.limits.max_recipients:
        raise Rejected(f"more than {config.limits.max_recipients} recipients")
    for r in rcpts:
        try:
            check_mailbox(r)
        except AddressError as e:
            raise Rejected(f"recipient {r!r}: {e}") from None
    if len(data) > config.limits.max_message_size:
        raise Rejected(f"message larger than {config.limits.max_message_size} octets")
    # as SMTP input: CRLF line ends, no NUL (RFC 5322 §2.3), lines of at most 998 octets
    data = data.replace(b"\0", b"").replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    data = data.replace(b"\n", b"\r\n")
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    data = longlines.conform(data) or data
    end = data.find(b"\r\n\r\n")
    head = data if end < 0 else data[: end + 4]
    headers = parse_headers(head)
    queue_id = ops.new_queue_id(now)
    added = b""
    mid = header(headers, "Message-ID")
    if not mid or not dedup.normalize_message_id(mid):
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        mid = f"<outbox.{digest}@{config.hostname}>"
        added = f"Message-ID: {mid}\r\n".encode()
    if header(headers, "Date") is None:
        added += date_header(now)
    trace = (
        f"Received: from relay_outbox (row {row_id}) by {config.hostname}"
        f" with local id {queue_id};\r\n\t"
    ).encode() + date_header(now)[len(b"Date: ") :]
    body = trace + added + data
    identity = shaping.sending_identity(config.shaping.identity_by, sender)
    msg = ops.NewMessage(
        queue_id=queue_id,
        message_id=dedup.normalize_message_id(mid),
        sender=sender,
        size=len(body),
        created_at=now,
        client=NAMESPACE,
        peer="outbox",
        lane=lane,
        lane_prio=LANE_PRIORITY[lane],
        identity=identity,
        body=body,
        body_path=None,
        recipients=tuple(
            ops.NewRecipient(
                address=r,
                destination=r.rpartition("@")[2].lower(),
                dedup_key=dedup.idempotency_dedup_key(NAMESPACE, key, r),
            )
            for r in rcpts
        ),
    )
    return msg, lane


def take(conn: Any, config: Config, batch: int) -> Taken:
    """One pass (in the spool writer's transaction): pending rows queued or rejected."""
    out = Taken([], [], [])
    rows = conn.execute(
        "SELECT id, idempotency_key, sender, recipients, message, lane FROM relay_outbox"
        " WHERE state = 'pending' ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
        (batch,),
    ).fetchall()
    for row_id, key, sender, rcpts, message, lane in rows:
        try:
            msg, _lane = prepare(
                config, row_id, key, sender or "", list(rcpts or ()), bytes(message), lane
            )
        except Rejected as e:
            _set(conn, row_id, "rejected", last_error=str(e))
            out.rejected.append((row_id, str(e)))
            # no silent path: the alert is recorded in the same transaction as the state
            # (coalesced per alerts.coalesce: a bad deploy's thousand rows make one alert)
            alerts.record(
                conn,
                alerts.Event(
                    "outbox_rejected",
                    "warning",
                    "outbox",
                    f"outbox row {row_id} rejected: {e}",
                    {"outbox_id": row_id, "reason": str(e)},
                ),
                time.time(),
                config.alerts.coalesce,
                alerts.sinks_of(config.alerts),
            )
            continue
        res = ops.accept(conn, msg, config.dedup_window)
        if res.queue_id is None:
            why = "already queued (the same idempotency key within dedup.window)"
            _set(conn, row_id, "duplicate", last_error=why)
            out.duplicates.append(row_id)
            continue
        _set(conn, row_id, "queued", queue_id=res.queue_id)
        out.accepted.append((row_id, res.queue_id, len(res.queued)))
    return out


def _set(
    conn: Any, row_id: int, state: str, last_error: str | None = None, queue_id: str | None = None
) -> None:
    conn.execute(
        "UPDATE relay_outbox SET state = ?, last_error = ?, queue_id = ?, updated_at = now()"
        " WHERE id = ?",
        (state, last_error, queue_id, row_id),
    )


_FINALS = ", ".join(f"'{s.value}'" for s in sorted(FINAL))
_DELIVERED = RcptState.DELIVERED.value

WRITE_BACK = f"""
    WITH agg AS (
        SELECT o.id,
               count(r.id) AS n,
               count(r.id) FILTER (WHERE r.state = '{_DELIVERED}') AS delivered,
               count(r.id) FILTER (WHERE r.state IN ({_FINALS})) AS final,
               coalesce(max(r.attempts), 0) AS attempts,
               min(r.next_attempt_at) FILTER (WHERE r.state NOT IN ({_FINALS})) AS next_at,
               string_agg(DISTINCT r.upstream_id, ' ') AS upstream_id,
               string_agg(r.address || ': ' || coalesce(r.last_reply, r.reason), '; '
                          ORDER BY r.id)
                 FILTER (WHERE r.state <> '{_DELIVERED}'
                         AND coalesce(r.last_reply, r.reason) IS NOT NULL) AS err
          FROM relay_outbox o LEFT JOIN recipients r ON r.msg_id = o.queue_id
         WHERE o.state = 'queued' {{only}}
         GROUP BY o.id
    ), new AS (
        SELECT id,
               CASE WHEN n = 0 THEN 'failed'
                    WHEN delivered = n THEN 'delivered'
                    WHEN final = n THEN 'failed'
                    ELSE 'queued' END AS state,
               attempts,
               to_timestamp(next_at) AS next_at,
               upstream_id,
               CASE WHEN n = 0 THEN 'deleted from the queue by an operator' ELSE err END AS err
          FROM agg
    )
    UPDATE relay_outbox o SET
        state = new.state, attempts = new.attempts, next_attempt_at = new.next_at,
        upstream_id = new.upstream_id, last_error = new.err, updated_at = now()
      FROM new
     WHERE o.id = new.id
       AND (o.state, o.attempts, o.next_attempt_at, o.upstream_id, o.last_error)
           IS DISTINCT FROM (new.state, new.attempts, new.next_at, new.upstream_id, new.err)
    RETURNING o.id, o.state, o.queue_id, o.last_error
"""


def write_back(
    conn: Any, queue_ids: list[str] | None = None
) -> list[tuple[int, str, str, str | None]]:
    """The spool's progress of queued rows into their status columns (only rows whose
    progress changed are written); returns the rows that reached a final state. With
    `queue_ids`: only the rows of those messages (an incremental pass)."""
    if queue_ids is None:
        rows = conn.execute(WRITE_BACK.format(only="")).fetchall()
    elif not queue_ids:
        return []
    else:
        rows = conn.execute(
            db.CUSTOM_PLAN + WRITE_BACK.format(only="AND o.queue_id = ANY(?::text[])"), (queue_ids,)
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows if r[1] != "queued"]


class Outbox:
    """The daemon's outbox loop."""

    def __init__(
        self, config: Callable[[], Config], writer: SpoolWriter, on_queued: Callable[[], None]
    ) -> None:
        self.config = config
        self.writer = writer
        self.on_queued = on_queued
        self.task: asyncio.Task[None] | None = None
        self._touched: set[str] = set()  # queue ids whose progress may have changed
        self._next_full = 0.0  # monotonic time of the next full write-back pass
        self.clock = time.monotonic

    def touched(self, queue_ids: Iterable[str]) -> None:
        """Messages whose recipients this node changed (the engine's records): written
        back at the next pass. Cheap (a set), and a message not of the outbox costs one
        index lookup of the pass's statement."""
        self._touched.update(queue_ids)

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name="outbox")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            conf = self.config()
            full = False
            try:
                full = await self.once(conf)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the database is away: the rows wait, pending
                log_event(log, logging.ERROR, "outbox_error", "outbox pass failed", exc=e)
            if not full:
                await asyncio.sleep(conf.outbox.poll_interval)

    async def once(self, conf: Config) -> bool:
        """One pass; True when a whole batch was taken (more may wait)."""
        batch = conf.outbox.batch
        taken = await self.writer.run(functools.partial(take, config=conf, batch=batch))
        for row_id, qid, n in taken.accepted:
            log_event(
                log,
                logging.INFO,
                "accepted",
                "outbox row queued",
                queue_id=qid,
                outbox_id=row_id,
                rcpts=n,
                client=NAMESPACE,
            )
        for row_id, why in taken.rejected:
            log_event(
                log,
                logging.ERROR,
                "outbox_rejected",
                "outbox row not sent",
                outbox_id=row_id,
                reason=why,
            )
        for row_id in taken.duplicates:
            log_event(
                log, logging.INFO, "deduplicated", "outbox row already queued", outbox_id=row_id
            )
        if taken.accepted:
            self.on_queued()
        self.touched(qid for _row, qid, _n in taken.accepted)
        ids: list[str] | None = None
        if self.clock() >= self._next_full:
            self._next_full = self.clock() + FULL_PASS
        else:
            ids = sorted(self._touched)
        touched, self._touched = self._touched, set()
        try:
            done = await self.writer.run(functools.partial(write_back, queue_ids=ids))
        except BaseException:
            self._touched |= touched  # written back at the next pass
            raise
        for row_id, state, qid, err in done:
            log_event(
                log,
                logging.INFO if state == "delivered" else logging.WARNING,
                "outbox_" + state,
                f"outbox row {state}",
                outbox_id=row_id,
                queue_id=qid,
                error=err,
            )
        n = len(taken.accepted) + len(taken.rejected) + len(taken.duplicates)
        return bool(n >= batch)
