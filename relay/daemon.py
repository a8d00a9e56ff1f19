"""Composition: builds the parts, starts them in order, reloads and stops them.

Rules:
- One event loop. Listeners are `loop.create_server(...)` with our SMTP protocol
  (relay/inbound/transport.py), one object per connection.
- Each part is built with everything it needs (no attribute set after construction); what
  reloads reads the config through `lambda: self.config`. The parts: the spool writer and
  its lock (relay/spool/lock.py), the engine, the health monitor (relay/ops/monitor.py),
  maintenance (relay/ops/maintenance.py), the inbound processes' supervisor
  (relay/inbound/supervisor.py), the maildrop importer, the outbox, feedback, alerts, the
  admin and public HTTP listeners, the start-up DNS check
  (relay/authenticity/startup_check.py), the DSN hook (relay/delivery/dsn.py).
- Start order: config -> spool (lock, migrate, recover) -> engine -> listeners -> admin ->
  inbound processes -> READY=1.
- SIGTERM/SIGINT: new connections get `421 4.3.2`, SMTP transactions in flight finish, the
  engine stops claiming and lets deliveries finish up to `shutdown_timeout`, claims not
  finished go back to `deferred` (due now); the daemon's own tasks are stopped
  (relay/ops/tasks.py); then the spool closes. Nothing stays `sending`.
- SIGHUP: reload the config; a bad one is logged and the old one kept. Listener addresses
  and the spool path need a restart; limits, destinations, lanes, retry, log level reload,
  and so do a listener's TLS certificate and AUTH users file (for new connections, on
  implicit-TLS listeners too: relay/inbound/tls_listener.py).
- Before the loop starts, the soft RLIMIT_NOFILE is raised to the hard limit; a
  `limits.max_connections` that cannot fit under it exits 78 (relay/inbound/fdlimit.py).
- One InboundGuard for every listener: connection counts, AUTH checks and bans are per
  daemon, not per listener.
- Health is measured every second by relay/ops/monitor.py (its rules: the checks, the
  alerts, /health, health.json, inbound's 451/452 refusal).
- The maildrop (relay/spool/maildrop.py) is created at start when missing and imported at start
  and every second (relay/spool/pickup.py); its `maildrop` health check warns when a file waits
  there over a minute. The importer stops first at shutdown, while the listeners still
  answer the submission in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any

from relay import __version__
from relay.authenticity.unsubscribe_http import UnsubscribeHandler
from relay.config.tree import Config, ConfigError, load_config
from relay.delivery import dsn, smtpclient_adapter
from relay.delivery.engine import Engine
from relay.feedback.service import FeedbackService
from relay.inbound import fdlimit
from relay.inbound.guard import InboundGuard
from relay.inbound.handler import InboundHandler, Suppressions
from relay.inbound.processes import NOTIFY_ENV, ROLE_ENV, STATS_ENV, InboundProcess, listen
from relay.inbound.stats import InboundStats
from relay.inbound.supervisor import Supervisor
from relay.ops import alerts, faults, runtime, tasks
from relay.ops.admin import AdminServer
from relay.ops.http import HttpLimits, HttpServer
from relay.ops.logs import log_event, reconfigure, redact_text, set_secrets, setup_logging
from relay.ops.maintenance import Maintenance
from relay.ops.metrics import Metrics
from relay.ops.monitor import CommitWatch, Monitor
from relay.ops.sdnotify import Notifier, watchdog_loop
from relay.spool import maildrop, pickup
from relay.spool.lock import lock_spool
from relay.spool.outbox import Outbox
from relay.spool.submit import Target
from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN = 15.0  # seconds past shutdown_timeout before the shutdown watchdog fires
# Listen backlog: during a connection flood the kernel's accept queue must not overflow, or
# an app's SYN is dropped and retried only after a second (the default is 100).
LISTEN_BACKLOG = 1024


def _http_limits(max_connections: int, per_ip: int, max_body: int) -> HttpLimits:
    return HttpLimits(
        max_connections=max_connections, max_connections_per_ip=per_ip, max_body=max_body
    )


def keep_restart_only(old: Config, new: Config) -> Config:
    """Listener addresses, the spool path and the upstream mode are fixed for the life
    of the process (open sockets, the open database, jobs grouped by destination); a
    reload that changes them keeps the running values and says so."""
    keep: dict[str, Any] = {}
    if [(x.host, x.port) for x in new.listen] != [(x.host, x.port) for x in old.listen]:
        keep["listen"] = old.listen
    if new.spool_path != old.spool_path:
        keep["spool_path"] = old.spool_path
    if new.upstream.mode != old.upstream.mode:
        keep["upstream"] = dataclasses.replace(new.upstream, mode=old.upstream.mode)
        keep["routing"] = old.routing  # the routes that mode implies
    if keep:
        names = {"listen": "listen", "spool_path": "spool.path", "upstream": "upstream.mode"}
        log_event(
            log,
            logging.WARNING,
            "config_reloaded",
            "these changes need a restart; the running values are kept",
            keys=[names[k] for k in keep if k in names],
        )
        new = dataclasses.replace(new, **keep)
    return new


class Daemon:
    """Builds the parts, starts them in order, reloads and stops them: nothing else. Each
    part is built with everything it needs; the config it reads through `lambda:
    self.config` (a reload replaces it)."""

    def __init__(self, config: Config, fd_limit: int = 0) -> None:
        self.config = config
        self.fd_limit = fd_limit  # the soft RLIMIT_NOFILE (serve()); 0: not checked
        self.started_at = time.time()
        self.metrics = Metrics()
        self.commits = CommitWatch(self.metrics)
        self.writer = SpoolWriter(
            config.spool_path,
            config.spool_pg,
            self.commits.observe,
            gather=lambda: self.config.spool_gather,  # a reload's value from its next batch
        )
        self.suppressions = Suppressions()
        self.stats = InboundStats(metrics=self.metrics)
        self.guard = InboundGuard(config, self.metrics)
        self.handlers: list[InboundHandler] = []
        self.servers: list[asyncio.Server] = []
        self.notifier = Notifier()
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.alerts = alerts.Dispatcher(
            self.writer, lambda: self.config.alerts, lambda: self.config.hostname, faults.now
        )
        self.inbound = Supervisor(
            lambda: self.config,
            self._stop.is_set,
            self._wake,
            absorb=self._absorb,
            retire=self._retire,
        )
        self.outbox = (  # README "The transactional outbox"
            Outbox(lambda: self.config, self.writer, self._wake) if config.outbox.enabled else None
        )
        self.pickup = pickup.Pickup(
            lambda: self.config.maildrop_dir(),
            self._pickup_target,
            self.alerts.add,
            time.time,
            lambda: self.config.limits.max_message_size,
        )
        self._pickup_task: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None  # relay/spool/lock.py, SQLite spools
        # built in run(), in start order (each needs what starts before it)
        self.engine: Engine | None = None
        self.admin: AdminServer | None = None
        self.feedback_http: HttpServer | None = None

    def _wake(self) -> None:
        """New mail queued (an inbound process, the outbox, a DSN): the engine claims it."""
        if self.engine is not None:
            self.engine.wake()

    def _absorb(self, source: str, payload: dict[str, Any]) -> None:
        """An inbound process's counters (relay/inbound/supervisor.py): into /metrics, the
        console's series and `relay status`."""
        rows, counts = payload.get("metrics"), payload.get("stats")
        if isinstance(rows, list):
            self.metrics.absorb(source, rows)
        if isinstance(counts, dict):
            self.stats.absorb(source, counts)

    def _retire(self, source: str) -> None:
        self.metrics.retire(source)
        self.stats.retire(source)

    async def _dead_letter(self, doc: dict[str, Any]) -> None:
        """The engine's dead-letter hook: the DSN to the sender (relay/delivery/dsn.py)."""
        await dsn.on_dead_letter(self.config, self.writer, doc, self._wake)

    # --- lifecycle ------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.config.spool_pg is None:
            self._lock_fd = lock_spool(self.config.spool_path)
            if self._lock_fd is None:
                return 75  # EX_TEMPFAIL
        await asyncio.to_thread(self.writer.start)
        await self._make_maildrop()
        await self.suppressions.refresh(self.writer)
        await self._start_feedback()
        for warning in self.config.warnings():
            log_event(log, logging.WARNING, "config_warning", warning)
        engine = await self._build_engine()
        await self._start_listeners(loop, engine)
        await self._start_http()
        for sig, fn in (
            (signal.SIGTERM, self._stop.set),
            (signal.SIGINT, self._stop.set),
            (signal.SIGHUP, self._reload.set),
        ):
            loop.add_signal_handler(sig, fn)
        if self.config.inbound_processes:
            await self.inbound.start(loop)
        if self.outbox is not None:
            self.outbox.start()
        self._pickup_task = loop.create_task(self.pickup.run(), name="maildrop")
        await self.monitor.check()
        self._tasks = [
            loop.create_task(engine.run(), name="engine"),
            loop.create_task(self.monitor.run(), name="health"),
            loop.create_task(self.alerts.run(), name="alerts"),
            loop.create_task(self.maintenance.run(), name="maintenance"),
            loop.create_task(self._reloader(), name="reloader"),
            loop.create_task(self._check_dkim_dns(), name="dkim-dns"),
            loop.create_task(
                watchdog_loop(self.notifier, self.notifier.watchdog_interval()), name="watchdog"
            ),
        ]
        runtime.settle_collector()  # start-up's objects frozen, young ones collected less often
        self._ready(loop)
        await self._stop.wait()
        await self.shutdown()
        return 0

    async def _start_feedback(self) -> None:
        """Bounces and complaints (relay/feedback/), and the one-click unsubscribe endpoint
        that suppresses through them."""
        self.feedback = FeedbackService(
            lambda: self.config,
            self.writer,
            self.metrics,
            lambda: (self.config.alerts.coalesce, alerts.sinks_of(self.config.alerts)),
            self.suppressions.add_local,
            faults.now,
        )
        await self.feedback.start()
        self.unsubscribe = UnsubscribeHandler(
            lambda: self.config.unsubscribe_confs(), self.feedback.suppress_for
        )

    async def _build_engine(self) -> Engine:
        """The engine, and the parts that watch it: maintenance (the runtime snapshot it
        writes, the failing times it restores) and the health monitor."""
        engine = self.engine = Engine(
            self.config,
            self.writer,
            metrics=self.metrics,
            on_dead_letter=self._dead_letter,
            is_suppressed=self.suppressions.get,
            on_suppressed=self.suppressions.add_local,
            clock=faults.now,
            verp_sender=self.feedback.verp_sender,
            on_recorded=self.outbox.touched if self.outbox is not None else None,
        )
        self.maintenance = Maintenance(
            lambda: self.config, self.writer, engine, self.suppressions, self.stats, self.started_at
        )
        await self.maintenance.restore()
        self.monitor = Monitor(
            lambda: self.config,
            self.writer,
            self.metrics,
            self.alerts,
            self.commits,
            engine,
            self.pickup,
            servers=self.servers,
            handlers=self.handlers,
            inbound_running=self.inbound.running,
            stopping=self._stop.is_set,
            started_at=self.started_at,
        )
        return engine

    async def _start_listeners(self, loop: asyncio.AbstractEventLoop, engine: Engine) -> None:
        """One handler and server per `listen` entry; none with inbound processes (they hold
        the listeners and this process delivers)."""
        for lst in self.config.listen if not self.config.inbound_processes else ():
            h = InboundHandler(
                self.config,
                lst,
                self.writer,
                self.suppressions,
                on_queued=engine.wake,
                stats=self.stats,
                guard=self.guard,
                gate=self.monitor.refusal_now,
                feedback=self.feedback,
            )
            # a fleet on PostgreSQL: several daemons on one machine may share the port
            # (SO_REUSEPORT; the kernel spreads connections; README "Running a fleet")
            pg = self.config.spool_pg is not None
            srv = await listen(loop, h, self.config, LISTEN_BACKLOG, reuse_port=pg)
            self.handlers.append(h)
            self.servers.append(srv)

    def _ready(self, loop: asyncio.AbstractEventLoop) -> None:
        addrs = (
            [
                f"{lst.host}:{s.sockets[0].getsockname()[1]}"
                for lst, s in zip(self.config.listen, self.servers, strict=True)
            ]
            if self.servers
            else [f"{lst.host}:{lst.port}" for lst in self.config.listen]
        )
        log_event(
            log,
            logging.INFO,
            "startup",
            "relay is ready",
            version=__version__,
            listen=addrs,
            spool=str(self.config.spool_path),
            mode=self.config.upstream.mode,
            loop=type(loop).__module__.partition(".")[0],
        )  # uvloop | asyncio
        self.notifier.ready()
        self.notifier.status(f"accepting on {', '.join(addrs)}")

    async def _start_http(self) -> None:
        """The admin listener (metrics, health, console) and the public routes: on
        `feedback.listen`, else on the admin listener."""
        fb = self.config.feedback
        if self.config.admin_listen is not None:
            self.admin = AdminServer(
                self.metrics,
                self.writer,
                self.monitor.readiness_problems,
                self.monitor.doc,
                self.config.spool_path,
                _http_limits(
                    self.config.admin_http.max_connections,
                    self.config.admin_http.max_connections_per_ip,
                    fb.max_body,
                ),
            )
            if self.config.admin_console:  # README "Console"
                self.admin.add_console(self.config.admin_users_file, self.config.spool_path)
            # the feedback endpoints share the admin listener unless they have their own
            if fb.listen is None:
                self._public_routes(self.admin.http)
            await self.admin.start(*self.config.admin_listen)
        if fb.listen is not None:
            self.feedback_http = HttpServer(
                "feedback",
                _http_limits(fb.http.max_connections, fb.http.max_connections_per_ip, fb.max_body),
                self.metrics,
            )
            self._public_routes(self.feedback_http)
            await self.feedback_http.start(*fb.listen)

    async def shutdown(self) -> None:
        log_event(
            log,
            logging.INFO,
            "shutdown",
            "stopping: refusing new mail, finishing what is in flight",
        )
        self.notifier.stopping()
        # a watchdog off the event loop: a shutdown stuck past shutdown_timeout plus a
        # margin writes every thread's stack to stderr (the journal) and exits; the spool
        # is durable, the next start recovers any claim left `sending`
        faulthandler.dump_traceback_later(self.config.shutdown_timeout + SHUTDOWN_MARGIN, exit=True)
        if self._pickup_task is not None:  # its submission in flight still gets its reply
            self.pickup.stop()
            await asyncio.gather(self._pickup_task, return_exceptions=True)
        for h in self.handlers:
            h.closing = True
        # no password check from now on (AUTH gets 454 4.7.0, try later): the CPU is for
        # the drain, and no check may outlive the loop in a thread pool
        self.guard.close()
        deadline = time.monotonic() + self.config.shutdown_timeout
        await self.inbound.stop(deadline)
        # let SMTP transactions in DATA finish (their 250 depends on the spool)
        while any(h.in_flight for h in self.handlers) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        # the listeners stay open while deliveries drain: a new client gets 421 4.3.2, not a
        # refused connection (RFC 5321 §3.8)
        assert self.engine is not None
        if self.outbox is not None:  # no new rows taken while the engine drains
            await self.outbox.stop()
        await self.engine.stop(max(0.0, deadline - time.monotonic()))
        if self.engine.mta_sts is not None:
            await self.engine.mta_sts.aclose()
        await tasks.stop_tasks(self._tasks)
        for s in self.servers:
            s.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await s.wait_closed()
        await self.maintenance.write_runtime()
        self.monitor.remove_file()
        if self.admin is not None:
            await self.admin.stop()
        if self.feedback_http is not None:
            await self.feedback_http.stop()
        await self.feedback.close()
        await asyncio.to_thread(self.writer.close)
        faulthandler.cancel_dump_traceback_later()
        log_event(log, logging.INFO, "shutdown", "stopped cleanly")

    async def _make_maildrop(self) -> None:
        """The maildrop folder, with its mode, when missing (relay/spool/maildrop.py). A failure
        is logged, never fatal: the daemon still takes SMTP; relay-sendmail then exits 75
        when it cannot reach us."""
        folder = self.config.maildrop_dir()
        try:
            warnings = await asyncio.to_thread(maildrop.ensure_folder, folder)
        except OSError as e:
            warnings = [f"cannot create the maildrop {folder}: {e.strerror or e}"]
        for w in warnings:
            log_event(log, logging.WARNING, "config_warning", w)

    def _pickup_target(self) -> Target:
        """Our own first listener, where the maildrop's files are submitted."""
        lst = self.config.listen[0]
        port = lst.port
        if self.servers:  # the bound port (a test may listen on port 0)
            port = self.servers[0].sockets[0].getsockname()[1]
        return pickup.target_of(lst.host, port, self.config.hostname)

    async def _check_dkim_dns(self) -> None:
        # imported here: an inbound process (which imports this module) never runs it
        from relay.authenticity.startup_check import log_dns_checks

        await log_dns_checks(self.config.dkim, self.config.upstream.mx.nameservers)

    def _public_routes(self, server: HttpServer) -> None:
        """What may face the providers and the recipients: the feedback webhooks and the
        one-click unsubscribe pages (on `feedback.listen`, else on the admin listener)."""
        server.route("/feedback/", self.feedback.http, prefix=True)
        server.route("/u/", self.unsubscribe.http, prefix=True)

    # --- reload (SIGHUP) ------------------------------------------------------------------

    async def _reloader(self) -> None:
        while True:
            await self._reload.wait()
            self._reload.clear()
            try:
                self.reload()
            except Exception as e:  # never lose the reloader: later SIGHUPs must work
                log_event(
                    log,
                    logging.ERROR,
                    "config_rejected",
                    "reload failed; keeping the running config",
                    exc=e,
                )

    def reload(self) -> bool:
        """Validate the new config, then hand it to every part that reloads."""
        self.notifier.reloading()
        assert self.engine is not None
        try:
            new = keep_restart_only(self.config, load_config(self.config.path))
            if self.fd_limit and (err := fdlimit.problem(new, self.fd_limit)) is not None:
                raise ConfigError(err)
            self.engine.reconfigure(new)  # validates what only the engine builds
        except (ConfigError, ValueError, OSError) as e:
            log_event(
                log,
                logging.ERROR,
                "config_rejected",
                "new config rejected; keeping the running one",
                error=str(e),
            )
            self.notifier.ready()
            return False
        set_secrets({**self.config.secrets(), **new.secrets()})  # old ones may be in flight
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
        self.inbound.reload()
        log_event(log, logging.INFO, "config_reloaded", "configuration reloaded")
        self.notifier.ready()
        return True


def _run_loop(main: Coroutine[Any, Any, int], kind: str) -> int:
    """uvloop when installed (libuv: about twice asyncio's socket throughput, which is what
    an SMTP relay spends its CPU on); the standard loop otherwise, or when
    RELAY_EVENT_LOOP=asyncio.

    Inbound STARTTLS (`loop.start_tls`, relay/inbound/transport.py) works on uvloop's
    transports too, so a listener with `tls` needs no fallback to the standard loop:
    tests/e2e/test_inbound_auth_e2e.py checks it against the daemon as spawned, under uvloop, and
    under RELAY_EVENT_LOOP=asyncio."""
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
        print(f"relay: {redact_text(str(e))}", flush=True, file=sys.stderr)
        return 78
    set_secrets(config.secrets())  # before anything logs: the formatter hides them
    fd_limit = fdlimit.raise_soft_limit()
    err = fdlimit.problem(config, fd_limit)
    if err is not None:
        print(f"relay: {err}", flush=True, file=sys.stderr)
        return 78
    setup_logging(config.log.level, config.log.format, config.log.unmask)
    faults.load_env()
    try:
        smtpclient_adapter.check()
    except smtpclient_adapter.AdapterError as e:
        log_event(log, logging.ERROR, "startup_failed", str(e))
        return 70  # EX_SOFTWARE: the installed library is not one we support
    try:
        if os.environ.get(ROLE_ENV) == "inbound":  # started by a main process
            fd, stats_fd = os.environ.get(NOTIFY_ENV), os.environ.get(STATS_ENV)
            child = InboundProcess(
                config,
                int(fd) if fd else None,
                LISTEN_BACKLOG,
                int(stats_fd) if stats_fd else None,
            )
            return _run_loop(child.run(), os.environ.get("RELAY_EVENT_LOOP", "auto"))
        daemon = Daemon(config, fd_limit)
        return _run_loop(daemon.run(), os.environ.get("RELAY_EVENT_LOOP", "auto"))
    except OSError as e:
        log_event(log, logging.ERROR, "startup_failed", str(e))
        return 71  # EX_OSERR
    except KeyboardInterrupt:
        return 0
