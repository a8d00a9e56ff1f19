"""Everything delivery relies on inside aiosmtplib that is not its public API, in one place.

Rules:
- aiosmtplib's `data()` sends the body and waits for the reply to the final dot under one
  timeout and one exception; we need the final dot as a phase of its own (ambiguity, RFC 5321
  §4.5.3.2.6) and a body streamed from a file with flow control. So `transport.py` drives
  the protocol itself, through the three functions here, exactly as `data()` does inside.
- `check()` runs at start (relay/daemon.py) and refuses to start, naming what is missing,
  when an aiosmtplib release no longer has what these functions use; pyproject.toml bounds
  the version (`<6`). tests/delivery/test_transport.py pins the behaviour end to end.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiosmtplib
from aiosmtplib.protocol import SMTPProtocol


class AdapterError(RuntimeError):
    pass


def check() -> None:
    init = inspect.getsource(SMTPProtocol.__init__)
    missing = [
        name for name in ("_command_lock", "_response_pending") if f"self.{name}" not in init
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
