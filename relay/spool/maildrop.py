"""The maildrop: where `relay-sendmail` leaves a message when the daemon does not answer.

Postfix's model (postdrop + pickup): the submitting program writes one file per message
into a folder it may write but not read, and the daemon imports the files into the queue.

Rules:
- Layout (the `make install` target and the systemd unit follow the same rules; keep them
  in step): the folder is `spool.maildrop` (default `<spool.path>/maildrop`), mode 0o3730:
  setgid + sticky, owner (the daemon's user) rwx, group `relay` write + search only. Apps
  in group `relay` may drop files; they cannot list the folder, nor read another app's
  file back, nor remove it (sticky). The setgid bit gives every file the group `relay`,
  which is how the daemon (a member of that group) reads it.
- A file is written as `.tmp-<name>` (mode 0640), fsync'd, renamed to its final name
  `<unix-time-ns>.<16 hex random>.msg`, then the folder is fsync'd (an app that may not
  open the folder, having no read permission on it, fsyncs the renamed file again
  instead: on ext4, XFS and btrfs that commits the journal entry of the rename).
  Temporaries are never imported; one older than STALE_TMP is removed by the daemon.
- The file format, version 1: one line of JSON (`v`, `sender`, `recipients`,
  `created_at`, `uid`, `user`, `size`) ended by LF, then the message's exact bytes
  (`size` of them, CRLF line endings): what relay-sendmail would have sent over SMTP.
- The daemon imports a file through the SMTP listener like any local client (the same
  checks, dedup and spool fsync), and unlinks it only after the relay's 250; a file it
  cannot read or parse goes to `<maildrop>/corrupt/` (relay/spool/pickup.py).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FOLDER_MODE = 0o3730  # setgid + sticky, rwx for the daemon, -wx for group `relay`
FILE_MODE = 0o640
GROUP = "relay"
VERSION = 1
TMP_PREFIX = ".tmp-"
SUFFIX = ".msg"
CORRUPT = "corrupt"
STALE_TMP = 3600.0  # seconds: a temporary this old was left by a writer that died
MAX_HEADER = 1 << 20  # the JSON line: a million recipients' worth is already absurd

# final names only: `<unix-time-ns>.<16 hex>.msg` (linear: no nested quantifier)
_NAME = re.compile(r"[0-9]{1,20}\.[0-9a-f]{16}\.msg")


class MalformedDrop(ValueError):
    """A maildrop file that is not a message we wrote: moved aside, never imported."""


@dataclass(frozen=True, slots=True)
class Drop:
    sender: str
    recipients: tuple[str, ...]
    data: bytes
    created_at: float
    uid: int | None
    user: str


# --- the format (pure) -----------------------------------------------------------------------


def encode(drop: Drop) -> bytes:
    head = {
        "v": VERSION,
        "sender": drop.sender,
        "recipients": list(drop.recipients),
        "created_at": drop.created_at,
        "uid": drop.uid,
        "user": drop.user,
        "size": len(drop.data),
    }
    # ensure_ascii: the line can never hold a raw LF or a byte that is not UTF-8
    return json.dumps(head, ensure_ascii=True, separators=(",", ":")).encode() + b"\n" + drop.data


def decode(raw: bytes) -> Drop:
    """The Drop in `raw`, or MalformedDrop saying what is wrong with it."""
    line, sep, data = raw.partition(b"\n")
    if not sep or len(line) > MAX_HEADER:
        raise MalformedDrop("no header line")
    try:
        head = json.loads(line)
    except ValueError as e:
        raise MalformedDrop(f"header is not JSON: {e}") from None
    if not isinstance(head, dict):
        raise MalformedDrop("header is not a JSON object")
    if head.get("v") != VERSION:
        raise MalformedDrop(f"unknown version {head.get('v')!r}")
    sender, rcpts, size = head.get("sender"), head.get("recipients"), head.get("size")
    created, uid, user = head.get("created_at"), head.get("uid"), head.get("user", "")
    if not isinstance(sender, str):
        raise MalformedDrop("sender is not a string")
    if not isinstance(rcpts, list) or not rcpts or not all(isinstance(r, str) for r in rcpts):
        raise MalformedDrop("recipients is not a non-empty list of strings")
    if not isinstance(size, int) or isinstance(size, bool) or size != len(data):
        raise MalformedDrop(f"size {size!r} does not match the {len(data)} bytes after the header")
    if not isinstance(created, int | float) or isinstance(created, bool):
        raise MalformedDrop("created_at is not a number")
    if uid is not None and (not isinstance(uid, int) or isinstance(uid, bool)):
        raise MalformedDrop("uid is not a number")
    if not isinstance(user, str):
        raise MalformedDrop("user is not a string")
    for text in (sender, *rcpts):
        if any(ch in text for ch in "\r\n\x00<>"):
            raise MalformedDrop("an address holds CR, LF, NUL or angle brackets")
    return Drop(sender, tuple(rcpts), data, float(created), uid, user)


def new_name(now_ns: int | None = None) -> str:
    return f"{time.time_ns() if now_ns is None else now_ns}.{secrets.token_hex(8)}{SUFFIX}"


def is_final(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def created_of(name: str) -> float | None:
    """The creation time a final name carries (seconds), or None."""
    if not is_final(name):
        return None
    return int(name.partition(".")[0]) / 1e9


def resolve(spool_path: Path, maildrop: str | None, base: Path) -> Path:
    """`spool.maildrop` (relative to the config file's folder), else `<spool.path>/maildrop`."""
    if not maildrop:
        return spool_path / "maildrop"
    p = Path(maildrop)
    return p if p.is_absolute() else (base / p).resolve()


# --- writing (relay-sendmail) ----------------------------------------------------------------


def write(folder: Path, drop: Drop) -> Path:
    """Write `drop` durably into `folder`; its final path. Raises OSError (the folder
    missing, not writable by us, the disk full): nothing is left behind then."""
    name = new_name()
    tmp = folder / f"{TMP_PREFIX}{name}"
    final = folder / name
    # O_EXCL|O_NOFOLLOW: never through a planted symlink or over someone's file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the app's umask: the daemon reads by group
            view = memoryview(encode(drop))
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _sync_folder(folder, fd)
    finally:
        os.close(fd)
    return final


def _sync_folder(folder: Path, fd: int) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        # group `relay` has no read permission on the folder, so it cannot open it; an
        # fsync of the renamed file commits the rename on journalling filesystems
        os.fsync(fd)
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# --- the daemon's side -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scan:
    ready: tuple[str, ...]  # final names, oldest first
    others: tuple[str, ...]  # names that are neither final nor temporaries: malformed
    stale: tuple[str, ...]  # temporaries older than STALE_TMP, removed
    corrupt: int  # files in corrupt/


def ensure_folder(folder: Path) -> list[str]:
    """Create the maildrop with FOLDER_MODE (group `relay` when such a group exists) if
    missing; warnings a person should read (a folder with another mode)."""
    warnings: list[str] = []
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(folder).st_mode)
        if mode != FOLDER_MODE:
            warnings.append(
                f"maildrop {folder} has mode {mode:#o}, not {FOLDER_MODE:#o}: apps in group"
                f" {GROUP!r} may not be able to drop mail, or may read each other's"
                " (README: relay-sendmail)"
            )
        return warnings
    try:
        gid = grp.getgrnam(GROUP).gr_gid
    except KeyError:
        gid = None
    if gid is not None:
        try:
            os.chown(folder, -1, gid)
        except PermissionError:
            warnings.append(f"maildrop {folder}: cannot give it to group {GROUP!r}")
    try:
        os.chmod(folder, FOLDER_MODE)  # mkdir's mode is masked by the umask, and never setgid
    except PermissionError:
        # systemd's RestrictSUIDSGID= forbids the setgid bit: the unit's ExecStartPre makes
        # the folder as root instead (systemd/relay.service); without it, sticky alone
        os.chmod(folder, FOLDER_MODE & ~stat.S_ISGID)
        warnings.append(
            f"maildrop {folder}: the setgid bit may not be set here (RestrictSUIDSGID?);"
            f" files dropped in it keep their apps' groups (README: relay-sendmail)"
        )
    return warnings


def scan(folder: Path, now: float) -> Scan:
    """What the folder holds (one listdir; cheap when empty). Removes stale temporaries."""
    ready: list[tuple[float, str]] = []
    others: list[str] = []
    stale: list[str] = []
    corrupt = 0
    with os.scandir(folder) as it:
        for entry in it:
            name = entry.name
            if name == CORRUPT:
                continue
            if name.startswith(TMP_PREFIX):
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP:
                        os.unlink(entry.path)
                        stale.append(name)
                except FileNotFoundError:
                    pass
                continue
            created = created_of(name)
            if created is None:
                others.append(name)
            else:
                ready.append((created, name))
    try:
        corrupt = sum(1 for _ in os.scandir(folder / CORRUPT))
    except FileNotFoundError:
        corrupt = 0
    ready.sort()
    return Scan(tuple(n for _c, n in ready), tuple(sorted(others)), tuple(stale), corrupt)


def read(path: Path, max_size: int | None = None) -> Drop:
    """The drop in `path`. MalformedDrop for a file that is not one (not a regular file,
    or larger than `max_size` plus its header line: never read whole into memory);
    FileNotFoundError when it is gone (another importer took it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MalformedDrop("not a regular file")
        if max_size is not None and st.st_size > max_size + MAX_HEADER:
            raise MalformedDrop(f"{st.st_size} bytes: larger than limits.max_message_size")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return decode(b"".join(chunks))


def move_aside(folder: Path, name: str) -> Path:
    """Move `name` into `<folder>/corrupt/` (created 0700 if missing); its new path."""
    dest = folder / CORRUPT
    try:
        os.mkdir(dest, 0o700)
    except FileExistsError:
        pass
    target = dest / name
    os.rename(folder / name, target)
    return target


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def entries(folder: Path) -> list[dict[str, Any]]:
    """The files waiting in the maildrop as `relay queue list` shows them (state
    `maildrop`, id = file name). What cannot be read is still listed, with what is known."""
    out: list[dict[str, Any]] = []
    try:
        names = scan_names(folder)
    except FileNotFoundError:
        return out
    for name in names:
        created = created_of(name) or 0.0
        row: dict[str, Any] = {
            "id": name,
            "state": "maildrop",
            "message_id": None,
            "sender": "",
            "size": 0,
            "created_at": created,
            "attempts": 0,
            "next_attempt_at": None,
            "lane": None,
            "recipients": [],
        }
        try:
            drop = read_head(folder / name)
        except FileNotFoundError:
            continue  # imported meanwhile
        except (OSError, MalformedDrop) as e:
            row["error"] = str(e)
        else:
            row["sender"] = drop.sender
            row["size"] = drop.size
            row["user"] = drop.user
            row["recipients"] = [
                {
                    "address": r,
                    "state": "maildrop",
                    "attempts": 0,
                    "last_reply": None,
                    "destination": r.rpartition("@")[2].lower(),
                    "next_attempt_at": None,
                    "reason": "waiting for the daemon to import it",
                    "upstream_id": None,
                }
                for r in drop.recipients
            ]
        out.append(row)
    return out


@dataclass(frozen=True, slots=True)
class Head:
    sender: str
    recipients: tuple[str, ...]
    size: int
    user: str


def read_head(path: Path) -> Head:
    """A file's header line only (the CLI's listing: a large message is not read)."""
    with open(path, "rb") as f:
        line = f.readline(MAX_HEADER + 1)
    if not line.endswith(b"\n"):
        raise MalformedDrop("no header line")
    try:
        head = json.loads(line)
        return Head(
            str(head["sender"]),
            tuple(str(r) for r in head["recipients"]),
            int(head["size"]),
            str(head.get("user", "")),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise MalformedDrop(f"bad header line: {e}") from None


def scan_names(folder: Path) -> list[str]:
    """Final names, oldest first (no side effects: the CLI's view)."""
    named = [(c, n) for n in os.listdir(folder) if (c := created_of(n)) is not None]
    return [n for _c, n in sorted(named)]
