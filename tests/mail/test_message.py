"""relay/mail/message.py: line endings, the header block and header parsing, and the trace header
(Received) that cannot be used to inject headers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.mail.message import (
    header,
    normalize_line_endings,
    parse_headers,
    received_header,
    split_message,
)

# --- line endings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", b""),
        (b"no line ending", b"no line ending"),
        (b"a\r\nb\r\n", b"a\r\nb\r\n"),
        (b"a\nb\n", b"a\r\nb\r\n"),
        (b"a\rb\r", b"a\r\nb\r\n"),
        (b"a\r\r\nb", b"a\r\n\r\nb"),
        (b"a\n\rb", b"a\r\n\r\nb"),
        (b"a\n\nb", b"a\r\n\r\nb"),
        (b"a\r\n\nb", b"a\r\n\r\nb"),
        # the smuggling shapes: a bare LF/CR before the dot is just a line ending
        (b"x\n.\r\nMAIL FROM:<e@x>\r\n", b"x\r\n.\r\nMAIL FROM:<e@x>\r\n"),
        (b"x\r\n.\nRCPT TO:<v@y>\r\n", b"x\r\n.\r\nRCPT TO:<v@y>\r\n"),
        (b"x\r.\rDATA\r\n", b"x\r\n.\r\nDATA\r\n"),
    ],
)
def test_normalize_line_endings_table(raw: bytes, expected: bytes) -> None:
    assert normalize_line_endings(raw) == expected


def _bare_endings(data: bytes) -> int:
    stripped = data.replace(b"\r\n", b"")
    return stripped.count(b"\r") + stripped.count(b"\n")


@given(
    st.lists(
        st.sampled_from([b"a", b"b.", b".", b"\r", b"\n", b"\r\n", b" ", b"\xff"]), max_size=40
    )
)
def test_normalize_line_endings_properties(parts: list[bytes]) -> None:
    raw = b"".join(parts)
    out = normalize_line_endings(raw)
    assert _bare_endings(out) == 0
    assert normalize_line_endings(out) == out  # idempotent
    # only line endings change: the other bytes are kept, in order
    assert out.replace(b"\r", b"").replace(b"\n", b"") == raw.replace(b"\r", b"").replace(
        b"\n", b""
    )
    if _bare_endings(raw) == 0:
        assert out == raw  # CRLF-only input is returned untouched


# --- header block and header parsing ------------------------------------------------------------


def test_split_message() -> None:
    assert split_message(b"A: 1\r\nB: 2\r\n\r\nbody\r\n") == (b"A: 1\r\nB: 2\r\n", b"body\r\n")
    # only the first empty line separates
    assert split_message(b"A: 1\r\n\r\nx\r\n\r\ny\r\n") == (b"A: 1\r\n", b"x\r\n\r\ny\r\n")
    # no empty line: everything is header
    assert split_message(b"A: 1\r\nB: 2\r\n") == (b"A: 1\r\nB: 2\r\n", b"")
    # starts with the empty line: no headers at all
    assert split_message(b"\r\nbody only\r\n") == (b"", b"body only\r\n")
    assert split_message(b"A: 1\r\n\r\n") == (b"A: 1\r\n", b"")


def test_parse_headers_unfolds_continuation_lines() -> None:
    block = (
        b"Subject: a long\r\n"
        b"  subject line\r\n"
        b"\tcontinued with a tab\r\n"
        b"To: x@example.org,\r\n"
        b" y@example.org\r\n"
        b"Message-ID:<id-1@example.com>\r\n"
        b"X-Empty:\r\n"
        b"X-Colon: a: b: c\r\n"
    )
    assert parse_headers(block) == [
        ("Subject", "a long subject line continued with a tab"),
        ("To", "x@example.org, y@example.org"),
        ("Message-ID", "<id-1@example.com>"),
        ("X-Empty", ""),
        ("X-Colon", "a: b: c"),
    ]


def test_parse_headers_skips_garbage_and_keeps_undecodable_bytes() -> None:
    block = (
        b" leading continuation with nothing before it\r\n"
        b"not a header line\r\n"
        b"Bad Name: has a space in its name\r\n"
        b"Subject: caf\xe9 latin-1\r\n"
        b"X-Utf8: caf\xc3\xa9\r\n"
    )
    got = parse_headers(block)
    assert [n for n, _v in got] == ["Subject", "X-Utf8"]
    assert got[0][1].encode("utf-8", errors="surrogateescape") == b"caf\xe9 latin-1"
    assert got[1][1] == "café"


def test_header_lookup_is_case_insensitive_and_first_wins() -> None:
    hs = parse_headers(b"message-id: <a@x>\r\nMessage-ID: <b@x>\r\nSubject: s\r\n")
    assert header(hs, "Message-ID") == "<a@x>"
    assert header(hs, "SUBJECT") == "s"
    assert header(hs, "Date") is None


# --- the trace header ------------------------------------------------------------------------


def test_received_header_shape() -> None:
    h = received_header(
        helo="client.test",
        peer_ip="127.0.0.1",
        hostname="relay.test",
        queue_id="0123456789BCDFGH",
        recipient="user@example.org",
        protocol="ESMTP",
        now=1_700_000_000,
    )
    assert h == (
        b"Received: from client.test ([127.0.0.1])\r\n"
        b"\tby relay.test (relay) with ESMTP id 0123456789BCDFGH\r\n"
        b"\tfor <user@example.org>; Tue, 14 Nov 2023 22:13:20 +0000\r\n"
    )
    assert all(len(line) <= 78 for line in h.split(b"\r\n"))
    assert parse_headers(h)[0][0] == "Received"
    # without a single recipient there is no "for" clause
    h2 = received_header(
        helo="c",
        peer_ip="::1",
        hostname="relay.test",
        queue_id="Q",
        recipient=None,
        protocol="SMTP",
        now=0,
    )
    assert b"for <" not in h2 and h2.endswith(b"; Thu, 01 Jan 1970 00:00:00 +0000\r\n")


def test_received_header_cannot_be_used_to_inject_headers() -> None:
    h = received_header(
        helo="evil\r\nX-Injected: 1\r\n\r\nbody",
        peer_ip="127.0.0.1",
        hostname="relay.test",
        queue_id="Q",
        recipient=None,
        protocol="ESMTP",
        now=0,
    )
    assert b"X-Injected: 1\r\n" not in h
    lines = h.split(b"\r\n")
    assert lines[-1] == b""
    assert lines[0].startswith(b"Received: from ")
    assert all(line.startswith(b"\t") for line in lines[1:-1])
    assert _bare_endings(h) == 0


def test_received_header_keeps_a_utf8_recipient_and_says_utf8smtp() -> None:
    h = received_header(
        helo="client.test",
        peer_ip="127.0.0.1",
        hostname="relay.test",
        queue_id="Q",
        recipient="josé@exämple.org",
        protocol="UTF8SMTPS",
        now=0,
    )
    assert "for <josé@exämple.org>".encode() in h  # was "jos?@ex?mple.org"
    assert b"with UTF8SMTPS id Q" in h
