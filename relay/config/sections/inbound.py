"""limits, auth, inbound, listen, local: the SMTP side (relay/inbound/)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    PlainValidator,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from relay.config import values as t
from relay.config.sections.base import MAX_HEADER_SIZE, MIN_HEADER_SIZE, Section, choice_of

if TYPE_CHECKING:  # ssl loads when a listener has TLS (the `relay queue ...` CLI needs none)
    import ssl


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


def _at_most_64(value: int) -> int:
    if value > 64:
        raise t.problem("at most 64")
    return value


def _processes(value: object) -> int | str:
    """inbound.processes: `auto` (relay/config/build.py picks from the machine's cores) or
    0-64."""
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
    # auto: one on a machine with two or more cores, none on one (relay/config/build.py)
    processes: Processes = "auto"  # type: ignore[valid-type]


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
        PlainValidator(lambda v: "starttls" if v is None else choice_of(v, "starttls", "implicit")),
        WithJsonSchema({"enum": ["starttls", "implicit", None]}),
    ] = None  # type: ignore[assignment]
    cert_file: t.OptPath = None
    key_file: t.OptPath = None
    _context: ssl.SSLContext | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> ListenerTLSSection:
        import ssl

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


class ListenerAuthSection(Section):
    """listen[].auth: AUTH PLAIN/LOGIN against a users file, read here (start, SIGHUP)."""

    users_file: t.OptPath = None
    allow_plaintext: t.OptBool = None  # None: false
    _users: Mapping[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _load(self) -> ListenerAuthSection:
        from relay.config.users import UsersFileError
        from relay.config.users import load_smtp_users as load_users

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


def _domain(value: str | None) -> str | None:
    from relay.mail.address import AddressError, check_domain

    if value is not None:
        try:
            check_domain(value)
        except AddressError:
            raise t.problem(f"{value!r} is not a domain") from None
    return value


def _aliases(value: object, info: ValidationInfo) -> object:
    """A mapping (name -> address or list of them), or an aliases(5) file: its name
    resolved and its text read here (parsed with the domain when the tree is built)."""
    if value is None:
        return {}
    if isinstance(value, str):
        path = t.path_value(value, info)
        assert path is not None  # a string names a file
        try:
            return AliasesFile(path, path.read_text(encoding="utf-8"))
        except OSError as e:
            raise t.problem(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(value, Mapping):
        raise t.problem("expected a mapping or a file name")
    out: dict[str, tuple[str, ...]] = {}
    for k, v in value.items():
        vals = v if isinstance(v, list) else [v]
        if not all(isinstance(x, str) for x in vals):
            raise t.problem("expected an address or a list of them", str(k))
        out[str(k)] = tuple(vals)
    return out


@dataclass(frozen=True, slots=True)
class AliasesFile:
    path: Path
    text: str


class LocalSection(Section):
    """Bare local parts (`root`) from relay-sendmail and allow-listed clients: qualified
    with `domain`, then `aliases` applied (relay/config/build.py `local`)."""

    domain: Annotated[t.OptStr, AfterValidator(_domain)] = None  # None: hostname
    aliases: Annotated[
        Any,
        PlainValidator(_aliases),
        WithJsonSchema(
            {
                "type": ["object", "string"],
                "additionalProperties": {
                    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]
                },
                "description": "name -> address(es), or an aliases(5) file",
            }
        ),
    ] = {}
