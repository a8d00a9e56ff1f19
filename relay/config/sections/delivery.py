"""retry, timeouts, delivery, destinations, upstream, shaping, lanes: the way out
(relay/delivery/)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainValidator,
    PrivateAttr,
    WithJsonSchema,
    model_validator,
)

from relay.config import values as t
from relay.config.sections.base import ReadablePath, Section, list_of
from relay.config.values import DURATION_SCHEMA


def _nonempty_list(value: object) -> object:
    if not isinstance(value, list | tuple) or not value:  # a tuple: the default
        raise t.problem("expected a non-empty list of durations")
    return value


class RetrySection(Section):
    schedule: Annotated[
        tuple[t.Duration, ...],
        # a check before the items': the contract's wording for "not a list"
        BeforeValidator(_nonempty_list),
        Field(json_schema_extra={"minItems": 1}),
    ] = ("1m", "5m", "30m", "2h")
    max_age: t.Duration = "5d"
    min_delay: t.Duration = "1s"
    warn_after: t.Duration = "4h"


class TimeoutsSection(Section):
    connect: t.Duration = "10s"
    command: t.Duration = "30s"
    data: t.Duration = "120s"


class DeliverySection(Section):
    workers: t.Int(1) = 50  # type: ignore[valid-type]
    batch: t.Int(1) = 200  # type: ignore[valid-type]
    poll_interval: t.Duration = "0.25s"
    gather: t.Duration = "10ms"  # new mail waits this long for more before a claim pass


def _burst(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1:
        return float(value)
    raise t.problem("expected a number >= 1")


class DestinationSection(Section):
    """One entry of `destinations` ("*" and each named one; a named one inherits every key
    it does not set from "*")."""

    max_connections: t.Int(1) = 10  # type: ignore[valid-type]
    rate: t.Rate = "50/s"
    burst: Annotated[
        float | None,
        PlainValidator(_burst),
        WithJsonSchema({"type": ["number", "null"], "minimum": 1}),
    ] = None
    daily_limit: t.OptInt(0) = None  # type: ignore[valid-type]
    max_messages_per_connection: t.Int(1) = 100  # type: ignore[valid-type]
    connect_timeout: t.OptDuration = None  # None: timeouts.*
    command_timeout: t.OptDuration = None
    data_timeout: t.OptDuration = None
    ambiguous: t.Choice("retry", "assume-delivered") = "retry"  # type: ignore[valid-type]
    circuit_failures: t.Int(1) = 5  # type: ignore[valid-type]
    circuit_cooldown: t.Duration = "60s"
    slowdown_cooldown: t.Duration = "60s"


class SmarthostSection(Section):
    host: t.Str = "127.0.0.1"
    port: t.Int(1) = 587  # type: ignore[valid-type]
    tls: t.Choice("none", "opportunistic", "starttls", "implicit") = "starttls"  # type: ignore[valid-type]
    verify: t.Bool = True
    ca_file: ReadablePath = None
    username: t.OptStr = None
    password_file: t.OptPath = None  # the password is read from this file, never inline
    _password: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_password(self) -> SmarthostSection:
        if self.password_file is not None:
            try:
                self._password = self.password_file.read_text(encoding="utf-8").strip("\r\n")
            except OSError as e:
                raise t.problem(
                    f"cannot read {self.password_file}: {e.strerror}", "password_file"
                ) from None
        if self.username and self._password is None:
            raise t.problem("required when username is set", "password_file")
        return self

    @property
    def password(self) -> str | None:
        return self._password


def _nameserver_list(value: object) -> object:
    if value is not None and (
        not isinstance(value, list) or not all(isinstance(x, str) for x in value)
    ):
        raise t.problem("expected a list of host[:port] strings")
    return value


def _nameserver(spec: str) -> str:
    try:
        t.parse_nameserver(spec)  # the resolver's own parser (relay/delivery/mx.py)
    except ValueError as e:
        raise t.problem(f"{spec!r}: {e}") from None
    return spec


class MxSection(Section):
    port: t.Int(1) = 25  # type: ignore[valid-type]
    tls: t.Choice("none", "opportunistic", "starttls") = "opportunistic"  # type: ignore[valid-type]
    verify: t.Bool = False
    nameservers: Annotated[
        tuple[Annotated[str, AfterValidator(_nameserver)], ...] | None,
        BeforeValidator(_nameserver_list),
    ] = None
    dns_timeout: t.Duration = "10s"
    mta_sts: t.Bool = True  # RFC 8461: honour the policies domains publish
    ca_file: ReadablePath = None
    mta_sts_port: t.Int(1) = 443  # type: ignore[valid-type]


class UpstreamSection(Section):
    mode: t.Choice("smarthost", "mx") = "smarthost"  # type: ignore[valid-type]
    helo: t.OptStr = None  # None: hostname
    smarthost: SmarthostSection = SmarthostSection.defaults()  # type: ignore[assignment]
    mx: MxSection = MxSection.defaults()  # type: ignore[assignment]


def _time_zone(name: str) -> str:
    import zoneinfo

    try:
        zoneinfo.ZoneInfo(name)
    except Exception:
        raise t.problem(f"{name!r} is not a known time zone") from None
    return name


def _shaping_rule(value: object) -> Any:
    from relay.config.rules import parse_rule

    if not isinstance(value, Mapping):
        raise t.problem("expected a mapping with match, action and for")
    rule = dict(value)
    if rule.get("for") is not None:  # a duration: 30s, 2h, or seconds
        try:
            rule["for"] = t.duration(rule["for"])
        except ValueError as e:
            raise t.problem(str(e), "for") from None
    try:
        return parse_rule(rule)
    except ValueError as e:
        raise t.problem(str(e)) from None


_RULE_SCHEMA = {
    "type": "object",
    "properties": {
        "match": {"type": "string", "description": "a regular expression on the reply"},
        "action": {"enum": ["suspend", "throttle"]},
        "for": DURATION_SCHEMA,
    },
    "required": ["match", "action"],
}


class ShapingSection(Section):
    window_tz: Annotated[t.Str, AfterValidator(_time_zone)] = "UTC"
    window_length: t.OptDuration = None
    identity_by: t.Choice("sender_domain", "sender") = "sender_domain"  # type: ignore[valid-type]
    # the operator's rules on upstream replies (relay/delivery/shaping.py), parsed
    rules: Annotated[
        tuple[Annotated[Any, PlainValidator(_shaping_rule), WithJsonSchema(_RULE_SCHEMA)], ...]
        | None,
        list_of("rules"),
    ] = None


def _lane_rules(value: object) -> Any:
    from relay.config.rules import parse_lane_rules

    if not isinstance(value, list):
        raise t.problem("expected a list")
    try:  # parsed here so that a bad rule is a config error, not a crash at start
        return parse_lane_rules(value)
    except ValueError as e:
        raise t.problem(
            re.sub(r"^lane rule (\d+)", r"lanes.rules[\1]", str(e)), full=True
        ) from None


class ShareSection(Section):
    share: t.Number(0.0, 1.0) = 1.0  # type: ignore[valid-type]


class LanesSection(Section):
    # README "Lanes": the rules that put a message in a lane (relay/delivery/lanes.py), parsed
    rules: Annotated[
        Any,
        PlainValidator(_lane_rules),
        WithJsonSchema({"type": "array", "items": {"type": "object"}}),
    ] = []
    transactional: ShareSection = {"share": 1.0}  # type: ignore[assignment]
    bulk: ShareSection = {"share": 0.5}  # type: ignore[assignment]
