"""Mutation-driven tests of the delivery engine's pure core: decide (attempt log duration,
`human`), the daily ledger (time zones of windows and warm-up, fleet grants, reservations),
routes (match edge cases, exact config refusals, secret keys, paths) and the health
judgements (exact details, `human` at unit boundaries, Model.drop)."""

from __future__ import annotations

import datetime as dt
import os
import random
import time
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay.config.tree import Identity, WarmupConf
from relay.delivery import decide, routes
from relay.delivery.jobs import Job
from relay.delivery.ledger import Ledger
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import RcptResult
from relay.ops import health
from relay.spool import ops

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


# --- routes: match -----------------------------------------------------------------------------

SMART = routes.UpstreamHost("smarthost", "smart.test", 587, "starttls")


def no_secret(path: Path, key: str) -> str:
    raise AssertionError(f"unexpected secret read {path} {key}")


def parse(
    ups: Any, rts: Any, mode: str = "smarthost", base: Path = Path("/"), rs: Any = no_secret
) -> routes.Routing:
    return routes.parse(ups, rts, mode=mode, smarthost=SMART, base=base, read_secret=rs)


def test_sender_without_at_has_no_domain() -> None:
    r = parse(None, [{"sender_domain": "corp.test", "via": "mx"}, {"via": ["smarthost"]}])
    assert r.match(sender="corp.test", recipient="u@x.test", client="", listener=None).index == 1
    assert r.match(sender="a@corp.test", recipient="u@x.test", client="", listener=None).index == 0


def test_listener_client_is_no_auth_user() -> None:
    r = parse(None, [{"auth_user": "ner:cron", "via": "mx"}, {"via": ["smarthost"]}])
    got = r.match(sender="a@b.test", recipient="u@x.test", client="listener:cron", listener=None)
    assert got.index == 1


@pytest.mark.parametrize("name", ["efgh", "xxxx"])
def test_user_client_is_on_no_listener(name: str) -> None:
    r = parse(None, [{"listener": name, "via": "mx"}, {"via": ["smarthost"]}])
    for client in ("user:abcdefgh", "user:crm"):
        got = r.match(sender="a@b.test", recipient="u@x.test", client=client, listener=None)
        assert got.index == 1


def test_an_unmatched_auth_user_route_goes_on_to_the_next() -> None:
    r = parse(
        None,
        [
            {"auth_user": "crm", "via": "mx"},
            {"sender_domain": "corp.test", "via": "mx"},
            {"via": ["smarthost"]},
        ],
    )
    got = r.match(sender="a@corp.test", recipient="u@x.test", client="user:other", listener=None)
    assert got.index == 1


# --- routes: parse -----------------------------------------------------------------------------


def refused(ups: Any, rts: Any, **kw: Any) -> str:
    with pytest.raises(routes.RouteConfigError) as e:
        parse(ups, rts, **kw)
    return str(e.value)


def test_exact_refusals_of_parse() -> None:
    assert refused(["a"], None) == "upstreams: expected a mapping of name -> upstream"
    assert refused(None, []) == "routes: expected a non-empty list"
    assert refused({"A!": {"host": "a"}}, None) == (
        "upstreams.A!: an upstream name is lowercase letters, digits, '-' and '_'"
        " (it names a destination too)"
    )
    assert refused({"a": "a.test"}, None) == "upstreams.a: expected a mapping"
    assert refused({"a": {"host": "a", "password": "x"}}, None) == (
        "upstreams.a.password: unknown key (secrets go in password_file)"
    )
    assert refused({"a": {"host": "a", "tls": "ssl"}}, None) == (
        "upstreams.a.tls: 'ssl' is not one of none, opportunistic, starttls, implicit"
    )
    assert refused({"a": {"host": "a", "auth": "md5"}}, None) == (
        "upstreams.a.auth: 'md5' is not one of auto, plain, login, xoauth2, oauthbearer"
    )
    oauth = {"host": "a", "auth": "xoauth2", "username": "u"}
    assert refused(
        {"a": {**oauth, "oauth": {"token_command": "x", "client_secret": "s"}}}, None
    ) == ("upstreams.a.oauth.client_secret: unknown key (secrets go in *_file keys)")
    assert refused(None, ["x"]) == "routes[0]: expected a mapping"
    assert refused(None, [{"via": "mx", "to": "x"}]) == (
        "routes[0].to: unknown key (conditions: sender, sender_domain, recipient_domain,"
        " listener, auth_user; then via, rewrite)"
    )


@pytest.mark.parametrize(
    "cond", ["sender", "sender_domain", "recipient_domain", "listener", "auth_user"]
)
def test_a_bad_condition_is_named(cond: str) -> None:
    assert refused(None, [{cond: [], "via": "mx"}]) == (
        f"routes[0].{cond}: expected a value or a list of values"
    )


def test_an_upstream_named_smarthost_overrides_the_block() -> None:
    r = parse({"smarthost": {"host": "mine.test"}}, [{"via": ["smarthost"]}])
    assert r.upstreams["smarthost"].host == "mine.test"


def test_upstreams_without_routes_go_via_smarthost() -> None:
    r = parse({"a": {"host": "a.test"}}, None)
    assert r.routes == (routes.Route(0, ("smarthost",)),)
    assert set(r.upstreams) == {"smarthost"}  # "a" is used by no route
    assert r.upstreams["smarthost"] is SMART


def test_unused_smarthost_is_kept() -> None:
    r = parse({"a": {"host": "a.test"}, "b": {"host": "b.test"}}, [{"via": ["a"]}])
    assert set(r.upstreams) == {"a", "smarthost"}


def test_secret_reads_name_their_key(tmp_path: Path) -> None:
    asked: list[tuple[Path, str]] = []

    def rs(path: Path, key: str) -> str:
        asked.append((path, key))
        return "s"

    ups = {
        "a": {"host": "a.test", "username": "u", "password_file": "pw"},
        "b": {
            "host": "b.test",
            "username": "u",
            "auth": "xoauth2",
            "oauth": {
                "token_url": "http://idp.test/token",
                "client_id": "c",
                "refresh_token_file": "rt",
                "timeout": 0.5,
            },
        },
    }
    r = parse(ups, [{"via": ["a", "b"]}], base=tmp_path, rs=rs)
    assert asked == [
        (tmp_path / "pw", "upstreams.a.password_file"),
        (tmp_path / "rt", "upstreams.b.oauth.refresh_token_file"),
    ]
    oauth = r.upstreams["b"].oauth
    assert oauth is not None
    assert oauth.token_url == "http://idp.test/token" and oauth.timeout == 0.5


def test_an_absolute_path_is_kept_as_written(tmp_path: Path) -> None:
    (tmp_path / "real.pem").write_text("x")
    (tmp_path / "ca.pem").symlink_to(tmp_path / "real.pem")
    r = parse({"a": {"host": "a.test", "ca_file": str(tmp_path / "ca.pem")}}, [{"via": ["a"]}])
    assert r.upstreams["a"].ca_file == tmp_path / "ca.pem"


# --- health ------------------------------------------------------------------------------------


def test_model_drop() -> None:
    m = health.Model()
    m.update("disk", "ok", "fine", 1.0)
    m.update("spool", "ok", "fine", 1.0)
    m.drop("disk")
    m.drop("nothing")
    assert list(m.checks) == ["spool"]


def test_exact_health_details() -> None:
    assert health.disk(1.0, 10.0, 5.0) == (
        "critical",
        "1.0% free where the spool lives (critical at 5%): new mail is refused with"
        " 452 4.3.1 until space is freed",
    )
    assert health.queue_age(None, 60.0, 120.0) == ("ok", "nothing waiting")
    assert health.queue_age(30.0, 60.0, 120.0) == ("ok", "oldest waiting recipient queued 30s ago")
    assert health.stall(0, None, 60.0) == ("ok", "the queue is moving")
    assert health.stall(3, None, 60.0) == (
        "warning",
        "queue stalled: 3 recipients due for over 1m0s and no delivery (none since start)",
    )
    assert health.stall(3, 120.0, 60.0) == (
        "warning",
        "queue stalled: 3 recipients due for over 1m0s and no delivery (last 2m0s ago)",
    )
    assert health.dead_letters(2, 5) == ("ok", "2 dead letters in the last hour")
    assert health.destination("x", "closed", 0, "535 bad auth", None) == (
        "critical",
        "x: upstream refused our configuration: 535 bad auth;"
        " mail is kept; fix the config and reload",
    )


@pytest.mark.parametrize(
    ("seconds", "want"),
    [(86400 + 3600, "1d1h"), (86400 + 3599, "1d0h"), (3600 + 60, "1h1m"), (3600 + 59, "1h0m")],
)
def test_health_human_boundaries(seconds: float, want: str) -> None:
    assert health.human(seconds) == want


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
