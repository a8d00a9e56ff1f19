"""Everything delivery relies on inside aiosmtplib that is not its public API, in one place.

Rules:
- aiosmtplib has no pipelining (RFC 2920): `GroupReplies` reads a group's replies while it
  holds the transport, then gives it back; it relies on the protocol's `transport`, its
  callbacks, and its reply limits (`MAX_LINE_LENGTH`, `MAX_RESPONSE_LENGTH`).
- aiosmtplib's `data()` sends the body and waits for the reply to the final dot under one
  timeout and one exception; we need the final dot as a phase of its own (ambiguity, RFC 5321
  §4.5.3.2.6) and a body streamed from a file with flow control. So `transport.py` drives
  the protocol itself, through the three functions here, exactly as `data()` does inside.
- `check()` runs at start (relay/daemon.py) and refuses to start, naming what is missing,
  when an aiosmtplib release no longer has what these functions use; pyproject.toml bounds
  the version (`<6`). tests/delivery/test_transport.py pins the behaviour end to end.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiosmtplib
from aiosmtplib.errors import SMTPReadTimeoutError, SMTPResponseException, SMTPServerDisconnected
from aiosmtplib.protocol import MAX_LINE_LENGTH, MAX_RESPONSE_LENGTH, SMTPProtocol
from aiosmtplib.response import SMTPResponse
from aiosmtplib.typing import SMTPStatus


class AdapterError(RuntimeError):
    pass


def check() -> None:
    init = inspect.getsource(SMTPProtocol.__init__)
    missing = [
        name
        for name in ("_command_lock", "_response_pending", "transport")
        if f"self.{name}" not in init
    ]
    for name in ("_drain_helper", "read_response", "write"):
        if not callable(getattr(SMTPProtocol, name, None)):
            missing.append(name)
    if missing:
        raise AdapterError(
            f"aiosmtplib {getattr(aiosmtplib, '__version__', '?')} lacks what relay relies on:"
            f" SMTPProtocol.{', SMTPProtocol.'.join(missing)}; install a supported version"
            " (see pyproject.toml)"
        )


@asynccontextmanager
async def command_lock(proto: Any) -> AsyncIterator[None]:
    """The protocol's own lock: no other command may interleave with DATA and the body."""
    async with proto._command_lock:
        yield


def expect_reply(proto: Any) -> None:
    """Tell the protocol a reply is due (else it takes the reply for an unsolicited line)."""
    proto._response_pending = True


async def drain(proto: Any) -> None:
    """Wait until the transport's write buffer is below its high-water mark."""
    await proto._drain_helper()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(SMTPReadTimeoutError("Timed out waiting for server response"))


_INVALID = SMTPStatus.invalid_response.value  # aiosmtplib's code for a reply it cannot read


class GroupReplies(asyncio.Protocol):
    """The replies to a pipelined group (RFC 2920 §3.1: the client writes several commands
    at once, then reads their replies in order). aiosmtplib's protocol holds one reply at a
    time and drops bytes that arrive while it holds one, so it cannot read a group: while
    the group's replies come in, this protocol holds the transport (`set_protocol`, public
    asyncio API), buffers every byte and parses replies as aiosmtplib does (the same codes,
    the same message text, the same exceptions); it passes the connection's loss and flow
    control on to aiosmtplib's protocol, and gives the transport back to it (`release`)."""

    def __init__(self, owner: SMTPProtocol) -> None:
        self.owner = owner
        self._buf = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._transport: asyncio.BaseTransport | None = None

    def hold(self) -> None:
        transport = self.owner.transport
        if transport is None or transport.is_closing():
            raise SMTPServerDisconnected("Connection lost")
        self._buf.clear()
        self._error = None
        self._transport = transport
        transport.set_protocol(self)

    def release(self) -> None:
        """Give the transport back to aiosmtplib (unsolicited bytes after the group are
        dropped, as aiosmtplib drops them)."""
        transport, self._transport = self._transport, None
        if transport is not None and not transport.is_closing():
            transport.set_protocol(self.owner)

    # --- asyncio.Protocol -------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._wake()

    def eof_received(self) -> bool:
        self._error = self._error or SMTPServerDisconnected("Unexpected EOF received")
        self._wake()
        return False  # close the transport, as aiosmtplib does

    def connection_lost(self, exc: Exception | None) -> None:
        if self._error is None:
            self._error = SMTPServerDisconnected("Connection lost")
            self._error.__cause__ = exc
        self._wake()
        self._transport = None
        self.owner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- replies ----------------------------------------------------------------------

    async def read(self, timeout: float) -> SMTPResponse:
        """The next reply of the group, each bounded by `timeout` (as `read_response`)."""
        while True:
            reply = self._parse()
            if reply is not None:
                return reply
            if self._error is not None:
                raise self._error
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            # a timer on the future, not asyncio.wait_for (which wraps it: more work per reply)
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None

    def _parse(self) -> SMTPResponse | None:
        """One complete reply off the buffer, as aiosmtplib's `_read_response_from_buffer`:
        continuation lines joined by "\\n", each stripped of the code and blanks."""
        buf = self._buf
        lines: list[bytes] = []
        offset = 0
        code = -1
        while True:
            end = buf.find(b"\n", offset)
            if end == -1:
                if len(buf) > MAX_RESPONSE_LENGTH:
                    raise SMTPResponseException(_INVALID, "Response too long")
                return None
            line = bytes(buf[offset : end + 1])
            if len(line) > MAX_LINE_LENGTH:
                raise SMTPResponseException(_INVALID, "Response too long")
            try:
                code = int(line[:3])
            except ValueError:
                text = line.decode("utf-8", errors="ignore")
                raise SMTPResponseException(
                    _INVALID, f"Malformed SMTP response line: {text}"
                ) from None
            offset = end + 1
            lines.append(line[4:].strip(b" \t\r\n"))
            if line[3:4] != b"-":
                del buf[:offset]
                return SMTPResponse(code, b"\n".join(lines).decode("utf-8", "surrogateescape"))
