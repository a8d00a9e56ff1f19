"""relay/delivery/decide.py: what happens to a claim given a result (decide), whether a job may go
now (admit), what an attempt tells the breaker, waiting without burning attempts, and the
attempt log's texts."""

from __future__ import annotations

import random
from typing import Any

import pytest

from relay.delivery import decide, retry
from relay.delivery.jobs import Job
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import RcptResult
from relay.spool import ops
from relay.spool.model import RcptState

NOW = 100_000.0


POLICY = decide.Policy(
    schedule=(60.0, 300.0), max_age=3600.0, min_delay=1.0, ambiguous="retry", warn_after=600.0
)


def claim(attempts: int = 0, age: float = 10.0) -> ops.Claim:
    return ops.Claim(
        1, "M", "u@x.test", "x.test", attempts, NOW - age, "transactional", "id", "key"
    )


def job(warned: float | None = None) -> Job:
    env = ops.Envelope("M", "<m@x>", "s@y.test", 1, b"x", None, warned)
    return Job("M", "smarthost", "transactional", "id", "s@y.test", [claim()], env)


def res(
    code: int, outcome: Outcome, phase: Phase = Phase.RCPT, ambiguous: bool = False
) -> RcptResult:
    return RcptResult(
        Verdict(outcome, False, False, Scope.RECIPIENT),
        Reply(code, f"{code // 100}.1.1", "text"),
        phase,
        ambiguous,
    )


@pytest.mark.parametrize(
    ("result", "cl", "policy", "kind", "state", "dead", "warn"),
    [
        (
            res(250, Outcome.DELIVERED),
            claim(),
            POLICY,
            "delivered",
            RcptState.DELIVERED,
            None,
            False,
        ),
        (res(451, Outcome.TRANSIENT), claim(), POLICY, "deferred", RcptState.DEFERRED, None, False),
        (
            res(451, Outcome.TRANSIENT),
            claim(age=700),
            POLICY,
            "deferred",
            RcptState.DEFERRED,
            None,
            True,
        ),  # past warn_after: the delay warning is due
        (
            res(451, Outcome.TRANSIENT),
            claim(age=3600),
            POLICY,
            "expired",
            RcptState.FAILED,
            "expired",
            False,
        ),  # past max_age: the last attempt failed
        (res(550, Outcome.BOUNCE), claim(), POLICY, "bounced", RcptState.BOUNCED, "bounced", False),
        (res(554, Outcome.FAIL), claim(), POLICY, "failed", RcptState.FAILED, "failed", False),
        (None, claim(), POLICY, "deferred", RcptState.DEFERRED, None, False),  # no reply
        (
            res(421, Outcome.TRANSIENT, Phase.DATA, ambiguous=True),
            claim(),
            POLICY,
            "deferred",
            RcptState.DEFERRED,
            None,
            False,
        ),  # ambiguous, policy retry
        (
            res(421, Outcome.TRANSIENT, Phase.DATA, ambiguous=True),
            claim(),
            decide.Policy((60.0,), 3600.0, 1.0, "assume-delivered", 0.0),
            "delivered",
            RcptState.DELIVERED,
            None,
            False,
        ),
    ],
)
def test_decide(
    result: RcptResult | None,
    cl: ops.Claim,
    policy: decide.Policy,
    kind: str,
    state: RcptState,
    dead: str | None,
    warn: bool,
) -> None:
    d = decide.decide(
        job(),
        cl,
        result,
        now=NOW,
        policy=policy,
        rng=random.Random(1),
        dest="smarthost",
        host="h",
        duration=0.5,
    )
    assert (d.kind, d.outcome.state, d.warn_delay) == (kind, state, warn)
    assert (d.dead.state if d.dead else None) == dead
    assert d.outcome.count_attempt
    if kind == "deferred":
        nxt = d.outcome.next_attempt_at
        assert nxt is not None and NOW + 1.0 <= nxt <= cl.created_at + policy.max_age
    if kind == "bounced":
        assert d.outcome.suppress == ("u@x.test", str(result.reply) if result else "")
    assert (d.logged == "ambiguous") == bool(result and result.ambiguous)
    reply = str((result or decide.NO_REPLY).reply)
    # what the spool records: the reply (or why it expired), and the attempt log line
    want_reply = reply if kind != "expired" else (f"expired after 1h in queue; last reply: {reply}")
    assert d.outcome.last_reply == want_reply
    assert d.outcome.log == ops.AttemptLog(d.logged, reply, "smarthost", "h", 0.5)
    assert d.outcome.rcpt_id == 1 and d.outcome.msg_id == "M"
    if dead:
        assert d.dead is not None
        assert (d.dead.reply, d.dead.destination, d.dead.recipient) == (
            want_reply,
            "smarthost",
            "u@x.test",
        )
        assert d.dead.at == ops.iso_utc(NOW) and d.dead.attempts == cl.attempts + 1


def test_decide_schedules_from_the_recipients_attempts_and_min_delay() -> None:
    policy = decide.Policy((10.0, 1000.0, 5000.0), 1e9, 7.0, "retry", 0.0)
    for attempts in (0, 1, 2):
        cl = claim(attempts=attempts)
        d = decide.decide(
            job(),
            cl,
            res(451, Outcome.TRANSIENT),
            now=NOW,
            policy=policy,
            rng=random.Random(3),
            dest="d",
            host=None,
            duration=0.0,
        )
        want = retry.next_attempt_at(
            NOW,
            cl.created_at,
            attempts + 1,
            policy.schedule,
            policy.max_age,
            random.Random(3),
            policy.min_delay,
        )
        assert d.outcome.next_attempt_at == want
    # min_delay is a floor: the first step is 10 s, never less than 7 s
    lows = [
        decide.decide(
            job(),
            claim(),
            res(451, Outcome.TRANSIENT),
            now=NOW,
            policy=policy,
            rng=random.Random(i),
            dest="d",
            host=None,
            duration=0.0,
        ).outcome.next_attempt_at
        for i in range(50)
    ]
    assert min(x for x in lows if x is not None) >= NOW + 7.0


@pytest.mark.parametrize(("age", "warn"), [(599.0, False), (600.0, True), (601.0, True)])
def test_the_delay_warning_boundary(age: float, warn: bool) -> None:
    d = decide.decide(
        job(),
        claim(age=age),
        res(451, Outcome.TRANSIENT),
        now=NOW,
        policy=POLICY,
        rng=random.Random(1),
        dest="d",
        host=None,
        duration=0.0,
    )
    assert d.warn_delay is warn


def test_decide_warns_once_per_message() -> None:
    d = decide.decide(
        job(warned=NOW - 5),
        claim(age=700),
        res(451, Outcome.TRANSIENT),
        now=NOW,
        policy=POLICY,
        rng=random.Random(1),
        dest="d",
        host=None,
        duration=0.0,
    )
    assert d.kind == "deferred" and not d.warn_delay


def test_wait_burns_no_attempt_and_expires_at_max_age() -> None:
    fresh, old = claim(age=10), claim(age=4000)
    outs, dead = decide.wait(
        job(), [fresh, old], NOW + 7200, "circuit open", now=NOW, max_age=3600.0
    )
    assert [o.state for o in outs] == [RcptState.DEFERRED, RcptState.FAILED]
    assert not any(o.count_attempt for o in outs)
    assert outs[0].next_attempt_at == fresh.created_at + 3600  # never past max_age
    assert outs[0].reason == "circuit open"
    assert [d.state for d in dead] == ["expired"]
    assert "still waiting: circuit open" in dead[0].reply


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, decide.Go()),
        ({"suspended_until": NOW + 60, "suspend_reason": "operator: x"}, decide.Wait),
        ({"circuit_until": NOW + 30}, decide.Wait),
        ({"room": (5, NOW + 100, "r")}, decide.Go()),  # everything fits
        ({"room": (2, NOW + 100, "daily limit")}, decide.Split(2, NOW + 100, "daily limit")),
        ({"room": (0, NOW + 100, "daily limit")}, decide.Split(0, NOW + 100, "daily limit")),
        ({"suspended_until": NOW - 1, "circuit_until": NOW + 30}, decide.Wait),  # expired susp.
    ],
)
def test_admit(kw: dict, want: Any) -> None:
    args: dict[str, Any] = {
        "suspended_until": 0.0,
        "suspend_reason": "",
        "circuit_until": None,
        "room": None,
        **kw,
    }
    got = decide.admit(5, name="d", now=NOW, **args)
    if isinstance(want, type):
        assert isinstance(got, want)
        assert "d" in got.reason
    else:
        assert got == want


def tr(code: int, phase: Phase, outcome: Outcome = Outcome.TRANSIENT) -> RcptResult:
    return RcptResult(
        Verdict(outcome, False, False, Scope.TRANSACTION), Reply(code, None, "x"), phase
    )


@pytest.mark.parametrize(
    ("results", "delivered", "seen", "conn_failed", "want"),
    [
        ({"a": tr(250, Phase.DATA, Outcome.DELIVERED)}, 1, True, False, "success"),
        ({"a": tr(550, Phase.RCPT, Outcome.BOUNCE)}, 0, True, False, "success"),  # an answer
        ({"a": tr(421, Phase.CONNECT)}, 0, True, True, "failure"),
        ({"a": tr(451, Phase.MAIL)}, 0, True, False, "failure"),  # takes no mail
        ({"a": tr(451, Phase.RCPT)}, 0, True, False, "success"),
        ({"a": tr(451, Phase.CONNECT)}, 0, False, True, "release"),  # never reached it
    ],
)
def test_breaker_action(
    results: dict, delivered: int, seen: bool, conn_failed: bool, want: str
) -> None:
    assert (
        decide.breaker_action(results, delivered, upstream_seen=seen, connection_failed=conn_failed)
        == want
    )


def test_wait_records_exactly_what_the_spool_needs() -> None:
    fresh, old = claim(age=10), claim(age=3600)  # old: exactly at max_age
    j = job()
    outs, dead = decide.wait(j, [fresh, old], NOW + 60, "why", now=NOW, max_age=3600.0)
    assert outs[0] == ops.RcptUpdate(
        rcpt_id=1,
        msg_id="M",
        state=RcptState.DEFERRED,
        count_attempt=False,
        next_attempt_at=NOW + 60,
        last_reply=None,
        reason="why",
    )
    text = "expired after 1h in queue; still waiting: why"
    assert outs[1] == ops.RcptUpdate(
        rcpt_id=1,
        msg_id="M",
        state=RcptState.FAILED,
        count_attempt=False,
        next_attempt_at=None,
        last_reply=text,
        log=ops.AttemptLog("expired", text, "smarthost", None, None),
    )
    assert [(d.reply, d.destination, d.at) for d in dead] == [(text, "smarthost", ops.iso_utc(NOW))]


def test_admit_waits_carry_their_times() -> None:
    args = {"suspend_reason": "operator: maint", "room": None}
    w = decide.admit(3, name="d", now=NOW, suspended_until=NOW + 60, circuit_until=None, **args)
    assert w == decide.Wait(
        NOW + 60, f"destination d suspended until {ops.iso_utc(NOW + 60)} (operator: maint)"
    )
    w = decide.admit(
        3, name="d", now=NOW, suspended_until=NOW, circuit_until=NOW + 30, **args
    )  # a suspension that ends now is over
    assert w == decide.Wait(NOW + 30, f"circuit open for d until {ops.iso_utc(NOW + 30)}")


def test_breaker_counts_a_refused_mail_only_when_nothing_was_delivered() -> None:
    refused = {"a": tr(451, Phase.MAIL)}
    assert (
        decide.breaker_action(refused, 0, upstream_seen=True, connection_failed=False) == "failure"
    )
    assert (
        decide.breaker_action(refused, 1, upstream_seen=True, connection_failed=False) == "success"
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (86400, "1d"),
        (172800, "2d"),
        (3600, "1h"),
        (7200, "2h"),
        (60, "1m"),
        (120, "2m"),
        (90, "90s"),
        (3601, "3601s"),
        (0.5, "0.5s"),
        (86460, "1441m"),
    ],
)
def test_decide_human(seconds: float, text: str) -> None:
    assert decide.human(seconds) == text


# Mutation-driven (tests/MUTANTS.md; until issue 28 in tests/test_mutants_delivery_core.py).
# --- decide ------------------------------------------------------------------------------------


def test_attempt_log_duration_rounded_to_four_places() -> None:
    cl = ops.Claim(1, "M", "u@x.test", "x.test", 0, 1000.0, "transactional", "id", "key")
    env = ops.Envelope("M", "<m@x>", "s@y.test", 1, b"x", None, None)
    job = Job("M", "smarthost", "transactional", "id", "s@y.test", [cl], env)
    res = RcptResult(
        Verdict(Outcome.DELIVERED, False, False, Scope.RECIPIENT),
        Reply(250, "2.0.0", "ok"),
        Phase.DATA,
    )
    pol = decide.Policy((60.0,), 3600.0, 1.0, "retry", 0.0)
    d = decide.decide(
        job,
        cl,
        res,
        now=1010.0,
        policy=pol,
        rng=random.Random(1),
        dest="x.test",
        host="mx.x.test",
        duration=1.234567,
    )
    assert d.outcome.log == ops.AttemptLog(
        "delivered", "250 2.0.0 ok", "x.test", "mx.x.test", 1.2346
    )


def test_decide_human_exact_for_huge_integer_seconds() -> None:
    days = 10**17 + 1  # past a float's exact integers: floor division must stay exact
    assert decide.human(86400 * days) == f"{days}d"
