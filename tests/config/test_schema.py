"""`relay config schema`: a JSON Schema (draft 2020-12) of the config file that editors
(yaml-language-server) use to complete and check relay.yaml. The shipped conf/relay.yaml is
valid under it and shows the schema's defaults; what the loader refuses in a section on the
library, the schema refuses too."""

from __future__ import annotations

import json
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
