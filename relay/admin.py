"""The admin endpoint: `GET /metrics` (Prometheus text format), `GET /healthz` (readiness)
and `GET /health` (the whole health model, relay/health.py).

Rules: it is handed what it serves (metrics, the spool writer, two callables for health),
never the daemon. A tiny HTTP/1.0-style server on asyncio streams (a few read-only routes
do not justify a web framework). Each request is bounded in size and time; anything
else gets 404/405.
`/healthz` answers 200 when every listener is open, the spool's last commit worked and
neither the disk nor the spool database is critical; 503 otherwise, with a JSON body
saying why. `/health` answers 200 for ok and warning, 503 for critical.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relay.metrics import Metrics
from relay.spool import ops
from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)


class AdminServer:
    def __init__(
        self,
        metrics: Metrics,
        writer: SpoolWriter,
        problems: Callable[[], Awaitable[list[str]]],
        health_doc: Callable[[], dict[str, Any]],
    ) -> None:
        self.metrics = metrics
        self.writer = writer
        self.problems = problems  # readiness: why mail cannot be taken now
        self.health_doc = health_doc  # the whole health model
        self.started_at = time.time()
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._handle, host, port, reuse_address=True)

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
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = line.split()
            if len(parts) < 2:
                await self._send(writer, 400, "text/plain", b"bad request\n")
                return
            method, path = parts[0], parts[1].split("?", 1)[0]
            head_only = method == "HEAD"
            if method not in ("GET", "HEAD"):
                await self._send(writer, 405, "text/plain", b"method not allowed\n")
            elif path == "/metrics":
                body = await self.metrics_text()
                await self._send(writer, 200, CONTENT_TYPE_LATEST, body, head_only)
            elif path == "/health":
                hdoc = self.health_doc()
                await self._send(
                    writer,
                    503 if hdoc["status"] == "critical" else 200,
                    "application/json",
                    json.dumps(hdoc).encode() + b"\n",
                    head_only,
                )
            elif path == "/healthz":
                problems = await self.problems()
                doc = {
                    "status": "ok" if not problems else "unhealthy",
                    "problems": problems,
                    "uptime_seconds": round(time.time() - self.started_at, 1),
                }
                await self._send(
                    writer,
                    200 if not problems else 503,
                    "application/json",
                    json.dumps(doc).encode() + b"\n",
                    head_only,
                )
            else:
                await self._send(writer, 404, "text/plain", b"not found\n")
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass
        except Exception:
            log.exception("admin request failed")
        finally:
            writer.close()

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        ctype: str,
        body: bytes,
        head_only: bool = False,
    ) -> None:
        reason = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            503: "Service Unavailable",
        }[status]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        if not head_only:
            writer.write(body)
        await writer.drain()

    async def metrics_text(self) -> bytes:
        m = self.metrics
        st = await self.writer.run(lambda c: ops.stats(c))
        for state, n in st["recipients"].items():
            m.queue_depth.labels(state).set(n)
        m.oldest_age.set(st["oldest_queued_age"] or 0)
        return bytes(generate_latest(m.registry))
