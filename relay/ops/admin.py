"""The admin endpoint: `GET /metrics` (Prometheus text format), `GET /healthz` (readiness)
and `GET /health` (the whole health model, relay/ops/health.py).

Rules: it is handed what it serves (metrics, the spool writer, two callables for health,
the spool folder), never the daemon. It serves on relay/ops/http.py (aiohttp, bounded in
connections, size and time); others add their routes to `self.http` (the feedback
endpoints, when they share this listener); any other path gets 404, a method other than
GET/HEAD on these 405.
`/console` is the operator console (relay/ops/console, `add_console`).
`/healthz` answers 200 when every listener is open, the spool's last commit worked, the
spool folder takes a new file (created, fsynced and removed, off the event loop) and
neither the disk nor the spool database is critical; 503 otherwise, with a JSON body
saying why. `/health` answers 200 for ok and warning, 503 for critical.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST

from relay.ops.http import HttpLimits, HttpServer, Request, Response
from relay.ops.metrics import Metrics
from relay.spool import ops
from relay.spool.writer import SpoolWriter

if TYPE_CHECKING:
    from relay.ops.console.app import Console

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 2.0  # a spool folder that takes longer to create a file is not fit for mail
_probes = itertools.count()


def probe_writable(folder: Path) -> str | None:
    """Create, fsync and remove a small file in `folder` (blocking: run it in a thread).
    None when that worked, else why not."""
    path = folder / f".healthz-probe.{os.getpid()}.{next(_probes)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"ok\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(path)
    except OSError as e:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        return f"spool folder not writable: {e.strerror or e}"
    return None


class AdminServer:
    def __init__(
        self,
        metrics: Metrics,
        writer: SpoolWriter,
        problems: Callable[[], Awaitable[list[str]]],
        health_doc: Callable[[], dict[str, Any]],
        spool_dir: Path | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.metrics = metrics
        self.writer = writer
        self.problems = problems  # readiness: why mail cannot be taken now
        self.health_doc = health_doc  # the whole health model
        self.spool_dir = spool_dir  # /healthz: must take a new file
        self.started_at = time.time()
        self.http = HttpServer("admin", limits, metrics)
        for path in ("/metrics", "/health", "/healthz"):
            self.http.route(path, self._route)
        self.console: Console | None = None

    def add_console(self, users_file: Path | None, spool_dir: Path) -> None:
        """The operator console under /console (relay/ops/console)."""
        from relay.ops.console.app import Console

        self.console = Console(self.writer, self.metrics, self.health_doc, spool_dir, users_file)
        self.console.install(self.http)

    async def start(self, host: str, port: int) -> None:
        await self.http.start(host, port)
        if self.console is not None:
            self.console.start()

    @property
    def port(self) -> int:
        return self.http.port

    async def stop(self) -> None:
        if self.console is not None:
            await self.console.stop()
        await self.http.stop()

    async def _route(self, req: Request) -> Response:
        path = req.path
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
        if self.spool_dir is not None and (why := await self._spool_writable()) is not None:
            problems.append(why)
        doc = {
            "status": "ok" if not problems else "unhealthy",
            "problems": problems,
            "uptime_seconds": round(time.time() - self.started_at, 1),
        }
        return Response(
            200 if not problems else 503, json.dumps(doc).encode() + b"\n", "application/json"
        )

    async def _spool_writable(self) -> str | None:
        assert self.spool_dir is not None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                return await asyncio.to_thread(probe_writable, self.spool_dir)
        except TimeoutError:
            return f"spool folder not writable: no new file within {PROBE_TIMEOUT:g} s"

    async def metrics_text(self) -> bytes:
        m = self.metrics
        # beside the writer, and only what the gauges show: at a million queued rows the
        # whole `stats` took ~0.5 s, and on the writer every 250 waited for it each scrape
        by_state, oldest_age = await self.writer.read(lambda c: ops.queue_gauges(c))
        for state, n in by_state.items():
            m.queue_depth.labels(state).set(n)
        m.oldest_age.set(oldest_age or 0)
        return m.exposition()  # with the inbound processes' samples
