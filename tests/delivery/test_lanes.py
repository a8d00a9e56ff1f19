"""Tests for relay.delivery.lanes: rule parsing, first-match classification, built-in defaults."""

from __future__ import annotations

import email
import re
from collections.abc import Mapping

import pytest

from relay.delivery.lanes import LANE_PRIORITY, LANES, LaneRule, classify_lane, parse_lane_rules

RULES = parse_lane_rules(
    [
        {"lane": "bulk", "listener": "newsletter"},
        {"lane": "transactional", "header": "X-Priority-Mail"},
        {"lane": "bulk", "sender": r"^(news|promo)@"},
        {"lane": "bulk", "sender_domain": "Marketing.Example.COM"},
        {"lane": "bulk", "header": "X-Campaign", "header_value": r"^spring-\d+$"},
    ]
)


def classify(
    sender: str = "app@example.com",
    headers: Mapping[str, str] | list[tuple[str, str]] | None = None,
    listener: str = "local",
    rules: tuple[LaneRule, ...] = RULES,
) -> str:
    return classify_lane(rules, sender=sender, headers=headers or {}, listener=listener)


def test_priority_table() -> None:
    assert LANE_PRIORITY == {"transactional": 0, "bulk": 1}
    assert set(LANES) == set(LANE_PRIORITY)


@pytest.mark.parametrize(
    ("kwargs", "lane"),
    [
        ({}, "transactional"),
        ({"listener": "newsletter"}, "bulk"),
        ({"sender": "news@example.com"}, "bulk"),
        ({"sender": "NEWS@example.com"}, "bulk"),
        ({"sender": "mynews@example.com"}, "transactional"),
        ({"sender": "a@marketing.example.com"}, "bulk"),
        ({"sender": "<a@MARKETING.example.com>"}, "bulk"),
        ({"sender": "a@sub.marketing.example.com"}, "transactional"),
        ({"sender": ""}, "transactional"),
        ({"headers": {"x-campaign": "Spring-2026"}}, "bulk"),
        ({"headers": {"X-Campaign": "autumn-2026"}}, "transactional"),
        # first match wins: the header rule (index 1) precedes the sender rule (index 2)
        ({"sender": "news@example.com", "headers": {"X-Priority-Mail": "1"}}, "transactional"),
        # rules beat the defaults
        ({"headers": {"Precedence": "bulk", "x-priority-mail": "yes"}}, "transactional"),
    ],
)
def test_rules(kwargs: dict[str, object], lane: str) -> None:
    assert classify(**kwargs) == lane  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("headers", "lane"),
    [
        ({"Precedence": "bulk"}, "bulk"),
        ({"precedence": " List "}, "bulk"),
        ({"PRECEDENCE": "junk"}, "bulk"),
        ({"Precedence": "first-class"}, "transactional"),
        ({"List-Unsubscribe": "<mailto:u@example.com>"}, "bulk"),
        ({"list-unsubscribe": ""}, "bulk"),
        ({"Subject": "hello"}, "transactional"),
        ({}, "transactional"),
    ],
)
def test_defaults(headers: dict[str, str], lane: str) -> None:
    assert classify(headers=headers, rules=()) == lane


def test_header_pairs_any_occurrence() -> None:
    pairs = [("X-Campaign", "other"), ("x-campaign", "spring-1")]
    assert classify(headers=pairs) == "bulk"


def test_email_message_headers() -> None:
    msg = email.message_from_string(
        "From: a@example.com\nPrecedence: list\nX-Campaign: spring-7\n\nbody\n"
    )
    assert classify_lane(RULES, sender="x@example.com", headers=msg, listener="l") == "bulk"
    plain = email.message_from_string("From: a@example.com\nSubject: hi\n\nbody\n")
    assert classify_lane((), sender="", headers=plain, listener="l") == "transactional"


def test_catch_all_rule() -> None:
    rules = parse_lane_rules([{"lane": "bulk"}])
    assert classify(rules=rules) == "bulk"


def test_parse_none_and_empty() -> None:
    assert parse_lane_rules(None) == ()
    assert parse_lane_rules([]) == ()


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([{"lane": "bulk"}, {"lane": "bulk", "sendr": "x"}], "lane rule 1: unknown key 'sendr'"),
        ([{"lane": "fast"}], "lane rule 0: key 'lane'"),
        ([{"sender": "x"}], "lane rule 0: key 'lane'"),
        ([{"lane": "bulk", "sender": "("}], "lane rule 0: key 'sender': invalid regular"),
        ([{"lane": "bulk", "header_value": "x"}], "lane rule 0: key 'header_value' requires"),
        ([{"lane": "bulk", "listener": 5}], "lane rule 0: key 'listener' must be"),
        ([{"lane": "bulk", "sender_domain": " "}], "lane rule 0: key 'sender_domain' must be"),
        ([{"lane": "bulk"}, {"lane": "bulk"}, "bulk"], "lane rule 2: expected a mapping"),
    ],
)
def test_parse_errors(items: list[object], fragment: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_lane_rules(items)  # type: ignore[arg-type]
    assert fragment in str(excinfo.value)


def test_lane_rule_validation() -> None:
    with pytest.raises(ValueError):
        LaneRule(lane="nope")
    with pytest.raises(ValueError):
        LaneRule(lane="bulk", header_value=re.compile("x"))
