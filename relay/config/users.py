"""The users files the config names, read and checked when it loads (start, SIGHUP): a
bad line is a config error naming the line, never quoting it (it could be a password).

- `listen[].auth.users_file`: `username:scrypt$<salt-b64>$<hash-b64>` lines, SMTP AUTH
  (relay/inbound/auth.py checks passwords against them).
- `admin.users_file`: `name:role:scrypt$...` lines, the operator console
  (relay/ops/console/auth.py).
Blank lines and lines starting with `#` are ignored in both. The hash format is
relay/inbound/auth.py's (`relay auth hash`, `relay admin passwd` make one).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path

PREFIX = "scrypt"
ROLES = ("viewer", "operator")


class UsersFileError(ValueError):
    """A users file that cannot be used; the message never quotes the file's contents."""


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


# --- listen[].auth.users_file ------------------------------------------------------------


def parse_smtp_users(text: str) -> dict[str, str]:
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


def read_users_file(path: Path) -> str:
    """A users file's text (both kinds): UTF-8, or a UsersFileError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsersFileError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsersFileError(f"{path} is not UTF-8 text") from None
    return text


def load_smtp_users(path: Path) -> dict[str, str]:
    return parse_smtp_users(read_users_file(path))


# --- admin.users_file --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class User:
    name: str
    role: str
    hash: str


def valid_name(name: str) -> bool:
    return (
        bool(name)
        and len(name) <= 64
        and name == name.strip()
        and not name.startswith("#")
        and all(c.isprintable() and c not in ":\r\n\0" for c in name)
    )


def parse_console_users(text: str) -> dict[str, User]:
    users: dict[str, User] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) != 3 or not valid_name(parts[0]):
            raise UsersFileError(f"line {n}: expected name:role:scrypt$<salt>$<hash>")
        name, role, stored = parts
        if role not in ROLES:
            raise UsersFileError(f"line {n}: the role is not one of {', '.join(ROLES)}")
        try:
            parse_hash(stored)
        except ValueError as e:
            raise UsersFileError(f"line {n}: {e} (make one with `relay admin passwd`)") from None
        if name in users:
            raise UsersFileError(f"line {n}: user listed twice")
        users[name] = User(name, role, stored)
    return users


def load_console_users(path: Path) -> dict[str, User]:
    return parse_console_users(read_users_file(path))
