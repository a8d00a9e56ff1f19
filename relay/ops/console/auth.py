"""The console's access control (pure apart from `load_key`): users, sessions, CSRF.

Rules:
- A users file (`admin.users_file`) holds one `name:role:hash` per line; blank lines and
  lines starting with `#` are ignored. Roles: `viewer` (reads) and `operator` (reads and
  acts). The hash is relay/inbound/auth.py's self-describing `scrypt$<salt-b64>$<hash-b64>`
  (hashlib.scrypt; `relay admin passwd NAME --role R` prints a line). An error names the
  line number only, never the line (it could hold a hash).
- A session is a signed cookie: `<payload-b64>.<hmac-sha256-b64>` where the payload is JSON
  (user, role, session id, expiry). The key (32 random bytes) is kept in the spool folder,
  0600, made at first start: a restart keeps sessions; deleting the file logs everyone out.
- The CSRF token of a session is HMAC(key, "csrf:" + session id): every POST carries it in
  a form field, compared in constant time; a missing or wrong one gets 403.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from relay.config.users import (  # the users file is read with the config
    ROLES,
    User,
    UsersFileError,
    valid_name,
)
from relay.config.users import load_console_users as load_users
from relay.config.users import parse_console_users as parse_users
from relay.inbound.auth import hash_password, verify_password

SESSION_TTL = 12 * 3600.0
KEY_FILE = "console.key"
COOKIE = "relay_console"

__all__ = [
    "ROLES",
    "User",
    "UsersFileError",
    "hash_password",
    "load_users",
    "parse_users",
    "valid_name",
    "verify_password",
]


@dataclass(frozen=True, slots=True)
class Session:
    user: str
    role: str
    sid: str
    expires: float

    @property
    def can_act(self) -> bool:
        return self.role == "operator"


def user_line(name: str, role: str, password: str) -> str:
    """One users-file line: `name:role:scrypt$...`."""
    if not valid_name(name):
        raise ValueError("a name is 1-64 printable characters, no ':' and no leading '#'")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if not password:
        raise ValueError("empty password")
    return f"{name}:{role}:{hash_password(password)}"


def check_login(users: dict[str, User], name: str, password: str) -> User | None:
    """The user when the password is right (one scrypt either way: timing does not tell
    which names exist). Blocking: run it off the event loop."""
    user = users.get(name)
    ok = verify_password(password, user.hash if user is not None else None)
    return user if ok and user is not None else None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_session(user: str, role: str, now: float, ttl: float = SESSION_TTL) -> Session:
    return Session(user, role, secrets.token_urlsafe(16), now + ttl)


def sign_session(key: bytes, s: Session) -> str:
    payload = json.dumps(
        {"u": s.user, "r": s.role, "s": s.sid, "e": round(s.expires)}, separators=(",", ":")
    ).encode()
    mac = hmac.new(key, b"session:" + payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}"


def verify_session(key: bytes, value: str, now: float) -> Session | None:
    """The session a cookie value carries, or None (forged, altered, expired, malformed)."""
    head, dot, tail = value.partition(".")
    if not dot or len(value) > 1024:
        return None
    try:
        payload = _unb64(head)
        mac = _unb64(tail)
    except (binascii.Error, ValueError):
        return None
    want = hmac.new(key, b"session:" + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, want):
        return None
    try:
        doc = json.loads(payload)
        s = Session(str(doc["u"]), str(doc["r"]), str(doc["s"]), float(doc["e"]))
    except (ValueError, KeyError, TypeError):
        return None
    if s.expires <= now or s.role not in ROLES:
        return None
    return s


def csrf_token(key: bytes, s: Session) -> str:
    return _b64(hmac.new(key, b"csrf:" + s.sid.encode(), hashlib.sha256).digest())


def csrf_ok(key: bytes, s: Session, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(token.encode(), csrf_token(key, s).encode())


def parse_cookies(header: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in header.split(";"):
        name, eq, value = part.strip().partition("=")
        if eq and name not in out:
            out[name] = value.strip().strip('"')
    return out


def cookie_header(value: str, *, secure: bool, max_age: int | None = None) -> str:
    """Set-Cookie: HttpOnly (no script reads it), SameSite=Strict (no other site's form or
    link carries it), Secure when the listener speaks TLS; Path=/console."""
    parts = [f"{COOKIE}={value}", "Path=/console", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def load_key(folder: Path) -> bytes:
    """The signing key in `folder` (made at first use, 0600)."""
    path = folder / KEY_FILE
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{KEY_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # the first of two starting at once wins; both read its key
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()
