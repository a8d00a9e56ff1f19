"""Inbound processes (`inbound.processes: N`): more SMTP listeners on the same ports and
the same spool, so that taking mail and delivering it use more than one core.

Rules:
- The main process (relay/inbound/supervisor.py) starts N of these (`relay serve` re-executed with
  RELAY_ROLE=inbound), waits until they listen, restarts one that dies, forwards SIGHUP,
  and stops them first at shutdown. The main process then listens for SMTP no more: it
  delivers, and serves admin, metrics and health, on a core of its own. Listener sockets
  are bound with SO_REUSEPORT: the kernel spreads new connections over the processes.
- An inbound process accepts and spools exactly as the main process does
  (relay/inbound/: same checks, same replies, `250` only after the commit), with a spool
  writer of its own. The writers of all processes take turns through an flock on the
  spool's lock file (relay/spool/writer.py), so dedup keys stay one set: a resubmission is
  answered `250` and queued once, whichever process takes it.
- After the messages it queues it writes one byte to a pipe the main process reads (one
  per turn of its event loop, however many it queued in that turn): the engine claims the
  new mail at once instead of at its next poll.
- Its log lines are written once per turn of its event loop (relay/ops/logs.py
  `lines_per_turn`), not one write each.
- It runs no delivery, no admin or metrics endpoint, no health checks and no alerts: those
  stay in the main process. Its counters (relay/ops/metrics.py, relay/inbound/stats.py) go
  to the main process once a second and at exit, on a socket of its own (STATS_ENV), so
  /metrics, the console and `relay status` count the mail every process takes. Its per-IP
  limits and AUTH failure counters are its own (a client spread over N+1 processes may
  open up to N+1 times `max_connections_per_ip`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import time
from typing import Any

from relay.config.tree import Config, ConfigError, load_config
from relay.feedback.service import FeedbackService
from relay.inbound.guard import InboundGuard
from relay.inbound.handler import InboundHandler, Suppressions
from relay.inbound.stats import InboundStats
from relay.inbound.tls_listener import implicit_context
from relay.ops import alerts, faults, runtime
from relay.ops.logs import lines_per_turn, log_event, reconfigure
from relay.ops.metrics import Metrics
from relay.ops.tasks import stop_tasks
from relay.spool.reserve import ReserveGate
from relay.spool.writer import SpoolWriter

log = logging.getLogger("relay.inbound")

ROLE_ENV = "RELAY_ROLE"  # "inbound" in a process the main one started
NOTIFY_ENV = "RELAY_NOTIFY_FD"  # the pipe's write end, inherited
STATS_ENV = "RELAY_STATS_FD"  # this process's end of its counters socket, inherited
STATS_EVERY = 1.0  # seconds between two snapshots of the counters to the main process
REFRESH_EVERY = 2.0  # seconds: the suppression list, as in the main process
# the WAL's pages past which this process's writer checkpoints (SQLite's default: 1,000):
# the main process's commits do it first (relay/spool/writer.py, the rules)
CHECKPOINT_PAGES = 10_000


class InboundProcess:
    def __init__(
        self,
        config: Config,
        notify_fd: int | None,
        listen_backlog: int,
        stats_fd: int | None = None,
    ) -> None:
        self.config = config
        self.notify_fd = notify_fd
        self.stats_sock = (
            socket.socket(fileno=stats_fd) if stats_fd is not None else None
        )  # SOCK_SEQPACKET: one datagram per snapshot
        self.backlog = listen_backlog
        self.metrics = Metrics()
        self.writer = SpoolWriter(
            config.spool_path,
            config.spool_pg,
            gather=lambda: self.config.spool_gather,
            checkpoint_pages=CHECKPOINT_PAGES,
        )
        self.suppressions = Suppressions()
        self.stats = InboundStats(metrics=self.metrics)
        self.guard = InboundGuard(config, self.metrics)
        self.handlers: list[InboundHandler] = []
        self.servers: list[asyncio.Server] = []
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        # spool.reserve: this process has no health pass; 452 4.3.1 below it, as the daemon
        self._notify_due = False  # a `q` for the main process is scheduled (_queued)
        self.reserve = ReserveGate(lambda: (self.config.spool_path, self.config.spool_reserve))

    def _queued(self) -> None:
        """A message is queued: one `q` to the main process per turn of the event loop, not
        per message (the accepts of one spool commit end in the same turn: one write)."""
        if self.notify_fd is None or self._notify_due:
            return
        self._notify_due = True
        asyncio.get_running_loop().call_soon(self._notify)

    def _notify(self) -> None:
        self._notify_due = False
        if self.notify_fd is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):  # a full pipe: a wake is pending
            os.write(self.notify_fd, b"q")

    def _report(self) -> None:
        """The counters to the main process (whole snapshots: one lost is harmless)."""
        if self.stats_sock is None:
            return
        payload = {"metrics": self.metrics.snapshot(), "stats": self.stats.counts()}
        with contextlib.suppress(OSError):  # a full socket: the next one says the same
            self.stats_sock.send(json.dumps(payload, separators=(",", ":")).encode())

    async def _reporter(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY)
            self._report()

    async def run(self) -> int:
        # the accepted lines of one loop turn (a spool commit's accepts) in one write
        with lines_per_turn(asyncio.get_running_loop()):
            return await self._serve()

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        if self.stats_sock is not None:
            self.stats_sock.setblocking(False)
        _die_with_parent()
        await asyncio.to_thread(self.writer.start)
        await self.suppressions.refresh(self.writer)
        feedback = FeedbackService(
            lambda: self.config,
            self.writer,
            self.metrics,
            lambda: (self.config.alerts.coalesce, alerts.sinks_of(self.config.alerts)),
            self.suppressions.add_local,
            faults.now,
        )
        await feedback.start()
        for lst in self.config.listen:
            h = InboundHandler(
                self.config,
                lst,
                self.writer,
                self.suppressions,
                on_queued=self._queued,
                stats=self.stats,
                guard=self.guard,
                gate=self.reserve.refusal,
                feedback=feedback,
            )
            # reuse_port: several inbound processes on one port
            srv = await listen(loop, h, self.config, self.backlog, reuse_port=True)
            self.handlers.append(h)
            self.servers.append(srv)
        for sig, fn in (
            (signal.SIGTERM, self._stop.set),
            (signal.SIGINT, self._stop.set),
            (signal.SIGHUP, self._reload.set),
        ):
            loop.add_signal_handler(sig, fn)
        tasks = [
            loop.create_task(self.reserve.watch(), name="disk-reserve"),
            loop.create_task(self._refresh(), name="suppressions"),
            loop.create_task(self._reloader(), name="reloader"),
            loop.create_task(self._reporter(), name="counters"),
        ]
        runtime.settle_collector()  # start-up's objects frozen, young ones collected less often
        log_event(
            log, logging.INFO, "startup", "inbound process ready", pid=os.getpid(), role="inbound"
        )
        if self.notify_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.notify_fd, b"r")  # the main process waits for this at start
        await self._stop.wait()
        for h in self.handlers:
            h.closing = True  # new commands get 421 4.3.2
        self.guard.close()  # AUTH gets 454 4.7.0; no check outlives the loop
        # (relay/inbound/guard.py)
        deadline = time.monotonic() + self.config.shutdown_timeout
        while any(h.in_flight for h in self.handlers) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await stop_tasks(tasks)
        for s in self.servers:
            s.close()
        await feedback.close()
        await asyncio.to_thread(self.writer.close)
        self._report()  # the last counts, after the last message
        return 0

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY)
            try:
                await self.suppressions.refresh(self.writer)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event(log, logging.ERROR, "maintenance_error", "refresh failed", exc=e)

    async def _reloader(self) -> None:
        while True:
            await self._reload.wait()
            self._reload.clear()
            try:
                new = load_config(self.config.path)
            except ConfigError as e:  # the main process says so too; keep running as is
                log_event(log, logging.ERROR, "config_rejected", "reload failed", error=str(e))
                continue
            if [(x.host, x.port) for x in new.listen] != [
                (x.host, x.port) for x in self.config.listen
            ] or new.spool_path != self.config.spool_path:
                continue  # needs a restart (the main process logs it)
            self.config = new
            self.guard.reconfigure(new)
            by_name = {lst.name: lst for lst in new.listen}
            for h in self.handlers:
                h.reconfigure(new)
                if h.listener.name in by_name:
                    h.listener = by_name[h.listener.name]
            reconfigure(new.log.level, new.log.format, new.log.unmask)


def _die_with_parent() -> None:
    """SIGTERM when the main process dies, even by SIGKILL (Linux PR_SET_PDEATHSIG): an
    inbound process never outlives it, holding ports the next start needs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


async def listen(
    loop: asyncio.AbstractEventLoop,
    h: InboundHandler,
    config: Config,
    backlog: int,
    reuse_port: bool = False,
) -> asyncio.Server:
    """The SMTP listener of a handler (the main process's or an inbound process's), with
    implicit TLS (RFC 8314 §3) when its listener has it, as configured now (SIGHUP
    replaces handler.listener)."""
    lst = h.listener
    tls: dict[str, Any] = {}
    if lst.tls is not None and lst.tls.implicit:
        tls = {
            "ssl": implicit_context(lst.tls, lambda: h.listener.tls),
            "ssl_handshake_timeout": config.limits.command_timeout,
        }
    return await loop.create_server(
        h.protocol,
        host=lst.host,
        port=lst.port,
        reuse_address=True,
        reuse_port=reuse_port or None,
        backlog=backlog,
        **tls,
    )
