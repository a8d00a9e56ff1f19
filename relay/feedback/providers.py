"""Providers' event webhooks become `FeedbackEvent`s; their signatures are checked offline
(pure: bytes in, events or an exception out; no network, no clock but the one passed in).

Rules:
- One parser per provider (`parse_ses`, `parse_postmark`, `parse_sendgrid`, `parse_mailgun`,
  `parse_generic`), each taking the raw HTTP body. A payload with nothing to act on
  (deliveries, opens, clicks, unsubscribes, ...) is an empty list, not an error.
- A body that is not UTF-8, not JSON, or not of the provider's shape raises `FeedbackError`
  with a short reason (the daemon answers 400 with it). Nothing else escapes: every field is
  type-checked. A text field of the wrong type counts as absent; a container that gives the
  payload its shape (SendGrid's array, Mailgun's `event-data`, SES's `bounce`, a recipient
  list) of the wrong type is an error. An event, or a recipient entry, without a usable
  address is skipped. A string with a lone surrogate (`"\\ud800"`) is refused: it could not
  be stored or logged.
- Types: a permanent failure is "bounce" (the address is bad: the daemon suppresses it); a
  temporary one, or a failure that says nothing about the address (content, reputation,
  DMARC, a provider's quota), is "soft_bounce" (recorded, nothing suppressed); a recipient's
  spam report is "complaint". Unsubscribes are none of these: no event.
- Ids: `event_id` is the provider's own id for the event (see each parser), else
  `content_id` of the event's content, so a redelivered event is the same event. Several
  recipients of one notification share its `event_id` (the daemon dedups on (provider,
  event_id, recipient)). `message_id` is the original's Message-ID as the provider gives it,
  with or without <> (the daemon normalizes); `upstream_id` is the id the provider's SMTP
  server gave in its 250 (SES: "250 Ok <id>", SendGrid: "250 Ok: queued as <id>").
- `reason` is the most specific human-readable diagnostic the payload has, whitespace and
  control characters collapsed to single spaces, at most 500 characters; `status` is an RFC
  3463 code ("5.1.1") from the payload's own status field, else the first one in its text.
- Signatures: `verify_mailgun` (HMAC-SHA256 of timestamp + token, stale timestamps refused)
  and `verify_sendgrid` (ECDSA P-256 over timestamp + raw body) raise `SignatureError`.
  Amazon SNS message signatures need AWS's certificate fetched over the network: they are
  checked by relay/feedback/sns.py when `verify_signatures` is on, before these parsers run.
  Postmark signs nothing (basic auth only).
- An SNS `SubscriptionConfirmation` raises `SubscriptionConfirmation`: the operator confirms
  it (the daemon logs the URL); it is never visited from here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
from typing import Any, Final

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from relay.feedback.events import EVENT_TYPES, EventType, FeedbackError, FeedbackEvent, content_id

REASON_MAX: Final = 500
_STATUS_IN_TEXT = re.compile(r"(?<![\d.])([245]\.\d{1,3}\.\d{1,3})(?![\d.])")
_STATUS = re.compile(r"[245]\.\d{1,3}\.\d{1,3}")
_CONTROLS = {i: " " for i in (*range(32), 127)}
_Obj = dict[str, Any]


class SignatureError(Exception):
    """A webhook call whose signature is missing, malformed, wrong or stale: HTTP 401."""


class SubscriptionConfirmation(Exception):  # named after the SNS message Type
    """Amazon SNS asks to confirm that this endpoint wants the topic's notifications. Not an
    error of the payload: the operator confirms it by opening `subscribe_url` once (or in the
    SNS console)."""

    def __init__(self, topic_arn: str, subscribe_url: str) -> None:
        super().__init__(topic_arn, subscribe_url)
        self.topic_arn = topic_arn
        self.subscribe_url = subscribe_url

    def __str__(self) -> str:
        return (
            f"Amazon SNS asks to confirm the subscription of this endpoint to topic"
            f" {self.topic_arn!r}: if you subscribed it, open {self.subscribe_url!r} once"
            " (or confirm it in the SNS console); no event arrives before that"
        )


# --- Amazon SES (through SNS) ----------------------------------------------------------------


def parse_ses(body: bytes) -> list[FeedbackEvent]:
    """Amazon SES notifications as SNS delivers them to an HTTPS subscription (the body is
    the SNS message, its `Message` the SES notification as a JSON string), or the SES
    notification itself (SNS "raw message delivery").

    - `notificationType` (identity notifications) or `eventType` (configuration-set event
      publishing): Bounce with `bounceType` Permanent -> bounce, Transient or Undetermined
      (SES sends those only once it has stopped retrying) -> soft_bounce; Complaint ->
      complaint; DeliveryDelay (event publishing) -> soft_bounce; anything else (Delivery,
      Send, Open, AmazonSnsSubscriptionSucceeded, ...) -> nothing.
    - One event per entry of `bouncedRecipients` / `complainedRecipients` /
      `delayedRecipients`, all with the notification's event_id: the SNS `MessageId` (the
      same on SNS's retries), else (raw delivery) the SES `feedbackId`, else `content_id`.
    - upstream_id: `mail.messageId` (SES's id, the one in its "250 Ok <id>"); message_id:
      `mail.commonHeaders.messageId`, else the Message-ID in `mail.headers` (present when
      the notifications include the original headers).
    - An SNS Notification whose Message is not a JSON object (SES's "Successfully validated
      SNS topic ..." notice) -> nothing; UnsubscribeConfirmation -> nothing.
    """
    doc = _load(body, "ses")
    if not isinstance(doc, dict):
        raise FeedbackError(f"ses: expected a JSON object (an SNS message), got {_kind(doc)}")
    if "Type" in doc:
        return _sns(doc)
    if "notificationType" in doc or "eventType" in doc:
        return _ses_notification(doc, None)
    raise FeedbackError(
        "ses: neither an SNS message (no 'Type') nor an SES notification"
        " (no 'notificationType' or 'eventType')"
    )


def _sns(doc: _Obj) -> list[FeedbackEvent]:
    kind = doc.get("Type")
    if kind == "SubscriptionConfirmation":
        url = _text(doc.get("SubscribeURL"), "ses: SubscribeURL")
        if url is None:
            raise FeedbackError("ses: an SNS SubscriptionConfirmation without a SubscribeURL")
        raise SubscriptionConfirmation(_text(doc.get("TopicArn"), "ses: TopicArn") or "", url)
    if kind == "UnsubscribeConfirmation":
        return []
    if kind != "Notification":
        raise FeedbackError(f"ses: unknown SNS message Type {_short(kind)}")
    message = doc.get("Message")
    if not isinstance(message, str):
        raise FeedbackError("ses: an SNS Notification without a 'Message' string")
    sns_id = _ident(doc.get("MessageId"), "ses: MessageId")
    if not message.lstrip().startswith("{"):
        return []  # a notice in plain text, not a notification
    inner = _parse_json(message, "ses: the SNS Message")
    if not isinstance(inner, dict):
        return []
    if "notificationType" not in inner and "eventType" not in inner:
        raise FeedbackError(
            "ses: the SNS Message is not an SES notification (no notificationType or eventType)"
        )
    return _ses_notification(inner, sns_id)


def _ses_notification(n: _Obj, sns_id: str | None) -> list[FeedbackEvent]:
    kind = _text(n.get("notificationType"), "ses: notificationType") or _text(
        n.get("eventType"), "ses: eventType"
    )
    if kind not in ("Bounce", "Complaint", "DeliveryDelay"):
        return []
    mail = _opt_obj(n, "mail", "ses: mail")
    upstream_id = _text(mail.get("messageId"), "ses: mail.messageId")
    message_id = _ses_message_id(mail)
    etype: EventType
    if kind == "Bounce":
        part = _req_obj(n, "bounce", "ses: a Bounce notification")
        btype = _text(part.get("bounceType"), "ses: bounce.bounceType")
        subtype = _text(part.get("bounceSubType"), "ses: bounce.bounceSubType")
        etype = "bounce" if btype == "Permanent" else "soft_bounce"
        entries = _entries(part, "bouncedRecipients", "ses: bounce.bouncedRecipients")
        summary = f"{btype or 'Undetermined'} bounce" + (f": {subtype}" if subtype else "")
    elif kind == "Complaint":
        part = _req_obj(n, "complaint", "ses: a Complaint notification")
        etype = "complaint"
        entries = _entries(part, "complainedRecipients", "ses: complaint.complainedRecipients")
        summary = (
            _text(part.get("complaintFeedbackType"), "ses: complaint.complaintFeedbackType")
            or _text(part.get("complaintSubType"), "ses: complaint.complaintSubType")
            or "complaint"
        )
    else:
        part = _req_obj(n, "deliveryDelay", "ses: a DeliveryDelay event")
        etype = "soft_bounce"
        entries = _entries(part, "delayedRecipients", "ses: deliveryDelay.delayedRecipients")
        delay = _text(part.get("delayType"), "ses: deliveryDelay.delayType")
        summary = "delivery delayed" + (f": {delay}" if delay else "")
    event_id = (
        sns_id
        or _ident(part.get("feedbackId"), "ses: feedbackId")
        or content_id(kind, upstream_id, message_id, _scalar(part.get("timestamp")))
    )
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        rcpt = _text(entry.get("emailAddress"), "ses: emailAddress")
        if rcpt is None:
            continue
        diag = _text(entry.get("diagnosticCode"), "ses: diagnosticCode")
        out.append(
            FeedbackEvent(
                provider="ses",
                type=etype,
                recipient=rcpt,
                event_id=event_id,
                message_id=message_id,
                upstream_id=upstream_id,
                reason=_reason(diag, summary),
                status=_status(entry.get("status"), diag),
            )
        )
    return out


def _ses_message_id(mail: _Obj) -> str | None:
    common = _opt_obj(mail, "commonHeaders", "ses: mail.commonHeaders")
    mid = _text(common.get("messageId"), "ses: mail.commonHeaders.messageId")
    if mid is not None:
        return mid
    for h in _entries(mail, "headers", "ses: mail.headers"):
        if isinstance(h, dict):
            name = h.get("name")
            if isinstance(name, str) and name.strip().lower() == "message-id":
                return _text(h.get("value"), "ses: mail.headers Message-ID")
    return None


# --- Postmark --------------------------------------------------------------------------------

# Postmark's bounce types (developer/api/bounce-api#bounce-types): by `Type`, the name; its
# `TypeCode` only when the name is missing or new (the spam complaint webhook's documented
# example says Type "SpamComplaint" with TypeCode 512, SpamNotification's code).
_POSTMARK_TYPES: Final[dict[str, EventType | None]] = {
    "HardBounce": "bounce",  # unknown user, mailbox not found
    "BadEmailAddress": "bounce",  # not a valid address
    "ManuallyDeactivated": "bounce",  # deactivated in Postmark: it refuses to send there
    "SpamComplaint": "complaint",
    "Transient": "soft_bounce",  # "message delayed"
    "SoftBounce": "soft_bounce",  # mailbox full, account disabled, over quota
    "DnsError": "soft_bounce",  # a temporary DNS error
    "SpamNotification": "soft_bounce",  # a filter's verdict, not the recipient's report
    "Unknown": "soft_bounce",  # an NDR Postmark could not classify
    "VirusNotification": "soft_bounce",  # about the content
    "Blocked": "soft_bounce",  # blocked for content or blocklisting
    "DMARCPolicy": "soft_bounce",  # about our From domain
    "Unsubscribe": None,
    "Subscribe": None,
    "AutoResponder": None,
    "AddressChange": None,
    "OpenRelayTest": None,
    "ChallengeVerification": None,
    "Unconfirmed": None,
    "SMTPApiError": None,
    "InboundError": None,
    "TemplateRenderingFailed": None,
    "ManualSuppression": None,
}
_POSTMARK_CODES: Final[dict[int, str]] = {
    1: "HardBounce",
    2: "Transient",
    16: "Unsubscribe",
    32: "Subscribe",
    64: "AutoResponder",
    128: "AddressChange",
    256: "DnsError",
    512: "SpamNotification",
    1024: "OpenRelayTest",
    2048: "Unknown",
    4096: "SoftBounce",
    8192: "VirusNotification",
    16384: "ChallengeVerification",
    100000: "BadEmailAddress",
    100001: "SpamComplaint",
    100002: "ManuallyDeactivated",
    100003: "Unconfirmed",
    100006: "Blocked",
    100007: "SMTPApiError",
    100008: "InboundError",
    100009: "DMARCPolicy",
    100010: "TemplateRenderingFailed",
}


def parse_postmark(body: bytes) -> list[FeedbackEvent]:
    """Postmark's bounce webhook (`RecordType` "Bounce") and spam complaint webhook
    (`RecordType` "SpamComplaint"); a record without `RecordType` (Postmark's older hooks)
    is read by its `Type`. Other RecordTypes (Delivery, Open, Click, SubscriptionChange)
    -> nothing.

    - Type (else TypeCode): HardBounce, BadEmailAddress, ManuallyDeactivated -> bounce;
      SpamComplaint -> complaint; Transient, SoftBounce, DnsError, SpamNotification,
      Unknown, VirusNotification, Blocked, DMARCPolicy -> soft_bounce; the informational
      ones (AutoResponder, Unsubscribe, AddressChange, ChallengeVerification, ...) ->
      nothing; a type not known here -> soft_bounce.
    - recipient `Email`; event_id `ID` (the bounce's id); upstream_id `MessageID`
      (Postmark's id); message_id none (the record does not carry it); reason `Details`
      (the receiving server's words), else `Description`.
    """
    doc = _load(body, "postmark")
    if not isinstance(doc, dict):
        raise FeedbackError(f"postmark: expected a JSON object, got {_kind(doc)}")
    record = doc.get("RecordType")
    if record is not None and record not in ("Bounce", "SpamComplaint"):
        if isinstance(record, str):
            return []
        raise FeedbackError(f"postmark: RecordType is {_kind(record)}, not a string")
    name = _text(doc.get("Type"), "postmark: Type")
    if record is None and name is None:
        raise FeedbackError(
            "postmark: not a bounce or spam complaint record (no RecordType and no Type)"
        )
    etype: EventType | None
    if record == "SpamComplaint":
        etype = "complaint"
    else:
        if name not in _POSTMARK_TYPES:
            code = doc.get("TypeCode")
            if isinstance(code, int) and not isinstance(code, bool):
                name = _POSTMARK_CODES.get(code, name)
        etype = _POSTMARK_TYPES.get(name or "", "soft_bounce")
    rcpt = _text(doc.get("Email"), "postmark: Email")
    if etype is None or rcpt is None:
        return []
    details = _text(doc.get("Details"), "postmark: Details")
    description = _text(doc.get("Description"), "postmark: Description")
    upstream_id = _text(doc.get("MessageID"), "postmark: MessageID")
    event_id = _ident(doc.get("ID"), "postmark: ID") or content_id(
        "postmark", record, name, rcpt, upstream_id, _scalar(doc.get("BouncedAt"))
    )
    return [
        FeedbackEvent(
            provider="postmark",
            type=etype,
            recipient=rcpt,
            event_id=event_id,
            upstream_id=upstream_id,
            reason=_reason(details, description, _text(doc.get("Name"), "postmark: Name"), name),
            status=_status(None, details, description),
        )
    ]


# --- SendGrid --------------------------------------------------------------------------------

# `dropped` events: SendGrid did not try. Only these reasons say something about the
# address; any other (Spam Content, Invalid SMTPAPI header, Recipient List over Package
# Quota, ...) is a failure of this message alone -> soft_bounce.
_SENDGRID_DROPPED: Final[dict[str, EventType | None]] = {
    "bounced address": "bounce",  # on SendGrid's bounce list
    "invalid": "bounce",  # not a valid address
    "invalid address": "bounce",
    "spam reporting address": "complaint",  # on SendGrid's spam report list
    "unsubscribed address": None,  # the recipient's choice, not a failure of the address
}


def parse_sendgrid(body: bytes) -> list[FeedbackEvent]:
    """SendGrid's Event Webhook: a JSON array of events.

    - `bounce` with `type` "bounce" (or none: older payloads) -> bounce; with `type`
      "blocked" (or another, e.g. "expired") -> soft_bounce. `deferred` -> soft_bounce.
      `spamreport` -> complaint. `dropped` by its `reason`: "Bounced Address", "Invalid" ->
      bounce; "Spam Reporting Address" -> complaint; "Unsubscribed Address" -> nothing; any
      other reason -> soft_bounce. Other events (processed, delivered, open, click,
      unsubscribe, group_unsubscribe, ...) -> nothing.
    - recipient `email`; event_id `sg_event_id` (SendGrid's id for deduplication), else
      `content_id`; message_id `smtp-id`.
    - upstream_id: the X-Message-ID SendGrid gave in its "250 Ok: queued as <id>", which is
      `sg_message_id` up to its ".filter..." / ".recvd-..." part
      ("14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0" -> "14c5d75ce93.dfd.64b469",
      "XBg2anf2TqCy6WXKQFhieQ.filter0905p1mdw1-..." -> "XBg2anf2TqCy6WXKQFhieQ"), else up
      to its first "."; none when SendGrid omits it (asynchronous bounces).
    - reason `reason` (bounce, dropped), `response` (deferred); status `status`.
    """
    doc = _load(body, "sendgrid")
    if not isinstance(doc, list):
        raise FeedbackError(f"sendgrid: expected a JSON array of events, got {_kind(doc)}")
    out: list[FeedbackEvent] = []
    for i, ev in enumerate(doc):
        if not isinstance(ev, dict):
            raise FeedbackError(f"sendgrid: event {i} is {_kind(ev)}, not an object")
        event = _sendgrid_event(ev)
        if event is not None:
            out.append(event)
    return out


def _sendgrid_event(ev: _Obj) -> FeedbackEvent | None:
    name = _text(ev.get("event"), "sendgrid: event")
    rcpt = _text(ev.get("email"), "sendgrid: email")
    reason = _text(ev.get("reason"), "sendgrid: reason")
    response = _text(ev.get("response"), "sendgrid: response")
    etype: EventType | None
    if name == "bounce":
        btype = _text(ev.get("type"), "sendgrid: type")
        etype = "bounce" if btype in (None, "bounce") else "soft_bounce"
    elif name == "deferred":
        etype = "soft_bounce"
    elif name == "spamreport":
        etype = "complaint"
    elif name == "dropped":
        etype = _SENDGRID_DROPPED.get((reason or "").strip().lower(), "soft_bounce")
    else:
        etype = None
    if etype is None or rcpt is None:
        return None
    sg_message_id = _text(ev.get("sg_message_id"), "sendgrid: sg_message_id")
    message_id = _text(ev.get("smtp-id"), "sendgrid: smtp-id")
    event_id = _ident(ev.get("sg_event_id"), "sendgrid: sg_event_id") or content_id(
        "sendgrid", name, rcpt, sg_message_id, message_id, reason, _scalar(ev.get("timestamp"))
    )
    text = (response, reason) if name == "deferred" else (reason, response)
    return FeedbackEvent(
        provider="sendgrid",
        type=etype,
        recipient=rcpt,
        event_id=event_id,
        message_id=message_id,
        upstream_id=_sendgrid_upstream(sg_message_id),
        reason=_reason(*text, name),
        status=_status(ev.get("status"), *text),
    )


def _sendgrid_upstream(sg_message_id: str | None) -> str | None:
    if sg_message_id is None:
        return None
    # up to the first dot-part that starts with letters holding "filter" (".filter0001",
    # ".stfilter") or with "recvd": plain string work, linear in the field
    parts = sg_message_id.split(".")
    for i in range(1, len(parts)):
        part = parts[i].lower()
        letters = len(part) - len(part.lstrip("abcdefghijklmnopqrstuvwxyz"))
        if "filter" in part[:letters] or part.startswith("recvd"):
            head = ".".join(parts[:i])
            if head:
                return head
    return sg_message_id.partition(".")[0] or None


# --- Mailgun ---------------------------------------------------------------------------------


def parse_mailgun(body: bytes) -> list[FeedbackEvent]:
    """Mailgun's webhooks in their JSON form: `{"signature": {...}, "event-data": {...}}`
    (the signature is `verify_mailgun`'s business).

    - `failed` with `severity` "permanent" -> bounce, except `reason` "suppress-complaint"
      (dropped: the address complained before) -> complaint and "suppress-unsubscribe"
      (dropped: it unsubscribed) -> nothing; `failed` "temporary" (or no severity) ->
      soft_bounce. `complained` -> complaint. Other events -> nothing.
    - recipient `recipient`; event_id `id` (Mailgun's event id, unique within a day, which
      covers its 8 hours of retries), else `content_id`.
    - message_id and upstream_id are both `message.headers.message-id` (without <>): the
      message's own Message-ID when it had one, else the one Mailgun made, which is the id
      its API returns. Mailgun's SMTP server says only "250 Great success", so a relay that
      recorded no id at the 250 matches on the Message-ID.
    - reason `delivery-status.message` (the receiving server's words), else its
      `description`; status `delivery-status.enhanced-code` / `bounce-code`, else from text.
    """
    doc = _load(body, "mailgun")
    if not isinstance(doc, dict):
        raise FeedbackError(f"mailgun: expected a JSON object, got {_kind(doc)}")
    data = doc.get("event-data")
    if not isinstance(data, dict):
        raise FeedbackError(
            "mailgun: no 'event-data' object (the legacy form-encoded webhooks are not read)"
        )
    name = _text(data.get("event"), "mailgun: event")
    severity = _text(data.get("severity"), "mailgun: severity")
    why = _text(data.get("reason"), "mailgun: reason")
    etype: EventType | None = None
    if name == "failed":
        if severity != "permanent":
            etype = "soft_bounce"
        elif why == "suppress-complaint":
            etype = "complaint"
        elif why != "suppress-unsubscribe":
            etype = "bounce"
    elif name == "complained":
        etype = "complaint"
    rcpt = _text(data.get("recipient"), "mailgun: recipient")
    if etype is None or rcpt is None:
        return []
    status_obj = _opt_obj(data, "delivery-status", "mailgun: delivery-status")
    said = _text(status_obj.get("message"), "mailgun: delivery-status.message")
    description = _text(status_obj.get("description"), "mailgun: delivery-status.description")
    message = _opt_obj(data, "message", "mailgun: message")
    headers = _opt_obj(message, "headers", "mailgun: message.headers")
    message_id = _text(headers.get("message-id"), "mailgun: message-id")
    event_id = _ident(data.get("id"), "mailgun: id") or content_id(
        "mailgun", name, rcpt, message_id, severity, why, _scalar(data.get("timestamp"))
    )
    summary = "complained" if name == "complained" else f"failed ({severity or 'temporary'})"
    if why and name == "failed":
        summary = f"{summary[:-1]}, {why})"
    code = status_obj.get("enhanced-code") or status_obj.get("bounce-code")
    return [
        FeedbackEvent(
            provider="mailgun",
            type=etype,
            recipient=rcpt,
            event_id=event_id,
            message_id=message_id,
            upstream_id=message_id,
            reason=_reason(said, description, summary),
            status=_status(code, said, description),
        )
    ]


# --- generic ---------------------------------------------------------------------------------

_GENERIC_TYPES: Final[dict[str, EventType]] = {t: t for t in EVENT_TYPES}
_GENERIC_FIELDS: Final = ("message_id", "upstream_id", "reason", "status")


def parse_generic(body: bytes) -> list[FeedbackEvent]:
    """Our own format, for anything else that can POST JSON: one object or an array of
    them, `{"type": "bounce" | "soft_bounce" | "complaint", "recipient": ...,
    "message_id"?, "upstream_id"?, "reason"?, "status"?, "id"?}`.

    Stricter than the providers' parsers (the sender is someone configuring it now): a
    missing or unknown `type`, a missing `recipient`, or a field of the wrong type is an
    error. `status` must be an RFC 3463 code. Without `id` (a string or an integer), the
    event_id is `content_id(type, recipient, message_id, upstream_id, reason)`.
    """
    doc = _load(body, "generic")
    if isinstance(doc, dict):
        items: list[Any] = [doc]
    elif isinstance(doc, list):
        items = doc
    else:
        raise FeedbackError(f"generic: expected an object or an array of them, got {_kind(doc)}")
    out = []
    for i, item in enumerate(items):
        where = "generic" if isinstance(doc, dict) else f"generic: event {i}"
        if not isinstance(item, dict):
            raise FeedbackError(f"{where}: {_kind(item)}, not an object")
        raw_type = item.get("type")
        etype = _GENERIC_TYPES.get(raw_type) if isinstance(raw_type, str) else None
        if etype is None:
            raise FeedbackError(f"{where}: 'type' must be one of {', '.join(EVENT_TYPES)}")
        rcpt = _text(item.get("recipient"), f"{where}: recipient")
        if rcpt is None:
            raise FeedbackError(f"{where}: 'recipient' must be a non-empty string")
        fields: dict[str, str | None] = {}
        for key in _GENERIC_FIELDS:
            value = item.get(key)
            if value is not None and not isinstance(value, str):
                raise FeedbackError(f"{where}: '{key}' must be a string")
            fields[key] = _text(value, f"{where}: {key}")
        status = fields["status"]
        if status is not None and not _STATUS.fullmatch(status.strip()):
            raise FeedbackError(f"{where}: 'status' must be an RFC 3463 code such as 5.1.1")
        raw_id = item.get("id")
        if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))):
            raise FeedbackError(f"{where}: 'id' must be a string or an integer")
        event_id = _ident(raw_id, f"{where}: id") or content_id(
            etype, rcpt, fields["message_id"], fields["upstream_id"], fields["reason"]
        )
        out.append(
            FeedbackEvent(
                provider="generic",
                type=etype,
                recipient=rcpt,
                event_id=event_id,
                message_id=fields["message_id"],
                upstream_id=fields["upstream_id"],
                reason=_reason(fields["reason"]),
                status=status.strip() if status else _status(None, fields["reason"]),
            )
        )
    return out


# --- signatures ------------------------------------------------------------------------------


def verify_mailgun(body: bytes, signing_key: bytes, *, now: float, max_age: float = 300) -> None:
    """Mailgun's webhook signature: the body's `signature` object holds `timestamp`,
    `token` and `signature`, the hex HMAC-SHA256 of timestamp + token under the domain's
    webhook signing key (documentation.mailgun.com, "Securing Webhooks"). Compared in
    constant time; `parent-signature` (a subaccount's event signed with the primary
    account's key) is accepted too. A timestamp more than `max_age` seconds from `now`,
    either way, is refused: a replayed call. (Replays inside that window carry an event
    the daemon has already applied, which it dedups.)"""
    try:
        doc = _load(body, "mailgun")
    except FeedbackError as e:
        raise SignatureError(f"no signature in the body ({e})") from None
    sig = doc.get("signature") if isinstance(doc, dict) else None
    if not isinstance(sig, dict):
        raise SignatureError("no 'signature' object in the body")
    raw_ts, token = sig.get("timestamp"), sig.get("token")
    if isinstance(raw_ts, int) and not isinstance(raw_ts, bool):
        raw_ts = str(raw_ts)
    if not (isinstance(raw_ts, str) and raw_ts.isascii() and raw_ts.isdigit() and len(raw_ts) < 20):
        raise SignatureError("signature.timestamp is not a number of seconds")
    timestamp = raw_ts
    if not isinstance(token, str) or not token or not token.isascii():
        raise SignatureError("signature.token is missing")
    given = [s for s in (sig.get("signature"), sig.get("parent-signature")) if isinstance(s, str)]
    if not given:
        raise SignatureError("signature.signature is missing")
    if not signing_key:
        raise SignatureError("no Mailgun signing key to check against")
    expected = hmac.new(signing_key, (timestamp + token).encode("ascii"), hashlib.sha256)
    digest = expected.hexdigest().encode("ascii")
    if not any(hmac.compare_digest(digest, _ascii(s.strip().lower())) for s in given):
        raise SignatureError("the signature does not match (check the webhook signing key)")
    age = now - int(timestamp)
    if not math.isfinite(age) or abs(age) > max_age:
        raise SignatureError(
            f"the signature's timestamp is {age:.0f}s from now (more than {max_age:g}s):"
            " a replayed call, or a clock out of step"
        )


def load_sendgrid_public_key(data: bytes) -> ec.EllipticCurvePublicKey:
    """SendGrid's verification key as its settings page shows it (base64 DER, a
    SubjectPublicKeyInfo) or as PEM. Raises `SignatureError` for anything that is not an
    ECDSA P-256 public key (config checks can call this to fail early)."""
    raw = bytes(data).strip()
    try:
        if raw.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(raw)
        else:
            der = base64.b64decode(b"".join(raw.split()), validate=True)
            key = serialization.load_der_public_key(der)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise SignatureError(f"the SendGrid public key cannot be read ({_first_line(e)})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SignatureError("the SendGrid public key is not an ECDSA P-256 key")
    return key


def verify_sendgrid(
    body: bytes, signature_b64: str, timestamp: str, public_key_pem_or_b64: bytes
) -> None:
    """SendGrid's Signed Event Webhook: `X-Twilio-Email-Event-Webhook-Signature` is the
    base64 of a DER ECDSA signature, with SHA-256, over the
    `X-Twilio-Email-Event-Webhook-Timestamp` value followed by the raw body (as SendGrid's
    own libraries check it). The timestamp is not judged for age here: a replayed batch
    carries events the daemon has already applied (sg_event_id), which it dedups."""
    key = load_sendgrid_public_key(public_key_pem_or_b64)
    try:
        signature = base64.b64decode(signature_b64.strip(), validate=True)
    except ValueError:
        raise SignatureError("the signature header is not base64") from None
    try:
        signed = timestamp.encode("utf-8") + bytes(body)
    except UnicodeEncodeError:
        raise SignatureError("the timestamp header is not text") from None
    if not signature:
        raise SignatureError("the signature header is empty")
    try:
        key.verify(signature, signed, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        raise SignatureError(
            "the signature does not match the timestamp and body (check the public key)"
        ) from None


# --- helpers ---------------------------------------------------------------------------------


def _load(body: bytes, provider: str) -> object:
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FeedbackError(f"{provider}: the body is not UTF-8 (at byte {e.start})") from None
    return _parse_json(text.removeprefix("\ufeff"), f"{provider}: the body")


def _parse_json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except RecursionError:
        raise FeedbackError(f"{what} is JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise FeedbackError(
            f"{what} is not JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except ValueError as e:  # e.g. an integer past Python's digit limit
        raise FeedbackError(f"{what} is not usable JSON ({_first_line(e)})") from None


def _kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _short(v: object, limit: int = 60) -> str:
    r = repr(v) if isinstance(v, str) else _kind(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


def _ascii(s: str) -> bytes:
    return s.encode("ascii", "replace")


def _text(v: object, what: str) -> str | None:
    """A string with something in it, else None. A lone surrogate is an error."""
    if not isinstance(v, str) or not v.strip():
        return None
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise FeedbackError(f"{what}: not valid Unicode (a lone surrogate)") from None
    return v


def _ident(v: object, what: str) -> str | None:
    """An id: a string, or an integer (Postmark's ids are numbers)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return _text(v, what)


def _scalar(v: object) -> str | None:
    """A timestamp or the like, as text for `content_id` (surrogates dropped, not refused)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return v.encode("utf-8", "replace").decode("utf-8")
    return None


def _opt_obj(parent: _Obj, key: str, what: str) -> _Obj:
    v = parent.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise FeedbackError(f"{what} is {_kind(v)}, not an object")
    return v


def _req_obj(parent: _Obj, key: str, what: str) -> _Obj:
    v = parent.get(key)
    if not isinstance(v, dict):
        raise FeedbackError(f"{what} without a '{key}' object")
    return v


def _entries(parent: _Obj, key: str, what: str) -> list[Any]:
    v = parent.get(key)
    if v is None:
        return []
    if not isinstance(v, list):
        raise FeedbackError(f"{what} is {_kind(v)}, not an array")
    return v


def _reason(*candidates: str | None) -> str:
    """The first candidate with something in it, made one tidy line of at most 500 chars."""
    for c in candidates:
        if c:
            line = " ".join(c[: REASON_MAX * 4].translate(_CONTROLS).split())
            if line:
                return line[:REASON_MAX]
    return ""


def _status(given: object, *texts: str | None) -> str | None:
    """The payload's own RFC 3463 status when it is one, else the first in its text."""
    if isinstance(given, str) and _STATUS.fullmatch(given.strip()):
        return given.strip()
    for t in texts:
        if t:
            m = _STATUS_IN_TEXT.search(t)
            if m is not None:
                return m.group(1)
    return None
