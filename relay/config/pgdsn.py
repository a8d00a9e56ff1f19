"""A PostgreSQL DSN's secrets (`spool.dsn`): hidden wherever a DSN is shown, and told to the
log formatter.

Rules:
- `redact` replaces a password written into the DSN with `***` (a URL's userinfo and query
  values, a key=value list's `password=`); a DSN that cannot be parsed shows as
  `<unparsable dsn>`, never as itself.
- `dsn_passwords` are every spelling of the passwords the DSN holds inline (quoted and
  unquoted), for relay.ops.logs.set_secrets.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

import psycopg


def redact(dsn: str) -> str:
    """The DSN with any password replaced by ***, for logs and messages (a URL's query
    values too: `?password=` is a libpq parameter)."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<unparsable dsn>"
    if parts.scheme in ("postgres", "postgresql"):
        from relay.ops.logs import redact_url

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
    try:
        out.append(str(psycopg.conninfo.conninfo_to_dict(dsn).get("password") or ""))
    except psycopg.Error:
        pass
    return tuple(unquote(p) for p in out if p) + tuple(p for p in out if p)
