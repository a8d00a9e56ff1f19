"""Every regular expression that sees client or upstream input runs in linear time: each is
fed pathological inputs under a time bound (hardening issue, item 0). Operator patterns
(lane and shaping rules) are checked at config load (relay/mail/regex_guard.py)."""

from __future__ import annotations

import re
import time

import pytest

from relay.authenticity import mtasts, unsubscribe
from relay.delivery import dsn, replies, upstream_ids
from relay.delivery.lanes import parse_lane_rules
from relay.delivery.shaping import parse_rule
from relay.feedback import bounces, providers
from relay.inbound import core
from relay.mail import message
from relay.mail.regex_guard import MAX_SUBJECT, bounded, check_linear
from relay.ops import logs

PATTERNS: dict[str, re.Pattern[str] | re.Pattern[bytes]] = {
    "logs._ADDRESS_RE (masking of free text)": logs._ADDRESS_RE,
    "logs._LOGFMT_KEY_RE": logs._LOGFMT_KEY_RE,
    "logs._URL_RE (redaction of URLs in free text)": logs._URL_RE,
    "replies._ENHANCED_RE": replies._ENHANCED_RE,
    "replies._LEADING_ENHANCED_RE": replies._LEADING_ENHANCED_RE,
    "replies._FROM_STR_RE": replies._FROM_STR_RE,
    "replies._POLICY_TEXT_RE": replies._POLICY_TEXT_RE,
    "replies._SENDER_TEXT_RE": replies._SENDER_TEXT_RE,
    "replies._THROTTLE_TEXT_RE": replies._THROTTLE_TEXT_RE,
    "dsn._ENHANCED": dsn._ENHANCED,
    "message._BARE": message._BARE,
    "inbound._HAS_ENHANCED": core._HAS_ENHANCED,
    # feedback from outside: bounce texts, upstream replies, unsubscribe subjects
    **{f"feedback.bounces.{k}": v for k, v in bounces.PATTERNS.items()},
    "feedback.bounces._BOUNDARY_PARAM": bounces._BOUNDARY_PARAM,
    "feedback.bounces._DASH_LINE": bounces._DASH_LINE,
    "feedback.bounces._BOUNDARY_2231": bounces._BOUNDARY_2231,
    **{f"upstream_ids.{name}": pat for name, pat, _ in upstream_ids.PATTERNS},
    "unsubscribe._SUBJECT": unsubscribe._SUBJECT,
    "providers._STATUS_IN_TEXT": providers._STATUS_IN_TEXT,
    "mtasts._MX_PATTERN_RE": mtasts._MX_PATTERN_RE,
    "mtasts._EXT_VALUE_RE": mtasts._EXT_VALUE_RE,
}

N = 50_000
HOSTILE = [
    "a" * N,
    "a." * (N // 2),
    "1." * (N // 2),
    "5.5" * (N // 3),
    "a@" + "a-" * (N // 2) + "!",
    "a" * N + "@",
    " " * N + "x",
    "\r" * N + "x",
    "[TS" * (N // 3),
    "(S" * (N // 2),
    "too many " * (N // 9),
    "x@[" + "1" * N,
    "-" * N + "@x",
    "a:/" * (N // 3),
    "a://" + "b" * N,
]


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_is_linear_on_hostile_input(name: str) -> None:
    pattern = PATTERNS[name]
    worst = 0.0
    for text in HOSTILE:
        subject: str | bytes = text.encode() if isinstance(pattern.pattern, bytes) else text
        started = time.process_time()
        pattern.sub(type(subject)(), subject)  # type: ignore[call-overload]
        worst = max(worst, time.process_time() - started)
    # 50 kB each: a linear pattern takes a few ms; the old masking pattern took minutes.
    assert worst < 0.5, (name, worst)


@pytest.mark.parametrize(
    "pattern",
    [
        r"(a+)+b",
        r"(\w*\s?)*x",
        r"(a|a)*",
        r"(x+x+)+y",
        r"([a-z]+\.)+com",
        r"(?=(a+)+b)",
        r"(?!(a+)+b)x",
        r"(?>(a+)+b)",
        r"(a+?)+b",
        r"(a{1,20})+",
        r"(a*)*?b",
        r"x|(a+)+b",
        r"(?:(?:a+)+)",
    ],
)
def test_nested_repetition_is_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match="nests repetitions"):
        check_linear(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^foo.*bar",
        r"rate[ -]?limit",
        r"(?:TS|TSS)\d+",
        r"(ab){2,5}",
        r"urgent|password reset",
        r"\[TS0[1-4]\]",
        r"(?>a+)+",
        r"(a{1,10})+",
        r"a++b",
        r"(?=ab+)c",
        r"(?:x)(?:y+)",
    ],
)
def test_ordinary_patterns_are_accepted(pattern: str) -> None:
    check_linear(pattern)


def test_lane_and_shaping_rules_refuse_nested_repetition_at_load() -> None:
    with pytest.raises(ValueError, match=r"lane rule 0: key 'header_value': .*nests"):
        parse_lane_rules([{"header": "Subject", "header_value": "(a+)+$", "lane": "bulk"}])
    with pytest.raises(ValueError, match=r"'match': .*nests"):
        parse_rule({"match": "(x*)*y", "action": "throttle"})


def test_subject_is_capped() -> None:
    assert bounded("x" * (MAX_SUBJECT + 10)) == "x" * MAX_SUBJECT
    assert bounded("x" * MAX_SUBJECT) == "x" * MAX_SUBJECT
    assert bounded("short") == "short"


# Edge cases the main tables did not pin down, each written against a surviving mutant
# (tests/MUTANTS.md; until issue 28 in tests/test_mutants_core_more.py).
# --- relay/mail/regex_guard.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [
        "(?:a{10})+",  # an inner count of 10 is bounded
        "(?:a+)++",  # a possessive repetition never backtracks: it is not "unbounded"
        "(?:a|b)++",
    ],
)
def test_check_linear_accepts(pattern: str) -> None:
    check_linear(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        "(?:a{11})+",  # an inner count above 10 counts as unbounded
        "(?:(?:a+)+)++",  # nesting inside a possessive repetition is still found
        "(?:(?:b|a+){2})*",  # an unbounded repetition inside a branch inside a '*'
        "(?:(?=a+)b)*",  # an unbounded repetition inside a lookahead inside a '*'
    ],
)
def test_check_linear_refuses(pattern: str) -> None:
    with pytest.raises(ValueError, match="nests repetitions"):
        check_linear(pattern)


# What the 2026-12-04 mutation run of retry/dedup/address/replies/regex_guard found unpinned
# (tests/MUTANTS.md, "First set, fourth run"; until issue 28 in
# tests/test_mutants_first_set.py): the exact texts of the errors an operator or a client
# reads, the bytes every dedup key hashes (keys are stored in the spool, so a release that
# hashed other bytes would let a resubmission after an upgrade through as new mail), text that
# was not UTF-8 in the hashed parts, the Idempotency-Key limits, and the boundaries of the
# command-character check of a path.
# --- relay/mail/regex_guard.py: the text `relay check-config` shows for a nested pattern --------


def test_nested_repetition_error_text() -> None:
    with pytest.raises(ValueError) as raised:
        check_linear("(a+)+")
    assert str(raised.value) == (
        "regular expression '(a+)+' nests repetitions (like '(a+)+'); it could take "
        "exponential time on hostile input: rewrite it without the nesting"
    )
