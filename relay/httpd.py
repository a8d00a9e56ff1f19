"""A tiny HTTP/1.1 server on asyncio streams, for the admin and feedback endpoints.

Rules: one request per connection (`Connection: close`); the head is bounded (16 KiB, 5 s),
the body too (`max_body`, read within 10 s; `Content-Length` or chunked). A request over a
bound or malformed gets `400` with a short text and never reaches a route; a route that
raises gets `500` and a logged traceback, and the server goes on. A handful of routes do
not justify a web framework.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
HEAD_TIMEOUT = 5.0
BODY_TIMEOUT = 10.0
REASONS = {
    200: "OK",
    202: "Accepted",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # names lowercased; a repeated name keeps its last value
    body: bytes
    peer: str


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    ctype: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def text(status: int, text: str) -> Response:
        return Response(status, (text + "\n").encode())


Handler = Callable[[Request], Awaitable[Response]]


class BadRequest(Exception):
    pass


class HttpServer:
    def __init__(self, handler: Handler, max_body: int = 1024 * 1024, name: str = "http") -> None:
        self.handler = handler
        self.max_body = max_body
        self.name = name
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(
            self._handle, host, port, reuse_address=True, limit=MAX_HEAD
        )

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
            except TimeoutError:
                pass

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer_ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        head_only = False
        try:
            try:
                req = await self._read(reader, peer_ip)
            except BadRequest as e:
                await _send(writer, Response.text(400, f"bad request: {e}"))
                return
            head_only = req.method == "HEAD"
            try:
                resp = await self.handler(req)
            except Exception:
                log.exception("%s request %s %s failed", self.name, req.method, req.path)
                resp = Response.text(500, "internal error")
            await _send(writer, resp, head_only)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("%s connection failed", self.name)
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, peer: str) -> Request:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except (asyncio.LimitOverrunError, ValueError) as e:
            raise BadRequest("request head too large") from e
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise BadRequest("malformed request line")
        method, target = parts[0], parts[1]
        path, _, query = target.partition("?")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise BadRequest("malformed header line")
            headers[name.lower()] = value.strip()
        body = b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await asyncio.wait_for(self._chunked(reader), BODY_TIMEOUT)
        elif "content-length" in headers:
            raw = headers["content-length"]
            if not raw.isdigit() or len(raw) > 12:
                raise BadRequest("bad Content-Length")
            size = int(raw)
            if size > self.max_body:
                raise BadRequest(f"body over {self.max_body} bytes")
            body = await asyncio.wait_for(reader.readexactly(size), BODY_TIMEOUT)
        return Request(method, path, query, headers, body, peer)

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError as e:
                raise BadRequest("bad chunk size") from e
            if size < 0 or len(out) + size > self.max_body:
                raise BadRequest(f"body over {self.max_body} bytes")
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return bytes(out)
            out += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise BadRequest("bad chunk")


async def _send(writer: asyncio.StreamWriter, resp: Response, head_only: bool = False) -> None:
    extra = "".join(f"{k}: {v}\r\n" for k, v in resp.headers.items())
    reason = REASONS.get(resp.status, "Unknown")
    writer.write(
        f"HTTP/1.1 {resp.status} {reason}\r\nContent-Type: {resp.ctype}\r\n"
        f"Content-Length: {len(resp.body)}\r\n{extra}Connection: close\r\n\r\n".encode()
    )
    if not head_only:
        writer.write(resp.body)
    await writer.drain()
