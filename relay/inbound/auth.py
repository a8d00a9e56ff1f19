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
import binascii
import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
PREFIX = "scrypt"
MAX_FAILURES = 3  # wrong passwords on one connection before `421 4.7.0` and close

_MAXMEM = 64 * 1024 * 1024  # scrypt needs 128 * r * n = 16 MiB; OpenSSL's default is 32 MiB


class UsersFileError(ValueError):
    """A users file that cannot be used; the message never quotes the file's contents."""


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


def parse_hash(stored: str) -> tuple[bytes, bytes]:
    """(salt, digest) of a stored hash; ValueError when it is not in our format."""
    parts = stored.split("$")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise ValueError("not a scrypt$<salt-b64>$<hash-b64> hash")
    try:
        salt = base64.b64decode(parts[1], validate=True)
        digest = base64.b64decode(parts[2], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the salt or the hash is not valid base64") from None
    if not salt or len(digest) < 16:
        raise ValueError("the salt is empty or the hash is too short")
    return salt, digest


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


def parse_users(text: str) -> dict[str, str]:
    """username -> stored hash, from a users file's text."""
    users: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        # the hash never contains ":" (base64 and "$"), so the username may
        name, sep, stored = line.rpartition(":")
        name = name.strip()
        if not sep or not name:
            raise UsersFileError(f"line {n}: expected username:scrypt$<salt>$<hash>")
        try:
            parse_hash(stored.strip())
        except ValueError as e:
            raise UsersFileError(f"line {n}: {e} (make one with `relay auth hash`)") from None
        if name in users:
            raise UsersFileError(f"line {n}: user listed twice")
        users[name] = stored.strip()
    return users


def load_users(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsersFileError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsersFileError(f"{path} is not UTF-8 text") from None
    return parse_users(text)


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
