"""Reads beside the writer (SpoolWriter.read): a /metrics scrape over a deep queue must not
hold up commits, i.e. the 250s of every SMTP session. The writer thread is held busy by a
job of the test's own, so each test shows the read finishing while the writer could not
have run it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relay.ops.admin import AdminServer
from relay.ops.metrics import Metrics
from relay.spool import db, ops
from relay.spool.writer import SpoolError, SpoolWriter


def _fill(conn: sqlite3.Connection) -> None:
    now = time.time()
    for i, state in enumerate(["pending", "pending", "deferred", "delivered"]):
        conn.execute(
            "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer,"
            " lane, identity, body, listener) VALUES (?, ?, 's@x.test', 10, ?, 'c', 'p',"
            " 'bulk', 'default', x'00', 'default')",
            (f"M{i}", f"<{i}@x.test>", now - 100 + i),
        )
        conn.execute(
            "INSERT INTO recipients (msg_id, address, destination, lane_prio, state,"
            " attempts, next_attempt_at, dedup_key, updated_at)"
            " VALUES (?, ?, 'x.test', 0, ?, 0, ?, ?, ?)",
            (f"M{i}", f"r{i}@x.test", state, now, f"k{i}", now),
        )


@pytest.fixture
async def busy_writer(tmp_path: Path) -> AsyncIterator[tuple[SpoolWriter, threading.Event]]:
    """A started writer on a spool with 4 recipients, its thread held inside a job until
    the event is set."""
    conn = db.connect(tmp_path / "spool")
    with db.transaction(conn):
        _fill(conn)
    conn.close()
    writer = SpoolWriter(tmp_path / "spool")
    writer.start()
    release = threading.Event()
    entered = threading.Event()

    def hold(c: sqlite3.Connection) -> None:
        entered.set()
        release.wait(30)

    held = asyncio.ensure_future(writer.run(hold))
    assert await asyncio.to_thread(entered.wait, 10)
    try:
        yield writer, release
    finally:
        release.set()
        await held
        writer.close()


async def test_a_read_runs_while_the_writer_is_busy(
    busy_writer: tuple[SpoolWriter, threading.Event],
) -> None:
    writer, release = busy_writer
    got = await asyncio.wait_for(writer.read(lambda c: ops.queue_gauges(c)), 10)
    assert not release.is_set()  # the writer thread was still held the whole time
    by_state, oldest = got
    assert (by_state["pending"], by_state["deferred"], by_state["delivered"]) == (2, 1, 1)
    assert oldest is not None and 90 < oldest < 200


async def test_a_read_cannot_write(busy_writer: tuple[SpoolWriter, threading.Event]) -> None:
    writer, _release = busy_writer
    with pytest.raises(SpoolError, match="attempt to write a readonly database"):
        await writer.read(lambda c: c.execute("DELETE FROM recipients"))


async def test_metrics_are_served_while_the_writer_is_busy(
    busy_writer: tuple[SpoolWriter, threading.Event],
) -> None:
    writer, release = busy_writer
    metrics = Metrics()

    async def no_problems() -> list[str]:
        return []

    def no_doc() -> dict[str, Any]:
        return {}

    admin = AdminServer(metrics, writer, no_problems, no_doc)
    text = await asyncio.wait_for(admin.metrics_text(), 10)
    assert not release.is_set()
    assert b'relay_queue_recipients{state="pending"} 2.0' in text
    assert b'relay_queue_recipients{state="deferred"} 1.0' in text


def test_stats_still_reports_the_gauges(tmp_path: Path) -> None:
    conn = db.connect(tmp_path / "spool")
    with db.transaction(conn):
        _fill(conn)
    st = ops.stats(conn, now=time.time())
    by_state, oldest = ops.queue_gauges(conn, now=time.time())
    assert st["recipients"] == by_state
    assert st["oldest_queued_age"] is not None and oldest is not None
    assert abs(st["oldest_queued_age"] - oldest) < 5
    conn.close()
