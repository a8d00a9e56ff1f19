"""The main process's side of the inbound processes (relay/inbound/processes.py): start them,
restart one that dies, forward SIGHUP, stop them first at shutdown.

Rules:
- `inbound.processes` processes are `relay serve` re-executed with RELAY_ROLE=inbound; each
  writes `r` to a pipe once it listens and `q` when it queues mail (then `on_queued`: the
  engine claims it at once). `start` returns once all of them listen, or raises OSError
  after INBOUND_START_TIMEOUT.
- A process that exits is started again a second later, unless the daemon is stopping
  (`stopping`: from SIGTERM on, before `stop` is even called: a process killed with the
  whole service is not restarted).
- `stop` (at shutdown, before the engine): SIGTERM to each, so they finish the DATA they
  are in (their 250 depends on the spool); a process still running at the deadline is
  killed.
- Each process gets a socket of its own (a `SOCK_SEQPACKET` pair: one datagram, one
  snapshot) on which it sends its counters once a second and at exit (JSON: `metrics`, a
  relay/ops/metrics.py snapshot, and `stats`, its `relay status` counts). The last one
  read goes to `absorb(source, payload)`; when the process has exited and its socket is
  read to the end, `retire(source)`: its counts stay in the totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relay.inbound.processes import NOTIFY_ENV, ROLE_ENV, STATS_ENV
from relay.ops.logs import log_event
from relay.ops.tasks import stop_tasks

if TYPE_CHECKING:
    from relay.config.tree import Config

log = logging.getLogger(__name__)

INBOUND_START_TIMEOUT = 30.0  # seconds for inbound processes to listen at start
RESTART_AFTER = 1.0  # seconds after a process died


class Supervisor:
    def __init__(
        self,
        config: Callable[[], Config],
        stopping: Callable[[], bool],
        on_queued: Callable[[], None],
        absorb: Callable[[str, dict[str, Any]], None] | None = None,
        retire: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.stopping = stopping
        self.on_queued = on_queued
        self.absorb = absorb
        self.retire = retire
        self.children: list[asyncio.subprocess.Process] = []  # running now
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = 0  # `r` bytes read: inbound processes (re)started listening

    def running(self) -> int:
        return len(self.children)

    async def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the processes; return once all of them listen."""
        want = self.config().inbound_processes
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        ready = asyncio.Event()

        def woken() -> None:
            try:
                data = os.read(rfd, 4096)
            except (BlockingIOError, OSError):
                return
            self._ready += data.count(b"r")
            if self._ready >= self.config().inbound_processes:
                ready.set()
            self.on_queued()

        loop.add_reader(rfd, woken)
        for i in range(want):
            self._tasks.append(loop.create_task(self._supervise(i, wfd), name=f"inbound-{i}"))
        try:
            async with asyncio.timeout(INBOUND_START_TIMEOUT):
                await ready.wait()
        except TimeoutError:
            raise OSError(
                f"inbound processes not listening after {INBOUND_START_TIMEOUT:.0f}s"
                " (see the lines above)"
            ) from None

    async def _supervise(self, index: int, wfd: int) -> None:
        """Run inbound process `index`; start it again a second after it dies."""
        args = [sys.executable, "-m", "relay", "serve"]
        path = self.config().path
        if path:
            args += ["-c", str(path)]
        loop = asyncio.get_running_loop()
        while not self.stopping():
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            env = {
                **os.environ,
                ROLE_ENV: "inbound",
                NOTIFY_ENV: str(wfd),
                STATS_ENV: str(theirs.fileno()),
            }
            try:
                proc = await asyncio.create_subprocess_exec(
                    *args, env=env, pass_fds=(wfd, theirs.fileno())
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            source = f"inbound-{index}-{proc.pid}"
            ours.setblocking(False)
            loop.add_reader(ours.fileno(), self._read_stats, ours, source)
            self.children.append(proc)
            try:
                code = await proc.wait()
            finally:
                self.children.remove(proc)
                loop.remove_reader(ours.fileno())
                self._read_stats(ours, source)  # what it sent as it exited
                ours.close()
                if self.retire is not None:
                    self.retire(source)
            if self.stopping():
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
            await asyncio.sleep(RESTART_AFTER)

    def _read_stats(self, sock: socket.socket, source: str) -> None:
        """Every snapshot waiting on `sock`; the last one that parses is absorbed."""
        last: dict[str, Any] | None = None
        while True:
            try:
                data = sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if not data:
                break
            try:
                payload = json.loads(data)
            except ValueError:
                continue  # never ours: a process writes whole JSON datagrams
            if isinstance(payload, dict):
                last = payload
        if last is not None and self.absorb is not None:
            self.absorb(source, last)

    def reload(self) -> None:
        """SIGHUP to each: they reload the config themselves."""
        for proc in self.children:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGHUP)

    async def stop(self, deadline: float) -> None:
        """At shutdown, before the engine: the inbound processes finish the DATA they are
        in (their 250 depends on the spool) and exit; killed at `deadline` (monotonic)."""
        for proc in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in list(self.children):
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await stop_tasks(self._tasks)
