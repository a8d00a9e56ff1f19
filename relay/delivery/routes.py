"""Named upstreams and routes: which way a recipient's mail goes (pure).

Rules:
- `upstreams:` names smarthosts (host, port, TLS, credentials: a password file, or OAuth2
  for XOAUTH2/OAUTHBEARER). `routes:` is a list; the first route whose every condition
  matches wins. Conditions: `sender` (the envelope sender), `sender_domain`,
  `recipient_domain`, `listener` (its name) and `auth_user` (the SMTP AUTH login); each
  takes one value or a list, compared case-insensitively. A route without conditions
  matches everything.
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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.config import credentials
from relay.delivery.oauth import OAuthConf
from relay.ops.logs import redact_url

NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
AUTH_MECHS = ("auto", "plain", "login", "xoauth2", "oauthbearer")
TLS_MODES = ("none", "opportunistic", "starttls", "implicit")
CONDITIONS = ("sender", "sender_domain", "recipient_domain", "listener", "auth_user")


class RouteConfigError(ValueError):
    """A bad `upstreams:`/`routes:` entry; the message starts with the key."""


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
    read_secret: Any,
) -> Routing:
    """`read_secret(path, key) -> str` reads a secret file (the config loader's, so its
    errors look like every other config error)."""
    if upstreams is None and routes is None:
        return default(mode, smarthost)
    ups: dict[str, UpstreamHost] = {}
    if upstreams is not None:
        if not isinstance(upstreams, Mapping):
            raise RouteConfigError("upstreams: expected a mapping of name -> upstream")
        for name, item in upstreams.items():
            ups[_name(name, "upstreams")] = _upstream(str(name), item, base, read_secret)
    if "smarthost" not in ups and mode == "smarthost":
        ups["smarthost"] = smarthost  # `via: [smarthost]` keeps meaning upstream.smarthost
    if routes is None:
        routes = [{"via": "mx" if mode == "mx" else ["smarthost"]}]
    if not isinstance(routes, list) or not routes:
        raise RouteConfigError("routes: expected a non-empty list")
    out = []
    for i, item in enumerate(routes):
        out.append(_route(i, item, ups))
    last = out[-1]
    if any((last.sender, last.sender_domain, last.recipient_domain, last.listener, last.auth_user)):
        raise RouteConfigError(
            f"routes[{len(out) - 1}]: the last route must match every"
            " message (no conditions), so no mail is left without a way"
        )
    used = {n for r in out for n in r.via}
    return Routing({n: u for n, u in ups.items() if n in used or n == "smarthost"}, tuple(out))


def _name(name: object, where: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RouteConfigError(
            f"{where}.{name}: an upstream name is lowercase letters,"
            " digits, '-' and '_' (it names a destination too)"
        )
    return name


def _upstream(name: str, item: object, base: Path, read_secret: Any) -> UpstreamHost:
    key = f"upstreams.{name}"
    if not isinstance(item, Mapping):
        raise RouteConfigError(f"{key}: expected a mapping")
    known = {
        "host",
        "port",
        "tls",
        "verify",
        "ca_file",
        "username",
        "password_file",
        "auth",
        "oauth",
    }
    for k in item:
        if k not in known:
            hint = " (secrets go in password_file)" if k == "password" else ""
            raise RouteConfigError(f"{key}.{k}: unknown key{hint}")
    host = item.get("host")
    if not isinstance(host, str) or not host:
        raise RouteConfigError(f"{key}.host: required")
    tls = item.get("tls", "starttls")
    if tls not in TLS_MODES:
        raise RouteConfigError(f"{key}.tls: {tls!r} is not one of {', '.join(TLS_MODES)}")
    port = item.get("port", 465 if tls == "implicit" else 587)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RouteConfigError(f"{key}.port: expected a port number")
    verify = item.get("verify", True)
    if not isinstance(verify, bool):
        raise RouteConfigError(f"{key}.verify: expected true or false")
    auth = item.get("auth", "auto")
    if auth not in AUTH_MECHS:
        raise RouteConfigError(f"{key}.auth: {auth!r} is not one of {', '.join(AUTH_MECHS)}")
    user = item.get("username")
    if user is not None and not isinstance(user, str):
        raise RouteConfigError(f"{key}.username: expected a string")
    password = None
    if item.get("password_file") is not None:
        password = read_secret(
            _path(item["password_file"], base, f"{key}.password_file"), f"{key}.password_file"
        )
    oauth = None
    if auth in ("xoauth2", "oauthbearer"):
        if not user:
            raise RouteConfigError(f"{key}.username: required with auth: {auth}")
        oauth = _oauth(key, item.get("oauth"), base, read_secret)
    elif item.get("oauth") is not None:
        raise RouteConfigError(f"{key}.oauth: only with auth: xoauth2 or oauthbearer")
    elif user and password is None:
        raise RouteConfigError(f"{key}.password_file: required when username is set")
    ca = item.get("ca_file")
    return UpstreamHost(
        name=name,
        host=host,
        port=port,
        tls=tls,
        verify=verify,
        ca_file=None if ca is None else _path(ca, base, f"{key}.ca_file"),
        username=user,
        password=password,
        auth=auth,
        oauth=oauth,
    )


def _oauth(key: str, item: object, base: Path, read_secret: Any) -> OAuthConf:
    k = f"{key}.oauth"
    if not isinstance(item, Mapping):
        raise RouteConfigError(f"{k}: required (token_url and credentials, or token_command)")
    known = {
        "token_url",
        "client_id",
        "client_secret_file",
        "refresh_token_file",
        "scope",
        "token_command",
        "timeout",
    }
    for x in item:
        if x not in known:
            hint = " (secrets go in *_file keys)" if "secret" in str(x) else ""
            raise RouteConfigError(f"{k}.{x}: unknown key{hint}")
    cmd = item.get("token_command")
    url = item.get("token_url")
    if not cmd and not url:
        raise RouteConfigError(f"{k}: token_url or token_command is required")
    if url is not None and not str(url).startswith(("https://", "http://")):
        raise RouteConfigError(f"{k}.token_url: {redact_url(str(url))!r} is not an http(s) URL")
    secret = refresh = None
    if item.get("client_secret_file") is not None:
        secret = read_secret(
            _path(item["client_secret_file"], base, f"{k}.client_secret_file"),
            f"{k}.client_secret_file",
        )
    if item.get("refresh_token_file") is not None:
        refresh = read_secret(
            _path(item["refresh_token_file"], base, f"{k}.refresh_token_file"),
            f"{k}.refresh_token_file",
        )
    if url and not cmd and not item.get("client_id"):
        raise RouteConfigError(f"{k}.client_id: required with token_url")
    timeout = item.get("timeout", 10)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise RouteConfigError(f"{k}.timeout: expected seconds")
    return OAuthConf(
        token_url=url,
        client_id=item.get("client_id"),
        client_secret=secret,
        refresh_token=refresh,
        scope=item.get("scope"),
        token_command=cmd,
        timeout=float(timeout),
    )


def _path(v: object, base: Path, key: str) -> Path:
    try:
        p = Path(credentials.expand(str(v), key))
    except ValueError as e:
        raise RouteConfigError(str(e)) from None
    return p if p.is_absolute() else (base / p).resolve()


def _values(v: object, key: str) -> frozenset[str]:
    if v is None:
        return frozenset()
    items: Sequence[object] = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(x, str) and x for x in items):
        raise RouteConfigError(f"{key}: expected a value or a list of values")
    return frozenset(str(x).lower() for x in items)


def _route(i: int, item: object, ups: Mapping[str, UpstreamHost]) -> Route:
    key = f"routes[{i}]"
    if not isinstance(item, Mapping):
        raise RouteConfigError(f"{key}: expected a mapping")
    for k in item:
        if k not in (*CONDITIONS, "via", "rewrite"):
            raise RouteConfigError(
                f"{key}.{k}: unknown key (conditions: {', '.join(CONDITIONS)}; then via, rewrite)"
            )
    via_raw = item.get("via")
    if via_raw == "mx":
        via: tuple[str, ...] = ()
    elif isinstance(via_raw, list) and via_raw and all(isinstance(x, str) for x in via_raw):
        via = tuple(via_raw)
        for n in via:
            if n not in ups:
                raise RouteConfigError(
                    f"{key}.via: no upstream named {n!r} (upstreams: "
                    f"{', '.join(sorted(ups)) or 'none'})"
                )
        if len(set(via)) != len(via):
            raise RouteConfigError(f"{key}.via: an upstream is named twice")
    else:
        raise RouteConfigError(f"{key}.via: expected a list of upstream names, or mx")
    return Route(
        index=i,
        via=via,
        sender=_values(item.get("sender"), f"{key}.sender"),
        sender_domain=_values(item.get("sender_domain"), f"{key}.sender_domain"),
        recipient_domain=_values(item.get("recipient_domain"), f"{key}.recipient_domain"),
        listener=_values(item.get("listener"), f"{key}.listener"),
        auth_user=_values(item.get("auth_user"), f"{key}.auth_user"),
        rewrite=_rewrite(item.get("rewrite"), f"{key}.rewrite"),
    )


def _rewrite(item: object, key: str) -> Rewrite | None:
    if item is None:
        return None
    if not isinstance(item, Mapping):
        raise RouteConfigError(f"{key}: expected a mapping")
    for k in item:
        if k not in ("envelope_sender", "from", "reply_to_original"):
            raise RouteConfigError(f"{key}.{k}: unknown key")
    from relay.mail.address import AddressError, check_mailbox

    out: dict[str, Any] = {}
    for k, attr in (("envelope_sender", "envelope_sender"), ("from", "from_addr")):
        v = item.get(k)
        if v is not None:
            try:
                check_mailbox(str(v))
            except AddressError as e:
                raise RouteConfigError(f"{key}.{k}: {e}") from None
            out[attr] = str(v)
    rto = item.get("reply_to_original", False)
    if not isinstance(rto, bool):
        raise RouteConfigError(f"{key}.reply_to_original: expected true or false")
    return Rewrite(reply_to_original=rto, **out)
