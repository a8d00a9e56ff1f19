"""One pydantic model per config section: the keys, their types (relay/config/values.py) and
defaults, the checks between keys of a section, and the frozen dataclass of relay/config/tree.py
each section builds (callers keep reading `config.limits.max_header_size`).

A model's defaults are written as in relay.yaml (`"7d"`, `"1MiB"`): they are what
`relay config schema` shows and what relay/config/tree.py's DEFAULTS holds for the section, and
they are validated like any value (`validate_default`). Sections not listed in SECTIONS are
still read by hand in relay/config/tree.py (`_from_mapping`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from relay.config import values as t
from relay.config.values import DURATION_SCHEMA

# limits.max_header_size: at most what the spool keeps in memory as a message's header block
# (relay/spool/incoming.py HEAD_MAX); at least a few ordinary headers' worth
MAX_HEADER_SIZE = 1 << 20
MIN_HEADER_SIZE = 1 << 10


class Section(BaseModel):
    """A config section: unknown keys are errors, values frozen, defaults validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    _hidden: ClassVar[tuple[str, ...]] = ()  # keys relay.yaml does not show

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The section's keys and defaults as written in relay.yaml (by alias)."""
        out = {f.alias or n: f.default for n, f in cls.model_fields.items() if n not in cls._hidden}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


class DedupSection(Section):
    window: t.Duration = Field("7d", description="how long a Message-ID is remembered")


class LimitsSection(Section):
    max_message_size: t.Size = "25MiB"
    max_recipients: t.Int(1) = 1000  # type: ignore[valid-type]
    session_timeout: t.Duration = "300s"
    # accepted; over 998 octets re-encoded (relay/inbound/longlines.py)
    max_line_length: t.Int(78) = 65536  # type: ignore[valid-type]
    max_command_length: t.Int(512) = 512  # type: ignore[valid-type]
    max_header_size: t.Size = "1MiB"
    max_connections: t.Int(1) = 500  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 50  # type: ignore[valid-type]
    max_connections_per_ip_allowed: t.Int(1) = 500  # type: ignore[valid-type]
    allowed_reserve: t.Int(0) = 50  # type: ignore[valid-type]
    max_errors: t.Int(0) = 10  # type: ignore[valid-type]
    command_timeout: t.Duration = "60s"
    min_data_rate: t.Size = 500  # bytes/s during DATA (0 = off)
    min_data_rate_window: t.Duration = "30s"

    @model_validator(mode="after")
    def _between_keys(self) -> LimitsSection:
        if self.allowed_reserve >= self.max_connections:
            raise t.problem(
                f"{self.allowed_reserve} must be below limits.max_connections"
                f" ({self.max_connections})",
                "allowed_reserve",
            )
        if not MIN_HEADER_SIZE <= self.max_header_size <= MAX_HEADER_SIZE:
            raise t.problem(
                f"{self.max_header_size} must be between {MIN_HEADER_SIZE} (1KiB) and"
                f" {MAX_HEADER_SIZE} (1MiB)",
                "max_header_size",
            )
        if self.command_timeout <= 0:
            raise t.problem("must be more than 0", "command_timeout")
        if self.min_data_rate and self.min_data_rate_window <= 0:
            raise t.problem("must be more than 0", "min_data_rate_window")
        return self


class AuthSection(Section):
    max_parallel: t.Int(1) = 2  # type: ignore[valid-type]
    max_pending: t.Int(0) = 100  # type: ignore[valid-type]
    failure_delay: t.Duration = "0.5s"
    max_failure_delay: t.Duration = "8s"
    max_failures_per_ip: t.Int(0) = 10  # type: ignore[valid-type]
    failure_window: t.Duration = "10m"
    ban_time: t.Duration = "10m"


def _nonempty_list(value: object) -> object:
    if not isinstance(value, list | tuple) or not value:  # a tuple: the default
        raise t.problem("expected a non-empty list of durations")
    return value


class RetrySection(Section):
    schedule: Annotated[
        tuple[t.Duration, ...],
        # a check before the items': the contract's wording for "not a list"
        BeforeValidator(_nonempty_list),
        Field(json_schema_extra={"minItems": 1}),
    ] = ("1m", "5m", "30m", "2h")
    max_age: t.Duration = "5d"
    min_delay: t.Duration = "1s"
    warn_after: t.Duration = "4h"


class TimeoutsSection(Section):
    connect: t.Duration = "10s"
    command: t.Duration = "30s"
    data: t.Duration = "120s"


class DeliverySection(Section):
    workers: t.Int(1) = 50  # type: ignore[valid-type]
    batch: t.Int(1) = 200  # type: ignore[valid-type]
    poll_interval: t.Duration = "0.25s"


class HealthSection(Section):
    disk_free_warning: t.Percent = "10%"
    disk_free_critical: t.Percent = "5%"
    queue_age_warning: t.Duration = "30m"
    queue_age_critical: t.Duration = "4h"
    stall_after: t.Duration = "10m"
    # an upstream whose every attempt failed this long, no answer since: a warning
    failing_after: t.Duration = "5m"
    dead_letters_warning: t.Int(1) = 50  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _between_keys(self) -> HealthSection:
        if self.disk_free_critical > self.disk_free_warning:
            raise t.problem("must not be above health.disk_free_warning", "disk_free_critical")
        if self.queue_age_critical < self.queue_age_warning:
            raise t.problem("must not be below health.queue_age_warning", "queue_age_critical")
        return self


class DsnSection(Section):
    enabled: t.Bool = False
    sender: t.OptStr = Field(None, alias="from")


class LogSection(Section):
    level: t.Choice("debug", "info", "warning", "error") = "info"  # type: ignore[valid-type]
    format: t.Choice("json", "text") = "json"  # type: ignore[valid-type]
    unmask: t.Bool = False


def _at_most_64(value: int) -> int:
    if value > 64:
        raise t.problem("at most 64")
    return value


def _processes(value: object) -> int | str:
    """inbound.processes: `auto` (relay/config/tree.py picks from the machine's cores) or 0-64."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected auto or a whole number, got {t.kind(value)}")
    return _at_most_64(t.integer(value))


Processes = t._type(
    int | str,
    _processes,
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 64}, {"const": "auto"}]},
)


class InboundSection(Section):
    # extra processes that take SMTP on the same ports and spool (relay/inbound/processes.py);
    # auto: one on a machine with two or more cores, none on one (relay/config/tree.py)
    processes: Processes = "auto"  # type: ignore[valid-type]


class AdminSection(Section):
    # each HTTP listener's connection bounds (relay/ops/http.py)
    listen: t.OptHostPort = "127.0.0.1:9025"
    max_connections: t.Int(1) = 256  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 32  # type: ignore[valid-type]
    console: t.Bool = True  # relay/ops/console: on a non-loopback listen it needs users_file
    users_file: Annotated[t.OptPath, BeforeValidator(lambda v: v or None)] = None

    @model_validator(mode="after")
    def _console_access(self) -> AdminSection:
        """The console is open (read-only, no login) only on a loopback listener; elsewhere
        it needs users (relay/ops/console/auth.py)."""
        from relay.ops.console.auth import UsersFileError, load_users

        if self.users_file is not None:
            try:
                load_users(self.users_file)
            except UsersFileError as e:
                raise t.problem(str(e), "users_file") from None
        if self.console and self.listen is not None and self.users_file is None:
            host = self.listen[0]
            try:
                loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback:
                raise t.problem(
                    f"admin.listen {host} is not loopback: the console there needs"
                    " admin.users_file (`relay admin passwd NAME --role operator`), or set"
                    " admin.console: false",
                    full=True,
                )
        return self


def _http_url(url: str) -> str:
    from relay.ops.logs import redact_webhook_url  # the URL is the secret: never print it whole

    if not url.startswith(("http://", "https://")):
        raise t.problem(f"{redact_webhook_url(url)!r} is not an http:// or https:// URL")
    return url


class WebhookSection(Section):
    """alerts.webhook: Slack, Teams, Google Chat or any JSON endpoint (relay/ops/alerts.py)."""

    # required: no default but None, so that a missing url is worded like any bad value
    url: Annotated[t.Str, AfterValidator(_http_url)] = Field(None, repr=False)
    secret_file: t.OptPath = None  # signs X-Relay-Signature; read when the config loads
    timeout: t.OptDuration = None  # None: 10s
    _secret: bytes | None = PrivateAttr(None)  # the file's contents (never in repr)

    @model_validator(mode="after")
    def _read_secret(self) -> WebhookSection:
        if self.secret_file is not None:
            try:
                self._secret = self.secret_file.read_bytes().strip()
            except OSError as e:
                msg = f"cannot read {self.secret_file}: {e.strerror or e}"
                raise t.problem(msg, "secret_file") from None
            if not self._secret:
                raise t.problem(f"{self.secret_file} is empty", "secret_file")
        return self

    @property
    def secret(self) -> bytes | None:
        return self._secret


class AlertsSection(Section):
    command: t.OptStr = None
    timeout: t.Duration = "10s"
    coalesce: t.Duration = "5m"
    webhook: WebhookSection | None = None


class FleetSection(Section):
    """fleet: several relays on one PostgreSQL spool (README "Running a fleet")."""

    node: t.OptStr = None
    lease: t.OptDuration = None  # None: 30s

    @model_validator(mode="after")
    def _renewable(self) -> FleetSection:
        if (self.lease or 30.0) < 3:
            raise t.problem("at least 3s (it is renewed every lease/3)", "lease")
        return self


class OutboxSection(Section):
    """outbox: the transactional outbox table on a PostgreSQL spool (relay/spool/outbox.py)."""

    enabled: t.OptBool = None
    poll_interval: t.OptDuration = None  # None (or 0): 1s
    batch: t.OptInt(1) = None  # type: ignore[valid-type]


def _burst(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1:
        return float(value)
    raise t.problem("expected a number >= 1")


class DestinationSection(Section):
    """One entry of `destinations` ("*" and each named one; a named one inherits every key
    it does not set from "*")."""

    max_connections: t.Int(1) = 10  # type: ignore[valid-type]
    rate: t.Rate = "50/s"
    burst: Annotated[
        float | None,
        PlainValidator(_burst),
        WithJsonSchema({"type": ["number", "null"], "minimum": 1}),
    ] = None
    daily_limit: t.OptInt(0) = None  # type: ignore[valid-type]
    max_messages_per_connection: t.Int(1) = 100  # type: ignore[valid-type]
    connect_timeout: t.OptDuration = None  # None: timeouts.*
    command_timeout: t.OptDuration = None
    data_timeout: t.OptDuration = None
    ambiguous: t.Choice("retry", "assume-delivered") = "retry"  # type: ignore[valid-type]
    circuit_failures: t.Int(1) = 5  # type: ignore[valid-type]
    circuit_cooldown: t.Duration = "60s"
    slowdown_cooldown: t.Duration = "60s"


def _readable(path: Path | None) -> Path | None:
    if path is not None and not os.access(path, os.R_OK):
        raise t.problem(f"cannot read {path}")
    return path


ReadablePath = Annotated[t.OptPath, AfterValidator(_readable)]


class SpoolSection(Section):
    _hidden = ("dsn", "password_file")  # not shown in relay.yaml (README: PostgreSQL)

    path: t.OptPath = "../var/spool"  # type: ignore[assignment]
    inline_max: t.Size = "128KiB"
    retention: t.Duration = "7d"
    backend: t.Choice("sqlite", "postgresql") = "sqlite"  # type: ignore[valid-type]
    maildrop: t.OptPath = None  # None: <spool.path>/maildrop (relay/spool/maildrop.py)
    reserve: t.Size = "64MiB"
    dsn: t.OptStr = Field(None, repr=False)  # may hold a password
    password_file: t.OptPath = None

    @model_validator(mode="after")
    def _backend(self) -> SpoolSection:
        if self.path is None:
            raise t.problem("required", "path")
        if self.backend == "sqlite":
            if self.dsn is not None or self.password_file is not None:
                raise t.problem("only with spool.backend: postgresql", "dsn")
            return self
        if not self.dsn:
            raise t.problem("required with spool.backend: postgresql", "dsn")
        if not self.dsn.startswith(("postgresql://", "postgres://")) and "=" not in self.dsn:
            raise t.problem("expected a libpq URL (postgresql://...) or key=value list", "dsn")
        try:
            _check_dsn_port(self.dsn)
        except ValueError as e:
            raise t.problem(str(e), "dsn") from None
        if self.password_file is not None and not self.password_file.is_file():
            raise t.problem(f"{self.password_file} is not a readable file", "password_file")
        return self


def _check_dsn_port(dsn: str) -> None:
    """A DSN whose URL or port libpq could never use is a config error now, not a crash
    of whatever reads it first (the message never shows the DSN: it may hold a password)."""
    from urllib.parse import urlsplit

    ports: list[str] = []
    if dsn.startswith(("postgresql://", "postgres://")):
        try:
            netloc = urlsplit(dsn).netloc
        except ValueError as e:
            raise ValueError(f"not a valid URL ({e})") from None
        # libpq's multi-host form: host1:5432,[::1]:5433
        for hostport in netloc.rpartition("@")[2].split(","):
            tail = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
            ports.append(tail.partition(":")[2])
    else:
        m = re.search(r"(?:^|\s)port\s*=\s*'?([^'\s]*)", dsn)
        ports = m.group(1).split(",") if m else []
    for p in ports:
        if p and not (p.isascii() and p.isdigit() and 0 < int(p) < 65536):
            raise ValueError(f"port {p!r} is not a number from 1 to 65535")


class SmarthostSection(Section):
    host: t.Str = "127.0.0.1"
    port: t.Int(1) = 587  # type: ignore[valid-type]
    tls: t.Choice("none", "opportunistic", "starttls", "implicit") = "starttls"  # type: ignore[valid-type]
    verify: t.Bool = True
    ca_file: ReadablePath = None
    username: t.OptStr = None
    password_file: t.OptPath = None  # the password is read from this file, never inline
    _password: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_password(self) -> SmarthostSection:
        if self.password_file is not None:
            try:
                self._password = self.password_file.read_text(encoding="utf-8").strip("\r\n")
            except OSError as e:
                raise t.problem(
                    f"cannot read {self.password_file}: {e.strerror}", "password_file"
                ) from None
        if self.username and self._password is None:
            raise t.problem("required when username is set", "password_file")
        return self

    @property
    def password(self) -> str | None:
        return self._password


def _nameserver_list(value: object) -> object:
    if value is not None and (
        not isinstance(value, list) or not all(isinstance(x, str) for x in value)
    ):
        raise t.problem("expected a list of host[:port] strings")
    return value


def _nameserver(spec: str) -> str:
    from relay.delivery.mx import parse_nameserver  # the resolver's own parser

    try:
        parse_nameserver(spec)
    except ValueError as e:
        raise t.problem(f"{spec!r}: {e}") from None
    return spec


class MxSection(Section):
    port: t.Int(1) = 25  # type: ignore[valid-type]
    tls: t.Choice("none", "opportunistic", "starttls") = "opportunistic"  # type: ignore[valid-type]
    verify: t.Bool = False
    nameservers: Annotated[
        tuple[Annotated[str, AfterValidator(_nameserver)], ...] | None,
        BeforeValidator(_nameserver_list),
    ] = None
    dns_timeout: t.Duration = "10s"
    mta_sts: t.Bool = True  # RFC 8461: honour the policies domains publish
    ca_file: ReadablePath = None
    mta_sts_port: t.Int(1) = 443  # type: ignore[valid-type]


class UpstreamSection(Section):
    mode: t.Choice("smarthost", "mx") = "smarthost"  # type: ignore[valid-type]
    helo: t.OptStr = None  # None: hostname
    smarthost: SmarthostSection = SmarthostSection.defaults()  # type: ignore[assignment]
    mx: MxSection = MxSection.defaults()  # type: ignore[assignment]


def _time_zone(name: str) -> str:
    import zoneinfo

    try:
        zoneinfo.ZoneInfo(name)
    except Exception:
        raise t.problem(f"{name!r} is not a known time zone") from None
    return name


def _list_of(what: str) -> Any:
    def check(value: object) -> object:
        if value is not None and not isinstance(value, list):
            raise t.problem(f"expected a list of {what}" if what else "expected a list")
        return value

    return BeforeValidator(check)


def _shaping_rule(value: object) -> Any:
    from relay.delivery.shaping import parse_rule

    if not isinstance(value, Mapping):
        raise t.problem("expected a mapping with match, action and for")
    rule = dict(value)
    if rule.get("for") is not None:  # a duration: 30s, 2h, or seconds
        try:
            rule["for"] = t.duration(rule["for"])
        except ValueError as e:
            raise t.problem(str(e), "for") from None
    try:
        return parse_rule(rule)
    except ValueError as e:
        raise t.problem(str(e)) from None


_RULE_SCHEMA = {
    "type": "object",
    "properties": {
        "match": {"type": "string", "description": "a regular expression on the reply"},
        "action": {"enum": ["suspend", "throttle"]},
        "for": DURATION_SCHEMA,
    },
    "required": ["match", "action"],
}


class ShapingSection(Section):
    window_tz: Annotated[t.Str, AfterValidator(_time_zone)] = "UTC"
    window_length: t.OptDuration = None
    identity_by: t.Choice("sender_domain", "sender") = "sender_domain"  # type: ignore[valid-type]
    # the operator's rules on upstream replies (relay/delivery/shaping.py), parsed
    rules: Annotated[
        tuple[Annotated[Any, PlainValidator(_shaping_rule), WithJsonSchema(_RULE_SCHEMA)], ...]
        | None,
        _list_of("rules"),
    ] = None


def _lane_rules(value: object) -> Any:
    from relay.delivery.lanes import parse_lane_rules

    if not isinstance(value, list):
        raise t.problem("expected a list")
    try:  # parsed here so that a bad rule is a config error, not a crash at start
        return parse_lane_rules(value)
    except ValueError as e:
        raise t.problem(
            re.sub(r"^lane rule (\d+)", r"lanes.rules[\1]", str(e)), full=True
        ) from None


class ShareSection(Section):
    share: t.Number(0.0, 1.0) = 1.0  # type: ignore[valid-type]


class LanesSection(Section):
    # README "Lanes": the rules that put a message in a lane (relay/delivery/lanes.py), parsed
    rules: Annotated[
        Any,
        PlainValidator(_lane_rules),
        WithJsonSchema({"type": "array", "items": {"type": "object"}}),
    ] = []
    transactional: ShareSection = {"share": 1.0}  # type: ignore[assignment]
    bulk: ShareSection = {"share": 0.5}  # type: ignore[assignment]


def read_secret(path: Path) -> str:
    """A secret file's contents without the final line break; ValueError (the key's
    problem) when it cannot be read or is empty."""
    try:
        value = path.read_text(encoding="utf-8").strip("\r\n")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def _secret(path: Path, key: str) -> str:
    try:
        return read_secret(path)
    except ValueError as e:
        raise t.problem(str(e), key) from None


def _mailbox(value: str | None) -> str | None:
    from relay.mail.address import AddressError, check_mailbox

    if value is not None:
        try:
            check_mailbox(value)
        except AddressError as e:
            raise t.problem(f"{value!r}: {e}") from None
    return value


FEEDBACK_PROVIDERS = ("ses", "postmark", "sendgrid", "mailgun", "generic")


class ProviderSection(Section):
    """feedback.providers.<name>: HTTP basic auth whose password is the token file's."""

    token_file: t.OptPath = None
    _token: str = PrivateAttr("")

    @model_validator(mode="after")
    def _read(self) -> ProviderSection:
        if self.token_file is None:
            raise t.problem("required (the webhook's basic-auth password)", "token_file")
        self._token = _secret(self.token_file, "token_file").strip()
        return self

    @property
    def token(self) -> str:
        return self._token


class MailgunProvider(ProviderSection):
    signing_key_file: t.OptPath = None
    _signing: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_key(self) -> MailgunProvider:
        if self.signing_key_file is None:
            raise t.problem("required (Mailgun signs every call)", "signing_key_file")
        self._signing = _secret(self.signing_key_file, "signing_key_file").strip().encode()
        return self

    @property
    def signing_key(self) -> bytes | None:
        return self._signing


class SendgridProvider(ProviderSection):
    public_key_file: t.OptPath = None  # the signed event webhook's ECDSA key
    _public: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_key(self) -> SendgridProvider:
        if self.public_key_file is not None:
            self._public = _secret(self.public_key_file, "public_key_file").strip().encode()
        return self

    @property
    def public_key(self) -> bytes | None:
        return self._public


def _hosts(value: object) -> object:
    hosts = value or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise t.problem("expected a list of host or host:port")
    return tuple(h.lower() for h in hosts)


class SesProvider(ProviderSection):
    """Amazon SNS's signature checked (relay/feedback/sns.py): the certificate hosts allowed
    besides sns.<region>.amazonaws.com, and the CA bundle to fetch it with."""

    verify_signatures: t.OptBool = None  # None: false
    signing_cert_hosts: Annotated[
        tuple[str, ...],
        PlainValidator(_hosts),
        WithJsonSchema({"type": ["array", "null"], "items": {"type": "string"}}),
    ] = ()
    signing_cert_ca_file: t.OptPath = None

    @model_validator(mode="after")
    def _signatures(self) -> SesProvider:
        ca = self.signing_cert_ca_file
        if ca is not None and not ca.is_file():
            raise t.problem(f"{ca} is not a file", "signing_cert_ca_file")
        if (self.signing_cert_hosts or ca is not None) and not self.verify_signatures:
            raise t.problem(
                "signing_cert_hosts and signing_cert_ca_file need verify_signatures: true"
            )
        return self


def _provider() -> Any:
    # absent: None (not validated); null: an empty mapping, whose token_file is missing
    return Field(None, validate_default=False)


class ProvidersSection(Section):
    ses: Annotated[SesProvider | None, BeforeValidator(lambda v: v or {})] = _provider()
    postmark: Annotated[ProviderSection | None, BeforeValidator(lambda v: v or {})] = _provider()
    sendgrid: Annotated[SendgridProvider | None, BeforeValidator(lambda v: v or {})] = _provider()
    mailgun: Annotated[MailgunProvider | None, BeforeValidator(lambda v: v or {})] = _provider()
    generic: Annotated[ProviderSection | None, BeforeValidator(lambda v: v or {})] = _provider()

    @staticmethod
    def unknown_key(name: str) -> str:
        import difflib

        close = difflib.get_close_matches(name, FEEDBACK_PROVIDERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown provider{hint}; known: {', '.join(FEEDBACK_PROVIDERS)}"


def _address(value: str | None) -> str | None:
    if value is not None and "+" in value.rpartition("@")[0]:
        raise t.problem("no '+' in the local part (VERP adds one)")
    return value


def _providers(value: object) -> object:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise t.problem("expected a mapping of provider names")
    return value


class FeedbackSection(Section):
    listen: t.OptHostPort = None  # its own HTTP listener; null: admin.listen
    address: Annotated[t.OptStr, AfterValidator(_mailbox), AfterValidator(_address)] = None
    verp: t.Bool = False
    verp_secret_file: t.OptPath = None
    max_body: t.Size = "1MiB"
    mail_max_stored: t.Size = "256KiB"
    mail_budget: t.Size = "64MiB"
    rate_per_ip: t.Int(0) = 20  # type: ignore[valid-type]
    rate_window: t.Duration = "1m"
    max_connections: t.Int(1) = 256  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 32  # type: ignore[valid-type]
    providers: Annotated[ProvidersSection, BeforeValidator(_providers)] = {}  # type: ignore[assignment]
    _verp_secret: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _between_keys(self) -> FeedbackSection:
        if self.verp and self.address is None:
            raise t.problem("needs feedback.address (the bounce address)", "verp")
        if self.verp_secret_file is not None:
            self._verp_secret = _secret(self.verp_secret_file, "verp_secret_file").encode()
        if self.mail_max_stored < 1024:
            raise t.problem("at least 1KiB (the headers of a report)", "mail_max_stored")
        if self.mail_budget < self.mail_max_stored:
            raise t.problem(
                f"{self.mail_budget} bytes is below feedback.mail_max_stored"
                f" ({self.mail_max_stored}): one stored mail must fit",
                "mail_budget",
            )
        if self.rate_window <= 0:
            raise t.problem("must be more than 0s", "rate_window")
        return self

    @property
    def verp_secret(self) -> bytes | None:
        return self._verp_secret


def _date(value: object) -> dt.date:
    try:
        if value is None:
            raise ValueError
        return dt.date.fromisoformat(str(value))
    except ValueError:
        raise t.problem(f"{value!r} is not a date (YYYY-MM-DD)") from None


def _counts(value: object) -> object:
    if value is not None and (
        not isinstance(value, list)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    ):
        raise t.problem("expected a list of whole numbers")
    return None if value is None else tuple(value)


class WarmupSection(Section):
    """identities.<name>.warmup: a ceiling that grows from `start` (README "Warm-up")."""

    start: Annotated[
        dt.date, PlainValidator(_date), WithJsonSchema({"type": "string", "format": "date"})
    ] = None  # type: ignore[assignment]
    schedule: Annotated[
        tuple[int, ...] | None,
        PlainValidator(_counts),
        WithJsonSchema({"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}}),
    ] = None
    initial: t.Int(1) = 500  # type: ignore[valid-type]
    factor: t.Number(1.0, 100.0) = 2.0  # type: ignore[valid-type]
    ceiling: t.OptInt(1) = None  # type: ignore[valid-type]


def _unsubscribe_url(url: str | None) -> str | None:
    from relay.ops.logs import redact_url

    if url is not None:
        if not url.lower().startswith(("https://", "http://")):
            raise t.problem(f"{redact_url(url)!r} is not an https:// URL")
        if not url.rstrip("/").endswith("/u"):
            raise t.problem(
                f"{redact_url(url)!r} must end in /u (the relay serves POST/GET /u/<token>)"
            )
    return url


class UnsubscribeSection(Section):
    """identities.<name>.unsubscribe: RFC 8058 one-click (relay/authenticity/unsubscribe.py)."""

    url: Annotated[t.OptStr, AfterValidator(_unsubscribe_url)] = None
    mailto: Annotated[t.OptStr, AfterValidator(_mailbox)] = None
    secret_file: t.OptPath = None  # the key that signs unsubscribe links
    _secret: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _read(self) -> UnsubscribeSection:
        from relay.authenticity.unsubscribe import MIN_SECRET

        if self.url is None and self.mailto is None:
            raise t.problem("give url, mailto or both")
        sp = self.secret_file
        if sp is None:
            raise t.problem("required (the key that signs unsubscribe links)", "secret_file")
        self._secret = _secret(sp, "secret_file").strip().encode()
        if len(self._secret) < MIN_SECRET:
            raise t.problem(
                f"{sp} holds {len(self._secret)} bytes; at least {MIN_SECRET}"
                " (e.g. `head -c 32 /dev/urandom | base64`)",
                "secret_file",
            )
        return self

    @property
    def secret(self) -> bytes:
        return self._secret


class IdentitySection(Section):
    """identities.<name>: daily ceilings, warm-up and unsubscribe per sending identity."""

    daily_limit: t.OptInt(0) = None  # type: ignore[valid-type]
    warmup: WarmupSection | None = None
    unsubscribe: UnsubscribeSection | None = None


def _network(value: object) -> Any:
    try:
        return ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        raise t.problem(f"{value!r} is not a network") from None


def _networks(value: object) -> object:
    if value is None:
        return ["127.0.0.0/8", "::1/128"]  # loopback only unless configured
    if not isinstance(value, list):
        raise t.problem("expected a list of networks")
    return value


def _lane(value: str | None) -> str | None:
    if value not in (None, "transactional", "bulk"):
        raise t.problem(f"{value!r} is not one of transactional, bulk")
    return value


def _namespace(value: str | None) -> str | None:
    if value is not None and not (
        0 < len(value) <= 100 and value.isascii() and value.isprintable()
    ):
        raise t.problem("1 to 100 printable ASCII characters")
    return value


def _listen_address(value: str) -> str:
    try:
        t.hostport(value)
    except ValueError as e:
        raise t.problem(str(e)) from None
    return value


class ListenerTLSSection(Section):
    """listen[].tls: the certificate offered to submitting clients; the server context is
    built (and the files checked) here, so a bad certificate is a config error."""

    mode: Annotated[
        str,
        PlainValidator(lambda v: "starttls" if v is None else _choice(v, "starttls", "implicit")),
        WithJsonSchema({"enum": ["starttls", "implicit", None]}),
    ] = None  # type: ignore[assignment]
    cert_file: t.OptPath = None
    key_file: t.OptPath = None
    _context: ssl.SSLContext | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> ListenerTLSSection:
        key = (info.context or {}).get("key", "listen[]") + ".tls"
        for name in ("cert_file", "key_file"):
            path = getattr(self, name)
            if path is None:
                raise t.problem("required", name)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise t.problem(f"cannot read {path}: {e.strerror or e}", name) from None
            except UnicodeDecodeError:
                raise t.problem(f"{path} is not a PEM file", name) from None
            if name == "cert_file":
                try:  # parses every certificate in the file; a leaf is fine here
                    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(
                        cadata=text
                    )
                except (ssl.SSLError, ValueError):
                    raise t.problem(f"{path} holds no valid PEM certificate", name) from None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2+, no client certs
        try:
            # an encrypted key would prompt on the terminal: answer with no password instead
            ctx.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")  # type: ignore[arg-type]
        except (ssl.SSLError, OSError) as e:
            raise t.problem(
                f"{self.key_file} is not an unencrypted PEM private key for"
                f" {key}.cert_file ({getattr(e, 'reason', None) or e})",
                "key_file",
            ) from None
        self._context = ctx
        return self

    @property
    def context(self) -> ssl.SSLContext:
        assert self._context is not None  # built by _load
        return self._context


def _choice(value: object, *choices: str) -> str:
    try:
        return t.choice(value, choices)
    except ValueError as e:
        raise t.problem(str(e)) from None


class ListenerAuthSection(Section):
    """listen[].auth: AUTH PLAIN/LOGIN against a users file, read here (start, SIGHUP)."""

    users_file: t.OptPath = None
    allow_plaintext: t.OptBool = None  # None: false
    _users: Mapping[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _load(self) -> ListenerAuthSection:
        from relay.inbound.auth import UsersFileError, load_users

        if self.users_file is None:
            raise t.problem("required", "users_file")
        try:
            self._users = load_users(self.users_file)
        except UsersFileError as e:
            raise t.problem(str(e), "users_file") from None
        return self

    @property
    def users(self) -> Mapping[str, str]:
        return self._users


class ListenerSection(Section):
    """One entry of `listen` (validated with its key, `listen[0]`, in the context)."""

    address: Annotated[t.Str, AfterValidator(_listen_address)] = None
    allow: Annotated[
        tuple[Annotated[Any, PlainValidator(_network)], ...],
        BeforeValidator(_networks),
        WithJsonSchema({"type": ["array", "null"], "items": {"type": "string"}}),
    ] = None  # type: ignore[assignment]
    lane: Annotated[t.OptStr, AfterValidator(_lane)] = None
    tls: ListenerTLSSection | None = None
    require_tls: t.OptBool = None  # None: false
    auth: ListenerAuthSection | None = None
    namespace: Annotated[t.OptStr, AfterValidator(_namespace)] = None

    @model_validator(mode="after")
    def _between_keys(self, info: ValidationInfo) -> ListenerSection:
        key = (info.context or {}).get("key", "listen[]")
        if self.require_tls and self.tls is None:
            raise t.problem(f"needs {key}.tls (a certificate to offer)", "require_tls")
        if self.auth is not None and self.tls is None and not self.auth.allow_plaintext:
            raise t.problem(
                f"AUTH is only offered over TLS: configure {key}.tls,"
                f" or set {key}.auth.allow_plaintext: true (loopback only)",
                "auth",
            )
        return self


class LocalSection(Section):
    """Bare local parts (`root`) from relay-sendmail and allow-listed clients: qualified
    with `domain`, then `aliases` applied (relay/config/tree.py `_local` reads them)."""

    domain: t.OptStr = None  # None: hostname
    aliases: Annotated[
        Any,
        WithJsonSchema(
            {
                "type": ["object", "string"],
                "description": "name -> address(es), or an aliases(5) file",
            }
        ),
    ] = {}


# the sections on the library, by their key (in the order relay.yaml shows them)
SECTIONS: dict[str, type[Section]] = {
    "fleet": FleetSection,
    "outbox": OutboxSection,
    "spool": SpoolSection,
    "dedup": DedupSection,
    "limits": LimitsSection,
    "auth": AuthSection,
    "upstream": UpstreamSection,
    "retry": RetrySection,
    "timeouts": TimeoutsSection,
    "shaping": ShapingSection,
    "lanes": LanesSection,
    "delivery": DeliverySection,
    "alerts": AlertsSection,
    "health": HealthSection,
    "dsn": DsnSection,
    "local": LocalSection,
    "admin": AdminSection,
    "feedback": FeedbackSection,
    "log": LogSection,
    "inbound": InboundSection,
}


@dataclass(frozen=True, slots=True)
class Sections:
    """The validated sections of one file (a section with errors: its defaults)."""

    spool: SpoolSection
    fleet: FleetSection
    outbox: OutboxSection
    dedup: DedupSection
    limits: LimitsSection
    auth: AuthSection
    upstream: UpstreamSection
    retry: RetrySection
    timeouts: TimeoutsSection
    shaping: ShapingSection
    lanes: LanesSection
    delivery: DeliverySection
    alerts: AlertsSection
    health: HealthSection
    dsn: DsnSection
    local: LocalSection
    admin: AdminSection
    feedback: FeedbackSection
    log: LogSection
    inbound: InboundSection
