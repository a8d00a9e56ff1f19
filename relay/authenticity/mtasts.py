"""MTA-STS (RFC 8461) for MX delivery: which MX hosts a domain allows, and whether they
must present a verified certificate.

The edge is :class:`MtaStsResolver` (DNS TXT lookup with dnspython's async resolver, policy
fetch over HTTPS with httpx, an in-memory cache optionally persisted to a JSON file). The
decisions are pure functions that table tests drive without a network: :func:`parse_policy`,
:func:`parse_txt`, :func:`mx_matches`, :func:`check_mx` and :func:`tls_failure_reason`.

Rules:

- Discovery (§3.1): TXT records of ``_mta-sts.<domain>``; those whose first field is not
  ``v=STSv1`` are ignored. None left: the domain has no policy. More than one, or one that
  is malformed (no ``id`` of 1-32 letters/digits): treated as no policy too, and counted as
  a ``txt_invalid`` failure so that an operator can see it.
- Fetch (§3.3): ``GET https://mta-sts.<domain>/.well-known/mta-sts.txt``; the certificate
  must verify for ``mta-sts.<domain>`` (the system store, or ``ca_file``); redirects are not
  followed; only HTTP 200 with media type ``text/plain`` and no content encoding counts;
  the body is at most 64 KiB; the whole fetch is bounded by ``timeout``. No proxy from the
  environment is used (``trust_env=False``): the daemon talks to MX hosts directly too.
- Policy (§3.2): ``version: STSv1``, ``mode`` (enforce | testing | none), ``max_age``
  (0..31557600 s) and one or more ``mx`` (optional in mode none); LF or CRLF line ends;
  field names and values are case-sensitive as in the RFC's ABNF; unknown fields are
  ignored; a repeated version/mode/max_age is invalid.
- Cache (§5.1): a policy applies until ``fetched_at + max_age``. Each :meth:`policy` call
  looks the TXT record up: same id as the cached policy -> the cached one (no fetch); other
  id, or no unexpired cached policy -> fetch. A TXT record that is absent, invalid or whose
  lookup fails does not remove an unexpired cached policy (that is MTA-STS's downgrade
  protection, §10.2): it keeps applying. A failed fetch keeps the unexpired cached policy
  (logged at WARNING); without one the domain is treated as having no policy (§3.3: deliver
  as if MTA-STS were not implemented), the failure is counted in
  ``MtaStsResolver.failures[(domain, reason)]`` and that id is not fetched again for
  ``failure_backoff`` seconds (a broken policy host must not stall every delivery attempt).
  An expired policy is never used.
- Persistence: with ``cache_path`` the unexpired policies are written to a JSON file
  (temporary file, fsync, rename, fsync of the folder; off the event loop) after each
  successful fetch and read back when a resolver is created. A corrupt file is logged and
  ignored.
- Matching (§4.1): case-insensitive, trailing dot ignored; ``*.example.com`` matches
  exactly one more leftmost label (``a.example.com``), never ``example.com`` nor
  ``a.b.example.com``.
- Verdict (:func:`check_mx`, §4.2, §5): enforce -> a non-matching MX host must not be
  used; a matching one only with STARTTLS and a certificate verified for the MX host name,
  a failure being transient (``4.7.5``, :func:`tls_failure_reason`). testing -> deliver
  as without a policy, and log what enforce would have refused. none / no policy -> no
  requirement.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import ssl
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias, TypeVar, cast

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.rdtypes.ANY.TXT
import dns.resolver
import httpx

from relay.delivery.errors import _find_cause
from relay.delivery.mx import make_resolver
from relay.ops.logs import log_event

__all__ = [
    "BODY_LIMIT",
    "FAILURE_REASONS",
    "MAX_AGE_LIMIT",
    "MtaStsResolver",
    "MtaStsVerdict",
    "Policy",
    "PolicyError",
    "Verdict",
    "check_mx",
    "mx_matches",
    "parse_policy",
    "parse_txt",
    "tls_failure_reason",
]

log = logging.getLogger("relay.authenticity.mtasts")

_E = TypeVar("_E", bound=BaseException)
Mode: TypeAlias = Literal["enforce", "testing", "none"]
MODES: Final = ("enforce", "testing", "none")
MAX_AGE_LIMIT: Final = 31_557_600  # RFC 8461 §3.2: about one year
BODY_LIMIT: Final = 64 * 1024  # RFC 8461 §3.3: senders MAY limit the policy body to 64 KiB
WELL_KNOWN_PATH: Final = "/.well-known/mta-sts.txt"
FAILURE_REASONS: Final = (
    "dns",  # the TXT lookup failed (SERVFAIL, timeout, ...)
    "txt_invalid",  # several v=STSv1 TXT records, or a malformed one
    "connect",  # the policy host could not be reached
    "tls",  # the policy host's certificate did not verify, or the handshake failed
    "timeout",  # the fetch took longer than `timeout`
    "redirect",  # HTTP 3xx (redirects are not followed, §3.3)
    "http_status",  # any other status than 200
    "content_type",  # not text/plain, or a content encoding
    "too_large",  # body over BODY_LIMIT
    "policy_invalid",  # the body is not a valid policy
    "http",  # another HTTP protocol error
    "cache_write",  # the cache file could not be written (the policy is still used)
)
"""Every ``reason`` :attr:`MtaStsResolver.failures` may count, for metrics to pre-declare."""

_CACHE_VERSION: Final = 1
_WSP: Final = " \t"
_ID_RE: Final = re.compile(r"[A-Za-z0-9]{1,32}")
_EXT_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_EXT_VALUE_RE: Final = re.compile(r"[\x21-\x3a\x3c\x3e-\x7e]+")
_MAX_AGE_RE: Final = re.compile(r"[0-9]{1,10}")
_LABEL: Final = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_MX_PATTERN_RE: Final = re.compile(rf"(?:\*\.)?{_LABEL}(?:\.{_LABEL})*")


# -- the policy ---------------------------------------------------------------------------


class PolicyError(ValueError):
    """A policy (or TXT record) that does not follow RFC 8461; the message says why."""


@dataclass(frozen=True, slots=True)
class Policy:
    """One domain's MTA-STS policy.

    ``mx`` holds the patterns lowercased, without trailing dot. ``id`` is the TXT record id
    the policy was fetched under, ``fetched_at`` when (``clock()`` seconds), ``domain`` the
    policy domain (lowercase A-labels); all three are empty/zero out of :func:`parse_policy`
    unless given.
    """

    mode: Mode
    mx: tuple[str, ...]
    max_age: int
    id: str = ""
    fetched_at: float = 0.0
    domain: str = ""

    @property
    def expires_at(self) -> float:
        return self.fetched_at + self.max_age

    def expired(self, now: float) -> bool:
        return now >= self.expires_at


def parse_policy(text: str, *, id: str = "", fetched_at: float = 0.0, domain: str = "") -> Policy:
    """Parse a policy body (RFC 8461 §3.2); raises :class:`PolicyError` if invalid."""
    fields: dict[str, str] = {}
    mx: list[str] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.removesuffix("\r").strip(_WSP)
        if not line:
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(_WSP), value.strip(_WSP)
        if not sep or not name:
            raise PolicyError(f"policy line {number} is not 'name: value': {line[:80]!r}")
        if name == "mx":
            mx.append(_mx_pattern(value))
        elif name in ("version", "mode", "max_age"):
            if name in fields:
                raise PolicyError(f"policy has more than one {name} field")
            fields[name] = value
        # other fields: extensions, ignored (§3.2)
    version = fields.get("version")
    if version is None:
        raise PolicyError("policy has no version field")
    if version != "STSv1":
        raise PolicyError(f"policy version is {version[:40]!r}, not 'STSv1'")
    mode = fields.get("mode")
    if mode is None:
        raise PolicyError("policy has no mode field")
    if mode not in MODES:
        raise PolicyError(f"policy mode is {mode[:40]!r}, not one of enforce, testing, none")
    max_age_text = fields.get("max_age")
    if max_age_text is None:
        raise PolicyError("policy has no max_age field")
    if _MAX_AGE_RE.fullmatch(max_age_text) is None or int(max_age_text) > MAX_AGE_LIMIT:
        raise PolicyError(
            f"policy max_age {max_age_text[:40]!r} is not an integer in 0..{MAX_AGE_LIMIT}"
        )
    if not mx and mode != "none":
        raise PolicyError(f"policy in mode {mode} has no mx field")
    return Policy(cast(Mode, mode), tuple(mx), int(max_age_text), id, fetched_at, domain)


def _mx_pattern(value: str) -> str:
    pattern = value.rstrip(".").lower()
    if not pattern.isascii():
        try:  # a U-label pattern: compare in A-labels, as MX host names are
            pattern = pattern.encode("idna").decode("ascii")
        except UnicodeError:
            raise PolicyError(f"policy mx {value[:80]!r} is not a domain name") from None
    if _MX_PATTERN_RE.fullmatch(pattern) is None:
        raise PolicyError(f"policy mx {value[:80]!r} is not a domain name or *.domain")
    return pattern


def parse_txt(record: str) -> str:
    """The ``id`` of one ``_mta-sts`` TXT record (RFC 8461 §3.1); :class:`PolicyError` if
    it is not a valid ``v=STSv1`` record."""
    parts = [part.strip(_WSP) for part in record.split(";")]
    if parts[0] != "v=STSv1":
        raise PolicyError("TXT record does not start with v=STSv1")
    if parts[-1] == "":
        parts.pop()  # an optional trailing ";"
    found: str | None = None
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if not sep or _EXT_NAME_RE.fullmatch(name) is None:
            raise PolicyError(f"TXT record field {part[:40]!r} is not name=value")
        if name == "id":
            if found is not None:
                raise PolicyError("TXT record has more than one id")
            if _ID_RE.fullmatch(value) is None:
                raise PolicyError(f"TXT record id {value[:40]!r} is not 1-32 letters or digits")
            found = value
        elif _EXT_VALUE_RE.fullmatch(value) is None:
            raise PolicyError(f"TXT record field {part[:40]!r} has an invalid value")
    if found is None:
        raise PolicyError("TXT record has no id")
    return found


def _is_sts_record(record: str) -> bool:
    return record.split(";", 1)[0].strip(_WSP) == "v=STSv1"


# -- matching and verdicts ----------------------------------------------------------------


def mx_matches(pattern: str, host: str) -> bool:
    """True if MX host name *host* matches policy mx *pattern* (RFC 8461 §4.1)."""
    pattern = pattern.strip().rstrip(".").lower()
    host = host.strip().rstrip(".").lower()
    if not pattern or not host:
        return False
    if pattern.startswith("*."):
        suffix = pattern[1:]  # ".example.com"
        if len(suffix) < 2 or not host.endswith(suffix):
            return False
        label = host[: -len(suffix)]
        return bool(label) and "." not in label
    return host == pattern


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a policy says about delivering to one MX host.

    ``allowed``: the host may be used. ``require_verified_tls``: only over STARTTLS with a
    certificate verified for the host name; a failure is transient. ``log_only``: testing
    mode, ``reason`` says what enforce would have refused (log it, deliver anyway).
    ``mode``: the policy's mode, ``"none"`` without a policy (a metrics label).
    """

    allowed: bool
    require_verified_tls: bool
    log_only: bool
    reason: str
    mode: str = "none"


MtaStsVerdict = Verdict
"""Alias for modules that already import :class:`relay.delivery.replies.Verdict`."""


def check_mx(policy: Policy | None, host: str) -> Verdict:
    """The verdict of *policy* (``None``: the domain has none) for MX host name *host*."""
    shown = host.strip().rstrip(".").lower()
    if policy is None:
        return Verdict(True, False, False, "no MTA-STS policy")
    domain = policy.domain or "the domain"
    if policy.mode == "none":
        return Verdict(True, False, False, f"MTA-STS policy of {domain} is mode none")
    matched = any(mx_matches(pattern, shown) for pattern in policy.mx)
    if policy.mode == "enforce":
        if matched:
            return Verdict(
                True,
                True,
                False,
                f"MX host {shown} matches the MTA-STS policy of {domain}: verified TLS required",
                "enforce",
            )
        return Verdict(False, False, False, _mismatch(shown, policy, domain), "enforce")
    # testing (§5: deliver as without a policy, report what enforce would have done)
    if matched:
        reason = (
            f"MTA-STS testing: MX host {shown} matches the policy of {domain};"
            " enforce would require verified TLS"
        )
    else:
        reason = f"MTA-STS testing: {_mismatch(shown, policy, domain)}; delivering anyway"
    return Verdict(True, False, True, reason, "testing")


def _mismatch(host: str, policy: Policy, domain: str) -> str:
    return (
        f"MX host {host} does not match the MTA-STS policy of {domain} (mx: {', '.join(policy.mx)})"
    )


def tls_failure_reason(domain: str, host: str, error: BaseException) -> str:
    """Transient reply text, enhanced code first, for a TLS failure under an enforce policy.

    ``Reply.parse(454, tls_failure_reason(...))`` makes it a ``454 4.7.5`` reply (RFC 3463
    X.7.5 cryptographic failure, 454 as in RFC 3207 §4).
    """
    shown_domain = domain.strip().rstrip(".").lower()
    shown_host = host.strip().rstrip(".").lower()
    verify = _find_cause(error, ssl.SSLCertVerificationError)
    if verify is not None:
        detail = verify.verify_message or _describe(verify)
        return (
            f"4.7.5 MTA-STS: certificate of {shown_host} not verified ({_one_line(detail)});"
            f" the policy of {shown_domain} requires it"
        )
    return (
        f"4.7.5 MTA-STS: no verified TLS with {shown_host} ({_one_line(_describe(error))});"
        f" the policy of {shown_domain} requires it"
    )


# -- the network edge ---------------------------------------------------------------------


class _Failure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = _one_line(detail)


@dataclass(frozen=True, slots=True)
class _Txt:
    id: str | None = None  # the id of the one valid record, if any
    failure: _Failure | None = None


class MtaStsResolver:
    """Look up, fetch, cache and persist MTA-STS policies (see the module rules).

    *nameservers*: as for :class:`relay.delivery.mx.Resolver` (``None``: the system's).
    *timeout* bounds the TXT lookup and, separately, the whole HTTPS fetch. *https_port*,
    *ca_file* and *connect_host* (maps ``mta-sts.<domain>`` to the address to connect to;
    SNI, ``Host`` and certificate verification still use the real name) exist for tests.
    *cache_path*: a JSON file that keeps policies over restarts. *failure_backoff*: how long
    a failed fetch for a TXT id is not retried.

    ``failures`` counts failures by ``(domain, reason)`` (reasons: :data:`FAILURE_REASONS`),
    ``fetches`` HTTPS fetch attempts by domain, ``last_failure`` holds the latest failure's
    text by domain.
    """

    def __init__(
        self,
        *,
        nameservers: Sequence[str] | None,
        timeout: float = 10.0,
        https_port: int = 443,
        ca_file: str | None = None,
        connect_host: Callable[[str], str] | None = None,
        cache_path: Path | None = None,
        clock: Callable[[], float] = time.time,
        failure_backoff: float = 300.0,
    ) -> None:
        if isinstance(nameservers, str):
            raise TypeError("nameservers must be a sequence of strings, not a string")
        self._timeout = timeout
        self._port_suffix = "" if https_port == 443 else f":{https_port}"
        self._connect_host = connect_host
        self._cache_path = cache_path
        self._clock = clock
        self._backoff = failure_backoff
        self._ssl = ssl.create_default_context(cafile=ca_file)
        self._resolver = make_resolver(nameservers, timeout)
        self._cache: dict[str, Policy] = {}
        self._failed: dict[str, tuple[str, float]] = {}  # domain -> (TXT id, retry after)
        self._inflight: dict[str, asyncio.Task[Policy | None]] = {}
        self._save_lock = asyncio.Lock()
        self.failures: Counter[tuple[str, str]] = Counter()
        self.fetches: Counter[str] = Counter()
        self.last_failure: dict[str, str] = {}
        if cache_path is not None:
            self._cache = _load(cache_path, clock())

    def cached(self, domain: str) -> Policy | None:
        """The unexpired cached policy of *domain*, without any lookup."""
        key = _domain_key(domain)
        policy = self._cache.get(key) if key is not None else None
        if policy is None or policy.expired(self._clock()):
            return None
        return policy

    async def policy(self, domain: str) -> Policy | None:
        """The policy that applies to mail for *domain* now, or ``None``; never raises for
        DNS or HTTPS trouble (see ``failures``). Concurrent calls for one domain share one
        lookup/fetch."""
        key = _domain_key(domain)
        if key is None:
            return None  # an address literal or an invalid name: nothing to look up
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._policy(key))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._done, key))
        return await asyncio.shield(task)

    async def aclose(self) -> None:
        """Cancel lookups in flight (the engine's shutdown)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def _done(self, key: str, task: asyncio.Task[Policy | None]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: nobody else may be waiting

    async def _policy(self, domain: str) -> Policy | None:
        now = self._clock()
        cached = self._cache.get(domain)
        if cached is not None and cached.expired(now):
            del self._cache[domain]  # §5.1: an expired policy is not used
            cached = None
        txt = await self._txt(domain)
        if txt.failure is not None:
            self._fail(domain, txt.failure, cached)
            return cached
        if txt.id is None:
            return cached  # no TXT record: an unexpired cached policy keeps applying
        if cached is not None and cached.id == txt.id:
            return cached
        failed = self._failed.get(domain)
        if failed is not None and failed[0] == txt.id and now < failed[1]:
            return cached  # this id failed recently: not again yet
        self.fetches[domain] += 1
        try:
            policy = await self._fetch(domain, txt.id)
        except _Failure as failure:
            self._prune(self._clock())
            self._failed[domain] = (txt.id, self._clock() + self._backoff)
            self._fail(domain, failure, cached)
            return cached
        self._prune(self._clock())
        self._failed.pop(domain, None)
        self._cache[domain] = policy
        log_event(
            log,
            logging.INFO,
            "mta_sts_policy",
            "MTA-STS policy fetched",
            domain=domain,
            id=policy.id,
            mode=policy.mode,
            mx=",".join(policy.mx),
            max_age=policy.max_age,
        )
        if self._cache_path is not None:
            await self._save(domain, self._cache_path)
        return policy

    def _prune(self, now: float) -> None:
        """Forget expired policies and elapsed backoffs (run at each fetch, which is rare)."""
        for name in [name for name, policy in self._cache.items() if policy.expired(now)]:
            del self._cache[name]
        for name in [name for name, (_, until) in self._failed.items() if now >= until]:
            del self._failed[name]

    def _fail(self, domain: str, failure: _Failure, cached: Policy | None) -> None:
        self.failures[(domain, failure.reason)] += 1
        self.last_failure[domain] = failure.detail
        if cached is not None:
            message = "MTA-STS policy not refreshed: the cached policy keeps applying"
        elif failure.reason == "txt_invalid":
            message = "MTA-STS TXT record invalid: the domain is treated as having no policy"
        else:
            message = "MTA-STS policy unavailable: delivering as if the domain had none"
        log_event(
            log,
            logging.WARNING,
            "mta_sts_failure",
            message,
            domain=domain,
            reason=failure.reason,
            detail=failure.detail,
            cached_id=cached.id if cached is not None else None,
        )

    async def _txt(self, domain: str) -> _Txt:
        qname = dns.name.from_text(f"_mta-sts.{domain}", origin=dns.name.root)
        try:
            answer = await self._resolver.resolve(qname, dns.rdatatype.TXT, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return _Txt()
        except dns.exception.DNSException as exc:
            return _Txt(failure=_Failure("dns", f"TXT _mta-sts.{domain}: {_dns_detail(exc)}"))
        records: list[str] = []
        for rdata in answer:
            assert isinstance(rdata, dns.rdtypes.ANY.TXT.TXT)
            # RFC 8461 §3.1 / RFC 7208 §3.3: the strings of one record are concatenated
            records.append(b"".join(rdata.strings).decode("ascii", "replace"))
        sts = [record for record in records if _is_sts_record(record)]
        if not sts:
            return _Txt()
        if len(sts) > 1:
            detail = f"{len(sts)} v=STSv1 TXT records at _mta-sts.{domain}"
            return _Txt(failure=_Failure("txt_invalid", detail))
        try:
            return _Txt(id=parse_txt(sts[0]))
        except PolicyError as exc:
            return _Txt(failure=_Failure("txt_invalid", f"_mta-sts.{domain}: {exc}"))

    async def _fetch(self, domain: str, txt_id: str) -> Policy:
        host = f"mta-sts.{domain}"
        target = self._connect_host(host) if self._connect_host is not None else host
        headers = {"Accept": "text/plain", "Accept-Encoding": "identity"}
        extensions: dict[str, Any] = {}
        if target != host:
            # connect to *target*, but speak to *host*: SNI and certificate verification
            # (httpcore's sni_hostname request extension) and the Host header
            headers["Host"] = f"{host}{self._port_suffix}"
            extensions["sni_hostname"] = host
            target = f"[{target}]" if ":" in target else target
        url = f"https://{target}{self._port_suffix}{WELL_KNOWN_PATH}"
        shown = f"https://{host}{self._port_suffix}{WELL_KNOWN_PATH}"
        try:
            async with (
                asyncio.timeout(self._timeout),
                httpx.AsyncClient(
                    verify=self._ssl,
                    follow_redirects=False,
                    trust_env=False,
                    # connect and TLS handshake each get under half of the budget, so
                    # that httpx's own timeout (which closes the socket) fires before
                    # the overall one (a cancelled handshake would leak the socket)
                    timeout=httpx.Timeout(self._timeout, connect=self._timeout * 0.45),
                ) as client,
                client.stream("GET", url, headers=headers, extensions=extensions) as response,
            ):
                body = await _read_body(response, shown)
        except TimeoutError:
            raise _Failure("timeout", f"{shown}: not complete within {self._timeout:g}s") from None
        except httpx.TimeoutException:
            raise _Failure("timeout", f"{shown}: timed out") from None
        except (httpx.HTTPError, OSError) as exc:  # OSError: what httpx did not wrap
            raise _http_failure(shown, exc) from None
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise _Failure("policy_invalid", f"{shown}: body is not UTF-8") from None
        try:
            return parse_policy(text, id=txt_id, fetched_at=self._clock(), domain=domain)
        except PolicyError as exc:
            raise _Failure("policy_invalid", f"{shown}: {exc}") from None

    async def _save(self, domain: str, path: Path) -> None:
        now = self._clock()
        doc = {
            "version": _CACHE_VERSION,
            "policies": {
                name: _policy_json(policy)
                for name, policy in sorted(self._cache.items())
                if not policy.expired(now)
            },
        }
        data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        async with self._save_lock:
            try:
                await asyncio.to_thread(_write_atomic, path, data)
            except OSError as exc:
                self._fail(domain, _Failure("cache_write", f"{path}: {exc}"), None)


async def _read_body(response: httpx.Response, shown: str) -> bytes:
    status = response.status_code
    if 300 <= status < 400:
        location = response.headers.get("location", "")
        raise _Failure(
            "redirect",
            f"{shown}: HTTP {status} redirect to {location[:200]!r} (not followed, RFC 8461 §3.3)",
        )
    if status != 200:
        raise _Failure("http_status", f"{shown}: HTTP {status}")
    content_type = response.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "text/plain":
        raise _Failure(
            "content_type", f"{shown}: content type {content_type[:80]!r}, not text/plain"
        )
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _Failure("content_type", f"{shown}: content encoding {encoding[:40]!r}")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > BODY_LIMIT:
        raise _Failure("too_large", f"{shown}: body of {length} bytes, over {BODY_LIMIT}")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > BODY_LIMIT:
            raise _Failure("too_large", f"{shown}: body over {BODY_LIMIT} bytes")
    return bytes(body)


def _http_failure(shown: str, exc: Exception) -> _Failure:
    tls = _find_cause(exc, ssl.SSLError)
    if tls is not None:
        verify = _find_cause(exc, ssl.SSLCertVerificationError)
        if verify is not None:
            detail = verify.verify_message or _describe(verify)
            return _Failure("tls", f"{shown}: certificate not verified ({detail})")
        return _Failure("tls", f"{shown}: TLS handshake failed ({_describe(tls)})")
    if isinstance(exc, httpx.ConnectError | OSError):
        return _Failure("connect", f"{shown}: cannot connect ({_describe(exc)})")
    return _Failure("http", f"{shown}: {type(exc).__name__} ({_describe(exc)})")


# -- the cache file -----------------------------------------------------------------------


def _policy_json(policy: Policy) -> dict[str, Any]:
    return {
        "mode": policy.mode,
        "mx": list(policy.mx),
        "max_age": policy.max_age,
        "id": policy.id,
        "fetched_at": policy.fetched_at,
    }


def _load(path: Path, now: float) -> dict[str, Policy]:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log_event(
            log,
            logging.WARNING,
            "mta_sts_cache",
            "MTA-STS cache file unreadable: starting with an empty cache",
            path=str(path),
            detail=_one_line(str(exc)),
        )
        return {}
    entries = doc.get("policies") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("version") != _CACHE_VERSION:
        entries = None
    if not isinstance(entries, dict):
        log_event(
            log,
            logging.WARNING,
            "mta_sts_cache",
            "MTA-STS cache file has an unknown format: starting with an empty cache",
            path=str(path),
        )
        return {}
    policies: dict[str, Policy] = {}
    for name, entry in entries.items():
        policy = _policy_from_json(name, entry)
        if policy is not None and not policy.expired(now):
            policies[name] = policy
    return policies


def _policy_from_json(name: object, entry: object) -> Policy | None:
    if not isinstance(name, str) or not isinstance(entry, dict):
        return None
    mode, mx, max_age = entry.get("mode"), entry.get("mx"), entry.get("max_age")
    txt_id, fetched_at = entry.get("id"), entry.get("fetched_at")
    if (
        mode not in MODES
        or not isinstance(mx, list)
        or not all(isinstance(p, str) for p in mx)
        or not isinstance(max_age, int)
        or not 0 <= max_age <= MAX_AGE_LIMIT
        or not isinstance(txt_id, str)
        or not isinstance(fetched_at, int | float)
    ):
        return None
    return Policy(cast(Mode, mode), tuple(mx), max_age, txt_id, float(fetched_at), name)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# -- helpers ------------------------------------------------------------------------------


def _domain_key(domain: str) -> str | None:
    """Lowercase A-label form without trailing dot, or ``None`` for a literal/invalid name."""
    text = domain.strip().rstrip(".")
    if not text or text.startswith("["):
        return None
    try:
        name = dns.name.from_text(text, origin=dns.name.root)
    except (dns.exception.DNSException, UnicodeError):
        return None
    if name == dns.name.root:
        return None
    return name.to_text(omit_final_dot=True).lower()


def _describe(error: BaseException) -> str:
    return _one_line(str(error)) or type(error).__name__


def _dns_detail(exc: dns.exception.DNSException) -> str:
    if isinstance(exc, dns.exception.Timeout):
        return "timed out"
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or refused)"
    return _describe(exc)


def _one_line(text: str) -> str:
    return " ".join(text.split())
