"""The delivery engine end to end: a real daemon subprocess relaying to a real, scripted
aiosmtpd upstream (smarthost mode). Each test drives one outcome of issue 3: transient
replies and retries, bounces and suppression, permanent failures, per-recipient results,
timeouts and the ambiguous case, expiry and dead letters (log, alert command, DSN),
operator replay, the circuit breaker, AUTH failures and connection reuse."""

from __future__ import annotations

import json
import signal
import smtplib
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.harness import RelayProcess, deep_merge, fast_config, free_port, make_message, send

pytestmark = pytest.mark.slow

SENDER = "app@example.com"

FAST: dict[str, Any] = fast_config("1s")


def fast(**extra: Any) -> dict[str, Any]:
    return deep_merge(FAST, extra)


# --- observation helpers ------------------------------------------------------------------


def recipient(r: RelayProcess, address: str) -> dict[str, Any]:
    """The (newest) queue entry for `address`, with the queue id added."""
    found = None
    for m in r.queue():
        for rc in m["recipients"]:
            if rc["address"] == address:
                found = {**rc, "queue_id": m["id"], "message": m}
    if found is None:
        raise AssertionError(f"{address} is not in the queue: {r.queue()}")
    return found


def state_of(r: RelayProcess, address: str) -> str | None:
    for m in r.queue():
        for rc in m["recipients"]:
            if rc["address"] == address:
                return str(rc["state"])
    return None


def wait_state(r: RelayProcess, address: str, state: str, timeout: float = 30.0) -> dict[str, Any]:
    """The recipient's entry as it was when it was seen in `state` (the same `queue list`:
    a second look could come after the next attempt on a loaded machine)."""
    seen: dict[str, Any] = {}

    def in_state() -> bool:
        for m in r.queue():
            for rc in m["recipients"]:
                if rc["address"] == address:
                    seen.clear()
                    seen.update({**rc, "queue_id": m["id"], "message": m})
        return seen.get("state") == state

    r.wait_until(in_state, timeout=timeout, what=f"{address} {state}")
    return dict(seen)


def show(r: RelayProcess, queue_id: str) -> dict[str, Any]:
    out: dict[str, Any] = r.cli_json("queue", "show", queue_id)
    return out


def attempt_log(r: RelayProcess, queue_id: str, address: str) -> list[dict[str, Any]]:
    return [a for a in show(r, queue_id)["attempt_log"] if a["recipient"] == address]


def events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


def suppression_list(r: RelayProcess) -> list[dict[str, Any]]:
    return list(r.cli_json("suppression", "list"))


def circuit_state(r: RelayProcess) -> str | None:
    daemon = r.cli_json("stats").get("daemon") or {}
    dest = daemon.get("destinations", {}).get("smarthost")
    return None if dest is None else str(dest["circuit"])


def smtp_refusal(port: int, rcpt: str) -> tuple[int, str]:
    """Start a transaction and return the relay's reply to RCPT TO."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        code, _ = s.mail(SENDER)
        assert code == 250
        code, msg = s.rcpt(rcpt)
        return code, msg.decode()


# --- transient replies --------------------------------------------------------------------


def test_451_then_ok_is_deferred_then_delivered(upstream, relay) -> None:
    up = upstream()
    calls = {"n": 0}

    def rcpt_reply(addr: str) -> str | None:
        calls["n"] += 1
        return "451 4.3.0 try again later" if calls["n"] == 1 else None

    up.rcpt_reply = rcpt_reply
    # a fixed 2 s step: the deferred state lasts long enough to be seen from the CLI
    r = relay(upstream=up, config=fast(retry={"schedule": ["2s"], "min_delay": "2s"}))
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}

    rc = wait_state(r, "user@example.org", "deferred")
    assert rc["attempts"] == 1
    assert rc["last_reply"].startswith("451 4.3.0")
    assert up.received == []

    rc = wait_state(r, "user@example.org", "delivered")
    assert rc["attempts"] == 2
    got = up.wait_for(1)
    assert len(got) == 1 and got[0].rcpt_tos == ["user@example.org"]
    log = attempt_log(r, rc["queue_id"], "user@example.org")
    assert [a["outcome"] for a in log] == ["transient", "delivered"]


def test_421_at_greeting_deferred_until_upstream_recovers(upstream, relay) -> None:
    up = upstream(connect_reply="421 4.3.2 busy")
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["user@example.org"], make_message(2)) == {}

    r.wait_until(
        lambda: recipient(r, "user@example.org")["attempts"] >= 2, what="two attempts counted"
    )
    rc = recipient(r, "user@example.org")
    assert rc["state"] in ("deferred", "sending")
    assert "421" in (rc["last_reply"] or "")
    assert up.received == []

    up.connect_reply = None
    rc = wait_state(r, "user@example.org", "delivered")
    assert rc["attempts"] >= 3
    assert up.wait_for(1)[0].rcpt_tos == ["user@example.org"]


# --- permanent replies --------------------------------------------------------------------


def test_550_511_bounces_and_suppresses_until_removed(upstream, relay) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: (
        "550 5.1.1 <gone@example.org>: no such user" if a == "gone@example.org" else None
    )
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["gone@example.org"], make_message(3)) == {}

    rc = wait_state(r, "gone@example.org", "bounced")
    assert rc["attempts"] == 1
    assert rc["last_reply"].startswith("550 5.1.1")

    entries = suppression_list(r)
    assert [e["address"] for e in entries] == ["gone@example.org"]
    assert "550 5.1.1" in entries[0]["reason"]
    assert entries[0]["created_at"]

    # a new message to the address is refused at RCPT, saying why
    code, text = smtp_refusal(r.port, "gone@example.org")
    assert code == 550
    assert text.startswith("5.1.1")
    assert "suppressed" in text.lower()

    # the operator removes it: within ~2 s the daemon accepts the address again
    up.rcpt_reply = lambda a: None
    r.cli("suppression", "remove", "gone@example.org", check=True)
    assert suppression_list(r) == []

    def accepted() -> bool:
        return smtp_refusal(r.port, "gone@example.org")[0] == 250

    r.wait_until(accepted, timeout=10, what="suppression removal to take effect")
    assert send(r.port, SENDER, ["gone@example.org"], make_message(4)) == {}
    got = up.wait_for(1)
    assert got[0].rcpt_tos == ["gone@example.org"]
    assert b"message 4" in got[0].data


def test_554_571_at_dot_fails_without_suppression(upstream, relay) -> None:
    up = upstream()
    up.data_reply = lambda env: "554 5.7.1 message rejected as spam"
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["user@example.org"], make_message(5)) == {}

    rc = wait_state(r, "user@example.org", "failed")
    assert rc["attempts"] == 1
    assert rc["last_reply"].startswith("554 5.7.1")
    assert suppression_list(r) == []
    assert up.received == []
    dead = events(r, "dead_letter")
    assert len(dead) == 1 and dead[0]["state"] == "failed"


@pytest.mark.parametrize("pipelining", [False, True], ids=["stepwise", "pipelined"])
def test_mixed_recipient_results_in_one_transaction(upstream, relay, pipelining: bool) -> None:
    """The same outcomes from an upstream that offers PIPELINING (RFC 2920: MAIL, the RCPTs
    and DATA in one write) as from one that does not."""
    up = upstream(pipelining=pipelining)
    replies = {
        "bad@example.org": "550 5.1.1 no such user",
        "later@example.org": "451 4.2.0 mailbox busy",
    }
    up.rcpt_reply = lambda a: replies.get(a)
    r = relay(upstream=up, config=fast())
    rcpts = ["ok@example.org", "bad@example.org", "later@example.org"]
    assert send(r.port, SENDER, rcpts, make_message(6)) == {}

    r.wait_until(
        lambda: (
            r.recipient_states().get("bad@example.org") == "bounced"
            and r.recipient_states().get("ok@example.org") == "delivered"
        ),
        what="delivered and bounced",
    )
    # wait for the 451 recipient's retries: they must not produce another transaction
    r.wait_until(
        lambda: recipient(r, "later@example.org")["attempts"] >= 3,
        what="retries of the deferred recipient",
    )
    states = r.recipient_states()
    assert states["ok@example.org"] == "delivered"
    assert states["bad@example.org"] == "bounced"
    assert states["later@example.org"] in ("deferred", "sending")
    assert recipient(r, "later@example.org")["last_reply"].startswith("451 4.2.0")

    got = up.wait_for(1)
    assert len(got) == 1
    assert got[0].rcpt_tos == ["ok@example.org"]
    cmds = list(up.commands)
    if pipelining:  # each retry of the 451 recipient sends DATA in its group (refused: 503)
        later = cmds.count("RCPT later@example.org")
        assert later - 1 <= cmds.count("DATA") <= later  # (a retry's group may be arriving)
    else:
        assert cmds.count("DATA") == 1
    # every recipient was offered in the first transaction (one MAIL for three RCPTs)
    first_mail = up.commands.index(f"MAIL {SENDER}")
    assert up.commands[first_mail + 1 : first_mail + 4] == [f"RCPT {a}" for a in rcpts]


# --- timeouts and the ambiguous case -----------------------------------------------------


def test_stall_at_rcpt_hits_command_timeout_and_defers(upstream, relay) -> None:
    up = upstream(stall={"rcpt": 3.0})
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["user@example.org"], make_message(7)) == {}

    r.wait_until(lambda: recipient(r, "user@example.org")["attempts"] >= 1, what="first attempt")
    rc = recipient(r, "user@example.org")
    assert rc["state"] in ("deferred", "sending")
    assert rc["last_reply"].startswith("451 4.4.2")
    assert "timeout" in rc["last_reply"]
    log = attempt_log(r, rc["queue_id"], "user@example.org")
    assert log[0]["outcome"] == "transient"  # before DATA: nothing is ambiguous

    up.stall = {}
    wait_state(r, "user@example.org", "delivered")
    assert [m.rcpt_tos for m in up.wait_for(1)] == [["user@example.org"]]


def test_stall_after_dot_is_ambiguous_and_retried(upstream, relay) -> None:
    up = upstream(stall={"data": 3.0})
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["user@example.org"], make_message(8)) == {}

    def ambiguous_logged() -> bool:
        rc = recipient(r, "user@example.org")
        return any(
            a["outcome"] == "ambiguous" for a in attempt_log(r, rc["queue_id"], "user@example.org")
        )

    r.wait_until(ambiguous_logged, what="an ambiguous attempt")
    rc = recipient(r, "user@example.org")
    assert rc["state"] in ("deferred", "sending")
    assert "timeout" in rc["last_reply"]
    amb = events(r, "ambiguous")
    assert amb and amb[0]["policy"] == "retry" and amb[0]["level"] == "warning"

    up.stall = {}
    rc = wait_state(r, "user@example.org", "delivered")
    assert rc["attempts"] >= 2
    # at-least-once: the stalled copy may have arrived too, but never none
    got = up.wait_for(1)
    assert all(m.rcpt_tos == ["user@example.org"] for m in got)
    assert any(b"body of message 8" in m.data for m in got)


def test_stall_after_dot_assume_delivered_policy(upstream, relay) -> None:
    up = upstream(stall={"data": 3.0})
    r = relay(upstream=up, config=fast(destinations={"*": {"ambiguous": "assume-delivered"}}))
    assert send(r.port, SENDER, ["user@example.org"], make_message(9)) == {}

    rc = wait_state(r, "user@example.org", "delivered")
    assert rc["attempts"] == 1
    log = attempt_log(r, rc["queue_id"], "user@example.org")
    assert [a["outcome"] for a in log] == ["ambiguous"]
    assert events(r, "ambiguous")[0]["policy"] == "assume-delivered"
    # counted as delivered: no second transaction, even after the retry step has passed
    time.sleep(2.0)
    assert up.commands.count("DATA") == 1
    assert up.commands.count(f"MAIL {SENDER}") == 1


def test_disconnect_after_dot_is_ambiguous_and_retried(upstream, relay) -> None:
    up = upstream(disconnect_after_dot=True)
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["user@example.org"], make_message(10)) == {}

    up.wait_for(1)  # the upstream has the message; the relay never heard so

    def ambiguous_logged() -> bool:
        rc = recipient(r, "user@example.org")
        return any(
            a["outcome"] == "ambiguous" for a in attempt_log(r, rc["queue_id"], "user@example.org")
        )

    r.wait_until(ambiguous_logged, what="an ambiguous attempt")
    assert state_of(r, "user@example.org") in ("deferred", "sending")
    assert "connection lost" in recipient(r, "user@example.org")["last_reply"]

    up.disconnect_after_dot = False
    rc = wait_state(r, "user@example.org", "delivered")
    assert rc["attempts"] >= 2
    assert len(up.wait_for(2)) >= 2  # at-least-once: the retry delivered a second copy


# --- expiry and dead letters --------------------------------------------------------------


def test_expiry_fails_and_logs_dead_letter(upstream, relay) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.3.0 try again later"
    r = relay(upstream=up, config=fast(retry={"max_age": "3s"}))
    assert send(r.port, SENDER, ["user@example.org"], make_message(11)) == {}

    rc = wait_state(r, "user@example.org", "failed", timeout=20)
    assert "expired" in rc["last_reply"]
    assert "451 4.3.0" in rc["last_reply"]
    assert rc["attempts"] >= 2
    dead = events(r, "dead_letter")
    assert len(dead) == 1
    d = dead[0]
    assert d["level"] == "error"
    assert d["state"] == "expired"
    assert d["queue_id"] == rc["queue_id"]
    assert d["rcpt"] == "u***@example.org"
    assert "user@example.org" not in json.dumps(d)
    assert up.received == []


def test_dead_letter_alert_command_and_dsn(upstream, relay, tmp_path: Path) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("gone") else None
    alerts = tmp_path / "alerts.jsonl"
    r = relay(
        upstream=up,
        config=fast(
            alerts={"command": f"cat >> {alerts}", "coalesce": "3s"}, dsn={"enabled": True}
        ),
    )
    # a null-sender message (itself a bounce) that bounces: an alert, but never a DSN
    assert send(r.port, "", ["gone1@example.org"], make_message(12)) == {}
    rc1 = wait_state(r, "gone1@example.org", "bounced")
    # an ordinary message that bounces: an alert and a DSN to its envelope sender
    assert send(r.port, SENDER, ["gone2@example.org"], make_message(13)) == {}
    rc = wait_state(r, "gone2@example.org", "bounced")

    got = up.wait_for(1)
    # both dead letters went to one destination within alerts.coalesce: one alert
    r.wait_until(lambda: alerts.exists() and alerts.read_text().strip(), what="the alert document")
    time.sleep(0.5)
    docs = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert len(docs) == 1, docs
    doc = docs[0]
    assert doc["version"] == 1 and doc["event"] == "dead_letter"
    assert doc["key"] == "smarthost" and doc["count"] == 2
    assert doc["severity"] == "warning"
    assert [s["queue_id"] for s in doc["samples"]] == [rc1["queue_id"], rc["queue_id"]]
    assert [s["recipient"] for s in doc["samples"]] == ["g***@example.org"] * 2  # masked
    assert all(s["reply"].startswith("550 5.1.1") for s in doc["samples"])
    assert "550 5.1.1" in doc["summary"] and doc["summary"].startswith("2 dead_letter")

    dsn = got[0]
    assert dsn.mail_from == "<>"  # MAIL FROM:<>, the null sender
    assert dsn.rcpt_tos == [SENDER]
    text = dsn.data.decode()
    assert "multipart/report" in text and "report-type=delivery-status" in text
    assert "Final-Recipient: rfc822; gone2@example.org" in text
    assert "Status: 5.1.1" in text
    assert "Action: failed" in text
    assert "Subject: message 13" in text  # original headers, text/rfc822-headers
    assert "body of message 13" not in text  # never the body
    assert r.recipient_states()[SENDER] == "delivered"

    time.sleep(2.0)  # the DSN pass is over; no DSN for the null-sender bounce
    assert len(up.received) == 1


def test_failing_or_hanging_alert_command_never_blocks_delivery(upstream, relay) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("gone") else None
    # one connection: a worker held by the alert would hold every delivery
    r = relay(
        upstream=up,
        config=fast(
            alerts={"command": "sleep 30", "timeout": "8s", "coalesce": "0s"},
            destinations={"*": {"max_connections": 1}},
        ),
    )
    assert send(r.port, SENDER, ["gone@example.org"], make_message(21)) == {}
    wait_state(r, "gone@example.org", "bounced")
    assert send(r.port, SENDER, ["ok@example.org"], make_message(22)) == {}
    wait_state(r, "ok@example.org", "delivered")
    # the hanging command is killed at alerts.timeout and reported, after the delivery
    r.wait_until(lambda: events(r, "alert_failed"), timeout=20, what="alert_failed")
    order = [e["event"] for e in r.events() if e.get("event") in ("delivered", "alert_failed")]
    assert order[:2] == ["delivered", "alert_failed"]
    failed = events(r, "alert_failed")[0]
    assert failed["level"] == "error" and "timed out" in failed["error"]
    assert "will retry" in failed["msg"]  # the alert stays in the outbox

    # a command that exits non-zero: logged at ERROR, the daemon carries on
    cfg = r.config
    cfg["alerts"] = {"command": "cat >/dev/null; exit 3", "timeout": "5s", "coalesce": "0s"}
    r.write_config(cfg)
    r.signal(signal.SIGHUP)
    r.wait_until(lambda: len(events(r, "config_reloaded")) >= 1, what="config reloaded", timeout=10)
    assert send(r.port, SENDER, ["gone2@example.org"], make_message(23)) == {}
    wait_state(r, "gone2@example.org", "bounced")
    r.wait_until(
        lambda: any("exited 3" in e["error"] for e in events(r, "alert_failed")),
        what="alert_failed: exited 3",
    )
    assert send(r.port, SENDER, ["ok2@example.org"], make_message(24)) == {}
    wait_state(r, "ok2@example.org", "delivered")


def test_retry_failed_replays_dead_letters_keeping_dedup_key(upstream, relay) -> None:
    up = upstream()
    up.data_reply = lambda env: "554 5.7.1 rejected by policy"
    r = relay(upstream=up, config=fast())
    data = make_message(14)
    assert send(r.port, SENDER, ["user@example.org"], data) == {}
    rc = wait_state(r, "user@example.org", "failed")
    qid = rc["queue_id"]

    up.data_reply = lambda env: None
    res = r.cli_json("queue", "retry", "--failed")
    assert res["recipients_changed"] == 1
    rc = recipient(r, "user@example.org")
    assert rc["queue_id"] == qid
    assert rc["state"] in ("deferred", "sending", "delivered")
    assert rc["attempts"] in (0, 1)  # reset (then maybe one new attempt already)

    rc = wait_state(r, "user@example.org", "delivered")
    assert rc["queue_id"] == qid
    assert len(up.wait_for(1)) == 1

    # the dedup key is kept: the same message again is recognised, not queued twice
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(SENDER)
        s.rcpt("user@example.org")
        code, msg = s.data(data)
    assert code == 250 and b"duplicate" in msg
    assert len(r.queue()) == 1
    time.sleep(1.0)
    assert len(up.received) == 1


def test_retry_failed_of_a_bounce_stays_suppressed_until_removed(upstream, relay) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user"
    r = relay(upstream=up, config=fast())
    assert send(r.port, SENDER, ["gone@example.org"], make_message(17)) == {}
    wait_state(r, "gone@example.org", "bounced")

    # the mailbox exists again, but leaving the suppression list is an explicit act
    up.rcpt_reply = lambda a: None
    res = r.cli("queue", "retry", "--failed", check=True)
    # left as it is, and the operator is told why and how to lift it (not quietly "sent")
    assert "relay suppression remove gone@example.org" in res.stderr
    time.sleep(2.5)
    rc = wait_state(r, "gone@example.org", "bounced")
    assert up.received == []

    r.cli("suppression", "remove", "gone@example.org", check=True)
    r.cli("queue", "retry", rc["queue_id"], check=True)
    wait_state(r, "gone@example.org", "delivered")
    assert [m.rcpt_tos for m in up.wait_for(1)] == [["gone@example.org"]]


def test_dsn_for_expiry_and_not_twice_for_a_replayed_dead_letter(upstream, relay) -> None:
    up = upstream()
    # the recipient's server never takes it; the sender's mailbox takes the DSN
    up.rcpt_reply = lambda a: None if a == SENDER else "451 4.2.2 mailbox full, try later"
    r = relay(upstream=up, config=fast(retry={"max_age": "3s"}, dsn={"enabled": True}))
    assert send(r.port, SENDER, ["user@example.org"], make_message(18)) == {}

    rc = wait_state(r, "user@example.org", "failed", timeout=20)
    dsn = up.wait_for(1)[0]
    assert dsn.mail_from == "<>" and dsn.rcpt_tos == [SENDER]
    text = dsn.data.decode()
    assert "Final-Recipient: rfc822; user@example.org" in text
    assert "Action: failed" in text
    # the last transient reply (4.2.2), now final: 5.2.2, as the code intends
    assert "Status: 5.2.2" in text
    assert "expired" in text

    # replaying the dead letter fails again (expired at once): no second DSN
    r.cli("queue", "retry", rc["queue_id"], check=True)
    r.wait_until(lambda: len(events(r, "dead_letter")) == 2, timeout=20, what="second dead letter")
    time.sleep(2.0)
    assert len(up.received) == 1
    assert len(r.queue()) == 2  # the message and its one DSN


# --- circuit breaker ----------------------------------------------------------------------


def test_circuit_breaker_opens_and_closes(upstream, relay) -> None:
    port = free_port()  # nothing listens here yet: connections are refused
    r = relay(
        config=fast(
            upstream={
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": port, "tls": "none"},
            },
            destinations={"*": {"circuit_failures": 2, "circuit_cooldown": "6s"}},
        )
    )
    assert send(r.port, SENDER, ["first@example.org"], make_message(15)) == {}

    r.wait_until(
        lambda: recipient(r, "first@example.org")["attempts"] >= 2, what="two refused connections"
    )
    # the second failure opened the circuit: new mail waits without burning an attempt,
    # and is not even claimed (no claim-and-write-back churn while the circuit is open)
    r.wait_until(lambda: circuit_state(r) == "open", timeout=15, what="circuit open in stats")
    assert send(r.port, SENDER, ["second@example.org"], make_message(16)) == {}
    time.sleep(0.6)  # three engine passes (poll_interval 0.2 s), well inside the cooldown
    seen = recipient(r, "second@example.org")
    assert (seen["state"], seen["attempts"], seen["last_reply"]) == ("pending", 0, None)

    # only real connection attempts count, and each is logged (one consistent snapshot)
    first = recipient(r, "first@example.org")
    shown = show(r, first["queue_id"])
    log = [a for a in shown["attempt_log"] if a["recipient"] == "first@example.org"]
    assert shown["recipients"][0]["attempts"] == len(log) >= 2
    assert all("refused" in a["reply"] for a in log)

    # after the cooldown one half-open trial connects; it fails, so the circuit re-opens
    r.wait_until(
        lambda: recipient(r, "first@example.org")["attempts"] >= 3,
        timeout=15,
        what="a half-open trial after the cooldown",
    )
    assert recipient(r, "second@example.org")["state"] != "delivered"

    # the upstream comes back: the next half-open trial succeeds and the circuit closes
    up = upstream(port=port)
    wait_state(r, "first@example.org", "delivered", timeout=30)
    wait_state(r, "second@example.org", "delivered", timeout=30)
    assert sorted(up.recipients()) == ["first@example.org", "second@example.org"]
    r.wait_until(lambda: circuit_state(r) == "closed", timeout=10, what="circuit closed")


# --- connection reuse ---------------------------------------------------------------------


@pytest.mark.parametrize("pipelining", [False, True], ids=["stepwise", "pipelined"])
def test_connection_reuse(upstream, relay, pipelining: bool) -> None:
    up = upstream(pipelining=pipelining)
    r = relay(
        upstream=up,
        config=fast(
            destinations={
                "*": {"max_connections": 1, "max_messages_per_connection": 10, "rate": "unlimited"}
            }
        ),
    )
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
        for i in range(20):
            s.sendmail(SENDER, [f"user{i}@example.org"], make_message(100 + i))
    got = up.wait_for(20)
    assert sorted(m.rcpt_tos[0] for m in got) == sorted(f"user{i}@example.org" for i in range(20))
    assert up.connections <= 3, up.connections
    r.wait_until(lambda: set(r.recipient_states().values()) == {"delivered"}, what="all delivered")


# --- smarthost AUTH refused: an operator problem, never the recipient's ----------------------


def test_smarthost_auth_failure_defers_and_logs_config_error(
    upstream, relay, tmp_path: Path
) -> None:
    # aiosmtpd only offers AUTH after STARTTLS here (it warns about AUTH in the clear)
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    up = upstream(tls_context=server_ctx, auth={"user": "right"})
    pw = tmp_path / "password"
    pw.write_text("wrong\n")
    r = relay(
        upstream=up,
        config=fast(
            upstream={
                "smarthost": {
                    "tls": "starttls",
                    "ca_file": str(ca_file),
                    "username": "user",
                    "password_file": str(pw),
                }
            }
        ),
    )
    assert send(r.port, SENDER, ["user@example.org"], make_message(20)) == {}

    r.wait_until(
        lambda: recipient(r, "user@example.org")["attempts"] >= 2, what="two refused logins"
    )
    rc = recipient(r, "user@example.org")
    assert rc["state"] in ("deferred", "sending")
    # the smarthost's own 535 is recorded, but it is an AUTH reply: transient, not a bounce
    assert rc["last_reply"].startswith("535 5.7.8")
    assert suppression_list(r) == []
    assert events(r, "dead_letter") == []
    errs = events(r, "upstream_config_error")
    assert errs and errs[0]["level"] == "error" and errs[0]["destination"] == "smarthost"
    assert "wrong" not in r.logs()  # the password never reaches the log
    assert up.received == []

    # the operator fixes the password file and reloads: the kept mail goes out
    pw.write_text("right\n")
    r.signal(signal.SIGHUP)
    wait_state(r, "user@example.org", "delivered")
    got = up.wait_for(1)
    assert got[0].auth == "user" and got[0].tls
