"""Boundary tests of relay/inbound/session_watch.py (real event loop timers, no sockets). (The
guard's AUTH pool, once tested here too, is in test_guard.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from relay.config.tree import Limits, from_mapping
from relay.inbound.session_watch import SessionWatch


def limits(tmp_path: Path, **over: object) -> Limits:
    return dataclasses.replace(from_mapping({"spool": {"path": "s"}}, tmp_path).limits, **over)


async def watch(tmp_path: Path, **over: object) -> tuple[SessionWatch, list[str]]:
    closed: list[str] = []
    w = SessionWatch(limits(tmp_path, **over), asyncio.get_running_loop(), closed.append)
    return w, closed


async def test_command_timer_runs_from_a_reply_to_a_line_end(tmp_path: Path) -> None:
    w, closed = await watch(tmp_path, command_timeout=0.2)
    w.replied("220 relay.test ESMTP")
    w.received(b"EHLO x")  # no line end yet: still timing
    await asyncio.sleep(0.1)
    w.received(b".test\r\n")
    await asyncio.sleep(0.2)
    assert closed == []
    w.replied("250-relay.test")  # continuation lines do not arm it...
    w.replied("250 HELP")  # ...the final line does
    await asyncio.sleep(0.3)
    assert closed == ["command_timeout"]
    w.replied("250 OK")  # after closing: nothing more
    await asyncio.sleep(0.3)
    assert closed == ["command_timeout"]


async def test_data_rate_only_between_354_and_the_end_of_data(tmp_path: Path) -> None:
    w, closed = await watch(
        tmp_path, command_timeout=10.0, min_data_rate=1000, min_data_rate_window=0.2
    )
    w.replied("354 End data with <CR><LF>.<CR><LF>")
    for _ in range(6):  # 5 KB/s
        w.received(b"x" * 200 + b"\r\n")
        await asyncio.sleep(0.04)
    assert closed == []
    w.received(b"last line\r\n.")
    w.received(b"\r\nQUIT\r\n")  # the end, split over two reads, QUIT pipelined after it
    await asyncio.sleep(0.4)  # the spool is slow to answer: not the client's fault
    assert closed == []
    w.replied("250 2.0.0 Ok: queued as X")
    w.replied("354 End data with <CR><LF>.<CR><LF>")
    w.received(b"Subject: x\r\n")
    await asyncio.sleep(0.4)
    assert closed == ["data_rate"]


async def test_errors_count_and_reset(tmp_path: Path) -> None:
    w, _ = await watch(tmp_path, max_errors=3)
    assert not w.replied("503 5.5.1 need MAIL")
    assert not w.replied("554 5.7.1 Relay access denied")
    assert not w.replied("250 2.0.0 Ok: queued as X")  # starts again
    assert not w.replied("503 5.5.1 need MAIL")
    assert not w.replied("451 4.3.0 Spool unavailable")  # ours
    assert not w.replied("503 5.5.1 need MAIL")
    assert w.replied("500 5.5.2 bad syntax")
    w.stop()


async def test_the_end_of_data_is_seen_in_a_large_block_full_of_dots(tmp_path: Path) -> None:
    """The end of the data in one 100 KiB read whose lines hold many dots (the search goes
    from dot to dot, relay/mail/message.py find_dot_line): the rate meter stops there,
    and a line that only starts with a dot is not the end."""
    w, closed = await watch(
        tmp_path, command_timeout=10.0, min_data_rate=10**9, min_data_rate_window=0.2
    )
    w.replied("354 End data with <CR><LF>.<CR><LF>")
    body = b"a.b.c.d. e.f\r\n..stuffed\r\n" * 4000
    w.received(body)  # no end yet, and far too slow for 1 GB/s: the meter runs
    w.received(body + b".\r\n")  # the end, after 40,000 dots
    await asyncio.sleep(0.4)
    assert closed == []  # stopped at the end: the spool's answer is ours to make
    w.replied("250 2.0.0 Ok: queued as X")
    w.replied("354 End data with <CR><LF>.<CR><LF>")
    w.received(body)  # only dot-stuffed lines: never the end
    await asyncio.sleep(0.4)
    assert closed == ["data_rate"]
