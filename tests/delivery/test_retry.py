"""Tests for relay.delivery.retry: full-jitter backoff, repeating last step, expiry clamp."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.delivery.retry import is_expired, next_attempt_at, next_delay

SCHEDULE = (60.0, 300.0, 900.0, 3600.0)


def test_delays_within_bounds_over_many_draws() -> None:
    rng = random.Random(1234)
    for failures, step in [(1, 60.0), (2, 300.0), (3, 900.0), (4, 3600.0)]:
        draws = [next_delay(failures, SCHEDULE, rng) for _ in range(2000)]
        assert all(1.0 <= d <= step for d in draws)
        # full jitter really spreads over the whole range
        assert min(draws) < step * 0.05
        assert max(draws) > step * 0.95
        mean = sum(draws) / len(draws)
        assert step * 0.4 < mean < step * 0.6


@pytest.mark.parametrize("failures", [4, 5, 10, 1000])
def test_last_step_repeats(failures: int) -> None:
    rng = random.Random(7)
    draws = [next_delay(failures, SCHEDULE, rng) for _ in range(500)]
    assert all(1.0 <= d <= 3600.0 for d in draws)
    assert max(draws) > 3000.0


def test_floor_never_exceeds_step() -> None:
    rng = random.Random(0)
    # min_delay larger than the step: the floor is the step itself
    assert all(next_delay(1, [0.5], rng, min_delay=1.0) == 0.5 for _ in range(100))
    assert all(next_delay(1, [0.0], rng) == 0.0 for _ in range(10))
    assert all(next_delay(1, [10.0], rng, min_delay=5.0) >= 5.0 for _ in range(200))


def test_deterministic_with_seed() -> None:
    a = [next_delay(2, SCHEDULE, random.Random(42)) for _ in range(3)]
    b = [next_delay(2, SCHEDULE, random.Random(42)) for _ in range(3)]
    assert a == b


@pytest.mark.parametrize(
    ("failures", "schedule", "min_delay"),
    [(0, SCHEDULE, 1.0), (-1, SCHEDULE, 1.0), (1, (), 1.0), (1, (-5.0,), 1.0), (1, SCHEDULE, -1)],
)
def test_bad_arguments(failures: int, schedule: tuple[float, ...], min_delay: float) -> None:
    with pytest.raises(ValueError):
        next_delay(failures, schedule, random.Random(0), min_delay)


@pytest.mark.parametrize(
    ("now", "created", "max_age", "expected"),
    [
        (100.0, 0.0, 100.0, True),
        (99.9, 0.0, 100.0, False),
        (1000.0, 0.0, 100.0, True),
        (0.0, 0.0, 0.0, True),
    ],
)
def test_is_expired(now: float, created: float, max_age: float, expected: bool) -> None:
    assert is_expired(now, created, max_age) is expected


def test_next_attempt_normal() -> None:
    rng = random.Random(3)
    at = next_attempt_at(1000.0, 0.0, 1, SCHEDULE, 86400.0, rng)
    assert at is not None
    assert 1001.0 <= at <= 1060.0


def test_next_attempt_clamped_to_max_age_then_expires() -> None:
    rng = random.Random(3)
    created, max_age = 0.0, 5000.0
    # 4990 s old, step 3600: the last attempt is at exactly the deadline
    at = next_attempt_at(4990.0, created, 9, SCHEDULE, max_age, rng, min_delay=100.0)
    assert at == 5000.0
    # that last attempt fails -> expired
    assert next_attempt_at(at, created, 10, SCHEDULE, max_age, rng) is None
    assert next_attempt_at(6000.0, created, 10, SCHEDULE, max_age, rng) is None


@given(
    failures=st.integers(min_value=1, max_value=50),
    schedule=st.lists(
        st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=8
    ),
    min_delay=st.floats(min_value=0, max_value=1e4, allow_nan=False),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_delay_always_between_floor_and_step(
    failures: int, schedule: list[float], min_delay: float, seed: int
) -> None:
    step = schedule[min(failures - 1, len(schedule) - 1)]
    d = next_delay(failures, schedule, random.Random(seed), min_delay)
    assert min(min_delay, step) <= d <= step


@given(
    now=st.floats(min_value=0, max_value=1e7, allow_nan=False),
    age=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    max_age=st.floats(min_value=1, max_value=1e6, allow_nan=False),
    failures=st.integers(min_value=1, max_value=20),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_next_attempt_never_after_deadline(
    now: float, age: float, max_age: float, failures: int, seed: int
) -> None:
    created = now - age
    at = next_attempt_at(now, created, failures, SCHEDULE, max_age, random.Random(seed))
    if now - created >= max_age:
        assert at is None
    else:
        assert at is not None
        assert now <= at <= created + max_age


# --- rows for mutants that survived `make mutate` -------------------------------------------------


class _Low(random.Random):
    """A source whose uniform() always draws the low end."""

    def uniform(self, a: float, b: float) -> float:
        return a


def test_default_floor_is_one_second() -> None:
    assert next_delay(1, [60.0], _Low()) == 1.0
    assert next_attempt_at(100.0, 100.0, 1, [60.0], 3600.0, _Low()) == 101.0


def test_min_delay_is_passed_through_by_next_attempt_at() -> None:
    assert next_attempt_at(100.0, 100.0, 1, [60.0], 3600.0, _Low(), min_delay=0.0) == 100.0


def test_full_jitter_draws_from_zero() -> None:
    assert next_delay(1, [60.0], _Low(), min_delay=0.0) == 0.0


# What the 2026-12-04 mutation run of retry/dedup/address/replies/regex_guard found unpinned
# (tests/MUTANTS.md, "First set, fourth run"; until issue 28 in
# tests/test_mutants_first_set.py): the exact texts of the errors an operator or a client
# reads, the bytes every dedup key hashes (keys are stored in the spool, so a release that
# hashed other bytes would let a resubmission after an upgrade through as new mail), text that
# was not UTF-8 in the hashed parts, the Idempotency-Key limits, and the boundaries of the
# command-character check of a path.
# --- relay/delivery/retry.py: the texts `relay check-config` shows for a bad retry schedule -------


@pytest.mark.parametrize(
    ("failures", "schedule", "min_delay", "message"),
    [
        (1, [], 1.0, "retry schedule must contain at least one step"),
        (1, [60, -1], 1.0, "retry schedule steps must be >= 0 seconds, got -1"),
        (1, [60, float("nan")], 1.0, "retry schedule steps must be >= 0 seconds, got nan"),
        (0, [60], 1.0, "failures must be >= 1, got 0"),
        (1, [60], -0.5, "min_delay must be >= 0, got -0.5"),
    ],
)
def test_retry_argument_errors_say_what_is_wrong(
    failures: int, schedule: list[float], min_delay: float, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        next_delay(failures, schedule, random.Random(1), min_delay)
    assert str(raised.value) == message
