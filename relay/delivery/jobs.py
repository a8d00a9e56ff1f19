"""The delivery engine's vocabulary: a job, a destination's live state, a dead letter.

Rules:
- A job is one message to one destination: one SMTP transaction. Its recipients are
  claims, each with its own retry clock (`Claim.created_at` is the recipient's, from
  `coalesce(retry_base, created_at)`: a `queue retry` restarts one recipient's clock, not
  its siblings').
- A destination is an upstream (by its name, `smarthost` for the classic one) or, in MX
  mode, a recipient domain. Its state lives in memory; what must survive a restart (counts,
  suspensions, commands) lives in the spool.
- A dead letter is a typed record; `as_doc()` is the JSON the DSN hook and logs use.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from relay.config.routes import Route, UpstreamHost
from relay.config.tree import Destination
from relay.delivery import outcomes, shaping
from relay.spool import ops


@dataclass(slots=True)
class Job:
    msg_id: str
    destination: str  # the destination whose queue and connections carry it
    lane: str
    identity: str
    sender: str
    claims: list[ops.Claim]
    envelope: ops.Envelope
    route: Route | None = None  # None: the classic single route
    reserved: tuple[str, ...] = ()  # ceiling scopes reserved at dispatch
    # the upstream that carries it after a failover, when its reservation was handed over
    # to that one (relay/delivery/connect.py); its deliveries count there
    carrier: str | None = None
    done: bool = False  # its outcomes are recorded (or being recorded)


@dataclass(slots=True)
class DestState:
    name: str
    conf: Destination
    bucket: shaping.TokenBucket | None
    adaptive: shaping.Adaptive
    breaker: shaping.Breaker
    upstream: UpstreamHost | None = None  # None: an MX destination (a recipient domain)
    queues: dict[str, deque[Job]] = field(
        default_factory=lambda: {"transactional": deque(), "bulk": deque()}
    )
    workers: set[asyncio.Task[None]] = field(default_factory=set)
    active: dict[str, int] = field(default_factory=lambda: {"transactional": 0, "bulk": 0})
    suspended_until: float = 0.0
    suspend_reason: str = ""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0
    reserved: int = 0
    config_error: str | None = None  # AUTH/TLS refused our configuration; cleared on success

    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())


@dataclass(frozen=True, slots=True)
class DeadLetter:
    queue_id: str
    recipient: str
    sender: str
    message_id: str
    state: str  # bounced | failed | expired: a dead kind of relay/delivery/outcomes.py
    reply: str
    destination: str
    attempts: int
    dedup_key: str
    at: str  # ISO 8601 UTC

    @property
    def reason(self) -> str:
        return outcomes.row(self.state).words

    def as_doc(self) -> dict[str, Any]:
        return {
            "event": "dead_letter",
            "queue_id": self.queue_id,
            "recipient": self.recipient,
            "sender": self.sender,
            "message_id": self.message_id,
            "state": self.state,
            "reply": self.reply,
            "destination": self.destination,
            "attempts": self.attempts,
            "reason": self.reason,
            "dedup_key": self.dedup_key,
            "at": self.at,
        }


def dead_letter(
    job: Job, cl: ops.Claim, state: str, reply: str, dest: str, now: float
) -> DeadLetter:
    return DeadLetter(
        queue_id=job.msg_id,
        recipient=cl.address,
        sender=job.sender,
        message_id=job.envelope.message_id,
        state=state,
        reply=reply,
        destination=dest,
        attempts=cl.attempts + 1,
        dedup_key=cl.dedup_key,
        at=ops.iso_utc(now),
    )
