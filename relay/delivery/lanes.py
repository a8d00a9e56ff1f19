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

from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol, runtime_checkable

# the rules are config values, parsed with the config (relay/config/rules.py)
from relay.config.rules import LANES, LaneRule, parse_lane_rules
from relay.mail.regex_guard import bounded

__all__ = [
    "DEFAULT_LANE",
    "LANES",
    "LANE_PRIORITY",
    "LaneRule",
    "classify_lane",
    "parse_lane_rules",
]

DEFAULT_LANE: Final = "transactional"
LANE_PRIORITY: Final[Mapping[str, int]] = {"transactional": 0, "bulk": 1}

_BULK_PRECEDENCE: Final = frozenset({"bulk", "list", "junk"})


@runtime_checkable
class _HasItems(Protocol):
    def items(self) -> Iterable[tuple[str, Any]]: ...


HeaderSource = _HasItems | Iterable[tuple[str, Any]]
"""A ``Mapping[str, str]``, an ``email.message.Message`` or ``(name, value)`` pairs."""


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
