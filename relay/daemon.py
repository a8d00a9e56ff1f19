"""Wiring: listeners, spool writer, delivery engine, admin endpoint, signals, sd_notify.

Rules:
- One event loop. Listeners are `loop.create_server(...)` with aiosmtpd's protocol, never
  aiosmtpd's Controller (which runs its own thread and loop).
- Start order: config -> spool (migrate, recover) -> engine -> listeners -> admin -> READY=1.
- SIGTERM/SIGINT: new connections get `421 4.3.2`, SMTP transactions in flight finish, the
  engine stops claiming and lets deliveries finish up to `shutdown_timeout`, claims not
  finished go back to `deferred` (due now), then the spool closes. Nothing stays `sending`.
- SIGHUP: reload the config; a bad one is logged and the old one kept. Listener addresses
  and the spool path need a restart; limits, destinations, lanes, retry, log level reload,
  and so do a listener's TLS certificate and AUTH users file (for new connections, on
  implicit-TLS listeners too: relay/tls_listener.py).
- Before the loop starts, the soft RLIMIT_NOFILE is raised to the hard limit; a
  `limits.max_connections` that cannot fit under it exits 78 (relay/fdlimit.py).
- One InboundGuard for every listener: connection counts, AUTH checks and bans are per
  daemon, not per listener.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from relay import __version__, faults, fdlimit, smtpd_adapter
from relay.admin import AdminServer
from relay.alerts import run_alert
from relay.config import Config, ConfigError, ListenerTLS, load_config
from relay.delivery import smtpclient_adapter
from relay.delivery.engine import Engine
from relay.dsn import queue_dsn
from relay.guard import InboundGuard
from relay.inbound import InboundHandler, InboundStats, Suppressions
from relay.logs import log_event, reconfigure, setup_logging
from relay.metrics import Metrics
from relay.sdnotify import Notifier, watchdog_loop
from relay.spool import bodies, ops
from relay.spool.writer import SpoolWriter
from relay.tls_listener import implicit_context

log = logging.getLogger(__name__)

MAINTENANCE_EVERY = 2.0  # seconds: suppression refresh, runtime snapshot (CLI sees <= 2 s)
PRUNE_EVERY = 600.0
# Listen backlog: during a connection flood the kernel's accept queue must not overflow, or
# an app's SYN is dropped and retried only after a second (the default is 100).
LISTEN_BACKLOG = 1024


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.writer = SpoolWriter(config.spool_path)
        self.suppressions = Suppressions()
        self.stats = InboundStats(metrics=self.metrics)
        self.guard = InboundGuard(config, self.metrics)
        self.fd_limit = 0  # the soft RLIMIT_NOFILE, set by serve()
        self.handlers: list[InboundHandler] = []
        self.servers: list[asyncio.Server] = []
        self.engine: Engine | None = None
        self.admin: AdminServer | None = None
        self.notifier = Notifier()
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_at = time.time()

    # --- lifecycle ------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.writer.on_commit = self._on_commit
        await asyncio.to_thread(self.writer.start)
        await self.suppressions.refresh(self.writer)
        self.engine = Engine(
            self.config, self.writer, metrics=self.metrics,
            on_dead_letter=self._dead_letter, is_suppressed=self.suppressions.get,
            on_suppressed=self.suppressions.add_local, clock=faults.now,
        )
        for lst in self.config.listen:
            h = InboundHandler(self.config, lst, self.writer, self.suppressions,
                               on_queued=self.engine.wake, stats=self.stats,
                               guard=self.guard)
            tls: dict[str, Any] = {}
            if lst.tls is not None and lst.tls.implicit:  # RFC 8314 §3
                tls = {"ssl": implicit_context(lst.tls, _current_tls(h)),
                       "ssl_handshake_timeout": self.config.limits.command_timeout}
            srv = await loop.create_server(h.protocol, host=lst.host, port=lst.port,
                                           reuse_address=True, backlog=LISTEN_BACKLOG,
                                           **tls)
            self.handlers.append(h)
            self.servers.append(srv)
        if self.config.admin_listen is not None:
            self.admin = AdminServer(self)
            await self.admin.start(*self.config.admin_listen)
        for sig, fn in ((signal.SIGTERM, self._stop.set), (signal.SIGINT, self._stop.set),
                        (signal.SIGHUP, self._reload.set)):
            loop.add_signal_handler(sig, fn)
        self._tasks = [
            loop.create_task(self.engine.run(), name="engine"),
            loop.create_task(self._maintenance(), name="maintenance"),
            loop.create_task(self._reloader(), name="reloader"),
            loop.create_task(watchdog_loop(self.notifier, self.notifier.watchdog_interval()),
                             name="watchdog"),
        ]
        addrs = [f"{lst.host}:{s.sockets[0].getsockname()[1]}"
                 for lst, s in zip(self.config.listen, self.servers, strict=True)]
        log_event(log, logging.INFO, "startup", "relay is ready", version=__version__,
                  listen=addrs, spool=str(self.config.spool_path),
                  mode=self.config.upstream.mode,
                  loop=type(loop).__module__.partition(".")[0])  # uvloop | asyncio
        self.notifier.ready()
        self.notifier.status(f"accepting on {', '.join(addrs)}")
        await self._stop.wait()
        await self.shutdown()
        return 0

    async def shutdown(self) -> None:
        log_event(log, logging.INFO, "shutdown", "stopping: refusing new mail, finishing"
                  " what is in flight")
        self.notifier.stopping()
        for h in self.handlers:
            h.closing = True
        deadline = time.monotonic() + self.config.shutdown_timeout
        # let SMTP transactions in DATA finish (their 250 depends on the spool)
        while any(h.in_flight for h in self.handlers) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        # the listeners stay open while deliveries drain: a new client gets 421 4.3.2, not a
        # refused connection (RFC 5321 §3.8)
        assert self.engine is not None
        await self.engine.stop(max(0.0, deadline - time.monotonic()))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.servers:
            s.close()
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except TimeoutError:
                pass
        await self._write_runtime()
        if self.admin is not None:
            await self.admin.stop()
        await asyncio.to_thread(self.writer.close)
        self.guard.close()
        log_event(log, logging.INFO, "shutdown", "stopped cleanly")

    # --- background work ----------------------------------------------------------------

    async def _maintenance(self) -> None:
        last_prune = -PRUNE_EVERY  # first pass at start: expired keys, orphan bodies
        while True:
            try:
                await self.suppressions.refresh(self.writer)
                await self._write_runtime()
                # spool.retention 0: a finished message (and its body: reset links, one-time
                # codes) is gone within one maintenance tick of its last recipient
                if (time.monotonic() - last_prune > PRUNE_EVERY
                        or self.config.retention == 0):
                    last_prune = time.monotonic()
                    await self._prune()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event(log, logging.ERROR, "maintenance_error", "maintenance pass failed", exc=e)
            await asyncio.sleep(MAINTENANCE_EVERY)
            if self.engine is not None:
                self.engine.wake()  # pick up CLI changes (retry, release, flush) promptly

    async def _write_runtime(self) -> None:
        if self.engine is None:
            return
        snap = self.engine.snapshot()
        snap["pid"] = os.getpid()
        snap["started_at"] = ops.iso_utc(self.started_at)
        snap["inbound"] = {"accepted": self.stats.accepted,
                           "deduplicated": self.stats.deduplicated,
                           "rejected": self.stats.rejected, "sessions": self.stats.sessions}
        now = time.time()
        await self.writer.run(lambda c: ops.put_runtime(c, "daemon", snap, now))

    async def _prune(self) -> None:
        now = time.time()
        window = self.config.dedup_window
        retention = self.config.retention
        paths = await self.writer.run(lambda c: ops.prune(c, now, window, retention))
        known = await self.writer.run(ops.body_paths)
        await asyncio.to_thread(bodies.delete_bodies, self.config.spool_path, paths)
        removed = await asyncio.to_thread(bodies.sweep, self.config.spool_path, known)
        if paths or removed:
            log_event(log, logging.INFO, "pruned", "finished messages and orphan bodies removed",
                      messages=len(paths), orphan_bodies=len(removed))

    async def _reloader(self) -> None:
        while True:
            await self._reload.wait()
            self._reload.clear()
            try:
                self.reload()
            except Exception as e:  # never lose the reloader: later SIGHUPs must work
                log_event(log, logging.ERROR, "config_rejected",
                          "reload failed; keeping the running config", exc=e)

    def _keep_restart_only(self, new: Config) -> Config:
        """Listener addresses, the spool path and the upstream mode are fixed for the life
        of the process (open sockets, the open database, jobs grouped by destination); a
        reload that changes them keeps the running values and says so."""
        old = self.config
        keep: dict[str, Any] = {}
        if [(x.host, x.port) for x in new.listen] != [(x.host, x.port) for x in old.listen]:
            keep["listen"] = old.listen
        if new.spool_path != old.spool_path:
            keep["spool_path"] = old.spool_path
        if new.upstream.mode != old.upstream.mode:
            keep["upstream"] = dataclasses.replace(new.upstream, mode=old.upstream.mode)
        if keep:
            names = {"listen": "listen", "spool_path": "spool.path", "upstream": "upstream.mode"}
            log_event(log, logging.WARNING, "config_reloaded",
                      "these changes need a restart; the running values are kept",
                      keys=[names[k] for k in keep])
            new = dataclasses.replace(new, **keep)
        return new

    def reload(self) -> bool:
        self.notifier.reloading()
        assert self.engine is not None
        try:
            new = self._keep_restart_only(load_config(self.config.path))
            if self.fd_limit and (err := fdlimit.problem(new, self.fd_limit)) is not None:
                raise ConfigError(err)
            self.engine.reconfigure(new)  # validates what only the engine builds
        except (ConfigError, ValueError, OSError) as e:
            log_event(log, logging.ERROR, "config_rejected",
                      "new config rejected; keeping the running one", error=str(e))
            self.notifier.ready()
            return False
        self.config = new
        self.guard.reconfigure(new)
        by_name = {lst.name: lst for lst in new.listen}
        for h in self.handlers:
            h.reconfigure(new)
            if h.listener.name in by_name:
                lst = by_name[h.listener.name]
                if (lst.host, lst.port) == (h.listener.host, h.listener.port):
                    h.listener = lst
        reconfigure(new.log.level, new.log.format, new.log.unmask)
        log_event(log, logging.INFO, "config_reloaded", "configuration reloaded")
        self.notifier.ready()
        return True

    # --- hooks ----------------------------------------------------------------------------

    def _on_commit(self, seconds: float, jobs: int) -> None:
        self.metrics.commit_latency.observe(seconds)
        self.metrics.commit_batch.observe(jobs)

    async def _dead_letter(self, doc: dict[str, Any]) -> None:
        cfg = self.config
        if cfg.alerts.command:
            await run_alert(cfg.alerts.command, doc, cfg.alerts.timeout)
        if cfg.dsn.enabled and doc.get("sender"):
            try:
                await queue_dsn(self, doc)
            except Exception as e:
                log_event(log, logging.ERROR, "dsn_failed", "could not queue a DSN", exc=e,
                          queue_id=doc.get("queue_id"))


def _current_tls(handler: InboundHandler) -> Callable[[], ListenerTLS | None]:
    """The listener's TLS as configured now (SIGHUP replaces handler.listener)."""
    return lambda: handler.listener.tls


def _run_loop(main: Coroutine[Any, Any, int], kind: str) -> int:
    """uvloop when installed (libuv: about twice asyncio's socket throughput, which is what
    an SMTP relay spends its CPU on); the standard loop otherwise, or when
    RELAY_EVENT_LOOP=asyncio.

    Inbound STARTTLS (aiosmtpd wraps the connection in asyncio.sslproto.SSLProtocol and
    swaps it in with transport.set_protocol) works on uvloop's transports too, so a listener
    with `tls` needs no fallback to the standard loop: tests/test_inbound_auth.py checks it
    against the daemon as spawned, under uvloop, and under RELAY_EVENT_LOOP=asyncio."""
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            uvloop = None  # type: ignore[assignment]
        if uvloop is not None:
            return uvloop.run(main)
    return asyncio.run(main)


def serve(config_path: str | None) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as e:
        print(f"relay: {e}", flush=True, file=sys.stderr)
        return 78
    fd_limit = fdlimit.raise_soft_limit()
    err = fdlimit.problem(config, fd_limit)
    if err is not None:
        print(f"relay: {err}", flush=True, file=sys.stderr)
        return 78
    setup_logging(config.log.level, config.log.format, config.log.unmask)
    faults.load_env()
    try:
        smtpd_adapter.check()
        smtpclient_adapter.check()
    except (smtpd_adapter.AdapterError, smtpclient_adapter.AdapterError) as e:
        log_event(log, logging.ERROR, "startup_failed", str(e))
        return 70  # EX_SOFTWARE: the installed library is not one we support
    try:
        daemon = Daemon(config)
        daemon.fd_limit = fd_limit
        return _run_loop(daemon.run(), os.environ.get("RELAY_EVENT_LOOP", "auto"))
    except OSError as e:
        log_event(log, logging.ERROR, "startup_failed", str(e))
        return 71  # EX_OSERR
    except KeyboardInterrupt:
        return 0


