"""The typed, frozen configuration tree the rest of the code reads: `Config` and its parts
(Limits, Upstream, Destination, FeedbackConf...), built once from the validated sections
(relay/config/build.py) and never changed; SIGHUP builds a new one.

Rules:
- Records are frozen dataclasses; a secret is a field with `repr=False` and never appears in
  `redacted()` output; `secrets()` lists every secret value for the log formatter.
- Defaults live in the section models (relay/config/sections/); a default here only serves
  code that builds a record by hand (tests).
"""

from __future__ import annotations

import copy
import datetime as dt
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from relay.config import redact
from relay.config.routes import Routing
from relay.config.rules import LaneRule, ShapingRule
from relay.config.sections.base import MAX_HEADER_SIZE

if TYPE_CHECKING:  # dkimpy, dnspython, cryptography and ssl load only when a key or TLS does
    import ssl

    from relay.authenticity.dkim import DkimKey


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
    # the dedup namespace of unauthenticated clients: `namespace:`, by default the name;
    # listeners of a fleet that take the same clients share one (README, fleet)
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


UNSUBSCRIBE_MIN_SECRET = 16  # bytes of an unsubscribe key (relay/authenticity/unsubscribe.py)


@dataclass(frozen=True, slots=True)
class UnsubscribeConf:
    """identities.<name>.unsubscribe: RFC 8058 one-click (relay/authenticity/unsubscribe.py)."""

    url: str | None  # https://relay.example.com/u: the relay serves POST/GET <path>/<TOKEN>
    mailto: str | None  # unsubscribe@relay.example.com
    secret: bytes = field(
        repr=False
    )  # the HMAC key (secret_file), UNSUBSCRIBE_MIN_SECRET bytes or more


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
    rules: tuple[ShapingRule, ...]  # the operator's, parsed (relay/config/rules.py)


@dataclass(frozen=True, slots=True)
class LanesConf:
    rules: tuple[LaneRule, ...]  # parsed (relay/config/rules.py)
    shares: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Delivery:
    workers: int
    batch: int
    poll_interval: float
    gather: float  # seconds (relay/delivery/engine.py: the run loop)


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

    dsn: str = field(repr=False)  # may hold a password: shown only through redact_dsn
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
    # spool.gather: after a batch of several jobs, a batch an accept opens waits this long
    # for more accepts before its commit, on either backend (relay/spool/writer.py)
    spool_gather: float = 0.003
    health: Health = field(default_factory=Health)
    routing: Routing = field(default_factory=lambda: Routing({}, ()))
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
            sp["dsn"] = redact.redact_dsn(sp["dsn"])
        wh = out.get("alerts", {}).get("webhook")
        if isinstance(wh, dict) and isinstance(wh.get("url"), str):
            wh["url"] = redact.redact_webhook_url(wh["url"])
        redacted: dict[str, Any] = redact.redact_tree(out, redact.secret_pairs(self.secrets()))
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
            shown = redact.redact_webhook_url(wh.url)
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
            values += redact.dsn_passwords(self.spool_pg.dsn)
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
