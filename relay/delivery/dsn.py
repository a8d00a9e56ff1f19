"""Delivery status notifications (RFC 3464) for dead letters, when `dsn.enabled`.

Rules:
- A DSN goes to the envelope sender of the failed message, from the null sender `<>`
  (RFC 5321 §4.5.5), so a DSN that fails is never answered by another: no bounce loops.
- Never for a message whose sender is null (that message was itself a bounce).
- One DSN per dead recipient, with the original headers (text/rfc822-headers), never the
  body. It is queued through the spool like any message, with a dedup key of
  (queue id, recipient), so a replayed dead letter does not notify twice.
- A delay warning (`retry.warn_after`, like Postfix's `delay_warning_time`) is one DSN per
  message with `Action: delayed`, a 4.x.x status and `Will-Retry-Until` (RFC 3464 §2.3.9),
  deduplicated on (queue id, "delayed").
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
import time
import uuid
from collections.abc import Callable
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

from relay.delivery.lanes import LANE_PRIORITY
from relay.delivery.outcomes import ROWS, Kind
from relay.mail.message import split_message
from relay.ops.logs import log_event
from relay.spool import bodies, dedup, ops

if TYPE_CHECKING:
    from relay.config.tree import Config
    from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

_ENHANCED = re.compile(r"(?<![\d.])[45]\.\d{1,3}\.\d{1,3}(?![\d.])")


def build_dsn(
    *,
    hostname: str,
    from_addr: str,
    to_addr: str,
    queue_id: str,
    recipient: str,
    status: str,
    reply: str,
    action: str,
    original_headers: bytes,
    now: float,
    retry_until: float | None = None,
) -> tuple[str, bytes]:
    boundary = f"=_{uuid.uuid4().hex}"
    mid = f"<{uuid.uuid4().hex}.dsn@{hostname}>"
    delayed = action == "delayed"
    if delayed:
        human = (
            f"This is the mail relay at {hostname}.\r\n\r\n"
            f"Your message to <{recipient}> has not been delivered yet. It is still in the"
            f" queue and will be retried"
            + (f" until {formatdate(retry_until, usegmt=True)}" if retry_until else "")
            + ".\r\nYou do not need to send it again.\r\n"
            f"The remote server said: {reply}\r\n\r\n"
            f"Queue id: {queue_id}\r\n"
        )
    else:
        human = (
            f"This is the mail relay at {hostname}.\r\n\r\n"
            f"Your message could not be delivered to <{recipient}>.\r\n"
            f"The remote server said: {reply}\r\n\r\n"
            f"Queue id: {queue_id}\r\n"
        )
    report = (
        f"Reporting-MTA: dns; {hostname}\r\n"
        f"X-Relay-Queue-ID: {queue_id}\r\n"
        f"Arrival-Date: {formatdate(now, usegmt=True)}\r\n\r\n"
        f"Final-Recipient: rfc822; {recipient}\r\n"
        f"Action: {action}\r\n"
        f"Status: {status}\r\n"
        f"Diagnostic-Code: smtp; {reply}\r\n"
    )
    if delayed and retry_until:
        report += f"Will-Retry-Until: {formatdate(retry_until, usegmt=True)}\r\n"
    parts = [
        f"From: Mail Delivery System <{from_addr}>",
        f"To: <{to_addr}>",
        "Subject: "
        + (
            "Delayed Mail (still being retried)"
            if delayed
            else "Undelivered Mail Returned to Sender"
        ),
        f"Date: {formatdate(now, usegmt=True)}",
        f"Message-ID: {mid}",
        "Auto-Submitted: auto-replied",
        "MIME-Version: 1.0",
        f'Content-Type: multipart/report; report-type=delivery-status; boundary="{boundary}"',
        "",
        f"--{boundary}",
        "Content-Type: text/plain; charset=us-ascii",
        "",
        human,
        f"--{boundary}",
        "Content-Type: message/delivery-status",
        "",
        report,
        f"--{boundary}",
        "Content-Type: text/rfc822-headers",
        "",
    ]
    text = "\r\n".join(parts).encode("utf-8", errors="replace") + b"\r\n"
    text += original_headers + f"\r\n--{boundary}--\r\n".encode()
    return mid, text


def action_of(doc: dict[str, Any]) -> str:
    """The DSN's Action (RFC 3464 §2.3.3), from the outcome table: a delay warning is the
    deferral's (`delayed`), a dead letter its kind's (`failed`); a doc without a kind of
    ours is a dead letter all the same."""
    kind = Kind.DEFERRED if doc.get("event") == "delayed" else doc.get("state")
    action = ROWS[Kind(kind)].dsn if kind in ROWS else None
    return action or "failed"


async def queue_dsn(
    cfg: Config, writer: SpoolWriter, doc: dict[str, Any], wake: Callable[[], None] = lambda: None
) -> str | None:
    sender = str(doc.get("sender") or "")
    if not sender or sender == "<>":
        return None
    queue_id = str(doc["queue_id"])
    body, path = await writer.run(lambda c: ops.message_body(c, queue_id))
    if path:
        body = await asyncio.to_thread(bodies.load, cfg.spool_path, body, path)
    headers, _ = split_message(body or b"")
    # the first enhanced code in the reply: "550 5.1.1 ..." or, for an expired recipient,
    # "expired after 5d in queue; last reply: 451 4.2.2 ..." (the code is not its 2nd word)
    enh = _ENHANCED.search(str(doc.get("reply", "")))
    delayed = doc.get("event") == "delayed"
    status = enh.group(0) if enh else ("4.0.0" if delayed else "5.0.0")
    if delayed:
        status = "4" + status[1:]  # still trying: a transient status
    elif status.startswith("4"):
        status = "5" + status[1:]  # expired after transient failures: final now
    now = time.time()
    retry_until = None
    if delayed and doc.get("retry_until"):
        retry_until = dt.datetime.fromisoformat(
            str(doc["retry_until"]).replace("Z", "+00:00")
        ).timestamp()
    from_addr = cfg.dsn.sender or f"MAILER-DAEMON@{cfg.hostname}"
    mid, data = build_dsn(
        hostname=cfg.hostname,
        from_addr=from_addr,
        to_addr=sender,
        queue_id=queue_id,
        recipient=str(doc["recipient"]),
        status=status,
        reply=str(doc.get("reply", "")),
        action=action_of(doc),
        original_headers=headers,
        now=now,
        retry_until=retry_until,
    )
    new_id = ops.new_queue_id(now)
    what = "delayed" if delayed else doc["recipient"]
    key = dedup.dedup_key("dsn", f"{queue_id}/{what}", sender)
    msg = ops.NewMessage(
        queue_id=new_id,
        message_id=dedup.normalize_message_id(mid),
        sender="",
        size=len(data),
        created_at=now,
        client="dsn",
        peer="127.0.0.1",
        lane="transactional",
        lane_prio=LANE_PRIORITY["transactional"],
        identity="<>",
        body=data,
        body_path=None,
        recipients=(ops.NewRecipient(sender, sender.rpartition("@")[2].lower(), key),),
    )
    window = cfg.dedup_window
    res = await writer.run(lambda c: ops.accept(c, msg, window))
    wake()
    return res.queue_id


async def on_dead_letter(
    cfg: Config, writer: SpoolWriter, doc: dict[str, Any], wake: Callable[[], None]
) -> None:
    """The engine's dead-letter hook: a dead letter or a delay warning. Its alert is in the
    outbox already (recorded with the outcome); here only the DSN to the sender, when
    `dsn.enabled`. A DSN that cannot be queued is logged, never raised."""
    if cfg.dsn.enabled and doc.get("sender"):
        try:
            await queue_dsn(cfg, writer, doc, wake)
        except Exception as e:
            log_event(
                log,
                logging.ERROR,
                "dsn_failed",
                "could not queue a DSN",
                exc=e,
                queue_id=doc.get("queue_id"),
            )
