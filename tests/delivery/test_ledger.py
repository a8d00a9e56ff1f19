"""relay/delivery/ledger.py: the daily ledger: counts and roll-over, limits and room per scope, time
zones of windows and warm-up, fleet grants, reservations and their hand-over on failover."""

from __future__ import annotations

import datetime as dt
import os
import time
import zoneinfo
from collections.abc import Iterator

import pytest

from relay.config.tree import Identity, WarmupConf
from relay.delivery.ledger import Ledger


def test_ledger_reserves_counts_and_rolls_over() -> None:
    led = Ledger(zoneinfo.ZoneInfo("UTC"), 100.0)
    led.load(led.day_of(1000.0), {"dest:d": 1})
    limits = led.limits("d", 3, "id", None, 1000.0)
    assert limits == [("dest:d", "d", 3)]
    assert led.room(limits, 1000.0)[0] == 2
    led.reserve(("dest:d",), 2)
    assert led.room(limits, 1000.0)[0] == 0  # reserved counts until released
    bump = led.release(("dest:d",), 2, 1, 1001.0, "d", True)
    assert bump == ("dest:d",) and led.today("dest:d") == 2
    assert led.room(limits, 1001.0)[0] == 1
    led.reserve(("dest:d",), 1)
    assert led.room(limits, 1100.0)[0] == 2  # a new window: counts reset, the job in flight
    assert led.release((), 0, 4, 1100.0, "e", False) == ("dest:e",)  # counted for stats
    assert led.today("dest:e") == 4


def test_ledger_limits_room_and_counts_per_scope() -> None:
    import datetime as dt

    from relay.config.tree import Identity, WarmupConf

    utc = zoneinfo.ZoneInfo("UTC")
    led = Ledger(utc, None)
    now = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC).timestamp()
    warm = Identity("shop.test", 1000, WarmupConf(dt.date(2026, 12, 2), None, 50, 2.0, None))
    assert led.day_of(now) == "2026-12-03"
    assert led.warmup_limit(warm, now) == 100  # day 2 of 50 x 2^(n-1)
    limits = led.limits("d", 500, "shop.test", warm, now)
    assert limits == [("dest:d", "d", 500), ("id:shop.test", "shop.test", 100)]
    assert led.limits("d", None, "x", Identity("x", None, None), now) == []
    led.load("2026-12-03", {"dest:d": 10, "id:shop.test": 95})
    room = led.room(limits, now)
    nxt = dt.datetime(2026, 12, 4, tzinfo=dt.UTC).timestamp()
    assert room == (5, nxt, shaping_reason(100, "shop.test", nxt))  # the tighter ceiling
    led.reserve(("dest:d", "id:shop.test"), 3)
    led.reserve(("id:shop.test",), 1)
    assert led.reserved == {"dest:d": 3, "id:shop.test": 4}
    assert led.room(limits, now)[0] == 1
    bumps = led.release(("dest:d", "id:shop.test"), 3, 2, now, "d", True)
    assert bumps == ("dest:d", "id:shop.test")
    assert led.reserved == {"dest:d": 0, "id:shop.test": 1}
    assert (led.today("dest:d"), led.today("id:shop.test")) == (12, 97)
    assert led.today("nothing") == 0
    # a scope never reserved (a reload added a ceiling) starts from zero, never negative
    led.release(("id:new",), 2, 1, now, "d", True)
    assert led.reserved["id:new"] == 0 and led.today("id:new") == 1


def shaping_reason(limit: int, name: str, nxt: float) -> str:
    from relay.delivery import shaping

    return shaping.ceiling_reason(limit, name, nxt)


# Mutation-driven (tests/MUTANTS.md; until issue 28 in tests/test_mutants_delivery_core.py).
UTC = zoneinfo.ZoneInfo("UTC")
KIRI = zoneinfo.ZoneInfo("Pacific/Kiritimati")  # UTC+14, no DST
# 2026-12-01T12:00Z: already 2026-12-02 (02:00) in Kiritimati
NOON = dt.datetime(2026, 12, 1, 12, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def utc_local() -> Iterator[None]:
    """The process's local time is UTC, so a zone lost (None = local) shows."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


# --- ledger: time zones ------------------------------------------------------------------------


def test_day_of_uses_the_ledger_zone(utc_local: None) -> None:
    assert Ledger(KIRI, None).day_of(NOON) == "2026-12-02"


def warm(
    schedule: tuple[int, ...] | None, factor: float = 2.0, ceiling: int | None = None
) -> Identity:
    return Identity(
        "corp.test",
        None,
        WarmupConf(dt.date(2026, 12, 1), schedule, 10, factor, ceiling),
    )


def test_warmup_day_is_the_ledger_zones_date(utc_local: None) -> None:
    # day 2 in Kiritimati, day 1 in UTC
    assert Ledger(KIRI, None).warmup_limit(warm((100, 200, 300)), NOON) == 200


def test_warmup_schedule_and_ceiling_are_passed_on() -> None:
    led = Ledger(UTC, None)
    assert led.warmup_limit(warm((100, 200, 300), ceiling=250), NOON) == 100
    after = NOON + 5 * 86400  # past the 3-day schedule: the ceiling is the limit
    assert led.warmup_limit(warm((100, 200, 300), ceiling=250), after) == 250


def test_warmup_factor_is_passed_on() -> None:
    led = Ledger(UTC, None)
    assert led.warmup_limit(warm(None, factor=3.0), NOON + 86400) == 30


def test_limits_take_the_smaller_of_daily_limit_and_warmup() -> None:
    ident = Identity("corp.test", 50, WarmupConf(dt.date(2026, 12, 1), (100,), 10, 2.0, None))
    led = Ledger(UTC, None)
    assert led.limits("x.test", None, "corp.test", ident, NOON) == [
        ("id:corp.test", "corp.test", 50)
    ]


# --- ledger: room ------------------------------------------------------------------------------

LIM = [("dest:x.test", "x.test", 100)]


@pytest.mark.parametrize(
    ("grants", "want"),
    [({"dest:x.test": 5}, 5), ({"dest:x.test": 0}, 0), ({"dest:x.test": -3}, 0), ({}, 0)],
)
def test_room_in_a_fleet_is_what_the_grant_left(grants: dict[str, int], want: int) -> None:
    led = Ledger(UTC, None, grants=grants)
    room = led.room(LIM, NOON)
    assert room is not None and room[0] == want


def test_room_keeps_the_first_of_equal_ceilings_and_the_smallest() -> None:
    led = Ledger(UTC, None)
    two = [("dest:x.test", "x.test", 10), ("id:corp.test", "corp.test", 10)]
    room = led.room(two, NOON)
    assert (
        room is not None
        and room[0] == 10
        and room[2].endswith("for x.test; next window 2026-12-02T00:00Z")
    )
    smaller_first = [("dest:x.test", "x.test", 3), ("id:corp.test", "corp.test", 10)]
    room = led.room(smaller_first, NOON)
    assert room == (
        3,
        dt.datetime(2026, 12, 2, tzinfo=UTC).timestamp(),
        "daily limit 3 reached for x.test; next window 2026-12-02T00:00Z",
    )


def test_room_next_window_in_the_ledger_zone(utc_local: None) -> None:
    room = Ledger(KIRI, None).room(LIM, NOON)
    # next Kiritimati midnight: 2026-12-03T00:00+14 = 2026-12-02T10:00Z
    assert room is not None and room[1] == dt.datetime(2026, 12, 2, 10, tzinfo=UTC).timestamp()


def test_room_next_window_of_a_fixed_length() -> None:
    room = Ledger(UTC, 3600.0).room(LIM, NOON + 60)
    assert room is not None and room[1] == NOON + 3600


# --- ledger: reserve / release -----------------------------------------------------------------


def test_reserve_takes_from_the_grant() -> None:
    led = Ledger(UTC, None, grants={"dest:x.test": 5})
    led.reserve(("dest:x.test", "id:corp.test"), 2)
    assert led.grants == {"dest:x.test": 3, "id:corp.test": -2}
    assert led.reserved == {"dest:x.test": 2, "id:corp.test": 2}


def test_release_of_nothing_reserved_leaves_no_reservation() -> None:
    led = Ledger(UTC, None)
    led.load(led.day_of(NOON), {})
    assert led.release(("dest:x.test",), 0, 0, NOON, "x.test", True) == ("dest:x.test",)
    assert led.reserved == {"dest:x.test": 0}


def test_release_adds_to_the_unlimited_destination_count() -> None:
    led = Ledger(UTC, None)
    led.load(led.day_of(NOON), {"dest:x.test": 3})
    assert led.release((), 2, 2, NOON, "x.test", False) == ("dest:x.test",)
    assert led.counts == {"dest:x.test": 5}


# --- ledger: failover hands a reservation over ---------------------------------------------


@pytest.mark.parametrize(
    ("scopes", "dst_limit", "after", "reserved"),
    [
        # both limited: the reservation moves from the primary's ceiling to the backup's
        (
            ("dest:a", "id:corp"),
            10,
            ("id:corp", "dest:b"),
            {"dest:a": 1, "dest:b": 3, "id:corp": 3},
        ),
        # an unlimited backup: nothing to reserve under it (its deliveries still count)
        (("dest:a",), None, (), {"dest:a": 1}),
        # an unlimited primary: only the backup's ceiling is reserved
        (("id:corp",), 10, ("id:corp", "dest:b"), {"dest:a": 4, "dest:b": 3, "id:corp": 3}),
    ],
)
def test_hand_over(
    scopes: tuple[str, ...], dst_limit: int | None, after: tuple[str, ...], reserved: dict[str, int]
) -> None:
    led = Ledger(UTC, None)
    led.reserve(scopes, 3)
    led.reserve(("dest:a",), 1)  # another job of the primary's keeps its reservation
    if "dest:a" not in scopes:
        led.reserve(("dest:a",), 3)
    assert led.hand_over(scopes, 3, "a", "b", dst_limit) == after
    assert {k: v for k, v in led.reserved.items() if v} == reserved
