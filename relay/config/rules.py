"""The operator's rules the config parses (pure): lane rules (`lanes.rules`: which lane a
message goes in, relay/delivery/lanes.py classifies with them) and shaping rules
(`shaping.rules`: what an upstream's reply text does to its destination,
relay/delivery/shaping.py matches them). Values of the config, so they live here; the
delivery side imports them.

Rules:
- A regular expression from the config is checked to run in linear time before it is
  compiled (relay/mail/regex_guard.py); a bad one is a ValueError naming the rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from relay.mail.regex_guard import check_linear

LANES: Final[tuple[str, ...]] = ("transactional", "bulk")
_LANE_RULE_KEYS: Final = ("lane", "sender", "sender_domain", "header", "header_value", "listener")


# --- lane rules (lanes.rules) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaneRule:
    """One classification rule; ``None`` conditions are not checked."""

    lane: str
    sender: re.Pattern[str] | None = None
    sender_domain: str | None = None
    header: str | None = None
    header_value: re.Pattern[str] | None = None
    listener: str | None = None

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise ValueError(f"unknown lane {self.lane!r} (expected one of {', '.join(LANES)})")
        if self.header_value is not None and self.header is None:
            raise ValueError("'header_value' requires 'header'")


def _str_value(index: int, item: Mapping[str, object], key: str) -> str | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"lane rule {index}: key {key!r} must be a non-empty string")
    return value.strip()


def _regex_value(index: int, item: Mapping[str, object], key: str) -> re.Pattern[str] | None:
    text = _str_value(index, item, key)
    if text is None:
        return None
    try:
        check_linear(text)
        return re.compile(text, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(
            f"lane rule {index}: key {key!r}: invalid regular expression {text!r}: {exc}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"lane rule {index}: key {key!r}: {exc}") from None


def parse_lane_rules(items: Iterable[Mapping[str, object]] | None) -> tuple[LaneRule, ...]:
    """Build rules from config mappings; ``ValueError`` names the item index and key."""
    if items is None:
        return ()
    rules: list[LaneRule] = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"lane rule {index}: expected a mapping, got {type(item).__name__}")
        for key in item:
            if key not in _LANE_RULE_KEYS:
                raise ValueError(
                    f"lane rule {index}: unknown key {key!r}"
                    f" (allowed: {', '.join(_LANE_RULE_KEYS)})"
                )
        lane = item.get("lane")
        if not isinstance(lane, str) or lane not in LANES:
            raise ValueError(
                f"lane rule {index}: key 'lane' must be one of {', '.join(LANES)}, got {lane!r}"
            )
        header = _str_value(index, item, "header")
        header_value = _regex_value(index, item, "header_value")
        if header_value is not None and header is None:
            raise ValueError(f"lane rule {index}: key 'header_value' requires key 'header'")
        domain = _str_value(index, item, "sender_domain")
        rules.append(
            LaneRule(
                lane=lane,
                sender=_regex_value(index, item, "sender"),
                sender_domain=None if domain is None else domain.lower().rstrip("."),
                header=header,
                header_value=header_value,
                listener=_str_value(index, item, "listener"),
            )
        )
    return tuple(rules)


# --- shaping rules (shaping.rules) -------------------------------------------------------

RuleAction = Literal["suspend", "throttle"]
_ACTIONS: Final[tuple[RuleAction, ...]] = ("suspend", "throttle")
_RULE_KEYS: Final = frozenset({"match", "action", "for"})


@dataclass(frozen=True, slots=True)
class ShapingRule:
    """Reply-text rule: ``suspend`` the destination or ``throttle`` it for ``duration`` s."""

    pattern: re.Pattern[str]
    action: RuleAction
    duration: float

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"action must be 'suspend' or 'throttle', got {self.action!r}")
        if not (self.duration >= 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be >= 0 seconds, got {self.duration!r}")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE | re.DOTALL)


def parse_rule(mapping: Mapping[str, object]) -> ShapingRule:
    """Build a rule from ``{"match": regex, "action": "suspend"|"throttle", "for": seconds}``.

    ``for`` is required for ``suspend`` and defaults to 0 for ``throttle``.  The regex is
    searched case-insensitively (``.`` also matches newlines of multi-line replies).
    """
    unknown = sorted(set(mapping) - _RULE_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (allowed: action, for, match)")
    match = mapping.get("match")
    if not isinstance(match, str) or not match:
        raise ValueError("'match' must be a non-empty regular expression string")
    try:
        check_linear(match)
        pattern = compile_pattern(match)
    except re.error as exc:
        raise ValueError(f"'match': invalid regular expression {match!r}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"'match': {exc}") from None
    action = mapping.get("action")
    if action == "suspend":
        kind: RuleAction = "suspend"
    elif action == "throttle":
        kind = "throttle"
    else:
        raise ValueError(f"'action' must be 'suspend' or 'throttle', got {action!r}")
    duration = mapping.get("for", None if kind == "suspend" else 0)
    if duration is None:
        raise ValueError("'for' (seconds) is required for action 'suspend'")
    if isinstance(duration, bool) or not isinstance(duration, int | float):
        raise ValueError(f"'for' must be a number of seconds, got {duration!r}")
    if not (duration >= 0 and math.isfinite(duration)):
        raise ValueError(f"'for' must be >= 0 seconds, got {duration!r}")
    return ShapingRule(pattern=pattern, action=kind, duration=float(duration))
