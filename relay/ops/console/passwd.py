"""`relay admin passwd NAME --role R [--file F]`: a console users_file line. The password
comes from stdin (twice, without echo, on a terminal; else the first line), never from the
command line, and is never printed; the line goes to stdout, or is appended to F (made
0600), replacing none: a name already in F is refused."""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path

from relay.ops.console.auth import UsersFileError, load_users, user_line


def passwd(name: str, role: str, file: str | None) -> int:
    try:
        if sys.stdin.isatty():
            password = getpass.getpass("Password: ")
            if getpass.getpass("Again: ") != password:
                print("relay: the passwords differ", file=sys.stderr)
                return 1
        else:
            password = sys.stdin.readline().rstrip("\r\n")
        line = user_line(name, role, password)
    except (EOFError, KeyboardInterrupt):
        return 1
    except ValueError as e:
        print(f"relay: {e}", file=sys.stderr)
        return 2
    if file is None:
        print(line)
        return 0
    path = Path(file)
    if path.exists():
        try:
            users = load_users(path)
        except UsersFileError as e:
            print(f"relay: {e}", file=sys.stderr)
            return 1
        if name in users:
            print(f"relay: {name} is in {path} already: remove its line first", file=sys.stderr)
            return 1
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size and not _ends_with_newline(path):
            os.write(fd, b"\n")
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    print(f"{name} ({role}) added to {path}")
    return 0


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
