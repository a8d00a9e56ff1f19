"""The systemd service notification protocol (sd_notify(3)), implemented directly.

The service manager passes ``$NOTIFY_SOCKET`` (a filesystem path, or an abstract
socket name starting with ``@``) to ``Type=notify`` services; the service sends
newline-separated ``KEY=VALUE`` assignments as single AF_UNIX datagrams:

- ``READY=1`` once it is listening (and again after a reload completed),
- ``RELOADING=1`` + ``MONOTONIC_USEC=...`` when a reload (SIGHUP) starts,
- ``STOPPING=1`` when shutdown begins,
- ``STATUS=...`` free-form status text shown by ``systemctl status``,
- ``WATCHDOG=1`` keep-alive pings when ``WatchdogSec=`` is set
  (``$WATCHDOG_USEC``, optionally restricted to ``$WATCHDOG_PID``).

Everything here is best effort: when ``$NOTIFY_SOCKET`` is unset every call is a
silent no-op, and a failing send is logged at WARNING but never raised — a
notification problem must not take the daemon down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier", "watchdog_loop"]

log = logging.getLogger(__name__)

_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _parse_watchdog(usec: str | None, pid: str | None) -> float | None:
    if not usec:
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring invalid WATCHDOG_USEC=%r", usec)
        return None
    if value <= 0:
        return None
    if pid:
        try:
            target = int(pid)
        except ValueError:
            log.warning("ignoring watchdog: invalid WATCHDOG_PID=%r", pid)
            return None
        if target != os.getpid():
            # The watchdog is meant for another process (e.g. our parent).
            return None
    return value / 1_000_000


class Notifier:
    """Sends sd_notify(3) datagrams to the service manager; never raises.

    ``notify_socket`` defaults to ``$NOTIFY_SOCKET``; pass ``""`` to disable
    explicitly. The environment (``NOTIFY_SOCKET``, ``WATCHDOG_USEC``,
    ``WATCHDOG_PID``) is read once, at construction (from ``env`` if given, else
    ``os.environ``); with ``unset_environment=True``
    those variables are then removed from ``os.environ`` so that child processes
    do not inherit them.
    """

    def __init__(
        self,
        notify_socket: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        unset_environment: bool = False,
    ) -> None:
        environ: Mapping[str, str] = os.environ if env is None else env
        raw = environ.get("NOTIFY_SOCKET", "") if notify_socket is None else notify_socket
        self._address: str | bytes | None = self._parse_address(raw)
        self._watchdog_interval = _parse_watchdog(
            environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
        )
        self._failing = False
        if unset_environment:
            for name in _ENV_VARS:
                os.environ.pop(name, None)

    @staticmethod
    def _parse_address(raw: str) -> str | bytes | None:
        if not raw:
            return None
        if raw.startswith("@"):
            # Abstract namespace socket: leading NUL byte instead of '@'.
            return b"\0" + os.fsencode(raw[1:])
        if raw.startswith("/"):
            return raw
        log.warning("ignoring unsupported NOTIFY_SOCKET=%r (not a path or @abstract)", raw)
        return None

    @property
    def enabled(self) -> bool:
        """True when a notification socket is configured."""
        return self._address is not None

    # ----------------------------------------------------------------- transport

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments as one datagram. Returns True if it was sent."""
        if self._address is None or not assignments:
            return False
        data = "\n".join(assignments).encode("utf-8", "replace")
        try:
            # A fresh socket per message, like libsystemd: nothing to leak or go stale.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(data, self._address)
        except Exception as exc:  # never let a notification failure escape
            self._report_failure(assignments, exc)
            return False
        if self._failing:
            self._failing = False
            log.info("sd_notify: sending to the service manager works again")
        return True

    def _report_failure(self, assignments: tuple[str, ...], exc: Exception) -> None:
        what = assignments[0].partition("=")[0]
        if not self._failing:
            self._failing = True
            log.warning(
                "sd_notify: could not send %s to %r: %s: %s",
                what,
                self._address,
                type(exc).__name__,
                exc,
            )
        else:  # don't repeat the warning for every watchdog ping of an outage
            log.debug("sd_notify: still failing (%s): %s", what, exc)

    # ----------------------------------------------------------------- messages

    def ready(self) -> bool:
        """``READY=1``: startup (or a reload) finished."""
        return self.notify("READY=1")

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown has begun."""
        return self.notify("STOPPING=1")

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (systemd >= 253, Type=notify-reload).

        Send :meth:`ready` once the reload has completed.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def status(self, text: str) -> bool:
        """``STATUS=<text>`` (newlines are replaced by spaces: one assignment per line)."""
        clean = " ".join(text.splitlines())
        return self.notify(f"STATUS={clean}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1`` keep-alive ping."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC=...``: ask for more time to start/stop/reload."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog_interval(self) -> float | None:
        """Watchdog timeout in seconds from ``$WATCHDOG_USEC``, or None when not enabled.

        None too when ``$WATCHDOG_PID`` is set and is not this process.
        """
        return self._watchdog_interval


async def watchdog_loop(notifier: Notifier, interval: float | None) -> None:
    """Send ``WATCHDOG=1`` every ``interval / 2`` seconds until cancelled.

    Returns immediately when ``interval`` is None or not positive (no watchdog), so
    ``watchdog_loop(n, n.watchdog_interval())`` is always safe to start.
    """
    if interval is None or interval <= 0:
        return
    period = interval / 2
    while True:
        notifier.watchdog()
        await asyncio.sleep(period)
