"""Everything `relay` relies on inside aiosmtpd that is not its documented API, in one place.

Rules:
- `check()` runs at start (relay/daemon.py) and refuses to start, with a message naming the
  missing piece, when an aiosmtpd release no longer has an internal listed here; the
  version is also bounded in pyproject.toml. tests/test_smtpd_adapter.py pins each one.
- What we use, and why:
  * `SMTP._reader` (the connection's StreamReader, set by `_cb_client_connected`): our
    `smtp_DATA`, `challenge_auth` and the strict command-line reader read from it.
  * `SMTP._cb_client_connected(reader, writer)`: the moment the reader is known, to give it
    the strict line discipline below.
  * `SMTP._reset_timeout()` / `_set_post_data_state()`: our `smtp_DATA` keeps the idle
    timer alive while bytes arrive and resets the transaction after the final dot.
  * `asyncio.StreamReader._buffer`: to put back what a block read took past the final dot,
    and to drop pipelined commands after our 421.
  * `aiosmtpd.smtp.inspect` / `aiosmtpd.smtp.dir`: module globals that `SMTP.__init__`
    calls per connection; replaced with per-class caches (CPU, see `_ClassInspect`).
- The strict line discipline (RFC 5321 §2.3.8: lines end with CRLF; a bare CR or LF is
  never a line ending, as Postfix 3.9's `smtpd_forbid_bare_newline`): a command line that
  contains a CR or LF other than its final CRLF is answered `500 5.5.2` and the connection
  is closed, so nothing of that line, and nothing a client pipelined after it, is acted on.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import aiosmtpd
import aiosmtpd.smtp
from aiosmtpd.smtp import SMTP

BARE_NEWLINE_REPLY = b"500 5.5.2 Syntax error: bare CR or LF in command line (RFC 5321 2.3.8)\r\n"


class AdapterError(RuntimeError):
    pass


def check() -> None:
    """Raise AdapterError naming what is missing in the installed aiosmtpd."""
    missing = [
        name
        for name in (
            "_cb_client_connected",
            "_handle_client",
            "check_helo_needed",
            "check_auth_needed",
            "challenge_auth",
            "push",
            "smtp_DATA",
            "_set_post_data_state",
            "_reset_timeout",
        )
        if not callable(getattr(SMTP, name, None))
    ]
    for glob in ("inspect",):
        if not hasattr(aiosmtpd.smtp, glob):
            missing.append(f"aiosmtpd.smtp.{glob}")
    src = inspect.getsource(SMTP.__init__)
    if "inspect.getmembers" not in src or "dir(self)" not in src:
        missing.append("SMTP.__init__ scanning members with inspect.getmembers / dir(self)")
    if "self._buffer = bytearray()" not in inspect.getsource(asyncio.StreamReader.__init__):
        missing.append("asyncio.StreamReader._buffer (a bytearray)")
    cb = getattr(SMTP, "_cb_client_connected", None)
    if cb is not None and "self._reader" not in inspect.getsource(cb):
        missing.append("SMTP._cb_client_connected setting self._reader")
    if missing:
        version = getattr(aiosmtpd, "__version__", "?")
        raise AdapterError(
            f"aiosmtpd {version} lacks what relay relies on: {', '.join(missing)}; "
            "install a supported version (see pyproject.toml)"
        )


class StrictLineReader(asyncio.StreamReader):
    """A StreamReader whose line reads (separator LF: aiosmtpd's command loop and AUTH
    challenges) accept only lines ending in CRLF with no other CR or LF. On a bare one it
    calls `on_bare_newline` (which answers and closes) and then waits to be cancelled by the
    connection's end, so the line is never returned to aiosmtpd."""

    on_bare_newline: Callable[[], None]
    relay_in_tail: bool

    async def readuntil(self, separator: Any = b"\n") -> bytes:
        try:
            line = await super().readuntil(separator)
        except asyncio.LimitOverrunError:
            # aiosmtpd drops an over-long line (`read(consumed)` up to its separator) and
            # answers 500; the tail we return next is of that refused line, unchecked.
            self.relay_in_tail = True
            raise
        if separator != b"\n":
            return line
        if self.relay_in_tail:
            self.relay_in_tail = False
            return line
        if line.endswith(b"\r\n") and b"\r" not in line[:-2]:
            return line
        self.on_bare_newline()
        await asyncio.get_running_loop().create_future()  # cancelled by connection_lost
        raise AssertionError("unreachable")


def make_strict(reader: asyncio.StreamReader, on_bare_newline: Callable[[], None]) -> None:
    """Give aiosmtpd's per-connection StreamReader the strict line discipline, in place
    (the reader is created inside `SMTP.__init__` and already wired to the transport)."""
    reader.__class__ = StrictLineReader
    cast_reader: Any = reader
    cast_reader.on_bare_newline = on_bare_newline
    cast_reader.relay_in_tail = False


def unread(reader: asyncio.StreamReader, data: bytes) -> None:
    """Put back bytes read past the end of a DATA (pipelined commands, RFC 2920) so that
    aiosmtpd's command loop reads them next. StreamReader has no public unread; its buffer
    is a bytearray we prepend to (checked by `check()`)."""
    buf: bytearray = reader._buffer  # type: ignore[attr-defined]
    buf[0:0] = data


def discard_unread(reader: asyncio.StreamReader) -> None:
    """Drop the commands a client pipelined that were not read yet: after our 421 the
    session must act on none of them (RFC 5321 §3.8). Cancelling the command loop is not
    enough: the cancel lands at its next real wait, and reading a line that is already
    buffered does not wait."""
    buf: bytearray = reader._buffer  # type: ignore[attr-defined]
    buf.clear()


def reader_of(proto: SMTP) -> asyncio.StreamReader:
    reader: asyncio.StreamReader = proto._reader
    return reader


class _ClassInspect:
    """aiosmtpd's `SMTP.__init__` runs `inspect.getmembers` on the protocol and on the
    handler, and `inspect.signature` on the EHLO hook, for every connection: about 200 us,
    a tenth of a core at a few hundred connections a second. The answers depend only on the
    classes, so we compute them once per class and bind them to each instance. Its only use
    of getmembers keeps the `auth_*` members, so that is all we return."""

    def __init__(self) -> None:
        self._names: dict[type, list[str]] = {}
        self._sigs: dict[object, inspect.Signature] = {}

    def getmembers(self, obj: object) -> list[tuple[str, Any]]:
        names = self._names.get(type(obj))
        if names is None:
            names = [n for n, _ in inspect.getmembers(obj) if n.startswith("auth_")]
            self._names[type(obj)] = names
        return [(n, getattr(obj, n)) for n in names]

    def signature(self, fn: Any) -> inspect.Signature:
        key = getattr(fn, "__func__", fn)
        sig = self._sigs.get(key)
        if sig is None:
            sig = self._sigs[key] = inspect.signature(fn)
        return sig

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)


_DIR_CACHE: dict[type, list[str]] = {}


def _class_dir(obj: object) -> list[str]:
    """`dir()` for aiosmtpd's per-connection scans of `smtp_*`/`handle_*` methods: those
    are class attributes, so one listing per class serves every connection."""
    names = _DIR_CACHE.get(type(obj))
    if names is None:
        names = _DIR_CACHE[type(obj)] = dir(obj)
    return names


def install_member_caches() -> None:
    """Replace aiosmtpd's per-connection introspection with per-class caches."""
    aiosmtpd.smtp.inspect = _ClassInspect()  # type: ignore[assignment,attr-defined]
    aiosmtpd.smtp.dir = _class_dir  # type: ignore[attr-defined]
