"""The health monitor: measures every check once a second, keeps the model, raises alerts.

Rules:
- Measured every second (HEALTH_EVERY): listeners, the spool (writable, commit latency, the
  database file still the one we opened), free disk, each destination, the queue (oldest
  waiting, stall; every 5 s), dead letters per hour, the maildrop. The judging is pure
  (relay/ops/health.py); this module only measures and acts on the result.
- A transition is logged and raised as an alert (relay/ops/alerts.py), except the
  listeners turning critical in an orderly stop: logged at INFO, no alert (otherwise every
  restart pages someone).
- The model is served at /health and /healthz (`doc`, `readiness_problems`) and written to
  `<spool>/health.json` for `relay status`; a full disk that keeps the file from being
  written is logged once, and once more when it can be written again.
- `refusal` is what inbound answers while the spool or the disk is bad: `451 4.3.0` once
  the spool database was deleted or replaced under us, `452 4.3.1` while the disk is
  critically full (at MAIL, before anything is accepted that could not be kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from relay.ops import alerts, faults, health
from relay.ops.logs import log_event
from relay.spool import db, ops

if TYPE_CHECKING:
    from relay.config.tree import Config
    from relay.delivery.engine import Engine
    from relay.inbound.handler import InboundHandler
    from relay.ops.metrics import Metrics
    from relay.spool.pickup import Pickup
    from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

HEALTH_EVERY = 1.0  # seconds between health passes
QUEUE_HEALTH_EVERY = 5.0  # the queue checks scan the recipients table: less often
SLOW_COMMIT = 2.0  # seconds: a group commit slower than this is a warning
# a write the database refused (full, read-only) keeps the spool critical this long: the
# daemon's own writes (maintenance every 2 s, the fleet heartbeat) renew it while it lasts,
# with mail or without; the health pass's probe is a read and cannot tell
REFUSED_HOLD = 5.0
HEALTH_FILE = health.HEALTH_FILE

Result = tuple[str, health.Status, str]


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


class CommitWatch:
    """The spool writer's commit hook: the commit metrics, and the slowest commit since the
    last health pass (the `spool` check's latency)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.slowest = 0.0

    def observe(self, seconds: float, jobs: int) -> None:
        self.metrics.commit_latency.observe(seconds)
        self.metrics.commit_batch.observe(jobs)
        self.slowest = max(self.slowest, seconds)

    def take_slowest(self) -> float:
        slowest, self.slowest = self.slowest, 0.0
        return slowest


class Monitor:
    def __init__(
        self,
        config: Callable[[], Config],
        writer: SpoolWriter,
        metrics: Metrics,
        alerts: alerts.Dispatcher,
        commits: CommitWatch,
        engine: Engine,
        pickup: Pickup,
        *,
        servers: Sequence[asyncio.Server],
        handlers: Sequence[InboundHandler],
        inbound_running: Callable[[], int],
        stopping: Callable[[], bool],
        started_at: float,
    ) -> None:
        """`servers` and `handlers` are the daemon's own lists of its listeners (filled as
        they start); `inbound_running` counts the inbound processes running;
        `stopping` is true from SIGTERM on."""
        self.config = config
        self.writer = writer
        self.metrics = metrics
        self.alerts = alerts
        self.commits = commits
        self.engine = engine
        self.pickup = pickup
        self.servers = servers
        self.handlers = handlers
        self.inbound_running = inbound_running
        self.stopping = stopping
        self.started_at = started_at
        self.model = health.Model()
        self.refusal: str | None = None  # what inbound answers while the spool/disk is bad
        self._write_failed = False  # health.json could not be written (disk full)
        self._spool_id: tuple[int, int] | None = None
        self._spool_gone = False
        self._queue_checked = -QUEUE_HEALTH_EVERY
        self._queue_results: list[Result] = []
        cfg = config()
        if cfg.spool_pg is None:  # a file that can be deleted or replaced under us
            st = os.stat(db.db_path(cfg.spool_path))
            self._spool_id = (st.st_dev, st.st_ino)

    def refusal_now(self) -> str | None:
        """The gate inbound asks at MAIL (relay/inbound/handler.py `gate`)."""
        return self.refusal

    def _closing(self) -> bool:
        return any(h.closing for h in self.handlers)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event(log, logging.ERROR, "health_error", "health pass failed", exc=e)

    async def check(self) -> None:
        """One health pass: measure, judge, log and alert transitions, set the refusal,
        write health.json."""
        now = faults.now()
        cfg = self.config()
        results: list[Result] = [self._listeners(cfg)]
        results.append(("spool", *await self._spool_check()))
        results.append(await self._disk_check(cfg))
        results.extend(self._destinations(cfg))
        if time.monotonic() - self._queue_checked >= QUEUE_HEALTH_EVERY:
            self._queue_checked = time.monotonic()
            self._queue_results = await self._queue_check(now)
        results.extend(self._queue_results)
        p = self.pickup
        results.append(
            ("maildrop", *health.maildrop(p.waiting, p.oldest_age, p.corrupt, error=p.error))
        )
        for name, status, detail in results:
            self.metrics.health_status.labels(name).set(health.RANK[status])
            t = self.model.update(name, status, detail, now)
            if t is not None:
                await self._transition(t)
        checks = self.model.checks
        # a failed commit is the commit's own 451; a database deleted or replaced under us
        # would take every later message into a file nobody will read: refuse them all
        if self._spool_gone:
            self.refusal = "451 4.3.0 Spool unavailable; message not accepted, try again later"
        elif checks["disk"].status == "critical":
            self.refusal = "452 4.3.1 Insufficient system storage; try again later"
        else:
            self.refusal = None
        await self._write_file(cfg, now)

    def _listeners(self, cfg: Config) -> Result:
        down = [
            lst.name for lst, s in zip(cfg.listen, self.servers, strict=False) if not s.is_serving()
        ]
        want = cfg.inbound_processes
        running = self.inbound_running()
        if self._closing() or (want and self.stopping()):
            return ("listeners", "critical", "shutting down: new mail gets 421")
        if want and not running:
            return ("listeners", "critical", "no inbound process running")
        if want and running < want:
            return ("listeners", "warning", f"{running} of {want} inbound processes")
        if want:
            return ("listeners", "ok", f"{want} inbound processes listening")
        if down:
            return ("listeners", "critical", f"not serving: {', '.join(down)}")
        return ("listeners", "ok", f"{len(self.servers)} listening")

    async def _disk_check(self, cfg: Config) -> Result:
        hc = cfg.health
        try:
            v = await asyncio.to_thread(os.statvfs, cfg.spool_path)
        except OSError as e:
            return ("disk", "critical", f"cannot stat the spool's filesystem: {e}")
        free = 100.0 * v.f_bavail / v.f_blocks if v.f_blocks else 100.0
        judged = health.disk(
            free,
            hc.disk_free_warning,
            hc.disk_free_critical,
            v.f_bavail * v.f_frsize,  # below spool.reserve: critical, new mail gets 452
            cfg.spool_reserve,
        )
        return ("disk", *judged)

    def _destinations(self, cfg: Config) -> list[Result]:
        hc = cfg.health
        mx = cfg.upstream.mode == "mx"
        checks = self.model.checks
        results: list[Result] = []
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
                *health.dead_letters(self.engine.dead_letters_last_hour(), hc.dead_letters_warning),
            )
        )
        return results

    async def _write_file(self, cfg: Config, now: float) -> None:
        doc = self.doc()
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
            if not self._write_failed:
                log_event(
                    log, logging.ERROR, "health_write_failed", "health file not written", exc=e
                )
            self._write_failed = True
        else:
            if self._write_failed:
                log_event(log, logging.INFO, "health_write_ok", "health file written again")
            self._write_failed = False

    def remove_file(self) -> None:
        """At shutdown: `relay status` then says the daemon is not running."""
        with contextlib.suppress(OSError):
            (self.config().spool_path / HEALTH_FILE).unlink()

    def doc(self) -> dict[str, Any]:
        """The model as served at /health and written to health.json."""
        doc = self.model.as_dict(ops.iso_utc)
        doc["uptime_seconds"] = round(time.time() - self.started_at, 1)
        e = self.engine
        if e.fleet:  # the fleet as this node saw it at its last heartbeat
            doc["fleet"] = {"node": e.node, "live": e.fleet_size, "nodes": e.fleet_nodes}
        return doc

    async def readiness_problems(self) -> list[str]:
        """Why the relay cannot take mail now (empty: it can): /healthz."""
        problems = []
        for s in self.servers:
            if not s.is_serving():
                problems.append("a listener is not serving")
        if self.config().inbound_processes and not self.inbound_running():
            problems.append("no inbound process running")
        if not self.writer.healthy:
            problems.append("the last spool commit failed")
        try:
            async with asyncio.timeout(2.0):
                await self.writer.run(lambda c: c.execute("SELECT 1").fetchone())
        except Exception as e:
            problems.append(f"spool not answering: {e}")
        if self._closing():
            problems.append("shutting down")
        for c in self.model.checks.values():  # the disk, a replaced spool database
            if c.name in health.READINESS and c.status == "critical" and c.detail not in problems:
                problems.append(c.detail)
        return problems

    async def _spool_check(self) -> tuple[health.Status, str]:
        if self._spool_id is not None:
            gone = await self._spool_file_check()
            if gone is not None:
                return gone
        t0 = time.monotonic()
        try:  # a commit of its own: after a failed one, this is what proves it works again
            async with asyncio.timeout(2.0):
                await self.writer.run(lambda c: c.execute("SELECT 1").fetchone())
        except Exception as e:
            return "critical", (
                f"the spool cannot commit ({e or type(e).__name__}): new mail"
                " gets 451 4.3.0 while it cannot"
            )
        if not self.writer.healthy:
            return "critical", "the last spool commit failed: new mail gets 4xx until one works"
        if time.monotonic() - self.writer.refused_at < REFUSED_HOLD:
            why = (self.writer.refused.splitlines() or ["?"])[0]
            return "critical", (
                f"the database refuses writes ({why}): new mail gets 451 4.3.0 while it does"
            )
        latency = max(self.commits.take_slowest(), time.monotonic() - t0)
        if latency > SLOW_COMMIT:
            return "warning", f"slow spool: a group commit took {latency:.1f}s"
        return "ok", f"writable; commit latency {latency * 1000:.0f} ms"

    async def _spool_file_check(self) -> tuple[health.Status, str] | None:
        """The SQLite file deleted or replaced under the running daemon, or None."""
        path = db.db_path(self.config().spool_path)
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
            async with asyncio.timeout(2.0):
                waiting, held = await self.writer.run(ops.unfinished_counts)
        except Exception:
            waiting = held = -1
        return spool_gone_advice(path, how, waiting, held)

    async def _queue_check(self, now: float) -> list[Result]:
        hc = self.config().health
        age, overdue = await self.writer.run(lambda c: ops.queue_health(c, now, hc.stall_after))
        last = self.engine.last_delivery_at
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
        stopping = t.name == "listeners" and (self.stopping() or self._closing())
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
