"""The admin endpoint: `GET /metrics` (Prometheus text format), `GET /healthz` (readiness)
and `GET /health` (the whole health model, relay/health.py).

Rules: it is handed what it serves (metrics, the spool writer, two callables for health),
never the daemon. A tiny HTTP/1.0-style server on asyncio streams (a few read-only routes
do not justify a web framework: relay/httpd.py). Each request is bounded in size and time;
anything else goes to `extra` (the feedback endpoints, when they share this listener) or
gets 404/405.
`/healthz` answers 200 when every listener is open, the spool's last commit worked and
neither the disk nor the spool database is critical; 503 otherwise, with a JSON body
saying why. `/health` answers 200 for ok and warning, 503 for critical.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relay.httpd import Handler, HttpServer, Request, Response
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
        extra: Handler | None = None,
        max_body: int = 1024 * 1024,
    ) -> None:
        self.metrics = metrics
        self.writer = writer
        self.problems = problems  # readiness: why mail cannot be taken now
        self.health_doc = health_doc  # the whole health model
        self.extra = extra  # routes of others (feedback, unsubscribe) on this listener
        self.started_at = time.time()
        self.http = HttpServer(self._route, max_body, name="admin")

    async def start(self, host: str, port: int) -> None:
        await self.http.start(host, port)

    @property
    def port(self) -> int:
        return self.http.port

    async def stop(self) -> None:
        await self.http.stop()

    async def _route(self, req: Request) -> Response:
        path = req.path
        if path not in ("/metrics", "/health", "/healthz"):
            if self.extra is not None:
                return await self.extra(req)
            return Response.text(404, "not found")
        if req.method not in ("GET", "HEAD"):
            return Response.text(405, "method not allowed")
        if path == "/metrics":
            return Response(200, await self.metrics_text(), CONTENT_TYPE_LATEST)
        if path == "/health":
            hdoc = self.health_doc()
            return Response(
                503 if hdoc["status"] == "critical" else 200,
                json.dumps(hdoc).encode() + b"\n",
                "application/json",
            )
        problems = await self.problems()
        doc = {
            "status": "ok" if not problems else "unhealthy",
            "problems": problems,
            "uptime_seconds": round(time.time() - self.started_at, 1),
        }
        return Response(
            200 if not problems else 503, json.dumps(doc).encode() + b"\n", "application/json"
        )

    async def metrics_text(self) -> bytes:
        m = self.metrics
        # beside the writer, and only what the gauges show: at a million queued rows the
        # whole `stats` took ~0.5 s, and on the writer every 250 waited for it each scrape
        by_state, oldest_age = await self.writer.read(lambda c: ops.queue_gauges(c))
        for state, n in by_state.items():
            m.queue_depth.labels(state).set(n)
        m.oldest_age.set(oldest_age or 0)
        return bytes(generate_latest(m.registry))
