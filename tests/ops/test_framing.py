"""Ambiguous HTTP framing is refused with 400 and never reaches a route (relay/ops/framing.py
and relay/ops/http.py): first the sans-I/O checker as a table (whole, and one byte at a
time), then each case on the wire against aiohttp's C parser (llhttp) and its pure-Python
fallback (what AIOHTTP_NO_EXTENSIONS=1 selects), with no log line above INFO and no
traceback for any of them.

What aiohttp alone did with these (3.14.5, before the gate; /tmp probes, kept here as the
reason for each guard): both parsers refused two Content-Lengths, TE with CL, `xchunked`,
`chunked, identity`, `0x5`, `1_0`, a bare LF in a header value, but each logged an ERROR
with a traceback (`aiohttp.server`); both accepted `gzip, chunked`, chunked in HTTP/1.0 and a
head of 100 fields of 8 KB (800 KB); llhttp accepted a 16 KiB chunk-size line (extensions)
and `GET /x` as HTTP/0.9 (the route answered); the Python parser answered a 16 KiB chunk-size
line with 500 and an ERROR traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import http_parser, web_protocol

from relay.ops.framing import FramingError, RequestFraming
from relay.ops.http import HttpLimits, HttpServer, Request, Response

H = b"POST /x HTTP/1.1\r\nHost: a\r\n"
CHUNKED = H + b"Transfer-Encoding: chunked\r\n\r\n"

# refused at the head: no route is ever called
HEAD_CASES = {
    "two differing Content-Lengths": H + b"Content-Length: 3\r\nContent-Length: 5\r\n\r\nhello",
    "two equal Content-Lengths": H + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "a Content-Length list": H + b"Content-Length: 5, 5\r\n\r\nhello",
    "a signed Content-Length": H + b"Content-Length: +5\r\n\r\nhello",
    "TE with CL": H
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "CL with TE": H
    + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "xchunked": H + b"Transfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunked, identity": H + b"Transfer-Encoding: chunked, identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "gzip, chunked": H + b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "identity": H + b"Transfer-Encoding: identity\r\n\r\nhello",
    "two TE fields": H
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunked in HTTP/1.0": b"POST /x HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n",
    "a bare LF inside a header value": H + b"X-A: b\nContent-Length: 5\r\n\r\nhello",
    "bare LF line ends": b"GET /x HTTP/1.1\nHost: a\n\n",
    "a bare CR inside a header value": H + b"X-A: b\rc\r\nContent-Length: 5\r\n\r\nhello",
    "obsolete line folding": H + b"X-A: b\r\n c\r\nContent-Length: 5\r\n\r\nhello",
    "whitespace before the colon": H + b"Content-Length : 5\r\n\r\nhello",
    "HTTP/0.9 (no version)": b"GET /x\r\n\r\n",
    "HTTP/1.2": b"GET /x HTTP/1.2\r\nHost: a\r\n\r\n",
    "a head of 100 fields of 8 KB": b"GET /x HTTP/1.1\r\nHost: a\r\n"
    + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 8000) for i in range(100))
    + b"\r\n",
}
# refused in the body: a route may have begun (it checks a token at the head) but never
# gets a byte of the body
BODY_CASES = {
    "chunk size 0x5": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "chunk size 1_0": CHUNKED + b"1_0\r\n0123456789abcdef\r\n0\r\n\r\n",
    "chunk size +5": CHUNKED + b"+5\r\nhello\r\n0\r\n\r\n",
    "chunk size with a space": CHUNKED + b"5 \r\nhello\r\n0\r\n\r\n",
    "chunk size empty": CHUNKED + b"\r\nhello\r\n0\r\n\r\n",
    "a 16 KiB chunk-size line (extension)": CHUNKED
    + b"5;"
    + b"x" * 16384
    + b"\r\nhello\r\n0\r\n\r\n",
    "a 16 KiB chunk-size line (zeros)": CHUNKED + b"0" * 16384 + b"5\r\nhello\r\n0\r\n\r\n",
    "17 hex digits": CHUNKED + b"00000000000000005\r\nhello\r\n0\r\n\r\n",
    "a bare LF after the chunk size": CHUNKED + b"5\nhello\r\n0\r\n\r\n",
    "chunk data without CRLF": CHUNKED + b"5\r\nhelloXX0\r\n\r\n",
    "a trailer with a bare LF": CHUNKED + b"5\r\nhello\r\n0\r\nX-T: 1\nX: 2\r\n\r\n",
    "a 20 KiB trailer": CHUNKED + b"5\r\nhello\r\n0\r\nX-T: " + b"t" * 20000 + b"\r\n\r\n",
}
GOOD = {
    "Content-Length": (H + b"Content-Length: 5\r\n\r\nhello", b"hello"),
    "chunked": (CHUNKED + b"5\r\nhello\r\n0\r\n\r\n", b"hello"),
    "CHUNKED (codings are case-insensitive)": (
        H + b"Transfer-Encoding: CHUNKED\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"hello",
    ),
    "a chunk extension": (CHUNKED + b"5;name=value\r\nhello\r\n0\r\n\r\n", b"hello"),
    "upper-case hex and leading zeros": (
        CHUNKED + b"000A\r\n0123456789\r\n0\r\n\r\n",
        b"0123456789",
    ),
    "a trailer": (CHUNKED + b"5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n", b"hello"),
    "no body": (b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n", b""),
}


# --- the checker, sans I/O ----------------------------------------------------------------


def _feed(raw: bytes, one_by_one: bool, max_body: int = 1000) -> RequestFraming:
    f = RequestFraming(max_body=max_body)
    pieces = [raw[i : i + 1] for i in range(len(raw))] if one_by_one else [raw]
    for p in pieces:
        f.feed(p)
    return f


@pytest.mark.parametrize("one_by_one", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("name", [*HEAD_CASES, *BODY_CASES])
def test_the_checker_refuses(name: str, one_by_one: bool) -> None:
    raw = {**HEAD_CASES, **BODY_CASES}[name]
    with pytest.raises(FramingError) as e:
        _feed(raw, one_by_one)
    assert e.value.status == 400


@pytest.mark.parametrize("one_by_one", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("name", list(GOOD))
def test_the_checker_takes_good_requests_to_their_end(name: str, one_by_one: bool) -> None:
    raw, body = GOOD[name]
    f = _feed(raw, one_by_one)
    assert f.done and f.body_size == len(body)
    # bytes after the end belong to no request
    g = RequestFraming()
    assert g.feed(raw + b"GET /next HTTP/1.1\r\n\r\n") == len(raw)


def test_the_head_is_refused_where_the_bytes_break_a_rule() -> None:
    f = RequestFraming()
    with pytest.raises(FramingError) as e:
        f.feed(b"POST /x HTTP/1.1\r\nX-A: b\nc")  # before the head ends
    assert "bare LF" in e.value.reason
    with pytest.raises(FramingError, match="over 64 bytes"):
        RequestFraming(max_head=64).feed(b"GET /" + b"a" * 100)


def test_bodies_over_max_body_are_413_before_the_data() -> None:
    f = RequestFraming(max_body=10)
    with pytest.raises(FramingError) as e:
        f.feed(H + b"Content-Length: 11\r\n\r\n")  # no byte of the body yet
    assert e.value.status == 413
    f = RequestFraming(max_body=10)
    f.feed(CHUNKED + b"6\r\nhello!\r\n")
    with pytest.raises(FramingError) as e:
        f.feed(b"5\r\n")  # 11: refused at the size line
    assert e.value.status == 413 and e.value.consumed == 0
    f = RequestFraming(max_body=10)
    assert f.feed(H + b"Content-Length: 10\r\n\r\n0123456789") > 0 and f.done


def test_consumed_says_how_far_the_bytes_were_fine() -> None:
    f = RequestFraming()
    raw = CHUNKED + b"5\r\nhello\r\n0x5\r\n"
    with pytest.raises(FramingError) as e:
        f.feed(raw)
    assert e.value.consumed == len(CHUNKED + b"5\r\nhello\r\n")


# --- on the wire, with each of aiohttp's parsers ------------------------------------------


@pytest.fixture(params=["llhttp", "python"])
def parser(request: pytest.FixtureRequest) -> Iterator[str]:
    """aiohttp's C parser, or the pure-Python one (what AIOHTTP_NO_EXTENSIONS=1 selects:
    `http_parser.HttpRequestParser` is then `HttpRequestParserPy`)."""
    if request.param == "llhttp":
        assert web_protocol.HttpRequestParser is not http_parser.HttpRequestParserPy
        yield "llhttp"
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(web_protocol, "HttpRequestParser", http_parser.HttpRequestParserPy)
        yield "python"


class Route:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bodies: list[bytes] = []

    async def __call__(self, req: Request) -> Response:
        self.calls.append(req.path)
        body = await req.read()
        self.bodies.append(body)
        return Response(200, b"route " + body)


@pytest.fixture
async def wire(parser: str) -> AsyncIterator[tuple[HttpServer, Route]]:
    route = Route()
    srv = HttpServer("framing", HttpLimits(max_body=100_000, head_timeout=3, body_timeout=3))
    srv.route("/", route, prefix=True)
    await srv.start("127.0.0.1", 0)
    yield srv, route
    await srv.stop()


async def exchange(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""  # refused while we were still sending: the refusal reset the rest
    finally:
        writer.close()


def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    loud = [
        r
        for r in caplog.records
        if r.levelno > logging.INFO or (r.exc_info and r.levelno > logging.DEBUG)
    ]
    assert not loud, [(r.name, r.levelname, r.getMessage()) for r in loud]


@pytest.mark.parametrize("name", list(HEAD_CASES))
async def test_refused_at_the_head_never_reaches_a_route(
    wire: tuple[HttpServer, Route], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    srv, route = wire
    with caplog.at_level(logging.DEBUG):
        data = await exchange(srv.port, HEAD_CASES[name])
    if name.startswith("a head of 100"):
        assert data == b"" or data.startswith(b"HTTP/1.1 400")  # reset while sending
    else:
        assert b" 400 " in data.split(b"\r\n", 1)[0], data[:200]
        assert data.split(b"\r\n\r\n", 1)[1].startswith(b"bad request: ")
    assert route.calls == []
    _quiet(caplog)


@pytest.mark.parametrize("name", list(BODY_CASES))
async def test_refused_in_the_body_gives_no_route_a_byte(
    wire: tuple[HttpServer, Route], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    srv, route = wire
    with caplog.at_level(logging.DEBUG):
        data = await exchange(srv.port, BODY_CASES[name])
    assert b" 400 " in data.split(b"\r\n", 1)[0], data[:200]
    assert data.split(b"\r\n\r\n", 1)[1].startswith(b"bad request")
    assert route.bodies == []
    _quiet(caplog)


@pytest.mark.parametrize("name", list(GOOD))
async def test_good_framing_reaches_the_route(wire: tuple[HttpServer, Route], name: str) -> None:
    srv, route = wire
    raw, body = GOOD[name]
    data = await exchange(srv.port, raw)
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"route " + body)
    assert route.bodies == [body]


async def test_errors_of_aiohttps_own_parser_are_quiet_400s(
    wire: tuple[HttpServer, Route], caplog: pytest.LogCaptureFixture
) -> None:
    """What only aiohttp's parser refuses (a NUL in a value, no Host) is answered like the
    rest: 400 `bad request: ...`, at most a DEBUG line."""
    srv, route = wire
    with caplog.at_level(logging.DEBUG):
        for raw in (
            b"GET /x HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n",
            b"GET /x HTTP/1.1\r\n\r\n",
        ):
            data = await exchange(srv.port, raw)
            assert b" 400 " in data.split(b"\r\n", 1)[0]
            assert data.split(b"\r\n\r\n", 1)[1].startswith(b"bad request: ")
    assert route.calls == []
    _quiet(caplog)
