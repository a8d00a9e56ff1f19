"""How the config's secrets print (README "Secrets"): a URL loses its userinfo password,
query values and fragment; a webhook URL (Slack, Teams, Google Chat put the secret in the
path) shows its scheme and host only; a PostgreSQL DSN loses its password. Pure functions:
the log formatter (relay/ops/logs.py) and the spool (relay/spool/pg.py) use them too.

Below them, the config's own: `redacted(config)` (check-config's view of the file, every
secret named by its file only) and `secrets(config)` (each secret value the config holds,
for the log formatter to replace); Config.redacted() and Config.secrets() call them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import unquote, urlsplit

MASK: Final = "***"

# A URL inside free text: a scheme, "://", then everything up to white space or a quote or
# bracket. The lookbehind starts a match only at the beginning of a run of scheme characters,
# so a long run without "://" is scanned once (linear time).
URL_RE: Final = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]+")


def _userinfo_host(netloc: str, keep_user: bool) -> tuple[str, str]:
    """(redacted userinfo with its "@", host[:port]) of a URL's netloc."""
    userinfo, at, host = netloc.rpartition("@")
    if not at:
        return "", netloc
    user, colon, _password = userinfo.partition(":")
    if not keep_user:
        return f"{MASK}@", host
    return (f"{user}:{MASK}@" if colon else f"{user}@"), host


def redact_url(url: str) -> str:
    """A URL fit to print: the password of its userinfo (``user:***@``), every query value
    (``?token=***``) and the fragment replaced; scheme, host, port and path kept. The
    general rule for URLs in logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = len(rest)
    for c in "/?#":
        i = rest.find(c)
        if i != -1:
            end = min(end, i)
    userinfo, host = _userinfo_host(rest[:end], keep_user=True)
    tail = rest[end:]
    path, q, query = tail.partition("?")
    frag = ""
    if not q:
        path, h, _f = path.partition("#")
        frag = f"#{MASK}" if h else ""
    else:
        query, h, _f = query.partition("#")
        frag = f"#{MASK}" if h else ""
        items = []
        for item in query.split("&"):
            name, eq, _v = item.partition("=")
            items.append(f"{name}={MASK}" if eq else (MASK if item else ""))
        path += "?" + "&".join(items)
    return f"{scheme}://{userinfo}{host}{path}{frag}"


def redact_webhook_url(url: str) -> str:
    """A webhook URL fit to print: scheme and host[:port] only, anything after it ``/***``.
    Slack, Teams and Google Chat put the secret in the path itself
    (hooks.slack.com/services/T/B/XXX), so no part of the path or query is shown."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return MASK
    end = len(rest)
    for c in "/?#":
        i = rest.find(c)
        if i != -1:
            end = min(end, i)
    userinfo, host = _userinfo_host(rest[:end], keep_user=False)
    return f"{scheme}://{userinfo}{host}" + (f"/{MASK}" if rest[end:].strip("/") else "")


MIN_SECRET: Final = 6  # shorter values would blank out ordinary words


def secret_pairs(secrets: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """(secret, what prints instead) pairs for `replace_secrets`: longest first, so a secret
    that contains another goes whole; values shorter than MIN_SECRET left out."""
    pairs = {k: v for k, v in secrets.items() if len(k) >= MIN_SECRET}
    return tuple(sorted(pairs.items(), key=lambda kv: -len(kv[0])))


def replace_secrets(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for secret, shown in pairs:
        if secret in text:
            text = text.replace(secret, shown)
    return text


def redact_urls(text: str) -> str:
    """Every URL in `text` through `redact_url`."""
    if "://" not in text:
        return text
    return URL_RE.sub(lambda m: redact_url(m.group(0)), text)


def redact_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ***, for logs and messages (a URL's query
    values too: `?password=` is a libpq parameter)."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<unparsable dsn>"
    if parts.scheme in ("postgres", "postgresql"):
        return redact_url(dsn)
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", dsn)


def dsn_passwords(dsn: str) -> tuple[str, ...]:
    """The passwords a DSN holds inline (URL userinfo, `?password=`, `password=` of a
    key=value list); the log formatter is told to hide them."""
    out = []
    try:
        out.append(urlsplit(dsn).password or "")
    except ValueError:
        pass
    import psycopg  # the libpq parser: only a PostgreSQL spool's config has a DSN

    try:
        out.append(str(psycopg.conninfo.conninfo_to_dict(dsn).get("password") or ""))
    except psycopg.Error:
        pass
    return tuple(unquote(p) for p in out if p) + tuple(p for p in out if p)


def redact_tree(node: Any, pairs: tuple[tuple[str, str], ...]) -> Any:
    """Every string in the tree that holds a URL: the config's secrets replaced, then each
    URL through redact_url (what relay.ops.logs.redact_text does once they are registered)."""
    if isinstance(node, dict):
        return {k: redact_tree(v, pairs) for k, v in node.items()}
    if isinstance(node, list):
        return [redact_tree(v, pairs) for v in node]
    if isinstance(node, str) and "://" in node:
        return redact_urls(replace_secrets(node, pairs))
    return node
