"""Tests for relay.delivery.shaping with an injected clock: buckets, rates, windows, warm-up, AIMD,
reply rules and the circuit breaker."""

from __future__ import annotations

import datetime as dt
import math
import re
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.delivery.shaping import (
    DEFAULT_RULES,
    UNLIMITED,
    Adaptive,
    Breaker,
    ShapingRule,
    TokenBucket,
    Warmup,
    ceiling_reason,
    day_key,
    effective_daily_limit,
    is_unlimited,
    match_rules,
    next_window,
    parse_rule,
    warmup_limit,
    window_start,
)

UTC = dt.UTC
WARSAW = ZoneInfo("Europe/Warsaw")
SANTIAGO = ZoneInfo("America/Santiago")


def ts(text: str, tz: dt.tzinfo = UTC) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=tz).timestamp()


# --- token bucket -------------------------------------------------------------------------


def test_bucket_starts_full_and_clamps() -> None:
    assert TokenBucket(rate=5, burst=5).tokens == 5
    assert TokenBucket(rate=5, burst=5, tokens=100).tokens == 5
    assert TokenBucket(rate=5, burst=5, tokens=2).tokens == 2


def test_bucket_30_takes_need_5_seconds() -> None:
    bucket = TokenBucket(rate=5, burst=5, updated=0.0)
    now = 0.0
    taken_at: list[float] = []
    while len(taken_at) < 30:
        if bucket.try_take(now):
            taken_at.append(now)
        else:
            wait = bucket.wait_time(now)
            assert wait > 0
            now += wait
        assert 0 <= bucket.tokens <= bucket.burst
    assert taken_at[4] == 0.0  # the burst goes immediately
    assert taken_at[5] > 0.0
    assert now >= 5.0 - 1e-6
    assert now == pytest.approx(5.0)
    # never more than burst at any instant, and never more than burst + rate * span overall
    for t in set(taken_at):
        assert taken_at.count(t) <= 5
    for i, start in enumerate(taken_at):
        for j in range(i, len(taken_at)):
            span = taken_at[j] - start
            assert j - i + 1 <= 5 + 5 * span + 1e-6


def test_bucket_wait_time_and_refill() -> None:
    bucket = TokenBucket(rate=2, burst=4, tokens=0, updated=100.0)
    assert bucket.wait_time(100.0) == pytest.approx(0.5)
    assert bucket.wait_time(100.0, 3) == pytest.approx(1.5)
    assert not bucket.try_take(100.4)
    assert bucket.try_take(100.5)
    bucket.refill(1000.0)
    assert bucket.tokens == 4
    assert bucket.wait_time(1000.0, 4) == 0.0


def test_bucket_clock_backwards_adds_nothing() -> None:
    bucket = TokenBucket(rate=1, burst=10, tokens=0, updated=100.0)
    bucket.refill(50.0)
    assert bucket.tokens == 0
    assert bucket.updated == 100.0
    bucket.refill(101.0)
    assert bucket.tokens == pytest.approx(1.0)


def test_bucket_set_rate_credits_old_rate_first() -> None:
    bucket = TokenBucket(rate=1, burst=100, tokens=0, updated=0.0)
    bucket.set_rate(10, now=10.0)
    assert bucket.tokens == pytest.approx(10.0)
    bucket.refill(11.0)
    assert bucket.tokens == pytest.approx(20.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": 0, "burst": 5},
        {"rate": -1, "burst": 5},
        {"rate": math.inf, "burst": 5},
        {"rate": 1, "burst": 0},
        {"rate": 1, "burst": 1, "tokens": -1},
    ],
)
def test_bucket_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TokenBucket(**kwargs)


def test_bucket_rejects_impossible_take() -> None:
    bucket = TokenBucket(rate=1, burst=2)
    with pytest.raises(ValueError):
        bucket.try_take(0.0, 3)
    with pytest.raises(ValueError):
        bucket.wait_time(0.0, -1)
    with pytest.raises(ValueError):
        bucket.set_rate(0, 0.0)


@given(
    ops=st.lists(
        st.tuples(
            st.floats(min_value=-5, max_value=50, allow_nan=False),
            st.floats(min_value=0, max_value=3, allow_nan=False),
        ),
        max_size=60,
    ),
    rate=st.floats(min_value=0.01, max_value=1000, allow_nan=False),
)
def test_bucket_never_negative_nor_above_burst(ops: list[tuple[float, float]], rate: float) -> None:
    bucket = TokenBucket(rate=rate, burst=3, updated=0.0)
    now = 0.0
    for dt_, n in ops:
        now += dt_
        bucket.try_take(now, n)
        assert 0 <= bucket.tokens <= bucket.burst
        assert bucket.wait_time(now, n) >= 0
        assert 0 <= bucket.tokens <= bucket.burst


def test_is_unlimited() -> None:
    assert is_unlimited(None)
    assert is_unlimited(UNLIMITED)
    assert not is_unlimited(0.1)


# --- daily windows ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "start", "nxt", "key"),
    [
        ("2026-12-02T00:00:00", "2026-12-02T00:00:00", "2026-12-03T00:00:00", "2026-12-02"),
        ("2026-12-02T13:45:10", "2026-12-02T00:00:00", "2026-12-03T00:00:00", "2026-12-02"),
        ("2026-12-02T23:59:59", "2026-12-02T00:00:00", "2026-12-03T00:00:00", "2026-12-02"),
        ("2026-12-31T23:59:59", "2026-12-31T00:00:00", "2027-01-01T00:00:00", "2026-12-31"),
    ],
)
def test_windows_utc(now: str, start: str, nxt: str, key: str) -> None:
    t = ts(now)
    assert window_start(t) == ts(start)
    assert next_window(t) == ts(nxt)
    assert day_key(t) == key


@pytest.mark.parametrize(
    ("local_now", "start_utc", "length_h", "key"),
    [
        # spring forward: 02:00 CET -> 03:00 CEST, a 23 hour day
        ("2026-03-29T12:00:00", "2026-03-28T23:00:00", 23, "2026-03-29"),
        ("2026-03-29T01:59:59", "2026-03-28T23:00:00", 23, "2026-03-29"),
        ("2026-03-29T03:00:00", "2026-03-28T23:00:00", 23, "2026-03-29"),
        ("2026-03-30T00:00:00", "2026-03-29T22:00:00", 24, "2026-03-30"),
        # fall back: 03:00 CEST -> 02:00 CET, a 25 hour day
        ("2026-10-25T12:00:00", "2026-10-24T22:00:00", 25, "2026-10-25"),
        ("2026-10-25T23:59:59", "2026-10-24T22:00:00", 25, "2026-10-25"),
        ("2026-10-24T23:59:59", "2026-10-23T22:00:00", 24, "2026-10-24"),
    ],
)
def test_windows_dst_warsaw(local_now: str, start_utc: str, length_h: int, key: str) -> None:
    t = ts(local_now, WARSAW)
    start = window_start(t, WARSAW)
    assert start == ts(start_utc)
    assert next_window(t, WARSAW) - start == length_h * 3600
    assert day_key(t, WARSAW) == key
    assert start <= t < next_window(t, WARSAW)


def test_window_in_repeated_hour() -> None:
    # 02:30 local happens twice on 2026-10-25; both belong to the same day
    first = dt.datetime(2026, 10, 25, 2, 30, tzinfo=WARSAW, fold=0).timestamp()
    second = dt.datetime(2026, 10, 25, 2, 30, tzinfo=WARSAW, fold=1).timestamp()
    assert second - first == 3600
    assert window_start(first, WARSAW) == window_start(second, WARSAW)
    assert day_key(first, WARSAW) == day_key(second, WARSAW) == "2026-10-25"


def test_window_when_local_midnight_does_not_exist() -> None:
    # Chile springs forward at 00:00 -> 01:00 on 2026-09-06: the day starts at 01:00 -03
    t = ts("2026-09-06T12:00:00", SANTIAGO)
    start = window_start(t, SANTIAGO)
    assert start == ts("2026-09-06T04:00:00")
    assert next_window(t, SANTIAGO) - start == 23 * 3600
    assert window_start(start, SANTIAGO) == start
    assert day_key(start - 1, SANTIAGO) == "2026-09-05"
    assert next_window(start - 1, SANTIAGO) == start


@given(
    t=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    tz=st.sampled_from([UTC, WARSAW, SANTIAGO, ZoneInfo("Australia/Lord_Howe")]),
)
def test_window_contains_now(t: float, tz: dt.tzinfo) -> None:
    start, nxt = window_start(t, tz), next_window(t, tz)
    assert start <= t < nxt
    assert day_key(start, tz) == day_key(t, tz)
    assert day_key(nxt, tz) != day_key(t, tz)


@pytest.mark.parametrize(
    ("now", "start", "key"),
    [
        (0.0, 0.0, "0"),
        (9.99, 0.0, "0"),
        (10.0, 10.0, "10"),
        (1_700_000_005.5, 1_700_000_000.0, "1700000000"),
    ],
)
def test_short_test_window(now: float, start: float, key: str) -> None:
    assert window_start(now, length=10) == start
    assert next_window(now, length=10) == start + 10
    assert day_key(now, length=10) == key
    # tz is ignored for fixed-length windows
    assert window_start(now, WARSAW, length=10) == start


def test_short_window_rollover() -> None:
    keys = [day_key(t / 2, length=10.0) for t in range(0, 60)]
    assert keys[:20] == ["0"] * 20
    assert keys[20:40] == ["10"] * 20
    assert len(set(keys)) == 3


@pytest.mark.parametrize("length", [0, -10, math.inf, math.nan])
def test_bad_window_length(length: float) -> None:
    with pytest.raises(ValueError):
        window_start(0.0, length=length)


# --- warm-up and daily ceiling ------------------------------------------------------------

START = dt.date(2026, 12, 1)


@pytest.mark.parametrize(
    ("today", "expected"),
    [
        (dt.date(2026, 11, 20), 500),  # before the start counts as day 1
        (START, 500),
        (dt.date(2026, 12, 2), 1000),
        (dt.date(2026, 12, 3), 2000),
        (dt.date(2026, 12, 8), 500 * 2**7),
        (dt.date(2036, 12, 1), None),  # uncapped curve grows beyond any sane limit
    ],
)
def test_warmup_doubling(today: dt.date, expected: int | None) -> None:
    assert warmup_limit(Warmup(start=START), today) == expected


def test_warmup_doubling_uncapped_is_monotonic() -> None:
    w = Warmup(start=START, initial=100, factor=1.5)
    limits = [warmup_limit(w, START + dt.timedelta(days=d)) for d in range(40)]
    assert limits[:4] == [100, 150, 225, 337]
    ints = [v for v in limits if v is not None]
    assert ints == sorted(ints)


@pytest.mark.parametrize(
    ("day", "expected"),
    [(1, 500), (2, 1000), (4, 4000), (5, 5000), (6, 5000), (400, 5000), (100_000, 5000)],
)
def test_warmup_doubling_ceiling(day: int, expected: int) -> None:
    w = Warmup(start=START, ceiling=5000)
    assert warmup_limit(w, START + dt.timedelta(days=day - 1)) == expected


def test_warmup_factor_one_is_flat() -> None:
    w = Warmup(start=START, initial=300, factor=1.0)
    assert warmup_limit(w, START + dt.timedelta(days=1000)) == 300


@pytest.mark.parametrize(
    ("day", "ceiling", "expected"),
    [
        (0, None, 50),
        (1, None, 50),
        (2, None, 200),
        (3, None, 1000),
        (4, None, None),  # after the list: warm-up over
        (30, None, None),
        (3, 800, 800),  # list values are capped at the ceiling
        (4, 800, 800),  # after the list: the ceiling stays
    ],
)
def test_warmup_explicit(day: int, ceiling: int | None, expected: int | None) -> None:
    w = Warmup(start=START, schedule=(50, 200, 1000), ceiling=ceiling)
    assert warmup_limit(w, START + dt.timedelta(days=day - 1)) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schedule": ()},
        {"schedule": (10, 0)},
        {"initial": 0},
        {"factor": 0.5},
        {"factor": math.nan},
        {"ceiling": 0},
    ],
)
def test_warmup_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Warmup(start=START, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("daily", "warm", "expected"),
    [(None, None, None), (5000, None, 5000), (None, 500, 500), (5000, 500, 500), (100, 500, 100)],
)
def test_effective_daily_limit(daily: int | None, warm: int | None, expected: int | None) -> None:
    assert effective_daily_limit(daily, warm) == expected


def test_ceiling_reason_exact() -> None:
    nxt = next_window(ts("2026-12-02T15:00:00"))
    assert (
        ceiling_reason(5000, "example.com", nxt)
        == "daily limit 5000 reached for example.com; next window 2026-12-03T00:00Z"
    )


def test_ceiling_reason_is_utc_for_local_windows() -> None:
    nxt = next_window(ts("2026-12-02T15:00:00", WARSAW), WARSAW)
    assert (
        ceiling_reason(20, "relay", nxt) == "daily limit 20 reached for relay; next window "
        "2026-12-02T23:00Z"
    )


# --- AIMD ---------------------------------------------------------------------------------


def test_aimd_halves_to_floor() -> None:
    a = Adaptive(base_rate=16.0, base_connections=8)
    now = 0.0
    factors = []
    for _ in range(7):
        assert a.on_throttle(now)
        factors.append(a.factor)
        now += 5.0
    assert factors == [0.5, 0.25, 0.125, 1 / 16, 1 / 16, 1 / 16, 1 / 16]
    assert a.effective_rate() == 1.0
    assert a.effective_connections() == 1


def test_aimd_one_decrease_per_min_interval() -> None:
    a = Adaptive(base_rate=10.0, base_connections=10)
    # ten concurrent connections all get 421 at about the same moment
    results = [a.on_throttle(100.0 + i * 0.1) for i in range(10)]
    assert results == [True] + [False] * 9
    assert a.factor == 0.5
    assert not a.on_throttle(104.9)
    assert a.on_throttle(105.0)
    assert a.factor == 0.25


def test_aimd_first_throttle_at_small_clock_values() -> None:
    a = Adaptive(base_rate=10.0, base_connections=10)
    assert a.on_throttle(0.0)
    assert a.factor == 0.5


def test_aimd_recovery_steps_and_cooldown() -> None:
    a = Adaptive(base_rate=10.0, base_connections=10)
    a.on_throttle(1000.0)
    assert a.factor == 0.5
    # 20 successes inside the cooldown: no increase
    assert not any(a.on_success(1000.0 + i) for i in range(20))
    assert a.factor == 0.5
    # first success after the cooldown triggers the pending step
    assert a.on_success(1060.0)
    assert a.factor == pytest.approx(0.6)
    # each further step needs another 20 successes
    results = [a.on_success(1070.0) for _ in range(20)]
    assert results == [False] * 19 + [True]
    assert a.factor == pytest.approx(0.7)
    for _ in range(100):
        a.on_success(2000.0)
    assert a.factor == 1.0
    assert a.effective_connections() == 10
    assert not a.on_success(2000.0)


def test_aimd_throttle_resets_success_count() -> None:
    a = Adaptive(base_rate=10.0, base_connections=4, cooldown=0.0)
    a.on_throttle(0.0)
    for _ in range(19):
        a.on_success(10.0)
    a.on_throttle(11.0)  # 11 s after the last decrease: halves again
    assert a.factor == 0.25
    for _ in range(19):
        assert not a.on_success(20.0)
    assert a.on_success(20.0)


def test_aimd_hold_blocks_recovery() -> None:
    a = Adaptive(base_rate=10.0, base_connections=4, cooldown=0.0)
    a.on_throttle(0.0, hold=300.0)
    assert a.hold_until == 300.0
    assert not any(a.on_success(299.0) for _ in range(40))
    assert a.on_success(300.0)


def test_aimd_connections_and_state() -> None:
    a = Adaptive(base_rate=0.0, base_connections=5)
    a.on_throttle(0.0)
    assert a.effective_connections() == 2
    assert a.effective_rate() == 0.0  # unlimited stays unlimited
    state = a.state()
    assert state["factor"] == 0.5
    assert state["effective_connections"] == 2
    assert state["last_decrease"] == 0.0
    assert state["successes"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"factor": 0.0},
        {"factor": 1.5},
        {"min_factor": 0.0},
        {"step": 0.0},
        {"successes_per_step": 0},
        {"base_connections": 0},
        {"base_rate": -1.0},
    ],
)
def test_aimd_validation(kwargs: dict[str, float]) -> None:
    base: dict[str, float] = {"base_rate": 1.0, "base_connections": 1}
    with pytest.raises(ValueError):
        Adaptive(**(base | kwargs))  # type: ignore[arg-type]


# --- shaping rules ------------------------------------------------------------------------

YAHOO_TS04 = (
    "421 4.7.0 [TS04] Messages from 1.2.3.4 temporarily deferred due to unexpected volume "
    "or user complaints"
)


@pytest.mark.parametrize(
    ("reply", "action", "duration"),
    [
        (YAHOO_TS04, "suspend", 7200.0),
        ("421 4.7.0 [TSS04] Messages from 1.2.3.4 temporarily deferred", "suspend", 7200.0),
        ("421 4.7.0 [TS01] Messages from 1.2.3.4 temporarily deferred", "throttle", 300.0),
        ("421 4.7.0 [TS03] All messages from 1.2.3.4 will be deferred", "throttle", 300.0),
        (
            "451 4.7.650 The mail server [1.2.3.4] has been temporarily rate limited due to IP "
            "reputation.",
            "throttle",
            300.0,
        ),
        (
            "421-4.7.28 Our system has detected an unusual rate of unsolicited mail",
            "throttle",
            300.0,
        ),
        ("421 4.7.0 Try again later,\nrate limit exceeded", "throttle", 300.0),
    ],
)
def test_default_rules(reply: str, action: str, duration: float) -> None:
    rule = match_rules(DEFAULT_RULES, reply)
    assert rule is not None
    assert (rule.action, rule.duration) == (action, duration)


@pytest.mark.parametrize(
    "reply",
    [
        "421 4.7.0 Try again later, closing connection.",
        "450 4.2.1 The user you are trying to contact is receiving mail too quickly",
        "250 2.0.0 OK",
        "451 4.7.6500 something else",
        "421 [TS05] unknown",
    ],
)
def test_default_rules_no_match(reply: str) -> None:
    assert match_rules(DEFAULT_RULES, reply) is None


def test_parse_rule_and_first_match() -> None:
    suspend = parse_rule({"match": r"\[TS0[1-3]\]", "action": "suspend", "for": 7200})
    assert suspend.action == "suspend"
    assert suspend.duration == 7200.0
    throttle = parse_rule({"match": "ts01", "action": "throttle"})
    assert throttle.duration == 0.0
    assert match_rules([suspend, throttle], "421 [TS01] deferred") is suspend
    assert match_rules([throttle, suspend], "421 [TS01] deferred") is throttle
    assert match_rules([suspend, throttle], "421 [TS04] deferred") is None
    assert match_rules([], YAHOO_TS04) is None
    # operator rules can be placed ahead of the defaults
    assert match_rules([throttle, *DEFAULT_RULES], YAHOO_TS04) is DEFAULT_RULES[0]


@pytest.mark.parametrize(
    ("mapping", "fragment"),
    [
        ({"match": "x", "action": "suspend"}, "'for'"),
        ({"match": "x", "action": "pause", "for": 1}, "'action'"),
        ({"action": "suspend", "for": 1}, "'match'"),
        ({"match": "", "action": "suspend", "for": 1}, "'match'"),
        ({"match": "(", "action": "suspend", "for": 1}, "invalid regular expression"),
        ({"match": "x", "action": "suspend", "for": "2h"}, "'for' must be a number"),
        ({"match": "x", "action": "suspend", "for": True}, "'for' must be a number"),
        ({"match": "x", "action": "suspend", "for": -1}, "'for' must be >= 0"),
        ({"match": "x", "action": "suspend", "for": 1, "regex": "y"}, "unknown key 'regex'"),
    ],
)
def test_parse_rule_errors(mapping: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_rule(mapping)
    assert fragment in str(excinfo.value)


def test_shaping_rule_validation() -> None:
    with pytest.raises(ValueError):
        ShapingRule(re.compile("x"), "pause", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ShapingRule(re.compile("x"), "suspend", -1.0)


# --- circuit breaker ----------------------------------------------------------------------


def test_breaker_opens_at_threshold() -> None:
    b = Breaker(threshold=3, cooldown=60.0)
    for i in range(2):
        b.on_failure(float(i))
        assert b.state(float(i)) == "closed"
        assert b.allow(float(i))
    b.on_failure(2.0)
    assert b.state(2.0) == "open"
    assert not b.allow(2.0)
    assert not b.allow(61.9)


def test_breaker_success_resets_count() -> None:
    b = Breaker(threshold=3)
    b.on_failure(0.0)
    b.on_failure(1.0)
    b.on_success(2.0)
    b.on_failure(3.0)
    b.on_failure(4.0)
    assert b.state(4.0) == "closed"


def test_breaker_half_open_single_trial_success() -> None:
    b = Breaker(threshold=1, cooldown=60.0)
    b.on_failure(0.0)
    assert b.state(60.0) == "half-open"
    assert b.allow(60.0)
    assert not b.allow(60.0)
    assert not b.allow(70.0)
    b.on_success(75.0)
    assert b.state(75.0) == "closed"
    assert b.allow(75.0)
    assert b.allow(75.0)


def test_breaker_failed_trial_reopens_with_fresh_cooldown() -> None:
    b = Breaker(threshold=2, cooldown=60.0)
    b.on_failure(0.0)
    b.on_failure(0.0)
    assert b.allow(100.0)
    b.on_failure(110.0)
    assert b.state(110.0) == "open"
    assert not b.allow(169.9)
    assert b.state(170.0) == "half-open"
    assert b.allow(170.0)


def test_breaker_ignores_late_failures_while_open() -> None:
    b = Breaker(threshold=1, cooldown=60.0)
    b.on_failure(0.0)
    b.on_failure(30.0)  # connection started before opening
    assert b.state(60.0) == "half-open"


def test_breaker_release_and_stale_trial() -> None:
    b = Breaker(threshold=1, cooldown=60.0)
    b.on_failure(0.0)
    assert b.allow(60.0)
    b.release()
    assert b.allow(61.0)  # a new trial may start right away
    # a trial that never reports is replaced after another cooldown
    assert not b.allow(120.0)
    assert b.allow(121.0)


@pytest.mark.parametrize("kwargs", [{"threshold": 0}, {"cooldown": -1.0}])
def test_breaker_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Breaker(**kwargs)  # type: ignore[arg-type]
