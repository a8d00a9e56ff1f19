"""Config sections on the library (relay/config/models.py): every error of a section in one
validation, in the contract's words (`key.path: problem`), unknown keys named with a
suggestion, and the frozen dataclasses the rest of the code reads, unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relay.config.models import SECTIONS, DestinationSection
from relay.config.tree import DEFAULTS, DESTINATION_DEFAULTS, ConfigError, Limits, from_mapping

BASE = Path("/nonexistent-base")


def _error(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        from_mapping(data, BASE)
    return str(ei.value).splitlines()


def test_every_bad_item_of_a_list_is_reported() -> None:
    # read by hand, the first bad item set the whole list aside and hid the others
    assert _error({"retry": {"schedule": ["1m", "5x", "2h", "soon"]}}) == [
        "retry.schedule[1]: '5x' is not a duration (use 30s, 5m, 2h, 7d or seconds)",
        "retry.schedule[3]: 'soon' is not a duration (use 30s, 5m, 2h, 7d or seconds)",
    ]


def test_every_error_of_a_section_in_file_order() -> None:
    assert _error(
        {
            "log": {"level": "loud"},
            "limits": {"max_recipients": "many", "max_errors": -1, "max_conections": 5},
            "delivery": {"workers": 0},
        }
    ) == [
        "limits.max_recipients: expected a whole number, got str 'many'",
        "limits.max_errors: -1 is below the minimum 0",
        "limits.max_conections: unknown key 'max_conections' (did you mean 'max_connections'?)",
        "delivery.workers: 0 is below the minimum 1",
        "log.level: 'loud' is not one of debug, info, warning, error",
    ]


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"limits": 5}, "limits: expected a mapping, got int 5"),
        ({"dsn": {"enabled": "yes"}}, "dsn.enabled: expected true or false, got str 'yes'"),
        ({"dsn": {"sender": "a@b.c"}}, "dsn.sender: unknown key 'sender'"),
        ({"inbound": {"processes": 65}}, "inbound.processes: at most 64"),
        ({"admin": {"listen": "nohost"}}, "admin.listen: 'nohost' has no port (use host:port)"),
        (
            {"admin": {"password": "x"}},
            "admin.password: unknown key: secrets are never inline;"
            " put it in a file and name the file with 'password_file'",
        ),
        (
            {"limits": {"max_connections": 10, "allowed_reserve": 10}},
            "limits.allowed_reserve: 10 must be below limits.max_connections (10)",
        ),
        (
            {"health": {"queue_age_warning": "5h"}},
            "health.queue_age_critical: must not be below health.queue_age_warning",
        ),
    ],
)
def test_section_errors(data: dict[str, Any], line: str) -> None:
    assert _error(data) == [line]


def test_the_dataclasses_are_built_from_the_sections() -> None:
    c = from_mapping(
        {"limits": {"max_header_size": "64KiB", "session_timeout": "2m"}, "admin": {"listen": ""}},
        BASE,
    )
    assert isinstance(c.limits, Limits)
    assert c.limits.max_header_size == 64 * 1024 and c.limits.session_timeout == 120.0
    assert c.admin_listen is None
    assert c.retry.schedule == (60.0, 300.0, 1800.0, 7200.0)
    assert c.dsn.sender is None and c.log.level == "info"


def test_the_defaults_come_from_the_models() -> None:
    for name, model in SECTIONS.items():
        if name in DEFAULTS:
            assert DEFAULTS[name] == model.defaults(), name
    # optional sections, not shown in conf/relay.yaml
    assert set(SECTIONS) - set(DEFAULTS) == {"fleet", "outbox"}
    assert DestinationSection.defaults() == DESTINATION_DEFAULTS


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (
            {"alerts": {"webhook": {"ulr": "https://hooks.example/x"}}},
            ["alerts.webhook.ulr: unknown key 'ulr' (did you mean 'url'?)"],
        ),
        (
            {"alerts": {"webhook": {"url": "https://h.example/x", "timeuot": "1s"}}},
            ["alerts.webhook.timeuot: unknown key 'timeuot' (did you mean 'timeout'?)"],
        ),
        ({"alerts": {"webhook": "x"}}, ["alerts.webhook: expected a mapping, got str 'x'"]),
        (
            {"alerts": {"webhook": {"url": "ftp://u:pw@h.example/secret"}}},
            ["alerts.webhook.url: 'ftp://***@h.example/***' is not an http:// or https:// URL"],
        ),
        (  # found by tests/config/test_fuzz.py: check-config and the daemon crashed on it
            {"alerts": {"webhook": {"url": "https://[hooks.example.net/x"}}},
            [
                "alerts.webhook.url: 'https://[hooks.example.net/***' is not a valid URL"
                " (Invalid IPv6 URL)"
            ],
        ),
        (
            {"alerts": {"webhook": {"url": "https://h.example:99999/T/B/x"}}},
            [
                "alerts.webhook.url: 'https://h.example:99999/***' is not a valid URL (Port"
                " out of range 0-65535)"
            ],
        ),
        (
            {"alerts": {"webhook": {"url": "https://"}}},
            ["alerts.webhook.url: 'https://' has no host"],
        ),
        (
            {"destinations": {"*": {"rate": "lots"}, "b.example": {"burst": 0, "ambigous": 1}}},
            [
                "destinations.\"*\".rate: 'lots' is not a rate (use 50/s, 100/m, 3600/h or"
                " unlimited)",
                "destinations.b.example.burst: expected a number >= 1",
                "destinations.b.example.ambigous: unknown key 'ambigous' (did you mean"
                " 'ambiguous'?)",
            ],
        ),
        ({"destinations": {"x.example": 5}}, ["destinations.x.example: expected a mapping"]),
        ({"fleet": {"lease": "2s"}}, ["fleet.lease: at least 3s (it is renewed every lease/3)"]),
        (
            {"outbox": {"enabled": True}},
            [
                "outbox.enabled: the outbox is a table of a PostgreSQL spool"
                " (spool.backend: postgresql)"
            ],
        ),
    ],
)
def test_more_section_errors(data: dict[str, Any], lines: list[str]) -> None:
    assert _error(data) == lines


def test_the_webhook_secret_is_read_and_never_shown(tmp_path: Path) -> None:
    (tmp_path / "hook").write_text("s3cret-key\n")
    c = from_mapping(
        {"alerts": {"webhook": {"url": "https://h.example/T0/B1/xyz", "secret_file": "hook"}}},
        tmp_path,
    )
    wh = c.alerts.webhook
    assert wh is not None and wh.secret == b"s3cret-key" and wh.timeout == 10.0
    assert wh.secret_file == tmp_path / "hook"
    assert "s3cret" not in repr(c) and "xyz" not in repr(c)
    assert _error({"alerts": {"webhook": {"url": "https://h.example/", "secret_file": "/no"}}}) == [
        "alerts.webhook.secret_file: cannot read /no: No such file or directory"
    ]


def test_a_named_destination_inherits_from_the_star() -> None:
    c = from_mapping(
        {
            "timeouts": {"connect": "3s"},
            "destinations": {"*": {"rate": "60/m", "max_connections": 4}, "A.example": {}},
        },
        BASE,
    )
    a = c.destination("a.example")
    assert a.name == "a.example" and a.rate == 1.0 and a.burst == 1.0
    assert a.max_connections == 4 and a.connect_timeout == 3.0
    assert c.destination("*").rate == 1.0


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        ({"spool": {"dsn": "x"}}, ["spool.dsn: only with spool.backend: postgresql"]),
        (
            {"spool": {"backend": "postgresql"}},
            ["spool.dsn: required with spool.backend: postgresql"],
        ),
        (
            {"spool": {"backend": "postgresql", "dsn": "nonsense"}},
            ["spool.dsn: expected a libpq URL (postgresql://...) or key=value list"],
        ),
        (
            {"upstream": {"smarthost": {"username": "u"}}},
            ["upstream.smarthost.password_file: required when username is set"],
        ),
        (
            {"upstream": {"mx": {"nameservers": "1.1.1.1"}}},
            ["upstream.mx.nameservers: expected a list of host[:port] strings"],
        ),
        (
            {"upstream": {"mode": "x", "smarthost": {"port": 0}, "mx": {"tls": "implicit"}}},
            [
                "upstream.mode: 'x' is not one of smarthost, mx",
                "upstream.smarthost.port: 0 is below the minimum 1",
                "upstream.mx.tls: 'implicit' is not one of none, opportunistic, starttls",
            ],
        ),
        (
            {"upstream": {"smarthost": {"hots": "h"}}},
            ["upstream.smarthost.hots: unknown key 'hots' (did you mean 'host'?)"],
        ),
    ],
)
def test_spool_and_upstream_errors(data: dict[str, Any], lines: list[str]) -> None:
    assert _error(data) == lines


def test_upstream_reads_the_password_file_once(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("hunter2\r\n")
    c = from_mapping(
        {
            "hostname": "relay.example.com",
            "upstream": {"smarthost": {"username": "app", "password_file": "pw"}},
            "spool": {"path": "sp", "maildrop": "/var/drop"},
        },
        tmp_path,
    )
    assert c.upstream.smarthost.password == "hunter2"
    assert c.upstream.helo == "relay.example.com"
    assert "hunter2" not in repr(c)
    assert c.spool_path == tmp_path / "sp" and c.maildrop_dir() == Path("/var/drop")
    assert c.spool_pg is None
    assert _error({"upstream": {"smarthost": {"password_file": "/nonexistent/pw"}}}) == [
        "upstream.smarthost.password_file: cannot read /nonexistent/pw: No such file or directory"
    ]


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (
            {"shaping": {"window_tz": "Mars/Base"}},
            ["shaping.window_tz: 'Mars/Base' is not a known time zone"],
        ),
        ({"shaping": {"rules": {"match": "x"}}}, ["shaping.rules: expected a list of rules"]),
        (
            {"shaping": {"rules": [5, {"match": "421", "action": "suspend", "for": "5x"}]}},
            [
                "shaping.rules[0]: expected a mapping with match, action and for",
                "shaping.rules[1].for: '5x' is not a duration (use 30s, 5m, 2h, 7d or seconds)",
            ],
        ),
        ({"lanes": {"rules": {}}}, ["lanes.rules: expected a list"]),
        ({"lanes": {"rules": [7]}}, ["lanes.rules[0]: expected a mapping, got int"]),
        (
            {"lanes": {"bulk": {"share": 2}}},
            ["lanes.bulk.share: expected a number from 0.0 to 1.0"],
        ),
    ],
)
def test_shaping_and_lanes_errors(data: dict[str, Any], lines: list[str]) -> None:
    assert _error(data) == lines


def test_shaping_rules_are_parsed() -> None:
    c = from_mapping(
        {"shaping": {"rules": [{"match": "4.7.0 .*busy", "action": "suspend", "for": "2m"}]}},
        BASE,
    )
    (rule,) = c.shaping.rules
    assert rule.action == "suspend" and rule.duration == 120.0
    assert c.lanes.shares == {"transactional": 1.0, "bulk": 0.5}


def test_a_control_character_in_a_key_stays_on_its_line() -> None:
    # str.splitlines splits on \x1c: the key is shown escaped, one error a line
    assert _error({"log": {"lev\x1cel": 1}}) == [
        "log.lev\\x1cel: unknown key 'lev\\x1cel' (did you mean 'level'?)"
    ]
    assert _error({"log": {"x\x1c": "\x00"}}) == [
        "log.x\\x1c: a NUL character is not allowed in a config value"
    ]


def test_spool_gather_is_a_duration_3ms_by_default() -> None:
    assert from_mapping({}, BASE).spool_gather == 0.003
    assert from_mapping({"spool": {"gather": "0"}}, BASE).spool_gather == 0.0
    assert from_mapping({"spool": {"gather": 0.01}}, BASE).spool_gather == 0.01
    assert _error({"spool": {"gather": "soon"}}) == [
        "spool.gather: 'soon' is not a duration (use 30s, 5m, 2h, 7d or seconds)"
    ]


def test_health_failing_after_is_a_duration() -> None:
    assert from_mapping({"health": {"failing_after": "2m"}}, BASE).health.failing_after == 120
    assert _error({"health": {"failing_after": "soon"}}) == [
        "health.failing_after: 'soon' is not a duration (use 30s, 5m, 2h, 7d or seconds)"
    ]


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (
            {"feedback": {"providers": {"sess": {}}}},
            [
                "feedback.providers.sess: unknown provider (did you mean 'ses'?); known: ses,"
                " postmark, sendgrid, mailgun, generic"
            ],
        ),
        (
            {"feedback": {"providers": {"ses": None}}},
            ["feedback.providers.ses.token_file: required (the webhook's basic-auth password)"],
        ),
        (
            {"feedback": {"providers": []}},
            ["feedback.providers: expected a mapping of provider names"],
        ),
        (
            {"feedback": {"verp": True}},
            ["feedback.verp: needs feedback.address (the bounce address)"],
        ),
        (
            {"feedback": {"address": "bounces+x@example.com"}},
            ["feedback.address: no '+' in the local part (VERP adds one)"],
        ),
        (
            {"feedback": {"max_body": "x"}},
            ["feedback.max_body: 'x' is not a size (use 25MiB, 64KiB or bytes)"],
        ),
        (
            {"feedback": {"mail_max_stored": "1MiB", "mail_budget": "512KiB"}},
            [
                "feedback.mail_budget: 524288 bytes is below feedback.mail_max_stored (1048576):"
                " one stored mail must fit"
            ],
        ),
    ],
)
def test_feedback_errors(data: dict[str, Any], lines: list[str]) -> None:
    assert _error(data) == lines


def test_feedback_secrets_are_read_and_never_shown(tmp_path: Path) -> None:
    for name, text in (("tok", "token-abc\n"), ("mg", "key-mg\n"), ("verp", "verp-s\n")):
        (tmp_path / name).write_text(text)
    c = from_mapping(
        {
            "feedback": {
                "address": "bounces@example.com",
                "verp": True,
                "verp_secret_file": "verp",
                "providers": {
                    "mailgun": {"token_file": "tok", "signing_key_file": "mg"},
                    "generic": {"token_file": "tok"},
                },
            }
        },
        tmp_path,
    )
    fb = c.feedback
    assert fb.verp_secret == b"verp-s"
    assert fb.providers["mailgun"].token == "token-abc"
    assert fb.providers["mailgun"].signing_key == b"key-mg"
    assert fb.providers["generic"].signing_key is None
    assert set(fb.providers) == {"mailgun", "generic"}
    for secret in ("token-abc", "key-mg", "verp-s"):
        assert secret not in repr(c)
        assert secret in c.secrets()


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        ({"identities": {"a.example": 5}}, ["identities.a.example: expected a mapping"]),
        (
            {"identities": {"a.example": {"warmup": {"initial": 10}}}},
            ["identities.a.example.warmup.start: None is not a date (YYYY-MM-DD)"],
        ),
        (
            {"identities": {"a.example": {"warmup": {"start": "2026-01-01", "schedule": [1, -2]}}}},
            ["identities.a.example.warmup.schedule: expected a list of whole numbers"],
        ),
        (
            {"identities": {"a.example": {"unsubscribe": {"url": "https://u.example/u"}}}},
            [
                "identities.a.example.unsubscribe.secret_file: required (the key that signs"
                " unsubscribe links)"
            ],
        ),
        (
            {"identities": {"a.example": {"unsubscribe": {"url": "https://u.example/x"}}}},
            [
                "identities.a.example.unsubscribe.url: 'https://u.example/x' must end in /u"
                " (the relay serves POST/GET /u/<token>)"
            ],
        ),
        (  # a host that does not parse: refused here, not at the first unsubscribe link
            {"identities": {"a.example": {"unsubscribe": {"url": "https://[u.example/u"}}}},
            [
                "identities.a.example.unsubscribe.url: 'https://[u.example/u' is not a valid"
                " URL (Invalid IPv6 URL)"
            ],
        ),
        (
            {"identities": {"a": {"daily_limt": 5}, "b": {"unsubscribe": {}}}},
            [
                "identities.a.daily_limt: unknown key 'daily_limt' (did you mean 'daily_limit'?)",
                "identities.b.unsubscribe: give url, mailto or both",
            ],
        ),
    ],
)
def test_identity_errors(data: dict[str, Any], lines: list[str]) -> None:
    assert _error(data) == lines


def test_identities_are_built(tmp_path: Path) -> None:
    (tmp_path / "unsub").write_text("0123456789abcdef0123\n")
    c = from_mapping(
        {
            "identities": {
                "News.Example": {
                    "daily_limit": 1000,
                    "warmup": {"start": "2026-01-05", "factor": 1.5},
                    "unsubscribe": {"url": "https://u.example/u", "secret_file": "unsub"},
                }
            }
        },
        tmp_path,
    )
    ident = c.identity("news.example")
    assert ident is not None and ident.name == "news.example" and ident.daily_limit == 1000
    assert ident.warmup is not None and ident.warmup.initial == 500
    assert ident.warmup.factor == 1.5 and ident.warmup.start.isoformat() == "2026-01-05"
    assert ident.unsubscribe is not None
    assert ident.unsubscribe.secret == b"0123456789abcdef0123"
    assert "0123456789abcdef" not in repr(c)


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        ({"listen": []}, ["listen: expected a non-empty list of listeners"]),
        (
            {"listen": [{"adress": "127.0.0.1:25"}, {"address": "x"}]},
            [
                "listen[0].adress: unknown key 'adress' (did you mean 'address'?)",
                "listen[1].address: 'x' has no port (use host:port)",
            ],
        ),
        (
            {"listen": [{"address": "127.0.0.1:25", "allow": ["10.0.0.0/8", "nonsense", 7]}]},
            [
                "listen[0].allow[1]: 'nonsense' is not a network",
                "listen[0].allow[2]: 7 is not a network",
            ],
        ),
        (
            {"listen": [{"address": "127.0.0.1:25", "require_tls": True}]},
            ["listen[0].require_tls: needs listen[0].tls (a certificate to offer)"],
        ),
        (
            {"listen": [{"address": "127.0.0.1:25", "tls": {"cert_file": "/nonexistent/c"}}]},
            ["listen[0].tls.cert_file: cannot read /nonexistent/c: No such file or directory"],
        ),
        (
            {"listen": [{"address": "127.0.0.1:25", "lane": "fast", "namespace": ""}]},
            [
                "listen[0].lane: 'fast' is not one of transactional, bulk",
                "listen[0].namespace: 1 to 100 printable ASCII characters",
            ],
        ),
    ],
)
def test_listener_errors(data: dict[str, Any], lines: list[str]) -> None:
    assert _error(data) == lines


def test_an_empty_section_keeps_its_defaults() -> None:
    # `upstream:` with every key commented out is YAML null: the defaults, and check-config
    # prints them (it crashed on the null before)
    c = from_mapping({"upstream": None, "limits": None, "identities": None}, BASE)
    assert c.upstream.smarthost.port == 587 and c.limits.max_recipients == 1000
    assert c.redacted()["upstream"]["smarthost"]["port"] == 587


def test_one_pass_reports_the_parts_read_by_code_too() -> None:
    assert _error(
        {
            "hostname": 5,
            "zzz": 1,
            "limitz": {},
            "local": {"domain": "no domain"},
            "dkim": {"a.example": {"key_file": "k"}, "b.example": {"selector": "s"}},
            "shutdown_timeout": "never",
        }
    ) == [
        "hostname: expected a string or null, got int 5",
        "local.domain: 'no domain' is not a domain",
        "dkim.a.example.selector: expected a string, got nothing",
        "dkim.b.example.key_file: required",
        "shutdown_timeout: 'never' is not a duration (use 30s, 5m, 2h, 7d or seconds)",
        "zzz: unknown key 'zzz'",
        "limitz: unknown key 'limitz' (did you mean 'limits'?)",
    ]


def test_admin_console_needs_users_off_loopback() -> None:
    assert _error({"admin": {"listen": "0.0.0.0:9025", "max_connections": 0}}) == [
        "admin.max_connections: 0 is below the minimum 1"
    ]
    assert _error({"admin": {"listen": "0.0.0.0:9025"}}) == [
        "admin.listen 0.0.0.0 is not loopback: the console there needs admin.users_file"
        " (`relay admin passwd NAME --role operator`), or set admin.console: false"
    ]
    c = from_mapping({"admin": {"listen": "0.0.0.0:9025", "console": False}}, BASE)
    assert c.admin_console is False and c.admin_users_file is None


def test_inbound_processes_default_to_one_with_two_cores_and_none_with_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 29 item 6: the relay as shipped is the fast one: an SMTP process beside the main
    one when the machine has the cores for it; a number given is kept as given."""
    import relay.config.build as config_

    for cores, want in ((1, 0), (2, 1), (16, 1)):
        monkeypatch.setattr(config_, "usable_cores", lambda n=cores: n)
        assert from_mapping({}, BASE).inbound_processes == want, cores
        assert from_mapping({"inbound": {"processes": "auto"}}, BASE).inbound_processes == want
        assert from_mapping({"inbound": {"processes": 0}}, BASE).inbound_processes == 0
        assert from_mapping({"inbound": {"processes": 3}}, BASE).inbound_processes == 3
    assert _error({"inbound": {"processes": "many"}}) == [
        "inbound.processes: expected auto or a whole number, got str 'many'"
    ]
