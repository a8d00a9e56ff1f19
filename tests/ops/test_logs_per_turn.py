"""Log lines written once per turn of an event loop (relay/ops/logs.py `lines_per_turn`, the
inbound process): fewer writes, and no line lost or out of order."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

from relay.ops.logs import held_lines, lines_per_turn, log_event
from tests.harness import LogWrites

LOGGER = logging.getLogger("relay.test")


def _events(s: LogWrites) -> list[str]:
    return [json.loads(line)["event"] for line in s.getvalue().splitlines()]


def test_the_lines_of_one_turn_are_one_write_after_it(log_writes: LogWrites) -> None:
    async def main() -> tuple[int, int]:
        with lines_per_turn(asyncio.get_running_loop()):
            for i in range(3):
                log_event(LOGGER, logging.INFO, f"e{i}", "one turn")
            during = len(log_writes.writes)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return during, len(log_writes.writes)

    during, after = asyncio.run(main())
    assert (during, after) == (0, 1)
    assert _events(log_writes) == ["e0", "e1", "e2"]


def test_a_line_from_another_thread_comes_after_the_pending_ones(log_writes: LogWrites) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "loop1", "")
            t = threading.Thread(target=lambda: log_event(LOGGER, logging.INFO, "thread", ""))
            t.start()
            t.join()
            log_event(LOGGER, logging.INFO, "loop2", "")
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(log_writes) == ["loop1", "thread", "loop2"]


def test_no_line_is_lost_at_the_end(log_writes: LogWrites) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "last", "")  # no turn of the loop after it

    asyncio.run(main())
    assert _events(log_writes) == ["last"]
    log_event(LOGGER, logging.INFO, "after", "")  # and then one write per line again
    assert _events(log_writes) == ["last", "after"] and len(log_writes.writes) == 2


def test_flush_writes_the_pending_lines(log_writes: LogWrites) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "pending", "")
            for h in logging.getLogger().handlers:
                h.flush()  # as logging.shutdown at exit
            assert _events(log_writes) == ["pending"]
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(log_writes) == ["pending"]


def test_a_write_stays_within_pipe_buf(log_writes: LogWrites) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            for i in range(40):
                log_event(LOGGER, logging.INFO, f"e{i}", "x" * 300)
            log_event(LOGGER, logging.INFO, "long", "y" * 9000)
            log_event(LOGGER, logging.INFO, "é", "é" * 1500)
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(log_writes) == [f"e{i}" for i in range(40)] + ["long", "é"]
    assert all(len(w.encode()) <= 4096 or w.count("\n") == 1 for w in log_writes.writes), [
        len(w.encode()) for w in log_writes.writes
    ]
    assert len(log_writes.writes) < 20


# --- held_lines: the lines of one synchronous step in one write (an attempt's recipients) ---


def test_held_lines_are_one_write_at_the_end_in_order(log_writes: LogWrites) -> None:
    log_event(LOGGER, logging.INFO, "before", "")
    with held_lines():
        for i in range(5):
            log_event(LOGGER, logging.INFO, f"r{i}", "")
        with held_lines():  # nested: the outermost writes
            log_event(LOGGER, logging.INFO, "inner", "")
        assert len(log_writes.writes) == 1  # only "before"
    assert len(log_writes.writes) == 2
    assert _events(log_writes) == ["before", "r0", "r1", "r2", "r3", "r4", "inner"]
    log_event(LOGGER, logging.INFO, "after", "")  # one write per line again
    assert len(log_writes.writes) == 3


def test_held_lines_are_written_when_the_step_raises(log_writes: LogWrites) -> None:
    with pytest.raises(RuntimeError), held_lines():
        log_event(LOGGER, logging.INFO, "kept", "")
        raise RuntimeError("boom")
    assert _events(log_writes) == ["kept"]


def test_another_threads_line_is_not_held(log_writes: LogWrites) -> None:
    with held_lines():
        log_event(LOGGER, logging.INFO, "held", "")
        t = threading.Thread(target=lambda: log_event(LOGGER, logging.INFO, "thread", ""))
        t.start()
        t.join()
        assert _events(log_writes) == ["thread"]
    assert _events(log_writes) == ["thread", "held"]


def test_held_lines_follow_the_lines_pending_in_a_turn(log_writes: LogWrites) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "pending", "")
            with held_lines():
                log_event(LOGGER, logging.INFO, "held", "")
            assert _events(log_writes) == ["pending", "held"] and len(log_writes.writes) == 1
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(log_writes) == ["pending", "held"]
