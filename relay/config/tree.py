"""The typed, frozen configuration tree.

Rules:
- One entry point, `load_config(path)` / `from_mapping(data, base_dir)`; the keys, types and
  defaults of each section are its pydantic model in relay/config/models.py (value types:
  relay/config/values.py); `DEFAULTS` below takes them from the models (and is mirrored,
  commented, in conf/relay.yaml; `relay config schema` prints the JSON Schema).
- An unknown key, a wrong type or a bad value raises `ConfigError` whose message names the
  key path (`retry.schedule[2]: '5x' is not a duration`); every error of a file is found in
  one pass, one a line; the CLI exits 78 (EX_CONFIG).
- Relative paths are relative to the config file's folder.
- Secrets are read from files named in the config and never appear in `repr` or in
  `redacted()` output.
- The rest of the code reads the frozen dataclasses below (Config, Limits, FeedbackConf...),
  built from the validated models.
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import ipaddress
import os
import re
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, create_model

from relay.authenticity.dkim import DkimKey
from relay.authenticity.unsubscribe import UnsubscribeConf
from relay.config import credentials
from relay.config import values as types
from relay.config.models import (
    FEEDBACK_PROVIDERS,
    MAX_HEADER_SIZE,
    SECTIONS,
    AdminSection,
    AlertsSection,
    AuthSection,
    DedupSection,
    DeliverySection,
    DestinationSection,
    DsnSection,
    FeedbackSection,
    HealthSection,
    IdentitySection,
    InboundSection,
    LanesSection,
    LimitsSection,
    ListenerSection,
    LocalSection,
    LogSection,
    MailgunProvider,
    RetrySection,
    Section,
    Sections,
    SendgridProvider,
    SesProvider,
    ShapingSection,
    TimeoutsSection,
)
from relay.delivery import routes as routing
from relay.delivery.lanes import LaneRule
from relay.delivery.shaping import ShapingRule
from relay.ops.logs import redact_webhook_url

EX_CONFIG = 78
DEFAULT_PATH = "/etc/relay/relay.yaml"
# the dedup namespace of a PostgreSQL spool's unauthenticated clients whose listener sets no
# `namespace` (dedup keys hash `listener:fleet`; on SQLite the default stays the address)
FLEET_NAMESPACE = "fleet"

DEFAULTS: dict[str, Any] = {
    "hostname": None,
    "listen": [{"address": "127.0.0.1:2525", "allow": ["127.0.0.0/8", "::1/128"]}],
    "spool": {
        "path": "../var/spool",
        "inline_max": "128KiB",
        "retention": "7d",
        "backend": "sqlite",
        "maildrop": None,  # None: <spool.path>/maildrop (relay/spool/maildrop.py)
        "reserve": "64MiB",
    },
    "dedup": DedupSection.defaults(),
    "limits": LimitsSection.defaults(),
    "auth": AuthSection.defaults(),
    "upstream": {
        "mode": "smarthost",
        "helo": None,
        "smarthost": {
            "host": "127.0.0.1",
            "port": 587,
            "tls": "starttls",
            "verify": True,
            "ca_file": None,
            "username": None,
            "password_file": None,
        },
        "mx": {
            "port": 25,
            "tls": "opportunistic",
            "verify": False,
            "nameservers": None,
            "dns_timeout": "10s",
            "mta_sts": True,
            "ca_file": None,
            "mta_sts_port": 443,
        },
    },
    "retry": RetrySection.defaults(),
    "timeouts": TimeoutsSection.defaults(),
    "destinations": {"*": {}},
    "identities": {},
    "shaping": ShapingSection.defaults(),
    "lanes": LanesSection.defaults(),
    "delivery": DeliverySection.defaults(),
    "alerts": AlertsSection.defaults(),
    "health": HealthSection.defaults(),
    "dsn": DsnSection.defaults(),
    "local": LocalSection.defaults(),
    "admin": AdminSection.defaults(),
    "dkim": {},
    "feedback": FeedbackSection.defaults(),
    "log": LogSection.defaults(),
    "shutdown_timeout": "30s",
    "inbound": InboundSection.defaults(),
}

# Per-destination keys and their defaults (used for "*" and every named destination; a
# named destination inherits every key it does not set from "*").
DESTINATION_DEFAULTS: dict[str, Any] = DestinationSection.defaults()

IDENTITY_DEFAULTS: dict[str, Any] = IdentitySection.defaults()


_T = TypeVar("_T")


class ConfigError(Exception):
    """A configuration problem; the message starts with the offending key path."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a cpuset or taskset counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_inbound_processes(value: int | str) -> int:
    """`inbound.processes`: a number as given; `auto` (the default): one SMTP process
    beside the main one when there are two or more cores to run on, none on one core (where
    a second process would only share the core: README "Using every core")."""
    if value == "auto":
        return 1 if usable_cores() >= 2 else 0
    return int(value)


def parse_duration(value: object, key: str) -> float:
    """Seconds from `30s`, `5m`, `2h`, `7d` or a number (relay.config.values.duration)."""
    return _keyed(types.duration, value, key)


def parse_percent(value: object, key: str) -> float:
    """ "10%" or 10 (percent, 0 to 100)."""
    return _keyed(types.percent, value, key)


def _read_secret(path: Path, key: str) -> str:
    try:
        value = path.read_text(encoding="utf-8").strip("\r\n")
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if not value:
        raise ConfigError(f"{key}: {path} is empty")
    return value


def parse_size(value: object, key: str) -> int:
    return _keyed(types.size, value, key)


def parse_rate(value: object, key: str) -> float | None:
    """Tokens per second; None means unlimited."""
    return _keyed(types.rate, value, key)


def parse_hostport(value: object, key: str, default_port: int | None = None) -> tuple[str, int]:
    return _keyed(lambda v: types.hostport(v, default_port), value, key)


def _keyed(parse: Callable[[Any], _T], value: object, key: str) -> _T:
    """`parse(value)`, its ValueError a ConfigError naming `key`."""
    try:
        return parse(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


class _Reader:
    """Walks one mapping, checking types and remembering which keys were used."""

    def __init__(self, data: object, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or 'config'}: expected a mapping, got {_kind(data)}")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        # a key from the file is shown escaped: a control character in an unknown key must
        # not break the one-error-a-line message (str.splitlines splits on \x1c-\x1e too)
        name = _shown(name)
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str) -> Any:
        self.used.add(name)
        return self.data.get(name)

    def string(self, name: str, choices: tuple[str, ...] | None = None) -> str:
        v = self.get(name)
        if v is None:
            self._misspelt(name)
        if not isinstance(v, str):
            raise ConfigError(f"{self.key(name)}: expected a string, got {_kind(v)}")
        if choices and v not in choices:
            raise ConfigError(f"{self.key(name)}: {v!r} is not one of {', '.join(choices)}")
        return v

    def opt_str(self, name: str) -> str | None:
        v = self.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise ConfigError(f"{self.key(name)}: expected a string or null, got {_kind(v)}")
        return v

    def duration(self, name: str) -> float:
        return parse_duration(self.get(name), self.key(name))

    def path_(self, name: str, base: Path) -> Path | None:
        v = self.opt_str(name)
        if v is None:
            return None
        try:  # systemd's LoadCredential= folder (relay/config/credentials.py)
            v = credentials.expand(v, self.key(name))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # ENAMETOOLONG is an OSError that Path.is_file() raises instead of answering False
        if len(os.fsencode(v)) >= 4096 or any(len(os.fsencode(c)) > 255 for c in v.split("/")):
            raise ConfigError(f"{self.key(name)}: file name too long")
        return (base / v).resolve() if not os.path.isabs(v) else Path(v)

    def _misspelt(self, name: str) -> None:
        """A required key is missing: if an unknown key looks like it, say so (the
        misspelling is the error, not the missing key)."""
        others = [str(k) for k in self.data if k not in self.used and k != name]
        close = difflib.get_close_matches(name, others, n=1, cutoff=0.6)
        if close:
            raise ConfigError(
                f"{self.key(close[0])}: unknown key {close[0]!r} (did you mean {name!r}?)"
            )

    def finish(self) -> None:
        unknown = [str(k) for k in self.data if k not in self.used]
        if not unknown:
            return
        name = unknown[0]
        raise ConfigError(_unknown_key(self.key(name), name, sorted(self.used)))


def _domain_ok(domain: str) -> bool:
    from relay.mail.address import AddressError, check_domain

    try:
        check_domain(domain)
    except AddressError:
        return False
    return True


_kind = types.kind


def _merge(base: Any, over: Any) -> Any:
    """Deep-merge `over` onto `base` for mappings; anything else replaces. A section left
    empty (`limits:` with every key commented out is YAML null) keeps its defaults."""
    if isinstance(base, dict) and over is None:
        return dict(base)
    if isinstance(base, dict) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return over


# --- the tree -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListenerTLS:
    """STARTTLS (or, with `mode: implicit`, TLS from the first byte: RFC 8314 §3) for
    submitting clients: the server context is built (and the files checked) when the config
    is loaded, so a bad certificate is a config error and SIGHUP reloads a renewed one."""

    cert_file: Path
    key_file: Path
    context: ssl.SSLContext = field(repr=False, compare=False)
    mode: str = "starttls"  # "starttls" | "implicit"

    @property
    def implicit(self) -> bool:
        return self.mode == "implicit"


@dataclass(frozen=True, slots=True)
class ListenerAuth:
    """AUTH PLAIN/LOGIN against a users file (`username:scrypt$salt$hash`), read when the
    config is loaded (start, SIGHUP). The hashes never appear in repr or logs."""

    users_file: Path
    allow_plaintext: bool  # offer AUTH without TLS (loopback-only set-ups)
    users: Mapping[str, str] = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Listener:
    name: str  # "host:port" as written
    # the dedup namespace of unauthenticated clients: `namespace:`, by default the name on
    # SQLite and FLEET_NAMESPACE on PostgreSQL (one for every listener of every node, so a
    # retry through a load balancer to another node is a duplicate; docs/fleet.md)
    namespace: str
    host: str
    port: int
    allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    lane: str | None = None
    tls: ListenerTLS | None = None
    require_tls: bool = False  # MAIL (anything but EHLO/NOOP/QUIT) needs STARTTLS first
    auth: ListenerAuth | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_size: int
    max_recipients: int
    session_timeout: float
    max_line_length: int
    max_command_length: int
    # the header block (up to the first empty line) of any message over SMTP; more: 552 5.3.4
    max_header_size: int = MAX_HEADER_SIZE
    max_connections: int = 500  # open SMTP connections at once, all clients together
    max_connections_per_ip: int = 50  # per client IP outside every `allow` network
    max_connections_per_ip_allowed: int = 500  # per IP in an `allow` network or loopback
    allowed_reserve: int = 50  # of max_connections, kept for `allow`/loopback clients
    max_errors: int = 10  # error replies in a session before 421 4.7.0 (0 = no limit)
    command_timeout: float = 60.0  # waiting for one command line, then 421 4.4.2
    min_data_rate: int = 500  # bytes/s during DATA, over min_data_rate_window (0 = off)
    min_data_rate_window: float = 30.0


@dataclass(frozen=True, slots=True)
class AuthLimits:
    """Daemon-wide AUTH protection (the per-listener users are in ListenerAuth)."""

    max_parallel: int = 2  # password checks running at once (threads)
    max_pending: int = 100  # checks waiting for a thread; more get 454 4.7.0
    failure_delay: float = 0.5  # before a 535; doubles per recent failure from the IP
    max_failure_delay: float = 8.0
    max_failures_per_ip: int = 10  # within failure_window, then a ban (0 = no ban)
    failure_window: float = 600.0
    ban_time: float = 600.0


@dataclass(frozen=True, slots=True)
class Smarthost:
    host: str
    port: int
    tls: str
    verify: bool
    ca_file: Path | None
    username: str | None
    password_file: Path | None
    password: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class MxMode:
    port: int
    tls: str
    verify: bool
    nameservers: tuple[str, ...] | None
    dns_timeout: float
    mta_sts: bool = True  # RFC 8461: honour the policies domains publish
    ca_file: Path | None = None  # extra trust for MTA-STS policy hosts and MX certificates
    mta_sts_port: int = 443  # the policy host's HTTPS port (tests, unusual set-ups)


@dataclass(frozen=True, slots=True)
class Upstream:
    mode: str
    helo: str
    smarthost: Smarthost
    mx: MxMode


@dataclass(frozen=True, slots=True)
class Retry:
    schedule: tuple[float, ...]
    max_age: float
    min_delay: float
    warn_after: float = 4 * 3600.0  # a `delayed` alert (and DSN) once per message; 0: never


@dataclass(frozen=True, slots=True)
class Destination:
    name: str
    max_connections: int
    rate: float | None  # tokens per second; None = unlimited
    burst: float
    daily_limit: int | None
    max_messages_per_connection: int
    connect_timeout: float
    command_timeout: float
    data_timeout: float
    ambiguous: str  # "retry" | "assume-delivered"
    circuit_failures: int
    circuit_cooldown: float
    slowdown_cooldown: float  # after a throttling reply, no rate increase for this long


@dataclass(frozen=True, slots=True)
class WarmupConf:
    start: dt.date
    schedule: tuple[int, ...] | None
    initial: int
    factor: float
    ceiling: int | None


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    daily_limit: int | None
    warmup: WarmupConf | None
    unsubscribe: UnsubscribeConf | None = (
        None  # RFC 8058 one-click (relay/authenticity/unsubscribe.py)
    )


@dataclass(frozen=True, slots=True)
class ShapingConf:
    window_tz: str
    window_length: float | None
    identity_by: str  # "sender_domain" | "sender"
    rules: tuple[ShapingRule, ...]  # the operator's, parsed (relay.delivery.shaping)


@dataclass(frozen=True, slots=True)
class LanesConf:
    rules: tuple[LaneRule, ...]  # parsed (relay.delivery.lanes)
    shares: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Delivery:
    workers: int
    batch: int
    poll_interval: float


@dataclass(frozen=True, slots=True)
class Webhook:
    url: str = field(repr=False)  # Slack, Teams, Google Chat: the URL is the secret
    secret: bytes | None = field(repr=False)  # read from secret_file; signs X-Relay-Signature
    secret_file: Path | None
    timeout: float


@dataclass(frozen=True, slots=True)
class Alerts:
    command: str | None
    timeout: float
    coalesce: float = 300.0  # events of one (event, key) within this window make one alert
    webhook: Webhook | None = None


@dataclass(frozen=True, slots=True)
class Health:
    disk_free_warning: float = 10.0  # percent of the spool's filesystem
    disk_free_critical: float = 5.0
    queue_age_warning: float = 1800.0
    queue_age_critical: float = 4 * 3600.0
    stall_after: float = 600.0
    # an upstream whose every attempt failed this long, no answer since: a warning
    failing_after: float = 300.0
    dead_letters_warning: int = 50  # dead letters in the last hour


@dataclass(frozen=True, slots=True)
class Local:
    """Bare local parts (`root`) from relay-sendmail and allow-listed clients: qualified with
    `domain`, then `aliases` (local name -> addresses, already qualified) applied."""

    domain: str
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def qualify(self, local: str) -> str:
        return f"{local}@{self.domain}"

    def expand(self, address: str) -> tuple[str, ...]:
        """The recipients an address stands for: its alias targets (recursively, at most
        8 levels, each once), or itself."""
        out: list[str] = []

        def walk(addr: str, depth: int) -> None:
            local, _at, domain = addr.rpartition("@")
            targets = (
                self.aliases.get(local.lower()) if domain.lower() == self.domain.lower() else None
            )
            if targets is None or depth >= 8:
                if addr.lower() not in (a.lower() for a in out):
                    out.append(addr)
                return
            for t in targets:
                walk(t, depth + 1)

        walk(address, 0)
        return tuple(out)


def parse_aliases(text: str, domain: str, key: str) -> dict[str, tuple[str, ...]]:
    """aliases(5): `name: addr, addr` per line, `#` comments, continuation lines starting
    with white space. Local names in targets are qualified with `domain`. Pipes, files and
    :include: are refused (a relay delivers no mail locally)."""
    from relay.mail.address import AddressError, check_local_part, check_mailbox

    entries: dict[str, tuple[str, ...]] = {}
    logical: list[tuple[int, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if line[0] in " \t" and logical:
            logical[-1] = (logical[-1][0], logical[-1][1] + " " + line.strip())
        else:
            logical.append((n, line))
    for n, line in logical:
        name, sep, rest = line.partition(":")
        name = name.strip().lower()
        if not sep or not name:
            raise ConfigError(f"{key}: line {n}: expected 'name: address, address'")
        targets: list[str] = []
        for t in (x.strip().strip("<>") for x in rest.split(",")):
            if not t:
                continue
            if t[0] in "|/" or t.startswith(":include:"):
                raise ConfigError(
                    f"{key}: line {n}: {t!r}: only addresses (no pipes, files or :include:)"
                )
            try:
                if "@" in t:
                    check_mailbox(t)
                else:
                    check_local_part(t)
                    t = f"{t}@{domain}"
            except AddressError as e:
                raise ConfigError(f"{key}: line {n}: {t!r}: {e}") from None
            targets.append(t)
        if not targets:
            raise ConfigError(f"{key}: line {n}: {name!r} has no address")
        entries[name] = tuple(targets)
    return entries


@dataclass(frozen=True, slots=True)
class FeedbackProvider:
    """One provider's webhook: HTTP basic auth whose password is `token`, plus the
    provider's own signature where it signs offline."""

    name: str
    token: str = field(repr=False)
    signing_key: bytes | None = field(default=None, repr=False)  # mailgun: HMAC key
    public_key: bytes | None = None  # sendgrid: the signed event webhook's ECDSA key
    # ses: check Amazon SNS's signature (relay/feedback/sns.py): the certificate hosts
    # allowed besides sns.<region>.amazonaws.com, and the CA bundle to fetch it with
    verify_signatures: bool = False
    signing_cert_hosts: tuple[str, ...] = ()
    signing_cert_ca_file: Path | None = None


@dataclass(frozen=True, slots=True)
class HttpBounds:
    """An HTTP listener's connection bounds (admin.*, feedback.*): past them a new connection
    gets 503 and is closed (relay/ops/http.py)."""

    max_connections: int = 256  # open at once, all clients together
    max_connections_per_ip: int = 32  # from one client IP (IPv6: one /64)


@dataclass(frozen=True, slots=True)
class FeedbackConf:
    listen: tuple[str, int] | None = None  # its own HTTP listener; None: admin.listen
    address: str | None = None  # bounces@relay.example.com: mail to it is feedback
    verp: bool = False
    verp_secret: bytes | None = field(default=None, repr=False)  # None: a key in the spool
    max_body: int = 1024 * 1024
    providers: Mapping[str, FeedbackProvider] = field(default_factory=dict)
    # storage bounds (relay/feedback/storage.py): octets kept of one feedback mail (the rest
    # cut off, noted on the row), and of all of them (oldest dropped first)
    mail_max_stored: int = 256 * 1024
    mail_budget: int = 64 * 1024 * 1024
    # mail to the feedback and unsubscribe addresses per client (IPv4, IPv6 /64) and window,
    # from clients outside every `allow` network (relay/inbound/anvil.py); 0 = no limit
    rate_per_ip: int = 20
    rate_window: float = 60.0
    http: HttpBounds = field(default_factory=HttpBounds)  # its own listener's, when it has one

    @property
    def local(self) -> str:
        return (self.address or "").rpartition("@")[0]

    @property
    def domain(self) -> str:
        return (self.address or "").rpartition("@")[2]


def _dkim(item: object, base: Path, errors: list[str]) -> dict[str, tuple[DkimKey, ...]]:
    """`dkim: {<domain>: {selector, key_file, algorithm?, headers?}}`, or a list of such
    mappings per domain (RSA and Ed25519 side by side, RFC 8463). Each key is read and
    checked now: a missing or unusable key is a config error (exit 78), never a surprise
    per message."""
    from relay.authenticity import dkim as dkim_sign

    if not isinstance(item, Mapping):
        raise ConfigError("dkim: expected a mapping of sending domains")
    keys: list[DkimKey] = []
    for domain, entries in item.items():
        listed = entries if isinstance(entries, list) else [entries]
        for i, entry in enumerate(listed):
            key = f"dkim.{_shown(str(domain))}" + (f"[{i}]" if isinstance(entries, list) else "")
            try:
                keys.append(_dkim_key(str(domain), entry, key, base))
            except ConfigError as e:  # each entry on its own: every bad one reported
                errors.append(str(e))
    try:
        return dkim_sign.by_domain(keys)
    except dkim_sign.DkimConfigError as e:
        raise ConfigError(str(e)) from None


def _dkim_key(domain: str, entry: object, key: str, base: Path) -> DkimKey:
    """One `dkim` entry: {selector, key_file, algorithm?, headers?}, its key loaded."""
    from relay.authenticity import dkim as dkim_sign

    r = _Reader(entry, key)
    selector = r.string("selector")
    path = r.path_("key_file", base)
    if path is None:
        raise ConfigError(f"{key}.key_file: required")
    algorithm = r.opt_str("algorithm") or "rsa-sha256"
    headers = r.get("headers")
    if headers is not None and (
        not isinstance(headers, list) or not all(isinstance(h, str) for h in headers)
    ):
        raise ConfigError(f"{key}.headers: expected a list of header names")
    r.finish()
    try:
        return dkim_sign.load_key(domain, selector, path, algorithm, headers)
    except dkim_sign.DkimConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def _feedback(fb: FeedbackSection) -> FeedbackConf:
    providers: dict[str, FeedbackProvider] = {}
    for name in FEEDBACK_PROVIDERS:
        p = getattr(fb.providers, name)
        if p is None:
            continue
        providers[name] = FeedbackProvider(
            name,
            p.token,
            p.signing_key if isinstance(p, MailgunProvider) else None,
            p.public_key if isinstance(p, SendgridProvider) else None,
            bool(p.verify_signatures) if isinstance(p, SesProvider) else False,
            p.signing_cert_hosts if isinstance(p, SesProvider) else (),
            p.signing_cert_ca_file if isinstance(p, SesProvider) else None,
        )
    return FeedbackConf(
        fb.listen,
        fb.address,
        fb.verp,
        fb.verp_secret,
        fb.max_body,
        providers,
        mail_max_stored=fb.mail_max_stored,
        mail_budget=fb.mail_budget,
        rate_per_ip=fb.rate_per_ip,
        rate_window=fb.rate_window,
        http=HttpBounds(fb.max_connections, fb.max_connections_per_ip),
    )


@dataclass(frozen=True, slots=True)
class Dsn:
    enabled: bool
    sender: str | None


@dataclass(frozen=True, slots=True)
class LogConf:
    level: str
    format: str
    unmask: bool


@dataclass(frozen=True, slots=True)
class PgSpool:
    """spool.backend: postgresql (relay/spool/pg.py)."""

    dsn: str = field(repr=False)  # may hold a password: shown only through pgdsn.redact
    password_file: Path | None = None


@dataclass(frozen=True, slots=True)
class FleetConf:
    """fleet: several relays on one PostgreSQL spool (README "Running a fleet")."""

    node: str | None = None  # this daemon's name in the fleet; None: <hostname>:<pid>
    lease: float = 30.0  # a claim's lease; renewed every lease/3 while the node runs


@dataclass(frozen=True, slots=True)
class OutboxConf:
    """outbox: the transactional outbox table on a PostgreSQL spool (relay/spool/outbox.py)."""

    enabled: bool = False
    poll_interval: float = 1.0
    batch: int = 100


@dataclass(frozen=True, slots=True)
class Config:
    path: Path | None
    hostname: str
    listen: tuple[Listener, ...]
    spool_path: Path
    inline_max: int
    dedup_window: float
    limits: Limits
    upstream: Upstream
    retry: Retry
    timeouts: Mapping[str, float]
    destinations: Mapping[str, Destination]
    identities: Mapping[str, Identity]
    shaping: ShapingConf
    lanes: LanesConf
    delivery: Delivery
    alerts: Alerts
    dsn: Dsn
    admin_listen: tuple[str, int] | None
    log: LogConf
    shutdown_timeout: float
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    auth: AuthLimits = field(default_factory=AuthLimits)
    local: Local = field(default_factory=lambda: Local(socket.getfqdn()))
    retention: float = 7 * 86400.0  # spool.retention: finished messages and their bodies
    # spool.reserve: free octets kept on the spool's filesystem; below it new mail gets
    # 452 4.3.1, so what is queued can still be claimed and delivered (relay/spool/reserve.py)
    spool_reserve: int = 64 * 1024 * 1024
    health: Health = field(default_factory=Health)
    routing: routing.Routing = field(default_factory=lambda: routing.Routing({}, ()))
    inbound_processes: int = 0  # inbound.processes: extra SMTP processes (inbound_proc.py)
    feedback: FeedbackConf = field(default_factory=FeedbackConf)
    dkim: Mapping[str, tuple[DkimKey, ...]] = field(default_factory=dict)  # by domain
    # spool.backend: postgresql: where the spool lives (None: SQLite under spool_path)
    spool_pg: PgSpool | None = None
    fleet: FleetConf = field(default_factory=lambda: FleetConf())
    outbox: OutboxConf = field(default_factory=lambda: OutboxConf())
    maildrop_path: Path | None = None  # spool.maildrop; None: <spool_path>/maildrop
    admin_http: HttpBounds = field(default_factory=HttpBounds)  # admin.max_connections...
    admin_console: bool = True  # admin.console: the operator console (relay/ops/console)
    admin_users_file: Path | None = None  # admin.users_file: the console's users
    hostname_set: bool = True  # False: `hostname` unset, the system's name (getfqdn) used

    def maildrop_dir(self) -> Path:
        """Where relay-sendmail leaves mail the daemon did not take (relay/spool/maildrop.py)."""
        return self.maildrop_path or self.spool_path / "maildrop"

    def warnings(self) -> list[str]:
        """Settings that work but are probably not what the operator wants (check-config
        prints them; the daemon logs them at start)."""
        out = []
        problem = hostname_problem(self.hostname)
        if problem is not None:
            where = "hostname" if self.hostname_set else "hostname (unset: the system's name)"
            out.append(
                f"{where}: {self.hostname!r} {problem}, not this host's fully-qualified domain"
                " name: set `hostname` in the config; it names the relay in Received headers and"
                " Message-IDs, in EHLO (upstream.helo), and qualifies bare senders and"
                " recipients (root -> root@<local.domain, else hostname>)"
            )
        if self.dedup_window < self.retry.max_age:
            out.append(
                f"dedup.window ({self.dedup_window:g}s) is shorter than retry.max_age"
                f" ({self.retry.max_age:g}s): an app that resubmits a message still being"
                " retried after the window gets it sent twice"
            )
        sg = self.feedback.providers.get("sendgrid")
        if sg is not None and sg.public_key is None:
            out.append(
                "feedback.providers.sendgrid: no public_key_file: events are checked by the"
                " basic-auth token only (enable SendGrid's Signed Event Webhook)"
            )
        ses = self.feedback.providers.get("ses")
        if ses is not None and not ses.verify_signatures:
            out.append(
                "feedback.providers.ses: verify_signatures is off: events are checked by the"
                " basic-auth token only (turn it on to check Amazon SNS's signatures)"
            )
        if self.feedback.providers and self.feedback.listen is None and self.admin_listen:
            host = self.admin_listen[0]
            if host not in ("127.0.0.1", "::1", "localhost"):
                out.append(
                    "feedback endpoints share admin.listen, which is not loopback: /metrics"
                    " and /health face the same network; set feedback.listen"
                )
        for keys in self.dkim.values():
            for k in keys:
                out.extend(f"dkim {k.selector}._domainkey.{k.domain}: {w}" for w in k.warnings)
        return out

    def destination(self, name: str) -> Destination:
        return self.destinations.get(name) or self.destinations["*"]

    def identity(self, name: str) -> Identity | None:
        return self.identities.get(name)

    def unsubscribe_confs(self) -> dict[str, UnsubscribeConf]:
        """Identity -> its one-click unsubscribe settings (only identities that have them)."""
        return {n: i.unsubscribe for n, i in self.identities.items() if i.unsubscribe}

    def redacted(self) -> dict[str, Any]:
        """The effective config as a plain mapping, secrets replaced (for check-config):
        secrets are only ever named by file, and every URL goes through the printing rules
        (README "Secrets"): a webhook URL shows its scheme and host only, any other URL loses
        its userinfo password and query values; a DSN its password."""
        out = copy.deepcopy(dict(self.raw))
        sh = out.get("upstream", {}).get("smarthost", {})
        if sh.get("password_file"):
            sh["password_file"] = f"{sh['password_file']} (set, contents not shown)"
        sp = out.get("spool", {})
        if isinstance(sp, dict) and isinstance(sp.get("dsn"), str):
            from relay.config.pgdsn import redact

            sp["dsn"] = redact(sp["dsn"])
        wh = out.get("alerts", {}).get("webhook")
        if isinstance(wh, dict) and isinstance(wh.get("url"), str):
            wh["url"] = redact_webhook_url(wh["url"])
        redacted: dict[str, Any] = _redact_urls(out)
        return redacted

    def secrets(self) -> dict[str, str]:
        """Every secret value this config holds -> what prints in its place; the log
        formatter replaces them in every line (relay.ops.logs.set_secrets), a second guard
        behind never logging them."""
        out: dict[str, str] = {}
        values: list[str | bytes | None] = [self.upstream.smarthost.password]
        for up in self.routing.upstreams.values():
            values.append(up.password)
            if up.oauth is not None:
                values += [up.oauth.client_secret, up.oauth.refresh_token]
        wh = self.alerts.webhook
        if wh is not None:
            values.append(wh.secret)
            shown = redact_webhook_url(wh.url)
            out[wh.url] = shown
            rest = wh.url.partition("://")[2]
            slash, tail = rest.partition("/")[1:]
            if slash and tail:  # the path alone, as a library might print it
                out["/" + tail] = "/***"
            for item in urlsplit(wh.url).query.split("&"):  # a token's value alone
                out[item.partition("=")[2]] = "***"
        values.append(self.feedback.verp_secret)
        for p in self.feedback.providers.values():
            values += [p.token, p.signing_key]
        for ident in self.identities.values():
            if ident.unsubscribe is not None:
                values.append(ident.unsubscribe.secret)
        if self.spool_pg is not None:
            from relay.config.pgdsn import dsn_passwords

            values += dsn_passwords(self.spool_pg.dsn)
            if self.spool_pg.password_file is not None:  # read at connect, by pg.py
                try:
                    values.append(self.spool_pg.password_file.read_text().rstrip("\r\n"))
                except OSError:
                    pass
        for v in values:
            if isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            if v:
                out[v] = "***"
        return out


def _redact_urls(node: Any) -> Any:
    """Every string in the tree that holds a URL, through relay.ops.logs.redact_text."""
    from relay.ops.logs import redact_text

    if isinstance(node, dict):
        return {k: _redact_urls(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_redact_urls(v) for v in node]
    if isinstance(node, str) and "://" in node:
        return redact_text(node)
    return node


def hostname_problem(name: str) -> str | None:
    """Why `name` is no name for this host on the Internet, or None. Other servers see it
    in EHLO (RFC 5321 §4.1.1.1 asks for the fully-qualified domain name), in Received
    headers and Message-IDs (RFC 5322 §3.6.4: a domain unique to this host); `localhost`
    (what getfqdn() gives when /etc/hosts names nothing better) or a bare label is neither."""
    n = name.strip().rstrip(".").lower()
    if n == "localhost" or n.startswith("localhost.") or n.endswith(".localhost"):
        return "is localhost"
    if "." not in n:
        return "has no dot"
    return None


# the sections still read by hand: their JSON Schema, in outline (relay.yaml's comments and
# the README say the rest)
_HAND_SCHEMAS: dict[str, dict[str, Any]] = {
    "upstreams": {"type": ["object", "null"]},
    "routes": {"type": ["array", "null"], "items": {"type": "object"}},
    "dkim": {"type": "object"},
}


def json_schema() -> dict[str, Any]:
    """The config file's JSON Schema (`relay config schema`), for editors: keys, types,
    defaults and descriptions; an unknown key is flagged as the loader would."""
    fields: dict[str, Any] = {}
    for name in dict.fromkeys([*DEFAULTS, "fleet", "outbox", "upstreams", "routes"]):
        default = DEFAULTS.get(name)
        if name in SECTIONS:
            fields[name] = (SECTIONS[name] | None, Field(default))
        elif name == "hostname":
            fields[name] = (types.OptStr, Field(default))
        elif name == "shutdown_timeout":
            fields[name] = (types.Duration, Field(default))
        elif name == "destinations":
            fields[name] = (dict[str, DestinationSection | None], Field(default))
        elif name == "listen":
            fields[name] = (list[ListenerSection], Field(default, min_length=1))
        elif name == "identities":
            fields[name] = (dict[str, IdentitySection], Field(default))
        else:
            schema = _HAND_SCHEMAS.get(name, {"type": ["object", "null"]})
            fields[name] = (Annotated[Any, WithJsonSchema(schema)], Field(default))
    model = create_model(
        "RelayConfig",
        __config__=ConfigDict(extra="forbid", title="relay.yaml"),
        __doc__="relay's config file (README: Configuration; CONTRACT.md: Config)",
        **fields,
    )
    out: dict[str, Any] = model.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **out}


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    p = Path(path or os.environ.get("RELAY_CONFIG") or DEFAULT_PATH)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        how = ""
        if not path and not os.environ.get("RELAY_CONFIG"):
            how = (
                " (no -c FILE given and $RELAY_CONFIG not set: point at a config with"
                " `-c FILE` or `RELAY_CONFIG=FILE`; `make run` uses conf/relay.yaml)"
            )
        raise ConfigError(f"config: cannot read {p}: {e.strerror or e}{how}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config: {where} is not valid YAML: {problem}") from None
    return from_mapping(data or {}, p.resolve().parent, path=p.resolve())


def from_mapping(data: object, base_dir: Path, path: Path | None = None) -> Config:
    """The config tree, or one ConfigError listing every error of the file (one a line).

    The sections on the library (relay/config/models.py) are validated once each, every
    error at once; a section with errors gets its defaults so that the rest can be read.
    The sections still read by hand (`_from_mapping`) report one error at a time: after an
    error the offending key is set aside (its default applies) and they are read again.
    """
    # a NUL reaches no file name, host or header: os and socket calls raise ValueError on it
    nul = [f"{k}: a NUL character is not allowed in a config value" for k in _nul_keys(data)]
    if nul:
        raise ConfigError("\n".join(nul))
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping at the top, got {_kind(data)}")
    errors: list[str] = []
    merged = _merge(DEFAULTS, data)
    typed = _sections(merged, base_dir, errors)
    destinations = _destinations(
        {"*": {}, **data["destinations"]}
        if isinstance(data.get("destinations"), Mapping)
        else merged["destinations"],
        typed.timeouts.model_dump(),
        errors,
    )
    identities = _identities(merged["identities"], base_dir, errors)
    listeners = _listeners(
        merged["listen"], base_dir, errors, fleet=typed.spool.backend != "sqlite"
    )
    config = _from_mapping(data, base_dir, path, typed, destinations, identities, listeners, errors)
    if errors:
        errors.sort(key=_place)
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    return config


# the order errors are listed in: the order the file is read in (sections, then unknown keys)
_SECTION_ORDER = (
    *("config", "hostname", "listen", "spool", "fleet", "outbox", "dedup", "limits", "auth"),
    *("upstream", "upstreams", "routes", "retry", "timeouts", "destinations", "identities"),
    *("shaping", "lanes", "delivery", "alerts", "health", "dsn", "local", "admin", "feedback"),
    *("dkim", "log", "shutdown_timeout", "inbound"),
)


def _place(msg: str) -> int:
    """Where an error is listed: its section's place in _SECTION_ORDER (unknown keys last)."""
    section = re.split(r"[.\[:]", msg, maxsplit=1)[0]
    return _SECTION_ORDER.index(section) if section in _SECTION_ORDER else len(_SECTION_ORDER)


def _sections(merged: Mapping[str, Any], base_dir: Path, errors: list[str]) -> Sections:
    """Each section on the library validated once; its errors (all of them) appended."""
    out: dict[str, Section] = {}
    for name, model in SECTIONS.items():
        value = merged.get(name)
        try:
            out[name] = model.model_validate(
                {} if value is None else value, context={"base": base_dir}
            )
        except ValidationError as e:
            errors.extend(_messages(e, model, name))
            out[name] = model()
    return Sections(**out)  # type: ignore[arg-type]


def _messages(e: ValidationError, model: type[BaseModel], prefix: str) -> list[str]:
    """pydantic's errors in the contract's words: `key.path: problem`. A key left out whose
    place an unknown key that looks like it takes is reported as that misspelling."""
    errs = e.errors()
    extras = {
        (err["loc"][:-1], str(err["loc"][-1])) for err in errs if err["type"] == "extra_forbidden"
    }
    misspelt: dict[tuple[Any, ...], str] = {}  # the unknown key's loc -> the key it stands for
    for err in errs:
        *parent, name = err["loc"] or ("",)
        if err["type"] == types.ERROR_TYPE and err["input"] is None and isinstance(name, str):
            others = [x for p, x in extras if p == tuple(parent)]
            close = difflib.get_close_matches(name, others, n=1, cutoff=0.6)
            if close:
                misspelt[(*parent, close[0])] = name
    out = []
    for err in errs:
        loc = err["loc"]
        key = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{_shown(p)}" for p in loc)
        kind = err["type"]
        ctx = err.get("ctx") or {}
        if kind == types.ERROR_TYPE:
            *parent, name = loc or ("",)
            if any(at[:-1] == tuple(parent) and meant == name for at, meant in misspelt.items()):
                continue  # reported as the misspelling
            if "key" in ctx:
                key = f"{key}.{ctx['key']}"
            out.append(ctx["msg"] if ctx.get("full") else f"{key}: {ctx['msg']}")
        elif kind == "extra_forbidden":
            name = str(loc[-1])
            if loc in misspelt:
                out.append(f"{key}: unknown key {name!r} (did you mean {misspelt[loc]!r}?)")
            else:
                at = _model_at(model, loc[:-1])
                hook = getattr(at, "unknown_key", None)  # a section's own wording
                if hook is not None:
                    out.append(f"{key}: {hook(name)}")
                else:
                    out.append(_unknown_key(key, name, _fields(at)))
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            out.append(f"{key}: expected a mapping, got {_kind(err['input'])}")
        else:  # not expected: every relay type words its own errors
            out.append(f"{key}: {err['msg']}")
    return out


def _shown(name: str) -> str:
    """A key from the file as an error shows it: escaped, since a control character in an
    unknown key must not break the one-error-a-line message (str.splitlines splits on
    \x1c-\x1e too)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def _model_at(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The section model at `loc` below `model` (for the keys an unknown key may mean)."""
    for part in loc:
        f = model.model_fields.get(str(part)) if model is not None else None
        if f is None:
            return None
        kinds = [f.annotation, *get_args(f.annotation)]
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    return model


def _fields(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return sorted(f.alias or n for n, f in model.model_fields.items())


def _unknown_key(key: str, name: str, known: list[str]) -> str:
    """`key: unknown key 'name'`, with the known key it looks like; a password is never
    inline (README "Secrets")."""
    if name == "password" or name.endswith("_password"):
        return (
            f"{key}: unknown key: secrets are never inline; put"
            " it in a file and name the file with 'password_file'"
        )
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key}: unknown key {name!r}{hint}"


def _nul_keys(node: object, key: str = "") -> list[str]:
    """The keys whose value (or name) holds a NUL character."""
    if isinstance(node, str):
        return [key or "config"] if "\x00" in node else []
    out: list[str] = []
    if isinstance(node, Mapping):
        for k, v in node.items():
            sub = f"{key}.{_shown(str(k))}" if key else _shown(str(k))
            out += _nul_keys(k, sub) + _nul_keys(v, sub)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _nul_keys(v, f"{key}[{i}]")
    return out


def _from_mapping(
    data: object,
    base_dir: Path,
    path: Path | None,
    typed: Sections,
    destinations: dict[str, Destination],
    identities: dict[str, Identity],
    listeners: tuple[Listener, ...],
    errors: list[str],
) -> Config:
    """The Config from the validated sections and the parts read here (hostname, routes,
    local, dkim, shutdown_timeout, unknown top-level keys); each part's error appended to
    `errors` and a default used in its place, so that one pass finds every error."""

    def attempt(read: Callable[[], _T], fallback: _T) -> _T:
        try:
            return read()
        except ConfigError as e:
            errors.append(str(e))
            return fallback

    assert isinstance(data, Mapping)  # from_mapping checked
    merged: dict[str, Any] = _merge(DEFAULTS, data)
    if "destinations" in data and isinstance(data["destinations"], Mapping):
        merged["destinations"] = {"*": {}, **dict(data["destinations"])}
    top = _Reader(merged, "")

    given_name = attempt(lambda: top.opt_str("hostname"), None)
    hostname = given_name or socket.getfqdn()
    hostname_set = bool(given_name)

    top.get("listen")  # read by _listeners

    sp = typed.spool
    spool_path = sp.path or base_dir  # never None: its model requires it
    inline_max = sp.inline_max
    retention = sp.retention
    spool_reserve = sp.reserve
    spool_pg = None if sp.backend == "sqlite" else PgSpool(sp.dsn or "", sp.password_file)
    maildrop_path = sp.maildrop or spool_path / "maildrop"
    fleet = FleetConf(node=typed.fleet.node or None, lease=typed.fleet.lease or 30.0)
    ob = typed.outbox
    outbox = OutboxConf(
        enabled=bool(ob.enabled), poll_interval=ob.poll_interval or 1.0, batch=ob.batch or 100
    )
    if outbox.enabled and spool_pg is None:
        raise ConfigError(
            "outbox.enabled: the outbox is a table of a PostgreSQL spool"
            " (spool.backend: postgresql)"
        )

    # the sections on the library (relay/config/models.py), validated by from_mapping
    for name in SECTIONS:
        top.get(name)
    dedup_window = typed.dedup.window
    limits = Limits(**typed.limits.model_dump())
    auth_limits = AuthLimits(**typed.auth.model_dump())

    up = typed.upstream
    smh, mx = up.smarthost, up.mx
    upstream = Upstream(
        mode=up.mode,
        helo=up.helo or hostname,
        smarthost=Smarthost(
            host=smh.host,
            port=smh.port,
            tls=smh.tls,
            verify=smh.verify,
            ca_file=smh.ca_file,
            username=smh.username,
            password_file=smh.password_file,
            password=smh.password,
        ),
        mx=MxMode(
            port=mx.port,
            tls=mx.tls,
            verify=mx.verify,
            nameservers=mx.nameservers,
            dns_timeout=mx.dns_timeout,
            mta_sts=mx.mta_sts,
            ca_file=mx.ca_file,
            mta_sts_port=mx.mta_sts_port,
        ),
    )
    smart = upstream.smarthost

    def routes() -> routing.Routing:
        try:
            return routing.parse(
                top.get("upstreams"),
                top.get("routes"),
                mode=upstream.mode,
                smarthost=routing.UpstreamHost(
                    name="smarthost",
                    host=smart.host,
                    port=smart.port,
                    tls=smart.tls,
                    verify=smart.verify,
                    ca_file=smart.ca_file,
                    username=smart.username,
                    password=smart.password,
                ),
                base=base_dir,
                read_secret=_read_secret,
            )
        except routing.RouteConfigError as e:
            raise ConfigError(str(e)) from None

    route_table = attempt(routes, routing.Routing({}, ()))

    retry = Retry(**typed.retry.model_dump())
    timeouts = typed.timeouts.model_dump()

    top.get("destinations")  # read by _destinations

    top.get("identities")  # read by _identities

    sg = typed.shaping
    shaping = ShapingConf(
        window_tz=sg.window_tz,
        window_length=sg.window_length,
        identity_by=sg.identity_by,
        rules=tuple(sg.rules or ()),
    )
    lanes = LanesConf(
        rules=typed.lanes.rules,
        shares={"transactional": typed.lanes.transactional.share, "bulk": typed.lanes.bulk.share},
    )

    delivery = Delivery(**typed.delivery.model_dump())

    al = typed.alerts
    wh = al.webhook
    alerts = Alerts(
        command=al.command,
        timeout=al.timeout,
        coalesce=al.coalesce,
        webhook=None
        if wh is None
        else Webhook(
            url=wh.url,
            secret=wh.secret,
            secret_file=wh.secret_file,
            timeout=10.0 if wh.timeout is None else wh.timeout,
        ),
    )

    health = Health(**typed.health.model_dump())
    dsn = Dsn(**typed.dsn.model_dump())

    top.get("local")
    local = attempt(lambda: _local(typed.local, hostname, base_dir), Local(hostname or "localhost"))

    admin = typed.admin
    admin_console, admin_users_file = admin.console, admin.users_file
    admin_listen = admin.listen
    admin_http = HttpBounds(
        max_connections=admin.max_connections,
        max_connections_per_ip=admin.max_connections_per_ip,
    )

    feedback = _feedback(typed.feedback)
    no_keys: dict[str, tuple[DkimKey, ...]] = {}
    dkim_keys = attempt(lambda: _dkim(top.get("dkim"), base_dir, errors), no_keys)

    log = LogConf(**typed.log.model_dump())

    shutdown_timeout = attempt(lambda: top.duration("shutdown_timeout"), 30.0)
    inbound_processes = auto_inbound_processes(typed.inbound.processes)
    for name in top.data:  # every unknown key, not the first
        if name not in top.used:
            errors.append(_unknown_key(_shown(str(name)), str(name), sorted(top.used)))

    return Config(
        path=path,
        hostname=hostname,
        hostname_set=hostname_set,
        listen=listeners,
        spool_path=spool_path,
        # on PostgreSQL every body lives in its row: the nodes of a fleet share no disk
        inline_max=inline_max if spool_pg is None else max(inline_max, limits.max_message_size),
        dedup_window=dedup_window,
        limits=limits,
        upstream=upstream,
        retry=retry,
        timeouts=timeouts,
        destinations=destinations,
        identities=identities,
        shaping=shaping,
        lanes=lanes,
        delivery=delivery,
        alerts=alerts,
        dsn=dsn,
        admin_listen=admin_listen,
        admin_http=admin_http,
        admin_console=admin_console,
        admin_users_file=admin_users_file,
        log=log,
        shutdown_timeout=shutdown_timeout,
        raw=merged,
        auth=auth_limits,
        local=local,
        retention=retention,
        spool_reserve=spool_reserve,
        health=health,
        routing=route_table,
        feedback=feedback,
        dkim=dkim_keys,
        spool_pg=spool_pg,
        fleet=fleet,
        outbox=outbox,
        inbound_processes=inbound_processes,
        maildrop_path=maildrop_path,
    )


def _local(lo: LocalSection, hostname: str, base_dir: Path) -> Local:
    """local: the domain bare local parts are qualified with, and the aliases (a mapping,
    or an aliases(5) file)."""
    local_domain = lo.domain or hostname
    if not _domain_ok(local_domain):
        raise ConfigError(f"local.domain: {local_domain!r} is not a domain")
    raw_aliases = lo.aliases
    if isinstance(raw_aliases, str):  # an aliases(5) file
        apath = _keyed(lambda v: _aliases_path(v, base_dir), raw_aliases, "local.aliases")
        try:
            atext = apath.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"local.aliases: cannot read {apath}: {e.strerror or e}") from None
        aliases = parse_aliases(atext, local_domain, f"local.aliases ({apath})")
    elif isinstance(raw_aliases, Mapping):
        lines = []
        for k, v in raw_aliases.items():
            vals = v if isinstance(v, list) else [v]
            if not all(isinstance(x, str) for x in vals):
                raise ConfigError(f"local.aliases.{k}: expected an address or a list of them")
            lines.append(f"{k}: {', '.join(vals)}")
        aliases = parse_aliases("\n".join(lines), local_domain, "local.aliases")
    else:
        raise ConfigError("local.aliases: expected a mapping or a file name")
    return Local(local_domain, aliases)


def _aliases_path(value: str, base_dir: Path) -> Path:
    from pydantic import TypeAdapter

    try:
        out = TypeAdapter(types.OptPath).validate_python(value, context={"base": base_dir})
    except ValidationError as e:
        raise ValueError(e.errors()[0]["ctx"]["msg"]) from None
    assert out is not None
    return Path(out)


def _listeners(
    raw: object, base_dir: Path, errors: list[str], *, fleet: bool = False
) -> tuple[Listener, ...]:
    """`listen`: each listener validated once (its certificate and users file read).
    `fleet` (a PostgreSQL spool): a listener without `namespace` is in the fleet's one
    namespace (FLEET_NAMESPACE) instead of its own address's."""
    if not isinstance(raw, list) or not raw:
        errors.append("listen: expected a non-empty list of listeners")
        return ()
    out = []
    for i, item in enumerate(raw):
        key = f"listen[{i}]"
        if item is None:
            item = {}
        try:
            m = ListenerSection.model_validate(item, context={"base": base_dir, "key": key})
        except ValidationError as e:
            errors.extend(_messages(e, ListenerSection, key))
            continue
        host, port = types.hostport(m.address)
        tls, auth = m.tls, m.auth
        out.append(
            Listener(
                name=m.address,
                namespace=m.namespace or (FLEET_NAMESPACE if fleet else m.address),
                host=host,
                port=port,
                allow=m.allow,
                lane=m.lane,
                tls=None
                if tls is None
                else ListenerTLS(
                    cert_file=tls.cert_file,  # type: ignore[arg-type]
                    key_file=tls.key_file,  # type: ignore[arg-type]
                    context=tls.context,
                    mode=tls.mode,
                ),
                require_tls=bool(m.require_tls),
                auth=None
                if auth is None
                else ListenerAuth(
                    users_file=auth.users_file,  # type: ignore[arg-type]
                    allow_plaintext=bool(auth.allow_plaintext),
                    users=auth.users,
                ),
            )
        )
    return tuple(out)


def _destinations(
    raw: object, timeouts: Mapping[str, float], errors: list[str]
) -> dict[str, Destination]:
    """`destinations`: "*" and each named one (which inherits every key it does not set from
    "*"), each validated once; errors appended."""
    if not isinstance(raw, Mapping):
        errors.append("destinations: expected a mapping")
        raw = {}
    star_raw = raw.get("*") or {}
    star = _destination("*", star_raw, {}, timeouts, errors)
    default = _destination("*", {}, {}, timeouts, [])
    assert default is not None  # the defaults are valid
    out = {"*": star or default}
    inherited = star_raw if star is not None else {}  # a bad "*" is reported once
    for name, d in raw.items():
        if name != "*":
            dest = _destination(str(name), d or {}, inherited, timeouts, errors)
            out[str(name).lower()] = dest or out["*"]
    return out


def _destination(
    name: str,
    data: object,
    star: Mapping[str, Any],
    timeouts: Mapping[str, float],
    errors: list[str],
) -> Destination | None:
    key = f"destinations.{name}" if re.fullmatch(r"[\w.-]+", name) else f'destinations."{name}"'
    if not isinstance(data, Mapping):
        errors.append(f"{key}: expected a mapping")
        return None
    try:
        d = DestinationSection.model_validate({**star, **data})
    except ValidationError as e:
        errors.extend(_messages(e, DestinationSection, key))
        return None
    rate = d.rate
    return Destination(
        name=name.lower(),
        max_connections=d.max_connections,
        rate=rate,
        burst=d.burst if d.burst is not None else (max(1.0, rate) if rate else 1.0),
        daily_limit=d.daily_limit,
        max_messages_per_connection=d.max_messages_per_connection,
        connect_timeout=d.connect_timeout or timeouts["connect"],
        command_timeout=d.command_timeout or timeouts["command"],
        data_timeout=d.data_timeout or timeouts["data"],
        ambiguous=d.ambiguous,
        circuit_failures=d.circuit_failures,
        circuit_cooldown=d.circuit_cooldown,
        slowdown_cooldown=d.slowdown_cooldown,
    )


def _identities(raw: object, base_dir: Path, errors: list[str]) -> dict[str, Identity]:
    """`identities`: each validated once (its secret files read); errors appended."""
    if not isinstance(raw, Mapping):
        errors.append("identities: expected a mapping")
        return {}
    out = {}
    for name, data in raw.items():
        key = f"identities.{_shown(str(name))}"
        if not isinstance(data, Mapping):
            errors.append(f"{key}: expected a mapping")
            continue
        try:
            ident = IdentitySection.model_validate(data, context={"base": base_dir})
        except ValidationError as e:
            errors.extend(_messages(e, IdentitySection, key))
            continue
        w, u = ident.warmup, ident.unsubscribe
        out[str(name).lower()] = Identity(
            name=str(name).lower(),
            daily_limit=ident.daily_limit,
            warmup=None
            if w is None
            else WarmupConf(w.start, w.schedule, w.initial, w.factor, w.ceiling),
            unsubscribe=None if u is None else UnsubscribeConf(u.url, u.mailto, u.secret),
        )
    return out
