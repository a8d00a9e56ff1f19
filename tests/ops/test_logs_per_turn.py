"""Log lines written once per turn of an event loop (relay/ops/logs.py `lines_per_turn`, the
inbound process): fewer writes, and no line lost or out of order."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest

from relay.ops.logs import held_lines, lines_per_turn, log_event, setup_logging

LOGGER = logging.getLogger("relay.test")


class _Writes(io.StringIO):
    """A stream that remembers each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


@pytest.fixture
def stream() -> Iterator[_Writes]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    s = _Writes()
    setup_logging("info", "json", stream=s)
    yield s
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def _events(s: _Writes) -> list[str]:
    return [json.loads(line)["event"] for line in s.getvalue().splitlines()]


def test_the_lines_of_one_turn_are_one_write_after_it(stream: _Writes) -> None:
    async def main() -> tuple[int, int]:
        with lines_per_turn(asyncio.get_running_loop()):
            for i in range(3):
                log_event(LOGGER, logging.INFO, f"e{i}", "one turn")
            during = len(stream.writes)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return during, len(stream.writes)

    during, after = asyncio.run(main())
    assert (during, after) == (0, 1)
    assert _events(stream) == ["e0", "e1", "e2"]


def test_a_line_from_another_thread_comes_after_the_pending_ones(stream: _Writes) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "loop1", "")
            t = threading.Thread(target=lambda: log_event(LOGGER, logging.INFO, "thread", ""))
            t.start()
            t.join()
            log_event(LOGGER, logging.INFO, "loop2", "")
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(stream) == ["loop1", "thread", "loop2"]


def test_no_line_is_lost_at_the_end(stream: _Writes) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "last", "")  # no turn of the loop after it

    asyncio.run(main())
    assert _events(stream) == ["last"]
    log_event(LOGGER, logging.INFO, "after", "")  # and then one write per line again
    assert _events(stream) == ["last", "after"] and len(stream.writes) == 2


def test_flush_writes_the_pending_lines(stream: _Writes) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "pending", "")
            for h in logging.getLogger().handlers:
                h.flush()  # as logging.shutdown at exit
            assert _events(stream) == ["pending"]
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(stream) == ["pending"]


def test_a_write_stays_within_pipe_buf(stream: _Writes) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            for i in range(40):
                log_event(LOGGER, logging.INFO, f"e{i}", "x" * 300)
            log_event(LOGGER, logging.INFO, "long", "y" * 9000)
            log_event(LOGGER, logging.INFO, "é", "é" * 1500)
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(stream) == [f"e{i}" for i in range(40)] + ["long", "é"]
    assert all(len(w.encode()) <= 4096 or w.count("\n") == 1 for w in stream.writes), [
        len(w.encode()) for w in stream.writes
    ]
    assert len(stream.writes) < 20


# --- held_lines: the lines of one synchronous step in one write (an attempt's recipients) ---


def test_held_lines_are_one_write_at_the_end_in_order(stream: _Writes) -> None:
    log_event(LOGGER, logging.INFO, "before", "")
    with held_lines():
        for i in range(5):
            log_event(LOGGER, logging.INFO, f"r{i}", "")
        with held_lines():  # nested: the outermost writes
            log_event(LOGGER, logging.INFO, "inner", "")
        assert len(stream.writes) == 1  # only "before"
    assert len(stream.writes) == 2
    assert _events(stream) == ["before", "r0", "r1", "r2", "r3", "r4", "inner"]
    log_event(LOGGER, logging.INFO, "after", "")  # one write per line again
    assert len(stream.writes) == 3


def test_held_lines_are_written_when_the_step_raises(stream: _Writes) -> None:
    with pytest.raises(RuntimeError), held_lines():
        log_event(LOGGER, logging.INFO, "kept", "")
        raise RuntimeError("boom")
    assert _events(stream) == ["kept"]


def test_another_threads_line_is_not_held(stream: _Writes) -> None:
    with held_lines():
        log_event(LOGGER, logging.INFO, "held", "")
        t = threading.Thread(target=lambda: log_event(LOGGER, logging.INFO, "thread", ""))
        t.start()
        t.join()
        assert _events(stream) == ["thread"]
    assert _events(stream) == ["thread", "held"]


def test_held_lines_follow_the_lines_pending_in_a_turn(stream: _Writes) -> None:
    async def main() -> None:
        with lines_per_turn(asyncio.get_running_loop()):
            log_event(LOGGER, logging.INFO, "pending", "")
            with held_lines():
                log_event(LOGGER, logging.INFO, "held", "")
            assert _events(stream) == ["pending", "held"] and len(stream.writes) == 1
            await asyncio.sleep(0)

    asyncio.run(main())
    assert _events(stream) == ["pending", "held"]
