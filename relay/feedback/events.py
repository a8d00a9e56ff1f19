"""The one shape every kind of feedback becomes before it touches the spool (pure).

Rules:
- A provider's webhook payload, a DSN or ARF report sent to `feedback.address`, and a VERP
  address all turn into `FeedbackEvent`s; only relay/feedback/apply.py acts on them.
- `event_id` is what makes a redelivered event a no-op: the provider's own id where it has
  one (SNS MessageId, SendGrid sg_event_id, Mailgun event id, ...), else a hash of the
  event's content (`content_id`). Apply dedups on (provider, event_id, recipient).
- Addresses are kept as the provider wrote them; matching lowercases them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

EventType = Literal["bounce", "soft_bounce", "complaint"]
EVENT_TYPES: tuple[EventType, ...] = ("bounce", "soft_bounce", "complaint")


@dataclass(frozen=True, slots=True)
class FeedbackEvent:
    provider: str  # ses | postmark | sendgrid | mailgun | generic | mail | verp
    type: EventType
    recipient: str  # the address the event is about
    event_id: str  # the provider's id for this event (see content_id)
    message_id: str | None = None  # the original's Message-ID, if the event names it
    upstream_id: str | None = None  # the id the upstream gave the original at its 250
    reason: str = ""  # the bounce's diagnostic / the complaint's feedback type
    status: str | None = None  # an RFC 3463 status ("5.1.1") when the event has one
    queue_id: str | None = None  # our queue id, when known (VERP)
    rcpt_id: int | None = None  # our recipient row id, when known (VERP)


class FeedbackError(ValueError):
    """A payload or message that cannot be read as feedback: HTTP 400, or a kept message."""


def content_id(*parts: str | None) -> str:
    """An event id for events that carry none: the same event posted twice gets the same id."""
    h = hashlib.sha256()
    for p in parts:
        h.update((p or "").encode("utf-8", "surrogateescape"))
        h.update(b"\x00")
    return "h:" + h.hexdigest()[:32]
