"""Named upstreams and routes: which way a recipient's mail goes (pure).

Rules:
- `upstreams:` names smarthosts (host, port, TLS, credentials: a password file, or OAuth2
  for XOAUTH2/OAUTHBEARER). `routes:` is a list; the first route whose every condition
  matches wins. Conditions: `sender` (the envelope sender), `sender_domain`,
  `recipient_domain`, `listener` (its name) and `auth_user` (the SMTP AUTH login); each
  takes one value or a list, compared case-insensitively. A route without conditions
  matches everything.
- The keys are checked by the models below (every error of both keys at once); the values
  the delivery side reads are the frozen dataclasses.
- `via` is a list of upstream names, tried in order (failover), or `mx` (direct delivery).
- Without `upstreams:`/`routes:` the relay has one route: `via: [smarthost]` (the
  `upstream.smarthost` block, as the upstream named "smarthost") in smarthost mode, or
  `via: mx` in MX mode. So old configs keep working unchanged.
- The last route must have no conditions (a catch-all): no mail is left without a way.
- Every upstream is its own destination for shaping: limits, breaker, ceilings, named by
  the upstream's name (`destinations.<name>`).
- `rewrite` on a route: `envelope_sender` (MAIL FROM sent upstream), `from` (the header
  From's address, its display name kept) and `reply_to_original` (a Reply-To with the
  original From, when the message has none). See README "Routes and upstreams".
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from relay.config import values as t
from relay.config.report import shown, validate
from relay.config.sections.base import Section, read_secret

NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
AUTH_MECHS = ("auto", "plain", "login", "xoauth2", "oauthbearer")
TLS_MODES = ("none", "opportunistic", "starttls", "implicit")
CONDITIONS = ("sender", "sender_domain", "recipient_domain", "listener", "auth_user")


class RouteConfigError(ValueError):
    """Bad `upstreams:`/`routes:` entries: every error, one a line, each starting with its
    key."""


@dataclass(frozen=True, slots=True)
class OAuthConf:
    """An upstream's OAuth2 token source (relay/delivery/oauth.py)."""

    token_url: str | None = None
    client_id: str | None = None
    client_secret: str | None = field(default=None, repr=False)
    refresh_token: str | None = field(default=None, repr=False)
    scope: str | None = None
    token_command: str | None = field(default=None, repr=False)
    timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class UpstreamHost:
    name: str
    host: str
    port: int
    tls: str
    verify: bool = True
    ca_file: Path | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    auth: str = "auto"  # auto (PLAIN/LOGIN as offered) | plain | login | xoauth2 | oauthbearer
    oauth: OAuthConf | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Rewrite:
    envelope_sender: str | None = None
    from_addr: str | None = None
    reply_to_original: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    index: int
    via: tuple[str, ...]  # upstream names; () means MX
    sender: frozenset[str] = frozenset()
    sender_domain: frozenset[str] = frozenset()
    recipient_domain: frozenset[str] = frozenset()
    listener: frozenset[str] = frozenset()
    auth_user: frozenset[str] = frozenset()
    rewrite: Rewrite | None = None

    @property
    def mx(self) -> bool:
        return not self.via

    def describe(self) -> str:
        return "mx" if self.mx else " -> ".join(self.via)


@dataclass(frozen=True, slots=True)
class Routing:
    upstreams: Mapping[str, UpstreamHost]
    routes: tuple[Route, ...]

    def match(self, *, sender: str, recipient: str, client: str, listener: str | None) -> Route:
        """The first route whose conditions all hold. `client` is the dedup namespace
        (`listener:NAME` or `user:LOGIN`)."""
        s = sender.lower()
        sdom = s.rpartition("@")[2] if "@" in s else ""
        rdom = recipient.rpartition("@")[2].lower()
        user = client[5:].lower() if client.startswith("user:") else None
        lst = (listener or (client[9:] if client.startswith("listener:") else "")).lower()
        for r in self.routes:
            if r.sender and s not in r.sender:
                continue
            if r.sender_domain and sdom not in r.sender_domain:
                continue
            if r.recipient_domain and rdom not in r.recipient_domain:
                continue
            if r.listener and lst not in r.listener:
                continue
            if r.auth_user and (user is None or user not in r.auth_user):
                continue
            return r
        return self.routes[-1]  # parse() guarantees a catch-all last


def default(mode: str, smarthost: UpstreamHost) -> Routing:
    if mode == "mx":
        return Routing({}, (Route(0, ()),))
    return Routing({smarthost.name: smarthost}, (Route(0, (smarthost.name,)),))


def parse(
    upstreams: object,
    routes: object,
    *,
    mode: str,
    smarthost: UpstreamHost,
    base: Path,
    read_secret: Callable[[Path, str], str] | None = None,
) -> Routing:
    """The routing table of `upstreams:` and `routes:`; RouteConfigError lists every error.
    `read_secret(path, key) -> str` reads a secret file (by default `_read_file`)."""
    read = read_secret or _read_file
    if upstreams is None and routes is None:
        return default(mode, smarthost)
    errors: list[str] = []
    ups: dict[str, UpstreamHost] = {}
    names: set[str] = set()
    if upstreams is not None and not isinstance(upstreams, Mapping):
        errors.append("upstreams: expected a mapping of name -> upstream")
    for name, item in (upstreams or {}).items() if isinstance(upstreams, Mapping) else ():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            errors.append(
                f"upstreams.{shown(str(name))}: an upstream name is lowercase letters,"
                " digits, '-' and '_' (it names a destination too)"
            )
            continue
        names.add(name)
        m = _validate(NamedUpstreamSection, item, f"upstreams.{name}", base, errors)
        if m is not None:
            try:
                ups[name] = m.host_of(name, f"upstreams.{name}", read)
            except (RouteConfigError, ValueError) as e:
                errors.append(str(e))
    if "smarthost" not in names and mode == "smarthost":
        ups["smarthost"] = smarthost  # `via: [smarthost]` keeps meaning upstream.smarthost
        names.add("smarthost")
    if routes is None:
        routes = [{"via": "mx" if mode == "mx" else ["smarthost"]}]
    if not isinstance(routes, list) or not routes:
        errors.append("routes: expected a non-empty list")
        routes = []
    out: list[Route] = []
    for i, item in enumerate(routes):
        r = _validate(RouteSection, item, f"routes[{i}]", base, errors, names=sorted(names))
        if r is not None:
            out.append(r.route(i))
    if out and len(out) == len(routes):
        last = out[-1]
        if any((last.sender, last.sender_domain, last.recipient_domain, last.listener)) or (
            last.auth_user
        ):
            errors.append(
                f"routes[{len(out) - 1}]: the last route must match every"
                " message (no conditions), so no mail is left without a way"
            )
    if errors:
        raise RouteConfigError("\n".join(errors))
    used = {n for r in out for n in r.via}
    return Routing({n: u for n, u in ups.items() if n in used or n == "smarthost"}, tuple(out))


def _read_file(path: Path, key: str) -> str:
    try:
        return read_secret(path)
    except ValueError as e:
        raise RouteConfigError(f"{key}: {e}") from None


def _validate(
    model: type[Section], item: object, key: str, base: Path, errors: list[str], **context: Any
) -> Any:
    if not isinstance(item, Mapping):
        errors.append(f"{key}: expected a mapping")
        return None
    return validate(model, item, key, errors, base=base, **context)


def _unknown(model: type[Section], name: str, otherwise: str) -> str:
    """An unknown key's words: the known key it looks like, or `otherwise`."""
    known = [f.alias or n for n, f in model.model_fields.items()]
    # a closer match than the other sections ask (0.6): these keys are short words
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    return f"unknown key {name!r} (did you mean {close[0]!r}?)" if close else otherwise


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(value: object) -> str:
        if value not in choices:
            raise t.problem(f"{value!r} is not one of {', '.join(choices)}")
        return str(value)

    return PlainValidator(check)


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise t.problem("expected true or false")
    return value


def _port(value: object) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536
    ):
        raise t.problem("expected a port number")
    return value


def _opt_string(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise t.problem("expected a string")
    return value


def _token_url(value: object) -> str | None:
    from relay.config.redact import redact_url  # a token URL may hold credentials

    if value is not None and not str(value).startswith(("https://", "http://")):
        raise t.problem(f"{redact_url(str(value))!r} is not an http(s) URL")
    if value is not None:
        t.require_url_host(str(value), redact_url(str(value)))
    return None if value is None else str(value)


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise t.problem("expected seconds")
    return float(value)


Flag = Annotated[bool, PlainValidator(_flag), WithJsonSchema({"type": "boolean"})]
OptString = Annotated[
    str | None, PlainValidator(_opt_string), WithJsonSchema({"type": ["string", "null"]})
]


class OAuthSection(Section):
    """upstreams.<name>.oauth: where XOAUTH2/OAUTHBEARER tokens come from."""

    token_url: Annotated[
        str | None, PlainValidator(_token_url), WithJsonSchema({"type": ["string", "null"]})
    ] = None
    client_id: OptString = None
    client_secret_file: t.OptPath = None
    refresh_token_file: t.OptPath = None
    scope: OptString = None
    token_command: OptString = None
    timeout: Annotated[
        float, PlainValidator(_seconds), WithJsonSchema({"type": "number", "exclusiveMinimum": 0})
    ] = 10

    @classmethod
    def unknown_key(cls, name: str) -> str:
        if "secret" in name:
            return "unknown key (secrets go in *_file keys)"
        return _unknown(cls, name, "unknown key")

    @model_validator(mode="after")
    def _source(self) -> OAuthSection:
        if not self.token_command and not self.token_url:
            raise t.problem("token_url or token_command is required")
        if self.token_url and not self.token_command and not self.client_id:
            raise t.problem("required with token_url", "client_id")
        return self

    def conf(self, key: str, read: Callable[[Path, str], str]) -> OAuthConf:
        """The token source, its secret files read (`read(path, key)`)."""
        secret = refresh = None
        if self.client_secret_file is not None:
            secret = read(self.client_secret_file, f"{key}.client_secret_file")
        if self.refresh_token_file is not None:
            refresh = read(self.refresh_token_file, f"{key}.refresh_token_file")
        return OAuthConf(
            token_url=self.token_url,
            client_id=self.client_id,
            client_secret=secret,
            refresh_token=refresh,
            scope=self.scope,
            token_command=self.token_command,
            timeout=self.timeout,
        )


def _oauth(value: object) -> object:
    if value is not None and not isinstance(value, Mapping):
        raise t.problem("required (token_url and credentials, or token_command)")
    return value


def _host(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise t.problem("required")
    return value


class NamedUpstreamSection(Section):
    """upstreams.<name>: a named smarthost."""

    host: Annotated[str, PlainValidator(_host), WithJsonSchema({"type": "string"})] = None  # type: ignore[assignment]
    port: Annotated[
        int | None,
        PlainValidator(_port),
        WithJsonSchema({"type": ["integer", "null"], "minimum": 1, "maximum": 65535}),
    ] = Field(None, description="default: 465 with tls: implicit, else 587")
    tls: Annotated[str, _one_of(TLS_MODES), WithJsonSchema({"enum": list(TLS_MODES)})] = "starttls"
    verify: Flag = True
    ca_file: t.OptPath = None
    username: OptString = None
    password_file: t.OptPath = None  # the password is read from this file, never inline
    auth: Annotated[str, _one_of(AUTH_MECHS), WithJsonSchema({"enum": list(AUTH_MECHS)})] = "auto"
    oauth: Annotated[OAuthSection | None, BeforeValidator(_oauth)] = None

    @classmethod
    def unknown_key(cls, name: str) -> str:
        if name == "password":
            return "unknown key (secrets go in password_file)"
        return _unknown(cls, name, "unknown key")

    @model_validator(mode="after")
    def _credentials(self) -> NamedUpstreamSection:
        if self.auth in ("xoauth2", "oauthbearer"):
            if not self.username:
                raise t.problem(f"required with auth: {self.auth}", "username")
            if self.oauth is None:
                raise t.problem("required (token_url and credentials, or token_command)", "oauth")
        elif self.oauth is not None:
            raise t.problem("only with auth: xoauth2 or oauthbearer", "oauth")
        elif self.username and self.password_file is None:
            raise t.problem("required when username is set", "password_file")
        return self

    def host_of(self, name: str, key: str, read: Callable[[Path, str], str]) -> UpstreamHost:
        """The upstream, its secret files read (`read(path, key)`)."""
        password = None
        if self.password_file is not None:
            password = read(self.password_file, f"{key}.password_file")
        oauth = None if self.oauth is None else self.oauth.conf(f"{key}.oauth", read)
        return UpstreamHost(
            name=name,
            host=self.host,
            port=self.port or (465 if self.tls == "implicit" else 587),
            tls=self.tls,
            verify=self.verify,
            ca_file=self.ca_file,
            username=self.username,
            password=password,
            auth=self.auth,
            oauth=oauth,
        )


def _values(value: object) -> frozenset[str]:
    if value is None:
        return frozenset()
    items: Sequence[object] = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(x, str) and x for x in items):
        raise t.problem("expected a value or a list of values")
    return frozenset(str(x).lower() for x in items)


def _via(value: object, info: ValidationInfo) -> tuple[str, ...]:
    if value == "mx":
        return ()
    if not (isinstance(value, list) and value and all(isinstance(x, str) for x in value)):
        raise t.problem("expected a list of upstream names, or mx")
    names = (info.context or {}).get("names", [])
    for n in value:
        if n not in names:
            raise t.problem(f"no upstream named {n!r} (upstreams: {', '.join(names) or 'none'})")
    if len(set(value)) != len(value):
        raise t.problem("an upstream is named twice")
    return tuple(value)


def _address(value: object) -> str | None:
    from relay.mail.address import AddressError, check_mailbox

    if value is None:
        return None
    try:
        check_mailbox(str(value))
    except AddressError as e:
        raise t.problem(str(e)) from None
    return str(value)


Address = Annotated[
    str | None, PlainValidator(_address), WithJsonSchema({"type": ["string", "null"]})
]


class RewriteSection(Section):
    """routes[].rewrite: what the relay changes in mail sent this way."""

    envelope_sender: Address = None
    from_addr: Address = Field(None, alias="from")
    reply_to_original: Flag = False

    @classmethod
    def unknown_key(cls, name: str) -> str:
        return _unknown(cls, name, "unknown key")


def _rewrite(value: object) -> object:
    if value is not None and not isinstance(value, Mapping):
        raise t.problem("expected a mapping")
    return value


Values = Annotated[
    frozenset[str],
    PlainValidator(_values),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
]


class RouteSection(Section):
    """routes[i]: conditions (all must hold; none: every message), then `via`."""

    sender: Values = None  # type: ignore[assignment]
    sender_domain: Values = None  # type: ignore[assignment]
    recipient_domain: Values = None  # type: ignore[assignment]
    listener: Values = None  # type: ignore[assignment]
    auth_user: Values = None  # type: ignore[assignment]
    via: Annotated[
        tuple[str, ...],
        PlainValidator(_via),
        WithJsonSchema(
            {"anyOf": [{"const": "mx"}, {"type": "array", "items": {"type": "string"}}]}
        ),
    ] = None  # type: ignore[assignment]
    rewrite: Annotated[RewriteSection | None, BeforeValidator(_rewrite)] = None

    @classmethod
    def unknown_key(cls, name: str) -> str:
        listed = f"unknown key (conditions: {', '.join(CONDITIONS)}; then via, rewrite)"
        return _unknown(cls, name, listed)

    def route(self, index: int) -> Route:
        rw = self.rewrite
        return Route(
            index=index,
            via=self.via,
            sender=self.sender,
            sender_domain=self.sender_domain,
            recipient_domain=self.recipient_domain,
            listener=self.listener,
            auth_user=self.auth_user,
            rewrite=None
            if rw is None
            else Rewrite(rw.envelope_sender, rw.from_addr, rw.reply_to_original),
        )
