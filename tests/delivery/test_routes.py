"""Table tests of the delivery core's pure decisions: routes (parse, match), header
rewriting, what happens to a claim given a result (decide), whether a job may go now
(admit), what an attempt tells the breaker, waiting without burning attempts, and the
daily ledger."""

from __future__ import annotations

import random
import zoneinfo
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import ConfigError, load_config
from relay.delivery import decide, retry, routes
from relay.delivery.jobs import Job
from relay.delivery.ledger import Ledger
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.rewrite import rewrite_headers
from relay.delivery.transport import RcptResult
from relay.spool import ops
from relay.spool.model import RcptState

# --- routes ----------------------------------------------------------------------------------


def load(tmp_path: Path, extra: dict[str, Any]) -> Any:
    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": "spool"}, **extra}))
    return load_config(str(p))


UPS = {"a": {"host": "a.test"}, "b": {"host": "b.test", "port": 465, "tls": "implicit"}}


def test_without_routes_the_classic_single_route(tmp_path: Path) -> None:
    cfg = load(tmp_path, {})
    r = cfg.routing.match(
        sender="x@y.test", recipient="u@z.test", client="listener:l", listener="l"
    )
    assert r.via == ("smarthost",) and cfg.routing.upstreams["smarthost"].port == 587
    cfg = load(tmp_path, {"upstream": {"mode": "mx"}})
    assert cfg.routing.match(sender="", recipient="u@z.test", client="", listener=None).mx


@pytest.mark.parametrize(
    ("sender", "rcpt", "client", "listener", "want"),
    [
        ("a@billing.example.com", "u@x.test", "listener:main", "main", 0),
        ("A@BILLING.example.com", "u@x.test", "listener:main", "main", 0),  # case-insensitive
        ("boss@corp.test", "u@x.test", "listener:main", "main", 1),  # exact sender
        ("x@corp.test", "u@partner.test", "listener:main", "main", 2),  # recipient domain
        ("x@corp.test", "u@x.test", "listener:cron", "cron", 3),  # listener
        ("x@corp.test", "u@x.test", "user:crm", "main", 4),  # AUTH user
        ("x@corp.test", "u@x.test", "user:other", "main", 5),  # the catch-all
        ("", "u@x.test", "listener:main", "main", 5),  # a null sender matches no sender rule
    ],
)
def test_first_matching_route_wins(
    tmp_path: Path, sender: str, rcpt: str, client: str, listener: str, want: int
) -> None:
    cfg = load(
        tmp_path,
        {
            "upstreams": UPS,
            "routes": [
                {"sender_domain": "billing.example.com", "via": ["b"]},
                {"sender": ["boss@corp.test"], "via": ["b"]},
                {"recipient_domain": ["partner.test", "other.test"], "via": ["b", "a"]},
                {"listener": "cron", "via": "mx"},
                {"auth_user": "crm", "via": ["a"]},
                {"via": ["a", "b"]},
            ],
        },
    )
    assert (
        cfg.routing.match(sender=sender, recipient=rcpt, client=client, listener=listener).index
        == want
    )


@pytest.mark.parametrize(
    ("extra", "msg"),
    [
        ({"routes": [{"via": ["nope"]}]}, "routes[0].via: no upstream named 'nope'"),
        (
            {"upstreams": UPS, "routes": [{"sender": "a@b.c", "via": ["a"]}]},
            "routes[0]: the last route must match every message",
        ),
        ({"upstreams": UPS, "routes": [{"via": ["a", "a"]}]}, "named twice"),
        ({"upstreams": UPS, "routes": [{"via": "a"}]}, "routes[0].via: expected a list"),
        (
            {"upstreams": UPS, "routes": [{"sender_domian": "x", "via": ["a"]}]},
            "routes[0].sender_domian: unknown key",
        ),
        ({"upstreams": {"Bad.Name": {"host": "x"}}}, "upstreams.Bad.Name"),
        ({"upstreams": {"a": {"host": "x", "password": "p"}}}, "password_file"),
        (
            {"upstreams": {"a": {"host": "x", "username": "u"}}},
            "upstreams.a.password_file: required",
        ),
        (
            {"upstreams": {"a": {"host": "x", "auth": "xoauth2", "username": "u"}}},
            "upstreams.a.oauth: required",
        ),
        (
            {
                "upstreams": {
                    "a": {
                        "host": "x",
                        "auth": "xoauth2",
                        "username": "u",
                        "oauth": {
                            "token_url": "https://t",
                            "client_id": "i",
                            "client_secret": "inline",
                        },
                    }
                }
            },
            "secrets go in *_file keys",
        ),
        (
            {
                "upstreams": {
                    "a": {
                        "host": "x",
                        "auth": "xoauth2",
                        "username": "u",
                        "oauth": {
                            "token_url": "https://t",
                            "client_id": "i",
                            "client_secret_file": "missing",
                        },
                    }
                }
            },
            "client_secret_file: cannot read",
        ),
        (
            {"upstreams": UPS, "routes": [{"via": ["a"], "rewrite": {"from": "not an address"}}]},
            "routes[0].rewrite.from",
        ),
    ],
)
def test_bad_routes_are_config_errors_naming_the_key(tmp_path: Path, extra: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("*", r"\*")):
        load(tmp_path, extra)


def test_oauth_upstream_reads_its_secrets(tmp_path: Path) -> None:
    (tmp_path / "cs").write_text("client-secret\n")
    (tmp_path / "rt").write_text("refresh-token\n")
    cfg = load(
        tmp_path,
        {
            "upstreams": {
                "m365": {
                    "host": "smtp.office365.com",
                    "username": "a@b.test",
                    "auth": "xoauth2",
                    "oauth": {
                        "token_url": "https://login.test/token",
                        "client_id": "id",
                        "client_secret_file": "cs",
                        "refresh_token_file": "rt",
                        "scope": "s",
                    },
                }
            },
            "routes": [{"via": ["m365"]}],
        },
    )
    up = cfg.routing.upstreams["m365"]
    assert up.tls == "starttls" and up.port == 587 and up.auth == "xoauth2"
    assert up.oauth is not None
    assert (up.oauth.client_secret, up.oauth.refresh_token) == ("client-secret", "refresh-token")
    assert "client-secret" not in repr(up)


# --- rewriting ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "from_addr", "rto", "want"),
    [
        (
            b"From: App <a@old.test>\r\nSubject: x\r\n",
            "n@new.test",
            False,
            b"From: App <n@new.test>\r\nX-Original-From: App <a@old.test>\r\nSubject: x\r\n",
        ),
        (
            b"From: a@old.test\r\n",
            "n@new.test",
            True,
            b"From: <n@new.test>\r\nX-Original-From: a@old.test\r\nReply-To: a@old.test\r\n",
        ),
        (
            b"From: a@old.test\r\nReply-To: r@old.test\r\n",
            None,
            True,  # has one: kept
            b"From: a@old.test\r\nReply-To: r@old.test\r\n",
        ),
        (
            b'From: "Doe, J"\r\n <a@old.test>\r\n',
            "n@new.test",
            False,  # folded, quoted
            b'From: "Doe, J" <n@new.test>\r\nX-Original-From: "Doe, J"\r\n <a@old.test>\r\n',
        ),
        (b"Subject: no from\r\n", "n@new.test", True, b"Subject: no from\r\n"),
    ],
)
def test_rewrite_headers(head: bytes, from_addr: str | None, rto: bool, want: bytes) -> None:
    body = b"\r\nbody\r\nFrom: not a header\r\n"
    assert rewrite_headers(head + body, from_addr, rto) == want + body


# --- decide ------------------------------------------------------------------------------------

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


# --- the ledger --------------------------------------------------------------------------------


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


def test_defaults_and_the_classic_smarthost_beside_named_upstreams(tmp_path: Path) -> None:
    cfg = load(tmp_path, {})
    (only,) = cfg.routing.routes
    assert (only.index, only.via) == (0, ("smarthost",))
    assert set(cfg.routing.upstreams) == {"smarthost"}
    mx = load(tmp_path, {"upstream": {"mode": "mx"}})
    assert [(r.index, r.via) for r in mx.routing.routes] == [(0, ())]
    assert dict(mx.routing.upstreams) == {}
    # named upstreams without routes: the mode's route; in MX mode no smarthost is made up
    named = load(tmp_path, {"upstream": {"mode": "mx"}, "upstreams": UPS})
    assert named.routing.routes[0].mx and "smarthost" not in named.routing.upstreams
    # routes may still name the classic one
    both = load(
        tmp_path,
        {
            "upstreams": UPS,
            "routes": [{"sender": "a@b.test", "via": ["smarthost"]}, {"via": ["a"]}],
        },
    )
    assert set(both.routing.upstreams) == {"smarthost", "a"}  # unused "b" is dropped
    assert both.routing.upstreams["smarthost"].host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"no upstream named 'x' \(upstreams: none\)"):
        load(tmp_path, {"upstream": {"mode": "mx"}, "routes": [{"via": ["x"]}]})
    with pytest.raises(ConfigError, match=r"\(upstreams: a, b, smarthost\)"):
        load(tmp_path, {"upstreams": UPS, "routes": [{"via": ["x"]}]})
    with pytest.raises(ConfigError, match=r"routes: expected a non-empty list"):
        load(tmp_path, {"upstreams": UPS, "routes": []})


def test_match_reads_the_listener_from_old_messages_and_quoted_local_parts(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        {
            "upstreams": UPS,
            "routes": [
                {"listener": "cron", "via": ["b"]},
                {"sender_domain": "x.test", "via": ["b"]},
                {"recipient_domain": "y.test", "via": ["b"]},
                {"via": ["a"]},
            ],
        },
    )
    m = cfg.routing.match
    # a message spooled before listeners were recorded: its namespace names it
    assert m(sender="", recipient="u@z.test", client="listener:cron", listener=None).index == 0
    assert m(sender="", recipient="u@z.test", client="user:cron", listener=None).index == 3
    assert m(sender='"a@b"@X.test', recipient="u@z.test", client="", listener="").index == 1
    assert m(sender="nodomain", recipient="u@z.test", client="", listener="").index == 3
    assert m(sender="", recipient='"u@q"@Y.TEST', client="", listener="").index == 2


def test_every_upstream_and_route_field_is_read(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("pass\n")
    (tmp_path / "cs").write_text("csec\n")
    (tmp_path / "rt").write_text("rtok\n")
    (tmp_path / "ca.pem").write_text("x")
    cfg = load(
        tmp_path,
        {
            "upstreams": {
                "p": {
                    "host": "p.test",
                    "port": 2525,
                    "tls": "none",
                    "verify": False,
                    "ca_file": "ca.pem",
                    "username": "u",
                    "password_file": "pw",
                    "auth": "login",
                },
                "o": {
                    "host": "o.test",
                    "tls": "implicit",
                    "username": "me@o.test",
                    "auth": "oauthbearer",
                    "oauth": {
                        "token_url": "https://t.test/tok",
                        "client_id": "cid",
                        "client_secret_file": "cs",
                        "refresh_token_file": "rt",
                        "scope": "sc",
                        "timeout": 3,
                    },
                },
                "c": {
                    "host": "c.test",
                    "username": "x@c.test",
                    "auth": "xoauth2",
                    "oauth": {"token_command": "get-token"},
                },
            },
            "routes": [
                {
                    "sender": "a@b.test",
                    "via": ["o", "c"],
                    "rewrite": {
                        "envelope_sender": "e@v.test",
                        "from": "f@v.test",
                        "reply_to_original": True,
                    },
                },
                {"via": ["p"], "rewrite": {"from": "g@v.test"}},
            ],
        },
    )
    ups = cfg.routing.upstreams
    assert ups["p"] == routes.UpstreamHost(
        name="p",
        host="p.test",
        port=2525,
        tls="none",
        verify=False,
        ca_file=(tmp_path / "ca.pem").resolve(),
        username="u",
        password="pass",
        auth="login",
        oauth=None,
    )
    o = ups["o"]
    assert (o.name, o.host, o.port, o.tls, o.verify, o.ca_file, o.password) == (
        "o",
        "o.test",
        465,
        "implicit",
        True,
        None,
        None,
    )
    assert o.oauth == routes.OAuthConf(
        token_url="https://t.test/tok",
        client_id="cid",
        client_secret="csec",
        refresh_token="rtok",
        scope="sc",
        token_command=None,
        timeout=3.0,
    )
    assert ups["c"].port == 587 and ups["c"].oauth == routes.OAuthConf(
        token_command="get-token", timeout=10.0
    )
    r0, r1 = cfg.routing.routes
    assert r0.rewrite == routes.Rewrite("e@v.test", "f@v.test", True)
    assert r1.rewrite == routes.Rewrite(None, "g@v.test", False)
    assert r0.sender == frozenset({"a@b.test"}) and r0.describe() == "o -> c"


@pytest.mark.parametrize(
    ("up", "msg"),
    [
        ({"port": 70000}, "upstreams.u.port: expected a port number"),
        ({"port": True}, "upstreams.u.port"),
        ({"tls": "ssl"}, "upstreams.u.tls: 'ssl' is not one of"),
        ({"verify": "yes"}, "upstreams.u.verify: expected true or false"),
        ({"auth": "cram-md5"}, "upstreams.u.auth: 'cram-md5' is not one of"),
        ({"username": 5}, "upstreams.u.username: expected a string"),
        ({"host": ""}, "upstreams.u.host: required"),
        ({"oauth": {"token_command": "x"}}, "upstreams.u.oauth: only with auth"),
        ({"bogus": 1}, r"upstreams.u.bogus: unknown key$"),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"client_id": "x"}},
            "token_url or token_command is required",
        ),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"token_url": "ftp://x"}},
            "oauth.token_url: 'ftp://x' is not an http",
        ),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"token_url": "https://x"}},
            "oauth.client_id: required with token_url",
        ),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"token_command": "x", "timeout": 0}},
            "oauth.timeout: expected seconds",
        ),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"token_command": "x", "timeout": True}},
            "oauth.timeout: expected seconds",
        ),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"token_command": "x", "timeout": "1"}},
            "oauth.timeout: expected seconds",
        ),
        (
            {"auth": "xoauth2", "username": "a", "oauth": {"token_command": "x", "nope": 1}},
            r"oauth.nope: unknown key$",
        ),
        (
            {"auth": "oauthbearer", "oauth": {"token_command": "x"}},
            "upstreams.u.username: required with auth: oauthbearer",
        ),
    ],
)
def test_bad_upstreams(tmp_path: Path, up: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load(tmp_path, {"upstreams": {"u": {"host": "h.test", **up}}, "routes": [{"via": ["u"]}]})


@pytest.mark.parametrize(
    ("rw", "msg"),
    [
        ({"reply_to_original": "yes"}, "rewrite.reply_to_original: expected true or false"),
        ({"envelope_sender": "bad"}, r"routes\[0\].rewrite.envelope_sender"),
        ({"sender": "x@y.test"}, r"routes\[0\].rewrite.sender: unknown key"),
        ("x", r"routes\[0\].rewrite: expected a mapping"),
    ],
)
def test_bad_rewrites(tmp_path: Path, rw: object, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load(tmp_path, {"upstreams": UPS, "routes": [{"via": ["a"], "rewrite": rw}]})


@pytest.mark.parametrize(("port", "ok"), [(1, True), (65535, True), (0, False), (65536, False)])
def test_upstream_port_bounds(tmp_path: Path, port: int, ok: bool) -> None:
    extra = {"upstreams": {"u": {"host": "h.test", "port": port}}, "routes": [{"via": ["u"]}]}
    if ok:
        assert load(tmp_path, extra).routing.upstreams["u"].port == port
    else:
        with pytest.raises(ConfigError, match=r"upstreams\.u\.port"):
            load(tmp_path, extra)


@pytest.mark.parametrize(
    ("value", "msg"),
    [
        ([""], r"routes\[0\].sender: expected a value or a list of values"),
        ([], r"routes\[0\].sender: expected a value or a list of values"),
        ([5], r"routes\[0\].sender: expected a value or a list of values"),
    ],
)
def test_route_condition_values(tmp_path: Path, value: object, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load(
            tmp_path,
            {"upstreams": UPS, "routes": [{"sender": value, "via": ["a"]}, {"via": ["a"]}]},
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


def test_route_description() -> None:
    assert routes.Route(0, ()).describe() == "mx"
    assert routes.Route(0, ("a", "b")).describe() == "a -> b"


# Mutation-driven (tests/MUTANTS.md; until issue 28 in tests/test_mutants_delivery_core.py).
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
