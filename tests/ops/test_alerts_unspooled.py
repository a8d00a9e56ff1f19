"""A health alert the spool cannot record (relay/ops/alerts.py rules; found by
tests/e2e/test_pg_faults_e2e.py: a PostgreSQL spool's database away, and the alert saying so
was lost). It is sent from memory at once and recorded once the spool takes writes again;
no sink is given it twice, a sink that failed is owed it by the outbox."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import load_config
from relay.ops import alerts, faults
from relay.spool.writer import SpoolError, SpoolWriter
from tests.webhook import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver().start()
    yield rec
    rec.stop()


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[SpoolWriter]:
    w = SpoolWriter(tmp_path / "spool")
    w.start()
    yield w
    faults.disarm_all()
    w.close()


def _dispatcher(tmp_path: Path, w: SpoolWriter, url: str, now: dict[str, float]) -> Any:
    p = tmp_path / "relay.yaml"
    spool = {"path": str(tmp_path / "spool")}
    p.write_text(yaml.safe_dump({"spool": spool, "alerts": {"webhook": {"url": url}}}))
    cfg = load_config(p)
    return alerts.Dispatcher(w, lambda: cfg.alerts, lambda: "relay.test", lambda: now["t"])


def test_sent_from_memory_while_the_spool_is_away_then_recorded_as_sent(
    tmp_path: Path, writer: SpoolWriter, receiver: Receiver
) -> None:
    now = {"t": 1_000_000.0}
    d = _dispatcher(tmp_path, writer, receiver.url, now)

    async def main() -> None:
        faults.arm("spool.begin", "eio")  # every transaction fails: the spool is away
        await d.add(alerts.Event("health", "critical", "spool", "spool critical: away"))
        with pytest.raises(SpoolError):  # coalesced events are not held: the caller logs
            await d.add(alerts.Event("dead_letter", "warning", "example.org", "bounced"))
        assert await d.unspooled_pass() is not None  # sent, but not recorded yet
        (post,) = receiver.posts
        assert post.doc["id"] == f"relay.test/mem-{os.getpid()}-1"
        assert post.headers["x-relay-delivery"] == post.doc["id"]
        assert (post.doc["event"], post.doc["severity"]) == ("health", "critical")
        assert await d.unspooled_pass() is not None  # not due: nothing sent again
        faults.disarm_all()  # the spool is back
        now["t"] += alerts.BACKOFF_CAP + 1
        assert await d.unspooled_pass() is None
        assert d.unspooled == []
        (row,) = await writer.run(lambda c: alerts.recent(c, 10))
        assert (row["event"], row["key"], row["pending_sinks"]) == ("health", "spool", [])
        assert row["sent_at"] is not None
        assert await d.pass_once() == 0  # the outbox does not send it again
        assert len(receiver.posts) == 1

    asyncio.run(main())


def test_a_sink_that_failed_meanwhile_is_owed_it_by_the_outbox(
    tmp_path: Path, writer: SpoolWriter, receiver: Receiver
) -> None:
    now = {"t": 1_000_000.0}
    d = _dispatcher(tmp_path, writer, receiver.url, now)

    async def main() -> None:
        faults.arm("spool.begin", "eio")
        receiver.status = 503
        await d.add(alerts.Event("health", "critical", "spool", "spool critical: away"))
        await d.unspooled_pass()
        assert [p.status for p in receiver.posts] == [503]
        faults.disarm_all()
        now["t"] += alerts.BACKOFF_CAP + 1
        assert await d.unspooled_pass() is None  # tried again (503), then recorded as owed
        (row,) = await writer.run(lambda c: alerts.recent(c, 10))
        assert row["pending_sinks"] == ["webhook"] and row["sent_at"] is None
        receiver.status = 200
        assert await d.pass_once() == 1
        assert [p.status for p in receiver.posts] == [503, 503, 200]
        assert receiver.posts[-1].doc["id"] == f"relay.test/{row['id']}"
        (row,) = await writer.run(lambda c: alerts.recent(c, 10))
        assert row["sent_at"] is not None

    asyncio.run(main())


def test_a_sent_alert_whose_record_failed_is_recorded_not_sent_again(
    tmp_path: Path, writer: SpoolWriter, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by tests/e2e/test_pg_faults_e2e.py under load: a `resolved` alert reached the
    webhook twice. Its sink took it, the update that records that failed (a commit lost to
    the database's restart), and the next pass found the row still due and sent it again."""
    now = {"t": 1_000_000.0}
    d = _dispatcher(tmp_path, writer, receiver.url, now)
    real_mark = alerts.mark
    failures = [1]

    def mark_fails_once(c: Any, *args: Any) -> None:
        if failures:
            failures.pop()
            raise sqlite3.OperationalError("the commit was lost")
        real_mark(c, *args)

    monkeypatch.setattr(alerts, "mark", mark_fails_once)

    async def main() -> None:
        await d.add(alerts.Event("resolved", "info", "spool", "spool ok again"))
        with pytest.raises(SpoolError):
            await d.pass_once()  # sent; its record failed
        assert len(receiver.posts) == 1
        assert await d.pass_once() == 1  # due still: recorded now, not sent
        assert len(receiver.posts) == 1
        (row,) = await writer.run(lambda c: alerts.recent(c, 10))
        assert row["sent_at"] is not None and row["pending_sinks"] == []
        assert await d.pass_once() == 0

    asyncio.run(main())
