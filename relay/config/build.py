"""From the validated sections to the frozen tree (relay/config/records.py): the checks
between sections and the values one section takes from another.

Rules:
- Each collection's entries are validated one by one here (their key paths: `listen[0]`,
  `destinations."*"`, `dkim.example.com[1]`), every error appended, a bad entry left out.
- Between sections: a named destination inherits every key it does not set from "*", its
  timeouts from `timeouts`; `local.domain` and `upstream.helo` default to the hostname; the
  outbox needs a PostgreSQL spool, where every body lives in its row; routes name upstreams
  (relay/config/routes.py); each DKIM key is loaded now (a bad key is a config error).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.config import routes as routing
from relay.config import values as types
from relay.config.models import (
    FEEDBACK_PROVIDERS,
    DestinationSection,
    DkimEntrySection,
    FeedbackSection,
    IdentitySection,
    ListenerSection,
    MailgunProvider,
    Sections,
    SendgridProvider,
    SesProvider,
)
from relay.config.records import (
    Alerts,
    AuthLimits,
    Config,
    Delivery,
    Destination,
    Dsn,
    FeedbackConf,
    FeedbackProvider,
    FleetConf,
    Health,
    HttpBounds,
    Identity,
    LanesConf,
    Limits,
    Listener,
    ListenerAuth,
    ListenerTLS,
    Local,
    LogConf,
    MxMode,
    OutboxConf,
    PgSpool,
    Retry,
    ShapingConf,
    Smarthost,
    UnsubscribeConf,
    Upstream,
    WarmupConf,
    Webhook,
)
from relay.config.report import ConfigError, shown, validate
from relay.config.sections.inbound import AliasesFile

if TYPE_CHECKING:  # dkimpy, dnspython and cryptography load only when a key does
    from relay.authenticity.dkim import DkimKey


def build(
    data: Mapping[str, Any],
    merged: dict[str, Any],
    base_dir: Path,
    path: Path | None,
    typed: Sections,
    errors: list[str],
) -> Config:
    """The Config of the validated sections and collections; every error appended."""
    top = typed.top
    hostname = top.hostname or socket.getfqdn()
    sp = typed.spool
    spool_path = sp.path or base_dir  # never None: its model requires it
    spool_pg = None if sp.backend == "sqlite" else PgSpool(sp.dsn or "", sp.password_file)
    limits = Limits(**typed.limits.model_dump())
    upstream = _upstream(typed, hostname)
    timeouts = typed.timeouts.model_dump()
    raw_dest = data.get("destinations")
    sg, admin = typed.shaping, typed.admin
    return Config(
        path=path,
        hostname=hostname,
        hostname_set=bool(top.hostname),
        listen=listeners(merged["listen"], base_dir, errors, fleet=typed.spool.backend != "sqlite"),
        spool_path=spool_path,
        # on PostgreSQL every body lives in its row: the nodes of a fleet share no disk
        inline_max=sp.inline_max
        if spool_pg is None
        else max(sp.inline_max, limits.max_message_size),
        dedup_window=typed.dedup.window,
        limits=limits,
        upstream=upstream,
        retry=Retry(**typed.retry.model_dump()),
        timeouts=timeouts,
        destinations=destinations(
            {"*": {}, **raw_dest} if isinstance(raw_dest, Mapping) else merged["destinations"],
            timeouts,
            errors,
        ),
        identities=identities(merged["identities"], base_dir, errors),
        shaping=ShapingConf(sg.window_tz, sg.window_length, sg.identity_by, tuple(sg.rules or ())),
        lanes=LanesConf(
            typed.lanes.rules,
            {"transactional": typed.lanes.transactional.share, "bulk": typed.lanes.bulk.share},
        ),
        delivery=Delivery(**typed.delivery.model_dump()),
        alerts=_alerts(typed),
        dsn=Dsn(**typed.dsn.model_dump()),
        admin_listen=admin.listen,
        admin_http=HttpBounds(
            max_connections=admin.max_connections,
            max_connections_per_ip=admin.max_connections_per_ip,
        ),
        admin_console=admin.console,
        admin_users_file=admin.users_file,
        log=LogConf(**typed.log.model_dump()),
        shutdown_timeout=top.shutdown_timeout,
        raw=merged,
        auth=AuthLimits(**typed.auth.model_dump()),
        local=local(typed, hostname, errors),
        retention=sp.retention,
        spool_reserve=sp.reserve,
        spool_gather=sp.gather,
        health=Health(**typed.health.model_dump()),
        routing=_routing(merged, upstream, base_dir, errors),
        feedback=feedback(typed.feedback),
        dkim=dkim(merged["dkim"], base_dir, errors),
        spool_pg=spool_pg,
        fleet=FleetConf(node=typed.fleet.node or None, lease=typed.fleet.lease or 30.0),
        outbox=_outbox(typed, spool_pg, errors),
        inbound_processes=auto_inbound_processes(typed.inbound.processes),
        maildrop_path=sp.maildrop or spool_path / "maildrop",
    )


def _outbox(typed: Sections, spool_pg: PgSpool | None, errors: list[str]) -> OutboxConf:
    ob = typed.outbox
    outbox = OutboxConf(
        enabled=bool(ob.enabled), poll_interval=ob.poll_interval or 1.0, batch=ob.batch or 100
    )
    if outbox.enabled and spool_pg is None:
        errors.append(
            "outbox.enabled: the outbox is a table of a PostgreSQL spool"
            " (spool.backend: postgresql)"
        )
    return outbox


def _routing(
    merged: Mapping[str, Any], upstream: Upstream, base_dir: Path, errors: list[str]
) -> routing.Routing:
    """`upstreams` and `routes` (relay/config/routes.py); `upstream.smarthost` is the
    upstream named "smarthost" unless one is."""
    smart = upstream.smarthost
    try:
        return routing.parse(
            merged.get("upstreams"),
            merged.get("routes"),
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
        )
    except routing.RouteConfigError as e:
        errors.extend(str(e).splitlines())
        return routing.Routing({}, ())


def _alerts(typed: Sections) -> Alerts:
    al, wh = typed.alerts, typed.alerts.webhook
    return Alerts(
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


def _upstream(typed: Sections, hostname: str) -> Upstream:
    up = typed.upstream
    smh, mx = up.smarthost, up.mx
    return Upstream(
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


def local(typed: Sections, hostname: str, errors: list[str]) -> Local:
    """local: the domain bare local parts are qualified with (the hostname unless set), and
    the aliases (a mapping, or an aliases(5) file) qualified with it."""
    lo = typed.local
    domain = lo.domain or hostname
    if lo.domain is None and not _domain_ok(domain):
        errors.append(f"local.domain: {domain!r} is not a domain")
        return Local(hostname or "localhost")
    try:
        if isinstance(lo.aliases, AliasesFile):
            where = f"local.aliases ({lo.aliases.path})"
            return Local(domain, parse_aliases(lo.aliases.text, domain, where))
        lines = [f"{k}: {', '.join(v)}" for k, v in lo.aliases.items()]
        return Local(domain, parse_aliases("\n".join(lines), domain, "local.aliases"))
    except ConfigError as e:
        errors.append(str(e))
        return Local(domain)


def _domain_ok(domain: str) -> bool:
    from relay.mail.address import AddressError, check_domain

    try:
        check_domain(domain)
    except AddressError:
        return False
    return True


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


# the dedup namespace of a PostgreSQL spool's unauthenticated clients whose listener sets no
# `namespace` (dedup keys hash `listener:fleet`; on SQLite the default stays the address)
FLEET_NAMESPACE = "fleet"


def listeners(
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
        m = validate(
            ListenerSection, {} if item is None else item, key, errors, base=base_dir, key=key
        )
        if m is None:
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
                    cert_file=tls.cert_file,
                    key_file=tls.key_file,
                    context=tls.context,
                    mode=tls.mode,
                ),
                require_tls=bool(m.require_tls),
                auth=None
                if auth is None
                else ListenerAuth(
                    users_file=auth.users_file,
                    allow_plaintext=bool(auth.allow_plaintext),
                    users=auth.users,
                ),
            )
        )
    return tuple(out)


def destinations(
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
    key = (
        f"destinations.{name}"
        if re.fullmatch(r"[\w.-]+", name)
        else f'destinations."{shown(name)}"'  # a key from the file, escaped
    )
    if not isinstance(data, Mapping):
        errors.append(f"{key}: expected a mapping")
        return None
    d = validate(DestinationSection, {**star, **data}, key, errors)
    if d is None:
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


def identities(raw: object, base_dir: Path, errors: list[str]) -> dict[str, Identity]:
    """`identities`: each validated once (its secret files read); errors appended."""
    if not isinstance(raw, Mapping):
        errors.append("identities: expected a mapping")
        return {}
    out = {}
    for name, data in raw.items():
        key = f"identities.{shown(str(name))}"
        if not isinstance(data, Mapping):
            errors.append(f"{key}: expected a mapping")
            continue
        ident = validate(IdentitySection, data, key, errors, base=base_dir)
        if ident is None:
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


def dkim(raw: object, base: Path, errors: list[str]) -> dict[str, tuple[DkimKey, ...]]:
    """`dkim: {<domain>: {selector, key_file, algorithm?, headers?}}`, or a list of such
    mappings per domain (RSA and Ed25519 side by side, RFC 8463). Each key is read and
    checked now: a missing or unusable key is a config error (exit 78), never a surprise
    per message."""
    if not isinstance(raw, Mapping):
        errors.append("dkim: expected a mapping of sending domains")
        return {}
    keys: list[DkimKey] = []
    for domain, entries in raw.items():
        listed = entries if isinstance(entries, list) else [entries]
        for i, entry in enumerate(listed):
            key = f"dkim.{shown(str(domain))}" + (f"[{i}]" if isinstance(entries, list) else "")
            e = validate(DkimEntrySection, {} if entry is None else entry, key, errors, base=base)
            if e is None:
                continue
            # dkimpy, dnspython and cryptography: only a config with a key pays for them
            from relay.authenticity import dkim as dkim_sign

            try:
                keys.append(
                    dkim_sign.load_key(
                        str(domain),
                        e.selector,
                        e.key_file,
                        e.algorithm or "rsa-sha256",
                        None if e.headers is None else list(e.headers),
                    )
                )
            except dkim_sign.DkimConfigError as err:
                errors.append(f"{key}: {err}")
    if not keys:
        return {}
    from relay.authenticity import dkim as dkim_sign

    try:
        return dkim_sign.by_domain(keys)
    except dkim_sign.DkimConfigError as err:
        errors.append(str(err))
        return {}


def feedback(fb: FeedbackSection) -> FeedbackConf:
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
