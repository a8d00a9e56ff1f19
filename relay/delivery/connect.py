"""The connector part of the engine: opens the connection for a job, the route's upstreams
in order (failover), or the recipient domain's MX hosts. Owns the MX resolver, the MTA-STS
resolver with what it learned, and one OAuth2 token cache per upstream; reads and charges
the destinations' breakers (relay/delivery/destinations.py).

Rules:
- An upstream whose circuit is open or that is suspended is skipped (the next one in `via`
  is tried); one that fails at connection level (refused, timeout, 421 greeting, TLS, AUTH)
  is charged to its own breaker, logged (`failover`), and the next one is tried, all within
  the same attempt. The last failure is the attempt's result.
- A refusal of our configuration (AUTH, certificate, STARTTLS missing) marks the upstream's
  `config_error` (critical in /health) and logs `upstream_config_error`; a connection that
  works clears it.
- MX: hosts in preference order, every address of each; a permanent greeting/EHLO refusal
  ends the attempt (siblings would say the same).
- MTA-STS (relay/authenticity/mtasts.py, `upstream.mx.mta_sts`): under an `enforce` policy a
  host the policy does not list is skipped and one it lists is used only over STARTTLS
  with a certificate verified for its name; either failure is transient (`4.7.5`, saying
  why), logged (`mta_sts_refused`) and counted per policy domain; `testing` logs what
  enforce would have refused and delivers as before.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.authenticity import mtasts
from relay.config.routes import UpstreamHost
from relay.config.tree import Config
from relay.delivery.errors import DnsPermanentError, DnsTransientError
from relay.delivery.jobs import DestState, Job
from relay.delivery.mx import MxHost, Resolver
from relay.delivery.oauth import TokenSource
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import ConnectFailed, Connection, RcptResult, Timeouts, TlsPolicy
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics

if TYPE_CHECKING:
    from relay.delivery.destinations import Destinations

log = logging.getLogger("relay.delivery.engine")

Failure = dict[str, RcptResult]


class Connector:
    """Opens the connection of a job. Owns the MX resolver, the MTA-STS resolver and what
    it learned (policy hosts' addresses, failures already counted), and one OAuth2 token
    cache per upstream."""

    def __init__(
        self,
        dests: Destinations,
        *,
        metrics: Metrics,
        clock: Callable[[], float],
        rng: random.Random,
        fleet: bool,
        resolver: Resolver | None = None,
    ) -> None:
        self.dests = dests
        self.metrics = metrics
        self.clock = clock
        self.rng = rng
        self.fleet = fleet  # a fleet counts a failover to the upstream dispatched to
        self.resolver = resolver
        self._ns: object = None
        self.mta_sts: mtasts.MtaStsResolver | None = None  # MX mode, upstream.mx.mta_sts
        self._sts_conf: object = None
        self.sts_hosts: dict[str, str] = {}  # mta-sts.<domain> -> address (nameservers set)
        self.sts_seen: dict[tuple[str, str], int] = {}  # failures already in the metric
        self._tokens: dict[str, tuple[UpstreamHost, TokenSource]] = {}

    def resolver_for(self, config: Config) -> Resolver:
        """The MX resolver `config` wants: the one we have while its nameservers stay
        (a new one may fail on a bad nameserver: called before anything changes)."""
        resolver = self.resolver
        ns = config.upstream.mx.nameservers
        if resolver is None or ns != self._ns:
            resolver = Resolver(
                nameservers=list(ns) if ns else None,
                timeout=config.upstream.mx.dns_timeout,
                rng=self.rng,
            )
        return resolver

    def apply_config(self, config: Config, resolver: Resolver) -> None:
        self.config = config
        self.resolver = resolver
        ns = config.upstream.mx.nameservers
        self._ns = ns
        mx = config.upstream.mx
        sts_conf = (mx.mta_sts, ns, mx.dns_timeout, mx.ca_file, mx.mta_sts_port, config.spool_path)
        if sts_conf != self._sts_conf:
            self.mta_sts = (
                mtasts.MtaStsResolver(
                    nameservers=list(ns) if ns else None,
                    timeout=mx.dns_timeout,
                    https_port=mx.mta_sts_port,
                    ca_file=str(mx.ca_file) if mx.ca_file else None,
                    # with upstream.mx.nameservers, the policy host is looked up there too
                    connect_host=(lambda h: self.sts_hosts.get(h, h)) if ns else None,
                    cache_path=config.spool_path / "mta-sts.json",
                    clock=self.clock,
                )
                if mx.mta_sts
                else None
            )
            self._sts_conf = sts_conf

    def token_source(self, up: UpstreamHost) -> TokenSource | None:
        """One OAuth2 token cache per upstream, kept while its OAuth settings stay."""
        if up.oauth is None:
            return None
        have = self._tokens.get(up.name)
        if have is None or have[0].oauth != up.oauth:
            have = (up, TokenSource(up.oauth, clock=self.clock))
            self._tokens[up.name] = have
        return have[1]

    async def open_for(
        self, st: DestState, job: Job, *, first_allowed: bool = True
    ) -> tuple[Connection | None, DestState, Failure | None, bool]:
        """(connection, the destination it belongs to, failure results, whether any upstream
        was tried at all)."""
        rcpts = [c.address for c in job.claims]
        if st.upstream is None:
            conn, failure = await self._open_mx(st, job)
            return conn, st, failure, True
        chain = [st]
        if job.route is not None and st.name in job.route.via:
            chain += [self.dests.dest(n) for n in job.route.via[job.route.via.index(st.name) + 1 :]]
        last: tuple[DestState, ConnectFailed] | None = None
        for i, d in enumerate(chain):
            now = self.clock()
            if i > 0 and not self.fleet:
                # the backup carries the transaction under its own daily ceiling (one engine;
                # a fleet counts it to the upstream it was dispatched to, README Known limits)
                ledger = self.dests.ledger
                room = ledger.room(ledger.limits(d.name, d.conf.daily_limit, "", None, now), now)
                if room is not None and room[0] < len(rcpts):
                    log_event(
                        log,
                        logging.INFO,
                        "failover",
                        "upstream skipped: its daily ceiling is reached",
                        destination=d.name,
                        queue_id=job.msg_id,
                    )
                    continue
            if i > 0 or not first_allowed:
                before = d.breaker.state(now)
                if d.suspended_until > now or not d.breaker.allow(now):
                    log_event(
                        log,
                        logging.INFO,
                        "failover",
                        "upstream skipped: circuit open or suspended",
                        destination=d.name,
                        queue_id=job.msg_id,
                    )
                    continue
                if before == "half-open":
                    log_event(
                        log,
                        logging.INFO,
                        "circuit_half_open",
                        "cooldown over: this connection is the trial",
                        destination=d.name,
                    )
            c = self._connection(d)
            try:
                await c.open()
            except ConnectFailed as ex:
                _config_error(d, c, ex)
                if ex.verdict.outcome is not Outcome.TRANSIENT:
                    return (
                        None,
                        d,
                        {r: RcptResult(ex.verdict, ex.reply, ex.phase) for r in rcpts},
                        True,
                    )
                if last is not None:  # the previous one's failure is final now: charge it
                    self._charge(*last)
                last = (d, ex)
                if i + 1 < len(chain):
                    log_event(
                        log,
                        logging.WARNING,
                        "failover",
                        "upstream failed; trying the next one",
                        destination=d.name,
                        host=c.label,
                        reply=str(ex.reply),
                        queue_id=job.msg_id,
                        next=chain[i + 1].name,
                    )
                continue
            if d.config_error is not None:
                log_event(
                    log,
                    logging.INFO,
                    "upstream_config_ok",
                    "upstream accepts our configuration again",
                    destination=d.name,
                    host=c.label,
                )
            d.config_error = None
            if last is not None:
                self._charge(*last)
            if i > 0 and not self.fleet:
                job.reserved = self.dests.ledger.hand_over(
                    job.reserved, len(job.claims), st.name, d.name, d.conf.daily_limit
                )
                job.carrier = d.name
            if i > 0:
                log_event(
                    log,
                    logging.INFO,
                    "failover",
                    "transaction goes to a later upstream",
                    destination=d.name,
                    host=c.label,
                    queue_id=job.msg_id,
                )
            return c, d, None, True
        if last is None:  # every upstream skipped
            names = ", ".join(d.name for d in chain)
            reply = Reply(
                451, "4.4.1", f"no upstream available now ({names}: circuit open or suspended)"
            )
            v = Verdict(Outcome.TRANSIENT, True, False, Scope.TRANSACTION)
            return None, st, {r: RcptResult(v, reply, Phase.CONNECT) for r in rcpts}, False
        d, failed = last
        return (
            None,
            d,
            {r: RcptResult(failed.verdict, failed.reply, failed.phase) for r in rcpts},
            True,
        )

    def _charge(self, d: DestState, ex: ConnectFailed) -> None:
        """An upstream failed and another carried the attempt: its breaker learns it here."""
        now = self.clock()
        before = d.breaker.state(now)
        d.breaker.on_failure(now)
        self.dests.breaker_changed(d, before, now, str(ex.reply))

    def _connection(self, d: DestState) -> Connection:
        up = d.upstream
        assert up is not None
        return Connection(
            host=up.host,
            address=up.host,
            port=up.port,
            helo=self.config.upstream.helo,
            tls=TlsPolicy(up.tls, up.verify, up.ca_file),
            timeouts=_timeouts(d),
            username=up.username,
            password=up.password,
            auth=up.auth,
            tokens=self.token_source(up),
        )

    async def _open_mx(self, st: DestState, job: Job) -> tuple[Connection | None, Failure | None]:
        mx = self.config.upstream.mx
        rcpts = [c.address for c in job.claims]
        assert self.resolver is not None
        try:
            hosts: list[MxHost] = await self.resolver.resolve(job.destination)
        except (DnsPermanentError, DnsTransientError) as ex:
            permanent = isinstance(ex, DnsPermanentError)
            v = Verdict(
                Outcome.BOUNCE if permanent else Outcome.TRANSIENT, True, False, Scope.TRANSACTION
            )
            return None, {r: RcptResult(v, ex.reply, Phase.CONNECT) for r in rcpts}
        policy = await self._sts_policy(job.destination)
        last: ConnectFailed | None = None
        refused: str | None = None  # why an MTA-STS policy kept us from every host
        for h in hosts:
            verdict = mtasts.check_mx(policy, h.name)
            if not verdict.allowed:
                refused = verdict.reason
                self._sts_failed(job.destination, "mx_mismatch", verdict.reason, h.name)
                continue
            if verdict.log_only:
                log_event(
                    log,
                    logging.WARNING,
                    "mta_sts_testing",
                    verdict.reason,
                    destination=job.destination,
                    host=h.name,
                    queue_id=job.msg_id,
                )
            tls = (
                TlsPolicy("starttls", True, mx.ca_file)
                if verdict.require_verified_tls
                else TlsPolicy(mx.tls, mx.verify, mx.ca_file)
            )
            for addr in h.addresses:
                c = Connection(
                    host=h.name,
                    address=addr,
                    port=mx.port,
                    helo=self.config.upstream.helo,
                    tls=tls,
                    timeouts=_timeouts(st),
                )
                try:
                    await c.open()
                    st.config_error = None
                    return c, None
                except ConnectFailed as ex:
                    if verdict.require_verified_tls and ex.phase in (Phase.STARTTLS, Phase.EHLO):
                        # the domain's policy demands verified TLS: its failure, not ours
                        text = mtasts.tls_failure_reason(job.destination, h.name, ex)
                        self._sts_failed(job.destination, "tls", text, h.name)
                        ex = ConnectFailed(
                            Verdict(Outcome.TRANSIENT, True, False, Scope.TRANSACTION),
                            Reply.parse(454, text),
                            ex.phase,
                            False,
                        )
                    last = ex
                    _config_error(st, c, ex)
                    if ex.verdict.outcome is not Outcome.TRANSIENT:
                        # a permanent greeting/EHLO refusal: no point trying siblings
                        return None, {r: RcptResult(ex.verdict, ex.reply, ex.phase) for r in rcpts}
        if last is None:
            # every MX host refused by the domain's MTA-STS policy: transient, and says why
            reply = Reply(451, "4.7.5", refused or "no MX host allowed")
            v = Verdict(Outcome.TRANSIENT, True, False, Scope.TRANSACTION)
            return None, {r: RcptResult(v, reply, Phase.CONNECT) for r in rcpts}
        # every host failed transiently: connection-level transient for all
        return None, {r: RcptResult(last.verdict, last.reply, last.phase) for r in rcpts}

    async def _sts_policy(self, domain: str) -> mtasts.Policy | None:
        """The MTA-STS policy for mail to `domain` (None: none, or MTA-STS off). With
        `upstream.mx.nameservers`, the policy host's address is looked up there too."""
        sts = self.mta_sts
        if sts is None:
            return None
        ns = self.config.upstream.mx.nameservers
        host = f"mta-sts.{domain}".lower()
        if ns and host not in self.sts_hosts and self.resolver is not None:
            found = await self.resolver.addresses_of(host)
            if found:
                self.sts_hosts[host] = found[0]
        policy = await sts.policy(domain)
        for (d, reason), n in sts.failures.items():  # the resolver's counts into the metric
            seen = self.sts_seen.get((d, reason), 0)
            if n > seen:
                self.metrics.mta_sts_failures.labels(d, reason).inc(n - seen)
                self.sts_seen[(d, reason)] = n
        return policy

    def _sts_failed(self, domain: str, reason: str, text: str, host: str) -> None:
        self.metrics.mta_sts_failures.labels(domain, reason).inc()
        log_event(
            log,
            logging.WARNING,
            "mta_sts_refused",
            text,
            destination=domain,
            host=host,
            reason=reason,
        )


def _config_error(d: DestState, c: Connection, ex: ConnectFailed) -> None:
    if ex.operator_fault:
        d.config_error = f"{c.label}: {ex.reply}"
        log_event(
            log,
            logging.ERROR,
            "upstream_config_error",
            "upstream refused our configuration (credentials, TLS); mail is kept and"
            " retried, fix the config",
            destination=d.name,
            host=c.label,
            reply=str(ex.reply),
        )


def _timeouts(d: DestState) -> Timeouts:
    return Timeouts(
        connect=d.conf.connect_timeout, command=d.conf.command_timeout, data=d.conf.data_timeout
    )
