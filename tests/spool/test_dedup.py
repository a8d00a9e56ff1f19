"""Pure tests of relay/spool/dedup.py (dedup keys, Message-ID normalization, content Message-IDs).
(relay/mail/message.py's line endings, header block and trace header, once tested here too, are
in tests/mail/test_message.py.)"""

from __future__ import annotations

import hashlib
import re

import pytest

from relay.mail.message import TRACE_HEADERS
from relay.spool import dedup

# --- Message-ID and address normalization ---------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("<abc@example.com>", "abc@example.com"),
        ("abc@example.com", "abc@example.com"),
        ("  <abc@example.com>  ", "abc@example.com"),
        ("< abc@example.com >", "abc@example.com"),
        # the domain is case-insensitive, the local part is not
        ("<ABC@Example.COM>", "ABC@example.com"),
        ("<Abc.Def@MAIL.Example.Org>", "Abc.Def@mail.example.org"),
        # trailing comment after the angle brackets is dropped
        ("<x@y.example> (sent by cron)", "x@y.example"),
        # the last "@" separates the domain
        ('<"a@b"@Host.Example>', '"a@b"@host.example'),
        # no "@": kept as is (trimmed)
        ("<no-at-sign>", "no-at-sign"),
        ("  bare-token ", "bare-token"),
        # an empty id normalizes to the empty string (the relay then derives one)
        ("<>", ""),
        ("   ", ""),
    ],
)
def test_normalize_message_id(raw: str, expected: str) -> None:
    assert dedup.normalize_message_id(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("user@example.org", "user@example.org"),
        ("User@Example.ORG", "user@example.org"),
        ("<User@Example.ORG>", "user@example.org"),
        ("  <a@b.example>  ", "a@b.example"),
    ],
)
def test_normalize_address(raw: str, expected: str) -> None:
    assert dedup.normalize_address(raw) == expected


# --- dedup keys --------------------------------------------------------------------------------

NS = "listener:127.0.0.1:2525"


def test_dedup_key_shape_and_golden_value() -> None:
    key = dedup.dedup_key(NS, "<Abc@Example.COM>", "User@Example.org")
    assert re.fullmatch(r"[0-9a-f]{40}", key)
    # Keys are stored in the spool and compared across restarts and upgrades: a change in
    # the derivation would silently let every resubmission through once. Pin it.
    assert key == "37422c0e4df0e8b1b56515484b2ae597299cb23b"
    # ... and it is the documented derivation: sha256 over the normalized parts, NUL-ended
    h = hashlib.sha256(f"{NS}\x00Abc@example.com\x00user@example.org\x00".encode())
    assert key == h.hexdigest()[:40]


def test_dedup_key_is_stable_across_equivalent_spellings() -> None:
    base = dedup.dedup_key(NS, "<abc@example.com>", "user@example.org")
    for mid in ("abc@example.com", " <abc@EXAMPLE.com> ", "<abc@Example.Com> (x)"):
        for rcpt in ("user@example.org", "USER@Example.Org", "<user@example.org>"):
            assert dedup.dedup_key(NS, mid, rcpt) == base, (mid, rcpt)
    # repeated calls give the same key (no salt, no time)
    assert dedup.dedup_key(NS, "<abc@example.com>", "user@example.org") == base


def test_dedup_key_separates_its_parts() -> None:
    base = dedup.dedup_key(NS, "<abc@example.com>", "user@example.org")
    different = [
        dedup.dedup_key("listener:127.0.0.1:2526", "<abc@example.com>", "user@example.org"),
        dedup.dedup_key("user:alice", "<abc@example.com>", "user@example.org"),
        dedup.dedup_key(NS, "<ABC@example.com>", "user@example.org"),  # local part case
        dedup.dedup_key(NS, "<abd@example.com>", "user@example.org"),
        dedup.dedup_key(NS, "<abc@example.com>", "user2@example.org"),
    ]
    assert base not in different
    assert len(set(different)) == len(different)
    # the NUL separator keeps ("ab", "c") and ("a", "bc") apart
    assert dedup.dedup_key("ns", "ab", "c@x.example") != dedup.dedup_key("nsa", "b", "c@x.example")


# --- content Message-ID ---------------------------------------------------------------------

HEAD = (
    b"From: cron@host.example\r\n"
    b"To: ops@example.org\r\n"
    b"Subject: nightly report\r\n"
    b"Date: Mon, 01 Jan 2024 03:00:00 +0000\r\n"
)
BODY = b"all good\r\n"


def test_content_message_id_shape_and_stability() -> None:
    mid = dedup.content_message_id(HEAD, BODY, "relay.test")
    assert re.fullmatch(r"<[0-9a-f]{32}\.content@relay\.test>", mid)
    assert dedup.content_message_id(HEAD, BODY, "relay.test") == mid
    assert dedup.normalize_message_id(mid) == mid[1:-1]


def test_content_message_id_ignores_trace_headers() -> None:
    base = dedup.content_message_id(HEAD, BODY, "relay.test")
    traced = (
        b"Received: from a (a [10.0.0.1]) by b; Mon, 01 Jan 2024 03:00:01 +0000\r\n"
        b"Return-Path: <cron@host.example>\r\n"
        + HEAD
        + b"X-Received: by 10.0.0.2 with SMTP id x\r\n"
        b"Delivered-To: ops@example.org\r\n"
        b"X-Originating-IP: [10.1.2.3]\r\n"
    )
    assert dedup.content_message_id(traced, BODY, "relay.test") == base
    # a second hop's Received header (folded) is ignored too
    refolded = b"Received: from c\r\n\tby d with ESMTP id 1;\r\n\tMon, 1 Jan 2024\r\n" + HEAD
    assert dedup.content_message_id(refolded, BODY, "relay.test") == base
    assert {"received", "return-path"} <= TRACE_HEADERS
    assert "date" not in TRACE_HEADERS


def test_content_message_id_depends_on_date_headers_and_body() -> None:
    base = dedup.content_message_id(HEAD, BODY, "relay.test")
    new_date = HEAD.replace(b"03:00:00", b"03:00:01")
    assert dedup.content_message_id(new_date, BODY, "relay.test") != base
    new_subject = HEAD.replace(b"nightly", b"weekly")
    assert dedup.content_message_id(new_subject, BODY, "relay.test") != base
    assert dedup.content_message_id(HEAD, BODY + b"!", "relay.test") != base
    assert dedup.content_message_id(HEAD, b"", "relay.test") != base
    # the body is not confused with a header: moving a line across the boundary matters
    assert dedup.content_message_id(
        HEAD + b"X-A: 1\r\n", BODY, "relay.test"
    ) != dedup.content_message_id(HEAD, b"X-A: 1\r\n" + BODY, "relay.test")
    # header names compare case-insensitively, as they do in RFC 5322
    assert (
        dedup.content_message_id(HEAD.replace(b"Subject:", b"SUBJECT:"), BODY, "relay.test") == base
    )
    # the relay's hostname is part of the id (and so of the namespace of derived ids)
    other = dedup.content_message_id(HEAD, BODY, "other.test")
    assert other != base and other.endswith("@other.test>")
    assert other[1:33] == base[1:33]


def test_content_message_id_of_a_well_formed_message_is_pinned() -> None:
    # derived ids are dedup keys stored in the spool: a change lets resubmissions through
    assert (
        dedup.content_message_id(HEAD, BODY, "relay.test")
        == "<c1471c4df302ade3d9fa3e6c3537bdbe.content@relay.test>"
    )


@pytest.mark.parametrize(
    ("one", "two"),
    [
        # no empty line at all: the whole message is the "header block"
        (b"disk full on host1\r\n", b"disk full on host2\r\n"),
        # lines among the fields that are not fields (no colon, a space in the name)
        (HEAD + b"free text one\r\n", HEAD + b"free text two\r\n"),
        (b"Bad Name: one\r\n" + HEAD, b"Bad Name: two\r\n" + HEAD),
        # a continuation line with no field before it
        (b" orphan one\r\n" + HEAD, b" orphan two\r\n" + HEAD),
    ],
)
def test_content_message_id_covers_every_line_of_the_header_block(one: bytes, two: bytes) -> None:
    """Two different messages must never share a derived Message-ID: the second would be
    answered 250 and dropped as a duplicate."""
    assert dedup.content_message_id(one, b"", "relay.test") != dedup.content_message_id(
        two, b"", "relay.test"
    )
    assert dedup.content_message_id(one, b"", "relay.test") == dedup.content_message_id(
        one, b"", "relay.test"
    )


# Edge cases the main tables did not pin down, each written against a surviving mutant
# (tests/MUTANTS.md; until issue 28 in tests/test_mutants_core_more.py).
# --- relay/spool/dedup.py -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # No leading "<": a ">" inside is kept as is (only "<...>" is unwrapped).
        ("ab>c@Example.COM", "ab>c@example.com"),
        # Unwrapping stops at the first ">".
        ("<a@X.com> <b@y>", "a@x.com"),
        # Only the part after the last "@" is the domain: earlier text keeps its case.
        ("x@Y@Example.COM", "x@Y@example.com"),
    ],
)
def test_normalize_message_id_edge_cases(raw: str, expected: str) -> None:
    assert dedup.normalize_message_id(raw) == expected


def test_content_message_id_hashes_stray_lines_with_a_fixed_label() -> None:
    # The id must stay stable across releases (it is the dedup key of a resubmission), so
    # the exact bytes hashed are pinned here.
    expected = hashlib.sha256(
        b"subject:hi\r\n\r\nbody\x00non-field lines\r\nstray line"
    ).hexdigest()[:32]
    got = dedup.content_message_id(b"Subject: hi\r\nstray line", b"body", "r.example")
    assert got == f"<{expected}.content@r.example>"


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        # An empty line does not end the scan: the line after it is still reported.
        (b"\r\nstray", [b"stray"]),
        (b"A: 1\r\n\r\nstray", [b"stray"]),
        # A continuation line is skipped, and the scan goes on after it.
        (b"A: 1\r\n folded\r\nstray", [b"stray"]),
    ],
)
def test_non_field_lines_scan_the_whole_block(block: bytes, expected: list[bytes]) -> None:
    assert dedup._non_field_lines(block) == expected


# What the 2026-12-04 mutation run of retry/dedup/address/replies/regex_guard found unpinned
# (tests/MUTANTS.md, "First set, fourth run"; until issue 28 in
# tests/test_mutants_first_set.py): the exact texts of the errors an operator or a client
# reads, the bytes every dedup key hashes (keys are stored in the spool, so a release that
# hashed other bytes would let a resubmission after an upgrade through as new mail), text that
# was not UTF-8 in the hashed parts, the Idempotency-Key limits, and the boundaries of the
# command-character check of a path.
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
