"""relay/httpd.py over a real loopback socket: bounded, malformed and chunked requests, and a
route that raises (500, and the server goes on)."""

from __future__ import annotations

import asyncio

import pytest

from relay.httpd import HttpServer, Request, Response


async def handler(req: Request) -> Response:
    if req.path == "/boom":
        raise RuntimeError("a bug in a route")
    return Response(200, f"{req.method} {req.path} {len(req.body)} {req.body!r}".encode())


async def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.fixture
async def port():
    srv = HttpServer(handler, max_body=1000)
    await srv.start("127.0.0.1", 0)
    yield srv.port
    await srv.stop()


async def test_plain_get_and_post_with_content_length(port: int) -> None:
    assert await exchange(port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n") == (200, b"GET /x 0 b''")
    raw = b"POST /p?q=1 HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    assert await exchange(port, raw) == (200, b"POST /p 5 b'hello'")


async def test_chunked_body_is_joined(port: int) -> None:
    head = b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw = head + b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    assert await exchange(port, raw) == (200, b"POST /c 5 b'abcde'")


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /x\r\n\r\n",
        b"GET /x HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET /x HTTP/1.1\r\n folded: start\r\n\r\n",
        b"POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST /x HTTP/1.1\r\nContent-Length: 1001\r\n\r\n" + b"x" * 1001,
        b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3E9\r\n" + b"x" * 1001 + b"\r\n",
        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
    ],
)
async def test_malformed_or_oversized_requests_get_400(port: int, raw: bytes) -> None:
    status, body = await exchange(port, raw)
    assert status == 400 and body.startswith(b"bad request")


async def test_a_failing_route_is_500_and_the_server_goes_on(port: int) -> None:
    assert (await exchange(port, b"GET /boom HTTP/1.1\r\n\r\n"))[0] == 500
    assert (await exchange(port, b"GET /ok HTTP/1.1\r\n\r\n"))[0] == 200
