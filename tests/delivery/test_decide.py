"""relay/delivery/decide.py: what happens to a claim given a result (decide), whether a job may go
now (admit), what an attempt tells the breaker, waiting without burning attempts, and the
attempt log's texts."""

from __future__ import annotations

import random

from relay.delivery import decide
from relay.delivery.jobs import Job
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import RcptResult
from relay.spool import ops

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
