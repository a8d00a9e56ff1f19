"""An orderly stop while AUTH password checks are pending (issue 26, the flake of
test_auth_checks_do_not_stall_other_clients): once the guard is closed no check runs, in
the old pool or a new one; the clients waiting get 454 4.7.0 (AuthBusy), and none of them
sees a CancelledError it did not ask for."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay import auth as auth_
from relay.config import load_config
from relay.guard import AuthBusy, InboundGuard


def _guard(tmp_path: Path, **auth: Any) -> InboundGuard:
    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": str(tmp_path / "spool")}, "auth": auth}))
    return InboundGuard(load_config(p))


async def test_close_drops_waiting_checks_and_refuses_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[float] = []
    gate = threading.Event()
    started = threading.Event()

    def slow_check(users: Any, login: bytes, password: bytes) -> str | None:
        ran.append(time.monotonic())
        started.set()
        gate.wait(5)  # the first check holds the only thread until the test lets it go
        return None

    monkeypatch.setattr(auth_, "check", slow_check)
    g = _guard(tmp_path, max_parallel=1, max_pending=10)
    tasks = [asyncio.create_task(g.check_password({}, b"a", b"b")) for _ in range(5)]
    assert await asyncio.to_thread(started.wait, 5)  # the first in its thread; four wait
    g.close()
    # the waiting ones answer at once, not when the running check frees its thread
    done, _ = await asyncio.wait(tasks[1:], timeout=2)
    assert len(done) == 4 and not tasks[0].done()
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] is None  # the one running finishes (a thread cannot be stopped)
    assert all(isinstance(r, AuthBusy) for r in results[1:]), results  # 454, not a check
    assert len(ran) == 1  # none of the waiting ones ran
    assert g._executor is None  # no new pool after close
    with pytest.raises(AuthBusy):
        await g.check_password({}, b"a", b"b")
    assert len(ran) == 1
