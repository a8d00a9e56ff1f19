"""MX resolution for outbound delivery (RFC 5321 §5.1, RFC 7505).

The edge is :class:`Resolver`, a thin asynchronous wrapper around
``dns.asyncresolver.Resolver`` (never blocking DNS in async code). The decisions
are pure functions that table tests can drive without DNS: :func:`order_mx`,
:func:`is_null_mx`, :func:`parse_nameserver` and :func:`parse_domain_literal`.

Outcome of :meth:`Resolver.resolve` for a recipient domain:

- a list of :class:`MxHost` in the order to try them, or
- :class:`~relay.delivery.errors.DnsPermanentError` (bounce the recipient), or
- :class:`~relay.delivery.errors.DnsTransientError` (defer and retry later).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.rdtypes.ANY.MX
import dns.resolver

from relay.config.values import parse_nameserver  # upstream.mx.nameservers
from relay.delivery.errors import DnsPermanentError, DnsTransientError
from relay.delivery.replies import Reply

__all__ = [
    "MxHost",
    "Resolver",
    "is_null_mx",
    "order_mx",
    "parse_domain_literal",
    "parse_nameserver",
]

_ATTEMPT_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class MxHost:
    """One mail exchanger to try.

    ``name`` is the exchange host name, lowercased (DNS names are case-insensitive,
    RFC 4343), in A-label (ASCII) form without the trailing dot; for a domain
    literal it is the literal itself, e.g. ``"[127.0.0.1]"``.
    ``addresses`` holds the A addresses followed by the AAAA addresses, each
    family in the order the resolver returned them.
    """

    name: str
    preference: int
    addresses: tuple[str, ...]


# -- pure decisions ---------------------------------------------------------------


def _is_root(exchange: str) -> bool:
    return exchange.strip().rstrip(".") == ""


def is_null_mx(records: Sequence[tuple[int, str]]) -> bool:
    """True if *records* is a null MX: one MX record, preference 0, exchange ``"."``.

    RFC 7505 §3: a domain that does not accept mail publishes a single MX record
    with preference 0 and the root as exchange, and no other MX records.
    """
    if len(records) != 1:
        return False
    preference, exchange = records[0]
    return preference == 0 and _is_root(exchange)


def order_mx(records: Sequence[tuple[int, str]], rng: random.Random) -> list[tuple[int, str]]:
    """Order MX records for delivery attempts (RFC 5321 §5.1).

    Records are sorted by preference, lowest first; hosts of equal preference are
    shuffled "to spread the load across multiple mail exchangers" (RFC 5321 §5.1)
    using *rng*. Each group is first put in a canonical (name) order so that the
    result depends only on the record set and the rng state, not on the order
    the DNS answer happened to list them in. Exchanges are compared
    case-insensitively and without the trailing dot; a host listed twice keeps
    its lowest preference. Root exchanges (``"."``, RFC 7505) are dropped: they
    name no host.
    """
    best: dict[str, tuple[int, str]] = {}
    for preference, exchange in records:
        if _is_root(exchange):
            continue
        key = exchange.strip().rstrip(".").lower()
        current = best.get(key)
        if current is None or preference < current[0]:
            best[key] = (preference, exchange)
    ordered = sorted(best.values(), key=lambda rec: (rec[0], rec[1].rstrip(".").lower()))
    result: list[tuple[int, str]] = []
    for _, group in itertools.groupby(ordered, key=lambda rec: rec[0]):
        same = list(group)
        rng.shuffle(same)
        result.extend(same)
    return result


def make_resolver(
    nameservers: Sequence[str] | None,
    timeout: float,
    base: dns.asyncresolver.Resolver | None = None,
) -> dns.asyncresolver.Resolver:
    """The project's one way to build a dnspython resolver: `nameservers` as specs
    (`"127.0.0.1:5353"`, `"[::1]"`; None: the system's, from /etc/resolv.conf), no cache,
    and `timeout` bounding one whole query. `base`: an already made resolver to set up
    (one made with configure=False when the system has no resolver configuration)."""
    resolver = (
        base if base is not None else dns.asyncresolver.Resolver(configure=nameservers is None)
    )
    if nameservers is not None:
        parsed = [parse_nameserver(spec) for spec in nameservers]
        if not parsed:
            raise ValueError("nameservers must not be empty (use None for the system's)")
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(address, port) for address, port in parsed
        ]
    # lifetime bounds one whole query (all servers and retries); each attempt gets a share
    # of it so that a dead first server leaves time to ask the next one, and a lone server
    # gets retransmissions (dnspython's default attempt is 2 s).
    servers = max(1, len(resolver.nameservers))
    resolver.lifetime = timeout
    resolver.timeout = min(_ATTEMPT_TIMEOUT, timeout / servers)
    resolver.cache = None
    return resolver


def parse_domain_literal(domain: str) -> str | None:
    """Return the IP address of an address literal, or ``None`` if *domain* is a name.

    RFC 5321 §4.1.3: ``[192.0.2.1]`` or ``[IPv6:2001:db8::1]``. Mail to an address
    literal goes straight to that address, without DNS (RFC 5321 §5.1). Raises
    :class:`DnsPermanentError` for a malformed or unsupported literal.
    """
    text = domain.strip()
    if not text.startswith("["):
        return None
    if not text.endswith("]"):
        raise _bad_literal(domain)
    inner = text[1:-1]
    try:
        if inner[:5].lower() == "ipv6:":
            return str(ipaddress.IPv6Address(inner[5:]))
        return str(ipaddress.IPv4Address(inner))
    except ValueError:
        raise _bad_literal(domain) from None


def _bad_literal(domain: str) -> DnsPermanentError:
    # RFC 3463: X.1.2 bad destination system address.
    return DnsPermanentError(Reply(550, "5.1.2", f"invalid address literal {domain}"))


# -- the DNS edge ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Lookup:
    """Result of one address lookup that never raises: addresses, or why there are none."""

    addresses: tuple[str, ...] = ()
    failure: str | None = None  # set when the lookup failed transiently


class Resolver:
    """Resolve recipient domains to ordered :class:`MxHost` lists.

    *nameservers* entries look like ``"127.0.0.1:5353"``, ``"127.0.0.1"`` or
    ``"[::1]:53"``; ``None`` uses the system configuration (``/etc/resolv.conf``).
    *timeout* bounds each DNS query (all retries and servers included). *rng*
    shuffles MX hosts of equal preference (RFC 5321 §5.1); inject a seeded one
    for deterministic tests.
    """

    def __init__(
        self,
        nameservers: Sequence[str] | None = None,
        timeout: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(nameservers, str):
            raise TypeError("nameservers must be a sequence of strings, not a string")
        self._rng = rng if rng is not None else random.Random()
        self._resolver = make_resolver(nameservers, timeout)

    async def resolve(self, domain: str) -> list[MxHost]:
        """Return the hosts to try for *domain*, most preferred first.

        Raises :class:`DnsPermanentError` or :class:`DnsTransientError`.
        """
        literal = parse_domain_literal(domain)
        if literal is not None:
            # RFC 5321 §5.1: an address literal is used as-is, no MX lookup.
            return [MxHost(domain.strip(), 0, (literal,))]

        shown = domain.strip().rstrip(".")
        try:
            qname = dns.name.from_text(shown, origin=dns.name.root)
        except (dns.exception.DNSException, UnicodeError) as exc:
            raise DnsPermanentError(
                Reply(550, "5.1.2", f"invalid domain name {shown!r}: {exc}")
            ) from exc
        if qname == dns.name.root:
            raise DnsPermanentError(Reply(550, "5.1.2", "empty domain name"))

        records = await self._query_mx(qname, shown)

        if records is None:
            # RFC 5321 §5.1: no MX records -> the domain itself is the implicit MX,
            # with preference 0, if it has address records.
            lookup = await self._addresses(qname)
            if lookup.addresses:
                name = qname.to_text(omit_final_dot=True).lower()
                return [MxHost(name, 0, lookup.addresses)]
            if lookup.failure is not None:
                raise _transient(shown, lookup.failure)
            raise DnsPermanentError(
                Reply(550, "5.1.2", f"domain {shown} has no MX and no address records")
            )

        if is_null_mx(records):
            # RFC 7505 §3 (null MX) with the 556 reply code of RFC 7504 and X.1.10:
            # the domain accepts no mail; do not fall back to its A/AAAA records.
            raise DnsPermanentError(
                Reply(556, "5.1.10", f"{shown} does not accept mail (null MX, RFC 7505)")
            )

        ordered = order_mx(records, self._rng)
        lookups = await asyncio.gather(
            *(self._addresses(dns.name.from_text(name)) for _, name in ordered)
        )
        hosts = [
            MxHost(name.rstrip(".").lower(), preference, lookup.addresses)
            for (preference, name), lookup in zip(ordered, lookups, strict=True)
            if lookup.addresses  # a host without addresses is skipped
        ]
        if hosts:
            return hosts
        failures = [lookup.failure for lookup in lookups if lookup.failure is not None]
        if failures:
            raise _transient(shown, failures[0])
        # RFC 3463: X.4.4 unable to route (no usable next hop).
        raise DnsPermanentError(Reply(550, "5.4.4", f"no MX host of {shown} has an address record"))

    async def _query_mx(self, qname: dns.name.Name, shown: str) -> list[tuple[int, str]] | None:
        """MX records of *qname*; ``None`` for NODATA. Raises the Dns*Error types."""
        try:
            answer = await self._resolver.resolve(qname, dns.rdatatype.MX, search=False)
        except dns.resolver.NXDOMAIN as exc:
            raise DnsPermanentError(
                Reply(550, "5.1.2", f"domain {shown} does not exist (NXDOMAIN)")
            ) from exc
        except dns.resolver.NoAnswer:
            return None
        except dns.exception.DNSException as exc:
            raise _transient(shown, describe_dns_error(exc)) from exc
        records: list[tuple[int, str]] = []
        for rdata in answer:
            assert isinstance(rdata, dns.rdtypes.ANY.MX.MX)
            records.append((rdata.preference, rdata.exchange.to_text()))
        return records or None

    async def addresses_of(self, host: str) -> tuple[str, ...]:
        """A and AAAA addresses of one host name (e.g. an MTA-STS policy host); () when it
        has none or the lookup failed; never raises."""
        try:
            name = dns.name.from_text(host)
        except dns.exception.DNSException:
            return ()
        return (await self._addresses(name)).addresses

    async def _addresses(self, host: dns.name.Name) -> _Lookup:
        """A then AAAA addresses of *host*, looked up concurrently; never raises."""
        results = await asyncio.gather(
            self._lookup(host, dns.rdatatype.A), self._lookup(host, dns.rdatatype.AAAA)
        )
        addresses = tuple(address for result in results for address in result.addresses)
        failures = [result.failure for result in results if result.failure is not None]
        return _Lookup(addresses, failures[0] if failures else None)

    async def _lookup(self, host: dns.name.Name, rdtype: dns.rdatatype.RdataType) -> _Lookup:
        try:
            answer = await self._resolver.resolve(host, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return _Lookup()
        except dns.exception.DNSException as exc:
            name = host.to_text(omit_final_dot=True)
            return _Lookup(
                failure=f"{dns.rdatatype.to_text(rdtype)} {name}: {describe_dns_error(exc)}"
            )
        return _Lookup(tuple(rdata.to_text() for rdata in answer))


def _transient(domain: str, detail: str) -> DnsTransientError:
    # RFC 3463: X.4.3 directory server failure (temporary).
    return DnsTransientError(Reply(451, "4.4.3", f"DNS lookup for {domain} failed: {detail}"))


def describe_dns_error(exc: dns.exception.DNSException) -> str:
    """A DNS failure in a few words, for replies and reports."""
    if isinstance(exc, dns.exception.Timeout):
        return "timed out"
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or refused)"
    if isinstance(exc, dns.resolver.NoResolverConfiguration):
        return "no nameservers configured"
    return str(exc) or type(exc).__name__
