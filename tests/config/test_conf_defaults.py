"""conf/relay.yaml says "Every key is shown with its default" (issue 26 item 10): every value
it sets equals the config code's default (relay/config/tree.py DEFAULTS and DESTINATION_DEFAULTS),
compared as the loader reads them (64KiB == 65536, 5m == 300s), and every default key is
shown. Before, `spool.inline_max: 64KiB` stood there while the default is 128 KiB."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from relay.config.tree import (
    DEFAULTS,
    DESTINATION_DEFAULTS,
    ConfigError,
    from_mapping,
    load_config,
    parse_duration,
    parse_percent,
    parse_rate,
    parse_size,
)

CONF = Path(__file__).resolve().parents[2] / "conf" / "relay.yaml"
PARSERS = (parse_duration, parse_size, parse_rate, parse_percent)


def _same(shown: Any, default: Any) -> bool:
    if shown == default:
        return True
    if isinstance(shown, list) and isinstance(default, list) and len(shown) == len(default):
        return all(_same(a, b) for a, b in zip(shown, default, strict=True))
    for parse in PARSERS:
        try:
            if parse(shown, "k") == parse(default, "k"):
                return True
        except ConfigError:
            continue
    return False


def _walk(shown: Any, default: Any, path: str, out: list[str]) -> None:
    if isinstance(default, dict) and isinstance(shown, dict):
        for k, v in shown.items():
            if k in default:
                _walk(v, default[k], f"{path}.{k}" if path else str(k), out)
        return
    if not _same(shown, default):
        out.append(f"{path}: conf/relay.yaml shows {shown!r}, the default is {default!r}")


def _missing(shown: dict[str, Any], default: dict[str, Any], path: str) -> list[str]:
    out = []
    for k, v in default.items():
        key = f"{path}.{k}" if path else k
        if k not in shown:
            out.append(key)
        elif isinstance(v, dict) and v and isinstance(shown[k], dict):
            out += _missing(shown[k], v, key)
    return out


def test_every_value_shown_is_the_default() -> None:
    conf = yaml.safe_load(CONF.read_text())
    wrong: list[str] = []
    _walk(conf, DEFAULTS, "", wrong)
    _walk(conf["destinations"]["*"], DESTINATION_DEFAULTS, 'destinations."*"', wrong)
    assert wrong == []


def test_every_default_key_is_shown() -> None:
    conf = yaml.safe_load(CONF.read_text())
    assert _missing(conf, DEFAULTS, "") == []


def test_the_file_loads_to_the_defaults() -> None:
    """The same promise for the whole tree, through the loader: the shipped file and an
    empty one give equal settings (the same folder as base for relative paths)."""
    shown = dataclasses.replace(load_config(CONF), path=None)
    empty = from_mapping({}, CONF.parent.resolve())
    differ = [
        f.name
        for f in dataclasses.fields(shown)
        if f.compare and getattr(shown, f.name) != getattr(empty, f.name)
    ]
    assert differ == []


def test_the_defaults_are_the_schema_defaults() -> None:
    """DEFAULTS, which the tests above hold conf/relay.yaml to, is what `relay config schema`
    shows editors: the same default for every top-level key and every key of a section the
    schema describes key by key (relay/config/models.py)."""
    from relay.config.tree import json_schema

    schema = json_schema()
    differ = []
    for name, default in DEFAULTS.items():
        prop = schema["properties"][name]
        if prop.get("default") != default:
            differ.append(name)
        refs = [o["$ref"] for o in [prop, *prop.get("anyOf", [])] if "$ref" in o]
        for ref in refs:
            props = schema["$defs"][ref.rsplit("/", 1)[1]]["properties"]
            shown = {k: v for k, v in props.items() if k in default}  # some are not shown
            differ += [f"{name}.{k}" for k, v in shown.items() if v.get("default") != default[k]]
    assert differ == []
