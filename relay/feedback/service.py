"""The daemon's side of feedback: the webhook endpoints, feedback mail, and what follows an
applied event (log line, metric, alert, the in-memory suppression list).

Rules:
- `POST /feedback/<provider>` for each provider enabled in `feedback.providers`; any other
  path under /feedback/ is 404, any other method 405. Order of checks: basic auth (the
  token; 401 with a `WWW-Authenticate` challenge), the provider's own signature (401; for
  Amazon SNS a signing certificate that cannot be fetched now is 503, relay/feedback/sns.py),
  the payload (400 with the reason), then the spool. A spool failure is 503: providers
  retry, and an event is applied once however often it comes.
- The reply says what happened: 200 with counts when at least one event matched (or was a
  duplicate), 202 when the payload held events but none matched one of our recipients
  (logged), 200 for a payload with nothing to act on (deliveries, opens, ...).
- Feedback mail (to `feedback.address` or its VERP form) is parsed in a child process
  within a time budget (relay/feedback/worker.py: never on the event loop); a message
  that cannot be read, or is past a bound (MIME parts, nesting, parse time), is kept in
  `feedback_mail` with the reason and logged at WARNING, never lost and never relayed.
- Events are applied at most `apply.EVENTS_PER_JOB` per writer job, one job after the
  other: a report or webhook batch of any size never holds the spool writer for long.
  Only events tied to our sending act (apply.py); an address-only one is `unverified`:
  logged (`feedback_unverified`) and counted (`relay_feedback_not_applied`), nothing more.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hmac
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relay.authenticity import unsubscribe
from relay.config.tree import Config, FeedbackProvider
from relay.feedback import bounces, providers, sns, storage
from relay.feedback.apply import EVENTS_PER_JOB, Applied, acted_on, apply_events
from relay.feedback.events import FeedbackError, FeedbackEvent
from relay.feedback.worker import ParserWorker
from relay.mail.message import header, parse_headers, split_message
from relay.ops import alerts
from relay.ops.http import Request, Response
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import ops
from relay.spool.writer import SpoolError, SpoolWriter

log = logging.getLogger(__name__)

_PARSERS: dict[str, Callable[[bytes], list[FeedbackEvent]]] = {
    "ses": providers.parse_ses,
    "postmark": providers.parse_postmark,
    "sendgrid": providers.parse_sendgrid,
    "mailgun": providers.parse_mailgun,
    "generic": providers.parse_generic,
}
VERP_KEY = "verp_key"  # the runtime row holding the spool's VERP key (no verp_secret_file)


class FeedbackService:
    def __init__(
        self,
        config: Callable[[], Config],
        writer: SpoolWriter,
        metrics: Metrics,
        alert_sinks: Callable[[], tuple[float, list[str]]],
        on_suppressed: Callable[[str, str, float, str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.writer = writer
        self.metrics = metrics
        # (config, unsubscribe mailto address -> identity) of that config
        self._mailtos: tuple[Config, dict[str, str]] | None = None
        self.alert_sinks = alert_sinks  # (coalesce window, sinks) of alerts now
        self.on_suppressed = on_suppressed  # the inbound/engine in-memory list
        self.clock = clock
        self.verp_key = b""
        self.parser = ParserWorker()  # feedback mail is parsed off the loop
        self._sns_certs: dict[Path | None, sns.CertCache] = {}  # by CA bundle (config reloads)

    async def start(self) -> None:
        """The VERP key: `feedback.verp_secret_file`, else one kept in the spool (made once;
        every relay sharing the spool reads the same)."""
        conf = self.config().feedback
        if conf.verp_secret is not None:
            self.verp_key = conf.verp_secret
            return
        self.verp_key = await self.writer.run(_spool_verp_key)

    async def close(self) -> None:
        """Stop the parser process (it also exits by itself when idle or orphaned)."""
        await self.parser.close()

    def verp_sender(self, queue_id: str, rcpt_id: int) -> str | None:
        """The VERP envelope sender for one recipient (None: `feedback.verp` is off)."""
        conf = self.config().feedback
        if not conf.verp or conf.address is None:
            return None
        return bounces.verp_encode(conf.local, conf.domain, queue_id, rcpt_id, self.verp_key)

    # --- HTTP -----------------------------------------------------------------------------

    async def _verify_sns(self, prov: FeedbackProvider, body: bytes) -> None:
        """Amazon SNS's own signature (relay/feedback/sns.py). A body that is not an SNS
        message (SNS "raw message delivery") carries none, so it is refused."""
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise providers.SignatureError("the body is not an SNS message (not JSON)") from None
        if not isinstance(doc, dict) or "Type" not in doc:
            raise providers.SignatureError(
                "not an SNS message: raw message delivery carries no signature (turn it off"
                " for this subscription, or verify_signatures off)"
            )
        url = doc.get("SigningCertURL")
        if not isinstance(url, str):
            raise providers.SignatureError("no SigningCertURL in the SNS message")
        sns.check_cert_url(url, prov.signing_cert_hosts)
        cache = self._sns_certs.get(prov.signing_cert_ca_file)
        if cache is None:
            cache = self._sns_certs[prov.signing_cert_ca_file] = sns.CertCache(
                prov.signing_cert_ca_file
            )
        sns.verify(doc, await cache.get(url))

    async def http(self, req: Request) -> Response:
        if not req.path.startswith("/feedback/"):
            return Response.text(404, "not found")
        name = req.path[len("/feedback/") :]
        conf = self.config().feedback
        prov = conf.providers.get(name)
        if prov is None:
            return Response.text(404, "not found (is the provider in feedback.providers?)")
        if req.method != "POST":
            return Response(405, b"method not allowed\n", headers={"Allow": "POST"})
        if not _authorised(req, prov.token):
            log_event(
                log, logging.WARNING, "feedback_refused", "bad or missing token", provider=name
            )
            return Response(
                401,
                b"unauthorized\n",
                headers={"WWW-Authenticate": f'Basic realm="relay feedback {name}"'},
            )
        await req.read()  # only now, after the token: a stranger's body is never read
        now = self.clock()
        try:
            _verify(prov, req, now)
            if prov.verify_signatures:
                await self._verify_sns(prov, req.body)
        except sns.CertFetchError as e:
            log_event(
                log,
                logging.WARNING,
                "feedback_deferred",
                "the SNS signing certificate could not be fetched; SNS will retry",
                provider=name,
                error=e,
            )
            return Response.text(503, f"cannot check the signature now: {e}")
        except providers.SignatureError as e:
            log_event(
                log, logging.WARNING, "feedback_refused", "bad signature", provider=name, error=e
            )
            return Response.text(401, f"bad signature: {e}")
        try:
            events = _PARSERS[name](req.body)
        except providers.SubscriptionConfirmation as sc:
            log_event(
                log,
                logging.WARNING,
                "sns_subscription",
                "Amazon SNS asks to confirm the subscription of this endpoint: open the"
                " SubscribeURL once (or confirm it in the SNS console) to receive events",
                topic=sc.topic_arn,
                subscribe_url=sc.subscribe_url,
            )
            return Response.text(200, "subscription confirmation logged for the operator")
        except FeedbackError as e:
            log_event(
                log, logging.WARNING, "feedback_refused", "bad payload", provider=name, error=e
            )
            return Response.text(400, f"bad payload: {e}")
        try:
            results = await self.apply(events)
        except (SpoolError, sqlite3.Error, OSError) as e:
            log_event(log, logging.ERROR, "feedback_failed", "spool error", provider=name, exc=e)
            return Response.text(503, "spool unavailable; try again later")
        doc = _summary(results)
        status = 202 if events and doc["unmatched"] + doc["unverified"] == len(events) else 200
        return Response(status, json.dumps(doc).encode() + b"\n", "application/json")

    # --- mail -----------------------------------------------------------------------------

    def is_feedback_rcpt(self, address: str) -> bool:
        """Mail for us, not to relay: the feedback address (and its VERP form) and every
        identity's one-click unsubscribe `mailto` address."""
        conf = self.config().feedback
        if conf.address is not None and bounces.is_feedback_address(
            address, conf.local, conf.domain
        ):
            return True
        return self._unsubscribe_identity(address) is not None

    def is_unsubscribe_rcpt(self, address: str) -> bool:
        return self._unsubscribe_identity(address) is not None

    def _unsubscribe_identity(self, address: str) -> str | None:
        cfg = self.config()
        known = self._mailtos
        if known is None or known[0] is not cfg:  # worked out once per config, not per RCPT
            by_addr: dict[str, str] = {}
            for name, u in cfg.unsubscribe_confs().items():
                if u.mailto is not None:
                    by_addr.setdefault(u.mailto.lower(), name)  # the first, as before
            known = self._mailtos = (cfg, by_addr)
        return known[1].get(address.strip("<>").lower())

    async def unsubscribe_mail(self, data: bytes, *, peer: str, sender: str) -> bool:
        """Mail to an unsubscribe `mailto`: the token in its Subject (as our List-Unsubscribe
        asked) names the identity and recipient; a valid one suppresses like the one-click
        POST. Anything else is logged and dropped (it is a request, not mail to keep)."""
        head, _ = split_message(data)
        subject = header(parse_headers(head), "Subject") or ""
        token = unsubscribe.mailto_token(subject)
        found = (
            unsubscribe.verify(self.config().unsubscribe_confs(), token)
            if token is not None
            else "no token in the Subject"
        )
        if isinstance(found, str):
            log_event(
                log,
                logging.WARNING,
                "unsubscribe_refused",
                "unsubscribe mail without a valid token",
                sender=sender or "<>",
                peer=peer,
                reason=found,
            )
            return False
        identity, recipient = found
        await self.suppress_for(identity, recipient, "unsubscribe-mail")
        log_event(log, logging.INFO, "unsubscribed", "by mail", identity=identity, rcpt=recipient)
        return True

    async def suppress_for(self, identity: str, recipient: str, source: str) -> bool:
        """Suppress `recipient` for mail of `identity` (one-click unsubscribe); True when new."""
        now = self.clock()
        reason = f"unsubscribed ({source})"

        def add(c: sqlite3.Connection) -> bool:
            if ops.suppression_get(c, recipient, identity) is not None:
                return False
            return ops.suppression_add(c, recipient, reason, now, identity, source)

        new = await self.writer.run(add)
        self.on_suppressed(recipient, reason, now, identity)
        return bool(new)

    async def mail(
        self,
        data: bytes,
        *,
        peer: str,
        sender: str,
        rcpts: Sequence[str],
        size: int | None = None,
    ) -> int:
        """Feedback mail: parse, apply, keep what cannot be read. Returns the events found."""
        conf = self.config().feedback
        now = self.clock()
        parsed = await self.parser.parse(data)
        events, error = list(parsed.events), parsed.error
        if error is not None:
            self.metrics.feedback_not_applied.labels(
                bounces.PROVIDER, "past_bound" if parsed.past_bound else "unreadable"
            ).inc()
        verp: tuple[str, int] | None = None
        for r in rcpts:
            verp = verp or bounces.verp_decode(r, conf.local, conf.domain, self.verp_key)
        if verp is not None:
            if events:
                events = bounces.events_for_verp(events, *verp)
            elif error is not None:
                # a failure notice we cannot read, but the address says whose it is
                error = f"{error} (VERP names {verp[0]}, recipient {verp[1]}: kept, not applied)"

        # bounded: cut at mail_max_stored, the oldest dropped past mail_budget (storage.py)
        row = storage.Mail(now, peer, sender, ",".join(rcpts), data, len(events), error, size)
        cap, budget = conf.mail_max_stored, conf.mail_budget
        storage.report(
            await self.writer.run(lambda c: storage.keep(c, row, cap, budget)), self.metrics, peer
        )
        if error is not None:
            log_event(
                log,
                logging.WARNING,
                "feedback_unreadable",
                "feedback mail kept unread: see `relay feedback list`",
                sender=sender or "<>",
                peer=peer,
                size=len(data),
                error=error,
            )
            return 0
        await self.apply(events)
        return len(events)

    # --- applying -------------------------------------------------------------------------

    async def apply(self, events: Sequence[FeedbackEvent]) -> list[Applied]:
        now = self.clock()
        coalesce, sinks = self.alert_sinks()

        def alert(c: sqlite3.Connection, a: Applied) -> None:
            ev = _alert_event(a)
            if ev is not None:
                alerts.record(c, ev, now, coalesce, sinks)

        results: list[Applied] = []
        acted: set[int] = set()
        for start in range(0, len(events), EVENTS_PER_JOB):
            job = functools.partial(
                _apply_chunk, events[start : start + EVENTS_PER_JOB], now, alert, frozenset(acted)
            )
            part = await self.writer.run(job)
            acted |= acted_on(part)
            results.extend(part)
        for a in results:
            self._report(a, now)
        return results

    def _report(self, a: Applied, now: float) -> None:
        ev = a.event
        if a.outcome in ("unverified", "unmatched"):
            self.metrics.feedback_not_applied.labels(ev.provider, a.outcome).inc()
        if a.outcome == "unverified":
            log_event(  # INFO, as feedback_unmatched: one forged report can name 1,000
                log,
                logging.INFO,
                "feedback_unverified",
                f"{ev.type} not tied to our sending (no VERP token, upstream id, Message-ID or"
                " queue id of the message): nothing suppressed",
                provider=ev.provider,
                rcpt=ev.recipient,
                event_id=ev.event_id,
            )
            return
        if a.outcome == "repeat":
            log_event(
                log,
                logging.INFO,
                "feedback_repeat",
                "recipient already acted on by this report",
                provider=ev.provider,
                queue_id=a.queue_id,
                event_id=ev.event_id,
            )
            return
        if a.outcome == "duplicate":
            log_event(
                log,
                logging.INFO,
                "feedback_duplicate",
                "event already applied",
                provider=ev.provider,
                event_id=ev.event_id,
            )
            return
        self.metrics.feedback_events.labels(ev.provider, ev.type).inc()
        fields: dict[str, Any] = {
            "provider": ev.provider,
            "rcpt": ev.recipient,
            "queue_id": a.queue_id,
            "identity": a.identity,
            "matched_by": a.matched_by,
            "reason": ev.reason or None,
            "status": ev.status,
        }
        if a.outcome == "unmatched":
            log_event(
                log,
                logging.INFO,
                "feedback_unmatched",
                f"{ev.type} for no recipient of ours",
                **fields,
                upstream_id=ev.upstream_id,
                message_id=ev.message_id,
            )
        elif ev.type == "bounce":
            assert a.address is not None
            self.on_suppressed(a.address, f"late bounce ({ev.provider})", now, "")
            log_event(
                log, logging.WARNING, "late_bounce", "bounced after delivery; suppressed", **fields
            )
        elif ev.type == "complaint":
            assert a.address is not None and a.identity is not None
            self.on_suppressed(a.address, f"complaint ({ev.provider})", now, a.identity)
            log_event(
                log,
                logging.WARNING,
                "complaint",
                "recipient complained; suppressed for this identity",
                **fields,
            )
        else:
            log_event(log, logging.INFO, "soft_bounce", "temporary failure reported", **fields)


def _apply_chunk(
    events: Sequence[FeedbackEvent],
    now: float,
    alert: Callable[[sqlite3.Connection, Applied], None],
    acted: frozenset[int],
    c: sqlite3.Connection,
) -> list[Applied]:
    """One writer job: at most EVENTS_PER_JOB events in one transaction."""
    return apply_events(c, events, now, alert, acted)


def _alert_event(a: Applied) -> alerts.Event | None:
    ev = a.event
    if ev.type == "soft_bounce":
        return None
    key = a.identity or "?"
    sample = alerts.sample(a.queue_id or "", a.address or ev.recipient, ev.reason or ev.type)
    if ev.type == "bounce":
        return alerts.Event(
            "late_bounce", "warning", key, f"late bounces for mail of {key}", sample
        )
    return alerts.Event("complaint", "warning", key, f"complaints about mail of {key}", sample)


def _summary(results: Sequence[Applied]) -> dict[str, int]:
    doc = {"events": len(results), "applied": 0, "duplicates": 0, "unmatched": 0, "unverified": 0}
    for a in results:
        if a.outcome in ("duplicate", "repeat"):
            doc["duplicates"] += 1
        elif a.outcome in ("unmatched", "unverified"):
            doc[a.outcome] += 1
        else:
            doc["applied"] += 1
    return doc


def _authorised(req: Request, token: str) -> bool:
    value = req.headers.get("authorization", "")
    scheme, _, cred = value.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(cred.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    _user, colon, password = decoded.partition(b":")
    ok: bool = hmac.compare_digest(password, token.encode("utf-8"))
    return bool(colon) and ok


def _verify(prov: FeedbackProvider, req: Request, now: float) -> None:
    if prov.name == "mailgun":
        assert prov.signing_key is not None
        providers.verify_mailgun(req.body, prov.signing_key, now=now)
    elif prov.name == "sendgrid" and prov.public_key is not None:
        sig = req.headers.get("x-twilio-email-event-webhook-signature", "")
        ts = req.headers.get("x-twilio-email-event-webhook-timestamp", "")
        if not sig or not ts:
            raise providers.SignatureError("no X-Twilio-Email-Event-Webhook-Signature/Timestamp")
        providers.verify_sendgrid(req.body, sig, ts, prov.public_key)


def _spool_verp_key(c: sqlite3.Connection) -> bytes:
    import secrets

    row = c.execute("SELECT value FROM runtime WHERE name = ?", (VERP_KEY,)).fetchone()
    if row is not None:
        return bytes.fromhex(row[0])
    key = secrets.token_bytes(32)
    c.execute(
        "INSERT INTO runtime (name, value, updated_at) VALUES (?,?,?) ON CONFLICT DO NOTHING",
        (VERP_KEY, key.hex(), time.time()),
    )
    row = c.execute("SELECT value FROM runtime WHERE name = ?", (VERP_KEY,)).fetchone()
    return bytes.fromhex(str(row[0]))
