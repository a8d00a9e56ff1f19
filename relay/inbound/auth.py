"""Inbound SMTP AUTH: password hashes, the users file, and the per-connection failure limit.

Rules:
- A users file holds one `username:hash` per line; blank lines and lines starting with `#`
  are ignored. The hash is `scrypt$<salt-b64>$<hash-b64>` (hashlib.scrypt, n=2**14, r=8,
  p=1): operators never store a plaintext password (`relay auth hash` makes the hash).
- The file is read when the config is loaded (at start and on SIGHUP). Its contents are never
  logged, and an error names the line number only, never the line (it could be a password).
- Verification is constant-time in the hash (hmac.compare_digest) and costs one scrypt
  whether or not the user exists, so timing does not reveal which usernames exist.
- One scrypt (n=2**14) costs ~16 MiB and a few tens of ms of CPU. The daemon runs `check`
  in a small thread pool, never in the event loop (relay/inbound/guard.py; hashlib.scrypt releases
  the GIL); the CPU is still spent, so a connection gets at most MAX_FAILURES wrong attempts
  and an IP is slowed down and banned across connections (relay/inbound/anvil.py).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Mapping

# the users file and the hash format are read with the config (relay/config/users.py)
from relay.config.users import PREFIX as PREFIX
from relay.config.users import UsersFileError as UsersFileError
from relay.config.users import load_smtp_users, parse_smtp_users
from relay.config.users import parse_hash as parse_hash

load_users = load_smtp_users  # the users file: username:scrypt$<salt>$<hash> lines
parse_users = parse_smtp_users

SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
MAX_FAILURES = 3  # wrong passwords on one connection before `421 4.7.0` and close

_MAXMEM = 64 * 1024 * 1024  # scrypt needs 128 * r * n = 16 MiB; OpenSSL's default is 32 MiB


def _scrypt(password: bytes, salt: bytes, dklen: int) -> bytes:
    return hashlib.scrypt(
        password, salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=_MAXMEM, dklen=dklen
    )


def hash_password(password: str | bytes, salt: bytes | None = None) -> str:
    """`scrypt$<salt-b64>$<hash-b64>` for a password (UTF-8 when given as text)."""
    pw = password.encode("utf-8") if isinstance(password, str) else password
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    digest = _scrypt(pw, salt, HASH_BYTES)
    return (
        f"{PREFIX}${base64.b64encode(salt).decode('ascii')}"
        f"${base64.b64encode(digest).decode('ascii')}"
    )


# A well-formed hash of a random password: unknown users cost one scrypt too.
_DUMMY = (b"\x00" * SALT_BYTES, b"\x00" * HASH_BYTES)


def verify_password(password: str | bytes, stored: str | None) -> bool:
    """True when `password` matches `stored`. A missing or malformed `stored` still costs one
    scrypt and answers False."""
    pw = password.encode("utf-8") if isinstance(password, str) else password
    try:
        salt, digest = parse_hash(stored) if stored is not None else _DUMMY
        ok = stored is not None
    except ValueError:
        salt, digest = _DUMMY
        ok = False
    candidate = _scrypt(pw, salt, len(digest))
    return hmac.compare_digest(candidate, digest) and ok


def check(users: Mapping[str, str], login: bytes, password: bytes) -> str | None:
    """The username when the credentials are right, else None (constant work either way)."""
    try:
        name = login.decode("utf-8")
    except UnicodeDecodeError:
        name = None
    stored = users.get(name) if name is not None else None
    if verify_password(password, stored) and name is not None:
        return name
    return None


def mask_user(name: str) -> str:
    """A username for the logs: like an address's local part, first character + `***`
    (`alice` -> `a***`, `app@example.com` -> `a***@example.com`)."""
    local, at, domain = name.rpartition("@")
    if at and local:
        return f"{local[:1]}***@{domain.lower()}"
    return f"{name[:1]}***" if name else "***"
