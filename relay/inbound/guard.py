"""The inbound guard: one per daemon, shared by every listener. It admits or refuses new
connections, runs AUTH password checks off the event loop, and applies the per-IP AUTH
failure delays and bans (the decisions are relay/inbound/anvil.py's), with their log lines and
metrics.

Rules:
- A refused connection is answered `421 4.7.0 <reason>` and closed (RFC 5321 §3.8); it is
  counted in `relay_connections_refused_total{reason}` every time and logged
  (`event=connection_limit`) once per (reason, client) per minute.
- Password checks (scrypt: tens of ms of CPU, ~16 MiB) run in a pool of `auth.max_parallel`
  threads (hashlib.scrypt releases the GIL), never in the event loop. At most
  `auth.max_pending` more wait for a thread; beyond that the client gets
  `454 4.7.0 Temporary authentication failure` (RFC 4954 §6) and no check runs.
- `close()` (at the start of an orderly stop) ends password checking for good: checks not
  yet running are dropped and every AUTH from then on gets the same 454 (try again later,
  on the next instance). Before, a check waiting for a thread went on after `close()` in a
  new pool nobody shut down, so an AUTH flood kept scrypt busy through the whole drain.
- The ban of an IP is logged once (`event=auth_ban`), when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from relay.config.tree import Config
from relay.inbound import anvil
from relay.inbound import auth as auth_
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics

log = logging.getLogger(__name__)

_TEXT = {
    "total": "too many connections, try again later",
    "per_ip": "too many connections from your address, try again later",
    "auth_ban": "too many authentication failures from your address, try again later",
}


class AuthBusy(Exception):
    """Too many password checks waiting: answer 454 4.7.0, run nothing."""


def is_allowed(ip: str, allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    """Inside one of the listener's `allow` networks (loopback is in the default list, not
    trusted by itself: a flood from 127.0.0.2 is still a flood)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in allow)


def peer_facts(
    ip: str, allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
) -> tuple[bool, str]:
    """`is_allowed(ip, allow)` and `anvil.client_key(ip)` from one parse of the address
    (a connection's peer is read once, at connection_made)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False, ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
            key = str(addr)
        else:
            key = str(ipaddress.IPv6Network((addr, 64), strict=False))
    else:
        key = str(addr)
    return any(addr in net for net in allow), key


class PeerFacts:
    """`peer_facts` of one listener, remembered per address: the apps that submit come
    from a few addresses again and again, and a parse was ~1% of the inbound's CPU per
    message under smtp-source (py-spy). Kept for one allow list (a reload that brings
    another starts afresh; the tuple is compared by identity, not hashed per connection),
    and at most `size` addresses (a scan from many addresses starts it afresh too)."""

    __slots__ = ("_allow", "_facts", "size")

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._allow: object = None
        self._facts: dict[str, tuple[bool, str]] = {}

    def __call__(
        self, ip: str, allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    ) -> tuple[bool, str]:
        if allow is not self._allow or len(self._facts) >= self.size:
            self._allow, self._facts = allow, {}
        facts = self._facts.get(ip)
        if facts is None:
            facts = self._facts[ip] = peer_facts(ip, allow)
        return facts


def _policy(config: Config) -> anvil.AuthPolicy:
    a = config.auth
    return anvil.AuthPolicy(
        failure_delay=a.failure_delay,
        max_failure_delay=a.max_failure_delay,
        max_failures=a.max_failures_per_ip,
        window=a.failure_window,
        ban_time=a.ban_time,
    )


def _limits(config: Config) -> anvil.ConnectionLimits:
    lim = config.limits
    return anvil.ConnectionLimits(
        max_connections=lim.max_connections,
        per_ip=lim.max_connections_per_ip,
        per_ip_allowed=lim.max_connections_per_ip_allowed,
        allowed_reserve=lim.allowed_reserve,
    )


class InboundGuard:
    def __init__(
        self,
        config: Config,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.connections = anvil.ConnectionTable()
        self.auth_failures = anvil.AuthFailures(_policy(config))
        self.feedback_rate = anvil.MessageRate()  # mail to the feedback/unsubscribe addresses
        self._log_once = anvil.LogOnce()
        self._executor: ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._waiting = 0
        self._parallel = config.auth.max_parallel
        self._closed = False
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        self.config = config
        self.limits = _limits(config)
        self.auth_failures.policy = _policy(config)
        if self._executor is not None and self._parallel != config.auth.max_parallel:
            self._executor.shutdown(wait=False)  # running checks finish; new ones: new pool
            self._executor = None
            self._slots = None  # holders release the old one; new checks wait on a new one
        self._parallel = config.auth.max_parallel

    def close(self) -> None:
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._slots is not None:
            # wake every check waiting for a thread now: each sees the guard closed and
            # answers 454 while the loop still runs (not a dropped connection at exit)
            for _ in range(self._waiting):
                self._slots.release()

    # --- connections -----------------------------------------------------------------------

    def admit(self, ip: str, allowed: bool, listener: str, key: str | None = None) -> str | None:
        """Count a new connection, or return the `421 4.7.0` reply that refuses it. `key`:
        `anvil.client_key(ip)` when the caller has it already (peer_facts)."""
        now = self.clock()
        if key is None:
            key = anvil.client_key(ip)
        banned = self.auth_failures.banned_until(key, now) is not None
        reason = anvil.refuse_connection(
            self.limits, self.connections.total, self.connections.from_ip(key), allowed, banned
        )
        if reason is None:
            self.connections.opened(key)
            if self.metrics is not None:
                self.metrics.connections_open.set(self.connections.total)
            return None
        if self.metrics is not None:
            self.metrics.connections_refused.labels(reason).inc()
        unlogged = self._log_once.check((reason, key), now)
        if unlogged is not None:
            log_event(
                log,
                logging.WARNING,
                "connection_limit",
                "connection refused",
                reason=reason,
                peer=ip,
                listener=listener,
                open_total=self.connections.total,
                open_from_peer=self.connections.from_ip(key),
                refused_unlogged=unlogged,
            )
        return f"421 4.7.0 {_TEXT[reason]}"

    def release(self, ip: str, key: str | None = None) -> None:
        self.connections.closed(anvil.client_key(ip) if key is None else key)
        if self.metrics is not None:
            self.metrics.connections_open.set(self.connections.total)

    def session_closed(self, reason: str, ip: str, listener: str) -> None:
        """A session we ended with a 421 (max_errors, command_timeout, data_rate,
        auth_failures, 421): counted always, logged once per (reason, client) a minute."""
        if self.metrics is not None:
            self.metrics.sessions_closed.labels(reason).inc()
        unlogged = self._log_once.check(("closed", reason, anvil.client_key(ip)), self.clock())
        if unlogged is not None:
            log_event(
                log,
                logging.WARNING,
                "session_closed",
                "client disconnected with 421",
                reason=reason,
                peer=ip,
                listener=listener,
                closed_unlogged=unlogged,
            )

    # --- feedback mail ---------------------------------------------------------------------

    def feedback_mail(self, ip: str, allowed: bool, listener: str) -> str | None:
        """One more message to the feedback or unsubscribe address from `ip`: None while
        within `feedback.rate_per_ip` per `feedback.rate_window` (an allow-listed or
        authenticated client is not limited), else the `450 4.7.1` that refuses it (RFC
        5321 §4.2.5: the sender keeps it and retries later). Logged once a minute per
        client as `feedback_rate_limited` (the caller counts it: relay_rejected_total)."""
        if allowed:
            return None
        conf = self.config.feedback
        now = self.clock()
        key = anvil.client_key(ip)
        if self.feedback_rate.allow(key, now, conf.rate_per_ip, conf.rate_window):
            return None
        unlogged = self._log_once.check(("feedback_rate", key), now)
        if unlogged is not None:
            log_event(
                log,
                logging.WARNING,
                "feedback_rate_limited",
                "too much mail to the feedback/unsubscribe addresses: 450",
                peer=ip,
                listener=listener,
                limit=conf.rate_per_ip,
                window=conf.rate_window,
                refused_unlogged=unlogged,
            )
        return "450 4.7.1 Too much mail to this address from your address; try again later"

    # --- AUTH ------------------------------------------------------------------------------

    def auth_banned(self, ip: str) -> bool:
        return self.auth_failures.banned_until(anvil.client_key(ip), self.clock()) is not None

    async def check_password(
        self, users: Mapping[str, str], login: bytes, password: bytes
    ) -> str | None:
        """auth.check in the pool; raises AuthBusy when too many are waiting, or once the
        guard is closed (shutting down)."""
        if self._closed:
            raise AuthBusy
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._parallel)
        if self._slots.locked() and self._waiting >= self.config.auth.max_pending:
            raise AuthBusy
        slots = self._slots
        self._waiting += 1
        try:
            await slots.acquire()
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        try:
            if self._closed:  # closed while this one waited for a thread: it never runs
                raise AuthBusy
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._parallel, thread_name_prefix="relay-auth")
            job = self._executor.submit(auth_.check, users, login, password)
        except BaseException:
            slots.release()
            raise

        def done(_: object) -> None:
            # the slot is free when the thread is, not when the client goes away: a client
            # that disconnects mid-check cannot pile up checks behind the semaphore's back
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                loop.call_soon_threadsafe(slots.release)

        job.add_done_callback(done)
        try:
            return await asyncio.wrap_future(job)  # cancelled: a job not yet started is dropped
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.cancelled() and self._closed and task is not None and not task.cancelling():
                # dropped by close(), not a cancellation of this session: answer 454
                raise AuthBusy from None
            raise

    def auth_busy(self, ip: str, listener: str) -> None:
        """A 454 because too many checks wait: logged once per client a minute."""
        if self.metrics is not None:
            self.metrics.rejected.labels("auth_busy").inc()
        unlogged = self._log_once.check(("auth_busy", anvil.client_key(ip)), self.clock())
        if unlogged is not None:
            log_event(
                log,
                logging.WARNING,
                "auth_busy",
                "too many AUTH checks waiting: 454",
                peer=ip,
                listener=listener,
                busy_unlogged=unlogged,
            )

    def auth_failed(self, ip: str, listener: str) -> anvil.AuthVerdict:
        verdict = self.auth_failures.failure(anvil.client_key(ip), self.clock())
        if verdict.banned_until is not None:
            if self.metrics is not None:
                self.metrics.auth_bans.inc()
            log_event(
                log,
                logging.WARNING,
                "auth_ban",
                "too many AUTH failures: client banned",
                peer=ip,
                listener=listener,
                failures=verdict.failures,
                seconds=round(self.config.auth.ban_time),
            )
        return verdict
