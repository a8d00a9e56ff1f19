"""relay/inbound/dataflow.py: the streamed DATA parser gives, for any split of the input into
blocks, exactly what the whole-buffer path gave (aiosmtpd's line-by-line DATA, then
un-dot-stuffing and line-ending normalisation), and finds the end of the data where RFC 5321
says, never at a bare-LF/CR "." line."""

from __future__ import annotations

import itertools
import re
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.inbound.dataflow import DataParser, DataState, Feed
from relay.mail import message
from relay.mail.message import normalize_line_endings


def reference(stream: bytes) -> tuple[bytes, bytes] | None:
    """The old path: CRLF lines until a line that is exactly ".", dots removed, then bare
    CR/LF normalised and NULs removed. None when the data never ends."""
    lines = []
    pos = 0
    while True:
        i = stream.find(b"\r\n", pos)
        if i < 0:
            return None
        line = stream[pos : i + 2]
        pos = i + 2
        if line == b".\r\n":
            break
        lines.append(line[1:] if line.startswith(b".") else line)
    # NULs go first: CR NUL LF is one line ending (CRLF), not a bare CR and a bare LF (two
    # line endings, which would put an empty line, the end of the header block, mid-header)
    data = normalize_line_endings(b"".join(lines).replace(b"\x00", b""))
    return data, stream[pos:]


def run(stream: bytes, cuts: list[int], max_size: int = 0, max_line: int = 10**9):
    p = DataParser(max_size, max_line)
    out, rest, done = b"", b"", False
    edges = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for a, b in itertools.pairwise(edges):
        f = p.feed(stream[a:b])
        out += f.data
        if f.done:
            rest, done = f.rest + stream[b:], True
            break
    return p, out, rest, done


_pieces = st.lists(
    st.sampled_from(
        [
            b"a",
            b"xyz",
            b".",
            b"..",
            b"\r\n",
            b"\n",
            b"\r",
            b"\x00",
            b"\r\n.\r\n",
            b"\n.\n",
            b"\r.\r",
            b"\n.\r\n",
            b"\r\n.\n",
            b".\r\n",
            b"QUIT\r\n",
            b"\xc3\xa9",
        ]
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(pieces=_pieces, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_gives_the_whole_buffer_result(pieces: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(pieces)
    expected = reference(stream)
    _p, out, rest, done = run(stream, cuts)
    if expected is None:
        assert not done
        return
    assert done
    data, after = expected
    assert (out, rest) == (data, after)


@settings(max_examples=400, deadline=None)
@given(pieces=_pieces, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_gives_the_whole_buffer_result_dots_found_one_by_one(
    pieces: list[bytes], cuts: list[int]
) -> None:
    # as above, with the dot-by-dot search of long buffers (relay/mail/message.py `_SHORT`,
    # its find_dot_line) on every buffer
    with mock.patch.object(message, "_SHORT", 0):
        test_any_split_gives_the_whole_buffer_result.hypothesis.inner_test(pieces, cuts)


_long_pieces = st.lists(
    st.sampled_from(
        [b"y" * 400, b"y" * 99, b"y", b".", b"\r\n", b"\n", b"\r", b"\x00", b"\r\n.\r\n"]
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(pieces=_long_pieces, cuts=st.lists(st.integers(0, 4000), max_size=8))
def test_longest_line_is_that_of_the_normalised_message(
    pieces: list[bytes], cuts: list[int]
) -> None:
    # `longest` decides whether a message is re-encoded for lines over 998 octets
    # (relay/inbound/longlines.py): exact whenever it is over 998, whatever the blocks and the
    # transparency dots, NULs and bare line ends that change line lengths on the way
    stream = b"".join(pieces) + b"\r\n.\r\n"
    expected = reference(stream)
    assert expected is not None
    p, out, _rest, done = run(stream, cuts)
    assert done and out == expected[0]
    longest = max(map(len, out.split(b"\r\n")))
    if longest > 998:
        assert p.longest == longest
    else:
        assert p.longest <= 998


@pytest.mark.parametrize(
    ("stream", "data", "rest"),
    [
        (b".\r\n", b"", b""),  # an empty message
        (b".\r\nQUIT\r\n", b"", b"QUIT\r\n"),
        (b"a\r\n.\r\nQUIT\r\n", b"a\r\n", b"QUIT\r\n"),
        (b"..\r\n.\r\n", b".\r\n", b""),  # a transparency dot
        (b"a\n.\nb\r\n.\r\n", b"a\r\n.\r\nb\r\n", b""),  # LF.LF does not end it
        (b"a\r.\rb\r\n.\r\n", b"a\r\n.\r\nb\r\n", b""),
        (b"a\r\n.\nb\r\n.\r\n", b"a\r\n\r\nb\r\n", b""),  # line ".\nb": dot removed
        (b"a\n.\r\nb\r\n.\r\n", b"a\r\n.\r\nb\r\n", b""),
        (b"a\x00b\r\n.\r\n", b"ab\r\n", b""),
        (b"S: x\r\x00\nT: y\r\n.\r\n", b"S: x\r\nT: y\r\n", b""),  # CR NUL LF: one CRLF
        (b"\r.\r\x00\n\r\n.\r\n", b"\r\n.\r\n\r\n", b""),  # found by CI's hypothesis run
    ],
)
def test_table(stream: bytes, data: bytes, rest: bytes) -> None:
    for cut in range(len(stream) + 1):
        _p, out, r, done = run(stream, [cut])
        assert done and (out, r) == (data, rest), cut


def test_nul_count() -> None:
    p, out, _r, _d = run(b"a\x00\x00b\r\n.\r\n", [])
    assert out == b"ab\r\n" and p.nul_count == 2


def test_over_size_is_reported_at_the_end_and_memory_stays_bounded() -> None:
    p = DataParser(max_size=1000, max_line=10_000)
    for _ in range(2000):  # 2 MB of lines
        f = p.feed(b"x" * 998 + b"\r\n")
        assert f.data == b"" or p.raw_size <= 1000
        assert len(p._pending) < 2000
    f = p.feed(b".\r\nNOOP\r\n")
    assert f.done and f.rest == b"NOOP\r\n"
    assert p.state is DataState.TOO_MUCH


def test_over_long_line_without_crlf_keeps_memory_bounded() -> None:
    p = DataParser(max_size=0, max_line=1001)
    for _ in range(1000):
        p.feed(b"y" * 10_000)  # 10 MB, one line, no CRLF
        assert len(p._pending) <= 1001 + 4 + 10_000
    f = p.feed(b"\r\n.\r\n")
    assert f.done and p.state is DataState.TOO_LONG


def test_line_limit_counts_the_crlf_and_the_transparency_dot() -> None:
    ok = DataParser(0, 1001)
    ok.feed(b"." + b"x" * 998 + b"\r\n.\r\n")  # 1001 octets with the dot and CRLF
    assert ok.state is DataState.NOMINAL
    long = DataParser(0, 1001)
    long.feed(b"." + b"x" * 999 + b"\r\n.\r\n")
    assert long.state is DataState.TOO_LONG


def test_linear_on_hostile_blocks() -> None:
    import time

    p = DataParser(0, 10**9)
    started = time.perf_counter()
    for _ in range(200):
        p.feed(b"\r" * 65536)  # no LF ever: one growing incomplete line
    assert time.perf_counter() - started < 5.0
    assert re.fullmatch(rb"\r*", bytes(p._pending)) is not None


# What a mutation run of the then new code found unpinned (tests/MUTANTS.md, "New code, spot
# check"; until issue 28 in tests/test_mutants_new_code.py).
# --- relay/inbound/dataflow.py --------------------------------------------------------------------


def test_done_and_what_comes_after_the_end() -> None:
    p = DataParser(0, 1000)
    assert p.done is False
    f = p.feed(b"abc\r\n.\r\nQUIT\r\n")
    assert f == Feed(b"abc\r\n", True, b"QUIT\r\n")
    assert p.done is True
    # fed again after the end: nothing is data, all of it is handed back as it came
    assert p.feed(b"MAIL FROM:<a@b>\r\n") == Feed(b"", True, b"MAIL FROM:<a@b>\r\n")
    assert p.done is True


def test_counters_start_at_zero_and_add_up() -> None:
    p = DataParser(0, 1000)
    p.feed(b"\r\n.\r\n")
    assert (p.raw_size, p.longest, p.nul_count) == (2, 0, 0)
    q = DataParser(0, 1000)
    q.feed(b"a\x00b\r\n")
    q.feed(b"c\x00\x00\r\n.\r\n")
    assert q.nul_count == 3  # over both blocks
    assert q.raw_size == len(b"a\x00b\r\nc\x00\x00\r\n")


def test_a_complete_line_is_handed_out_at_once() -> None:
    p = DataParser(0, 1000)
    assert p.feed(b"\r\n").data == b"\r\n"  # an empty first line (no header block)
    assert p.feed(b"a\r\nb\r\nc").data == b"a\r\nb\r\n"  # every complete line, not the first
    assert p.feed(b"\r\nxyz").data == b"c\r\n"  # the CRLF that completes the pending line
    q = DataParser(0, 1000)
    assert q.feed(b"ab\r").data == b""
    assert q.feed(b"\nc").data == b"ab\r\n"  # a CRLF split between two blocks


def test_an_incomplete_line_at_the_limit_is_not_yet_too_long() -> None:
    p = DataParser(0, 100)
    p.feed(b"x" * 97)  # with its CRLF it will be 99 octets: within the limit
    f = p.feed(b"y\r\n.\r\n")
    assert f.done and p.state is DataState.NOMINAL and f.data == b"x" * 97 + b"y\r\n"


def test_raw_size_counts_a_too_long_line_once() -> None:
    p = DataParser(0, 100)
    p.feed(b"ok\r\n")
    p.feed(b"z" * 500)  # over the limit before its CRLF: kept short, counted
    p.feed(b"z" * 500)
    f = p.feed(b"\r\n.\r\n")
    assert f.done and p.state is DataState.TOO_LONG
    assert p.raw_size == 4 + 1000 + 2


def test_a_message_of_exactly_max_size_is_not_too_large() -> None:
    p = DataParser(10, 1000)
    f = p.feed(b"12345678\r\n.\r\n")  # 10 octets before the end line
    assert f.done and p.state is DataState.NOMINAL
    q = DataParser(10, 1000)
    q.feed(b"123456789\r\n.\r\n")
    assert q.state is DataState.TOO_MUCH


def test_a_refused_line_hands_out_no_data() -> None:
    p = DataParser(0, 100)
    assert p.feed(b"x" * 200 + b"\r\n").data == b""
    assert p.state is DataState.TOO_LONG


@pytest.mark.parametrize(
    ("line", "longest"),
    [
        (b"." + b"d" * 998, 998),  # the transparency dot is not part of the message
        (b"n" * 998 + b"\x00", 998),  # nor is a NUL
        (b"s " * 500, 1000),  # spaces are not line ends
        (b"s " * 500 + b"\n", 1000),  # ... also on the normalising path (a bare LF)
    ],
)
def test_longest_line_of_the_message_as_stored(line: bytes, longest: int) -> None:
    p = DataParser(0, 10_000)
    p.feed(b"a\r\n" + line + b"\r\n.\r\n")
    assert p.longest == longest


@pytest.mark.parametrize("dots", [0, 1, 15, 16, 17, 40])
@pytest.mark.parametrize("cut", [None, 3, 50, 5000])
def test_many_dots_before_a_dot_line_and_the_end(dots: int, cut: int | None) -> None:
    # in a long buffer the dot lines are found from the dots (the first few one by one,
    # then one search): any number of ordinary dots before them changes nothing
    text = b"a." * dots + b"\r\n" + b"y" * 5000 + b"\r\n" + b"b." * dots
    stream = text + b"\r\n..x\r\n" + b"c." * dots + b"\r\n.\r\nQUIT\r\n"
    _p, out, rest, done = run(stream, [] if cut is None else [cut, len(text) + cut])
    assert done
    assert (out, rest) == (text + b"\r\n.x\r\n" + b"c." * dots + b"\r\n", b"QUIT\r\n")
