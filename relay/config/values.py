"""The value types of the config (durations, sizes, rates, percentages, host:port, and the
strict scalars) as pydantic annotated types, with the parsers they are built on.

Each parser is a pure function: value in, parsed value out, or `ValueError` whose text is
the contract's wording without the key (`'5x' is not a duration (use ...)`); the config
loader prefixes the key path (`retry.schedule[2]: ...`). In a pydantic model the same text
travels as a `relay_config` error, so the loader can print it unchanged (pydantic's own
wording never reaches the operator). Each type carries its JSON Schema for editors.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainValidator, ValidationInfo, WithJsonSchema
from pydantic_core import PydanticCustomError

from relay.config import credentials

# the error type every relay validator raises; `{msg}` is the whole text
ERROR_TYPE = "relay_config"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB|k|K|M|G)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "k": 1024,
    "K": 1024,
    "KiB": 1024,
    "M": 1024**2,
    "MiB": 1024**2,
    "G": 1024**3,
    "GiB": 1024**3,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|m|min|h|hour|d|day)\s*$")
_RATE_UNITS = {
    "s": 1,
    "sec": 1,
    "m": 60,
    "min": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}


def kind(v: object) -> str:
    """How an unexpected value is named in an error: `str 'x'`, `nothing`."""
    return "nothing" if v is None else f"{type(v).__name__} {v!r}"


def duration(value: object) -> float:
    """`30s`, `5m`, `2h`, `7d`, `250ms`, `1w`, or a number of seconds."""
    if isinstance(value, bool) or (isinstance(value, float) and value != value):  # NaN
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{value!r} must not be negative")
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    raise ValueError(f"{value!r} is not a duration (use 30s, 5m, 2h, 7d or seconds)")


def size(value: object) -> int:
    """`64KiB`, `1MiB`, `1KB` (decimal), `2G` (binary), or a number of octets."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    raise ValueError(f"{value!r} is not a size (use 25MiB, 64KiB or bytes)")


def rate(value: object) -> float | None:
    """Tokens per second from `50/s`, `100/m`, `3600/h`, `N/d` or a number; None (or
    `unlimited`) means unlimited."""
    if value is None or value == "unlimited":
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    if isinstance(value, str):
        m = _RATE.match(value)
        if m and float(m.group(1)) > 0:
            return float(m.group(1)) / _RATE_UNITS[m.group(2)]
    raise ValueError(f"{value!r} is not a rate (use 50/s, 100/m, 3600/h or unlimited)")


def percent(value: object) -> float:
    """`10%` or 10 (percent, 0 to 100)."""
    v: object = value
    if isinstance(v, str) and v.endswith("%"):
        try:
            v = float(v[:-1])
        except ValueError:
            v = value
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 100:
        raise ValueError(f"{value!r} is not a percentage (use 10% or 10)")
    return float(v)


def hostport(value: object, default_port: int | None = None) -> tuple[str, int]:
    """`host:port`, `[v6]:port`; without a port only when `default_port` is given."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{value!r} is not a host:port address")
    host, sep, port_s = value.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"{value!r} has no port (use host:port)")
        host, port_s = value, str(default_port)
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"{port_s!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    if not host:
        raise ValueError(f"{value!r} has no host")
    return host, port


DEFAULT_DNS_PORT = 53


def parse_nameserver(spec: str) -> tuple[str, int]:
    """Parse ``"127.0.0.1:5353"``, ``"127.0.0.1"``, ``"[::1]:53"``, ``"[::1]"`` or ``"::1"``.

    Returns ``(address, port)``; raises :class:`ValueError` for anything else
    (host names are not accepted: resolving the resolver would need a resolver).
    """
    text = spec.strip()
    port = DEFAULT_DNS_PORT
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"invalid nameserver {spec!r}: missing ']'")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"invalid nameserver {spec!r}")
            port = _parse_port(spec, rest[1:])
        address = host
    elif text.count(":") == 1:
        address, _, port_text = text.partition(":")
        port = _parse_port(spec, port_text)
    else:
        address = text  # IPv4 without port, or a bare IPv6 address
    try:
        return str(ipaddress.ip_address(address)), port
    except ValueError:
        raise ValueError(f"invalid nameserver {spec!r}: not an IP address") from None


def _parse_port(spec: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"invalid nameserver {spec!r}: bad port")
    return int(text)


def string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {kind(value)}")
    return value


def opt_string(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"expected a string or null, got {kind(value)}")
    return value


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {kind(value)}")
    return value


def integer(value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {kind(value)}")
    if value < minimum:
        raise ValueError(f"{value} is below the minimum {minimum}")
    return value


def number(value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"expected a number from {lo} to {hi}")
    return float(value)


def choice(value: object, choices: tuple[str, ...]) -> str:
    v = string(value)
    if v not in choices:
        raise ValueError(f"{v!r} is not one of {', '.join(choices)}")
    return v


def problem(msg: str, key: str | None = None, full: bool = False) -> PydanticCustomError:
    """A relay error for pydantic: `msg` printed as is after the key path; `key` names a
    field below the failing model (a model's cross-field check names the field it blames);
    `full`: `msg` names its key path itself (a parser of its own that numbers its items)."""
    ctx: dict[str, Any] = {"msg": msg}
    if key is not None:
        ctx["key"] = key
    if full:
        ctx["full"] = True
    return PydanticCustomError(ERROR_TYPE, "{msg}", ctx)


def require_url_host(url: str, shown: str) -> None:
    """Refuse `url` (http:// or https://, already checked; `shown` is how an error prints it,
    redacted) when it cannot be sent to: a host that does not parse (`https://[h.example/x`:
    an unclosed IPv6 bracket) or is missing, a port that is not a number in 1-65535. Found
    here, not by the HTTP client at the first alert."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise problem(f"{shown!r} is not a valid URL ({e})") from None
    if not parts.hostname:
        raise problem(f"{shown!r} has no host")
    if port == 0:
        raise problem(f"{shown!r} has port 0")


def _checked(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        try:
            return parse(value)
        except ValueError as e:
            raise problem(str(e)) from None

    return check


def _type(py: Any, parse: Callable[[Any], Any], schema: dict[str, Any]) -> Any:
    return Annotated[py, PlainValidator(_checked(parse)), WithJsonSchema(schema)]


DURATION_SCHEMA = {
    "anyOf": [
        {"type": "number", "minimum": 0},
        {"type": "string", "pattern": _DURATION.pattern},
    ],
    "description": "a duration: 30s, 5m, 2h, 7d, 250ms, 1w, or a number of seconds",
}
_SIZE_SCHEMA = {
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": _SIZE.pattern},
    ],
    "description": "a size: 64KiB, 1MiB, 25MiB, 1KB (1000), or a number of octets",
}
_RATE_SCHEMA = {
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0},
        {"type": "string", "pattern": _RATE.pattern},
        {"const": "unlimited"},
        {"type": "null"},
    ],
    "description": "a rate: 50/s, 100/m, 3600/h, 1000/d, a number per second, or unlimited",
}
_PERCENT_SCHEMA = {
    "anyOf": [
        {"type": "number", "minimum": 0, "maximum": 100},
        {"type": "string", "pattern": r"^\d+(\.\d+)?%$"},
    ],
    "description": "a percentage: 10% or 10",
}

Duration = _type(float, duration, DURATION_SCHEMA)
OptDuration = _type(
    float | None,
    lambda v: None if v is None else duration(v),
    {"anyOf": [*DURATION_SCHEMA["anyOf"], {"type": "null"}]},
)
Size = _type(int, size, _SIZE_SCHEMA)
Rate = _type(float | None, rate, _RATE_SCHEMA)
Percent = _type(float, percent, _PERCENT_SCHEMA)
HostPort = _type(
    tuple[str, int],
    hostport,
    {"type": "string", "pattern": r"^.+:\d+$", "description": "host:port"},
)
OptHostPort = _type(
    tuple[str, int] | None,
    lambda v: hostport(v) if opt_string(v) else None,
    {"type": ["string", "null"], "pattern": r"^.+:\d+$", "description": "host:port"},
)
Str = _type(str, string, {"type": "string"})
OptStr = _type(str | None, opt_string, {"type": ["string", "null"]})
Bool = _type(bool, boolean, {"type": "boolean"})
OptBool = _type(
    bool | None, lambda v: None if v is None else boolean(v), {"type": ["boolean", "null"]}
)


def Int(minimum: int = 0) -> Any:
    """A whole number of at least `minimum` (a bool is no number here)."""
    return _type(int, lambda v: integer(v, minimum), {"type": "integer", "minimum": minimum})


def OptInt(minimum: int = 0) -> Any:
    return _type(
        int | None,
        lambda v: None if v is None else integer(v, minimum),
        {"type": ["integer", "null"], "minimum": minimum},
    )


def Number(lo: float, hi: float) -> Any:
    return _type(
        float, lambda v: number(v, lo, hi), {"type": "number", "minimum": lo, "maximum": hi}
    )


def Choice(*choices: str) -> Any:
    return _type(str, lambda v: choice(v, choices), {"enum": list(choices)})


def _path(value: object, info: ValidationInfo) -> Path | None:
    """A file or folder name: `${CREDENTIALS_DIRECTORY}` expanded (systemd's LoadCredential=,
    relay/config/credentials.py), relative names resolved against the config file's folder (the
    validation context's `base`)."""
    v = opt_string(value)
    if v is None:
        return None
    try:
        v = credentials.expand(v, "")
    except ValueError as e:
        raise problem(str(e).removeprefix(": ")) from None
    # ENAMETOOLONG is an OSError that Path.is_file() raises instead of answering False
    if len(os.fsencode(v)) >= 4096 or any(len(os.fsencode(c)) > 255 for c in v.split("/")):
        raise problem("file name too long")
    base = Path((info.context or {}).get("base", "."))
    return (base / v).resolve() if not os.path.isabs(v) else Path(v)


def path_value(value: object, info: ValidationInfo) -> Path | None:
    """A file key's value as a Path (None: null); a relay error naming the problem."""
    try:
        return _path(value, info)
    except ValueError as e:
        raise problem(str(e)) from None


OptPath = Annotated[
    Path | None,
    PlainValidator(path_value),
    WithJsonSchema(
        {"type": ["string", "null"], "description": "a file name (relative: to this file)"}
    ),
]
