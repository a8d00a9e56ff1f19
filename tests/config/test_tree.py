"""Config loading: defaults, error messages that name the key, exit code 78 from the CLI,
relative paths, and secrets that never show."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import (
    EX_CONFIG,
    ConfigError,
    from_mapping,
    load_config,
    parse_duration,
    parse_hostport,
    parse_rate,
    parse_size,
)
from tests.harness import ROOT

BASE = Path("/nonexistent-base")


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as ei:
        from_mapping(data, BASE)
    return str(ei.value)


# --- defaults and parsing -----------------------------------------------------------------


def test_empty_config_gets_the_documented_defaults() -> None:
    c = from_mapping({}, BASE)
    assert [(lst.host, lst.port) for lst in c.listen] == [("127.0.0.1", 2525)]
    assert [str(n) for n in c.listen[0].allow] == ["127.0.0.0/8", "::1/128"]
    assert c.listen[0].name == "127.0.0.1:2525"
    assert c.spool_path == (BASE / "../var/spool").resolve()
    assert c.dedup_window == 7 * 86400
    assert c.upstream.mode == "smarthost"
    assert c.upstream.smarthost.port == 587 and c.upstream.smarthost.tls == "starttls"
    assert c.retry.schedule == (60, 300, 1800, 7200)
    assert c.retry.max_age == 5 * 86400
    assert c.timeouts == {"connect": 10, "command": 30, "data": 120}
    star = c.destination("*")
    assert star.max_connections == 10 and star.rate == 50 and star.daily_limit is None
    assert c.destination("unknown.example") is star
    assert c.admin_listen == ("127.0.0.1", 9025)


def test_default_dedup_namespace_is_the_address_on_sqlite_the_fleets_on_postgresql() -> None:
    listen = [
        {"address": "127.0.0.1:2525"},
        {"address": "0.0.0.0:2526"},
        {"address": "127.0.0.1:2527", "namespace": "tenant-b"},
    ]
    sqlite = from_mapping({"listen": listen}, BASE)
    # SQLite: unchanged, so the dedup keys already stored keep matching
    assert [lst.namespace for lst in sqlite.listen] == [
        "127.0.0.1:2525",
        "0.0.0.0:2526",
        "tenant-b",
    ]
    pg = from_mapping(
        {"listen": listen, "spool": {"backend": "postgresql", "dsn": "postgresql://db/relay"}},
        BASE,
    )
    # PostgreSQL: one namespace for every node's listeners but those that set their own
    assert [lst.namespace for lst in pg.listen] == ["fleet", "fleet", "tenant-b"]


def test_shipped_default_config_loads() -> None:
    c = load_config(ROOT / "conf" / "relay.yaml")
    assert c.listen and c.spool_path.is_absolute()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("7d", 604800),
        (45, 45),
        (1.5, 1.5),
        ("250ms", 0.25),
        ("1w", 604800),
        ("90", 90),
        (" 2m ", 120),
        (0, 0),
    ],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value, "k") == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", ["5x", "", "m", "5 minutes", "-5s", True, None, [1], float("nan")]
)
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_duration(value, "some.key")
    assert str(ei.value).startswith("some.key: ")


def test_negative_duration_is_rejected() -> None:
    assert _error({"timeouts": {"connect": -1}}) == "timeouts.connect: -1 must not be negative"


@pytest.mark.parametrize(
    ("value", "per_second"),
    [
        ("50/s", 50),
        ("120/m", 2),
        ("3600/h", 1),
        ("86400/d", 1),
        ("10 / min", 10 / 60),
        (7, 7),
        (None, None),
        ("unlimited", None),
    ],
)
def test_parse_rate(value: object, per_second: float | None) -> None:
    got = parse_rate(value, "k")
    assert got == (None if per_second is None else pytest.approx(per_second))


@pytest.mark.parametrize(
    ("value", "size"),
    [("25MiB", 25 << 20), ("64KiB", 64 << 10), ("1KB", 1000), (123, 123), ("2G", 2 << 30)],
)
def test_parse_size(value: object, size: int) -> None:
    assert parse_size(value, "k") == size


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:2525", "k") == ("127.0.0.1", 2525)
    assert parse_hostport("[::1]:25", "k") == ("::1", 25)
    assert parse_hostport("mail.example", "k", default_port=25) == ("mail.example", 25)
    for bad, msg in (
        ("127.0.0.1", "has no port"),
        ("h:99999", "out of range"),
        ("h:abc", "is not a port number"),
        (":25", "has no host"),
    ):
        with pytest.raises(ConfigError, match=msg):
            parse_hostport(bad, "admin.listen")


# --- error messages name the key ----------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # unknown keys, at every depth
        ({"bogus": 1}, "bogus: unknown key"),
        ({"spool": {"pathh": "x"}}, "spool.pathh: unknown key"),
        ({"listen": [{"address": "127.0.0.1:25", "alow": []}]}, "listen[0].alow: unknown key"),
        ({"destinations": {"*": {"rte": "5/s"}}}, 'destinations."*".rte: unknown key'),
        ({"upstream": {"smarthost": {"hots": "x"}}}, "upstream.smarthost.hots: unknown key"),
        # wrong types
        ({"retry": 5}, "retry: expected a mapping, got int 5"),
        (
            {"limits": {"max_recipients": "ten"}},
            "limits.max_recipients: expected a whole number, got str 'ten'",
        ),
        (
            {"upstream": {"smarthost": {"port": "587"}}},
            "upstream.smarthost.port: expected a whole number, got str '587'",
        ),
        (
            {"upstream": {"smarthost": {"verify": "yes"}}},
            "upstream.smarthost.verify: expected true or false, got str 'yes'",
        ),
        ({"listen": "127.0.0.1:25"}, "listen: expected a non-empty list of listeners"),
        ({"listen": []}, "listen: expected a non-empty list of listeners"),
        ({"retry": {"schedule": "5m"}}, "retry.schedule: expected a non-empty list of durations"),
        # bad values
        ({"upstream": {"mode": "direct"}}, "upstream.mode: 'direct' is not one of smarthost, mx"),
        (
            {"upstream": {"smarthost": {"tls": "maybe"}}},
            "upstream.smarthost.tls: 'maybe' is not one of none, opportunistic, starttls, implicit",
        ),
        ({"limits": {"max_recipients": 0}}, "limits.max_recipients: 0 is below the minimum 1"),
        ({"spool": {"inline_max": "12 parsecs"}}, "spool.inline_max: '12 parsecs' is not a size"),
        ({"dedup": {"window": "forever"}}, "dedup.window: 'forever' is not a duration"),
        ({"timeouts": {"connect": float("nan")}}, "timeouts.connect: nan is not a duration"),
        ({"listen": [{"address": "127.0.0.1:99999"}]}, "listen[0].address: port 99999 is out"),
        ({"admin": {"listen": "localhost"}}, "admin.listen: 'localhost' has no port"),
        (
            {"upstream": {"smarthost": {"username": "u"}}},
            "upstream.smarthost.password_file: required when username is set",
        ),
    ],
)
def test_error_names_the_key(data: dict[str, Any], message: str) -> None:
    assert _error(data).startswith(message)


def test_bad_duration_exact_wording() -> None:
    msg = _error({"retry": {"schedule": ["1m", "5m", "5x"]}})
    assert msg.startswith("retry.schedule[2]: '5x' is not a duration")
    assert "retry.schedule[2]: '5x' is not a duration" in msg


@pytest.mark.parametrize(
    ("allow", "message"),
    [
        (["10.0.0.0/33"], "listen[0].allow[0]: '10.0.0.0/33' is not a network"),
        (["127.0.0.0/8", "not-a-net"], "listen[0].allow[1]: 'not-a-net' is not a network"),
        (["::1/129"], "listen[0].allow[0]: '::1/129' is not a network"),
        ("10.0.0.0/8", "listen[0].allow: expected a list of networks"),
    ],
)
def test_bad_network(allow: object, message: str) -> None:
    assert _error({"listen": [{"address": "127.0.0.1:2525", "allow": allow}]}) == message


def test_networks_parse_non_strict() -> None:
    c = from_mapping(
        {"listen": [{"address": "127.0.0.1:2525", "allow": ["10.1.2.3/8", "2001:db8::1/32"]}]}, BASE
    )
    assert [str(n) for n in c.listen[0].allow] == ["10.0.0.0/8", "2001:db8::/32"]


@pytest.mark.parametrize(
    ("dest", "rate", "message"),
    [
        ("*", "5/fortnight", "destinations.\"*\".rate: '5/fortnight' is not a rate"),
        ("*", "0/s", "destinations.\"*\".rate: '0/s' is not a rate"),
        ("*", 0, 'destinations."*".rate: 0 is not a rate'),
        ("*", -3, 'destinations."*".rate: -3 is not a rate'),
        ("example.com", "fast", "destinations.example.com.rate: 'fast' is not a rate"),
    ],
)
def test_bad_rate(dest: str, rate: object, message: str) -> None:
    assert _error({"destinations": {dest: {"rate": rate}}}).startswith(message)


def test_named_destination_inherits_from_star() -> None:
    c = from_mapping(
        {
            "destinations": {
                "*": {"rate": "10/s", "max_connections": 3},
                "Example.COM": {"rate": "1/s"},
            }
        },
        BASE,
    )
    d = c.destination("example.com")
    assert d.rate == 1 and d.max_connections == 3
    assert c.destination("other.example").rate == 10
    assert d.connect_timeout == 10 and d.data_timeout == 120  # from timeouts


def test_inline_secret_is_refused_without_echoing_it() -> None:
    msg = _error({"upstream": {"smarthost": {"password": "hunter2-secret"}}})
    assert msg.startswith("upstream.smarthost.password: unknown key")
    assert "password_file" in msg  # says where a secret goes
    assert "hunter2-secret" not in msg


# --- files: relative paths, env var, YAML safety ---------------------------------------------


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "pw").write_text("s3cret\n")
    cfg = _write(
        tmp_path / "etc" / "relay.yaml",
        {
            "spool": {"path": "../var/spool"},
            "upstream": {"smarthost": {"username": "u", "password_file": "../secrets/pw"}},
        },
    )
    c = load_config(cfg)
    assert c.spool_path == (tmp_path / "var" / "spool").resolve()
    assert c.upstream.smarthost.password_file == (tmp_path / "secrets" / "pw").resolve()
    assert c.upstream.smarthost.password == "s3cret"  # trailing newline stripped
    assert "s3cret" not in repr(c)
    assert "s3cret" not in json.dumps(c.redacted(), default=str)


def test_config_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _write(tmp_path / "relay.yaml", {"dedup": {"window": "2s"}})
    monkeypatch.setenv("RELAY_CONFIG", str(cfg))
    assert load_config().dedup_window == 2
    assert load_config(None).path == cfg.resolve()


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config: cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [\n")
    with pytest.raises(ConfigError, match=r"^config: .* is not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"^config: expected a mapping at the top"):
        load_config(top)
    missing_pw = _write(
        tmp_path / "pw.yaml",
        {"upstream": {"smarthost": {"username": "u", "password_file": "nope"}}},
    )
    with pytest.raises(ConfigError, match=r"^upstream\.smarthost\.password_file: cannot read"):
        load_config(missing_pw)


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f'x: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(cfg)
    assert not marker.exists()


# --- the CLI: exit 78, key path on stderr, redacted output ------------------------------------


def _relay(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_config_bad_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "relay.yaml", {"retry": {"schedule": ["1m", "5m", "5x"]}})
    res = _relay("check-config", "-c", str(cfg))
    assert res.returncode == EX_CONFIG == 78
    assert "retry.schedule[2]: '5x' is not a duration" in res.stderr
    assert res.stdout == ""
    unknown = _write(tmp_path / "u.yaml", {"spool": {"path": "s", "color": "blue"}})
    res = _relay("check-config", "-c", str(unknown))
    assert res.returncode == 78
    assert "spool.color: unknown key" in res.stderr


def test_check_config_missing_file_exits_78(tmp_path: Path) -> None:
    res = _relay("check-config", "-c", str(tmp_path / "nope.yaml"))
    assert res.returncode == 78
    assert "cannot read" in res.stderr


def test_check_config_prints_effective_config_without_secrets(tmp_path: Path) -> None:
    secret = "correct-horse-battery-staple-7731"
    pw = tmp_path / "smarthost.pw"
    pw.write_text(secret + "\n")
    cfg = _write(
        tmp_path / "relay.yaml",
        {
            "listen": [{"address": "127.0.0.1:2600", "allow": ["127.0.0.0/8"]}],
            "spool": {"path": "spool"},
            "upstream": {
                "smarthost": {
                    "host": "smtp.example.net",
                    "username": "relayuser",
                    "password_file": "smarthost.pw",
                }
            },
            "retry": {"schedule": ["30s", "2m"]},
        },
    )
    res = _relay("check-config", "-c", str(cfg))
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout and secret not in res.stderr
    printed = yaml.safe_load(res.stdout)
    # the effective config: what was set, plus the defaults that were not
    assert printed["listen"][0]["address"] == "127.0.0.1:2600"
    assert printed["retry"]["schedule"] == ["30s", "2m"]
    assert printed["retry"]["max_age"] == "5d"
    assert printed["dedup"]["window"] == "7d"
    sh = printed["upstream"]["smarthost"]
    assert sh["host"] == "smtp.example.net" and sh["username"] == "relayuser"
    assert "contents not shown" in sh["password_file"]
    assert "password" not in sh

    res = _relay("check-config", "--json", "-c", str(cfg))
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout
    doc = json.loads(res.stdout)
    assert doc["upstream"]["smarthost"]["username"] == "relayuser"
    assert "contents not shown" in doc["upstream"]["smarthost"]["password_file"]


def test_serve_with_bad_config_exits_78(tmp_path: Path) -> None:
    cfg = _write(
        tmp_path / "relay.yaml",
        {
            "spool": {"path": "spool"},
            "listen": [{"address": "127.0.0.1:2525", "allow": ["300.0.0.0/8"]}],
        },
    )
    res = _relay("serve", "-c", str(cfg))
    assert res.returncode == 78
    assert "listen[0].allow[0]: '300.0.0.0/8' is not a network" in res.stderr
    assert not (tmp_path / "spool").exists()  # nothing was started


def test_other_commands_with_bad_config_exit_78(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "relay.yaml", {"destinations": {"*": {"rate": "lots"}}})
    for args in (("queue", "list"), ("stats",)):
        res = _relay(*args, "-c", str(cfg))
        assert res.returncode == 78, args
        assert 'destinations."*".rate' in res.stderr


# --- errors that help --------------------------------------------------------------------


def test_every_error_of_a_file_is_reported_at_once() -> None:
    msg = _error(
        {
            "retry": {"schedule": ["1m", "5x"]},
            "listen": [{"adress": "127.0.0.1:2525"}],
            "limits": {"max_recipients": "many"},
            "dedup": {"window": "forever"},
        }
    )
    lines = msg.splitlines()
    assert len(lines) == 4, msg
    assert any(line.startswith("retry.schedule[1]: '5x' is not a duration") for line in lines)
    assert "listen[0].adress: unknown key 'adress' (did you mean 'address'?)" in lines
    assert any(line.startswith("limits.max_recipients:") for line in lines)
    assert any(line.startswith("dedup.window:") for line in lines)


def test_a_misspelt_key_gets_a_suggestion() -> None:
    msg = _error({"spool": {"inline_mx": "1KiB"}})
    assert msg == "spool.inline_mx: unknown key 'inline_mx' (did you mean 'inline_max'?)"
    assert _error({"zzz": 1}) == "zzz: unknown key 'zzz'"


def test_yaml_errors_name_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  - address: 127.0.0.1:2525\n    allow: [127.0.0.0/8\nspool: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert re.match(rf"config: {re.escape(str(bad))}:\d+:\d+ is not valid YAML: ", str(e.value))
