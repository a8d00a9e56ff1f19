"""The failure paths of "250 only after fsync", driven through the fault seams
(relay/ops/faults.py): in-process for the spool writer, and against a live daemon for the SMTP
replies. Each test fails when its line is broken back (see tests/MUTANTS.md)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from relay.ops import faults
from relay.spool.writer import SpoolError, SpoolWriter
from tests.harness import RelayProcess, Upstream, deep_merge, make_message, smarthost_config
from tests.pgserver import BACKENDS, backend_writer


@pytest.fixture(autouse=True)
def _clean_faults() -> Iterator[None]:
    faults.disarm_all()
    yield
    faults.disarm_all()


# --- the writer, in-process --------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def writer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpoolWriter]:
    w = cast(SpoolWriter, backend_writer(request, tmp_path))
    w.start()
    w.run_sync(lambda c: c.execute("CREATE TABLE IF NOT EXISTS t (v TEXT)"))
    yield w
    w.close()


def _insert(v: str):  # type: ignore[no-untyped-def]
    def job(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES (?)", (v,))
        return v

    return job


def _rows(w: SpoolWriter) -> list[str]:
    return [r[0] for r in w.run_sync(lambda c: c.execute("SELECT v FROM t ORDER BY v").fetchall())]


def _batch(w: SpoolWriter, jobs: list[str]) -> list[object]:
    """Run these jobs in ONE batch: hold the writer thread on a gate job, queue them, open."""
    gate = threading.Event()
    started = threading.Event()

    def hold(_c: sqlite3.Connection) -> None:
        started.set()
        gate.wait(10)

    results: list[object] = [None] * len(jobs)
    t0 = threading.Thread(target=lambda: w.run_sync(hold))
    t0.start()
    assert started.wait(10)

    def submit(i: int, v: str) -> None:
        try:
            results[i] = w.run_sync(_insert(v))
        except Exception as e:  # the caller sees the error
            results[i] = e

    threads = [threading.Thread(target=submit, args=(i, v)) for i, v in enumerate(jobs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while w._q.qsize() < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in [t0, *threads]:
        t.join(10)
    return results


def test_one_failing_job_rolls_back_alone_and_the_batch_commits(writer: SpoolWriter) -> None:
    faults.arm("spool.job", "error", times=1, after=1)  # the second job of the next batch
    batches = writer.batches
    res = _batch(writer, ["a", "b", "c"])
    assert writer.batches == batches + 2  # the hold job, then the three in one COMMIT
    assert [type(r).__name__ for r in res].count("InjectedFault") == 1
    assert sorted(r for r in res if isinstance(r, str)) == sorted(_rows(writer))
    assert len(_rows(writer)) == 2


def test_failed_commit_fails_every_job_and_leaves_nothing(writer: SpoolWriter) -> None:
    faults.arm("spool.commit", "eio", times=1, after=1)  # after the hold batch
    res = _batch(writer, ["a", "b"])
    assert all(isinstance(r, sqlite3.OperationalError) for r in res), res
    assert not writer.healthy and writer.failures == 1
    assert _rows(writer) == []  # rolled back, never reported as success
    # the connection is usable again: the failed transaction was rolled back
    assert writer.run_sync(_insert("after")) == "after"
    assert _rows(writer) == ["after"] and writer.healthy


def test_failed_begin_fails_the_batch_and_the_next_one_works(writer: SpoolWriter) -> None:
    faults.arm("spool.begin", "locked", times=1)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        writer.run_sync(_insert("x"))
    assert writer.run_sync(_insert("y")) == "y"
    assert _rows(writer) == ["y"]


async def test_async_callers_get_spool_error(writer: SpoolWriter) -> None:
    faults.arm("spool.commit", "enospc", times=1)
    with pytest.raises(SpoolError, match="full"):
        await writer.run(_insert("z"))


def test_fault_file_spec_parses() -> None:
    got = faults.parse("spool.commit enospc times=2 after=1  # disk full\nclock shift value=60")
    assert got["spool.commit"] == faults.Fault("enospc", 2, 1)
    assert got["clock"].value == 60
    with pytest.raises(ValueError, match="unknown"):
        faults.parse("x error bogus=1")


# --- the daemon: what a client sees ------------------------------------------------------------


@pytest.fixture()
def faulty(tmp_path: Path) -> Iterator[tuple[RelayProcess, Upstream, Path]]:
    up = Upstream().start()
    fault_file = tmp_path / "faults"
    fault_file.write_text("")
    # a short poll interval: the first outcome-record retry waits min(0.5 s, poll interval)
    cfg = deep_merge(
        smarthost_config(up),
        {"destinations": {"*": {"rate": "unlimited"}}, "delivery": {"poll_interval": "0.05s"}},
    )
    r = RelayProcess(tmp_path / "relay", cfg, env={"RELAY_FAULTS_FILE": str(fault_file)})
    r.start()
    try:
        yield r, up, fault_file
    finally:
        r.close()
        up.stop()


def _set(fault_file: Path, text: str) -> None:
    fault_file.write_text(text)
    time.sleep(0.15)  # the daemon re-reads the file at most every 50 ms


def _submit(port: int, data: bytes) -> tuple[int, bytes]:
    import smtplib

    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.mail("app@example.com")[0] == 250
        assert s.rcpt("user@example.org")[0] == 250
        code, msg = s.data(data)
        return code, msg


BIG = b"x" * 100 + b"\r\n"


@pytest.mark.parametrize(
    ("spec", "large", "expected"),
    [
        ("body.write enospc", True, b"4.3.1"),  # disk full writing a body file: 452, not 552
        ("body.write eio", True, b"4.3.0"),
        ("spool.commit enospc", False, b"4.3.1"),  # SQLite's "database or disk is full"
        ("spool.commit eio", False, b"4.3.0"),  # a failed COMMIT is never a 250
        ("spool.begin locked", False, b"4.3.0"),
        ("spool.job error", False, b"4.3.0"),
        ("inbound.accept error", False, b"4.3.0"),  # a hook exception: 451, never 5xx
    ],
)
def test_spool_failures_answer_4xx_and_lose_nothing(
    faulty: tuple[RelayProcess, Upstream, Path],
    spec: str,
    large: bool,
    expected: bytes,
) -> None:
    r, up, fault_file = faulty
    mid = f"<fault-{spec.replace(' ', '-')}@failure>"
    data = make_message(message_id=mid) + (BIG * 1400 if large else b"")  # > inline_max
    # armed for every hit while this client submits (the daemon's own commits, which run
    # every 2 s, fail meanwhile too: which commit a `times=1` fault hits would be a race)
    _set(fault_file, spec)
    code, msg = _submit(r.port, data)
    _set(fault_file, "")
    assert (code, msg[:5]) == (452 if expected == b"4.3.1" else 451, expected), (code, msg)
    assert r.queue(all=True) == []  # nothing half-accepted
    # the client retries, as a 4xx tells it to: now it is accepted and delivered once
    code, msg = _submit(r.port, data)
    assert code == 250, msg
    got = up.wait_for(1)
    assert sum(mid.encode() in m.data for m in got) == 1
    if large:
        bodies = [p for p in (r.spool / "bodies").rglob("*") if p.is_file()]
        assert all(not p.name.startswith(".") for p in bodies), bodies  # no temp left
    assert r.proc is not None and r.proc.poll() is None


def test_an_outcome_the_spool_refuses_is_recorded_once_it_takes_it(
    faulty: tuple[RelayProcess, Upstream, Path],
) -> None:
    """Commit dcfd486: recording an outcome retries (with capped backoff) until the spool
    takes it, not five times; otherwise the recipient stays `sending` until a restart and
    is sent again then."""
    r, up, fault_file = faulty
    _set(fault_file, "engine.record error times=6")
    code, _msg = _submit(r.port, make_message(message_id="<record-retry@failure>"))
    assert code == 250
    up.wait_for(1)
    r.wait_until(
        lambda: [x["state"] for m in r.queue(all=True) for x in m["recipients"]] == ["delivered"],
        timeout=40,
        what="the outcome recorded",
    )
    assert sum(b"<record-retry@failure>" in m.data for m in up.received) == 1
    assert sum(1 for e in r.events() if e.get("event") == "spool_error") >= 6


def test_healthz_answers_503_while_the_spool_fails_and_200_once_it_works(
    faulty: tuple[RelayProcess, Upstream, Path],
) -> None:
    import json
    import urllib.error
    import urllib.request

    r, _up, fault_file = faulty

    def healthz() -> tuple[int, dict[str, object]]:
        url = f"http://127.0.0.1:{r.admin_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert healthz()[0] == 200
    _set(fault_file, "spool.commit eio")  # every commit fails until the file changes
    code, _msg = _submit(r.port, make_message(message_id="<healthz@failure>"))
    assert code == 451
    status, doc = healthz()
    assert status == 503, doc
    assert "spool" in json.dumps(doc)
    _set(fault_file, "")
    r.wait_until(lambda: healthz()[0] == 200, timeout=10, what="healthy again")
