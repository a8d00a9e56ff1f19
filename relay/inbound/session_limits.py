"""Per-connection limits on slow or erring clients: which replies count as errors, and the
minimum data rate during DATA. Pure: the clock is passed in; relay/inbound.py owns the timers
and answers.

Rules:
- Errors (Postfix's smtpd_hard_error_limit): every 4xx/5xx reply counts, except a `421`
  (the connection closes anyway), a reply whose enhanced code is `X.3.Y` (the mail system's
  own condition, e.g. `451 4.3.0` spool unavailable: not the client's fault), `452 4.5.3`
  too many recipients (flow control: the client sends the rest in another transaction,
  RFC 5321 §4.5.3.1.10) and a refused suppressed recipient (the recipient's state, not the
  client's behaviour). After
  `limits.max_errors` of them in one session the client gets `421 4.7.0` and is closed
  (RFC 5321 §4.2.5, §3.8). An accepted message (`250` to DATA) starts the count again, so a
  long-lived session of a busy app is judged on its recent behaviour.
- Command timeout: from the end of a reply until the next command line has arrived, at most
  `limits.command_timeout`, then `421 4.4.2` and close (RFC 5321 §4.5.3.2.7 is the server's
  timeout awaiting a command; §3.8 allows the 421).
- Minimum data rate: during DATA, once `limits.min_data_rate_window` has passed, the bytes
  received in the last window must be at least `min_data_rate * window`, else `421 4.4.2`
  and close. Measured over a ring of slots, so memory is constant however the client
  fragments its writes. relay/inbound/session_watch.py feeds it from the transport's
  `data_received` (relay/inbound/transport.py), whatever the protocol core makes of the
  bytes.
"""

from __future__ import annotations

import re

SLOTS = 10  # a window is measured in this many slots

_REPLY = re.compile(r"^([245])\d\d[ -](?:([245])\.(\d{1,3})\.(\d{1,3})\b)?")


def counts_as_error(status: str) -> bool:
    """Whether a reply (one line, as pushed) counts towards `limits.max_errors`."""
    m = _REPLY.match(status)
    if m is None or m.group(1) == "2" or status.startswith("421"):
        return False
    if status[3] == "-":  # a continuation line: the final line counts
        return False
    if m.group(3) == "3":  # X.3.Y: mail system status (ours, not the client's)
        return False
    if m.group(3) == "5" and m.group(4) == "3":  # X.5.3: too many recipients
        return False
    return not (status.startswith("550 5.1.1") and "suppressed" in status)


def resets_errors(status: str) -> bool:
    """An accepted message: the reply to the final dot of DATA."""
    return status.startswith("250 2.0.0 Ok: ")


class DataRate:
    """Bytes over a sliding window; `feed(n, now)` answers True when the client is too slow.

    `feed(0, now)` from a periodic timer catches a client that sends nothing at all."""

    def __init__(self, min_rate: float, window: float, start: float) -> None:
        self.min_rate = min_rate
        self.window = window
        self.start = start
        self._slot = window / SLOTS
        self._counts = [0] * SLOTS
        self._index = 0  # absolute slot number of the newest slot
        self.total = 0

    def feed(self, nbytes: int, now: float) -> bool:
        index = int((now - self.start) / self._slot)
        if index > self._index:
            for i in range(self._index + 1, min(index, self._index + SLOTS) + 1):
                self._counts[i % SLOTS] = 0
            self._index = index
        self._counts[index % SLOTS] += nbytes
        self.total += nbytes
        return self.too_slow(now)

    def too_slow(self, now: float) -> bool:
        if self.min_rate <= 0 or now - self.start < self.window:
            return False
        # the full slots of the last window (the current one is still filling)
        index = int((now - self.start) / self._slot)
        recent = sum(
            self._counts[i % SLOTS] for i in range(index - SLOTS + 1, index + 1) if i <= self._index
        )
        return recent < self.min_rate * self.window
