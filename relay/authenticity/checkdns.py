"""`relay check-dns DOMAIN`: read the DNS records that decide whether mail sent as DOMAIN is
delivered and trusted, and say, per item, what was seen and what to change.

Rules:
- One :class:`Check` per item: `ok` | `warning` | `error`, the record seen (or None) and a
  detail a person can act on. :func:`exit_code` follows `relay status`: 0 all ok, 1 a
  warning and no error, 2 an error.
- DNS is read with `dns.asyncresolver` at the given nameservers (`"127.0.0.1:5353"`,
  `"[::1]"`; None: the system's), each query bounded by `timeout` as in
  relay/delivery/mx.py. NXDOMAIN and NODATA are answers ("not published"); SERVFAIL,
  refusal and timeouts make the item that needed the answer an error "DNS lookup failed:
  ...", never a crash. Each (name, type) is asked once per run: a shared cache, so the SPF
  walk, the SPF evaluation and the other checks can run concurrently.
- A TXT record split into several strings is one record: the strings are joined without
  separators (RFC 7208 §3.3, RFC 6376 §3.6.2.2).
- No regular expressions: records are parsed by splitting and single left-to-right scans,
  so hostile DNS text costs linear time; digit runs are length-capped before `int()`.
- The organisational domain (RFC 7489 §3.2) is the public suffix plus one label, by the
  Public Suffix List that the `publicsuffixlist` package carries (offline, both its ICANN
  and private sections, as OpenDMARC reads it): `mail.example.com` -> `example.com`,
  `a.example.co.uk` -> `example.co.uk`. A name that is itself a public suffix is its own
  organisational domain. A name under a suffix the list does not know (`.test`) takes the
  list's default rule `*`: its last two labels.
- DKIM keys are those the relay signs with for DOMAIN (d=DOMAIN), so a configured key whose
  DNS record matches always aligns with a From at DOMAIN.

Checks, in this order:
- `spf`: the TXT records of DOMAIN starting `v=spf1`: none -> error (publish one); two or
  more -> error (permerror, RFC 7208 §3.2); a syntax error (unknown mechanism, bad
  address, bad macro, `redirect`/`exp` twice) -> error; `+all`/`?all`, no `all` and no
  `redirect=`, terms after `all`, `redirect=` beside `all`, `ptr`, unknown modifiers ->
  warning.
- `spf.lookups` (only when `spf` found one valid record): the DNS-querying terms (include,
  a, mx, ptr, exists, redirect), counted through includes and redirects (each included
  record counted each time it is included): over 10 -> error (RFC 7208 §4.6.4); an include
  or redirect to a domain without a (valid, single) SPF record, a loop, an MX with more
  than 10 hosts, a DNS failure -> error; more than 2 void lookups (an include, redirect, a
  or mx target that does not exist or has no records) -> warning. Targets with macros
  are not followed (noted).
- `spf.authorises`: with `ip`, check_host() of RFC 7208 §4 for ip at DOMAIN (sender
  postmaster@DOMAIN, HELO DOMAIN): ip4/ip6 with CIDR, a, mx, include, redirect, macros;
  `ptr` and `exists` count as lookups but never match (noted). pass -> ok; anything else
  -> error, with the ip4:/ip6: term to add. Without `ip` -> ok "not checked".
- `dkim:<selector>` per configured key: TXT at `<selector>._domainkey.DOMAIN`: missing,
  several key records, a different `p=`, an empty `p=` (revoked), another `k=`, `v=` not
  `DKIM1`, `s=` without `email` -> error, with the record to publish; `t=y` -> warning.
- `dmarc`: TXT at `_dmarc.DOMAIN`, else at `_dmarc.<organisational domain>` (its `sp=`
  then applies): missing -> warning (publish `p=none` with `rua=`); two or more,
  malformed tags, an invalid `p=`/`sp=`/`adkim=`/`aspf=`/`pct=` -> error; `p=none` ->
  warning (monitoring only); no `rua=`, a non-mailto report address, an external report
  address whose domain does not authorise the reports (RFC 7489 §7.1) -> warning;
  quarantine/reject -> ok.
- `dmarc.alignment`: the envelope domain against DOMAIN (relaxed: same organisational
  domain; strict `aspf=s`: equal) and DKIM (d=DOMAIN, aligned when a configured key's
  record is right): both -> ok; one -> warning; neither -> error.
- `mx`: MX hosts -> ok; no MX (implicit MX) -> warning; null MX (RFC 7505) -> warning
  (bounces to the domain are lost); a host without an address -> warning; NXDOMAIN or a
  DNS failure -> error.
- `mta-sts`: TXT `v=STSv1; id=...` at `_mta-sts.DOMAIN`: absent -> ok (optional); several
  or malformed -> error (RFC 8461 §3.1). The policy file is not fetched here.
- `tls-rpt`: TXT `v=TLSRPTv1; rua=...` at `_smtp._tls.DOMAIN`: absent -> ok (optional);
  several or malformed -> error (RFC 8460 §3).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import urllib.parse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdtypes.ANY.MX
import dns.rdtypes.ANY.TXT
import dns.resolver
from publicsuffixlist import PublicSuffixList

from relay.delivery.mx import describe_dns_error, is_null_mx, make_resolver

__all__ = [
    "Check",
    "Status",
    "check_domain",
    "exit_code",
    "org_domain",
    "render_text",
    "to_json",
]

Status = Literal["ok", "warning", "error"]
_RANK: dict[str, int] = {"ok": 0, "warning": 1, "error": 2}
_LABEL: dict[str, str] = {"ok": "OK", "warning": "WARN", "error": "ERROR"}

SPF_LOOKUP_LIMIT = 10  # RFC 7208 §4.6.4
SPF_VOID_LIMIT = 2  # RFC 7208 §4.6.4
SPF_MX_LIMIT = 10  # RFC 7208 §4.6.4: address lookups per mx mechanism
_WALK_CAP = 40  # distinct SPF records the lookup count follows at most
_NOT_CHECKED = "not checked: give --ip or run in MX mode"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class Check:
    """One item of the report: `record` is what DNS held (None: nothing), `detail` what it
    means and what to change."""

    name: str
    status: Status
    record: str | None
    detail: str


# -- results ----------------------------------------------------------------------------------


def exit_code(checks: Sequence[Check]) -> int:
    """0 when every check is ok, 1 with a warning and no error, 2 with an error."""
    return max((_RANK[c.status] for c in checks), default=0)


_BY_RANK: tuple[Status, ...] = ("ok", "warning", "error")


def _worst(checks: Sequence[Check]) -> Status:
    return _BY_RANK[exit_code(checks)]


def _printable(text: str) -> str:
    """DNS text is shown to a terminal: escape control and other non-printable characters."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def render_text(domain: str, checks: Sequence[Check]) -> str:
    """One line per check (`OK|WARN|ERROR  name  detail`), its record on the next line,
    and a summary line."""
    width = max((len(c.name) for c in checks), default=0)
    lines: list[str] = []
    for c in checks:
        lines.append(f"{_LABEL[c.status]:<5}  {c.name:<{width}}  {_printable(c.detail)}")
        if c.record is not None:
            lines.append(f"      record: {_printable(c.record)}")
    tally = {s: sum(1 for c in checks if c.status == s) for s in _RANK}
    lines.append(
        f"{domain}: {tally['ok']} ok, {tally['warning']} warning(s), {tally['error']} error(s)"
    )
    return "\n".join(lines) + "\n"


def to_json(domain: str, checks: Sequence[Check]) -> dict[str, Any]:
    """`{"domain", "status", "exit_code", "checks": [{"name", "status", "record", "detail"}]}`."""
    return {
        "domain": domain,
        "status": _worst(checks),
        "exit_code": exit_code(checks),
        "checks": [asdict(c) for c in checks],
    }


class _Findings:
    """Issues found for one check; the check takes the worst status among them."""

    def __init__(self) -> None:
        self.issues: list[tuple[Status, str]] = []
        self.notes: list[str] = []

    def add(self, status: Status, text: str) -> None:
        self.issues.append((status, text))

    def check(self, name: str, record: str | None, ok_detail: str) -> Check:
        status: Status = "ok"
        for s, _ in self.issues:
            if _RANK[s] > _RANK[status]:
                status = s
        if status == "ok":
            parts = [ok_detail]
        else:
            ordered = sorted(self.issues, key=lambda issue: -_RANK[issue[0]])
            parts = [text for s, text in ordered if s != "ok"]
        parts += self.notes
        return Check(name, status, record, "; ".join(parts))


# -- names ------------------------------------------------------------------------------------


def org_domain(domain: str) -> str:
    """The organisational domain: the public suffix plus one label (see the module rules)."""
    name = domain.strip().rstrip(".").lower()
    return _suffixes().privatesuffix(name) or name


@functools.cache
def _suffixes() -> PublicSuffixList:
    # built once per process, when `relay check-dns` first needs it (parses the bundled list)
    return PublicSuffixList()


def _normalise(domain: str) -> str:
    try:
        name = dns.name.from_text(domain.strip(), origin=dns.name.root)
    except (dns.exception.DNSException, UnicodeError, ValueError) as exc:
        raise ValueError(f"invalid domain name {domain!r}: {exc}") from None
    if name == dns.name.root:
        raise ValueError("empty domain name")
    return name.to_text(omit_final_dot=True).lower()


def _parse_ip(text: str) -> Address:
    address = ipaddress.ip_address(text.strip())
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # RFC 7208 §5: an IPv4-mapped address is IPv4
    return address


def _digits(text: str, maximum: int) -> int | None:
    """A decimal without sign or leading zero, at most `maximum`; None if it is not one."""
    if not text or len(text) > 3 or not (text.isascii() and text.isdigit()):
        return None
    if len(text) > 1 and text[0] == "0":
        return None
    value = int(text)
    return value if value <= maximum else None


# -- DNS --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Answer:
    """One lookup that never raises. `items`: TXT texts (strings joined), addresses, or
    MX as "preference exchange"."""

    kind: Literal["ok", "nxdomain", "nodata", "failed"]
    items: tuple[str, ...] = ()
    failure: str = ""

    @property
    def void(self) -> bool:
        return self.kind in ("nxdomain", "nodata")


class _Dns:
    """Cached asynchronous lookups for one run (see the module rules)."""

    def __init__(self, nameservers: Sequence[str] | None, timeout: float) -> None:
        if isinstance(nameservers, str):
            raise TypeError("nameservers must be a sequence of strings, not a string")
        self._cache: dict[tuple[str, str], asyncio.Task[_Answer]] = {}
        self._broken: str | None = None
        try:
            self._resolver = make_resolver(nameservers, timeout)
        except dns.exception.DNSException as exc:  # no /etc/resolv.conf
            base = dns.asyncresolver.Resolver(configure=False)
            self._resolver = make_resolver(nameservers, timeout, base)
            self._broken = describe_dns_error(exc)

    async def query(self, name: str, rdtype: str) -> _Answer:
        key = (name.rstrip(".").lower(), rdtype)
        task = self._cache.get(key)
        if task is None:
            task = asyncio.ensure_future(self._resolve(*key))
            self._cache[key] = task
        return await task

    def close(self) -> None:
        for task in self._cache.values():
            task.cancel()

    async def _resolve(self, name: str, rdtype: str) -> _Answer:
        if self._broken is not None:
            return _Answer("failed", failure=f"{rdtype} {name}: {self._broken}")
        try:
            qname = dns.name.from_text(name, origin=dns.name.root)
        except (dns.exception.DNSException, UnicodeError, ValueError) as exc:
            return _Answer("failed", failure=f"{rdtype} {name}: invalid name ({exc})")
        try:
            answer = await self._resolver.resolve(qname, rdtype, search=False)
        except dns.resolver.NXDOMAIN:
            return _Answer("nxdomain")
        except dns.resolver.NoAnswer:
            return _Answer("nodata")
        except dns.exception.DNSException as exc:
            return _Answer("failed", failure=f"{rdtype} {name}: {describe_dns_error(exc)}")
        items: list[str] = []
        for rdata in answer:
            if isinstance(rdata, dns.rdtypes.ANY.TXT.TXT):
                # RFC 7208 §3.3: the strings of one record are concatenated as they are
                items.append(b"".join(rdata.strings).decode("utf-8", "replace"))
            elif isinstance(rdata, dns.rdtypes.ANY.MX.MX):
                items.append(f"{rdata.preference} {rdata.exchange.to_text().lower()}")
            else:
                items.append(rdata.to_text())
        return _Answer("ok", tuple(items)) if items else _Answer("nodata")


def _failed(name: str, answer: _Answer) -> Check:
    return Check(name, "error", None, f"DNS lookup failed: {answer.failure}")


def _joined(texts: Sequence[str]) -> str:
    """Several records in one line, sorted (DNS gives an RRset in any order)."""
    return " | ".join(sorted(texts))


def _mx_pairs(answer: _Answer) -> list[tuple[int, str]]:
    pairs = []
    for item in answer.items:
        preference, _, exchange = item.partition(" ")
        pairs.append((int(preference), exchange))
    return pairs


# -- tag lists (DKIM, DMARC, MTA-STS, TLS-RPT) ------------------------------------------------


def _tags(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """`name=value` pairs separated by `;` (surrounding whitespace ignored), and the
    problems found (a part without `=`, an empty name, a repeated name)."""
    pairs: list[tuple[str, str]] = []
    errors: list[str] = []
    seen: set[str] = set()
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or not name:
            errors.append(f"{part!r} is not tag=value")
            continue
        if name.lower() in seen:
            errors.append(f"tag {name} appears twice")
        seen.add(name.lower())
        pairs.append((name, value.strip()))
    return pairs, errors


def _b64(value: str) -> str:
    return "".join(value.split())


# -- SPF: syntax (RFC 7208 §4.6, §5, §6, §7) --------------------------------------------------

_MECHANISMS = ("all", "include", "a", "mx", "ptr", "ip4", "ip6", "exists")
_LOOKUP_TERMS = frozenset({"include", "a", "mx", "ptr", "exists", "redirect"})
_RESULTS = {"+": "pass", "-": "fail", "~": "softfail", "?": "neutral"}
_MACRO_LETTERS = frozenset("slodiphv")  # c, r and t only appear in explanation text
_MACRO_DELIMITERS = frozenset(".-+,/_=")


@dataclass(frozen=True, slots=True)
class _Term:
    raw: str
    name: str  # mechanism or modifier name, lowercased
    qualifier: str  # "+", "-", "~" or "?"; "" for a modifier
    value: str = ""  # domain-spec, network or modifier value; "" when absent
    cidr4: int | None = None
    cidr6: int | None = None

    @property
    def modifier(self) -> bool:
        return not self.qualifier


@dataclass(frozen=True, slots=True)
class _Spf:
    text: str
    terms: tuple[_Term, ...]
    errors: tuple[str, ...]

    @property
    def mechanisms(self) -> list[_Term]:
        return [t for t in self.terms if not t.modifier]

    def modifier(self, name: str) -> _Term | None:
        return next((t for t in self.terms if t.modifier and t.name == name), None)

    def has_all(self) -> bool:
        return any(t.name == "all" for t in self.mechanisms)


def _is_spf(text: str) -> bool:
    """RFC 7208 §4.5: a record is SPF when it is `v=spf1` alone or followed by a space."""
    return text[:6].lower() == "v=spf1" and (len(text) == 6 or text[6] == " ")


def _parse_spf(text: str) -> _Spf:
    terms: list[_Term] = []
    errors: list[str] = []
    for raw in text[6:].split(" "):
        if not raw:
            continue
        term, error = _parse_term(raw)
        if term is None:
            errors.append(f"{raw!r}: {error}")
        else:
            terms.append(term)
    for name in ("redirect", "exp"):
        count = sum(1 for t in terms if t.modifier and t.name == name)
        if count > 1:
            errors.append(f"{name}= appears {count} times (RFC 7208 §6)")
    return _Spf(text, tuple(terms), tuple(errors))


def _is_name_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "-_.")


def _parse_term(raw: str) -> tuple[_Term | None, str]:
    for c in raw:
        if not "\x21" <= c <= "\x7e":
            return None, f"invalid character {c!r}"
    i = 0
    while i < len(raw) and _is_name_char(raw[i]):
        i += 1
    if 0 < i < len(raw) and raw[i] == "=" and raw[0].isalpha():
        name, value = raw[:i].lower(), raw[i + 1 :]
        error = _check_macro_string(value, domain_end=name in ("redirect", "exp"))
        if error:
            return None, f"{name}=: {error}"
        return _Term(raw, name, "", value), ""

    qualifier, body = "+", raw
    if raw[0] in _RESULTS:
        qualifier, body = raw[0], raw[1:]
    j = 0
    while j < len(body) and body[j].isascii() and body[j].isalnum():
        j += 1
    name, rest = body[:j].lower(), body[j:]
    if name in ("redirect", "exp"):
        return None, f"{name} is a modifier: write {name}=..."
    if name not in _MECHANISMS or (rest and rest[0] not in ":/"):
        return None, "unknown mechanism (RFC 7208 §5: all, include, a, mx, ptr, ip4, ip6, exists)"

    cidr4 = cidr6 = None
    if name == "all":
        if rest:
            return None, "all takes no argument"
    elif name in ("include", "exists"):
        if not rest.startswith(":"):
            return None, f"{name} needs a domain: {name}:example.com"
    elif name == "ptr":
        if rest.startswith("/"):
            return None, "ptr takes no CIDR length"
    elif name in ("a", "mx"):
        rest, cidr4, cidr6, error = _split_dual_cidr(rest)
        if error:
            return None, error
    else:  # ip4, ip6
        return _parse_ip_term(raw, qualifier, name, rest)
    if rest and not rest.startswith(":"):
        return None, f"{name}: expected ':' before the domain"
    value = rest[1:]
    if rest:
        error = _check_macro_string(value, domain_end=True)
        if error:
            return None, error
    return _Term(raw, name, qualifier, value, cidr4, cidr6), ""


def _split_dual_cidr(rest: str) -> tuple[str, int | None, int | None, str]:
    """`[:domain][/n][//m]` -> (":domain" or "", n, m, error). A `/` inside a macro
    (`%{d/}`) is part of the domain."""
    cidr4 = cidr6 = None
    brace = rest.rfind("}")
    k = rest.rfind("//")
    if k > brace:
        cidr6 = _digits(rest[k + 2 :], 128)
        if cidr6 is None:
            return rest, None, None, f"bad IPv6 CIDR length {rest[k + 2 :]!r} (0-128)"
        rest = rest[:k]
    k = rest.rfind("/")
    if k > brace:
        cidr4 = _digits(rest[k + 1 :], 32)
        if cidr4 is None:
            return rest, None, None, f"bad IPv4 CIDR length {rest[k + 1 :]!r} (0-32)"
        rest = rest[:k]
    return rest, cidr4, cidr6, ""


def _parse_ip_term(raw: str, qualifier: str, name: str, rest: str) -> tuple[_Term | None, str]:
    if not rest.startswith(":"):
        return None, f"{name} needs an address: {name}:ADDRESS[/LENGTH]"
    address, slash, length = rest[1:].partition("/")
    maximum = 32 if name == "ip4" else 128
    try:
        if name == "ip4":
            ipaddress.IPv4Address(address)
        else:
            ipaddress.IPv6Address(address)
    except ValueError:
        return None, f"{address!r} is not an IPv{name[-1]} address"
    cidr = _digits(length, maximum) if slash else maximum
    if cidr is None:
        return None, f"bad CIDR length {length!r} (0-{maximum})"
    if name == "ip4":
        return _Term(raw, name, qualifier, address, cidr4=cidr), ""
    return _Term(raw, name, qualifier, address, cidr6=cidr), ""


def _check_macro_string(spec: str, *, domain_end: bool) -> str:
    """RFC 7208 §7.1 in one scan: the error, or "" when `spec` is valid. With `domain_end`
    it is a domain-spec: not empty, ending in a macro or in `.toplabel[.]`."""
    i, n, ends_in_macro = 0, len(spec), False
    while i < n:
        c = spec[i]
        if c == "%":
            nxt = spec[i + 1 : i + 2]
            if nxt and nxt in "%_-":
                i, ends_in_macro = i + 2, True
                continue
            if nxt != "{":
                return "'%' must start a macro: %{x}, %%, %_ or %- (RFC 7208 §7.1)"
            close = spec.find("}", i + 2)
            if close == -1:
                return "unterminated macro '%{'"
            error = _check_macro(spec[i + 2 : close])
            if error:
                return error
            i, ends_in_macro = close + 1, True
            continue
        if not "\x21" <= c <= "\x7e":
            return f"invalid character {c!r}"
        i, ends_in_macro = i + 1, False
    if not domain_end or ends_in_macro:
        return ""
    if not spec:
        return "empty domain"
    name = spec[:-1] if spec.endswith(".") else spec
    dot = name.rfind(".")
    top = name[dot + 1 :]
    if (
        dot == -1
        or not top
        or not all(c.isascii() and (c.isalnum() or c == "-") for c in top)
        or top[0] == "-"
        or top[-1] == "-"
        or top.isdigit()
    ):
        return f"{spec!r} is not a domain name (RFC 7208 §7.1: it must end in .toplabel)"
    return ""


def _check_macro(body: str) -> str:
    if not body or body[0].lower() not in _MACRO_LETTERS:
        return f"unknown macro %{{{body}}} (letters: s l o d i p h v)"
    k = 1
    while k < len(body) and body[k].isascii() and body[k].isdigit():
        k += 1
    if k > 1 and _digits(body[1:k], 128) in (None, 0):
        return f"bad macro transformer in %{{{body}}}"
    if k < len(body) and body[k] in "rR":
        k += 1
    if any(c not in _MACRO_DELIMITERS for c in body[k:]):
        return f"bad macro delimiter in %{{{body}}}"
    return ""


@dataclass(frozen=True, slots=True)
class _MacroContext:
    ip: Address
    sender: str  # local@domain
    helo: str


def _expand(spec: str, ctx: _MacroContext, domain: str) -> str:
    """Expand a valid domain-spec (RFC 7208 §7.3); the result is shortened from the left
    to 253 characters."""
    out: list[str] = []
    i = 0
    while i < len(spec):
        c = spec[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        nxt = spec[i + 1]
        if nxt != "{":
            out.append({"%": "%", "_": " ", "-": "%20"}[nxt])
            i += 2
            continue
        close = spec.index("}", i + 2)
        out.append(_expand_macro(spec[i + 2 : close], ctx, domain))
        i = close + 1
    result = "".join(out)
    while len(result) > 253 and "." in result:
        result = result.partition(".")[2]
    return result


def _expand_macro(body: str, ctx: _MacroContext, domain: str) -> str:
    letter = body[0].lower()
    local, _, sender_domain = ctx.sender.rpartition("@")
    if letter == "i":
        if isinstance(ctx.ip, ipaddress.IPv6Address):
            value = ".".join(ctx.ip.exploded.replace(":", ""))
        else:
            value = str(ctx.ip)
    else:
        value = {
            "s": ctx.sender,
            "l": local,
            "o": sender_domain,
            "d": domain,
            "p": "unknown",
            "v": "in-addr" if ctx.ip.version == 4 else "ip6",
            "h": ctx.helo,
        }[letter]
    k = 1
    while k < len(body) and body[k].isdigit():
        k += 1
    keep = int(body[1:k]) if k > 1 else 0
    reverse = k < len(body) and body[k] in "rR"
    delimiters = set(body[k + 1 if reverse else k :]) or {"."}
    parts: list[str] = []
    current: list[str] = []
    for c in value:
        if c in delimiters:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    if reverse:
        parts.reverse()
    if keep:
        parts = parts[-keep:]
    expanded = ".".join(parts)
    if body[0].isupper():
        expanded = urllib.parse.quote(expanded, safe="-._~")
    return expanded


def _network(address: str, cidr: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(f"{address}/{cidr}", strict=False)


def _ip_term(ip: Address) -> str:
    return f"ip{ip.version}:{ip}"


def _with_term(spf_text: str | None, term: str) -> str:
    """The SPF record with `term` added before `all` or `redirect=` (or at the end)."""
    if spf_text is None:
        return f"v=spf1 {term} -all"
    terms = [t for t in spf_text[6:].split(" ") if t]
    at = len(terms)
    for k, t in enumerate(terms):
        if t.lstrip("+-~?").lower() == "all" or t.lower().startswith("redirect="):
            at = k
            break
    terms.insert(at, term)
    return " ".join(["v=spf1", *terms])


# -- SPF: the record --------------------------------------------------------------------------


def _spf_record_check(domain: str, records: Sequence[str], ip: Address | None) -> Check:
    if not records:
        term = _ip_term(ip) if ip is not None else "ip4:<your relay's address>"
        return Check(
            "spf",
            "error",
            None,
            f"no SPF record at {domain}: receivers cannot tell which hosts may send as it;"
            f' publish a TXT record {domain} "v=spf1 {term} -all" (listing every host'
            " that sends as the domain)",
        )
    if len(records) > 1:
        return Check(
            "spf",
            "error",
            _joined(records),
            f"{len(records)} SPF records at {domain}: receivers return permerror"
            " (RFC 7208 §3.2, §4.5); merge them into one record",
        )
    spf = _parse_spf(records[0])
    if spf.errors:
        return Check(
            "spf",
            "error",
            records[0],
            "syntax error: " + "; ".join(spf.errors) + "; receivers return permerror"
            " (RFC 7208 §4.6)",
        )
    found = _Findings()
    mechanisms = spf.mechanisms
    redirect = spf.modifier("redirect")
    alls = [t for t in mechanisms if t.name == "all"]
    if alls:
        last = alls[0]
        if last.qualifier == "+":
            found.add(
                "warning",
                f"{last.raw} lets every host on the Internet send as {domain}:"
                " end the record with -all (or ~all)",
            )
        elif last.qualifier == "?":
            found.add(
                "warning",
                f"{last.raw} (neutral) says nothing about hosts not listed:"
                " end the record with -all (or ~all)",
            )
        if mechanisms[-1] is not last:
            found.add(
                "warning",
                f"terms after {last.raw} are never evaluated (RFC 7208 §5.1): move them before it",
            )
        if redirect is not None:
            found.add(
                "warning",
                f"{redirect.raw} is ignored because the record has {last.raw} (RFC 7208 §6.1)",
            )
        ending = f"hosts not listed get {_RESULTS[last.qualifier]} ({last.raw})"
    elif redirect is None:
        found.add(
            "warning",
            "no 'all' term and no redirect=: hosts not listed get neutral;"
            " end the record with -all (or ~all)",
        )
        ending = ""
    else:
        ending = f"hosts not listed get the result of {redirect.raw}"
    if any(t.name == "ptr" for t in mechanisms):
        found.add(
            "warning",
            "ptr is slow and unreliable and should not be used (RFC 7208 §5.5):"
            " list the addresses with ip4:/ip6:",
        )
    for t in spf.terms:
        if t.modifier and t.name not in ("redirect", "exp"):
            found.add("warning", f"unknown modifier {t.raw} is ignored by receivers (RFC 7208 §6)")
    return found.check("spf", records[0], f"one valid SPF record; {ending}")


# -- SPF: the lookup count --------------------------------------------------------------------


@dataclass(slots=True)
class _Walk:
    """Counts the DNS lookups of an SPF record through its includes and redirects."""

    dns: _Dns
    memo: dict[str, int] = field(default_factory=dict)
    own: list[tuple[str, int]] = field(default_factory=list)
    voids: list[str] = field(default_factory=list)
    found: _Findings = field(default_factory=_Findings)
    fetched: int = 0

    async def record(self, domain: str, spf: _Spf, path: tuple[str, ...]) -> int:
        followed = [
            t
            for t in spf.terms
            if t.name in _LOOKUP_TERMS and (not t.modifier or t.name == "redirect")
        ]
        if spf.has_all():  # RFC 7208 §6.1: redirect is ignored
            followed = [t for t in followed if not t.modifier]
        self.own.append((domain, len(followed)))
        # ask everything this record needs at once; the cache serves the walk below
        await asyncio.gather(*(self._prefetch(t, domain) for t in followed))
        total = len(followed)
        for t in followed:
            total += await self._term(t, domain, path)
        return total

    async def _prefetch(self, term: _Term, domain: str) -> None:
        target = term.value or domain
        if "%" in target:
            return
        if term.name in ("include", "redirect"):
            await self.dns.query(target, "TXT")
        elif term.name == "a":
            await asyncio.gather(self.dns.query(target, "A"), self.dns.query(target, "AAAA"))
        elif term.name == "mx":
            await self.dns.query(target, "MX")

    async def _term(self, term: _Term, domain: str, path: tuple[str, ...]) -> int:
        if term.name in ("ptr", "exists"):
            return 0
        target = (term.value or domain).rstrip(".").lower()
        if "%" in target:
            self.found.notes.append(f"{term.raw} in {domain} not followed (macro)")
            return 0
        if term.name == "a":
            answers = [await self.dns.query(target, t) for t in ("A", "AAAA")]
            failed = next((a for a in answers if a.kind == "failed"), None)
            if failed is not None:
                self.found.add("error", f"DNS lookup failed: {failed.failure}")
            elif all(a.void for a in answers):
                self.voids.append(f"{term.raw} in {domain}")
            return 0
        if term.name == "mx":
            answer = await self.dns.query(target, "MX")
            if answer.kind == "failed":
                self.found.add("error", f"DNS lookup failed: {answer.failure}")
            elif answer.void:
                self.voids.append(f"{term.raw} in {domain}")
            elif len(answer.items) > SPF_MX_LIMIT:
                self.found.add(
                    "error",
                    f"{term.raw} in {domain}: {target} has {len(answer.items)} MX hosts;"
                    f" SPF allows {SPF_MX_LIMIT} (RFC 7208 §4.6.4)",
                )
            return 0
        return await self._follow(term, domain, target, path)

    async def _follow(self, term: _Term, domain: str, target: str, path: tuple[str, ...]) -> int:
        where = f"{term.raw} in {domain}"
        if target in path:
            self.found.add("error", f"{where} loops back to {target}: receivers return permerror")
            return 0
        if target in self.memo:
            return self.memo[target]
        if self.fetched >= _WALK_CAP:
            self.found.add("warning", f"stopped counting after {_WALK_CAP} records at {where}")
            return 0
        self.fetched += 1
        answer = await self.dns.query(target, "TXT")
        if answer.kind == "failed":
            self.found.add("error", f"DNS lookup failed: {answer.failure}")
            return 0
        records = [t for t in answer.items if _is_spf(t)]
        if answer.void:
            self.voids.append(where)
        if len(records) != 1:
            have = "no SPF record" if not records else f"{len(records)} SPF records"
            self.found.add(
                "error", f"{where}: {target} has {have}; receivers return permerror (RFC 7208 §5.2)"
            )
            return 0
        spf = _parse_spf(records[0])
        if spf.errors:
            self.found.add(
                "error", f"{where}: syntax error in the record of {target}: {spf.errors[0]}"
            )
            return 0
        count = await self.record(target, spf, (*path, target))
        self.memo[target] = count
        return count


async def _spf_lookups_check(resolver: _Dns, domain: str, spf: _Spf) -> Check:
    walk = _Walk(resolver)
    total = await walk.record(domain, spf, (domain,))
    if total > SPF_LOOKUP_LIMIT:
        walk.found.add(
            "error",
            f"{total} DNS lookups: receivers allow {SPF_LOOKUP_LIMIT} and then return permerror"
            " (RFC 7208 §4.6.4); replace includes with the ip4:/ip6: ranges they list or drop"
            " unused ones",
        )
    if len(walk.voids) > SPF_VOID_LIMIT:
        walk.found.add(
            "warning",
            f"{len(walk.voids)} void lookups (names without records: {', '.join(walk.voids)});"
            f" receivers may return permerror after {SPF_VOID_LIMIT} (RFC 7208 §4.6.4)",
        )
    breakdown = ", ".join(f"{name} {n}" for name, n in walk.own)
    record = f"lookups {total} ({breakdown}), void {len(walk.voids)}"
    detail = (
        f"{total} of {SPF_LOOKUP_LIMIT} DNS lookups, "
        f"{len(walk.voids)} of {SPF_VOID_LIMIT} void lookups"
    )
    return walk.found.check("spf.lookups", record, detail)


# -- SPF: check_host() (RFC 7208 §4) ----------------------------------------------------------


class _SpfAbort(Exception):
    def __init__(self, result: str, why: str) -> None:
        super().__init__(why)
        self.result, self.why = result, why


@dataclass(slots=True)
class _Evaluator:
    dns: _Dns
    ctx: _MacroContext
    lookups: int = 0
    voids: int = 0
    notes: list[str] = field(default_factory=list)
    via: str = ""  # why the last include that matched passed

    async def run(self, domain: str) -> tuple[str, str]:
        try:
            return await self._check_host(domain, (domain,))
        except _SpfAbort as abort:
            return abort.result, abort.why

    async def _check_host(self, domain: str, path: tuple[str, ...]) -> tuple[str, str]:
        answer = await self.dns.query(domain, "TXT")
        if answer.kind == "failed":
            raise _SpfAbort("temperror", f"DNS lookup failed: {answer.failure}")
        records = [t for t in answer.items if _is_spf(t)]
        if not records:
            return "none", f"{domain} has no SPF record"
        if len(records) > 1:
            raise _SpfAbort("permerror", f"{domain} has {len(records)} SPF records")
        spf = _parse_spf(records[0])
        if spf.errors:
            raise _SpfAbort("permerror", f"syntax error in {domain}: {spf.errors[0]}")
        for term in spf.mechanisms:
            if term.name in _LOOKUP_TERMS:
                self._count(term, domain)
            if await self._matches(term, domain, path):
                why = f"{term.raw} in {domain} matched"
                if term.name == "include":
                    why += f" ({self.via})"
                return _RESULTS[term.qualifier], why
        redirect = spf.modifier("redirect")
        if redirect is not None:
            self._count(redirect, domain)
            target = self._target(redirect, domain)
            if target in path:
                raise _SpfAbort("permerror", f"{redirect.raw} in {domain} loops")
            result, why = await self._check_host(target, (*path, target))
            if result == "none":
                raise _SpfAbort("permerror", f"{redirect.raw} in {domain}: {why}")
            return result, why
        return "neutral", f"no term of {domain} matched and it has no all"

    def _count(self, term: _Term, domain: str) -> None:
        self.lookups += 1
        if self.lookups > SPF_LOOKUP_LIMIT:
            raise _SpfAbort(
                "permerror",
                f"more than {SPF_LOOKUP_LIMIT} DNS lookups at {term.raw} in {domain}"
                " (RFC 7208 §4.6.4)",
            )

    def _void(self, term: _Term, domain: str) -> None:
        self.voids += 1
        if self.voids > SPF_VOID_LIMIT:
            raise _SpfAbort(
                "permerror",
                f"more than {SPF_VOID_LIMIT} void lookups at {term.raw} in {domain}"
                " (RFC 7208 §4.6.4)",
            )

    def _target(self, term: _Term, domain: str) -> str:
        if not term.value:
            return domain
        return _expand(term.value, self.ctx, domain).rstrip(".").lower()

    async def _addresses(self, name: str) -> tuple[str, ...] | None:
        answer = await self.dns.query(name, "A" if self.ctx.ip.version == 4 else "AAAA")
        if answer.kind == "failed":
            raise _SpfAbort("temperror", f"DNS lookup failed: {answer.failure}")
        return None if answer.void else answer.items

    def _in(self, addresses: Sequence[str], term: _Term) -> bool:
        ip = self.ctx.ip
        cidr = term.cidr4 if ip.version == 4 else term.cidr6
        length = ip.max_prefixlen if cidr is None else cidr
        return any(ip in _network(a, length) for a in addresses)

    async def _matches(self, term: _Term, domain: str, path: tuple[str, ...]) -> bool:
        ip = self.ctx.ip
        if term.name == "all":
            return True
        if term.name in ("ip4", "ip6"):
            if (term.name == "ip4") != (ip.version == 4):
                return False
            cidr = term.cidr4 if term.name == "ip4" else term.cidr6
            assert cidr is not None
            return ip in _network(term.value, cidr)
        if term.name in ("ptr", "exists"):
            self.notes.append(f"{term.raw} in {domain} not evaluated (treated as not matching)")
            return False
        target = self._target(term, domain)
        if term.name == "a":
            addresses = await self._addresses(target)
            if addresses is None:
                self._void(term, domain)
                return False
            return self._in(addresses, term)
        if term.name == "mx":
            answer = await self.dns.query(target, "MX")
            if answer.kind == "failed":
                raise _SpfAbort("temperror", f"DNS lookup failed: {answer.failure}")
            if answer.void:
                self._void(term, domain)
                return False
            if len(answer.items) > SPF_MX_LIMIT:
                raise _SpfAbort(
                    "permerror", f"{term.raw} in {domain}: more than {SPF_MX_LIMIT} MX hosts"
                )
            hosts = [name for _, name in _mx_pairs(answer) if name.strip(".")]
            found = await asyncio.gather(*(self._addresses(h) for h in hosts))
            return any(self._in(addresses or (), term) for addresses in found)
        # include
        if target in path:
            raise _SpfAbort("permerror", f"{term.raw} in {domain} loops")
        result, why = await self._check_host(target, (*path, target))
        if result == "pass":
            self.via = why
            return True
        if result == "none":
            raise _SpfAbort("permerror", f"{term.raw} in {domain}: {why}")
        return False


async def _spf_authorises_check(
    resolver: _Dns, domain: str, ip: Address | None, own: str | None
) -> Check:
    if ip is None:
        return Check("spf.authorises", "ok", None, _NOT_CHECKED)
    evaluator = _Evaluator(resolver, _MacroContext(ip, f"postmaster@{domain}", domain))
    result, why = await evaluator.run(domain)
    record = f"{result}: {why}"
    notes = "".join(f" (note: {n})" for n in evaluator.notes)
    if result == "pass":
        return Check("spf.authorises", "ok", record, f"{ip} may send as {domain}{notes}")
    if result == "temperror":
        return Check("spf.authorises", "error", record, f"{why}{notes}")
    term = _ip_term(ip)
    if result == "permerror":
        detail = (
            f"SPF of {domain} gives permerror for {ip} ({why}): receivers treat the mail as"
            " unauthenticated; fix the errors reported for spf and spf.lookups"
        )
    elif result == "none":
        detail = f'{ip} is not authorised: publish TXT {domain} "{_with_term(None, term)}"'
    else:
        detail = (
            f"{ip} is not authorised (SPF {result}): add {term} to the SPF record of {domain}:"
            f' "{_with_term(own, term)}"'
        )
    return Check("spf.authorises", "error", record, detail + notes)


async def _spf_checks(resolver: _Dns, domain: str, ip: Address | None) -> list[Check]:
    answer = await resolver.query(domain, "TXT")
    records = [t for t in answer.items if _is_spf(t)]
    own = records[0] if len(records) == 1 else None
    checks, authorises = await asyncio.gather(
        _spf_static_checks(resolver, domain, answer, records, ip),
        _spf_authorises_check(resolver, domain, ip, own),
    )
    return [*checks, authorises]


async def _spf_static_checks(
    resolver: _Dns, domain: str, answer: _Answer, records: list[str], ip: Address | None
) -> list[Check]:
    if answer.kind == "failed":
        return [_failed("spf", answer)]
    checks = [_spf_record_check(domain, records, ip)]
    if len(records) == 1:
        spf = _parse_spf(records[0])
        if not spf.errors:
            checks.append(await _spf_lookups_check(resolver, domain, spf))
    return checks


# -- DKIM (RFC 6376 §3.6.1) -------------------------------------------------------------------


async def _dkim_check(resolver: _Dns, domain: str, selector: str, expected: str) -> Check:
    name = f"dkim:{selector}"
    owner = f"{selector}._domainkey.{domain}"
    publish = f'publish TXT {owner} "{expected}"'
    answer = await resolver.query(owner, "TXT")
    if answer.kind == "failed":
        return _failed(name, answer)
    if answer.void:
        return Check(name, "error", None, f"no DKIM key at {owner}: {publish}")
    keys = []
    for text in answer.items:
        pairs, _ = _tags(text)
        names = {n for n, _ in pairs}
        if "p" in names or ("v", "DKIM1") in pairs:
            keys.append(text)
    if not keys:
        return Check(
            name, "error", _joined(answer.items), f"no DKIM key record (p=) at {owner}: {publish}"
        )
    if len(keys) > 1:
        return Check(
            name,
            "error",
            _joined(keys),
            f"{len(keys)} key records at {owner}: verifiers may use any of them; keep only"
            f" one: {publish}",
        )
    text = keys[0]
    pairs, errors = _tags(text)
    tags = dict(pairs)
    wanted = dict(_tags(expected)[0])
    found = _Findings()
    for error in errors:
        found.add("error", f"malformed record: {error}")
    if "v" in tags and (tags["v"] != "DKIM1" or pairs[0][0] != "v"):
        found.add("error", f"v= must be DKIM1 and the first tag (RFC 6376 §3.6.1): {publish}")
    key = _b64(tags.get("p", ""))
    if not key:
        found.add("error", f"empty p=: the key is revoked (RFC 6376 §3.6.1): {publish}")
    elif key != _b64(wanted.get("p", "")):
        found.add(
            "error",
            f"DNS has a different key than the one configured for selector {selector}:"
            " signatures fail; " + publish,
        )
    k, wanted_k = tags.get("k", "rsa").lower(), wanted.get("k", "rsa").lower()
    if k != wanted_k:
        found.add("error", f"k={k} in DNS but the configured key is k={wanted_k}: {publish}")
    services = {s.strip() for s in tags.get("s", "*").split(":")}
    if not services & {"*", "email"}:
        found.add("error", f"s={tags['s']} does not allow email (RFC 6376 §3.6.1)")
    if "y" in {f.strip() for f in tags.get("t", "").split(":")}:
        found.add(
            "warning",
            "t=y: testing mode, verifiers may ignore failed signatures; remove t=y when"
            " signing works",
        )
    return found.check(name, text, f"the key at {owner} matches the configured key")


# -- DMARC (RFC 7489 §6) ----------------------------------------------------------------------

_POLICIES = ("none", "quarantine", "reject")
_MODES = ("r", "s")


@dataclass(frozen=True, slots=True)
class _Dmarc:
    check: Check
    tags: dict[str, str] | None  # the record's tags (names lowercased), None without one


def _is_dmarc(text: str) -> bool:
    pairs, _ = _tags(text)
    return bool(pairs) and pairs[0][0].lower() == "v" and pairs[0][1].upper() == "DMARC1"


async def _dmarc_check(resolver: _Dns, domain: str) -> _Dmarc:
    owner = f"_dmarc.{domain}"
    answer = await resolver.query(owner, "TXT")
    if answer.kind == "failed":
        return _Dmarc(_failed("dmarc", answer), None)
    seen = answer.items
    records = [t for t in answer.items if _is_dmarc(t)]
    policy_domain, inherited = domain, False
    org = org_domain(domain)
    if not records and org != domain:
        answer = await resolver.query(f"_dmarc.{org}", "TXT")
        if answer.kind == "failed":
            return _Dmarc(_failed("dmarc", answer), None)
        records = [t for t in answer.items if _is_dmarc(t)]
        policy_domain, inherited = org, True
    if not records:
        check = Check(
            "dmarc",
            "warning",
            _joined(seen) if seen else None,
            f"no DMARC record at {owner}: publish TXT {owner}"
            f' "v=DMARC1; p=none; rua=mailto:dmarc-reports@{domain}", read the reports, then'
            " move to p=quarantine or p=reject",
        )
        return _Dmarc(check, None)
    if len(records) > 1:
        check = Check(
            "dmarc",
            "error",
            _joined(records),
            f"{len(records)} DMARC records at _dmarc.{policy_domain}: receivers apply none"
            " (RFC 7489 §6.6.3); keep one",
        )
        return _Dmarc(check, None)
    text = records[0]
    pairs, errors = _tags(text)
    tags = {n.lower(): v for n, v in pairs}
    found = _Findings()
    for error in errors:
        found.add("error", f"malformed record: {error}")
    if pairs[0][1] != "DMARC1":
        found.add("error", f"the version must be exactly v=DMARC1, not v={pairs[0][1]}")
    for tag, allowed in (("p", _POLICIES), ("sp", _POLICIES), ("adkim", _MODES), ("aspf", _MODES)):
        value = tags.get(tag)
        if (value is None and tag == "p") or (value is not None and value.lower() not in allowed):
            found.add(
                "error",
                f"{tag}={value or ''} is missing or invalid (one of {', '.join(allowed)}):"
                " receivers may ignore the record",
            )
    if "pct" in tags and _digits(tags["pct"], 100) is None:
        found.add("error", f"pct={tags['pct']} is not 0-100")
    tag = "sp" if inherited and "sp" in tags else "p"
    policy = tags.get(tag, "").lower()
    if policy == "none":
        found.add(
            "warning",
            f"{tag}=none is monitoring only: receivers deliver mail that fails DMARC; move to"
            " p=quarantine, then p=reject, once the reports show all your mail passes",
        )
    await _dmarc_reports(resolver, found, domain, policy_domain, tags.get("rua"))
    if inherited:
        found.notes.append(f"inherited from _dmarc.{org} ({tag}= applies to {domain})")
    detail = f"policy {tag}={policy}, aggregate reports to {tags.get('rua')}"
    return _Dmarc(found.check("dmarc", text, detail), tags)


async def _dmarc_reports(
    resolver: _Dns, found: _Findings, domain: str, policy_domain: str, rua: str | None
) -> None:
    if not rua:
        found.add(
            "warning",
            "no rua=: you get no aggregate reports, so you cannot see who sends as"
            f" {domain}; add rua=mailto:dmarc-reports@{domain}",
        )
        return
    external: list[tuple[str, str]] = []
    for uri in rua.split(","):
        uri = uri.strip().partition("!")[0]
        if uri[:7].lower() != "mailto:" or "@" not in uri:
            found.add(
                "warning", f"rua {uri} is not a mailto: address: receivers send reports by mail"
            )
            continue
        target = uri.rpartition("@")[2].rstrip(".").lower()
        if org_domain(target) != org_domain(policy_domain):
            external.append((uri, target))
    for uri, target in external:
        # RFC 7489 §7.1: the report receiver must agree to get reports for the domain
        owner = f"{policy_domain}._report._dmarc.{target}"
        answer = await resolver.query(owner, "TXT")
        if answer.kind == "failed":
            found.add("error", f"DNS lookup failed: {answer.failure}")
        elif not any(_is_dmarc(t) for t in answer.items):
            found.add(
                "warning",
                f'reports to {uri} are dropped: {target} must publish TXT {owner} "v=DMARC1"'
                " (RFC 7489 §7.1)",
            )


def _alignment_check(
    domain: str,
    envelope: str,
    dmarc: _Dmarc,
    spf: Sequence[Check],
    dkim: Sequence[Check],
    configured: bool,
) -> Check:
    """DMARC alignment (RFC 7489 §3.1). SPF counts when the envelope domain aligns and,
    when it is DOMAIN itself, `spf`/`spf.authorises` found no error (SPF could not pass);
    DKIM counts when a configured key's record is right."""
    tags = dmarc.tags or {}
    aspf = "s" if tags.get("aspf", "r").lower() == "s" else "r"
    adkim = "s" if tags.get("adkim", "r").lower() == "s" else "r"
    same = envelope == domain if aspf == "s" else org_domain(envelope) == org_domain(domain)
    spf_broken = envelope == domain and any(c.status == "error" for c in spf)
    dkim_ok = configured and any(c.status != "error" for c in dkim)
    mode = "strict (aspf=s): the same domain" if aspf == "s" else "relaxed: the same org domain"
    if not configured:
        dkim_text = "DKIM: not configured"
    else:
        dkim_text = f"DKIM: d={domain}, {len(dkim)} key(s)" + ("" if dkim_ok else ", none valid")
    record = f"From {domain}; envelope {envelope}; aspf={aspf} adkim={adkim}; {dkim_text}"
    if not same:
        spf_why = f"envelope {envelope} is not aligned with {domain} ({mode})"
        spf_fix = f"use an envelope sender at {domain}" + (
            "" if aspf == "s" else f" or a subdomain of {org_domain(domain)}"
        )
    else:
        spf_why = f"SPF of {domain} cannot pass (see spf and spf.authorises)"
        spf_fix = f"fix the SPF record of {domain}"
    if not configured:
        dkim_why, dkim_fix = "DKIM is not configured", f"configure DKIM signing for {domain}"
    else:
        dkim_why = "no configured DKIM key is published correctly"
        dkim_fix = "fix the DKIM key records (see dkim:...)"
    suffix = "" if dmarc.tags is not None else " (no DMARC record yet: relaxed defaults)"
    spf_ok = same and not spf_broken
    if spf_ok and dkim_ok:
        status: Status = "ok"
        detail = f"SPF (envelope {envelope}) and DKIM (d={domain}) both align with From {domain}"
    elif spf_ok:
        status = "warning"
        detail = (
            f"only SPF aligns: {dkim_why}, and forwarded mail (which breaks SPF) fails DMARC;"
            f" {dkim_fix}"
        )
    elif dkim_ok:
        status = "warning"
        detail = (
            f"only DKIM aligns: {spf_why}, so mail whose signature breaks fails DMARC; {spf_fix}"
        )
    else:
        status = "error"
        detail = (
            f"neither SPF nor DKIM aligns with From {domain}: {spf_why} and {dkim_why};"
            f" receivers enforcing DMARC reject or quarantine the mail: {dkim_fix}, or {spf_fix}"
        )
    return Check("dmarc.alignment", status, record, detail + suffix)


# -- MX (RFC 5321 §5.1, RFC 7505) -------------------------------------------------------------


async def _mx_check(resolver: _Dns, domain: str) -> Check:
    answer = await resolver.query(domain, "MX")
    if answer.kind == "failed":
        return _failed("mx", answer)
    if answer.kind == "nxdomain":
        return Check("mx", "error", None, f"{domain} does not exist (NXDOMAIN)")
    if answer.kind == "nodata":
        return Check(
            "mx",
            "warning",
            None,
            f"no MX record: senders fall back to the address of {domain} (implicit MX,"
            " RFC 5321 §5.1); publish MX records naming the hosts that receive its mail"
            " (bounces and replies)",
        )
    pairs = sorted(_mx_pairs(answer))
    record = ", ".join(f"{p} {name}" for p, name in pairs)
    if is_null_mx(pairs):
        return Check(
            "mx",
            "warning",
            record,
            "null MX (RFC 7505): the domain accepts no mail: bounces to it are lost",
        )
    found = _Findings()
    hosts = [name.rstrip(".") for _, name in pairs if name.strip(".")]
    if len(hosts) < len(pairs):
        found.add("warning", "a null MX ('.') among other MX records (RFC 7505 §3): remove it")
    lookups = await asyncio.gather(*(resolver.query(h, t) for h in hosts for t in ("A", "AAAA")))
    for k, host in enumerate(hosts):
        pair = lookups[2 * k : 2 * k + 2]
        for a in pair:
            if a.kind == "failed":
                found.add("error", f"DNS lookup failed: {a.failure}")
        if all(a.void for a in pair):
            found.add("warning", f"MX host {host} has no A/AAAA record: mail cannot reach it")
    return found.check("mx", record, f"{len(hosts)} MX host(s)")


# -- MTA-STS (RFC 8461 §3.1) and TLS-RPT (RFC 8460 §3) ----------------------------------------


def _is_ext_name(name: str) -> bool:
    return 0 < len(name) <= 32 and name[0].isalnum() and all(_is_name_char(c) for c in name)


async def _txt_policy(
    resolver: _Dns, name: str, owner: str, prefix: str, version: str
) -> tuple[Check | None, str, list[tuple[str, str]], _Findings]:
    """The one record at `owner` starting with `prefix` (case-insensitive), parsed; a Check
    when there is nothing more to judge."""
    answer = await resolver.query(owner, "TXT")
    found = _Findings()
    if answer.kind == "failed":
        return _failed(name, answer), "", [], found
    records = [t for t in answer.items if t[: len(prefix)].lower() == prefix.lower()]
    if not records:
        return Check(name, "ok", None, "not published (optional)"), "", [], found
    if len(records) > 1:
        check = Check(
            name,
            "error",
            _joined(records),
            f"{len(records)} records at {owner}: senders ignore them all; keep one",
        )
        return check, "", [], found
    pairs, errors = _tags(records[0])
    for error in errors:
        found.add("error", f"malformed record: {error}")
    if not pairs or pairs[0] != ("v", version):
        found.add("error", f"the record must start with v={version};")
    for n, v in pairs:
        if not _is_ext_name(n) or not v:
            found.add("error", f"bad field {n}={v}")
    return None, records[0], pairs, found


async def _mta_sts_check(resolver: _Dns, domain: str) -> Check:
    owner = f"_mta-sts.{domain}"
    done, text, pairs, found = await _txt_policy(resolver, "mta-sts", owner, "v=sts", "STSv1")
    if done is not None:
        return done
    ident = dict(pairs).get("id")
    if ident is None:
        found.add("error", "no id= (RFC 8461 §3.1): senders ignore the record")
    elif not (0 < len(ident) <= 32 and ident.isascii() and ident.isalnum()):
        found.add("error", f"id={ident} must be 1-32 letters and digits (RFC 8461 §3.1)")
    detail = (
        f"published (id={ident}); the policy at https://mta-sts.{domain}/.well-known/mta-sts.txt"
        " is not checked here"
    )
    return found.check("mta-sts", text, detail)


async def _tls_rpt_check(resolver: _Dns, domain: str) -> Check:
    owner = f"_smtp._tls.{domain}"
    done, text, pairs, found = await _txt_policy(resolver, "tls-rpt", owner, "v=tlsrpt", "TLSRPTv1")
    if done is not None:
        return done
    rua = dict(pairs).get("rua")
    if rua is None:
        found.add("error", "no rua= (RFC 8460 §3): senders have nowhere to report")
    else:
        for uri in (u.strip() for u in rua.split(",")):
            low = uri.lower()
            mail = low.startswith("mailto:") and "@" in uri
            if not (mail or (low.startswith("https://") and len(uri) > 8)):
                found.add("error", f"rua {uri!r} is not a mailto: or https:// URI")
    return found.check("tls-rpt", text, f"published: TLS reports to {rua}")


# -- the run ----------------------------------------------------------------------------------


async def check_domain(
    domain: str,
    *,
    nameservers: Sequence[str] | None,
    dkim: Sequence[tuple[str, str]] = (),
    ip: str | None = None,
    envelope_domain: str | None = None,
    timeout: float = 5.0,
) -> list[Check]:
    """Check the mail DNS records of `domain` (see the module rules for the checks).

    `dkim`: (selector, expected public key record) per configured key; `ip`: the sending
    address to test SPF authorisation for; `envelope_domain`: the domain of the envelope
    sender (None: `domain`). Raises ValueError for an invalid domain, envelope domain, ip or
    nameserver; DNS failures become error checks.
    """
    name = _normalise(domain)
    envelope = _normalise(envelope_domain) if envelope_domain else name
    address = _parse_ip(ip) if ip is not None else None
    resolver = _Dns(nameservers, timeout)
    try:
        spf, dkim_checks, dmarc, mx, sts, tlsrpt = await asyncio.gather(
            _spf_checks(resolver, name, address),
            asyncio.gather(*(_dkim_check(resolver, name, s, e) for s, e in dkim)),
            _dmarc_check(resolver, name),
            _mx_check(resolver, name),
            _mta_sts_check(resolver, name),
            _tls_rpt_check(resolver, name),
        )
    finally:
        resolver.close()
    alignment = _alignment_check(name, envelope, dmarc, spf, dkim_checks, bool(dkim))
    return [*spf, *dkim_checks, dmarc.check, alignment, mx, sts, tlsrpt]
