"""The per-connection watch over slow and erring clients: the command timer, the DATA rate
meter and the error count (the decisions are relay/inbound/session_limits.py's). It only sees the
replies the protocol pushes and the bytes the transport delivers, so it does not depend on
how the protocol core (relay/inbound/core.py) parses commands and message data.

Rules:
- After a final reply (and after a `334` AUTH challenge) the command timer runs until a line
  end arrives; when it fires: `421 4.4.2` and close.
- `354` starts the DATA rate meter; it stops at the `<CRLF>.<CRLF>` that ends the data, or at
  the next final reply. Every slot of its window a timer feeds it zero bytes, so a client
  that sends nothing is caught too. Too slow: `421 4.4.2` and close.
- `replied()` answers whether the error limit has just been reached; the protocol then sends
  `421 4.7.0` and closes (it can await a push, a timer callback cannot).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from relay.config.tree import Limits
from relay.inbound.session_limits import SLOTS, DataRate, counts_as_error, resets_errors
from relay.mail.message import find_dot_line

_END_OF_DATA = b"\r\n.\r\n"

CommandTimeout = "421 4.4.2 {host} timeout waiting for a command, closing connection"
DataTooSlow = "421 4.4.2 {host} data arriving too slowly, closing connection"
TooManyErrors = "421 4.7.0 {host} too many errors, closing connection"


class SessionWatch:
    def __init__(
        self, limits: Limits, loop: asyncio.AbstractEventLoop, close: Callable[[str], None]
    ) -> None:
        """`close(reason)` answers 421 for that reason and closes the connection."""
        self.limits = limits
        self.loop = loop
        self._close = close
        self.errors = 0
        self._command_timer: asyncio.TimerHandle | None = None
        self._command_deadline: float | None = None  # loop time; None: not running
        self._rate: DataRate | None = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self.closed = False

    # --- what the protocol tells us --------------------------------------------------------

    def replied(self, status: str) -> bool:
        """A reply line was sent. True when it was the `max_errors`-th error."""
        if self.closed:
            return False
        final = len(status) < 4 or status[3] == " "
        if status.startswith("354"):
            self.awaiting_data()
        elif final or status.startswith("334"):
            self.awaiting_command()
        if resets_errors(status):
            self.errors = 0
        elif counts_as_error(status):
            self.errors += 1
            if self.limits.max_errors and self.errors >= self.limits.max_errors:
                return True
        return False

    def awaiting_command(self) -> None:
        """A final reply (or a 334) is out: the command timer runs until a line end."""
        if not self.closed:
            self._stop_rate()
            self._start_command_timer()

    def awaiting_data(self) -> None:
        """Our 354 is out: the DATA rate meter runs."""
        if not self.closed:
            self._stop_command_timer()
            self._start_rate()

    def waiting_on_us(self) -> None:
        """A decision of ours is pending (the accept step): no client timer runs."""
        self._stop_command_timer()
        self._stop_rate()

    def received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._command_deadline is not None and b"\n" in data:
            self._stop_command_timer()
        if self._rate is not None:
            # only ever the end (dots at the start of a data line are doubled)
            # found from the dots (a memchr: relay/inbound/dataflow.py), not by a search for
            # the pattern over CRLF-dense text, which was 4% of a 100 KiB message's loop time
            end = find_dot_line(data, 0, _END_OF_DATA) >= 0 or _END_OF_DATA in self._tail + data[:4]
            self._tail = (self._tail + data[-4:])[-4:]
            if end:
                self._stop_rate()  # the client is done; the reply is ours to make
            elif self._rate.feed(len(data), self.loop.time()):
                self._fire("data_rate")

    def stop(self) -> None:
        self.closed = True
        self._stop_command_timer()
        if self._command_timer is not None:  # a closed session holds no timer
            self._command_timer.cancel()
            self._command_timer = None
        self._stop_rate()

    # --- timers ----------------------------------------------------------------------------

    def _fire(self, reason: str) -> None:
        if not self.closed:
            self.stop()
            self._close(reason)

    # The command timer is a deadline and one timer handle: starting it moves the deadline,
    # stopping it clears the deadline; the handle is armed again only when it fires with
    # the deadline still ahead (a client that answers at once costs no timer per command).

    def _start_command_timer(self) -> None:
        self._command_deadline = self.loop.time() + self.limits.command_timeout
        if self._command_timer is None:
            self._command_timer = self.loop.call_at(self._command_deadline, self._command_due)

    def _stop_command_timer(self) -> None:
        self._command_deadline = None

    def _command_due(self) -> None:
        self._command_timer = None
        deadline = self._command_deadline
        if deadline is None or self.closed:
            return
        if self.loop.time() < deadline:
            self._command_timer = self.loop.call_at(deadline, self._command_due)
            return
        self._fire("command_timeout")

    def _start_rate(self) -> None:
        self._stop_rate()
        if self.limits.min_data_rate <= 0:
            return
        window = self.limits.min_data_rate_window
        self._rate = DataRate(self.limits.min_data_rate, window, self.loop.time())
        self._tail = b"\r\n"  # the data may be empty: "." right after the 354
        self._rate_timer = self.loop.call_later(window / SLOTS, self._tick)

    def _tick(self) -> None:
        self._rate_timer = None
        if self._rate is None or self.closed:
            return
        if self._rate.feed(0, self.loop.time()):
            self._fire("data_rate")
            return
        self._rate_timer = self.loop.call_later(self._rate.window / SLOTS, self._tick)

    def _stop_rate(self) -> None:
        self._rate = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
