"""No silent failure, end to end: a real daemon, a real aiosmtpd upstream and a real HTTP
receiver for the alert webhook, all on loopback. The health model (/health, /healthz,
`relay status`), the durable coalesced alert outbox, the breaker the operator sees and
overrides, delay warnings."""

from __future__ import annotations

import json
import signal
import smtplib
import sqlite3
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    RelayProcess,
    deep_merge,
    fast_config,
    make_message,
    send,
    server_context,
    smtp_session,
)
from tests.webhook import Receiver

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
SECRET = b"hook-secret-123"

FAST: dict[str, Any] = fast_config("2s")


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def factory(start: bool = True) -> Receiver:
        rec = Receiver()
        made.append(rec)
        return rec.start() if start else rec

    yield factory
    for rec in made:
        rec.stop()


def hooked(tmp_path: Path, rec: Receiver, **extra: Any) -> dict[str, Any]:
    secret = tmp_path / "hook.secret"
    secret.write_bytes(SECRET + b"\n")
    cfg = deep_merge(
        FAST,
        {
            "alerts": {
                "webhook": {"url": rec.url, "secret_file": str(secret), "timeout": "2s"},
                "coalesce": "1s",
            }
        },
    )
    return deep_merge(cfg, extra)


def http_get(r: RelayProcess, path: str) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{r.admin_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check(r: RelayProcess, name: str) -> dict[str, Any]:
    _code, doc = http_get(r, "/health")
    for c in doc["checks"]:
        if c["name"] == name:
            return dict(c)
    return {"name": name, "status": None, "detail": ""}


def events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


def states(r: RelayProcess) -> dict[str, str]:
    return r.recipient_states()


def status_json(r: RelayProcess, code: int) -> dict[str, Any]:
    res = r.cli("status", "--json")
    assert res.returncode == code, res.stdout + res.stderr
    doc = dict(json.loads(res.stdout))
    assert doc["exit_code"] == code
    return doc


def mail_reply(port: int) -> tuple[int, bytes]:
    with smtp_session(port) as s:
        return s.mail(SENDER)


# --- a refused AUTH ------------------------------------------------------------------------


def test_refused_auth_is_critical_at_once_alerted_once_and_resolved_after_the_fix(
    upstream, relay, receiver, ca, tmp_path: Path
) -> None:
    up = upstream(tls_context=server_context(ca), auth={"user": "right"})
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    pw = tmp_path / "password"
    pw.write_text("wrong\n")
    rec = receiver()
    r = relay(
        upstream=up,
        config=hooked(
            tmp_path,
            rec,
            upstream={
                "smarthost": {
                    "tls": "starttls",
                    "ca_file": str(ca_file),
                    "username": "user",
                    "password_file": str(pw),
                }
            },
        ),
    )
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}

    # within one attempt (and one health pass): critical, naming the destination and cause
    r.wait_until(
        lambda: check(r, "destination:smarthost")["status"] == "critical",
        timeout=10,
        what="destination critical",
    )
    code, doc = http_get(r, "/health")
    assert code == 503 and doc["status"] == "critical"
    detail = check(r, "destination:smarthost")["detail"]
    assert "refused our configuration" in detail and "535" in detail, detail
    res = r.cli("status")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout.startswith("CRITICAL:") and "smarthost" in res.stdout
    # readiness is about taking mail, which still works
    assert http_get(r, "/healthz")[0] == 200

    posts = rec.wait(
        lambda ps: any(p.doc["event"] == "upstream_config_error" for p in ps),
        what="upstream_config_error alert",
    )
    alert = next(p for p in posts if p.doc["event"] == "upstream_config_error")
    assert alert.signed_by(SECRET)
    assert alert.headers["content-type"] == "application/json"
    d = alert.doc
    assert d["version"] == 1 and d["severity"] == "critical"
    assert d["key"] == "destination:smarthost" and d["count"] == 1
    assert "535" in d["summary"]
    assert "wrong" not in alert.body.decode()  # never a secret
    r.wait_until(
        lambda: (
            len(r.cli_json("queue", "list")[0]["recipients"][0:1]) == 1
            and r.cli_json("queue", "list")[0]["recipients"][0]["attempts"] >= 3
        ),
        what="three refused attempts",
    )
    # attempts go on failing; the alert was one
    assert sum(p.doc["event"] == "upstream_config_error" for p in rec.accepted()) == 1

    pw.write_text("right\n")
    r.signal(signal.SIGHUP)
    r.wait_until(lambda: states(r).get("user@example.org") == "delivered", what="delivered")
    rec.wait(
        lambda ps: any(
            p.doc["event"] == "resolved" and p.doc["key"] == "destination:smarthost" for p in ps
        ),
        what="resolved alert",
    )
    r.wait_until(lambda: r.cli("status").returncode == 0, timeout=10, what="status OK")
    assert up.wait_for(1)[0].auth == "user"


# --- coalescing ----------------------------------------------------------------------------


def test_two_hundred_dead_letters_in_a_minute_make_one_alert(
    upstream, relay, receiver, tmp_path: Path
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user"
    rec = receiver()
    r = relay(upstream=up, config=hooked(tmp_path, rec, alerts={"coalesce": "6s"}))
    for m in range(4):
        rcpts = [f"gone{m}-{i}@example.org" for i in range(50)]
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            assert s.sendmail(SENDER, rcpts, make_message(100 + m)) == {}
    r.wait_until(lambda: list(states(r).values()).count("bounced") == 200, what="200 bounced")
    posts = rec.wait(
        lambda ps: any(p.doc["event"] == "dead_letter" for p in ps),
        timeout=20,
        what="the dead_letter alert",
    )
    time.sleep(1.5)
    dead = [p.doc for p in rec.accepted() if p.doc["event"] == "dead_letter"]
    assert len(dead) == 1, dead
    assert dead[0]["count"] == 200 and dead[0]["key"] == "smarthost"
    assert len(dead[0]["samples"]) == 5
    assert all(
        s["reply"].startswith("550 5.1.1") and s["recipient"].startswith("g***@")
        for s in dead[0]["samples"]
    )
    assert posts[0].signed_by(SECRET)
    # every dead letter is still its own ERROR line
    assert len(events(r, "dead_letter")) == 200


# --- durability of the outbox -----------------------------------------------------------------


def pending_alerts(r: RelayProcess) -> list[dict[str, Any]]:
    return [a for a in r.cli_json("alerts") if a["pending_sinks"]]


def test_an_alert_recorded_before_a_sigkill_reaches_the_webhook_once_after_restart(
    upstream, relay, receiver, tmp_path: Path
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("gone") else None
    rec = receiver(start=False)  # the receiver is down
    r = relay(upstream=up, config=hooked(tmp_path, rec, alerts={"coalesce": "0s"}))
    assert send(r.port, SENDER, ["gone1@example.org"], make_message(1)) == {}
    assert send(r.port, SENDER, ["gone2@example.org"], make_message(2)) == {}
    r.wait_until(
        lambda: len(pending_alerts(r)) == 2 and all(a["attempts"] >= 1 for a in pending_alerts(r)),
        what="two alerts recorded, their webhook failing",
    )
    assert "webhook" in (pending_alerts(r)[0]["last_error"] or "")
    r.kill()  # SIGKILL: nothing gets flushed on the way out

    rec.start()
    r.start_again()
    posts = rec.wait(lambda ps: len(ps) >= 2, what="both alerts after the restart")
    time.sleep(2.0)
    ids = [p.doc["id"] for p in rec.accepted()]
    assert len(ids) == 2 and len(set(ids)) == 2, ids  # each exactly once
    assert all(p.headers["x-relay-delivery"] == p.doc["id"] for p in posts)
    assert pending_alerts(r) == []


def test_a_receiver_that_fails_for_a_while_gets_every_alert_once_it_is_back(
    upstream, relay, receiver, tmp_path: Path
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user"
    rec = receiver()
    rec.status = 503
    r = relay(upstream=up, config=hooked(tmp_path, rec, alerts={"coalesce": "0s"}))
    for i in range(3):
        assert send(r.port, SENDER, [f"gone{i}@example.org"], make_message(i)) == {}
    deadline = time.monotonic() + 20
    while len({json.loads(p.body)["id"] for p in rec.posts}) < 3:
        assert time.monotonic() < deadline, "three alerts not tried"
        time.sleep(0.1)
    errors = events(r, "alert_failed")
    assert errors and "HTTP 503" in errors[0]["error"]
    rec.status = 200
    rec.wait(lambda ps: len(ps) >= 3, what="three alerts once the receiver is back")
    time.sleep(2.5)
    ids = [p.doc["id"] for p in rec.accepted()]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 3


# --- readiness: disk and spool ----------------------------------------------------------------


def test_disk_below_the_critical_threshold_refuses_at_mail_and_fails_readiness(
    upstream, relay
) -> None:
    up = upstream()
    # an injectable threshold: any real filesystem has at most 100% free
    r = relay(
        upstream=up,
        config=deep_merge(
            FAST, {"health": {"disk_free_warning": "100%", "disk_free_critical": "100%"}}
        ),
    )
    code, msg = mail_reply(r.port)
    assert (code, msg[:5]) == (452, b"4.3.1"), msg
    assert http_get(r, "/healthz")[0] == 503
    c = check(r, "disk")
    assert c["status"] == "critical" and "452 4.3.1" in c["detail"]
    assert r.cli("status").returncode == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{r.admin_port}/metrics", timeout=10) as m:
        metrics = m.read().decode()
    assert 'relay_health_status{check="disk"} 2.0' in metrics
    assert 'relay_health_status{check="spool"} 0.0' in metrics
    # space freed (here: thresholds back to normal): mail is taken again
    cfg = r.config
    cfg["health"] = {"disk_free_warning": "0%", "disk_free_critical": "0%"}
    r.write_config(cfg)
    r.signal(signal.SIGHUP)
    r.wait_until(lambda: mail_reply(r.port)[0] == 250, timeout=10, what="MAIL accepted")
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}
    assert http_get(r, "/healthz")[0] == 200
    up.wait_for(1)


def test_a_spool_database_deleted_under_the_daemon_is_critical_within_seconds(
    upstream, relay
) -> None:
    up = upstream()
    r = relay(upstream=up, config=FAST)
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}
    up.wait_for(1)
    for name in ("relay.sqlite", "relay.sqlite-wal", "relay.sqlite-shm"):
        (r.spool / name).unlink(missing_ok=True)
    t0 = time.monotonic()
    r.wait_until(lambda: mail_reply(r.port)[0] == 451, timeout=5, what="451 at MAIL")
    assert time.monotonic() - t0 < 5
    code, msg = mail_reply(r.port)
    assert (code, msg[:5]) == (451, b"4.3.0")
    c = check(r, "spool")
    assert c["status"] == "critical" and "deleted" in c["detail"]
    assert http_get(r, "/healthz")[0] == 503
    res = r.cli("status")  # reads the health file, not the (gone) database
    assert res.returncode == 2 and "deleted" in res.stdout
    assert [e for e in events(r, "health_changed") if e["check"] == "spool"]


# --- the queue ----------------------------------------------------------------------------


def test_a_stalled_and_an_old_queue_raise_their_warnings(upstream, relay) -> None:
    up = upstream()
    up.stall = {"mail": 30}  # takes the connection, never answers MAIL
    r = relay(
        upstream=up,
        config=deep_merge(
            FAST,
            {
                "destinations": {"*": {"command_timeout": "60s"}},
                "health": {
                    "stall_after": "1s",
                    "queue_age_warning": "2s",
                    "queue_age_critical": "1h",
                },
            },
        ),
    )
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}
    r.wait_until(
        lambda: check(r, "queue_stall")["status"] == "warning", timeout=15, what="stall warning"
    )
    assert "stalled" in check(r, "queue_stall")["detail"]
    r.wait_until(
        lambda: check(r, "queue_age")["status"] == "warning", timeout=15, what="queue age warning"
    )
    res = r.cli("status")
    assert res.returncode == 1 and res.stdout.startswith("WARNING:"), res.stdout
    assert http_get(r, "/health")[0] == 200  # warnings are not outages
    doc = status_json(r, 1)
    assert {c["name"]: c["status"] for c in doc["checks"]}["queue_stall"] == "warning"


# --- the breaker ----------------------------------------------------------------------------


def test_a_421_greeting_opens_the_circuit_and_flush_and_reset_act_at_once(upstream, relay) -> None:
    up = upstream()
    up.connect_reply = "421 4.7.0 upstream.test too busy"
    r = relay(
        upstream=up,
        config=deep_merge(
            FAST, {"destinations": {"*": {"circuit_failures": 2, "circuit_cooldown": "1h"}}}
        ),
    )
    assert send(r.port, SENDER, ["a@example.org"], make_message(1)) == {}
    r.wait_until(lambda: events(r, "circuit_open"), what="circuit_open")
    opened = events(r, "circuit_open")[0]
    assert opened["level"] == "warning" and "421" in opened["reason"]
    assert opened["destination"] == "smarthost" and opened["retry_at"]
    # the check warns from the first failure (an upstream that never answered since start,
    # health.failing_after); it names the open circuit once the health pass has seen it
    r.wait_until(
        lambda: "circuit open" in check(r, "destination:smarthost")["detail"],
        what="destination warning naming the open circuit",
    )
    assert check(r, "destination:smarthost")["status"] == "warning"

    # new mail meanwhile is not claimed (so its row has no reason): `queue show` says why
    assert send(r.port, SENDER, ["w@example.org"], make_message(4)) == {}
    r.wait_until(
        lambda: any(
            d["name"] == "smarthost" and d.get("circuit") == "open"
            for d in r.cli_json("destination", "list")
        ),
        what="the snapshot shows the open circuit",
    )
    found = r.cli_json("queue", "find", "--recipient", "w@example.org")
    qid = found[0]["id"]
    shown = r.cli_json("queue", "show", qid)
    (rc,) = shown["recipients"]
    assert rc["state"] == "pending" and rc["reason"] is None
    assert rc["waiting_on"].startswith("circuit open for smarthost until 20")
    text = r.cli("queue", "show", qid).stdout
    assert f"waiting: {rc['waiting_on']}" in text
    # and in the queue listing, as Postfix's mailq shows a suspended destination
    listed = {m["id"]: m for m in r.queue(all=False)}
    assert listed[qid]["recipients"][0]["waiting_on"] == rc["waiting_on"]
    assert f"(waiting: {rc['waiting_on']})" in r.cli("queue", "list").stdout
    # the mail that failed waits for the same circuit: said the same way, beside its reply
    a_id = r.cli_json("queue", "find", "--recipient", "a@example.org")[0]["id"]
    (first,) = r.cli_json("queue", "show", a_id)["recipients"]
    assert first["state"] == "deferred" and "421" in first["last_reply"]
    assert first["waiting_on"] == rc["waiting_on"]  # not at its next_attempt_at, an hour on

    # the upstream is back; the circuit waits an hour, but a flush goes now
    up.connect_reply = None
    t0 = time.monotonic()
    assert r.cli("queue", "flush").returncode == 0
    r.wait_until(
        lambda: states(r).get("a@example.org") == "delivered",
        timeout=10,
        what="delivered after flush",
    )
    assert time.monotonic() - t0 < 8
    r.wait_until(lambda: events(r, "circuit_closed"), what="circuit_closed")
    assert events(r, "circuit_half_open")

    # an upstream that answers 4xx to every MAIL counts as failing too
    up.mail_reply = lambda s: "451 4.3.0 try again later"
    assert send(r.port, SENDER, ["b@example.org"], make_message(2)) == {}
    r.wait_until(lambda: len(events(r, "circuit_open")) == 2, what="circuit open again")
    up.mail_reply = lambda s: None
    t0 = time.monotonic()
    res = r.cli_json("destination", "reset", "smarthost")
    assert res["action"] == "reset"
    r.wait_until(
        lambda: states(r).get("b@example.org") == "delivered",
        timeout=10,
        what="delivered after reset",
    )
    assert time.monotonic() - t0 < 8
    closed = events(r, "circuit_closed")
    assert any(e["reason"] == "operator reset" for e in closed)
    assert events(r, "destination_reset")

    # and `destination resume` sends the next attempt at once too
    up.mail_reply = lambda s: "421 4.7.0 closing"  # (the open connection is reused)
    assert send(r.port, SENDER, ["c@example.org"], make_message(3)) == {}
    r.wait_until(lambda: len(events(r, "circuit_open")) == 3, what="circuit open, third")
    up.mail_reply = lambda s: None
    t0 = time.monotonic()
    assert r.cli("destination", "resume", "smarthost").returncode == 0
    r.wait_until(
        lambda: states(r).get("c@example.org") == "delivered",
        timeout=10,
        what="delivered after resume",
    )
    assert time.monotonic() - t0 < 8


# --- relay status with no daemon -----------------------------------------------------------


def test_status_is_unknown_when_the_daemon_is_stopped_or_killed(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up, config=FAST)
    res = r.cli("status")
    assert res.returncode == 0 and res.stdout.startswith("OK:"), res.stdout
    assert status_json(r, 0)["status"] == "ok"
    r.kill()  # the health file stays, naming a dead pid
    res = r.cli("status")
    assert res.returncode == 3 and res.stdout.startswith("UNKNOWN: daemon not running")
    st = r.cli("stats")
    assert "NOT RUNNING" in st.stdout
    assert r.cli_json("stats")["daemon"]["running"] is False
    r.start_again()
    assert r.cli("status").returncode == 0
    r.stop()  # a clean stop removes the health file
    res = r.cli("status")
    assert res.returncode == 3 and "not running" in res.stdout
    assert status_json(r, 3)["status"] == "unknown"


# --- delay warnings -------------------------------------------------------------------------


def test_a_delayed_message_raises_one_alert_and_one_delay_dsn(
    upstream, relay, receiver, tmp_path: Path
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.2.0 mailbox busy" if a.startswith("slow") else None
    rec = receiver()
    r = relay(
        upstream=up, config=hooked(tmp_path, rec, retry={"warn_after": "1s"}, dsn={"enabled": True})
    )
    assert send(r.port, SENDER, ["slow@example.org"], make_message(7)) == {}
    r.wait_until(
        lambda: r.cli_json("queue", "list")[0]["recipients"][0]["attempts"] >= 4,
        timeout=20,
        what="four attempts",
    )
    posts = rec.wait(lambda ps: any(p.doc["event"] == "delayed" for p in ps), what="delayed alert")
    delayed = [p.doc for p in posts if p.doc["event"] == "delayed"]
    assert len(delayed) == 1 and "451 4.2.0" in delayed[0]["summary"]
    dsns = [m for m in up.wait_for(1) if m.mail_from == "<>"]
    assert len(dsns) == 1 and dsns[0].rcpt_tos == [SENDER]
    text = dsns[0].data.decode()
    assert "Action: delayed" in text and "Status: 4.2.0" in text
    assert "Will-Retry-Until:" in text and "Subject: Delayed Mail" in text
    assert len(events(r, "delayed")) == 1
    with sqlite3.connect(r.spool / "relay.sqlite") as c:
        assert (
            c.execute("SELECT count(*) FROM messages WHERE delay_warned_at IS NOT NULL").fetchone()[
                0
            ]
            == 1
        )
