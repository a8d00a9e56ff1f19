"""Per-client-IP counters for the inbound limits, after Postfix's anvil(8): open connections,
AUTH failures and bans, and "log this once a minute". Pure: the clock is passed in, nothing
here does I/O; relay/inbound/guard.py is the edge that answers, logs and counts metrics.

Rules:
- A new connection is checked in this order (the first that applies refuses it; the client
  gets `421 4.7.0` and the connection is closed, RFC 5321 §3.8 and §4.2.5):
  1. `total`: `max_connections` connections are open (everyone, allow-listed included: this
     is the bound that keeps the daemon under its file-descriptor limit).
  2. `total`: a client outside every `allow` network when
     `max_connections - allowed_reserve` are open: the last `allowed_reserve` slots are kept
     for the apps the relay serves.
  3. `per_ip`: its IP already has `max_connections_per_ip` open (`..._allowed` for an
     allow-listed IP).
  4. `auth_ban`: a client outside every `allow` network whose IP is banned for AUTH guessing
     (it could do nothing but AUTH).
- AUTH failures are counted per IP over all connections and listeners, in a sliding window
  of `failure_window`. The n-th failure in the window waits `failure_delay * 2**(n-1)`
  (capped at `max_failure_delay`) before its `535`; the `max_failures_per_ip`-th starts a ban
  of `ban_time` (0 = never). A success does not clear the count (an attacker behind the same
  address as a real user must not be helped by that user's logins).
- A refusal or a ban is logged once per (kind, IP) per minute; the line says how many were
  not logged since the last one.
- "Per IP" is per IPv4 address, and per /64 for IPv6 (`client_key`): one host can use a
  whole /64 (RFC 4291 §2.5.1, 64-bit interface identifiers), so counting single IPv6
  addresses would let it sidestep every per-IP limit. IPv4-mapped IPv6 counts as IPv4.
- Memory is bounded: IPs with nothing open, no failure in the window and no ban are forgotten.
- Message rates (`MessageRate`, e.g. mail to the feedback and unsubscribe addresses): at most
  `limit` events per client in any sliding `window`; the one past it is refused and not
  counted (a client that keeps trying is not locked out for longer). Memory is bounded by
  `MAX_TRACKED` clients of at most `limit` timestamps each: past that, clients with nothing
  in the window are forgotten, then the longest-known ones.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from dataclasses import dataclass

LOG_INTERVAL = 60.0  # seconds: one log line per (kind, client) per minute
MAX_TRACKED = 10_000  # IPs remembered for AUTH before a sweep of the stale ones


def client_key(ip: str) -> str:
    """What the per-IP counters count: the IPv4 address, or the IPv6 /64."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    per_ip: int
    per_ip_allowed: int
    allowed_reserve: int


def refuse_connection(
    limits: ConnectionLimits, total: int, from_ip: int, allowed: bool, banned: bool
) -> str | None:
    """Why a new connection must be refused (`total`, `per_ip`, `auth_ban`), or None.
    `total` and `from_ip` are the connections open before this one."""
    if total >= limits.max_connections:
        return "total"
    if not allowed and total >= limits.max_connections - limits.allowed_reserve:
        return "total"
    if from_ip >= (limits.per_ip_allowed if allowed else limits.per_ip):
        return "per_ip"
    if banned and not allowed:
        return "auth_ban"
    return None


class ConnectionTable:
    """Open connections, in total and per IP."""

    def __init__(self) -> None:
        self.total = 0
        self.by_ip: dict[str, int] = {}

    def opened(self, ip: str) -> None:
        self.total += 1
        self.by_ip[ip] = self.by_ip.get(ip, 0) + 1

    def closed(self, ip: str) -> None:
        n = self.by_ip.get(ip, 0)
        if n <= 0:
            return
        self.total -= 1
        if n == 1:
            del self.by_ip[ip]
        else:
            self.by_ip[ip] = n - 1

    def from_ip(self, ip: str) -> int:
        return self.by_ip.get(ip, 0)


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    failure_delay: float
    max_failure_delay: float
    max_failures: int  # 0 = never ban
    window: float
    ban_time: float


@dataclass(frozen=True, slots=True)
class AuthVerdict:
    delay: float  # seconds to wait before the 535
    failures: int  # failures from this IP in the window, this one included
    banned_until: float | None  # set when this failure started a ban


def failure_delay(policy: AuthPolicy, failures: int) -> float:
    """The wait before the `535` of the n-th failure in the window (n >= 1)."""
    if policy.failure_delay <= 0 or failures < 1:
        return 0.0
    return min(policy.max_failure_delay, policy.failure_delay * 2.0 ** min(failures - 1, 32))


class AuthFailures:
    """AUTH failures and bans per IP, across connections."""

    def __init__(self, policy: AuthPolicy) -> None:
        self.policy = policy
        self._failures: dict[str, deque[float]] = {}
        self._bans: dict[str, float] = {}

    def banned_until(self, ip: str, now: float) -> float | None:
        until = self._bans.get(ip)
        if until is None:
            return None
        if until <= now:
            del self._bans[ip]
            return None
        return until

    def failure(self, ip: str, now: float) -> AuthVerdict:
        p = self.policy
        times = self._failures.get(ip)
        if times is None:
            if len(self._failures) >= MAX_TRACKED:
                self.sweep(now)
            times = self._failures[ip] = deque(maxlen=max(p.max_failures, 64))
        while times and times[0] <= now - p.window:
            times.popleft()
        times.append(now)
        n = len(times)
        until = None
        if p.max_failures and n >= p.max_failures and self.banned_until(ip, now) is None:
            until = self._bans[ip] = now + p.ban_time
            times.clear()  # after the ban, a fresh count (and short delays) again
        return AuthVerdict(delay=failure_delay(p, n), failures=n, banned_until=until)

    def sweep(self, now: float) -> None:
        """Forget IPs with no failure in the window and no ban."""
        cutoff = now - self.policy.window
        for ip in [ip for ip, t in self._failures.items() if not t or t[-1] <= cutoff]:
            del self._failures[ip]
        for ip in [ip for ip, until in self._bans.items() if until <= now]:
            del self._bans[ip]

    def tracked(self) -> int:
        return len(self._failures) + len(self._bans)


class LogOnce:
    """Rate-limits log lines to one per key per `interval`."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self._last: dict[object, tuple[float, int]] = {}

    def check(self, key: object, now: float) -> int | None:
        """None: do not log now. Else log, saying this many were not logged since."""
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if len(self._last) >= MAX_TRACKED:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval}
        self._last[key] = (now, 0)
        return last[1] if last is not None else 0


class MessageRate:
    """At most `limit` events per key in any sliding `window` of seconds (see the rules)."""

    def __init__(self) -> None:
        self._times: dict[str, deque[float]] = {}

    def allow(self, key: str, now: float, limit: int, window: float) -> bool:
        """Count one event for `key` and say whether it is within the limit (0: no limit)."""
        if limit <= 0:
            return True
        times = self._times.get(key)
        if times is None:
            if len(self._times) >= MAX_TRACKED:
                self.sweep(now, window)
            times = self._times[key] = deque()
        while times and times[0] <= now - window:
            times.popleft()
        if len(times) >= limit:
            return False
        times.append(now)
        return True

    def sweep(self, now: float, window: float) -> None:
        """Forget keys with nothing in the window; if as many are left, the older half."""
        cutoff = now - window
        self._times = {k: t for k, t in self._times.items() if t and t[-1] > cutoff}
        if len(self._times) >= MAX_TRACKED:
            keep = list(self._times.items())[len(self._times) // 2 :]
            self._times = dict(keep)

    def tracked(self) -> int:
        return len(self._times)
