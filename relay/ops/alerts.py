"""Alerts: one durable outbox in the spool, coalesced, handed to the operator's sinks.

Rules:
- An alert is a row in the spool's `alerts` table before any sink sees it: a crash, a
  restart or a sink that is down loses none. Each row remembers which sinks still need it;
  a sink that took it is never given it again (a crash between a sink's success and the
  row's update can repeat it once: at-least-once, with a stable `id` receivers can dedup on).
  An update that fails while the daemon runs (the spool away, a commit lost to a database
  restart) is kept in memory and made again by the next pass, which does not send again.
- Coalescing: events of one (event, key) within `alerts.coalesce` make one alert with a
  `count` and a few samples. Dead letters and delay warnings wait for their window to close
  (1,000 dead letters to one domain in a minute make one alert, not 1,000); health
  transitions (`health`, `resolved`, `upstream_config_error`) are single state changes and
  go at once.
- Sinks: `alerts.command` (one process per alert, the JSON document on stdin, through
  `/bin/sh -c`, killed after `alerts.timeout`) and `alerts.webhook` (an HTTP POST of the
  same JSON, signed `X-Relay-Signature: sha256=<hex HMAC-SHA256 of the body>` with the
  secret, the GitHub convention). A failing sink is retried with capped exponential backoff
  and logged; no sink ever holds up delivery. An alert no sink took within
  `GIVE_UP_AFTER` is logged at ERROR as `alert_dropped`.
- A health transition the spool cannot take (a PostgreSQL spool whose database is down,
  full or read-only: the very thing the alert is about) is not lost: it is held in memory
  and handed to the sinks at once, with the id `<host>/mem-<pid>-<n>`, then recorded in
  the outbox once the spool takes writes again (as sent, or with the sinks still owed it,
  which the outbox then retries). At most `MAX_UNSPOOLED` are held; a restart loses them.
- The document (version 1) is in README "Monitoring and alerts".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import random
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay.config.tree import Alerts as AlertsConf
from relay.ops import shell
from relay.ops.logs import log_event, mask_address, redact_text, redact_webhook_url
from relay.spool import ops

# httpx loads with the first webhook (`relay alerts` only reads the spool; the daemon has it
# loaded from the start, relay/delivery/oauth.py)
if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

VERSION = 1
MAX_SAMPLES = 5
GIVE_UP_AFTER = 86400.0
BACKOFF_CAP = 60.0
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
# events that are single state changes: sent at once, not held for the coalescing window
IMMEDIATE = frozenset(
    {"health", "resolved", "upstream_config_error", "circuit_open", "circuit_closed"}
)
# the health transitions held in memory when the spool cannot record them (see the rules)
HELD = frozenset({"health", "resolved"})


MAX_UNSPOOLED = 100


@dataclass(frozen=True, slots=True)
class Event:
    event: str
    severity: str  # info | warning | critical
    key: str  # the destination or check it is about
    summary: str  # one line a person can read
    sample: dict[str, Any] | None = None  # {queue_id, recipient (masked), reply}


def sample(queue_id: str, recipient: str, reply: str) -> dict[str, Any]:
    return {"queue_id": queue_id, "recipient": mask_address(recipient), "reply": reply}


def sinks_of(conf: AlertsConf) -> list[str]:
    out = []
    if conf.command:
        out.append("command")
    if conf.webhook is not None:
        out.append("webhook")
    return out


# --- the outbox (SQL; run on the spool writer) ----------------------------------------------


def record(
    conn: sqlite3.Connection, ev: Event, now: float, coalesce: float, sinks: Sequence[str]
) -> int:
    """Add one event: to the open alert of its (event, key) if its window is still open,
    else as a new alert. Returns the alert's id."""
    if ev.event not in IMMEDIATE:
        row = conn.execute(
            "SELECT id, count, samples, severity FROM alerts WHERE event = ? AND key = ?"
            " AND sent_at IS NULL AND attempts = 0 AND send_at > ? ORDER BY id DESC LIMIT 1",
            (ev.event, ev.key, now),
        ).fetchone()
        if row is not None:
            samples = json.loads(row[2])
            if ev.sample is not None and len(samples) < MAX_SAMPLES:
                samples.append(ev.sample)
            sev = max(row[3], ev.severity, key=SEVERITY_RANK.__getitem__)
            conn.execute(
                "UPDATE alerts SET count = count + 1, last_at = ?, samples = ?, severity = ?,"
                " summary = ? WHERE id = ?",
                (now, json.dumps(samples), sev, ev.summary, row[0]),
            )
            return int(row[0])
    send_at = now if ev.event in IMMEDIATE else now + coalesce
    cur = conn.execute(
        "INSERT INTO alerts (event, severity, key, count, first_at, last_at, send_at, summary,"
        " samples, sinks, next_try_at, sent_at) VALUES (?,?,?,1,?,?,?,?,?,?,?,?) RETURNING id",
        (
            ev.event,
            ev.severity,
            ev.key,
            now,
            now,
            send_at,
            ev.summary,
            json.dumps([ev.sample] if ev.sample is not None else []),
            json.dumps(list(sinks)),
            send_at,
            None if sinks else now,
        ),
    )
    return int(cur.fetchone()[0])


def due(conn: sqlite3.Connection, now: float, limit: int = 50) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT id, event, severity, key, count, first_at, last_at, summary, samples, sinks,"
        " attempts FROM alerts WHERE sent_at IS NULL AND next_try_at <= ? ORDER BY id LIMIT ?",
        (now, limit),
    ).fetchall()
    return [
        {
            "id": r[0],
            "event": r[1],
            "severity": r[2],
            "key": r[3],
            "count": r[4],
            "first_at": r[5],
            "last_at": r[6],
            "summary": r[7],
            "samples": json.loads(r[8]),
            "sinks": json.loads(r[9]),
            "attempts": r[10],
        }
        for r in rows
    ]


def retry_now(conn: sqlite3.Connection, now: float) -> int:
    return conn.execute(
        "UPDATE alerts SET next_try_at = ? WHERE sent_at IS NULL AND attempts > 0"
        " AND next_try_at > ?",
        (now, now),
    ).rowcount


def next_due_at(conn: sqlite3.Connection) -> float | None:
    row = conn.execute("SELECT min(next_try_at) FROM alerts WHERE sent_at IS NULL").fetchone()
    return None if row is None or row[0] is None else float(row[0])


def mark(
    conn: sqlite3.Connection,
    alert_id: int,
    remaining: Sequence[str],
    now: float,
    error: str | None,
    next_try_at: float,
) -> None:
    if not remaining:
        conn.execute(
            "UPDATE alerts SET sinks = '[]', sent_at = ?, last_error = NULL WHERE id = ?",
            (now, alert_id),
        )
    else:
        conn.execute(
            "UPDATE alerts SET sinks = ?, attempts = attempts + 1, next_try_at = ?,"
            " last_error = ? WHERE id = ?",
            (json.dumps(list(remaining)), next_try_at, error, alert_id),
        )


def recent(conn: sqlite3.Connection, limit: int = 50) -> list[dict[str, Any]]:
    """The newest alerts, for `relay alerts`."""
    rows = conn.execute(
        "SELECT id, event, severity, key, count, first_at, last_at, summary, sinks, attempts,"
        " last_error, sent_at FROM alerts ORDER BY id DESC LIMIT ?",
        (limit,),
    ).fetchall()
    return [
        {
            "id": r[0],
            "event": r[1],
            "severity": r[2],
            "key": r[3],
            "count": r[4],
            "first_at": ops.iso_utc(r[5]),
            "last_at": ops.iso_utc(r[6]),
            "summary": r[7],
            "pending_sinks": json.loads(r[8]),
            "attempts": r[9],
            "last_error": r[10],
            "sent_at": None if r[11] is None else ops.iso_utc(r[11]),
        }
        for r in rows
    ]


def document(row: dict[str, Any], hostname: str) -> dict[str, Any]:
    """The versioned JSON every sink receives."""
    n = int(row["count"])
    summary = (
        row["summary"]
        if n == 1
        else f"{n} {row['event']} events for {row['key']}; latest: {row['summary']}"
    )
    return {
        "version": VERSION,
        "id": f"{hostname}/{row['id']}",
        "host": hostname,
        "event": row["event"],
        "severity": row["severity"],
        "key": row["key"],
        "count": n,
        "first_at": ops.iso_utc(row["first_at"]),
        "last_at": ops.iso_utc(row["last_at"]),
        "summary": summary,
        "samples": row["samples"],
    }


def sign(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


# --- the sinks ------------------------------------------------------------------------------


async def run_command(command: str, doc: dict[str, Any], timeout: float) -> str | None:
    """Run the alert command; None when it worked, else what went wrong."""
    payload = json.dumps(doc, sort_keys=True).encode() + b"\n"
    try:
        done = await shell.run(command, timeout, stdin=payload, stderr=True)
    except TimeoutError:  # (an OSError too: first)
        return f"alert command timed out after {timeout:g}s"
    except OSError as e:
        return f"alert command did not start: {e}"
    if done.returncode != 0:
        text = done.stderr[:300].decode(errors="replace").strip()
        return f"alert command exited {done.returncode}" + (f": {text}" if text else "")
    return None


async def post_webhook(
    client: httpx.AsyncClient, url: str, secret: bytes | None, doc: dict[str, Any], timeout: float
) -> str | None:
    """POST the alert; None when the receiver answered 2xx, else what went wrong."""
    import httpx

    body = json.dumps(doc, sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "relay-alerts/1",
        "X-Relay-Event": str(doc["event"]),
        "X-Relay-Delivery": str(doc["id"]),
    }
    if secret is not None:
        headers["X-Relay-Signature"] = sign(secret, body)
    try:
        r = await client.post(url, content=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        if not str(e):
            return f"webhook: {type(e).__name__}"
        # the error is stored, logged and shown by /health: never with the URL (a secret)
        text = str(e).replace(url, redact_webhook_url(url))
        return f"webhook: {type(e).__name__}: {redact_text(text)}"
    if not 200 <= r.status_code < 300:
        return f"webhook answered HTTP {r.status_code}"
    return None


@dataclass(slots=True)
class Unspooled:
    """A health transition the spool could not record (see the rules): its sinks are given
    it from memory; it is recorded once the spool takes writes again."""

    ev: Event
    at: float
    n: int
    sinks: list[str]  # the sinks that have not taken it yet
    attempts: int = 0
    next_try_at: float = 0.0

    def row(self) -> dict[str, Any]:
        return {
            "id": f"mem-{os.getpid()}-{self.n}",
            "event": self.ev.event,
            "severity": self.ev.severity,
            "key": self.ev.key,
            "count": 1,
            "first_at": self.at,
            "last_at": self.at,
            "summary": self.ev.summary,
            "samples": [self.ev.sample] if self.ev.sample is not None else [],
            "sinks": list(self.sinks),
            "attempts": self.attempts,
        }


class Dispatcher:
    """Hands due alerts to the sinks; one background task of the daemon."""

    def __init__(
        self,
        writer: Any,
        conf: Callable[[], AlertsConf],
        hostname: Callable[[], str],
        clock: Callable[[], float],
    ) -> None:
        self.writer = writer
        self.conf = conf
        self.hostname = hostname
        self.clock = clock
        self._wake = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self.rng = random.Random()
        self.unspooled: list[Unspooled] = []
        self._unspooled_n = 0
        # alert id -> what its sinks said (`mark`'s arguments), for an alert handed to its
        # sinks whose record of that failed (the spool away, a commit lost to a database
        # restart): the next pass records it again instead of sending it again
        self._unmarked: dict[int, tuple[list[str], float, str | None, float]] = {}

    def wake(self) -> None:
        self._wake.set()

    async def add(self, ev: Event) -> None:
        """Record an event in the outbox (durable before this returns)."""
        conf = self.conf()
        now = self.clock()
        sinks = sinks_of(conf)
        try:
            await self.writer.run(lambda c: record(c, ev, now, conf.coalesce, sinks))
        except Exception as e:
            if not (ev.event in HELD and sinks) or len(self.unspooled) >= MAX_UNSPOOLED:
                raise
            self._unspooled_n += 1
            self.unspooled.append(Unspooled(ev, now, self._unspooled_n, list(sinks)))
            log_event(
                log,
                logging.WARNING,
                "alert_failed",
                "the spool cannot record this alert; sending it from memory",
                alert_event=ev.event,
                key=ev.key,
                exc=e,
            )
        if ev.event in IMMEDIATE:
            self.wake()

    async def run(self) -> None:
        now = self.clock()
        try:  # a restart is a fresh try for alerts a sink refused (not for open windows)
            await self.writer.run(lambda c: retry_now(c, now))
        except Exception as e:
            log_event(log, logging.ERROR, "alert_failed", "alert outbox unreadable", exc=e)
        try:
            while True:
                nxt: float | None = None
                if self.unspooled:  # first, and whatever the spool does
                    nxt = await self.unspooled_pass()
                try:
                    await self.pass_once()
                    spooled = await self.writer.run(next_due_at)
                    if spooled is not None:
                        nxt = spooled if nxt is None else min(nxt, spooled)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log_event(log, logging.ERROR, "alert_failed", "alert dispatch failed", exc=e)
                wait = 1.0 if nxt is None else min(1.0, max(0.05, nxt - self.clock()))
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
        finally:
            if self._client is not None:
                await self._client.aclose()

    async def unspooled_pass(self) -> float | None:
        """Give the held alerts to the sinks that still need them, and record in the outbox
        those the spool now takes; returns when the next held one is due (None: none left)."""
        conf = self.conf()
        for u in list(self.unspooled):
            now = self.clock()
            if u.next_try_at > now:
                continue
            if u.sinks:
                remaining, error = await self._deliver(u.row(), conf)
                if remaining and now - u.at > GIVE_UP_AFTER:
                    remaining = []
                if error is not None:
                    log_event(
                        log,
                        logging.ERROR,
                        "alert_failed",
                        "alert sink failed; will retry",
                        alert_id=u.row()["id"],
                        alert_event=u.ev.event,
                        key=u.ev.key,
                        error=error,
                    )
                else:
                    log_event(
                        log,
                        logging.INFO,
                        "alert_sent",
                        u.ev.summary,
                        alert_id=u.row()["id"],
                        alert_event=u.ev.event,
                        key=u.ev.key,
                        count=1,
                        sinks=u.sinks,
                    )
                u.sinks = remaining
            try:  # the outbox takes it over: history, and the sinks still owed it
                job = functools.partial(record, ev=u.ev, now=u.at, coalesce=0.0, sinks=u.sinks)
                await self.writer.run(job)
            except Exception:
                delay = min(BACKOFF_CAP, 2.0 ** min(u.attempts, 16))
                u.attempts += 1
                u.next_try_at = now + (delay / 2 + self.rng.uniform(0, delay / 2))
                continue
            self.unspooled.remove(u)
        return min((u.next_try_at for u in self.unspooled), default=None)

    async def _deliver(self, row: dict[str, Any], conf: AlertsConf) -> tuple[list[str], str | None]:
        """Give one alert to each of its sinks: the sinks that failed, and their errors."""
        doc = document(row, self.hostname())
        remaining: list[str] = []
        errors: list[str] = []
        for sink in row["sinks"]:
            err: str | None
            if sink == "command" and conf.command:
                err = await run_command(conf.command, doc, conf.timeout)
            elif sink == "webhook" and conf.webhook is not None:
                if self._client is None:
                    import httpx

                    self._client = httpx.AsyncClient(follow_redirects=False)
                wh = conf.webhook
                err = await post_webhook(self._client, wh.url, wh.secret, doc, wh.timeout)
            else:
                log_event(
                    log,
                    logging.WARNING,
                    "alert_failed",
                    "alert sink no longer configured; skipped",
                    sink=sink,
                    alert_id=row["id"],
                )
                continue
            if err is not None:
                remaining.append(sink)
                errors.append(err)
        return remaining, "; ".join(errors) or None

    async def pass_once(self) -> int:
        now = self.clock()
        rows = await self.writer.run(lambda c: due(c, now))
        for row in rows:
            await self._send(row)
        return len(rows)

    async def _record(self, alert_id: int) -> None:
        """What the sinks said of a sent alert (`_unmarked`) into its row; kept until that
        commits."""
        owed = self._unmarked[alert_id]
        await self.writer.run(lambda c: mark(c, alert_id, *owed))
        del self._unmarked[alert_id]

    async def _send(self, row: dict[str, Any]) -> None:
        alert_id = int(row["id"])
        if alert_id in self._unmarked:  # sent already: only its record is owed (see __init__)
            await self._record(alert_id)
            return
        conf = self.conf()
        doc = document(row, self.hostname())
        remaining, error = await self._deliver(row, conf)
        now = self.clock()
        if remaining and now - float(row["first_at"]) > GIVE_UP_AFTER:
            log_event(
                log,
                logging.ERROR,
                "alert_dropped",
                "no sink took this alert for a day; giving up",
                alert_id=row["id"],
                alert_event=row["event"],
                key=row["key"],
                error=error,
            )
            remaining = []
        delay = min(BACKOFF_CAP, 2.0 ** int(row["attempts"]))
        delay = delay / 2 + self.rng.uniform(0, delay / 2)
        self._unmarked[alert_id] = (remaining, now, error, now + delay)
        await self._record(alert_id)
        if error is not None:
            log_event(
                log,
                logging.ERROR,
                "alert_failed",
                "alert sink failed; will retry" if remaining else "alert sink failed",
                alert_id=alert_id,
                alert_event=row["event"],
                key=row["key"],
                error=error,
                retry_in=round(delay, 1) if remaining else None,
            )
        else:
            log_event(
                log,
                logging.INFO,
                "alert_sent",
                doc["summary"],
                alert_id=alert_id,
                alert_event=row["event"],
                key=row["key"],
                count=row["count"],
                sinks=row["sinks"],
            )
