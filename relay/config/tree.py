"""The config's entry point: `load_config(path)` / `from_mapping(data, base_dir)` give the
frozen tree (relay/config/records.py) or one `ConfigError` listing every error of the file.

Rules:
- The keys, types and defaults are the pydantic models (relay/config/models.py, the
  sections in relay/config/sections/; value types: relay/config/values.py); `DEFAULTS` below
  takes them from the models (and is mirrored, commented, in conf/relay.yaml; `relay config
  schema` prints the JSON Schema, `json_schema()`).
- An unknown key, a wrong type or a bad value is an error whose message names the key path
  (`retry.schedule[2]: '5x' is not a duration`); every error of a file is found in one pass,
  one a line (relay/config/report.py); the CLI exits 78 (EX_CONFIG).
- Each section is validated once; a section with errors gets its defaults so that the rest
  (the checks between sections, relay/config/build.py) can still be made and reported.
- Relative paths are relative to the config file's folder.
- Secrets are read from files named in the config and never appear in `repr` or in
  `redacted()` output.
- The records (Config, Limits, FeedbackConf...) are importable from here too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from relay.config import values as types
from relay.config.build import build, parse_aliases
from relay.config.models import (
    SECTIONS,
    AdminSection,
    AlertsSection,
    AuthSection,
    DedupSection,
    DeliverySection,
    DestinationSection,
    DsnSection,
    FeedbackSection,
    HealthSection,
    IdentitySection,
    InboundSection,
    LanesSection,
    LimitsSection,
    LocalSection,
    LogSection,
    RetrySection,
    Section,
    Sections,
    ShapingSection,
    SpoolSection,
    TimeoutsSection,
    TopLevel,
    UpstreamSection,
    file_model,
)
from relay.config.records import (
    Alerts,
    AuthLimits,
    Config,
    Delivery,
    Destination,
    Dsn,
    FeedbackConf,
    FeedbackProvider,
    FleetConf,
    Health,
    HttpBounds,
    Identity,
    LanesConf,
    Limits,
    Listener,
    ListenerAuth,
    ListenerTLS,
    Local,
    LogConf,
    MxMode,
    OutboxConf,
    PgSpool,
    Retry,
    ShapingConf,
    Smarthost,
    Upstream,
    WarmupConf,
    Webhook,
    hostname_problem,
)
from relay.config.report import (
    EX_CONFIG,
    ConfigError,
    nul_keys,
    place,
    shown,
    unknown_key,
    validate,
)

__all__ = [
    "DEFAULTS",
    "DEFAULT_PATH",
    "DESTINATION_DEFAULTS",
    "EX_CONFIG",
    "IDENTITY_DEFAULTS",
    "Alerts",
    "AuthLimits",
    "Config",
    "ConfigError",
    "Delivery",
    "Destination",
    "Dsn",
    "FeedbackConf",
    "FeedbackProvider",
    "FleetConf",
    "Health",
    "HttpBounds",
    "Identity",
    "LanesConf",
    "Limits",
    "Listener",
    "ListenerAuth",
    "ListenerTLS",
    "Local",
    "LogConf",
    "MxMode",
    "OutboxConf",
    "PgSpool",
    "Retry",
    "ShapingConf",
    "Smarthost",
    "Upstream",
    "WarmupConf",
    "Webhook",
    "from_mapping",
    "hostname_problem",
    "json_schema",
    "load_config",
    "parse_aliases",
    "parse_duration",
    "parse_hostport",
    "parse_percent",
    "parse_rate",
    "parse_size",
]

DEFAULT_PATH = "/etc/relay/relay.yaml"

DEFAULTS: dict[str, Any] = {
    "hostname": TopLevel.model_fields["hostname"].default,
    "listen": [{"address": "127.0.0.1:2525", "allow": ["127.0.0.0/8", "::1/128"]}],
    "spool": SpoolSection.defaults(),
    "dedup": DedupSection.defaults(),
    "limits": LimitsSection.defaults(),
    "auth": AuthSection.defaults(),
    "upstream": UpstreamSection.defaults(),
    "retry": RetrySection.defaults(),
    "timeouts": TimeoutsSection.defaults(),
    "destinations": {"*": {}},
    "identities": {},
    "shaping": ShapingSection.defaults(),
    "lanes": LanesSection.defaults(),
    "delivery": DeliverySection.defaults(),
    "alerts": AlertsSection.defaults(),
    "health": HealthSection.defaults(),
    "dsn": DsnSection.defaults(),
    "local": LocalSection.defaults(),
    "admin": AdminSection.defaults(),
    "dkim": {},
    "feedback": FeedbackSection.defaults(),
    "log": LogSection.defaults(),
    "shutdown_timeout": TopLevel.model_fields["shutdown_timeout"].default,
    "inbound": InboundSection.defaults(),
}

# Per-destination keys and their defaults (used for "*" and every named destination; a
# named destination inherits every key it does not set from "*").
DESTINATION_DEFAULTS: dict[str, Any] = DestinationSection.defaults()

IDENTITY_DEFAULTS: dict[str, Any] = IdentitySection.defaults()


_T = TypeVar("_T")


def parse_duration(value: object, key: str) -> float:
    """Seconds from `30s`, `5m`, `2h`, `7d` or a number (relay.config.values.duration)."""
    return _keyed(types.duration, value, key)


def parse_percent(value: object, key: str) -> float:
    """ "10%" or 10 (percent, 0 to 100)."""
    return _keyed(types.percent, value, key)


def parse_size(value: object, key: str) -> int:
    return _keyed(types.size, value, key)


def parse_rate(value: object, key: str) -> float | None:
    """Tokens per second; None means unlimited."""
    return _keyed(types.rate, value, key)


def parse_hostport(value: object, key: str, default_port: int | None = None) -> tuple[str, int]:
    return _keyed(lambda v: types.hostport(v, default_port), value, key)


def _keyed(parse: Callable[[Any], _T], value: object, key: str) -> _T:
    """`parse(value)`, its ValueError a ConfigError naming `key`."""
    try:
        return parse(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _merge(base: Any, over: Any) -> Any:
    """Deep-merge `over` onto `base` for mappings; anything else replaces. A section left
    empty (`limits:` with every key commented out is YAML null) keeps its defaults."""
    if isinstance(base, dict) and over is None:
        return dict(base)
    if isinstance(base, dict) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return over


def json_schema() -> dict[str, Any]:
    """The config file's JSON Schema (`relay config schema`), for editors: keys, types,
    defaults and descriptions; an unknown key is flagged as the loader would."""
    out: dict[str, Any] = file_model(DEFAULTS).model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **out}


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    p = Path(path or os.environ.get("RELAY_CONFIG") or DEFAULT_PATH)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        how = ""
        if not path and not os.environ.get("RELAY_CONFIG"):
            how = (
                " (no -c FILE given and $RELAY_CONFIG not set: point at a config with"
                " `-c FILE` or `RELAY_CONFIG=FILE`; `make run` uses conf/relay.yaml)"
            )
        raise ConfigError(f"config: cannot read {p}: {e.strerror or e}{how}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config: {where} is not valid YAML: {problem}") from None
    return from_mapping(data or {}, p.resolve().parent, path=p.resolve())


def from_mapping(data: object, base_dir: Path, path: Path | None = None) -> Config:
    """The config tree, or one ConfigError listing every error of the file (one a line)."""
    # a NUL reaches no file name, host or header: os and socket calls raise ValueError on it
    nul = [f"{k}: a NUL character is not allowed in a config value" for k in nul_keys(data)]
    if nul:
        raise ConfigError("\n".join(nul))
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping at the top, got {types.kind(data)}")
    errors: list[str] = []
    merged: dict[str, Any] = _merge(DEFAULTS, data)
    typed = _sections(merged, base_dir, errors)
    config = build(data, merged, base_dir, path, typed, errors)
    known = [*DEFAULTS, "upstreams", "routes", "fleet", "outbox"]
    for name in data:  # every unknown key at the top, not the first
        if name not in known:
            errors.append(unknown_key(shown(str(name)), str(name), sorted(known)))
    if errors:
        errors.sort(key=place)
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    return config


def _sections(merged: Mapping[str, Any], base_dir: Path, errors: list[str]) -> Sections:
    """Each section validated once; its errors (all of them) appended."""
    out: dict[str, Section] = {}
    top = {k: merged[k] for k in TopLevel.model_fields if k in merged}
    out["top"] = validate(TopLevel, top, "", errors) or TopLevel()
    for name, model in SECTIONS.items():
        value = merged.get(name)
        got = validate(model, {} if value is None else value, name, errors, base=base_dir)
        out[name] = got or model()
    return Sections(**out)  # type: ignore[arg-type]
