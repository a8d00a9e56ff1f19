"""Feedback storage that cannot fill the disk (issue 27 item 5): the per-mail cap (stored
truncated, noted), the total budget (oldest dropped, counted), the per-client rate limit on
mail to the feedback and unsubscribe addresses (relay/inbound/anvil.py's MessageRate, 450 4.7.1),
`relay feedback purge`, the config keys, and the spool's disk reserve (relay/spool/reserve.py
and the `disk` health check)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import ConfigError, from_mapping
from relay.feedback import storage
from relay.inbound import anvil
from relay.ops import health
from relay.ops.metrics import Metrics
from relay.spool import db, reserve
from tests.inbound.test_handler_accept import (
    BOUNCES,
    FEEDBACK_OK,
    NOT_A_REPORT,
    UNSUB,
    Start,
)
from tests.inbound.test_handler_accept import start as start  # a fixture, re-exported
from tests.pgserver import BACKENDS, open_backend

# --- storage (both backends) ----------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    c = open_backend(request, tmp_path / "spool")
    yield c
    c.close()


def mail(at: float, data: bytes) -> storage.Mail:
    return storage.Mail(at, "192.0.2.1", "mailer-daemon@example.net", BOUNCES, data, 0, None)


def keep(conn: Any, m: storage.Mail, cap: int, budget: int) -> storage.Kept:
    with db.transaction(conn):
        return storage.keep(conn, m, cap, budget)


def stored(conn: Any) -> list[tuple[Any, ...]]:
    return [
        tuple(r)
        for r in conn.execute(
            "SELECT at, size, stored, truncated, body FROM feedback_mail ORDER BY at"
        ).fetchall()
    ]


@pytest.mark.parametrize(
    ("data", "cap", "kept"),
    [(b"", 4, b""), (b"abcd", 4, b"abcd"), (b"abcde", 4, b"abcd"), (b"ab", 1, b"a")],
)
def test_cut_keeps_the_first_cap_octets(data: bytes, cap: int, kept: bytes) -> None:
    assert storage.cut(data, cap) == kept


def test_a_mail_over_the_cap_is_stored_truncated_and_noted(conn: Any) -> None:
    small = keep(conn, mail(1, b"x" * 100), cap=100, budget=1000)
    big = keep(conn, mail(2, b"y" * 250), cap=100, budget=1000)
    assert (small.truncated, big.truncated) == (False, True)
    assert (big.size, big.stored, big.dropped) == (250, 100, 0)
    assert stored(conn) == [(1, 100, 100, 0, b"x" * 100), (2, 250, 100, 1, b"y" * 100)]
    assert storage.total(conn) == 200


def test_past_the_budget_the_oldest_are_dropped_first_and_counted(conn: Any) -> None:
    for at in (1, 2, 3):
        assert keep(conn, mail(at, bytes([96 + at]) * 40), cap=50, budget=130).dropped == 0
    # 120 + 40 > 130: the oldest goes, the newest stays whole
    k = keep(conn, mail(4, b"d" * 40), cap=50, budget=130)
    assert (k.dropped, k.dropped_bytes, k.truncated) == (1, 40, False)
    assert [r[0] for r in stored(conn)] == [2, 3, 4]
    k = keep(conn, mail(5, b"e" * 90), cap=100, budget=130)  # 210: two more must go
    assert (k.dropped, k.dropped_bytes, k.stored) == (2, 80, 90)
    assert [r[0] for r in stored(conn)] == [4, 5]
    assert storage.total(conn) == 130
    k = keep(conn, mail(6, b"f" * 500), cap=100, budget=130)  # cut to 100, then fits
    assert (k.dropped, k.stored, k.truncated) == (2, 100, True)
    assert [r[0] for r in stored(conn)] == [6]


def test_purge_by_age_or_all(conn: Any) -> None:
    for at in (10, 20, 30):
        keep(conn, mail(at, b"z" * at), cap=1000, budget=10_000)
    with db.transaction(conn):
        assert storage.purge(conn, before=25) == (2, 30)
    assert [r[0] for r in stored(conn)] == [30]
    with db.transaction(conn):
        assert storage.purge(conn, before=None) == (1, 30)
    assert stored(conn) == []


def test_report_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    caplog.set_level(logging.INFO, logger="relay.feedback.storage")
    storage.report(storage.Kept(1, 10, 10), m, "192.0.2.1")
    assert not caplog.records
    storage.report(storage.Kept(2, 500, 100, dropped=3, dropped_bytes=300), m, "192.0.2.1")
    assert m.feedback_mail_truncated._value.get() == 1
    assert m.feedback_mail_dropped._value.get() == 3
    events = {getattr(r, "event", None): r.levelno for r in caplog.records}
    assert events == {"feedback_truncated": logging.INFO, "feedback_dropped": logging.WARNING}


# --- the rate (pure) ------------------------------------------------------------------------


def test_message_rate_allows_n_per_sliding_window() -> None:
    rate = anvil.MessageRate()
    assert [rate.allow("a", t, 3, 60) for t in (0, 1, 2, 3, 4)] == [True] * 3 + [False] * 2
    assert rate.allow("b", 4, 3, 60)  # per key
    assert not rate.allow("a", 59.9, 3, 60)
    assert rate.allow("a", 60.5, 3, 60)  # the one at 0 left the window; refusals not counted
    assert not rate.allow("a", 60.6, 3, 60)
    assert all(rate.allow("c", t, 0, 60) for t in range(100))  # 0: no limit


def test_message_rate_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anvil, "MAX_TRACKED", 10)
    rate = anvil.MessageRate()
    for i in range(10):
        rate.allow(f"old{i}", 0, 5, 60)
    rate.allow("new", 100, 5, 60)  # the old ones have nothing in the window: forgotten
    assert rate.tracked() == 1
    for i in range(20):
        rate.allow(f"busy{i}", 101, 5, 60)
    assert rate.tracked() <= 10


# --- the rate through SMTP ------------------------------------------------------------------

OUTSIDER = {"listen": [{"address": "127.0.0.1:2525", "allow": []}]}
LIMITED = "450 4.7.1 Too much mail to this address from your address; try again later"


async def test_feedback_mail_past_the_rate_gets_450_and_the_unsubscribe_address_too(
    start: Start,
) -> None:
    r = await start(
        {**OUTSIDER, "feedback": {"rate_per_ip": 2, "rate_window": "1h"}}, feedback=True
    )
    assert await r.send("d@example.net", [BOUNCES], NOT_A_REPORT) == FEEDBACK_OK
    assert await r.send("d@example.net", [UNSUB], NOT_A_REPORT) == FEEDBACK_OK
    # the third message from this client within the window: refused at RCPT, kept nowhere
    assert await r.send("d@example.net", [BOUNCES], NOT_A_REPORT) == LIMITED
    assert await r.send("d@example.net", [UNSUB], NOT_A_REPORT) == LIMITED
    assert r.rows("SELECT count(*) FROM feedback_mail") == [(1,)]
    assert r.handler.stats.by_reason == {"feedback_rate": 2}
    # counted once per transaction: two feedback recipients in one message are one
    r2 = await start(
        {**OUTSIDER, "feedback": {"rate_per_ip": 1, "rate_window": "1h"}}, feedback=True
    )
    assert await r2.send("d@example.net", [BOUNCES, UNSUB], NOT_A_REPORT) == FEEDBACK_OK


async def test_allow_listed_clients_are_not_rate_limited(start: Start) -> None:
    r = await start({"feedback": {"rate_per_ip": 1, "rate_window": "1h"}}, feedback=True)
    for _ in range(3):
        assert await r.send("d@example.net", [BOUNCES], NOT_A_REPORT) == FEEDBACK_OK


async def test_feedback_mail_over_the_cap_is_stored_truncated(start: Start) -> None:
    r = await start({**OUTSIDER, "feedback": {"mail_max_stored": "1KiB"}}, feedback=True)
    big = NOT_A_REPORT + b"filler line of junk\r\n" * 500
    assert await r.send("d@example.net", [BOUNCES], big) == FEEDBACK_OK
    assert r.rows("SELECT size, stored, truncated, body FROM feedback_mail") == [
        (len(big), 1024, 1, big[:1024])
    ]


async def test_a_large_feedback_mail_is_never_read_whole_into_memory(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27 (MEDIUM): mail to the feedback address was read whole into memory (20 x
    20 MiB from one outsider: +307 MiB). Now only what is parsed or stored is read; the row
    still says how much was received."""
    from relay.feedback import bounces
    from relay.inbound import handler as inbound  # where the accept step looks it up

    read: list[int] = []
    real = inbound._head_of

    def spy(incoming: Any, limit: int) -> bytes:
        data = real(incoming, limit)
        read.append(len(data))
        return data

    monkeypatch.setattr(inbound, "_head_of", spy)
    r = await start({**OUTSIDER, "feedback": {"mail_max_stored": "1KiB"}}, feedback=True)
    big = NOT_A_REPORT + (b"x" * 998 + b"\r\n") * (6 * 1024)  # 6 MiB, past the parser's 4
    assert await r.send("d@example.net", [BOUNCES], big) == FEEDBACK_OK
    assert read == [bounces.MAX_PARSE]
    assert r.rows("SELECT size, stored, truncated FROM feedback_mail") == [(len(big), 1024, 1)]


# --- config -------------------------------------------------------------------------------


def test_config_defaults_and_checks(tmp_path: Path) -> None:
    base = {"spool": {"path": str(tmp_path)}}
    c = from_mapping(base, tmp_path)
    assert c.spool_reserve == 64 << 20
    f = c.feedback
    assert (f.mail_max_stored, f.mail_budget, f.rate_per_ip, f.rate_window) == (
        256 << 10,
        64 << 20,
        20,
        60.0,
    )
    c = from_mapping({"spool": {"path": str(tmp_path), "reserve": 0}}, tmp_path)
    assert c.spool_reserve == 0
    for bad, why in [
        ({"spool": {"reserve": "lots"}}, "spool.reserve: 'lots' is not a size"),
        ({"feedback": {"mail_max_stored": 10}}, "feedback.mail_max_stored: at least 1KiB"),
        ({"feedback": {"mail_budget": "1KiB"}}, "feedback.mail_budget: 1024 bytes is below"),
        ({"feedback": {"rate_per_ip": -1}}, "feedback.rate_per_ip: -1 is below the minimum 0"),
        ({"feedback": {"rate_window": "0s"}}, "feedback.rate_window: must be more than 0s"),
        ({"feedback": {"rate_limit": 3}}, "feedback.rate_limit: unknown key"),
    ]:
        cfg = {"spool": {"path": str(tmp_path), **bad.get("spool", {})}}
        if "feedback" in bad:
            cfg["feedback"] = bad["feedback"]
        with pytest.raises(ConfigError, match="^" + why.replace("(", r"\(")):
            from_mapping(cfg, tmp_path)


def test_the_shipped_config_names_the_new_keys_with_their_defaults() -> None:
    conf = yaml.safe_load(Path("conf/relay.yaml").read_text())
    assert conf["spool"]["reserve"] == "64MiB"
    assert {k: conf["feedback"][k] for k in ("mail_max_stored", "mail_budget")} == {
        "mail_max_stored": "256KiB",
        "mail_budget": "64MiB",
    }
    assert (conf["feedback"]["rate_per_ip"], conf["feedback"]["rate_window"]) == (20, "1m")


# --- `relay feedback purge` ---------------------------------------------------------------


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", "feedback", "purge", *args, "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_feedback_purge_cli(tmp_path: Path) -> None:
    import time

    spool = tmp_path / "spool"
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"spool": {"path": str(spool)}}))
    conn = db.connect(spool)
    now = time.time()
    for age, size in ((3 * 86400, 30), (2 * 86400, 20), (60, 10)):
        keep(conn, mail(now - age, b"q" * size), cap=1000, budget=10_000)
    conn.close()
    # usage errors: exit 2 (neither, both, a bad duration), nothing deleted
    assert cli(config).returncode == 2
    assert cli(config, "--all", "--older-than", "1d").returncode == 2
    bad = cli(config, "--older-than", "soon")
    assert bad.returncode == 2 and "--older-than" in bad.stderr
    res = cli(config, "--older-than", "1d", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {
        "action": "feedback purge",
        "mails": 2,
        "bytes": 50,
        "older_than": "1d",
    }
    res = cli(config, "--all")
    assert res.returncode == 0 and res.stdout == "feedback purge: deleted 1 mail (10 bytes)\n"
    conn = db.connect(spool)
    try:
        assert stored(conn) == []
        actions = [r[0] for r in conn.execute("SELECT action FROM oplog ORDER BY id")]
        assert actions == ["feedback purge", "feedback purge"]  # the audit trail
    finally:
        conn.close()


# --- the disk reserve -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "kept", "low"),
    [(0, 0, False), (10, 0, False), (99, 100, True), (100, 100, False), (101, 100, False)],
)
def test_reserve_low(free: int, kept: int, low: bool) -> None:
    assert reserve.low(free, kept) is low


def test_the_disk_check_is_critical_below_the_reserve() -> None:
    status, detail = health.disk(50.0, 10.0, 5.0, free_bytes=10 << 20, reserve=64 << 20)
    assert status == "critical"
    assert "below spool.reserve (64.0 MiB)" in detail and "452 4.3.1" in detail
    assert health.disk(50.0, 10.0, 5.0, free_bytes=65 << 20, reserve=64 << 20)[0] == "ok"
    assert health.disk(50.0, 10.0, 5.0, free_bytes=1, reserve=0)[0] == "ok"
    assert health.disk(4.0, 10.0, 5.0, free_bytes=1 << 40, reserve=64 << 20)[0] == "critical"


async def test_the_reserve_gate_refuses_below_the_reserve(tmp_path: Path) -> None:
    free = reserve.free_bytes(tmp_path)
    want = {"reserve": free * 2}
    gate = reserve.ReserveGate(lambda: (tmp_path, want["reserve"]))
    await gate.check()
    assert gate.refusal() == "452 4.3.1 Insufficient system storage; try again later"
    want["reserve"] = 0
    await gate.check()
    assert gate.refusal() is None
    want["reserve"] = max(1, free // 2)
    await gate.check()
    assert gate.refusal() is None
