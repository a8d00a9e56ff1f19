"""`relay config schema`: a JSON Schema (draft 2020-12) of the config file that editors
(yaml-language-server) use to complete and check relay.yaml. The shipped conf/relay.yaml is
valid under it and shows the schema's defaults; what the loader refuses in a section on the
library, the schema refuses too."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from relay.config.tree import ConfigError, from_mapping, json_schema
from relay.config.values import duration, percent, rate, size

CONF = Path(__file__).resolve().parents[2] / "conf" / "relay.yaml"
SCHEMA = json_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_the_cli_prints_the_schema() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "relay", "config", "schema"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    assert printed == json.loads(json.dumps(SCHEMA))
    jsonschema.Draft202012Validator.check_schema(printed)


def test_the_shipped_config_is_valid_under_the_schema() -> None:
    conf = yaml.safe_load(CONF.read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(conf)]
    assert errors == []


def test_the_shipped_config_shows_the_schema_defaults() -> None:
    """Every value conf/relay.yaml sets in a section the schema describes key by key equals
    that key's default in the schema, compared as the loader reads them (5m == 300s)."""
    conf = yaml.safe_load(CONF.read_text())
    wrong, compared = [], 0
    for section, shown in conf.items():
        props = _properties(SCHEMA["properties"][section])
        if not props or not isinstance(shown, dict):
            continue
        for key, value in shown.items():
            assert key in props, f"{section}.{key}: not in the schema"
            if "default" in props[key]:
                compared += 1
                if not _same(value, props[key]["default"]):
                    wrong.append(f"{section}.{key}: {value!r} != {props[key]['default']!r}")
    assert wrong == []
    assert compared > 50  # the sections on the library are checked key by key


def _properties(node: dict[str, Any]) -> dict[str, Any]:
    for option in [node, *node.get("anyOf", [])]:
        ref = option.get("$ref")
        if ref:
            return dict(SCHEMA["$defs"][ref.rsplit("/", 1)[1]]["properties"])
    return {}


def _same(shown: Any, default: Any) -> bool:
    if shown == default:
        return True
    if isinstance(shown, list) and isinstance(default, list) and len(shown) == len(default):
        return all(_same(a, b) for a, b in zip(shown, default, strict=True))
    for parse in (duration, size, rate, percent):
        try:
            if parse(shown) == parse(default):
                return True
        except ValueError:
            continue
    return False


@pytest.mark.parametrize(
    "data",
    [
        {"retry": {"schedule": ["1m", "5x"]}},
        {"limits": {"max_recipients": "many"}},
        {"limits": {"max_conections": 5}},
        {"log": {"level": "loud"}},
        {"destinations": {"*": {"rate": "lots"}}},
        {"alerts": {"webhook": {"url": "https://h.example/", "timeuot": 1}}},
        {"zzz": 1},
    ],
)
def test_what_the_loader_refuses_the_schema_refuses(data: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        from_mapping(data, Path("/nonexistent"))
    assert not VALIDATOR.is_valid(data)


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"retry": {"schedule": ["30s", 90, "2h"]}, "limits": {"max_header_size": "64KiB"}},
        {"destinations": {"*": {"rate": "unlimited"}, "example.com": {"rate": "10/m"}}},
        {"health": {"disk_free_warning": "20%"}, "dsn": {"from": "postmaster@example.com"}},
    ],
)
def test_what_the_loader_takes_the_schema_takes(data: dict[str, Any]) -> None:
    from_mapping(data, Path("/nonexistent"))
    VALIDATOR.validate(data)


# --- every key the docs and relay.yaml name ---------------------------------------------

REFERENCE = CONF.parent.parent / "docs" / "reference" / "config.md"


def _reference_keys() -> list[str]:
    """The key column of the docs' config reference (docs/reference/config.md)."""
    keys = []
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            keys.append(line.split("`")[1])
    assert len(keys) > 100
    return keys


NAMED = ("destinations", "identities", "dkim", "upstreams", "local.aliases")


def _yaml_keys(node: Any, key: str = "") -> list[str]:
    """Every key path of conf/relay.yaml in the reference's notation (`listen[].address`)."""
    out = [key] if key else []
    if isinstance(node, dict):
        for k, v in node.items():
            name = "<name>" if key in NAMED else str(k)  # a destination's name is no key
            out += _yaml_keys(v, f"{key}.{name}" if key else name)
    elif isinstance(node, list):
        for v in node:
            if isinstance(v, dict):
                out += _yaml_keys(v, f"{key}[]")
    return out


def _doc(key: str, value: Any) -> Any:
    """The smallest document that sets `key` (`<name>` a destination or identity name) to
    `value`."""
    parts = key.replace("[]", ".[]").split(".")
    for part in reversed(parts):
        name = "example.com" if part == "<name>" else part
        value = [value] if part == "[]" else {name: value}
    return value


def _misspelt(key: str) -> str:
    """`key` with its last name misspelt as an operator might (one letter doubled)."""
    head, _, last = key.rpartition(".")
    bad = last.replace("[]", "")
    bad = bad[0] + bad  # "retry" -> "rretry"
    return f"{head}.{bad}" if head else bad


KEYS = sorted(set(_reference_keys()) | set(_yaml_keys(yaml.safe_load(CONF.read_text()))))


def test_every_key_of_the_reference_and_relay_yaml_is_in_the_schema() -> None:
    from relay.cli.docsgen import schema_keys

    known = schema_keys()
    assert [k for k in KEYS if k not in known] == []


@pytest.mark.parametrize("key", KEYS)
def test_every_key_with_its_default_validates_and_a_misspelling_is_flagged(key: str) -> None:
    from relay.cli.docsgen import config_keys

    defaults = dict(config_keys())
    if key in defaults:  # the documented default, as the code has it, is valid where it stands
        errors = [e.message for e in VALIDATOR.iter_errors(_doc(key, defaults[key]))]
        assert errors == [], key
    if not key.endswith("<name>"):  # any name is a name
        bad = _misspelt(key)
        assert not VALIDATOR.is_valid(_doc(bad, None)), bad


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"hostnme": "a.example"}, "hostnme: unknown key 'hostnme' (did you mean 'hostname'?)"),
        (
            {"upstream": {"smarthost": {"prot": 25}}},
            "upstream.smarthost.prot: unknown key 'prot' (did you mean 'port'?)",
        ),
        (
            {"destinations": {"example.com": {"rat": "1/s"}}},
            "destinations.example.com.rat: unknown key 'rat' (did you mean 'rate'?)",
        ),
        (
            {"dkim": {"example.com": {"selectr": "s", "key_file": "k"}}},
            "dkim.example.com.selectr: unknown key 'selectr' (did you mean 'selector'?)",
        ),
        (
            {"upstreams": {"a": {"host": "a.example", "prot": 25}}, "routes": [{"via": ["a"]}]},
            "upstreams.a.prot: unknown key 'prot' (did you mean 'port'?)",
        ),
        (
            {"upstreams": {"a": {"hots": "a.example"}}, "routes": [{"via": ["a"]}]},
            "upstreams.a.hots: unknown key 'hots' (did you mean 'host'?)",
        ),
        (
            {"routes": [{"sender_domian": "a.example", "via": "mx"}, {"via": "mx"}]},
            "routes[0].sender_domian: unknown key 'sender_domian' (did you mean 'sender_domain'?)",
        ),
        (
            {"local": {"domian": "example.com"}},
            "local.domian: unknown key 'domian' (did you mean 'domain'?)",
        ),
    ],
)
def test_a_misspelt_key_is_flagged_by_the_schema_and_the_loader(
    data: dict[str, Any], line: str
) -> None:
    assert not VALIDATOR.is_valid(data)
    with pytest.raises(ConfigError) as e:
        from_mapping(data, Path("/nonexistent"))
    assert line in str(e.value).splitlines()


# --- the commented examples in conf/relay.yaml --------------------------------------------

_EXAMPLE = re.compile(
    r"^(\s*)# ((?:- )?(?:\"[^\"]*\"|[a-z_*.]+[a-z_]):(?: |$).*|- \{.*|\s+.*[a-z_]+:.*)$"
)
_EMPTY = re.compile(r"^(\s*[a-z_]+:) (?:\{\}|\[\]|null)(\s+#.*)?$")


def _uncommented(text: str) -> str:
    """conf/relay.yaml with its commented-out examples (`# lane: bulk`, `# upstreams:` and
    the lines under them) made live, and a `key: {}` that an example fills made a parent."""
    lines = text.splitlines()
    out: list[str] = []
    live = False  # inside an example block
    for line in lines:
        m = _EXAMPLE.match(line)
        starts = m is not None and not m.group(2).startswith(" ")
        if m is not None and (starts or live):
            out.append(m.group(1) + m.group(2))
            live = True
        else:
            out.append(line)
            live = False
    for i in range(len(out) - 1):  # `identities: {}` followed by an example entry
        m = _EMPTY.match(out[i])
        nxt = out[i + 1]
        deeper = len(nxt) - len(nxt.lstrip()) - (len(out[i]) - len(out[i].lstrip()))
        child = deeper > 0 or (deeper == 0 and nxt.lstrip().startswith("- "))
        if m is not None and child and not nxt.lstrip().startswith("#"):
            out[i] = m.group(1)
    return "\n".join(out) + "\n"


def _as_editor_reads(node: Any) -> Any:
    """YAML 1.1 makes 2026-12-01 a date; editors (YAML 1.2) and the JSON Schema see text."""
    if isinstance(node, dict):
        return {k: _as_editor_reads(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_as_editor_reads(v) for v in node]
    return node.isoformat() if isinstance(node, dt.date) else node


def _examples(text: str | None = None) -> dict[str, Any]:
    data = yaml.safe_load(_uncommented(CONF.read_text() if text is None else text))
    assert isinstance(data, dict)
    return dict(_as_editor_reads(data))


def test_the_commented_examples_are_live_in_the_test() -> None:
    data = _examples()
    assert [x["address"] for x in data["listen"]] == [
        "127.0.0.1:2525",
        "0.0.0.0:2587",
        "0.0.0.0:465",
    ]
    assert data["listen"][0]["auth"] == {"users_file": "users", "allow_plaintext": False}
    assert set(data["upstreams"]) == {"primary", "backup"} and len(data["routes"]) == 2
    assert set(data["destinations"]) == {"*", "gmail.com"}
    assert data["identities"]["example.com"]["unsubscribe"]["mailto"]
    assert len(data["dkim"]["example.com"]) == 2 and data["shaping"]["rules"]


def test_the_commented_examples_are_valid_under_the_schema() -> None:
    """The examples in conf/relay.yaml's comments use keys and values the config takes: a
    renamed or misspelt key in a comment fails here, not on the operator's machine."""
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(_examples())]
    assert errors == []


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("password_file: secrets/primary", "pasword_file: secrets/primary"),
        ("{sender_domain: billing", "{sender_domian: billing"),
        ("- {selector: s2026", "- {selectr: s2026"),
        ("#   mode: starttls", "#   mode: tls"),
        ("#   daily_limit: 50000", "#   daily_limit: lots"),
    ],
)
def test_a_drifted_example_is_caught(good: str, bad: str) -> None:
    text = CONF.read_text()
    assert good in text
    assert VALIDATOR.is_valid(_examples(text))
    assert not VALIDATOR.is_valid(_examples(text.replace(good, bad, 1)))
