"""What happens to a claim given a result, and whether a job may go now (pure).

Rules:
- `decide` turns one recipient's result of one attempt into its outcome (a kind of the
  outcome table, relay/delivery/outcomes.py, whose row says the state and the rest): delivered;
  transient -> deferred per the retry schedule, counted from the recipient's own clock, or
  expired (failed, a dead letter) past `retry.max_age`; bounce -> bounced and suppressed;
  fail -> failed. An ambiguous result (the connection lost after the final dot) is retried,
  or counted delivered with `ambiguous: assume-delivered`. A deferral past
  `retry.warn_after` asks for the message's one delay warning.
- `wait` is a deferral that burns no attempt (shaping, suspension, circuit), never past a
  recipient's `retry.max_age`: then it expires.
- `admit` decides whether a job goes now: a suspended destination or an open circuit makes
  it wait (with the reason and the time); a daily ceiling lets what fits go and the rest
  wait for the next window.
- `breaker_action`: what one attempt tells the destination's circuit breaker.
No I/O, no clock, no randomness of its own: everything comes in as arguments.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from relay.delivery import retry
from relay.delivery.jobs import DeadLetter, Job, dead_letter
from relay.delivery.outcomes import ROWS, Kind
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import RcptResult
from relay.spool import ops

NO_REPLY = RcptResult(
    Verdict(Outcome.TRANSIENT, False, False, Scope.TRANSACTION),
    Reply(451, "4.3.0", "no reply recorded"),
    Phase.MAIL,
)


@dataclass(frozen=True, slots=True)
class Policy:
    schedule: tuple[float, ...]
    max_age: float
    min_delay: float
    ambiguous: str  # retry | assume-delivered
    warn_after: float  # 0: no delay warnings


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: ops.RcptUpdate
    kind: Kind  # its row in the outcome table (relay/delivery/outcomes.py)
    logged: str  # the attempt log's outcome: the reply's, or "ambiguous"
    dead: DeadLetter | None = None
    warn_delay: bool = False  # past retry.warn_after: the message's delay warning is due


# the reply's verdict -> the kind it makes (a transient one expires past retry.max_age)
KIND_OF: dict[Outcome, Kind] = {
    Outcome.DELIVERED: Kind.DELIVERED,
    Outcome.TRANSIENT: Kind.DEFERRED,
    Outcome.BOUNCE: Kind.BOUNCED,
    Outcome.FAIL: Kind.FAILED,
}


def decide(
    job: Job,
    cl: ops.Claim,
    res: RcptResult | None,
    *,
    now: float,
    policy: Policy,
    rng: random.Random,
    dest: str,
    host: str | None,
    duration: float,
) -> Decision:
    res = res or NO_REPLY
    reply = str(res.reply)
    outcome = res.verdict.outcome
    logged = outcome.value
    if res.ambiguous:
        logged = "ambiguous"
        if policy.ambiguous == "assume-delivered":
            outcome = Outcome.DELIVERED
    kind, text, nxt, warn = KIND_OF[outcome], reply, None, False
    if kind is Kind.DEFERRED:
        nxt = retry.next_attempt_at(
            now,
            cl.created_at,
            cl.attempts + 1,
            policy.schedule,
            policy.max_age,
            rng,
            policy.min_delay,
        )
        if nxt is None:
            kind = Kind.EXPIRED
            text = f"expired after {human(policy.max_age)} in queue; last reply: {reply}"
    row = ROWS[kind]
    if row.warns:
        warn = (
            bool(policy.warn_after)
            and now - cl.created_at >= policy.warn_after
            and job.envelope.delay_warned_at is None
        )
    update = ops.RcptUpdate(
        rcpt_id=cl.rcpt_id,
        msg_id=job.msg_id,
        state=row.state,
        count_attempt=True,
        next_attempt_at=nxt,
        last_reply=text,
        log=ops.AttemptLog(logged, reply, dest, host, round(duration, 4)),
        suppress=(cl.address, text) if row.suppresses else None,
    )
    dead = dead_letter(job, cl, kind.value, text, dest, now) if row.dead else None
    return Decision(update, kind, logged, dead, warn)


def wait(
    job: Job, claims: list[ops.Claim], until: float, reason: str, *, now: float, max_age: float
) -> tuple[list[ops.RcptUpdate], list[DeadLetter]]:
    """Wait without burning an attempt, but never past a recipient's `retry.max_age`: one
    that is too old when it would wait again expires (failed, dead letter) like any other."""
    outs: list[ops.RcptUpdate] = []
    dead: list[DeadLetter] = []
    for cl in claims:
        deadline = cl.created_at + max_age
        if now < deadline:
            outs.append(
                ops.RcptUpdate(
                    rcpt_id=cl.rcpt_id,
                    msg_id=job.msg_id,
                    state=ROWS[Kind.DEFERRED].state,
                    count_attempt=False,
                    next_attempt_at=min(until, deadline),
                    last_reply=None,
                    reason=reason,
                )
            )
            continue
        text = f"expired after {human(max_age)} in queue; still waiting: {reason}"
        dead.append(dead_letter(job, cl, Kind.EXPIRED.value, text, job.destination, now))
        outs.append(
            ops.RcptUpdate(
                rcpt_id=cl.rcpt_id,
                msg_id=job.msg_id,
                state=ROWS[Kind.EXPIRED].state,
                count_attempt=False,
                next_attempt_at=None,
                last_reply=text,
                # no attempt: the attempt log says the kind (outcomes.ATTEMPTLESS)
                log=ops.AttemptLog(Kind.EXPIRED.value, text, job.destination, None, None),
            )
        )
    return outs, dead


@dataclass(frozen=True, slots=True)
class Go:
    pass


@dataclass(frozen=True, slots=True)
class Wait:
    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Split:
    """`fit` recipients go now; the rest wait until `until`."""

    fit: int
    until: float
    reason: str


def admit(
    n: int,
    *,
    name: str,
    now: float,
    suspended_until: float,
    suspend_reason: str,
    circuit_until: float | None,
    room: tuple[int, float, str] | None,
) -> Go | Wait | Split:
    """`circuit_until`: when an open circuit lets a trial through (None: not open);
    `room`: (recipients that fit under every ceiling, next window, reason) or None."""
    if suspended_until > now:
        return Wait(
            suspended_until,
            f"destination {name} suspended until {ops.iso_utc(suspended_until)} ({suspend_reason})",
        )
    if circuit_until is not None:
        return Wait(circuit_until, f"circuit open for {name} until {ops.iso_utc(circuit_until)}")
    if room is not None and room[0] < n:
        return Split(room[0], room[1], room[2])
    return Go()


BreakerAction = Literal["release", "failure", "success"]


def breaker_action(
    results: dict[str, RcptResult], delivered: int, *, upstream_seen: bool, connection_failed: bool
) -> BreakerAction:
    if not upstream_seen:
        return "release"  # our own error: says nothing; a half-open trial goes back
    if connection_failed or refused_mail(results, delivered):
        return "failure"
    return "success"


def refused_mail(results: dict[str, RcptResult], delivered: int) -> bool:
    """An upstream that answered but refused the transaction at MAIL with a 4xx: it takes
    no mail, so for the breaker it is failing like a refused connection. (A 4xx later in
    the transaction, e.g. a 421 to DATA, is throttling: the AIMD slow-down handles it.)"""
    if delivered or not results:
        return False
    return all(
        r.verdict.outcome is Outcome.TRANSIENT and not r.ambiguous and r.phase is Phase.MAIL
        for r in results.values()
    )


def human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
