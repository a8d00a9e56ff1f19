"""Wiring: listeners, spool writer, delivery engine, admin endpoint, signals, sd_notify.

Rules:
- One event loop. Listeners are `loop.create_server(...)` with our SMTP protocol
  (relay/inbound/transport.py), one object per connection.
- Start order: config -> spool (migrate, recover) -> engine -> listeners -> admin -> READY=1.
- SIGTERM/SIGINT: new connections get `421 4.3.2`, SMTP transactions in flight finish, the
  engine stops claiming and lets deliveries finish up to `shutdown_timeout`, claims not
  finished go back to `deferred` (due now), then the spool closes. Nothing stays `sending`.
- SIGHUP: reload the config; a bad one is logged and the old one kept. Listener addresses
  and the spool path need a restart; limits, destinations, lanes, retry, log level reload,
  and so do a listener's TLS certificate and AUTH users file (for new connections, on
  implicit-TLS listeners too: relay/inbound/tls_listener.py).
- Before the loop starts, the soft RLIMIT_NOFILE is raised to the hard limit; a
  `limits.max_connections` that cannot fit under it exits 78 (relay/inbound/fdlimit.py).
- One InboundGuard for every listener: connection counts, AUTH checks and bans are per
  daemon, not per listener.
- Health (relay/ops/health.py) is measured every second: listeners, the spool (writable, commit
  latency, the database file still the one we opened), free disk, each destination, the
  queue (oldest waiting, stall; every 5 s), dead letters per hour. A transition is logged
  and raised as an alert (relay/ops/alerts.py); the model is served at /health and /healthz
  and written to `<spool>/health.json` for `relay status`. Inbound answers `451 4.3.0`
  once the spool database was deleted or replaced under us, and `452 4.3.1` while the disk
  is critically full (at MAIL, before anything is accepted that could not be kept).
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
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from typing import Any

from relay import __version__
from relay.authenticity.unsubscribe import UnsubscribeHandler
from relay.cli.sendmail import Target
from relay.config.tree import Config, ConfigError, load_config
from relay.delivery import smtpclient_adapter, views
from relay.delivery.dsn import queue_dsn
from relay.delivery.engine import Engine
from relay.feedback.service import FeedbackService
from relay.inbound import fdlimit
from relay.inbound.guard import InboundGuard
from relay.inbound.handler import InboundHandler, InboundStats, Suppressions
from relay.inbound.processes import NOTIFY_ENV, ROLE_ENV, InboundProcess, listen
from relay.ops import alerts, faults, health
from relay.ops.admin import AdminServer
from relay.ops.http import HttpLimits, HttpServer
from relay.ops.logs import log_event, reconfigure, redact_text, set_secrets, setup_logging
from relay.ops.metrics import Metrics
from relay.ops.sdnotify import Notifier, watchdog_loop
from relay.spool import bodies, db, maildrop, ops, pickup
from relay.spool.outbox import Outbox
from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

MAINTENANCE_EVERY = 2.0  # seconds: suppression refresh, runtime snapshot (CLI sees <= 2 s)
HEALTH_EVERY = 1.0  # seconds between health passes
QUEUE_HEALTH_EVERY = 5.0  # the queue checks scan the recipients table: less often
SLOW_COMMIT = 2.0  # seconds: a group commit slower than this is a warning
HEALTH_FILE = "health.json"
FAILING_SINCE = "failing_since"  # runtime row: upstream -> first failure since its answer
DAEMON_LOCK = "daemon.lock"  # held by the one daemon of a SQLite spool
PRUNE_EVERY = 600.0
SHUTDOWN_MARGIN = 15.0  # seconds past shutdown_timeout before the shutdown watchdog fires
# Listen backlog: during a connection flood the kernel's accept queue must not overflow, or
# an app's SYN is dropped and retried only after a second (the default is 100).
LISTEN_BACKLOG = 1024
INBOUND_START_TIMEOUT = 30.0  # seconds for inbound processes to listen at start


def _http_limits(max_connections: int, per_ip: int, max_body: int) -> HttpLimits:
    return HttpLimits(
        max_connections=max_connections, max_connections_per_ip=per_ip, max_body=max_body
    )


def spool_gone_advice(path: os.PathLike[str], how: str, waiting: int, held: int) -> str:
    """The `spool` check's detail once the database file was deleted or replaced under the
    running daemon. The daemon keeps the old file open and keeps delivering from it, so a
    restart now would discard what it still holds: drain first, then restart (`waiting`
    -1: the count could not be read)."""
    head = (
        f"the spool database {path} was {how} under the running daemon: new mail is refused"
        " (451 4.3.0)"
    )
    if waiting == 0:
        return f"{head}; every recipient in the old file is finished: restart relay now"
    count = "an unknown number of" if waiting < 0 else str(waiting)
    stuck = (
        f" ({held} of them held: they never leave on their own, and `relay queue release`"
        f" cannot reach the old file; a restart discards them)"
        if held > 0
        else ""
    )
    return (
        f"{head}; {count} recipients are still queued in the old file{stuck}. Do not"
        " restart relay yet (a restart discards them): the daemon keeps delivering from the"
        " open file; wait until `relay status` (or GET /health) shows this check with 0"
        " recipients queued (`relay queue list` cannot see the old file), then restart"
        " relay to start a new spool"
    )


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.writer = SpoolWriter(config.spool_path, config.spool_pg)
        self.suppressions = Suppressions()
        self.stats = InboundStats(metrics=self.metrics)
        self.guard = InboundGuard(config, self.metrics)
        self.fd_limit = 0  # the soft RLIMIT_NOFILE, set by serve()
        self.handlers: list[InboundHandler] = []
        self.servers: list[asyncio.Server] = []
        self.engine: Engine | None = None
        self.admin: AdminServer | None = None
        self.feedback_http: HttpServer | None = None
        self.notifier = Notifier()
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_at = time.time()
        self.health = health.Model()
        self.refusal: str | None = None  # what inbound answers while the spool/disk is bad
        self._health_write_failed = False  # health.json could not be written (disk full)
        self.alerts = alerts.Dispatcher(
            self.writer, lambda: self.config.alerts, lambda: self.config.hostname, faults.now
        )
        self._spool_id: tuple[int, int] | None = None
        self._spool_gone = False
        self._commit_max = 0.0
        self._queue_checked = -QUEUE_HEALTH_EVERY
        self._queue_results: list[tuple[str, health.Status, str]] = []
        self._children: list[asyncio.subprocess.Process] = []  # inbound processes
        self._supervisors: list[asyncio.Task[None]] = []
        self._wake_fd: int | None = None
        self._inbound_ready = 0  # `r` bytes read: inbound processes (re)started listening
        self._lock_fd: int | None = None  # DAEMON_LOCK, SQLite spools
        self.outbox: Outbox | None = None
        self.pickup = pickup.Pickup(
            lambda: self.config.maildrop_dir(),
            self._pickup_target,
            self.alerts.add,
            time.time,
            lambda: self.config.limits.max_message_size,
        )
        self._pickup_task: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def _lock_spool(self) -> bool:
        """One daemon per SQLite spool: a second one would take the first one's claims in
        flight for a crash's leftovers and send them again. (A fleet shares a PostgreSQL
        spool through leases instead; more SMTP processes on SQLite: inbound.processes.)
        The lock is held for the life of the process; the kernel drops it at exit."""
        path = self.config.spool_path
        path.mkdir(parents=True, exist_ok=True, mode=0o750)
        fd = os.open(path / DAEMON_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            log_event(
                log,
                logging.ERROR,
                "spool_locked",
                "another relay daemon runs on this spool; not starting a second one",
                spool=str(path),
                pid=holder,
            )
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        return True

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.config.spool_pg is None and not self._lock_spool():
            return 75  # EX_TEMPFAIL
        self.writer.on_commit = self._on_commit
        await asyncio.to_thread(self.writer.start)
        await self._make_maildrop()
        if self.config.spool_pg is None:  # a file that can be deleted or replaced under us
            st = os.stat(db.db_path(self.config.spool_path))
            self._spool_id = (st.st_dev, st.st_ino)
        await self.suppressions.refresh(self.writer)
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
        for warning in self.config.warnings():
            log_event(log, logging.WARNING, "config_warning", warning)
        self.engine = Engine(
            self.config,
            self.writer,
            metrics=self.metrics,
            on_dead_letter=self._dead_letter,
            is_suppressed=self.suppressions.get,
            on_suppressed=self.suppressions.add_local,
            clock=faults.now,
        )
        self.engine.verp_sender = self.feedback.verp_sender
        if self.config.spool_pg is None:  # the failing time of each upstream, as left
            left = await self.writer.run(lambda c: ops.get_runtime(c, FAILING_SINCE))
            if left is not None and isinstance(left[0], dict):
                views.seed_failing_since(self.engine, left[0])
        # with inbound processes, they hold the listeners and this process delivers
        for lst in self.config.listen if not self.config.inbound_processes else ():
            h = InboundHandler(
                self.config,
                lst,
                self.writer,
                self.suppressions,
                on_queued=self.engine.wake,
                stats=self.stats,
                guard=self.guard,
                gate=self._refusal,
                feedback=self.feedback,
            )
            # a fleet on PostgreSQL: several daemons on one machine may share the port
            # (SO_REUSEPORT; the kernel spreads connections; README "Running a fleet")
            pg = self.config.spool_pg is not None
            srv = await listen(loop, h, self.config, LISTEN_BACKLOG, reuse_port=pg)
            self.handlers.append(h)
            self.servers.append(srv)
        fb = self.config.feedback
        if self.config.admin_listen is not None:
            self.admin = AdminServer(
                self.metrics,
                self.writer,
                self.readiness_problems,
                self.health_doc,
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
        for sig, fn in (
            (signal.SIGTERM, self._stop.set),
            (signal.SIGINT, self._stop.set),
            (signal.SIGHUP, self._reload.set),
        ):
            loop.add_signal_handler(sig, fn)
        if self.config.inbound_processes:
            await self._start_inbound(loop)
        if self.config.outbox.enabled:  # README "The transactional outbox"
            self.outbox = Outbox(lambda: self.config, self.writer, self.engine.wake)
            self.engine.on_recorded = self.outbox.touched
            self.outbox.start()
        self._pickup_task = loop.create_task(self.pickup.run(), name="maildrop")
        await self.check_health()
        self._tasks = [
            loop.create_task(self.engine.run(), name="engine"),
            loop.create_task(self._health_loop(), name="health"),
            loop.create_task(self.alerts.run(), name="alerts"),
            loop.create_task(self._maintenance(), name="maintenance"),
            loop.create_task(self._reloader(), name="reloader"),
            loop.create_task(self._check_dkim_dns(), name="dkim-dns"),
            loop.create_task(
                watchdog_loop(self.notifier, self.notifier.watchdog_interval()), name="watchdog"
            ),
        ]
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
        await self._stop.wait()
        await self.shutdown()
        return 0

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
        await self._stop_inbound(deadline)
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
        with contextlib.suppress(OSError):
            (self.config.spool_path / HEALTH_FILE).unlink()
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
        """At start, `relay check-dns` for every DKIM signing domain, logged (never blocks
        start, never stops it): a key not yet published, a broken SPF or a missing DMARC
        shows in the journal the moment the relay starts signing."""
        from relay.authenticity import checkdns
        from relay.authenticity.dkim import public_record

        ns = self.config.upstream.mx.nameservers
        for domain, keys in self.config.dkim.items():
            try:
                checks = await checkdns.check_domain(
                    domain,
                    nameservers=list(ns) if ns else None,
                    dkim=[(k.selector, public_record(k)) for k in keys],
                )
            except Exception as e:
                log_event(log, logging.WARNING, "dns_check", "check failed", domain=domain, exc=e)
                continue
            for c in checks:
                if c.status != "ok":
                    log_event(
                        log,
                        logging.ERROR if c.status == "error" else logging.WARNING,
                        "dns_check",
                        c.detail,
                        domain=domain,
                        check=c.name,
                        status=c.status,
                        record=c.record,
                    )
            log_event(
                log,
                logging.INFO,
                "dns_check",
                f"{domain}: {sum(c.status == 'ok' for c in checks)}/{len(checks)} ok",
                domain=domain,
                exit_code=checkdns.exit_code(checks),
            )

    def _public_routes(self, server: HttpServer) -> None:
        """What may face the providers and the recipients: the feedback webhooks and the
        one-click unsubscribe pages (on `feedback.listen`, else on the admin listener)."""
        server.route("/feedback/", self.feedback.http, prefix=True)
        server.route("/u/", self.unsubscribe.http, prefix=True)

    # --- background work ----------------------------------------------------------------

    async def _maintenance(self) -> None:
        last_prune = -PRUNE_EVERY  # first pass at start: expired keys, orphan bodies
        while True:
            try:
                await self.suppressions.refresh(self.writer)
                await self._write_runtime()
                # spool.retention 0: a finished message (and its body: reset links, one-time
                # codes) is gone within one maintenance tick of its last recipient
                if time.monotonic() - last_prune > PRUNE_EVERY or self.config.retention == 0:
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
        snap = self.engine.snapshot().as_json()
        snap["pid"] = os.getpid()
        snap["host"] = socket.gethostname()
        snap["node"] = self.engine.node
        snap["fleet_size"] = self.engine.fleet_size
        snap["started_at"] = ops.iso_utc(self.started_at)
        snap["inbound"] = {
            "accepted": self.stats.accepted,
            "deduplicated": self.stats.deduplicated,
            "rejected": self.stats.rejected,
            "sessions": self.stats.sessions,
        }
        now = time.time()
        node = self.engine.node

        failing = views.failing_since(self.engine)

        def put(c: Any) -> None:
            # a fleet: the last node's view as `daemon`, and each node's own view
            ops.put_runtime(c, "daemon", snap, now)
            if self.config.spool_pg is not None:
                ops.put_runtime(c, f"node:{node}", snap, now)
            else:  # for the next start (relay/delivery/views.py failing_since)
                ops.put_runtime(c, FAILING_SINCE, failing, now)

        await self.writer.run(put)

    async def _prune(self) -> None:
        now = time.time()
        window = self.config.dedup_window
        retention = self.config.retention
        paths = await self.writer.run(lambda c: ops.prune(c, now, window, retention))
        known = await self.writer.run(ops.body_paths)
        await asyncio.to_thread(bodies.delete_bodies, self.config.spool_path, paths)
        removed = await asyncio.to_thread(bodies.sweep, self.config.spool_path, known)
        if paths or removed:
            log_event(
                log,
                logging.INFO,
                "pruned",
                "finished messages and orphan bodies removed",
                messages=len(paths),
                orphan_bodies=len(removed),
            )

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

    def reload(self) -> bool:
        self.notifier.reloading()
        assert self.engine is not None
        try:
            new = self._keep_restart_only(load_config(self.config.path))
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
        for proc in self._children:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGHUP)
        log_event(log, logging.INFO, "config_reloaded", "configuration reloaded")
        self.notifier.ready()
        return True

    # --- inbound processes (relay/inbound/processes.py) ------------------------------------------

    async def _start_inbound(self, loop: asyncio.AbstractEventLoop) -> None:
        """`inbound.processes` processes take SMTP on the configured ports and spool; each
        writes `r` to this pipe once it listens and `q` when it queues mail (the engine
        claims it at once). Start-up waits until all of them listen."""
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_fd = wfd
        ready = asyncio.Event()

        def woken() -> None:
            try:
                data = os.read(rfd, 4096)
            except (BlockingIOError, OSError):
                return
            self._inbound_ready += data.count(b"r")
            if self._inbound_ready >= self.config.inbound_processes:
                ready.set()
            if self.engine is not None:
                self.engine.wake()

        loop.add_reader(rfd, woken)
        for i in range(self.config.inbound_processes):
            self._supervisors.append(loop.create_task(self._supervise(i, wfd), name=f"inbound-{i}"))
        try:
            await asyncio.wait_for(ready.wait(), INBOUND_START_TIMEOUT)
        except TimeoutError:
            raise OSError(
                f"inbound processes not listening after {INBOUND_START_TIMEOUT:.0f}s"
                " (see the lines above)"
            ) from None

    async def _supervise(self, index: int, wfd: int) -> None:
        """Run inbound process `index`; start it again a second after it dies."""
        env = {**os.environ, ROLE_ENV: "inbound", NOTIFY_ENV: str(wfd)}
        args = [sys.executable, "-m", "relay", "serve"]
        if self.config.path:
            args += ["-c", str(self.config.path)]
        while not self._stop.is_set():
            proc = await asyncio.create_subprocess_exec(*args, env=env, pass_fds=(wfd,))
            self._children.append(proc)
            code = await proc.wait()
            self._children.remove(proc)
            if self._stop.is_set():
                return
            log_event(
                log,
                logging.ERROR,
                "inbound_process_exited",
                "an inbound process exited; starting it again",
                index=index,
                pid=proc.pid,
                code=code,
            )
            await asyncio.sleep(1.0)

    async def _stop_inbound(self, deadline: float) -> None:
        """At shutdown, before the engine: the inbound processes finish the DATA they are
        in (their 250 depends on the spool) and exit."""
        for proc in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in list(self._children):
            try:
                await asyncio.wait_for(proc.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for t in self._supervisors:
            t.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)

    # --- hooks ----------------------------------------------------------------------------

    def _on_commit(self, seconds: float, jobs: int) -> None:
        self.metrics.commit_latency.observe(seconds)
        self.metrics.commit_batch.observe(jobs)
        self._commit_max = max(self._commit_max, seconds)

    def _refusal(self) -> str | None:
        return self.refusal

    # --- health ---------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY)
            try:
                await self.check_health()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event(log, logging.ERROR, "health_error", "health pass failed", exc=e)

    async def check_health(self) -> None:
        now = faults.now()
        cfg = self.config
        hc = cfg.health
        results: list[tuple[str, health.Status, str]] = []
        down = [
            lst.name for lst, s in zip(cfg.listen, self.servers, strict=False) if not s.is_serving()
        ]
        want = cfg.inbound_processes
        if any(h.closing for h in self.handlers) or (want and self._stop.is_set()):
            results.append(("listeners", "critical", "shutting down: new mail gets 421"))
        elif want and not self._children:
            results.append(("listeners", "critical", "no inbound process running"))
        elif want and len(self._children) < want:
            results.append(
                ("listeners", "warning", f"{len(self._children)} of {want} inbound processes")
            )
        elif want:
            results.append(("listeners", "ok", f"{want} inbound processes listening"))
        elif down:
            results.append(("listeners", "critical", f"not serving: {', '.join(down)}"))
        else:
            results.append(("listeners", "ok", f"{len(self.servers)} listening"))
        results.append(("spool", *await self._spool_check()))
        try:
            v = await asyncio.to_thread(os.statvfs, cfg.spool_path)
            free = 100.0 * v.f_bavail / v.f_blocks if v.f_blocks else 100.0
            judged = health.disk(
                free,
                hc.disk_free_warning,
                hc.disk_free_critical,
                v.f_bavail * v.f_frsize,  # below spool.reserve: critical, new mail gets 452
                cfg.spool_reserve,
            )
            results.append(("disk", *judged))
        except OSError as e:
            results.append(("disk", "critical", f"cannot stat the spool's filesystem: {e}"))
        if self.engine is not None:
            mx = cfg.upstream.mode == "mx"
            checks = self.health.checks
            for d in self.engine.health():
                shown = f"destination:{d.name}" in checks
                if not health.judged(mx, d.upstream, d.config_error, shown):
                    continue
                results.append(
                    (
                        f"destination:{d.name}",
                        *health.destination(
                            d.name,
                            d.circuit,
                            d.failures,
                            d.config_error,
                            d.reopen_at,
                            # a recipient domain (MX) that does not answer is that
                            # domain's problem; an upstream's is ours
                            failing_for=d.failing_for if d.upstream else None,
                            answered=d.answered,
                            failing_after=hc.failing_after,
                        ),
                    )
                )
            results.append(
                (
                    "dead_letters",
                    *health.dead_letters(
                        self.engine.dead_letters_last_hour(), hc.dead_letters_warning
                    ),
                )
            )
            if time.monotonic() - self._queue_checked >= QUEUE_HEALTH_EVERY:
                self._queue_checked = time.monotonic()
                self._queue_results = await self._queue_check(now)
            results.extend(self._queue_results)
        if self._pickup_task is not None:
            p = self.pickup
            results.append(
                (
                    "maildrop",
                    *health.maildrop(p.waiting, p.oldest_age, p.corrupt, error=p.error),
                )
            )
        for name, status, detail in results:
            self.metrics.health_status.labels(name).set(health.RANK[status])
            t = self.health.update(name, status, detail, now)
            if t is not None:
                await self._transition(t)
        checks = self.health.checks
        # a failed commit is the commit's own 451; a database deleted or replaced under us
        # would take every later message into a file nobody will read: refuse them all
        if self._spool_gone:
            self.refusal = "451 4.3.0 Spool unavailable; message not accepted, try again later"
        elif checks["disk"].status == "critical":
            self.refusal = "452 4.3.1 Insufficient system storage; try again later"
        else:
            self.refusal = None
        doc = self.health_doc()
        doc.update(pid=os.getpid(), updated_at=ops.iso_utc(now), updated_ts=now)
        try:
            await asyncio.to_thread(
                _write_atomic,
                cfg.spool_path / HEALTH_FILE,
                json.dumps(doc, sort_keys=True).encode(),
            )
        except OSError as e:
            # a full disk: the health pass (and its 452 gate) goes on; logged once, not
            # every second, and once more when the file can be written again
            if not self._health_write_failed:
                log_event(
                    log, logging.ERROR, "health_write_failed", "health file not written", exc=e
                )
            self._health_write_failed = True
        else:
            if self._health_write_failed:
                log_event(log, logging.INFO, "health_write_ok", "health file written again")
            self._health_write_failed = False

    def health_doc(self) -> dict[str, Any]:
        doc = self.health.as_dict(ops.iso_utc)
        doc["uptime_seconds"] = round(time.time() - self.started_at, 1)
        e = self.engine
        if e is not None and e.fleet:  # the fleet as this node saw it at its last heartbeat
            doc["fleet"] = {"node": e.node, "live": e.fleet_size, "nodes": e.fleet_nodes}
        return doc

    async def readiness_problems(self) -> list[str]:
        """Why the relay cannot take mail now (empty: it can): /healthz."""
        problems = []
        for s in self.servers:
            if not s.is_serving():
                problems.append("a listener is not serving")
        if self.config.inbound_processes and not self._children:
            problems.append("no inbound process running")
        if not self.writer.healthy:
            problems.append("the last spool commit failed")
        try:
            await asyncio.wait_for(self.writer.run(lambda c: c.execute("SELECT 1").fetchone()), 2.0)
        except Exception as e:
            problems.append(f"spool not answering: {e}")
        if any(h.closing for h in self.handlers):
            problems.append("shutting down")
        for c in self.health.checks.values():  # the disk, a replaced spool database
            if c.name in health.READINESS and c.status == "critical" and c.detail not in problems:
                problems.append(c.detail)
        return problems

    async def _spool_check(self) -> tuple[health.Status, str]:
        if self.config.spool_pg is None:
            gone = await self._spool_file_check()
            if gone is not None:
                return gone
        t0 = time.monotonic()
        try:  # a commit of its own: after a failed one, this is what proves it works again
            await asyncio.wait_for(self.writer.run(lambda c: c.execute("SELECT 1").fetchone()), 2.0)
        except Exception as e:
            return "critical", (
                f"the spool cannot commit ({e or type(e).__name__}): new mail"
                " gets 451 4.3.0 while it cannot"
            )
        if not self.writer.healthy:
            return "critical", "the last spool commit failed: new mail gets 4xx until one works"
        latency = max(self._commit_max, time.monotonic() - t0)
        self._commit_max = 0.0
        if latency > SLOW_COMMIT:
            return "warning", f"slow spool: a group commit took {latency:.1f}s"
        return "ok", f"writable; commit latency {latency * 1000:.0f} ms"

    async def _spool_file_check(self) -> tuple[health.Status, str] | None:
        """The SQLite file deleted or replaced under the running daemon, or None."""
        path = db.db_path(self.config.spool_path)
        try:
            st = await asyncio.to_thread(os.stat, path)
        except FileNotFoundError:
            self._spool_gone = True
            return "critical", await self._spool_gone_detail(path, "deleted")
        except OSError as e:
            return "critical", f"cannot stat the spool database {path}: {e}"
        if (st.st_dev, st.st_ino) != self._spool_id:
            self._spool_gone = True
            return "critical", await self._spool_gone_detail(path, "replaced")
        return None

    async def _spool_gone_detail(self, path: os.PathLike[str], how: str) -> str:
        try:  # the open handle still reads the old file
            waiting, held = await asyncio.wait_for(self.writer.run(ops.unfinished_counts), 2.0)
        except Exception:
            waiting = held = -1
        return spool_gone_advice(path, how, waiting, held)

    async def _queue_check(self, now: float) -> list[tuple[str, health.Status, str]]:
        hc = self.config.health
        age, overdue = await self.writer.run(lambda c: ops.queue_health(c, now, hc.stall_after))
        last = None if self.engine is None else self.engine.last_delivery_at
        since = (
            (now - last)
            if last is not None
            else (None if now - self.started_at >= hc.stall_after else 0.0)
        )
        return [
            ("queue_age", *health.queue_age(age, hc.queue_age_warning, hc.queue_age_critical)),
            ("queue_stall", *health.stall(overdue, since, hc.stall_after)),
        ]

    async def _transition(self, t: health.Transition) -> None:
        # an orderly stop (SIGTERM, systemctl stop) turns the listeners critical: /healthz
        # says 503 so a balancer drains us, but it is the operator's own action, not an
        # incident: logged at INFO, no alert (otherwise every restart pages someone)
        stopping = t.name == "listeners" and (
            self._stop.is_set() or any(h.closing for h in self.handlers)
        )
        ok = t.new == "ok"
        log_event(
            log,
            logging.INFO
            if ok or stopping
            else (logging.ERROR if t.new == "critical" else logging.WARNING),
            "health_resolved" if ok else "health_changed",
            f"{t.name} is ok again" if ok else f"{t.name} is {t.new}",
            check=t.name,
            was=t.old,
            detail=t.detail,
        )
        if stopping:
            return
        if ok:
            ev = alerts.Event("resolved", "info", t.name, f"{t.name} ok again: {t.detail}")
        else:
            name = "health"
            if t.name.startswith("destination:") and "refused our configuration" in t.detail:
                name = "upstream_config_error"
            ev = alerts.Event(name, t.new, t.name, f"{t.name} {t.new}: {t.detail}")
        try:
            await self.alerts.add(ev)
        except Exception as e:
            log_event(
                log, logging.ERROR, "alert_failed", "could not record an alert", exc=e, check=t.name
            )

    async def _dead_letter(self, doc: dict[str, Any]) -> None:
        """A dead letter or a delay warning: its alert is in the outbox already (recorded
        with the outcome); here only the DSN to the sender."""
        cfg = self.config
        if cfg.dsn.enabled and doc.get("sender"):
            try:
                await queue_dsn(
                    cfg,
                    self.writer,
                    doc,
                    self.engine.wake if self.engine is not None else lambda: None,
                )
            except Exception as e:
                log_event(
                    log,
                    logging.ERROR,
                    "dsn_failed",
                    "could not queue a DSN",
                    exc=e,
                    queue_id=doc.get("queue_id"),
                )


def _write_atomic(path: os.PathLike[str] | str, data: bytes) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a partial file on a full disk: not left to take more space
        raise
    os.replace(tmp, path)


def _run_loop(main: Coroutine[Any, Any, int], kind: str) -> int:
    """uvloop when installed (libuv: about twice asyncio's socket throughput, which is what
    an SMTP relay spends its CPU on); the standard loop otherwise, or when
    RELAY_EVENT_LOOP=asyncio.

    Inbound STARTTLS (`loop.start_tls`, relay/inbound/transport.py) works on uvloop's
    transports too, so a listener with `tls` needs no fallback to the standard loop:
    tests/test_inbound_auth.py checks it against the daemon as spawned, under uvloop, and
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
            fd = os.environ.get(NOTIFY_ENV)
            child = InboundProcess(config, int(fd) if fd else None, LISTEN_BACKLOG)
            return _run_loop(child.run(), os.environ.get("RELAY_EVENT_LOOP", "auto"))
        daemon = Daemon(config)
        daemon.fd_limit = fd_limit
        return _run_loop(daemon.run(), os.environ.get("RELAY_EVENT_LOOP", "auto"))
    except OSError as e:
        log_event(log, logging.ERROR, "startup_failed", str(e))
        return 71  # EX_OSERR
    except KeyboardInterrupt:
        return 0
