"""What delivery can make of one recipient: one row per outcome kind, the table every part
reads (as h11's `_events.py`/`_state.py` are for its connection).

Rules:
- An outcome kind is where one recipient's pass through delivery ends: an attempt's
  decision (relay/delivery/decide.py: delivered, deferred, bounced, failed, expired) or an
  answer before any attempt (relay/delivery/dispatch.py: suppressed; a wait for shaping, a
  suspension or an open circuit, a deferral that burns no attempt, or expired past
  `retry.max_age`).
- A row says, for its kind: the recipient state the spool records (relay/spool/model.py),
  the log event (relay/ops/logs.py `EVENTS`) with its level and message, the recipients
  counter it moves (one of relay/ops/metrics.py `OUTCOME_COUNTERS`) and that counter's
  `reason` label, the alert it raises, the RFC 3464 §2.3.3 action of the
  DSN it sends the sender (None: none is sent), and its words for people (a dead letter's
  `reason` in the DSN hook's document and its log line). The CLI names the dead letters
  (`queue retry --failed`) by the dead rows' states.
- What differs by more than data is a flag the code reads, never a kind compared by name:
  `counts` (a delivery: the upstream id, the latency, the breaker, the daily counters),
  `suppresses` (the address goes on the suppression list), `dead` (a dead letter: its log
  lines, its alert, the DSN hook; relay/delivery/deadletters.py), `warns` (a deferral past
  `retry.warn_after` asks for the message's one delay warning).
- The attempt log (the spool's `attempts.outcome`, the `outcome` label of
  `relay_delivery_attempts`) says what the upstream's reply was (relay/delivery/replies.py
  `Outcome`, or `ambiguous`), not the kind: an expired recipient's last attempt was
  `transient`. An outcome without an attempt logs its kind there (`ATTEMPTLESS`).
- Adding an outcome: a `Kind` member and its row here, the code that decides it, a meaning
  for a new event in docs/reference/meanings.yaml, and its stimulus in
  tests/delivery/test_outcomes.py, which checks the table is complete and walks every row
  through a real engine and spool.
No I/O: a pure table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from relay.spool.model import RcptState

__all__ = ["ATTEMPTLESS", "ROWS", "Kind", "Row", "row"]


class Kind(StrEnum):
    DELIVERED = "delivered"
    DEFERRED = "deferred"
    BOUNCED = "bounced"
    FAILED = "failed"
    EXPIRED = "expired"
    SUPPRESSED = "suppressed"


DsnAction = Literal["delivered", "failed", "delayed", "relayed", "expanded"]  # RFC 3464 §2.3.3


@dataclass(frozen=True, slots=True)
class Row:
    kind: Kind
    state: RcptState  # what the spool records for the recipient
    event: str  # its log line's event (relay/ops/logs.py EVENTS)
    level: int  # ... and level
    message: str  # ... and message ("" for a dead letter's outcome line)
    metric: str  # the recipients counter it moves (metrics.OUTCOME_COUNTERS), by destination
    reason: str | None  # that counter's `reason` label, when it has one
    alert: str | None  # the alert event it raises (relay/ops/alerts.py)
    dsn: DsnAction | None  # the Action of the DSN it sends the sender; None: none
    words: str  # how the CLI, the dead-letter hook (`reason`) and the log say it
    counts: bool = False  # a delivery: breaker success, latency, daily counters
    suppresses: bool = False  # the address goes on the suppression list
    dead: bool = False  # a dead letter: its log lines, alert and DSN hook
    warns: bool = False  # may ask for the message's delay warning (retry.warn_after)
    # what its log line (relay/delivery/attempt.py) says after queue_id, dedup_key, rcpt,
    # destination, host and reply
    log_fields: tuple[str, ...] = ()


ROWS: dict[Kind, Row] = {
    r.kind: r
    for r in (
        Row(
            Kind.DELIVERED,
            RcptState.DELIVERED,
            "delivered",
            logging.INFO,
            "recipient delivered",
            "relay_delivered_recipients",
            None,
            alert=None,
            dsn=None,  # no success DSNs (NOTIFY=SUCCESS is not offered)
            words="delivered: the upstream accepted it",
            counts=True,
            log_fields=("upstream_id", "duration"),
        ),
        Row(
            Kind.DEFERRED,
            RcptState.DEFERRED,
            "deferred",
            logging.WARNING,
            "recipient deferred",
            "relay_deferred_recipients",
            "transient",
            alert="delayed",  # once per message, past retry.warn_after
            dsn="delayed",  # ... with the delay warning
            words="deferred: will be retried",
            warns=True,
            log_fields=("next_attempt_at", "attempts"),
        ),
        Row(
            Kind.BOUNCED,
            RcptState.BOUNCED,
            "bounced",
            logging.WARNING,
            "",
            "relay_bounced_recipients",
            None,
            alert="dead_letter",
            dsn="failed",
            words="permanent address failure; address suppressed",
            suppresses=True,
            dead=True,
        ),
        Row(
            Kind.FAILED,
            RcptState.FAILED,
            "failed",
            logging.WARNING,
            "",
            "relay_failed_recipients",
            None,
            alert="dead_letter",
            dsn="failed",
            words="permanent failure",
            dead=True,
        ),
        Row(
            Kind.EXPIRED,
            RcptState.FAILED,
            "expired",
            logging.WARNING,
            "",
            "relay_failed_recipients",
            None,
            alert="dead_letter",
            dsn="failed",
            words="gave up: max_age reached",
            dead=True,
        ),
        Row(
            Kind.SUPPRESSED,
            RcptState.SUPPRESSED,
            "suppressed",
            logging.WARNING,
            "recipient is suppressed",
            "relay_suppressed_recipients",
            None,
            alert=None,
            dsn=None,  # the address is known bad: no DSN, no attempt
            words="suppressed: the address is on the suppression list",
        ),
    )
}

# the kinds an answer without an attempt can have: their attempt-log outcome is the kind
ATTEMPTLESS = frozenset({Kind.SUPPRESSED, Kind.EXPIRED})


def row(kind: str) -> Row:
    """The row of a kind, by its value too (a dead letter's `state`)."""
    return ROWS[Kind(kind)]
