"""The shutdown's stop of a process's own tasks (relay/ops/tasks.py `stop_tasks`): a lost
cancel does not hold it, and a task that never ends is named, not waited for."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from relay.ops import tasks as tasks_mod


async def _loop(ticks: list[int]) -> None:
    while True:
        await asyncio.sleep(0.01)
        ticks.append(1)


async def _loses_one_cancel(ticks: list[int]) -> None:
    """The shape of the bug: the first cancel is swallowed (as 3.11's wait_for did), the
    loop goes on, and only a second one ends it."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass
    await _loop(ticks)


async def _never_ends(release: asyncio.Event) -> None:
    while not release.is_set():  # every cancel swallowed until the test lets it go
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


async def _fails() -> None:
    raise RuntimeError("its own business")


def test_every_task_ends_and_a_lost_cancel_is_sent_again() -> None:
    async def main() -> tuple[set[asyncio.Task[None]], float, list[asyncio.Task[None]]]:
        ticks: list[int] = []
        tasks = [
            asyncio.ensure_future(_loop(ticks)),
            asyncio.ensure_future(_loses_one_cancel(ticks)),
            asyncio.ensure_future(_fails()),
        ]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        left = await tasks_mod.stop_tasks(tasks, 10.0)
        return left, time.monotonic() - t0, tasks

    left, took, tasks = asyncio.run(main())
    assert left == set()
    assert all(t.done() for t in tasks)
    assert tasks[0].cancelled() and tasks[1].cancelled()
    assert took < 5.0  # the second cancel came after a second, not at the grace's end


def test_a_task_that_never_ends_is_named_and_left_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[set[asyncio.Task[None]], float]:
        release = asyncio.Event()
        stuck = asyncio.ensure_future(_never_ends(release))
        stuck.set_name("stubborn")
        await asyncio.sleep(0)
        t0 = time.monotonic()
        left = await tasks_mod.stop_tasks([stuck], 1.5)
        took = time.monotonic() - t0
        release.set()  # the test's own clean-up
        stuck.cancel()
        await stuck
        return left, took

    with caplog.at_level(logging.ERROR, logger="relay.ops.tasks"):
        left, took = asyncio.run(main())
    assert [t.get_name() for t in left] == ["stubborn"]
    assert 1.4 < took < 5.0
    rec = [r for r in caplog.records if "did not end when cancelled" in r.getMessage()]
    assert len(rec) == 1
    fields = rec[0].__dict__["fields"]
    assert fields["task"] == "stubborn"
    assert "test_tasks.py:" in fields["at"]  # where it waits
