"""What the 2026-12-04 mutation run of retry/dedup/address/replies/regex_guard found unpinned
(tests/MUTANTS.md, "First set, fourth run"): the exact texts of the errors an operator or a
client reads, the bytes every dedup key hashes (keys are stored in the spool, so a release
that hashed other bytes would let a resubmission after an upgrade through as new mail), text
that was not UTF-8 in the hashed parts, the Idempotency-Key limits, and the boundaries of
the command-character check of a path."""

from __future__ import annotations

import hashlib
import random

import pytest

from relay.delivery.replies import Reply, synthetic
from relay.delivery.retry import next_delay
from relay.mail.address import (
    AddressError,
    check_domain,
    check_local_part,
    check_mailbox,
    parse_path,
)
from relay.mail.regex_guard import check_linear
from relay.spool import dedup

# --- relay/delivery/retry.py: the texts `relay check-config` shows for a bad retry schedule -------


@pytest.mark.parametrize(
    ("failures", "schedule", "min_delay", "message"),
    [
        (1, [], 1.0, "retry schedule must contain at least one step"),
        (1, [60, -1], 1.0, "retry schedule steps must be >= 0 seconds, got -1"),
        (1, [60, float("nan")], 1.0, "retry schedule steps must be >= 0 seconds, got nan"),
        (0, [60], 1.0, "failures must be >= 1, got 0"),
        (1, [60], -0.5, "min_delay must be >= 0, got -0.5"),
    ],
)
def test_retry_argument_errors_say_what_is_wrong(
    failures: int, schedule: list[float], min_delay: float, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        next_delay(failures, schedule, random.Random(1), min_delay)
    assert str(raised.value) == message


# --- relay/delivery/replies.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "enhanced", "message"),
    [
        (99, None, "SMTP reply code must have three digits, got 99"),
        (550, "5.1", "malformed enhanced status code '5.1'"),
        (550, "4.1.1", "enhanced code 4.1.1 does not match 550"),
    ],
)
def test_reply_construction_errors_say_what_is_wrong(
    code: int, enhanced: str | None, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        Reply(code, enhanced, "text")
    assert str(raised.value) == message


def test_from_str_names_what_is_not_a_reply() -> None:
    with pytest.raises(ValueError) as raised:
        Reply.from_str("hello")
    assert str(raised.value) == "not an SMTP reply: 'hello'"
    with pytest.raises(ValueError) as raised:
        synthetic(250, "2.0.0", "fine")
    assert str(raised.value) == "synthetic replies are 4xx or 5xx, got 250"


def test_a_continuation_line_with_only_the_code_adds_no_text() -> None:
    # "250-first\r\n250": the last line carries the code alone; the text is "first", not
    # "first / " plus a placeholder.
    assert Reply.from_str("250-first\r\n250") == Reply(250, None, "first")
    assert Reply.from_str("550-5.1.1 a\r\n550\r\n550 5.1.1 b") == Reply(550, "5.1.1", "a / b")


# --- relay/mail/regex_guard.py: the text `relay check-config` shows for a nested pattern --------


def test_nested_repetition_error_text() -> None:
    with pytest.raises(ValueError) as raised:
        check_linear("(a+)+")
    assert str(raised.value) == (
        "regular expression '(a+)+' nests repetitions (like '(a+)+'); it could take "
        "exponential time on hostile input: rewrite it without the nesting"
    )


# --- relay/spool/dedup.py: the bytes a stored key hashes ----------------------------------------


def _sha40(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(parts)).hexdigest()[:40]


def test_idempotency_key_hashes_a_label_then_each_part_nul_terminated() -> None:
    assert dedup.idempotency_dedup_key("ns", "k-1", "<U@X.test>") == _sha40(
        b"idempotency-key\x00", b"ns\x00", b"k-1\x00", b"u@x.test\x00"
    )
    # 40 hex digits, as the dedup column of the spool stores them
    assert len(dedup.idempotency_dedup_key("ns", "k-1", "u@x.test")) == 40


def test_message_id_key_hashes_each_part_nul_terminated() -> None:
    assert dedup.dedup_key("ns", "<A@Example.COM>", "<U@X.test>") == _sha40(
        b"ns\x00", b"A@example.com\x00", b"u@x.test\x00"
    )


def test_recipient_normalization_strips_only_angle_brackets_and_space() -> None:
    # "X" and "<>" are different things: stripping any other character from the ends would
    # let two recipients share one key, and the second would never be sent.
    assert dedup.normalize_address(" <Xa@b.test> ") == "xa@b.test"
    assert dedup.normalize_address("aX@b.tesX") == "ax@b.tesx"
    assert dedup.dedup_key("ns", "<m@h>", "Xa@b.test") != dedup.dedup_key("ns", "<m@h>", "a@b.test")


# A Message-ID, a recipient or a header that was not UTF-8 reaches the hash as lone
# surrogates (surrogateescape); the key must be the key of the bytes the client sent.
NOT_UTF8 = "\udce9"


def test_keys_of_text_that_was_not_utf8_are_the_keys_of_its_bytes() -> None:
    assert dedup.dedup_key("ns", f"<a{NOT_UTF8}@h>", "u@x.test") == _sha40(
        b"ns\x00", b"a\xe9@h\x00", b"u@x.test\x00"
    )
    assert dedup.idempotency_dedup_key("ns", "k", f"u{NOT_UTF8}@x.test") == _sha40(
        b"idempotency-key\x00", b"ns\x00", b"k\x00", b"u\xe9@x.test\x00"
    )


def test_content_message_id_of_a_header_block_that_is_not_utf8() -> None:
    block = b"X-\xe9: caf\xe9\r\n"
    expected = hashlib.sha256(b"x-\xe9:caf\xe9\r\n\r\nbody").hexdigest()[:32]
    assert dedup.content_message_id(block, b"body", "h.test") == f"<{expected}.content@h.test>"


def test_content_message_id_joins_stray_lines_with_crlf() -> None:
    block = b"stray one\r\nstray two\r\n"
    expected = hashlib.sha256(
        b"\r\n" + b"\x00non-field lines\r\n" + b"stray one\r\nstray two"
    ).hexdigest()[:32]
    assert dedup.content_message_id(block, b"", "h.test") == f"<{expected}.content@h.test>"


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("", False),
        ("k", True),
        ("k" * dedup.IDEMPOTENCY_KEY_MAX, True),
        ("k" * (dedup.IDEMPOTENCY_KEY_MAX + 1), False),
        (" ", True),  # printable ASCII includes the space
        ("~", True),
        ("a\x1fb", False),
        ("a\x7fb", False),
    ],
)
def test_idempotency_key_limits(value: str, valid: bool) -> None:
    assert dedup.valid_idempotency_key(value) is valid


# --- relay/mail/address.py ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        # the command-character check answers first, and names the character
        ("<\u0080a@x.test>", "character U+0080 not allowed in a command"),
        ("<a\u009f@x.test>", "character U+009F not allowed in a command"),
        ("<a\ud800@x.test>", "character U+D800 not allowed in a command"),
        ("<a\udfff@x.test>", "character U+DFFF not allowed in a command"),
        # only spaces may come before "<": no other (Unicode) white space, no letter
        ("\u2003<a@x.test>", "the address must be enclosed in <>"),
        ("X<a@x.test>", "the address must be enclosed in <>"),
    ],
)
def test_path_refusal_texts(arg: str, message: str) -> None:
    with pytest.raises(AddressError) as raised:
        parse_path(arg, null_ok=False)
    assert str(raised.value) == message


@pytest.mark.parametrize("arg", ["<a\u00a0b@x.test>", "<a\ue000@x.test>"])
def test_first_characters_past_the_refused_ranges_are_accepted(arg: str) -> None:
    assert parse_path(arg, null_ok=False).address == arg[1:-1]


def test_source_route_ends_at_its_first_colon() -> None:
    # the mailbox may hold colons of its own (an IPv6 literal)
    assert parse_path("<@a.test:u@[IPv6:::1]>", null_ok=False).address == "u@[IPv6:::1]"


def test_path_length_limit_is_256_octets_with_the_brackets() -> None:
    domain = "b" * 63 + "." + "c" * 63 + "." + "d" * 61
    longest = "a" * 64 + "@" + domain
    assert len(longest) == 254
    assert parse_path(f"<{longest}>", null_ok=False).address == longest
    with pytest.raises(AddressError) as raised:
        parse_path(f"<{longest}d>", null_ok=False)
    assert str(raised.value) == "path longer than 256 octets"


def test_bare_local_part_limits_and_texts() -> None:
    check_local_part("a" * 64)  # 64 octets is the limit, not past it
    with pytest.raises(AddressError) as raised:
        check_local_part("a" * 65)
    assert str(raised.value) == "local part longer than 64 octets"
    with pytest.raises(AddressError) as raised:
        check_local_part("a@b")
    assert str(raised.value) == "not a bare local part"


@pytest.mark.parametrize(
    ("mailbox", "message"),
    [
        ("@x.test", "empty local part"),
        ('"a\x01"@x.test', "character U+0001 not allowed in a local part"),
    ],
)
def test_mailbox_refusal_texts(mailbox: str, message: str) -> None:
    with pytest.raises(AddressError) as raised:
        check_mailbox(mailbox)
    assert str(raised.value) == message


def test_ipv6_literal_takes_hex_digits_colons_and_dots_only() -> None:
    check_domain("[IPv6:a::1]")
    with pytest.raises(AddressError) as raised:
        check_domain("[IPv6:X::1]")
    assert str(raised.value) == "malformed IPv6 address literal"
