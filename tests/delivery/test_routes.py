"""relay/delivery/routes.py: upstreams and routes as the config gives them (parse, exact
refusals, secrets, paths) and which route a message takes (match). (Header rewriting, decide
and the ledger, once tested here too, are in test_rewrite.py, test_decide.py and
test_ledger.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config import routes
from relay.config.tree import ConfigError, load_config

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
        (  # refused at load, not at the first token fetch
            {"auth": "xoauth2", "username": "a", "oauth": {"token_url": "https://[t.test/tok"}},
            r"oauth.token_url: 'https://\[t.test/tok' is not a valid URL \(Invalid IPv6 URL\)",
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
