"""Traffic shaping primitives (pure, sans-I/O; the clock ``now`` is always injected).

Rules:
- Rates are tokens per second (relay/config/tree.py's ``parse_rate`` reads ``"50/s"``). A rate
  of 0 / ``None`` means *unlimited* and is handled by the caller, which simply does not
  create a ``TokenBucket``; the bucket itself requires a positive rate.
- ``TokenBucket`` starts full (``tokens = burst``), never holds more than ``burst`` nor less
  than 0, and a clock that goes backwards adds no tokens.
- Daily windows start at local midnight in the configured time zone (default UTC).  DST days
  are 23 or 25 hours long.  A fixed ``length`` (seconds) instead gives epoch-aligned windows
  ``floor(now / length) * length`` with key ``str(int(start))`` -- for tests and demos only.
- Warm-up: day 1 is ``Warmup.start``; days before the start also count as day 1 (the most
  conservative limit).  An explicit ``schedule`` gives the limit for each day; after the list
  ends the warm-up is over and the limit is ``ceiling`` (``None`` = no warm-up limit).
  Without a schedule the limit is ``floor(initial * factor ** (day - 1))`` capped at
  ``ceiling`` (once reached, the ceiling stays); with no ceiling the curve grows without bound.
  The effective daily limit is the smaller of the configured daily limit and the warm-up limit.
- AIMD (``Adaptive``): a throttle halves the multiplier (floored at ``min_factor``), at most
  once per ``min_interval`` seconds, so a burst of 421s from concurrent connections counts
  once.  Every ``successes_per_step`` clean deliveries add ``step`` back (up to 1.0), but not
  within ``cooldown`` seconds of the last decrease, nor before a rule's hold has passed.
- Shaping rules match SMTP reply text by case-insensitive regex search; the first match
  wins.  ``suspend`` stops deliveries to the destination for ``duration`` seconds;
  ``throttle`` applies an AIMD decrease and holds recovery for ``duration`` seconds.
- Circuit breaker per destination: ``threshold`` consecutive connection-level transient
  failures open it for ``cooldown`` seconds; then exactly one half-open trial is allowed.
  Its success closes the breaker, its failure re-opens it with a fresh cooldown.  A trial
  whose outcome is never reported is replaced by a new trial after another ``cooldown``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal

from relay.config.rules import ShapingRule, compile_pattern, parse_rule
from relay.mail.regex_guard import bounded

__all__ = [
    "DEFAULT_RULES",
    "UNLIMITED",
    "Adaptive",
    "Breaker",
    "ShapingRule",
    "TokenBucket",
    "Warmup",
    "ceiling_reason",
    "day_key",
    "effective_daily_limit",
    "is_unlimited",
    "match_rules",
    "next_window",
    "parse_rule",
    "warmup_limit",
    "window_start",
]

UTC: Final = dt.UTC

# Tolerance for float rounding, so that waiting exactly ``wait_time`` always succeeds.
_EPS: Final = 1e-9

# ---------------------------------------------------------------------------
# Token bucket and rates
# ---------------------------------------------------------------------------

UNLIMITED: Final = 0.0
"""The rate value meaning "no rate limit" (also ``None``)."""


def is_unlimited(rate: float | None) -> bool:
    """True for ``None`` or a non-positive rate (no bucket should be created)."""
    return rate is None or rate <= 0


@dataclass(slots=True)
class TokenBucket:
    """Token bucket: ``rate`` tokens per second, at most ``burst`` tokens.

    ``tokens`` defaults to ``burst`` (the bucket starts full); larger values are clamped.
    ``updated`` is the clock value of the last refill.  ``rate`` must be positive: an
    unlimited rate (0 / ``None``) is handled by the caller by not using a bucket at all.
    """

    rate: float
    burst: float
    tokens: float = math.inf
    updated: float = 0.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not (self.burst > 0 and math.isfinite(self.burst)):
            raise ValueError(f"burst must be a positive number, got {self.burst!r}")
        if not self.tokens >= 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens!r}")
        self.tokens = min(self.tokens, self.burst)

    def refill(self, now: float) -> None:
        """Add the tokens earned since ``updated`` (none if the clock went backwards)."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def _check_n(self, n: float) -> None:
        if not 0 <= n <= self.burst:
            raise ValueError(f"cannot take {n!r} tokens from a bucket with burst {self.burst}")

    def try_take(self, now: float, n: float = 1.0) -> bool:
        """Take ``n`` tokens if available; return whether they were taken."""
        self._check_n(n)
        self.refill(now)
        if self.tokens + _EPS < n:
            return False
        self.tokens = max(0.0, self.tokens - n)
        return True

    def wait_time(self, now: float, n: float = 1.0) -> float:
        """Seconds from ``now`` until ``n`` tokens are available (0.0 if they are now)."""
        self._check_n(n)
        self.refill(now)
        if self.tokens + _EPS >= n:
            return 0.0
        return (n - self.tokens) / self.rate

    def set_rate(self, rate: float, now: float) -> None:
        """Change the rate; tokens earned so far are credited at the old rate."""
        _check_rate(rate)
        self.refill(now)
        self.rate = rate


def _check_rate(rate: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(
            f"token bucket rate must be a positive number of tokens per second, got {rate!r} "
            "(an unlimited rate is handled by not using a bucket)"
        )


# ---------------------------------------------------------------------------
# Daily windows
# ---------------------------------------------------------------------------


def _check_length(length: float) -> None:
    if not (length > 0 and math.isfinite(length)):
        raise ValueError(f"window length must be a positive number of seconds, got {length!r}")


def _midnight(day: dt.date, tz: dt.tzinfo) -> float:
    # fold=0: if local midnight does not exist (DST jump at 00:00) this maps to the instant
    # of the jump; if it is ambiguous, to its first occurrence.  Both are the day's start.
    return dt.datetime(day.year, day.month, day.day, tzinfo=tz).timestamp()


def window_start(now: float, tz: dt.tzinfo = UTC, length: float | None = None) -> float:
    """Start of the window containing ``now``: local midnight in ``tz``.

    With ``length`` (seconds; for tests/demos) windows are fixed epoch-aligned intervals
    ``floor(now / length) * length`` and ``tz`` is ignored.
    """
    if length is not None:
        _check_length(length)
        return math.floor(now / length) * length
    day = dt.datetime.fromtimestamp(now, tz).date()
    start = _midnight(day, tz)
    if start > now:  # exotic zone data; never return a start in the future
        start = _midnight(day - dt.timedelta(days=1), tz)
    return start


def next_window(now: float, tz: dt.tzinfo = UTC, length: float | None = None) -> float:
    """Start of the window after the one containing ``now`` (next local midnight)."""
    if length is not None:
        return window_start(now, tz, length) + length
    day = dt.datetime.fromtimestamp(now, tz).date()
    return _midnight(day + dt.timedelta(days=1), tz)


def day_key(now: float, tz: dt.tzinfo = UTC, length: float | None = None) -> str:
    """Key naming the window containing ``now``: ``"2026-12-02"`` (local date in ``tz``).

    With ``length`` the key is ``str(int(window_start))``.
    """
    if length is not None:
        return str(int(window_start(now, tz, length)))
    return dt.datetime.fromtimestamp(now, tz).date().isoformat()


# ---------------------------------------------------------------------------
# Warm-up and daily ceilings
# ---------------------------------------------------------------------------

# Above this the doubling curve is meaningless; computing it could overflow a float.
_HUGE_LIMIT: Final = 2**62


@dataclass(frozen=True, slots=True)
class Warmup:
    """IP/domain warm-up plan; see ``warmup_limit`` for the curve."""

    start: dt.date
    schedule: tuple[int, ...] | None = None
    initial: int = 500
    factor: float = 2.0
    ceiling: int | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None:
            if not self.schedule:
                raise ValueError("warm-up schedule must not be empty")
            bad = [v for v in self.schedule if v < 1]
            if bad:
                raise ValueError(f"warm-up schedule values must be >= 1, got {bad[0]!r}")
        if self.initial < 1:
            raise ValueError(f"warm-up initial must be >= 1, got {self.initial!r}")
        if not (self.factor >= 1 and math.isfinite(self.factor)):
            raise ValueError(f"warm-up factor must be >= 1, got {self.factor!r}")
        if self.ceiling is not None and self.ceiling < 1:
            raise ValueError(f"warm-up ceiling must be >= 1, got {self.ceiling!r}")


def warmup_limit(w: Warmup, today: dt.date) -> int | None:
    """Daily message limit imposed by the warm-up on ``today`` (``None`` = no limit).

    Day ``n`` is ``(today - w.start).days + 1``; days before the start count as day 1.

    * Explicit ``schedule``: ``schedule[n - 1]`` (capped at ``ceiling``); after the list the
      warm-up is over and the limit is ``ceiling`` (``None`` when unset).
    * Otherwise: ``floor(initial * factor ** (n - 1))`` capped at ``ceiling``; without a
      ceiling the curve is unbounded (``None`` once it is astronomically large).
    """
    n = max(1, (today - w.start).days + 1)
    if w.schedule is not None:
        if n > len(w.schedule):
            return w.ceiling
        value = w.schedule[n - 1]
        return value if w.ceiling is None else min(value, w.ceiling)
    cap = _HUGE_LIMIT if w.ceiling is None else w.ceiling
    if w.factor > 1 and math.log(w.initial) + (n - 1) * math.log(w.factor) >= math.log(cap):
        return w.ceiling
    return min(cap, math.floor(w.initial * w.factor ** (n - 1)))


def sending_identity(identity_by: str, sender: str) -> str:
    """The sending identity of an envelope sender (`shaping.identity_by`): daily ceilings,
    scoped suppression (complaints, unsubscribes) and feedback rates are kept per identity.
    `<>` (and an empty sender) is the identity `<>`."""
    sender = "" if sender == "<>" else sender
    return (
        sender.rpartition("@")[2].lower() if identity_by == "sender_domain" else sender.lower()
    ) or "<>"


def effective_daily_limit(daily_limit: int | None, warmup_limit: int | None) -> int | None:
    """The smaller of the configured daily limit and the warm-up limit (``None`` = none)."""
    limits = [v for v in (daily_limit, warmup_limit) if v is not None]
    return min(limits) if limits else None


def ceiling_reason(limit: int, scope: str, next_window_at: float) -> str:
    """Deferral reason, e.g.
    ``daily limit 5000 reached for example.com; next window 2026-12-03T00:00Z``.

    The next window is shown in UTC with minute precision.
    """
    when = dt.datetime.fromtimestamp(next_window_at, UTC).strftime("%Y-%m-%dT%H:%MZ")
    return f"daily limit {limit} reached for {scope}; next window {when}"


# ---------------------------------------------------------------------------
# AIMD adaptive slow-down
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Adaptive:
    """Additive-increase / multiplicative-decrease multiplier for a destination's shaping.

    ``factor`` (0 < factor <= 1) scales ``base_rate`` and ``base_connections``.  A
    ``base_rate`` of 0 (unlimited) stays unlimited; only connections shrink then.
    """

    base_rate: float
    base_connections: int
    factor: float = 1.0
    min_factor: float = 1 / 16
    cooldown: float = 60.0
    min_interval: float = 5.0
    last_decrease: float | None = None
    step: float = 0.1
    successes_per_step: int = 20
    hold_until: float | None = None
    _successes: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.min_factor <= 1:
            raise ValueError(f"min_factor must be in (0, 1], got {self.min_factor!r}")
        if not self.min_factor <= self.factor <= 1:
            raise ValueError(f"factor must be in [min_factor, 1], got {self.factor!r}")
        if not 0 < self.step <= 1:
            raise ValueError(f"step must be in (0, 1], got {self.step!r}")
        if self.successes_per_step < 1:
            raise ValueError(f"successes_per_step must be >= 1, got {self.successes_per_step}")
        if self.base_connections < 1:
            raise ValueError(f"base_connections must be >= 1, got {self.base_connections}")
        if self.base_rate < 0 or self.cooldown < 0 or self.min_interval < 0:
            raise ValueError("base_rate, cooldown and min_interval must be >= 0")

    def on_throttle(self, now: float, hold: float = 0.0) -> bool:
        """Record a throttling reply; return whether the factor was halved.

        Throttles within ``min_interval`` of the last decrease only reset the success count
        (and extend ``hold``).  ``hold`` (seconds) blocks recovery until ``now + hold``.
        """
        self._successes = 0
        if hold > 0:
            until = now + hold
            self.hold_until = until if self.hold_until is None else max(self.hold_until, until)
        if self.last_decrease is not None and now - self.last_decrease < self.min_interval:
            return False
        self.factor = max(self.min_factor, self.factor / 2)
        self.last_decrease = now
        return True

    def on_success(self, now: float) -> bool:
        """Record a clean delivery; return whether the factor was increased."""
        if self.factor >= 1.0:
            self._successes = 0
            return False
        self._successes += 1
        if self._successes < self.successes_per_step:
            return False
        if self.last_decrease is not None and now - self.last_decrease < self.cooldown:
            return False
        if self.hold_until is not None and now < self.hold_until:
            return False
        self.factor = min(1.0, self.factor + self.step)
        self._successes = 0
        return True

    def reset(self) -> None:
        """The operator's `destination reset`: back to the configured rate at once."""
        self.factor = 1.0
        self.last_decrease = None
        self.hold_until = None
        self._successes = 0

    def effective_rate(self) -> float:
        """Current rate in tokens per second (0 stays 0 = unlimited)."""
        return self.base_rate * self.factor

    def effective_connections(self) -> int:
        """Current connection limit, never below 1."""
        return max(1, math.floor(self.base_connections * self.factor))

    def state(self) -> dict[str, float | int | None]:
        """Snapshot for stats output."""
        return {
            "factor": self.factor,
            "effective_rate": self.effective_rate(),
            "effective_connections": self.effective_connections(),
            "last_decrease": self.last_decrease,
            "hold_until": self.hold_until,
            "successes": self._successes,
        }


# ---------------------------------------------------------------------------
# Shaping rules (reply-text automation); the rule and its parser are config values
# (relay/config/rules.py)
# ---------------------------------------------------------------------------


def match_rules(rules: Iterable[ShapingRule], reply_text: str) -> ShapingRule | None:
    """The first rule whose pattern is found in ``reply_text``, or ``None``."""
    for rule in rules:
        if rule.pattern.search(bounded(reply_text)):
            return rule
    return None


DEFAULT_RULES: Final[tuple[ShapingRule, ...]] = (
    # Yahoo: "421 4.7.0 [TS04]/[TSS04] Messages from x temporarily deferred due to unexpected
    # volume or user complaints" -> stop for 2 hours; retrying sooner prolongs the deferral.
    ShapingRule(compile_pattern(r"\[TSS?04\]"), "suspend", 7200.0),
    # Yahoo [TS01]-[TS03]: reputation/complaint deferrals -> slow down.
    ShapingRule(compile_pattern(r"\[TSS?0[1-3]\]"), "throttle", 300.0),
    # Outlook/Hotmail 4.7.650: "temporarily rate limited due to IP reputation".
    ShapingRule(compile_pattern(r"\b4\.7\.650\b"), "throttle", 300.0),
    # Gmail 4.7.28: "unusual rate of unsolicited mail originating from your IP".
    ShapingRule(compile_pattern(r"\b4\.7\.28\b"), "throttle", 300.0),
    # Gmail and others: 4.7.0 replies that talk about the sending rate.
    ShapingRule(compile_pattern(r"\b4\.7\.0\b.*\brate\b"), "throttle", 300.0),
)
"""Conservative built-in rules, consulted after the operator's own rules."""


# ---------------------------------------------------------------------------
# Circuit breaker
# ---------------------------------------------------------------------------

BreakerState = Literal["closed", "open", "half-open"]


@dataclass(slots=True)
class Breaker:
    """Per-destination circuit breaker over connection-level transient failures.

    Any SMTP reply (even a 5xx) proves the destination reachable and counts as success;
    only failures to connect/greet/TLS or dropped sessions count as failures.  Every
    ``allow`` that returned True for a half-open trial must be followed by ``on_success``,
    ``on_failure`` or ``release``.  Failures reported while open are ignored (connections
    begun before it opened); while a trial is out any failure counts as the trial's.  A
    success reported at any time closes the breaker.

    For the health model (relay/ops/health.py `destination`) it also remembers when the first
    failure since the last success happened (`failing_since`, every failure counts, late
    ones too) and whether the destination ever answered since the daemon started
    (`answered`). An operator's `reset` changes neither, only an answer does. The daemon
    keeps `failing_since` across a restart (relay/delivery/views.py `failing_since`).
    """

    threshold: int = 5
    cooldown: float = 60.0
    failures: int = 0
    opened_at: float | None = None
    half_open_trial: bool = False
    trial_started_at: float | None = None
    failing_since: float | None = None
    answered: bool = False

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"breaker threshold must be >= 1, got {self.threshold}")
        if self.cooldown < 0:
            raise ValueError(f"breaker cooldown must be >= 0, got {self.cooldown}")

    def reopens_at(self, now: float) -> float:
        """When the cooldown of the open circuit ends and a trial is allowed."""
        return (self.opened_at or now) + self.cooldown

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        if now - self.opened_at < self.cooldown:
            return "open"
        return "half-open"

    def allow(self, now: float) -> bool:
        """May a new connection be attempted now?"""
        state = self.state(now)
        if state == "closed":
            return True
        if state == "open":
            return False
        if (
            self.half_open_trial
            and self.trial_started_at is not None
            and now - self.trial_started_at < self.cooldown
        ):
            return False
        self.half_open_trial = True
        self.trial_started_at = now
        return True

    def on_success(self, now: float) -> None:
        """A connection worked: close the breaker."""
        self.failing_since = None
        self.answered = True
        self.reset()

    def reset(self) -> None:
        """Close the breaker (the operator's `destination reset`): not an answer, so the
        health model still sees a destination failing since `failing_since`."""
        self.failures = 0
        self.opened_at = None
        self.half_open_trial = False
        self.trial_started_at = None

    def on_failure(self, now: float) -> None:
        """A connection-level transient failure."""
        if self.failing_since is None:
            self.failing_since = now
        if self.half_open_trial:
            self.opened_at = now  # the trial failed: re-open with a fresh cooldown
            self.half_open_trial = False
            self.trial_started_at = None
            return
        if self.opened_at is not None:
            return  # late failure of a connection started before the breaker opened
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = now

    def kick(self, now: float) -> None:
        """The operator asked for an attempt now (`queue flush`, `destination resume`): an
        open breaker becomes half-open at once, so the next connection is its trial."""
        if self.opened_at is not None and now - self.opened_at < self.cooldown:
            self.opened_at = now - self.cooldown
            self.half_open_trial = False
            self.trial_started_at = None

    def release(self) -> None:
        """The half-open trial ended without a connection outcome (e.g. cancelled)."""
        self.half_open_trial = False
        self.trial_started_at = None
