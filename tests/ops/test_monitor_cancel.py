"""A cancellation that arrives as an awaited spool job finishes ends the health task.

Python 3.11's `asyncio.wait_for` returned the finished job's result instead and swallowed
the cancel: the health loop then ran on, and the daemon's shutdown (which cancels it and
waits) hung until the watchdog killed it (CI, stop 42: one run in about a hundred under
load). The waits are `asyncio.timeout` now, and ruff bans `asyncio.wait_for` (pyproject.toml).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest

from relay.ops.monitor import Monitor


class _Writer:
    """A writer whose job finishes when the test says so."""

    healthy = True
    refused_at = float("-inf")
    refused = ""

    def __init__(self) -> None:
        self.gate: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting = asyncio.Event()

    async def run(self, job: Callable[[sqlite3.Connection], Any]) -> Any:
        self.waiting.set()
        return await self.gate


class _Commits:
    def take_slowest(self) -> float:
        return 0.0


def _monitor(writer: _Writer) -> Monitor:
    m = Monitor.__new__(Monitor)  # only what the spool check reads
    m.writer = writer  # type: ignore[assignment]
    m.commits = _Commits()  # type: ignore[assignment]
    m._spool_id = None
    return m


@pytest.mark.parametrize("check", ["spool", "readiness"])
def test_a_cancel_as_the_spool_answers_is_not_swallowed(check: str) -> None:
    async def main() -> None:
        writer = _Writer()
        m = _monitor(writer)
        m.servers = []
        m.handlers = []
        m.config = lambda: type("C", (), {"inbound_processes": 0})()  # type: ignore[assignment]
        m.model = type("M", (), {"checks": {}})()  # type: ignore[assignment]
        coro = m._spool_check() if check == "spool" else m.readiness_problems()
        task = asyncio.ensure_future(coro)
        await writer.waiting.wait()
        # in one turn of the loop: the job's answer and the shutdown's cancel
        writer.gate.set_result((1,))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
