"""Message and recipient states, and the one transition table.

Rules:
- Every recipient has its own state. A recipient starts `pending`; delivery claims it
  (`sending`) and an attempt ends it in `delivered`, `bounced`, `failed` (all final) or back in
  `deferred` (waiting for its next attempt).
- `suppressed` is final: the address was on the suppression list when delivery reached it.
- `held` is parked by an operator; `release` makes it `deferred` and due now. A hold that
  meets a recipient in its attempt (`sending`) marks it (`hold_after`): the attempt's end
  makes it `held` where it would have made it `deferred` (a delivery or a permanent failure
  stands: there is nothing left to hold), and so does a crash recovery or an expired lease
  that finds it marked. A `release` before the attempt ends takes the mark off. The table
  below has no `sending` -> `held`: an operator's hold never takes a recipient out of its
  attempt (its outcome would find nothing to record); the mark is the spool's own step
  (relay/spool/ops.py `_attempt_ends`).
- An operator `retry` may bring a final failure (`bounced`, `failed`, `suppressed`) back to
  `deferred`; `delivered` never leaves its state (no duplicate sends by accident).
- A message's state is derived from its recipients (see `message_state`); it is never stored
  on its own, so it cannot disagree with them.
- Crash recovery turns every `sending` back into `deferred`, due now: a claim that did not
  record its outcome is retried (at-least-once).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class RcptState(StrEnum):
    PENDING = "pending"
    DEFERRED = "deferred"
    SENDING = "sending"
    DELIVERED = "delivered"
    BOUNCED = "bounced"
    FAILED = "failed"
    SUPPRESSED = "suppressed"
    HELD = "held"


class MsgState(StrEnum):
    QUEUED = "queued"
    DEFERRED = "deferred"
    SENDING = "sending"
    HELD = "held"
    SENT = "sent"
    FAILED = "failed"


FINAL = frozenset({RcptState.DELIVERED, RcptState.BOUNCED, RcptState.FAILED, RcptState.SUPPRESSED})
DEAD = frozenset({RcptState.BOUNCED, RcptState.FAILED})  # dead letters (delivery/outcomes.py)
WAITING = frozenset({RcptState.PENDING, RcptState.DEFERRED})  # due at next_attempt_at
UNFINISHED = frozenset({RcptState.PENDING, RcptState.DEFERRED, RcptState.SENDING, RcptState.HELD})


def sql_in(states: Iterable[RcptState]) -> str:
    """`('deferred', 'pending')`: a state set for SQL, spelled from this module only."""
    return "(" + ", ".join(f"'{s.value}'" for s in sorted(states)) + ")"


# from-state -> the states it may move to. Anything else is a bug (or an operator race that
# the spool refuses with a conditional UPDATE).
TRANSITIONS: dict[RcptState, frozenset[RcptState]] = {
    RcptState.PENDING: frozenset(
        {RcptState.SENDING, RcptState.HELD, RcptState.SUPPRESSED, RcptState.DEFERRED}
    ),
    RcptState.DEFERRED: frozenset(
        {
            RcptState.SENDING,
            RcptState.HELD,
            RcptState.SUPPRESSED,
            RcptState.DEFERRED,
            RcptState.FAILED,
        }
    ),
    RcptState.SENDING: frozenset(
        {
            RcptState.DELIVERED,
            RcptState.DEFERRED,
            RcptState.BOUNCED,
            RcptState.FAILED,
            RcptState.SUPPRESSED,
        }
    ),
    RcptState.HELD: frozenset({RcptState.DEFERRED}),
    RcptState.BOUNCED: frozenset({RcptState.DEFERRED}),
    RcptState.FAILED: frozenset({RcptState.DEFERRED}),
    RcptState.SUPPRESSED: frozenset({RcptState.DEFERRED}),
    # a late bounce (relay/feedback/): the upstream said 250, the mailbox said no later
    RcptState.DELIVERED: frozenset({RcptState.BOUNCED}),
}


def can_move(src: RcptState, dst: RcptState) -> bool:
    return dst in TRANSITIONS[src]


def sources_for(dst: RcptState) -> tuple[str, ...]:
    """Every state that may move to `dst` (for conditional UPDATEs in the spool)."""
    return tuple(sorted(s.value for s, targets in TRANSITIONS.items() if dst in targets))


def message_state(states: Iterable[str]) -> MsgState:
    """A message is `sent` when every recipient is done and none died; `failed` when every
    recipient is done and at least one bounced or failed."""
    st = {RcptState(s) for s in states}
    if not st:
        return MsgState.SENT
    if st <= FINAL:
        return MsgState.FAILED if st & DEAD else MsgState.SENT
    if RcptState.SENDING in st:
        return MsgState.SENDING
    if RcptState.PENDING in st:
        return MsgState.QUEUED
    if RcptState.DEFERRED in st:
        return MsgState.DEFERRED
    return MsgState.HELD
