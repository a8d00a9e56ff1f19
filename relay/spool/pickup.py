"""The maildrop importer (Postfix's pickup): mail relay-sendmail left while the daemon was
down goes into the queue once the daemon runs.

Rules:
- At start and then every POLL_EVERY seconds: one listdir of the maildrop (cheap when
  empty), oldest file first. File I/O and the submission run in a worker thread, never on
  the event loop.
- Each file is submitted over SMTP to the daemon's own first listener, exactly as
  relay-sendmail would have submitted it (relay/spool/submit.py): the same checks as any
  local client (RCPT, suppressions, aliases, limits), the same dedup namespace and the
  same spool fsync before the 250. The file is unlinked only after that 250, so a crash in
  between imports it again, and dedup (the same listener, the same Message-ID or content)
  makes the second import a duplicate, not a second message.
- A transient refusal (4xx, the relay not answering) leaves the file for a later pass,
  with a backoff per file (BACKOFF); the `maildrop` health check warns once a file waits
  over a minute.
- A file that is not a maildrop file (unreadable, malformed, a symlink, a strange name),
  or that the relay refuses for good (5xx for the sender, the message or every
  recipient), is moved into `<maildrop>/corrupt/`, logged at ERROR and alerted
  (`maildrop`): never lost silently, never a crash. Recipients refused while others were
  accepted are logged at ERROR and alerted too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from relay.ops import alerts
from relay.ops.logs import log_event, mask_address
from relay.spool import maildrop, submit

log = logging.getLogger(__name__)

POLL_EVERY = 1.0  # seconds between passes
SUBMIT_TIMEOUT = 30.0  # seconds per SMTP reply from our own listener
BACKOFF = (1.0, 5.0, 30.0, 60.0, 300.0)  # seconds before the n-th retry of one file


class Pickup:
    def __init__(
        self,
        folder: Callable[[], Path],
        target: Callable[[], submit.Target],
        alert: Callable[[alerts.Event], Awaitable[None]],
        clock: Callable[[], float],
        max_size: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.folder = folder
        self.max_size = max_size  # limits.max_message_size: a bigger file is not read
        self.target = target
        self.alert = alert
        self.clock = clock
        # the health check's numbers, from the last pass
        self.waiting = 0
        self.oldest_age: float | None = None
        self.corrupt = 0
        self._retry: dict[str, tuple[float, int]] = {}  # file -> (next try, failures)
        self._stopping = asyncio.Event()
        self._scan_error: str | None = None
        self.error: str | None = None  # the folder cannot be read (the health check says it)
        self._stuck: set[str] = set()  # could not be moved aside: not tried again

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.pass_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never lose the importer
                log_event(log, logging.ERROR, "maildrop_error", "maildrop pass failed", exc=e)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_EVERY):
                    await self._stopping.wait()

    def stop(self) -> None:
        """No new file after the one being submitted (shutdown: before the listeners
        close, so that submission still gets its reply)."""
        self._stopping.set()

    async def pass_once(self) -> int:
        """Import what is due; the number of files imported."""
        folder = self.folder()
        now = self.clock()
        try:
            scan = await asyncio.to_thread(maildrop.scan, folder, now)
        except OSError as e:
            text = f"cannot read the maildrop {folder}: {e.strerror or e}"
            self.error = text
            if text != self._scan_error:  # once, not every second
                log_event(log, logging.ERROR, "maildrop_error", text)
                self._scan_error = text
            self.waiting, self.oldest_age = 0, None
            return 0
        self._scan_error = None
        self.error = None
        for name in scan.stale:
            log_event(
                log,
                logging.WARNING,
                "maildrop_stale",
                "removed a temporary file a writer left over an hour ago",
                file=name,
            )
        for name in scan.others:
            if name not in self._stuck:
                await self._aside(folder, name, "not a maildrop file name")
        oldest = maildrop.created_of(scan.ready[0]) if scan.ready else None
        self.waiting = len(scan.ready)
        self.oldest_age = None if oldest is None else max(0.0, now - oldest)
        self.corrupt = scan.corrupt + len(scan.others)
        for name in list(self._retry):
            if name not in scan.ready:
                del self._retry[name]
        imported = 0
        for name in scan.ready:
            if self._stopping.is_set():
                break
            due = self._retry.get(name)
            if (due is not None and due[0] > now) or name in self._stuck:
                continue
            imported += await self._import(folder, name)
        return imported

    async def _import(self, folder: Path, name: str) -> int:
        path = folder / name
        try:
            drop = await asyncio.to_thread(maildrop.read, path, self.max_size())
        except FileNotFoundError:
            return 0  # taken by another importer (a fleet on one machine)
        except (OSError, maildrop.MalformedDrop) as e:
            await self._aside(folder, name, str(e))
            return 0
        target = self.target()
        try:
            refused = await asyncio.to_thread(
                submit.submit,
                target,
                drop.sender,
                list(drop.recipients),
                drop.data,
                SUBMIT_TIMEOUT,
            )
        except submit.Failure as f:
            if f.code in (submit.EX_DATAERR, submit.EX_NOUSER):
                await self._aside(folder, name, f"refused by the relay: {f}", drop)
            else:
                self._later(name, str(f))
            return 0
        await asyncio.to_thread(maildrop.unlink, path)
        self._retry.pop(name, None)
        log_event(
            log,
            logging.INFO,
            "maildrop_imported",
            "message from the maildrop queued",
            file=name,
            user=drop.user,
            uid=drop.uid,
            sender=drop.sender or "<>",
            rcpts=list(drop.recipients),
        )
        if refused:
            masked = [_masked(r) for r in refused]
            text = f"maildrop file {name}: the relay refused some recipients: " + "; ".join(masked)
            log_event(log, logging.ERROR, "maildrop_refused", text, file=name, user=drop.user)
            await self._alert("warning", text)
        return 1

    def _later(self, name: str, why: str) -> None:
        _due, failures = self._retry.get(name, (0.0, 0))
        delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
        self._retry[name] = (self.clock() + delay, failures + 1)
        if failures in (0, len(BACKOFF) - 1):  # the first time, and once it is slow
            log_event(
                log,
                logging.WARNING,
                "maildrop_deferred",
                "the relay did not take a maildrop message now; will retry",
                file=name,
                error=why,
                retry_in=delay,
            )

    async def _aside(
        self, folder: Path, name: str, why: str, drop: maildrop.Drop | None = None
    ) -> None:
        try:
            dest: Path | str = await asyncio.to_thread(maildrop.move_aside, folder, name)
        except FileNotFoundError:
            return
        except OSError as e:
            dest = f"(could not move it: {e.strerror or e})"
            self._stuck.add(name)
        self._retry.pop(name, None)
        log_event(
            log,
            logging.ERROR,
            "maildrop_corrupt",
            "maildrop file not imported; moved aside",
            file=name,
            moved_to=str(dest),
            reason=why,
            user=drop.user if drop is not None else None,
        )
        text = f"maildrop file {name} not imported ({why}); moved to {dest}"
        await self._alert("critical", _masked(text))

    async def _alert(self, severity: str, text: str) -> None:
        try:
            await self.alert(alerts.Event("maildrop", severity, "maildrop", text))
        except Exception as e:
            log_event(log, logging.ERROR, "alert_failed", "could not record an alert", exc=e)


_BRACKETED = re.compile(r"<([^<>]*)>")  # linear: no nested quantifier


def _masked(text: str) -> str:
    """relay/spool/submit.py's texts (`refused recipient <addr>: ...`) with every `<addr>` masked:
    an alert's text never names a recipient in full (alerts carry masked samples)."""
    return _BRACKETED.sub(
        lambda m: f"<{mask_address(m.group(1))}>" if "@" in m.group(1) else m.group(0), text
    )


def target_of(host: str, port: int, hostname: str) -> submit.Target:
    """The daemon's own first listener, as relay-sendmail finds it."""
    if host in ("0.0.0.0", "*", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return submit.Target(host=host, port=port, hostname=hostname)
