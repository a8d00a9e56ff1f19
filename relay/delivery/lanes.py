"""Delivery lanes: classify each message as "transactional" (default) or "bulk" (pure).

Rules:
- Operator rules are tried in order; the first rule whose conditions ALL match wins.  A
  rule with no conditions matches every message (a catch-all).
- Conditions: ``sender`` (regex searched case-insensitively in the envelope sender),
  ``sender_domain`` (exact, case-insensitive domain of the envelope sender), ``header``
  (header present, name case-insensitive) optionally with ``header_value`` (regex searched
  case-insensitively in any occurrence of that header), ``listener`` (exact listener name).
- When no rule matches, the built-in default applies: ``Precedence: bulk|list|junk`` or
  any ``List-Unsubscribe`` header makes the message "bulk"; everything else is
  "transactional".
- Lower ``LANE_PRIORITY`` is served first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from relay.mail.regex_guard import bounded, check_linear

__all__ = [
    "DEFAULT_LANE",
    "LANES",
    "LANE_PRIORITY",
    "LaneRule",
    "classify_lane",
    "parse_lane_rules",
]

LANES: Final[tuple[str, ...]] = ("transactional", "bulk")
DEFAULT_LANE: Final = "transactional"
LANE_PRIORITY: Final[Mapping[str, int]] = {"transactional": 0, "bulk": 1}

_RULE_KEYS: Final = ("lane", "sender", "sender_domain", "header", "header_value", "listener")
_BULK_PRECEDENCE: Final = frozenset({"bulk", "list", "junk"})


@runtime_checkable
class _HasItems(Protocol):
    def items(self) -> Iterable[tuple[str, Any]]: ...


HeaderSource = _HasItems | Iterable[tuple[str, Any]]
"""A ``Mapping[str, str]``, an ``email.message.Message`` or ``(name, value)`` pairs."""


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
            if key not in _RULE_KEYS:
                raise ValueError(
                    f"lane rule {index}: unknown key {key!r} (allowed: {', '.join(_RULE_KEYS)})"
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


def _header_pairs(headers: HeaderSource) -> list[tuple[str, str]]:
    # a list (the inbound path) skips the Protocol check: isinstance() against a
    # runtime_checkable Protocol inspects the class's attributes on every call
    pairs = (
        headers
        if isinstance(headers, list)
        else (headers.items() if isinstance(headers, _HasItems) else headers)
    )
    return [(str(name).lower(), str(value)) for name, value in pairs]


def _sender_domain(sender: str) -> str:
    address = sender.strip().strip("<>")
    _, at, domain = address.rpartition("@")
    return domain.lower().rstrip(".") if at else ""


def _rule_matches(
    rule: LaneRule, sender: str, domain: str, headers: list[tuple[str, str]], listener: str
) -> bool:
    if rule.listener is not None and rule.listener != listener:
        return False
    if rule.sender_domain is not None and rule.sender_domain != domain:
        return False
    if rule.sender is not None and not rule.sender.search(bounded(sender)):
        return False
    if rule.header is not None:
        wanted = rule.header.lower()
        values = [value for name, value in headers if name == wanted]
        if not values:
            return False
        if rule.header_value is not None:
            pattern = rule.header_value
            return any(pattern.search(bounded(value)) for value in values)
    return True


def _default_lane(headers: list[tuple[str, str]]) -> str:
    for name, value in headers:
        if name == "list-unsubscribe":
            return "bulk"
        if name == "precedence" and value.strip().lower() in _BULK_PRECEDENCE:
            return "bulk"
    return DEFAULT_LANE


def classify_lane(
    rules: Iterable[LaneRule], *, sender: str, headers: HeaderSource, listener: str
) -> str:
    """The lane for a message: first matching rule, else the built-in default."""
    pairs = _header_pairs(headers)
    domain = _sender_domain(sender)
    for rule in rules:
        if _rule_matches(rule, sender, domain, pairs, listener):
            return rule.lane
    return _default_lane(pairs)
