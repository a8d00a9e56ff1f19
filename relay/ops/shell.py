"""Running an operator's shell command (an alert command, an OAuth2 token command).

Rules:
- `/bin/sh -c COMMAND` in a process group of its own, with optional bytes on stdin.
- At the timeout (or if the caller is cancelled) the whole group is killed: `sh -c` forks
  its commands, and a child left alive would keep the pipes, and the caller, waiting until
  it ends. A child that left the group is not waited for longer than `REAP_GRACE`.
- OSError when it cannot start; TimeoutError at the timeout. The exit status and what was
  captured come back as they are: judging them is the caller's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

REAP_GRACE = 1.0  # seconds to wait for a killed command's pipes to close


@dataclass(frozen=True, slots=True)
class Finished:
    returncode: int
    stdout: bytes
    stderr: bytes


async def run(
    command: str,
    timeout: float,
    *,
    stdin: bytes | None = None,
    stdout: bool = False,
    stderr: bool = False,
) -> Finished:
    """`stdout`/`stderr`: capture them (else discarded)."""
    pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
    proc = await asyncio.create_subprocess_shell(
        command,
        stdin=pipe if stdin is not None else null,
        stdout=pipe if stdout else null,
        stderr=pipe if stderr else null,
        start_new_session=True,  # its own process group: a timeout kills all of it
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate(stdin)
    finally:
        if proc.returncode is None:  # timed out or cancelled
            await kill_group(proc)
    assert proc.returncode is not None
    return Finished(proc.returncode, out or b"", err or b"")


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    # the shell leads its own group (start_new_session): this kills it and all it started
    # (not proc.kill(): Popen polls first and could reap the pid under asyncio's watcher)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    # a child that left the group may still hold a pipe open: do not wait on it forever
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(REAP_GRACE):
            await proc.wait()
