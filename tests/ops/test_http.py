"""relay/ops/http.py over a real loopback socket: bounded, malformed and chunked requests, a
route that raises (500, and the server goes on), the head and body timeouts, the connection
bounds, and a route that answers before the body is read. (Was tests/test_httpd.py, for the
hand-written server this one replaced: every assertion about the wire is kept; a body over
max_body is now 413, not 400.)"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import pytest

from relay.ops.http import HttpLimits, HttpServer, Request, Response
from relay.ops.metrics import Metrics

LIMITS = HttpLimits(max_body=1000, head_timeout=0.5, body_timeout=0.5)


async def handler(req: Request) -> Response:
    if req.path == "/boom":
        raise RuntimeError("a bug in a route")
    if req.path == "/auth" and req.headers.get("authorization") != "yes":
        return Response.text(401, "unauthorized")  # before the body, as the webhooks do
    body = await req.read()
    return Response(200, f"{req.method} {req.path} {len(body)} {body!r}".encode())


async def exchange(port: int, raw: bytes, source: str = "127.0.0.1") -> tuple[int, bytes]:
    """One request from `source` (any 127/8 address is a distinct client on loopback)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    srv = HttpServer("test", LIMITS, Metrics())
    srv.route("/", handler, prefix=True)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.stop()


@pytest.fixture
def port(server: HttpServer) -> int:
    return server.port


async def test_plain_get_and_post_with_content_length(port: int) -> None:
    assert await exchange(port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n") == (200, b"GET /x 0 b''")
    raw = b"POST /p?q=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
    assert await exchange(port, raw) == (200, b"POST /p 5 b'hello'")


async def test_chunked_body_is_joined(port: int) -> None:
    head = b"POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw = head + b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    assert await exchange(port, raw) == (200, b"POST /c 5 b'abcde'")


async def test_one_request_per_connection_and_head_has_no_body(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    two = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n"
    writer.write(two)
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert data.count(b"HTTP/1.1 200") == 1 and b"GET /a" in data and b"/b" not in data
    assert b"Connection: close" in data and b"aiohttp" not in data
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"Content-Length: %d" % len(b"HEAD /x 0 b''") in head and body == b""


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /x\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\n folded: start\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 1001\r\n\r\n" + b"x" * 1001, 413),
        (b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (
            b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3E9\r\n"
            + b"x" * 1001
            + b"\r\n",
            413,
        ),
        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\n\r\n", 400),  # RFC 9112 §3.2: HTTP/1.1 without Host
    ],
)
async def test_malformed_or_oversized_requests_get_400_or_413(
    port: int, raw: bytes, status: int
) -> None:
    got, body = await exchange(port, raw)
    assert got == status
    assert body.startswith(b"bad request" if status == 400 else b"request body too large")


async def test_a_failing_route_is_500_and_the_server_goes_on(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="relay.ops.http"):
        assert (await exchange(port, b"GET /boom HTTP/1.1\r\nHost: a\r\n\r\n"))[0] == 500
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    assert (await exchange(port, b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n"))[0] == 200


async def test_a_slow_head_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n")  # and then nothing
    t0 = time.monotonic()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert data == b"" and time.monotonic() - t0 < 3


async def test_an_idle_connection_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert time.monotonic() - t0 < 3


async def test_a_slow_body_gets_408_and_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nhel")
    t0 = time.monotonic()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3


async def test_a_route_answers_before_the_body_is_sent(port: int) -> None:
    """The token is checked at the head: the refusal comes while the body is still unsent
    (nothing of it read, nothing waited for)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /auth HTTP/1.1\r\nHost: a\r\nContent-Length: 900\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 2)  # within the body timeout: not waited for
    writer.close()
    assert data.startswith(b"HTTP/1.1 401")


async def _idle(source: str, port: int, n: int) -> list[asyncio.StreamWriter]:
    out = []
    for _ in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        w.write(b"GET /x HTTP/1.1\r\n")  # a head that never ends
        out.append(w)
    await asyncio.sleep(0.1)
    return out


async def test_connections_are_bounded_per_ip_and_in_total() -> None:
    limits = HttpLimits(max_connections=6, max_connections_per_ip=4, head_timeout=5)
    metrics = Metrics()
    srv = HttpServer("test", limits, metrics)
    srv.route("/", handler, prefix=True)
    await srv.start("127.0.0.1", 0)
    held: list[asyncio.StreamWriter] = []
    try:
        held += await _idle("127.0.0.1", srv.port, 4)
        t0 = time.monotonic()
        status, body = await exchange(srv.port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        assert status == 503 and b"from your address" in body
        assert time.monotonic() - t0 < 1  # at once, not after a timeout
        # another address still gets in, up to the total
        assert await exchange(srv.port, b"GET /y HTTP/1.1\r\nHost: a\r\n\r\n", "127.0.0.2") == (
            200,
            b"GET /y 0 b''",
        )
        held += await _idle("127.0.0.2", srv.port, 2)
        status, body = await exchange(srv.port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n", "127.0.0.3")
        assert status == 503 and body == b"too many connections, try again later\n"
        assert srv.connections.total == 6
        sample = metrics.registry.get_sample_value
        assert (
            sample("relay_http_connections_refused_total", {"listener": "test", "reason": "per_ip"})
            == 1
        )
        assert (
            sample("relay_http_connections_refused_total", {"listener": "test", "reason": "total"})
            == 1
        )
        # closed connections free their slots
        for w in held:
            w.close()
        held = []
        deadline = time.monotonic() + 5
        while srv.connections.total and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        assert srv.connections.total == 0
        assert (await exchange(srv.port, b"GET /z HTTP/1.1\r\nHost: a\r\n\r\n"))[0] == 200
    finally:
        for w in held:
            w.close()
        await srv.stop()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_refused_connections_hold_no_descriptor() -> None:
    limits = HttpLimits(max_connections=256, max_connections_per_ip=8, head_timeout=5)
    srv = HttpServer("test", limits)
    srv.route("/", handler, prefix=True)
    await srv.start("127.0.0.1", 0)
    held: list[asyncio.StreamWriter] = []
    try:
        held += await _idle("127.0.0.1", srv.port, 8)
        before = _open_fds()
        for _ in range(50):
            status, _ = await exchange(srv.port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            assert status == 503
        assert _open_fds() <= before + 2
    finally:
        for w in held:
            w.close()
        await srv.stop()


async def test_100_continue_only_after_the_route_asked_for_the_body(port: int) -> None:
    """Expect: 100-continue (RFC 9110 §10.1.1): a client the route refuses at the head gets
    the refusal and no 100, so it never sends the body; one it takes gets 100, then sends."""
    head = b"POST /auth HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert data.startswith(b"HTTP/1.1 401") and b"100 Continue" not in data
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"Authorization: yes\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b"hello")
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"POST /auth 5 b'hello'")


async def test_a_route_of_aiohttps_own_kind_gets_the_same_gate() -> None:
    """The operator console's way in: `server.app.router` with aiohttp handlers, behind the
    same bounds (framing, one request per connection)."""
    from aiohttp import web

    async def native(request: web.Request) -> web.Response:
        return web.json_response({"hello": request.match_info["name"]})

    srv = HttpServer("test", LIMITS)
    srv.app.router.add_get("/hello/{name}", native)
    await srv.start("127.0.0.1", 0)
    try:
        status, body = await exchange(srv.port, b"GET /hello/you HTTP/1.1\r\nHost: a\r\n\r\n")
        assert (status, body) == (200, b'{"hello": "you"}')
        raw = (
            b"GET /hello/you HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        )
        assert (await exchange(srv.port, raw))[0] == 400
    finally:
        await srv.stop()
