"""Tests an audit found missing (issue 26, "Tests that an audit found missing"): each pins a
line whose one-line break survived the suite before. In process, with real parts (SQLite
spool and its writer, a real HTTP receiver, real files); the daemon-level ones are in
tests/e2e/test_audit_gaps_e2e.py. tests/MUTANTS.md lists which test pins which gap.

- alerts: a webhook answering 401/404 leaves the alert pending with its error and retries
  it; only 2xx marks it sent; after a restart a refused alert goes out at once;
- longlines: a large body re-encoded for long lines is fsync'd before its row commits;
- relay status: a live pid with a stale health file is 3 "not responding";
- auth.max_pending = N allows exactly N waiting checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import load_config
from relay.inbound import auth as auth_
from relay.inbound import longlines
from relay.inbound.guard import AuthBusy, InboundGuard
from relay.ops import alerts
from relay.spool.incoming import IncomingBody
from relay.spool.writer import SpoolWriter
from tests.webhook import Receiver


def _config(tmp_path: Path, extra: dict[str, Any]) -> Any:
    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": str(tmp_path / "spool")}, **extra}))
    return load_config(p)


# --- alerts: a refused webhook ------------------------------------------------------------


@pytest.fixture
def receiver():
    rec = Receiver().start()
    yield rec
    rec.stop()


async def _rows(w: SpoolWriter) -> list[dict[str, Any]]:
    return await w.run(lambda c: alerts.recent(c, 10))


def test_a_webhook_refusing_with_401_or_404_keeps_the_alert_and_only_2xx_sends_it(
    tmp_path: Path, receiver: Receiver
) -> None:
    (tmp_path / "hook.secret").write_text("s3cret\n")
    cfg = _config(
        tmp_path,
        {
            "alerts": {
                "webhook": {"url": receiver.url, "secret_file": str(tmp_path / "hook.secret")}
            }
        },
    )
    w = SpoolWriter(cfg.spool_path)
    w.start()
    now = {"t": 1_000_000.0}

    def dispatcher() -> alerts.Dispatcher:
        return alerts.Dispatcher(w, lambda: cfg.alerts, lambda: "relay.test", lambda: now["t"])

    async def main() -> None:
        d = dispatcher()
        await d.add(alerts.Event("health", "warning", "destination:x", "x warning"))
        for status, want_sent in ((401, False), (404, False), (300, False), (204, True)):
            receiver.status = status
            before = len(receiver.posts)
            assert await d.pass_once() == 1  # due: a retry of the refused one
            assert len(receiver.posts) == before + 1
            (row,) = await _rows(w)
            if want_sent:
                assert row["sent_at"] is not None and row["pending_sinks"] == []
                assert row["last_error"] is None
            else:
                assert row["sent_at"] is None and row["pending_sinks"] == ["webhook"]
                assert row["last_error"] == f"webhook answered HTTP {status}"
                assert await d.pass_once() == 0  # backed off: not due yet
                now["t"] += alerts.BACKOFF_CAP + 1  # the backoff is over
        assert await d.pass_once() == 0  # sent: never again
        # 200 and 299 are 2xx too
        for status in (200, 299):
            receiver.status = status
            await d.add(alerts.Event("health", "warning", f"k{status}", "s"))
            assert await d.pass_once() == 1
            assert (await _rows(w))[0]["sent_at"] is not None

    try:
        asyncio.run(main())
    finally:
        w.close()


def test_after_a_restart_a_refused_alert_goes_out_at_once(
    tmp_path: Path, receiver: Receiver
) -> None:
    cfg = _config(tmp_path, {"alerts": {"webhook": {"url": receiver.url}}})
    w = SpoolWriter(cfg.spool_path)
    w.start()
    now = {"t": 2_000_000.0}

    async def main() -> None:
        d = alerts.Dispatcher(w, lambda: cfg.alerts, lambda: "relay.test", lambda: now["t"])
        receiver.status = 401
        await d.add(alerts.Event("health", "critical", "spool", "spool critical"))
        assert await d.pass_once() == 1
        (row,) = await _rows(w)
        assert row["sent_at"] is None and row["attempts"] == 1
        # the operator fixed the receiver and restarts the daemon: the clock has not moved,
        # the backoff is not over, and still the alert goes out now
        receiver.status = 200
        again = alerts.Dispatcher(w, lambda: cfg.alerts, lambda: "relay.test", lambda: now["t"])
        task = asyncio.create_task(again.run())
        await asyncio.to_thread(receiver.wait, lambda ok: len(ok) == 1, 5.0)
        for _ in range(250):  # then the row is marked sent
            if (await _rows(w))[0]["sent_at"] is not None:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        (row,) = await _rows(w)
        assert row["sent_at"] is not None, row
        assert [p.status for p in receiver.posts] == [401, 200]

    try:
        asyncio.run(main())
    finally:
        w.close()


# --- long lines: the re-encoded body is durable before its row ---------------------------


async def test_a_large_body_re_encoded_for_long_lines_is_fsynced_before_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    events: list[tuple[str, object]] = []
    real_fsync, real_write, real_replace = os.fsync, os.write, os.replace

    def ino(fd: int) -> int:  # descriptors are reused (a folder's fsync): compare files
        return os.fstat(fd).st_ino

    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", ino(fd))), real_fsync(fd))[1]
    )
    monkeypatch.setattr(
        os, "write", lambda fd, b: (events.append(("write", ino(fd))), real_write(fd, b))[1]
    )
    monkeypatch.setattr(
        os,
        "replace",
        lambda a, b: (events.append(("replace", Path(b).name)), real_replace(a, b))[1],
    )
    inc = IncomingBody(spool, inline_max=1024)
    msg = b"Subject: long\r\nContent-Type: text/plain\r\n\r\n" + b"x" * 5000 + b"\r\nend\r\n"
    await inc.add(msg)
    await inc.finish()
    assert inc.on_disk and inc._fd is not None
    body = ino(inc._fd)
    events.clear()
    await inc.rewrite(longlines.conform)
    path = await inc.commit("QLONGLINES0001")
    stored = (spool / path).read_bytes()
    assert longlines.longest_line(stored) <= longlines.MAX_LINE and stored != msg
    writes = [i for i, e in enumerate(events) if e == ("write", body)]
    syncs = [i for i, e in enumerate(events) if e == ("fsync", body)]
    moved = events.index(("replace", "QLONGLINES0001"))
    assert writes, events  # the re-encoded body went into the same file
    # the rewritten octets are on disk before the file takes its final name (and the row,
    # which names it, commits only after commit() returns)
    assert any(writes[-1] < s < moved for s in syncs), events


# --- relay status: alive but not responding ------------------------------------------------


def _health_file(tmp_path: Path, age: float, pid: int) -> Path:
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    now = time.time()
    doc = {"status": "ok", "checks": [], "pid": pid, "updated_ts": now - age}
    (spool / "health.json").write_text(json.dumps(doc))
    cfg = tmp_path / "relay.yaml"
    cfg.write_text(yaml.safe_dump({"spool": {"path": str(spool)}}))
    return cfg


@pytest.mark.parametrize(
    ("age", "code", "head"),
    [
        (1.0, 0, "OK: all checks ok"),
        (10.0, 0, "OK: all checks ok"),  # STALE_AFTER is 15 s (the process start included)
        (17.0, 3, "UNKNOWN: daemon not responding (health last updated 1"),
        (600.0, 3, "UNKNOWN: daemon not responding (health last updated 60"),
    ],
)
def test_status_of_a_live_pid_with_a_stale_health_file_is_unknown_not_responding(
    tmp_path: Path, age: float, code: int, head: str
) -> None:
    cfg = _health_file(tmp_path, age, os.getpid())  # this process: alive
    res = subprocess.run(
        [sys.executable, "-m", "relay", "status", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    first = res.stdout.splitlines()[0]
    assert (res.returncode, first.startswith(head)) == (code, True), (first, res.stderr)


# --- auth.max_pending ----------------------------------------------------------------------


@pytest.mark.parametrize("pending", [0, 1, 3])
async def test_max_pending_n_lets_exactly_n_checks_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pending: int
) -> None:
    gate = threading.Event()
    started = threading.Event()

    def held(users: Any, login: bytes, password: bytes) -> str | None:
        started.set()
        gate.wait(5)
        return None

    monkeypatch.setattr(auth_, "check", held)
    g = InboundGuard(_config(tmp_path, {"auth": {"max_parallel": 1, "max_pending": pending}}))
    running = asyncio.create_task(g.check_password({}, b"a", b"b"))
    assert await asyncio.to_thread(started.wait, 5)  # the one thread is taken
    waiting = [asyncio.create_task(g.check_password({}, b"a", b"b")) for _ in range(pending)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in waiting)  # all N wait for the thread
    with pytest.raises(AuthBusy):  # the N+1th is refused at once
        await g.check_password({}, b"a", b"b")
    gate.set()
    assert await asyncio.gather(running, *waiting) == [None] * (pending + 1)
    g.close()


# --- long lines: a folded Content-Transfer-Encoding goes whole ------------------------------


def test_a_folded_content_transfer_encoding_is_removed_whole() -> None:
    msg = (
        b"Subject: folded\r\n"
        b"Content-Transfer-Encoding:\r\n"
        b" 8bit\r\n"
        b"X-After: kept\r\n"
        b"\r\n" + b"y" * 2000 + b"\r\n"
    )
    out = longlines.conform(msg)
    assert out is not None
    head = out.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert b" 8bit" not in head  # no orphan continuation line (it would fold into Subject)
    ctes = [h for h in head if h.lower().startswith(b"content-transfer-encoding:")]
    assert ctes == [b"Content-Transfer-Encoding: quoted-printable"], head
    assert b"Subject: folded" in head and b"X-After: kept" in head
