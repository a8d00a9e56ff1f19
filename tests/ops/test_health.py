"""The pure parts of "no silent failure": health judgements and transitions (relay/ops/health.py),
the monitoring plugin output, the breaker's operator controls, what counts as a failing
upstream, and the per-recipient retry clock (a regression: recipients sharing a job expired
against the first one's). (The alert outbox, once tested here too, is in test_alerts.py.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from relay.config.tree import ConfigError, load_config
from relay.delivery import attempt, shaping
from relay.delivery.decide import refused_mail
from relay.delivery.engine import Engine
from relay.delivery.jobs import Job
from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict
from relay.delivery.transport import RcptResult
from relay.ops import health
from relay.spool import ops
from relay.spool.writer import SpoolWriter
from tests.bodyfiles import write_body

# --- judgements -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "status"),
    [
        (50.0, "ok"),
        (10.01, "ok"),
        (10.0, "warning"),
        (5.01, "warning"),
        (5.0, "critical"),
        (0.0, "critical"),
    ],
)
def test_disk(free: float, status: str) -> None:
    got, detail = health.disk(free, 10.0, 5.0)
    assert got == status
    assert f"{free:.1f}% free" in detail
    assert ("452 4.3.1" in detail) == (status == "critical")


@pytest.mark.parametrize(
    ("age", "status"),
    [
        (None, "ok"),
        (0.0, "ok"),
        (1799.0, "ok"),
        (1800.0, "warning"),
        (14399.0, "warning"),
        (14400.0, "critical"),
    ],
)
def test_queue_age(age: float | None, status: str) -> None:
    assert health.queue_age(age, 1800.0, 14400.0)[0] == status


@pytest.mark.parametrize(
    ("overdue", "since", "status"),
    [
        (0, None, "ok"),  # nothing overdue
        (3, 5.0, "ok"),  # overdue, but deliveries continue
        (3, 600.0, "warning"),  # overdue, and nothing delivered for stall_after
        (3, None, "warning"),  # overdue, nothing delivered since start
    ],
)
def test_stall(overdue: int, since: float | None, status: str) -> None:
    got, detail = health.stall(overdue, since, 600.0)
    assert got == status
    if status == "warning":
        assert f"{overdue} recipients" in detail


def test_dead_letters_and_destination() -> None:
    assert health.dead_letters(49, 50)[0] == "ok"
    assert health.dead_letters(50, 50)[0] == "warning"
    assert health.destination("d", "closed", 0, None, None) == ("ok", "d: ok")
    assert health.destination("d", "closed", 2, None, None)[0] == "ok"
    st, detail = health.destination("d", "open", 5, None, "2026-01-01T00:00:00Z")
    assert st == "warning" and "5 consecutive" in detail and "2026-01-01" in detail
    assert health.destination("d", "half-open", 5, None, None)[0] == "warning"
    # a configuration error is critical at once, whatever the circuit says
    st, detail = health.destination("d", "closed", 1, "h: 535 5.7.8 bad", None)
    assert st == "critical" and "535 5.7.8" in detail


def test_model_transitions_and_since() -> None:
    m = health.Model()
    assert m.update("disk", "ok", "90% free", 1.0) is None  # starting ok is no news
    assert m.update("spool", "critical", "gone", 1.0) == health.Transition(
        "spool", "ok", "critical", "gone"
    )  # starting bad is
    assert m.update("disk", "ok", "89% free", 2.0) is None
    assert m.checks["disk"].since == 1.0 and m.checks["disk"].detail == "89% free"
    t = m.update("disk", "warning", "9% free", 3.0)
    assert t == health.Transition("disk", "ok", "warning", "9% free")
    assert m.checks["disk"].since == 3.0
    assert m.status() == "critical" and not m.ready()
    m.update("spool", "ok", "fine", 4.0)
    assert m.status() == "warning" and m.ready()  # a warning is still ready
    m.update("destination:x", "critical", "refused", 5.0)
    assert m.ready()  # a destination does not decide whether mail can be taken
    doc = m.as_dict(str)
    assert doc["status"] == "critical"
    assert [c["name"] for c in doc["checks"]] == ["destination:x", "disk", "spool"]


@pytest.mark.parametrize(
    ("doc", "code", "head"),
    [
        (
            {
                "status": "ok",
                "checks": [{"name": "a", "status": "ok", "since": "t", "detail": "d"}],
            },
            0,
            "OK: all checks ok",
        ),
        (
            {
                "status": "warning",
                "checks": [{"name": "a", "status": "warning", "since": "t", "detail": "slow"}],
            },
            1,
            "WARNING: a: slow",
        ),
        (
            {
                "status": "critical",
                "checks": [
                    {"name": "a", "status": "critical", "since": "t", "detail": "x"},
                    {"name": "b", "status": "warning", "since": "t", "detail": "y"},
                ],
            },
            2,
            "CRITICAL: a: x; b: y",
        ),
        ({"status": "unknown", "detail": "daemon not running"}, 3, "UNKNOWN: daemon not running"),
        ({}, 3, "UNKNOWN: no health data"),
    ],
)
def test_plugin_output(doc: dict, code: int, head: str) -> None:
    got, text = health.plugin_output(doc)
    assert got == code
    assert text.splitlines()[0] == head


# --- config ----------------------------------------------------------------------------------


def _load(tmp_path: Path, extra: dict) -> object:
    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": "spool"}, **extra}))
    return load_config(str(p))


def test_health_and_webhook_config(tmp_path: Path) -> None:
    (tmp_path / "s").write_text("sekrit\n")
    cfg = _load(
        tmp_path,
        {
            "health": {"disk_free_warning": 20, "disk_free_critical": "2.5%"},
            "alerts": {"webhook": {"url": "https://h.test/x", "secret_file": "s"}},
        },
    )
    assert cfg.health.disk_free_warning == 20.0 and cfg.health.disk_free_critical == 2.5
    assert cfg.alerts.webhook.secret == b"sekrit" and cfg.alerts.webhook.timeout == 10.0
    assert cfg.alerts.coalesce == 300.0 and cfg.retry.warn_after == 4 * 3600
    assert "sekrit" not in json.dumps(cfg.redacted(), default=str)
    for bad, msg in [
        ({"health": {"disk_free_warning": "110%"}}, "health.disk_free_warning"),
        (
            {"health": {"disk_free_warning": "5%", "disk_free_critical": "6%"}},
            "health.disk_free_critical",
        ),
        ({"alerts": {"webhook": {"url": "ftp://x"}}}, "alerts.webhook.url"),
        (
            {"alerts": {"webhook": {"url": "http://x", "secret_file": "nope"}}},
            "alerts.webhook.secret_file",
        ),
        ({"alerts": {"webhook": {"url": "http://x", "secret": "inline"}}}, "alerts.webhook.secret"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            _load(tmp_path, bad)


# --- the breaker ------------------------------------------------------------------------------


def test_kick_makes_an_open_breaker_half_open_at_once() -> None:
    b = shaping.Breaker(threshold=1, cooldown=3600.0)
    b.on_failure(100.0)
    assert b.state(101.0) == "open" and not b.allow(101.0)
    b.kick(101.0)
    assert b.state(101.0) == "half-open"
    assert b.allow(101.0)  # the trial
    assert not b.allow(101.5)  # only one
    b.on_failure(102.0)
    assert b.state(102.0) == "open"  # a failed trial re-opens with a fresh cooldown
    closed = shaping.Breaker()
    closed.kick(5.0)
    assert closed.state(5.0) == "closed"


def test_reset_undoes_every_slow_down() -> None:
    a = shaping.Adaptive(base_rate=10.0, base_connections=8)
    a.on_throttle(1.0, hold=600.0)
    a.on_throttle(10.0)
    assert a.effective_connections() == 2
    a.reset()
    assert a.effective_rate() == 10.0 and a.effective_connections() == 8
    assert a.hold_until is None and a.last_decrease is None


def _res(
    code: int, phase: Phase, outcome: Outcome = Outcome.TRANSIENT, ambiguous: bool = False
) -> RcptResult:
    return RcptResult(
        Verdict(outcome, False, False, Scope.TRANSACTION),
        Reply(code, f"{code // 100}.0.0", "x"),
        phase,
        ambiguous,
    )


@pytest.mark.parametrize(
    ("results", "delivered", "failing"),
    [
        ({"a": _res(451, Phase.MAIL), "b": _res(451, Phase.MAIL)}, 0, True),  # 4xx to MAIL
        ({"a": _res(421, Phase.MAIL)}, 0, True),
        ({"a": _res(421, Phase.DATA)}, 0, False),  # throttling: AIMD's, not the breaker's
        ({"a": _res(451, Phase.RCPT)}, 0, False),  # one mailbox busy: the host works
        ({"a": _res(451, Phase.MAIL), "b": _res(250, Phase.DATA, Outcome.DELIVERED)}, 1, False),
        ({"a": _res(550, Phase.MAIL, Outcome.FAIL)}, 0, False),  # a 5xx is an answer
        ({"a": _res(421, Phase.DATA, ambiguous=True)}, 0, False),  # after the dot: unknown
        ({}, 0, False),
    ],
)
def test_refused_mail(results: dict, delivered: int, failing: bool) -> None:
    assert refused_mail(results, delivered) is failing


# --- the retry clock (issue: recipients sharing a job expired against the wrong clock) ----


def test_each_recipient_of_a_job_expires_against_its_own_clock(tmp_path: Path) -> None:
    p = tmp_path / "relay.yaml"
    p.write_text(
        yaml.safe_dump({"spool": {"path": "spool"}, "retry": {"schedule": ["1m"], "max_age": "1h"}})
    )
    cfg = load_config(str(p))
    w = SpoolWriter(cfg.spool_path)
    w.start()
    now = 100_000.0

    async def main() -> dict[str, str]:
        e = Engine(cfg, w, clock=lambda: now)
        msg = ops.NewMessage(
            "M1",
            "1@x",
            "a@x.test",
            1,
            now - 7200,
            "c",
            "p",
            "transactional",
            0,
            "x.test",
            b"x",
            None,
            (
                ops.NewRecipient("fresh@x.test", "x.test", "k1"),
                ops.NewRecipient("old@x.test", "x.test", "k2"),
            ),
        )
        await w.run(lambda c: ops.accept(c, msg, 3600))
        ids = {c.address: c.rcpt_id for c in await w.run(lambda c: ops.claim_due(c, now, 10))}
        # `queue retry` restarted fresh@'s clock ten seconds ago; old@ keeps the arrival's
        fresh = ops.Claim(
            ids["fresh@x.test"],
            "M1",
            "fresh@x.test",
            "x.test",
            3,
            now - 10,
            "transactional",
            "x.test",
        )
        old = ops.Claim(
            ids["old@x.test"],
            "M1",
            "old@x.test",
            "x.test",
            3,
            now - 7200,
            "transactional",
            "x.test",
        )
        env = ops.Envelope("M1", "<1@x>", "a@x.test", 1, b"x", None)
        job = Job("M1", "smarthost", "transactional", "x.test", "a@x.test", [fresh, old], env)
        st = e.dests.dest("smarthost")
        busy = {a: _res(451, Phase.RCPT) for a in ("fresh@x.test", "old@x.test")}
        await attempt.apply(e.attempt, st, job, busy, host=None, duration=0.0)
        rows = await w.run(lambda c: c.execute("SELECT address, state FROM recipients").fetchall())
        return dict(rows)

    try:
        got = asyncio.run(main())
    finally:
        w.close()
    assert got == {"fresh@x.test": "deferred", "old@x.test": "failed"}


# --- 0f92e41: a DSN reads a file-stored body off the event loop ---------------------------


def test_a_dsn_reads_a_file_stored_body_in_a_thread(tmp_path: Path, monkeypatch) -> None:
    import threading

    from relay.delivery import dsn
    from relay.spool import bodies

    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": "spool"}, "dsn": {"enabled": True}}))
    cfg = load_config(str(p))
    w = SpoolWriter(cfg.spool_path)
    w.start()
    body = b"Subject: big\r\nMessage-ID: <big@x.test>\r\n\r\n" + b"x" * 100 + b"\r\n"
    rel = write_body(cfg.spool_path, "Q1BIG", body)
    msg = ops.NewMessage(
        "Q1BIG",
        "big@x.test",
        "s@y.test",
        len(body),
        1.0,
        "c",
        "p",
        "transactional",
        0,
        "y.test",
        b"",
        rel,
        (ops.NewRecipient("gone@x.test", "x.test", "k1"),),
    )
    threads: list[bool] = []
    real = bodies.load

    def spy(*a: object, **kw: object) -> bytes:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bodies, "load", spy)

    async def main() -> str | None:
        await w.run(lambda c: ops.accept(c, msg, 3600))
        return await dsn.queue_dsn(
            cfg,
            w,
            {
                "queue_id": "Q1BIG",
                "sender": "s@y.test",
                "recipient": "gone@x.test",
                "reply": "550 5.1.1 no such user",
            },
        )

    try:
        new = asyncio.run(main())
    finally:
        w.close()
    assert new is not None
    assert threads == [False]  # read once, not on the event loop's thread


# --- exact texts: what a person reads ------------------------------------------------------


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (
            health.disk(3.0, 10, 5),
            (
                "critical",
                "3.0% free where the spool lives (critical at 5%):"
                " new mail is refused with 452 4.3.1 until space"
                " is freed",
            ),
        ),
        (health.disk(8.0, 10, 5), ("warning", "8.0% free where the spool lives (warning at 10%)")),
        (health.queue_age(None, 60, 120), ("ok", "nothing waiting")),
        (
            health.queue_age(90, 60, 120),
            ("warning", "oldest waiting recipient queued 1m30s ago (warning at 1m0s)"),
        ),
        (health.stall(0, None, 600), ("ok", "the queue is moving")),
        (health.stall(2, 5.0, 600), ("ok", "2 recipients overdue, but deliveries continue")),
        (
            health.stall(2, None, 600),
            (
                "warning",
                "queue stalled: 2 recipients due for over 10m0s and no delivery (none since start)",
            ),
        ),
        (
            health.stall(2, 7300, 600),
            (
                "warning",
                "queue stalled: 2 recipients due for over 10m0s and no delivery (last 2h1m ago)",
            ),
        ),
        (health.dead_letters(3, 50), ("ok", "3 dead letters in the last hour")),
        (
            health.destination("d", "closed", 0, "h: 535 bad", None),
            (
                "critical",
                "d: upstream refused our configuration: h: 535 bad; mail is kept; fix the"
                " config and reload",
            ),
        ),
    ],
)
def test_details_read_right(got: tuple[str, str], want: tuple[str, str]) -> None:
    assert got == want


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (5, "5s"),
        (59, "59s"),
        (60, "1m0s"),
        (3599, "59m59s"),
        (3600, "1h0m"),
        (86399, "23h59m"),
        (86400, "1d0h"),
        (90061, "1d1h"),
    ],
)
def test_human(seconds: float, text: str) -> None:
    assert health.human(seconds) == text


def test_check_document_and_worst() -> None:
    m = health.Model()
    m.update("a", "warning", "slow", 5.0)
    assert m.checks["a"].as_dict(lambda t: f"T{t:g}") == {
        "name": "a",
        "status": "warning",
        "since": "T5",
        "detail": "slow",
    }
    assert health.worst(["ok", "critical", "warning"]) == "critical"
    assert health.worst(["warning", "ok"]) == "warning"
    assert health.worst([]) == "ok"


def test_plugin_output_lists_every_check() -> None:
    doc = {
        "status": "warning",
        "checks": [
            {"name": "a", "status": "ok", "since": "S1", "detail": "fine"},
            {"name": "b", "status": "warning", "since": "S2", "detail": "slow"},
        ],
    }
    code, text = health.plugin_output(doc)
    assert code == 1
    assert text.splitlines() == [
        "WARNING: b: slow",
        "ok       a                        since S1  fine",
        "warning  b                        since S2  slow",
    ]
    assert health.plugin_output({"status": "ok"}) == (0, "OK: all checks ok")


# Mutation-driven (tests/MUTANTS.md; until issue 28 in tests/test_mutants_delivery_core.py).
# --- health ------------------------------------------------------------------------------------


def test_model_drop() -> None:
    m = health.Model()
    m.update("disk", "ok", "fine", 1.0)
    m.update("spool", "ok", "fine", 1.0)
    m.drop("disk")
    m.drop("nothing")
    assert list(m.checks) == ["spool"]


def test_exact_health_details() -> None:
    assert health.disk(1.0, 10.0, 5.0) == (
        "critical",
        "1.0% free where the spool lives (critical at 5%): new mail is refused with"
        " 452 4.3.1 until space is freed",
    )
    assert health.queue_age(None, 60.0, 120.0) == ("ok", "nothing waiting")
    assert health.queue_age(30.0, 60.0, 120.0) == ("ok", "oldest waiting recipient queued 30s ago")
    assert health.stall(0, None, 60.0) == ("ok", "the queue is moving")
    assert health.stall(3, None, 60.0) == (
        "warning",
        "queue stalled: 3 recipients due for over 1m0s and no delivery (none since start)",
    )
    assert health.stall(3, 120.0, 60.0) == (
        "warning",
        "queue stalled: 3 recipients due for over 1m0s and no delivery (last 2m0s ago)",
    )
    assert health.dead_letters(2, 5) == ("ok", "2 dead letters in the last hour")
    assert health.destination("x", "closed", 0, "535 bad auth", None) == (
        "critical",
        "x: upstream refused our configuration: 535 bad auth;"
        " mail is kept; fix the config and reload",
    )


@pytest.mark.parametrize(
    ("seconds", "want"),
    [(86400 + 3600, "1d1h"), (86400 + 3599, "1d0h"), (3600 + 60, "1h1m"), (3600 + 59, "1h0m")],
)
def test_health_human_boundaries(seconds: float, want: str) -> None:
    assert health.human(seconds) == want
