"""The HTTP listeners (admin, feedback webhooks, one-click unsubscribe): aiohttp's web server in
the daemon's own event loop, behind a gate that bounds connections and request framing.

Rules:
- One `HttpServer` per listener. Routes: `server.route("/metrics", handler)` (one path) or
  `server.route("/u/", handler, prefix=True)` (every path under it), where a handler takes
  relay's `Request` and returns a `Response` (values, testable without a socket); a route
  of aiohttp's own kind goes on `server.app.router` (the same gate and bounds apply). Add
  routes before `start`. Any method reaches a route; the handler answers 405 itself.
- Connections: at most `max_connections` open at once and `max_connections_per_ip` from one
  client (the IPv4 address, or the IPv6 /64: relay/inbound/anvil.py). Past either, the client gets
  `503` with `Retry-After` at once, nothing is read, and the connection is closed; counted
  in `relay_http_connections_refused_total{listener,reason}`, logged (`connection_limit`)
  once per client and reason per minute. This keeps the daemon under its file-descriptor
  limit (relay/inbound/fdlimit.py counts these bounds).
- One request per connection (`Connection: close` on every answer). The head must arrive
  within `head_timeout` of the connect, the body within `body_timeout` of the head; a
  connection past either is closed (a body too slow for a waiting route gets 408).
- Every byte goes through relay/ops/framing.py before aiohttp's parser: a head over
  `max_head`, ambiguous framing or a body over `max_body` never reaches a route (400 or
  413, "bad request: <why>"). A Content-Length over `max_body` is refused before a byte of
  the body is read. A route reads the body only when it asks (`await req.read()`): the
  feedback webhooks check their token first, so a stranger's body is never read.
- A bad request is logged at DEBUG (the internet sends plenty); a route that raises gets
  `500 internal error` and an ERROR line with the traceback, and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from relay.ops.framing import MAX_HEAD, FramingError, RequestFraming
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics

log = logging.getLogger(__name__)

HEAD_TIMEOUT = 5.0
BODY_TIMEOUT = 10.0
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_IP = 32


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_ip: int = MAX_CONNECTIONS_PER_IP
    max_body: int = 1024 * 1024
    max_head: int = MAX_HEAD
    head_timeout: float = HEAD_TIMEOUT
    body_timeout: float = BODY_TIMEOUT


class BodyError(Exception):
    """The body broke a bound while a route waited for it (413, 400, 408)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Request:
    """One request as a route sees it: the head at once, the body on `await read()`."""

    __slots__ = ("_body", "_reader", "headers", "method", "path", "peer", "query")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],  # names lowercased; a repeated name keeps its last value
        body: bytes | None,
        peer: str,
        reader: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        self.method = method
        self.path = path  # as sent, not percent-decoded
        self.query = query
        self.headers = headers
        self.peer = peer
        self._body = body
        self._reader = reader

    async def read(self) -> bytes:
        """The body (within `max_body`); raises BodyError past a bound."""
        if self._body is None:
            self._body = b"" if self._reader is None else await self._reader()
        return self._body

    @property
    def body(self) -> bytes:
        if self._body is None:
            raise RuntimeError("the body is not read yet: await req.read() first")
        return self._body


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

_TEXT = {
    400: "bad request",
    404: "not found",
    405: "method not allowed",
    408: "request timeout",
    413: "request body too large",
    500: "internal error",
}
_BUSY = {
    "total": b"too many connections, try again later\n",
    "per_ip": b"too many connections from your address, try again later\n",
}


def _raw(status: int, reason: str, text: bytes, extra: str = "") -> bytes:
    """A whole response for the gate to write before aiohttp has a request."""
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(text)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode() + text


_PHRASES = {400: "Bad Request", 413: "Content Too Large", 503: "Service Unavailable"}


class HttpServer:
    def __init__(
        self, name: str, limits: HttpLimits | None = None, metrics: Metrics | None = None
    ) -> None:
        self.name = name
        self.limits = limits or HttpLimits()
        self.metrics = metrics
        self.app = web.Application(
            middlewares=[self._middleware], client_max_size=self.limits.max_body
        )
        from relay.inbound import anvil  # here, not at the top: relay.inbound imports config

        self.connections = anvil.ConnectionTable()
        self._policy = anvil.ConnectionLimits(
            max_connections=self.limits.max_connections,
            per_ip=self.limits.max_connections_per_ip,
            per_ip_allowed=self.limits.max_connections_per_ip,
            allowed_reserve=0,
        )
        self._log_once = anvil.LogOnce()
        self._gates: weakref.WeakValueDictionary[int, _Gate] = weakref.WeakValueDictionary()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._kwargs: dict[str, Any] = {}

    # --- routes -----------------------------------------------------------------------------

    def route(self, path: str, handler: Handler, *, prefix: bool = False) -> None:
        """`handler` answers every method on `path`, or on every path under `path` (which
        then ends in '/')."""
        if prefix and not path.endswith("/"):
            raise ValueError(f"a prefix route ends in '/': {path!r}")

        async def serve(request: web.Request) -> web.StreamResponse:
            return _to_aiohttp(await handler(self._request(request)))

        pattern = path + "{tail:.*}" if prefix else path
        self.app.router.add_route("*", pattern, serve, expect_handler=_no_continue)

    def _request(self, request: web.Request) -> Request:
        raw_path, _, query = request.raw_path.partition("?")
        headers = {k.lower(): v for k, v in request.headers.items()}

        async def reader() -> bytes:
            try:
                if request.headers.get("Expect", "").lower() == "100-continue":
                    # only now: a client refused at the head (a bad token) never sends
                    # the body it asked to send (RFC 9110 §10.1.1)
                    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                return await request.read()
            except web.HTTPRequestEntityTooLarge as e:  # the gate's bound, as aiohttp counts
                raise BodyError(413, f"request body over {self.limits.max_body} bytes") from e
            except (ConnectionError, RequestPayloadError) as e:
                raise BodyError(400, f"body not received: {e}") from e

        return Request(request.method, raw_path, query, headers, None, request.remote or "", reader)

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        lim = self.limits
        self._runner = web.AppRunner(
            self.app, handle_signals=False, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        self._kwargs = {
            # a backstop behind the gate's own timers: an idle connection is closed
            "keepalive_timeout": lim.head_timeout,
            "max_line_size": lim.max_head,
            "max_field_size": lim.max_head,
            "max_headers": 256,
            "lingering_time": 0,  # never drain a body nobody asked for
            "auto_decompress": False,  # the bytes as sent (no gzip bombs): max_body is theirs
            "access_log": None,  # relay logs what matters itself
        }
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Gate(self), host, port, reuse_address=True)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()  # requests in flight get shutdown_timeout (1 s)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

    def _protocol(self) -> RequestHandler:
        assert self._runner is not None and self._runner.server is not None
        return _Protocol(self, self._runner.server, loop=asyncio.get_running_loop(), **self._kwargs)

    # --- connections --------------------------------------------------------------------------

    def admit(self, ip: str) -> str | None:
        """Count a new connection, or say why it is refused (`total`, `per_ip`)."""
        from relay.inbound import anvil  # here, not at the top: relay.inbound imports config

        key = anvil.client_key(ip)
        reason = anvil.refuse_connection(
            self._policy, self.connections.total, self.connections.from_ip(key), True, False
        )
        if reason is None:
            self.connections.opened(key)
            if self.metrics is not None:
                self.metrics.http_connections_open.labels(self.name).set(self.connections.total)
            return None
        if self.metrics is not None:
            self.metrics.http_connections_refused.labels(self.name, reason).inc()
        unlogged = self._log_once.check((reason, key), time.monotonic())
        if unlogged is not None:
            log_event(
                log,
                logging.WARNING,
                "connection_limit",
                "HTTP connection refused",
                reason=reason,
                peer=ip,
                listener=self.name,
                open_total=self.connections.total,
                open_from_peer=self.connections.from_ip(key),
                refused_unlogged=unlogged,
            )
        return reason

    def release(self, ip: str) -> None:
        from relay.inbound import anvil  # here, not at the top: relay.inbound imports config

        self.connections.closed(anvil.client_key(ip))
        if self.metrics is not None:
            self.metrics.http_connections_open.labels(self.name).set(self.connections.total)

    def bad_request(self, peer: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.http_bad_requests.labels(self.name).inc()
        log.debug("%s: bad request from %s: %s", self.name, peer, reason)

    # --- every request ------------------------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        gate = self._gates.get(id(request.transport))
        try:
            if gate is not None:
                gate.request = request
                if gate.error is not None:  # the body broke a bound before the route began
                    raise gate.error
            resp = await handler(request)
        except web.HTTPException as e:
            resp = _text_response(e.status, _TEXT.get(e.status, e.reason.lower()))
            if e.status == 405:
                resp.headers["Allow"] = e.headers.get("Allow", "")
        except BodyError as e:
            self.bad_request(request.remote or "", e.reason)
            resp = _text_response(e.status, f"{_TEXT.get(e.status, 'bad request')}: {e.reason}")
        except Exception:
            log.exception("%s request %s %s failed", self.name, request.method, request.path)
            resp = _text_response(500, "internal error")
        if not resp.prepared:  # a route of aiohttp's own kind may have streamed already
            resp.force_close()  # one request per connection
            resp.headers["Server"] = "relay"  # not aiohttp's version
        return resp


async def _no_continue(request: web.Request) -> None:
    """No `100 Continue` before the route ran: `Request.read` sends it (aiohttp's default
    sends it at once, before the route could refuse the head)."""


def _text_response(status: int, text: str) -> web.Response:
    return _to_aiohttp(Response.text(status, text))


def _to_aiohttp(resp: Response) -> web.Response:
    headers = {"Content-Type": resp.ctype, **resp.headers}
    return web.Response(status=resp.status, body=resp.body, headers=headers)


class _Protocol(RequestHandler):
    """aiohttp's connection handler, with relay's answer to a request its parser refused:
    `400 bad request: <why>` and a DEBUG line (aiohttp logs these at ERROR, with a traceback).
    """

    def __init__(self, owner: HttpServer, manager: Any, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.owner = owner

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("%s request failed", self.owner.name, exc_info=exc)
            text = _TEXT.get(status, "internal error")
        else:
            why = (message or "").split("\n", 1)[0].rstrip(":")
            self.owner.bad_request(str(request.remote), why)
            text = f"bad request: {why}" if why else "bad request"
        resp = _text_response(status, text)
        resp.force_close()
        resp.headers["Server"] = "relay"
        return resp


class _Gate(asyncio.Protocol):
    """In front of aiohttp's protocol: admits the connection, times the head and the body,
    and checks every byte's framing before aiohttp's parser sees it."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.inner: RequestHandler | None = None
        self.transport: asyncio.Transport | None = None
        self.ip = ""
        self.framing = RequestFraming(
            server.limits.max_head, server.limits.max_body, max_chunk_line=1024
        )
        self.request: web.Request | None = None  # once the route's middleware began
        self.admitted = False
        self._head = bytearray()  # the head so far: aiohttp gets it whole, once it passed
        self.error: BodyError | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        reason = self.server.admit(ip)
        if reason is not None:
            # nothing is read: the answer, then the close (RFC 9110 §15.6.4, Retry-After)
            self.transport.write(_raw(503, _PHRASES[503], _BUSY[reason], "Retry-After: 1\r\n"))
            self.transport.close()
            return
        self.ip = ip
        self.admitted = True
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.server.limits.head_timeout, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if not self.admitted or self.error is not None or self.framing.done:
            return  # refused, broken, or bytes after the one request: dropped
        head_done = self.framing.head_done
        try:
            n = self.framing.feed(data)
        except FramingError as e:
            if self.framing.head_done and e.consumed:
                self._pass(data[: e.consumed])  # the head, for the route's answer
            self._refuse(e.status, e.reason)
            return
        if not head_done and self.framing.head_done:
            self._cancel_timer()
            if not self.framing.done:
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self.server.limits.body_timeout, self._too_slow)
        if self.framing.done:
            self._cancel_timer()
        if n:
            self._pass(data if n == len(data) else data[:n])

    def _pass(self, data: bytes) -> None:
        """Hand checked bytes to aiohttp; it meets the connection only with a whole head
        that passed (a refused or idle one never costs it a task)."""
        if self.inner is None:
            if not self.framing.head_done:
                self._head += data
                return
            assert self.transport is not None
            self.server._gates[id(self.transport)] = self
            self.inner = self.server._protocol()
            self.inner.connection_made(self.transport)
            data, self._head = bytes(self._head) + data, bytearray()
        self.inner.data_received(data)

    def eof_received(self) -> bool:
        # a client that half-closes after a whole request still gets its answer
        return self.framing.done and self.inner is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.admitted:
            self.admitted = False
            self.server.release(self.ip)
        if self.inner is not None:
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        if not self.framing.head_done:
            self.server.bad_request(self.ip, "request head too slow")
            assert self.transport is not None
            self.transport.close()
            return
        self._fail(BodyError(408, "request body too slow"))

    def _refuse(self, status: int, reason: str) -> None:
        if self.framing.head_done:
            # aiohttp has the head: the route (or the middleware) answers
            self._fail(BodyError(status, reason))
            return
        self.server.bad_request(self.ip, reason)
        assert self.transport is not None
        text = f"{_TEXT.get(status, 'bad request')}: {reason}\n".encode()
        self.transport.write(_raw(status, _PHRASES.get(status, "Bad Request"), text))
        self.transport.close()

    def _fail(self, error: BodyError) -> None:
        """A bound broken after the head: the route waiting for the body gets the error (its
        answer goes out through aiohttp); no more bytes are taken."""
        self._cancel_timer()
        self.error = error
        if self.request is not None:
            self.request.content.set_exception(error)
