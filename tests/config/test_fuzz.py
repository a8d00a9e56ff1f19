"""`relay check-config` never crashes (issue 27 LOW items): whatever value of whatever type
stands at whatever key, the answer is a clean message naming the key and exit 78, or OK
and exit 0, never a traceback. Hypothesis substitutes random values into a config that
uses every section (PostgreSQL spool, routes and upstreams, an AUTH listener,
feedback, alerts, identities, lanes), run through `relay check-config` in-process."""

from __future__ import annotations

import copy
import io
import logging
import os
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.cli import main as cli
from relay.config.tree import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
USERS = "app:scrypt$gxCvyfN76ozocWt3m6lrIQ==$c5iurdD0ND6MtbfKn5rYCC00je4UT9t70rklWXReTaU=\n"


def rich(d: Path) -> dict[str, Any]:
    """conf/relay.yaml with every optional section switched on (its secret files exist)."""
    for name in ("token", "password", "secret", "users"):
        (d / name).write_text("x\n" if name != "users" else USERS)
    base = yaml.safe_load((ROOT / "conf" / "relay.yaml").read_text())
    extra: dict[str, Any] = {
        "hostname": "relay.example.net",
        "spool": {
            "path": str(d / "spool"),
            "backend": "postgresql",
            "dsn": "postgresql://relay@127.0.0.1:5432/relay",
            "password_file": str(d / "password"),
        },
        "listen": [
            {"address": "127.0.0.1:2525", "allow": ["127.0.0.0/8", "::1/128"]},
            {
                "address": "127.0.0.1:2587",
                "auth": {"users_file": str(d / "users"), "allow_plaintext": True},
            },
        ],
        "upstreams": {
            "primary": {
                "host": "smtp.example.net",
                "port": 587,
                "tls": "starttls",
                "username": "app",
                "password_file": str(d / "password"),
            },
            "backup": {"host": "smtp2.example.net", "port": 465, "tls": "implicit"},
        },
        "routes": [
            {"recipient_domain": ["example.org"], "via": "mx"},
            {"sender_domain": "billing.example.com", "via": ["backup"]},
            {"via": ["primary", "backup"]},
        ],
        "destinations": {"*": {}, "primary": {"rate": "10/s", "daily_limit": 1000}},
        "identities": {"example.com": {"daily_limit": 5000}},
        "alerts": {
            "command": "/bin/true",
            "webhook": {"url": "https://hooks.example.net/x", "secret_file": str(d / "secret")},
        },
        "feedback": {
            "address": "bounces@relay.example.net",
            "verp": True,
            "providers": {"generic": {"token_file": str(d / "token")}},
        },
        "local": {"domain": "example.net", "aliases": {"root": "ops@example.net"}},
        "dsn": {"enabled": True, "from": "postmaster@example.net"},
        "lanes": {"rules": [{"header": "Precedence", "header_value": "bulk", "lane": "bulk"}]},
    }
    for k, v in extra.items():
        base[k] = v
    return base


def keys(node: Any, pre: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield pre
    if isinstance(node, dict):
        for k, v in node.items():
            yield from keys(v, (*pre, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from keys(v, (*pre, i))


_text = st.sampled_from(
    [
        "",
        "x",
        "abc:def",
        "-1",
        "1e999",
        "1h",
        "99999999999999999999d",
        "0s",
        "[",
        "::::",
        "postgresql://u@h:abc/db",
        "postgresql://u@[::1/db",
        "postgres://h:99999/db",
        "a@b",
        "127.0.0.1:abc",
        "127.0.0.1:99999",
        "host:-1",
        ":25",
        "10.0.0.0/33",
        "1.2.3.4/abc",
        "\x00",
        "é",
        "%",
        "5MiB",
        "-5MiB",
        "http://h:abc/",
        "https://[::1",
        "0.0.0.0:0",
        "1/s",
        "0/s",
        "-1/s",
        "nan",
        "inf",
        "UTC+99",
        "Mars/Olympus",
    ]
) | st.text(max_size=12)
_scalar = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _text
)
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    d = tmp_path_factory.mktemp("cfg")
    return rich(d), d


@pytest.fixture(autouse=True)
def _keep_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def check_config(path: Path) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        rc = cli.main(["check-config", "-c", str(path)])
    return rc, err.getvalue()


def test_the_rich_base_is_a_valid_config(base: tuple[dict[str, Any], Path]) -> None:
    conf, d = base
    path = d / "base.yaml"
    path.write_text(yaml.safe_dump(conf))
    assert check_config(path) == (0, "")


@settings(
    # 60 in `make test` (each writes and loads a whole config); `make fuzz` runs more
    max_examples=int(os.environ.get("RELAY_CONFIG_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_value_at_any_key_is_a_clean_error_or_ok(
    base: tuple[dict[str, Any], Path], data: st.DataObject
) -> None:
    conf, d = base
    doc = copy.deepcopy(conf)
    where = data.draw(st.sampled_from([k for k in keys(doc) if k]), label="key")
    node = doc
    for k in where[:-1]:
        node = node[k]
    old = node[where[-1]]
    # a value of any type, or the key's own value slightly broken (a letter in a port)
    value = data.draw(_value | _mutations(old), label="value")
    node[where[-1]] = value
    path = d / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:  # only ConfigError, whose message starts with the key at fault
        load_config(path)
    except ConfigError as e:
        first = str(e).splitlines()[0]
        assert ": " in first and not first.startswith(" "), str(e)
    rc, err = check_config(path)  # and the command: a clean line, no traceback
    assert rc in (0, 78), err
    assert "Traceback" not in err
    if rc == 78:
        assert err.startswith("relay: ") and err.count("\n") >= 1, err


def _mutations(old: Any) -> st.SearchStrategy[Any]:
    if isinstance(old, str) and old:
        return st.builds(
            lambda i, c, how: (
                old[:i] + c + old[i:]
                if how == 0
                else old[:i] + c + old[i + 1 :]
                if how == 1
                else old[:i]
            ),
            st.integers(0, len(old) - 1),
            st.sampled_from("x:9-.@/[]% é\x00"),
            st.integers(0, 2),
        )
    if isinstance(old, int) and not isinstance(old, bool):
        return st.sampled_from([-old, old * 10**12, f"{old}x", old + 0.5])
    return _value


@pytest.mark.parametrize(
    ("dsn", "says"),
    [
        ("postgresql://relay:pw@db.example.net:abc/relay", "spool.dsn: port 'abc'"),
        ("postgresql://relay@db.example.net:99999/relay", "spool.dsn: port '99999'"),
        ("postgresql://relay@[::1/relay", "spool.dsn: "),
    ],
)
def test_a_dsn_with_a_bad_port_is_a_config_error(
    base: tuple[dict[str, Any], Path], dsn: str, says: str
) -> None:
    conf, d = base
    doc = copy.deepcopy(conf)
    doc["spool"]["dsn"] = dsn
    path = d / "dsn.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, err = check_config(path)
    assert rc == 78 and err.startswith(f"relay: {says}"), err
    assert "pw" not in err  # the password stays out of the message


@pytest.mark.parametrize(
    ("where", "value", "says"),
    [
        (("feedback", "verp_secret_file"), "/etc/relay/\x00key", "feedback.verp_secret_file: "),
        (("upstreams", "primary", "password_file"), "\x00", "upstreams.primary.password_file: "),
        (("lanes", "rules", 0, "header_value"), "bulk\x00", "lanes.rules[0].header_value: "),
        (("spool", "password_file"), "a" * 300, "spool.password_file: file name too long"),
        (("alerts", "webhook", "secret_file"), "/x" * 2100, "alerts.webhook.secret_file: "),
    ],
)
def test_values_the_os_refuses_are_config_errors(
    base: tuple[dict[str, Any], Path], where: tuple[Any, ...], value: str, says: str
) -> None:
    """Found by the test above: a NUL (ValueError from os calls) and an over-long file name
    (ENAMETOOLONG from Path.is_file) crashed check-config."""
    conf, d = base
    doc = copy.deepcopy(conf)
    node = doc
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    path = d / "os.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(says), str(e.value)
    rc, err = check_config(path)
    assert rc == 78 and err.startswith(f"relay: {says}"), err


def test_an_unknown_key_with_a_control_character_is_one_escaped_line(tmp_path: Path) -> None:
    """Found by the fuzz test above: a record separator (\\x1e) in an unknown key was
    printed raw, and str.splitlines cut the one-error-a-line message at it."""
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump({"spool": {"path": "spool", "x\x1ey": 1}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).splitlines() == ["spool.x\\x1ey: unknown key 'x\\x1ey'"]


def test_a_named_entry_with_a_control_character_is_one_escaped_line(tmp_path: Path) -> None:
    """Found by the fuzz test above: an alias named "\\r" without an address was reported as
    `local.aliases.<CR>: ...`, which str.splitlines cut before its colon (the key a
    section's check names, as well as the keys pydantic names, is shown escaped)."""
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump({"local": {"aliases": {"\r": None}}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).splitlines() == ["local.aliases.\\r: expected an address or a list of them"]


@pytest.mark.parametrize(
    ("doc", "line"),
    [
        (  # found by the fuzz test: a bad upstream name was printed raw
            {"upstreams": {"\r": None}},
            "upstreams.\\r: an upstream name is lowercase letters, digits, '-' and '_' (it"
            " names a destination too)",
        ),
        ({"destinations": {"a\rb": 5}}, 'destinations."a\\rb": expected a mapping'),
    ],
)
def test_a_bad_name_with_a_control_character_is_shown_escaped(
    tmp_path: Path, doc: dict[str, Any], line: str
) -> None:
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert line in str(e.value).splitlines(), str(e.value)
