"""Log privacy of a whole daemon run, in both formats: a message accepted, delivered to one
recipient, deferred for another (451) and bounced for a third (550 -> dead letter), through
an authenticated smarthost. The daemon's entire output never holds a full recipient or
sender address (not even inside the upstream's replies, which echo them), any of the body,
or the smarthost password; with `log.unmask: true` the addresses do appear (so the check can
fail). Every accept, delivery, deferral, bounce and dead letter is one line with an event."""

from __future__ import annotations

import json
import re
import ssl
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.harness import RelayProcess, Upstream, make_message, send, wait_port

pytestmark = pytest.mark.slow

SENDER = "sender.fennel4471@example.com"
OK = "alice.quokka9182@example.org"
DEFER = "bob.marmot5530@example.org"
BOUNCE = "carol.axolotl2207@example.net"
BODY_MARKER = "zq-body-marker-5d41402abc4b2a76"
PASSWORD = "pw-Tr0ub4dor-3-horse-battery"
USER = "relayuser"


def run_scenario(
    upstream: Any, relay: Any, tmp_path: Path, log: dict[str, Any], name: str
) -> tuple[RelayProcess, Upstream, str]:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / f"{name}-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    up = upstream(tls_context=server_ctx, auth={USER: PASSWORD})  # AUTH after STARTTLS
    # upstreams echo the address in their replies; those replies reach our logs
    up.rcpt_reply = lambda a: (
        f"451 4.3.0 <{a}>: mailbox temporarily unavailable"
        if a == DEFER
        else f"550 5.1.1 <{a}>: recipient address rejected: no such user"
        if a == BOUNCE
        else None
    )
    pw_file = tmp_path / f"{name}-password"
    pw_file.write_text(PASSWORD + "\n")
    r = relay(
        upstream=up,
        name=name,
        start=False,
        config={
            "upstream": {
                "smarthost": {
                    "tls": "starttls",
                    "ca_file": str(ca_file),
                    "username": USER,
                    "password_file": str(pw_file),
                }
            },
            "retry": {"schedule": ["1h"], "min_delay": "10m", "max_age": "5d"},
            "log": {**log, "level": "info"},
        },
    )
    r.start(wait=False)
    wait_port(r.port)
    body = f"Hello,\r\nthe secret is {BODY_MARKER}.\r\n".encode()
    msg = make_message(1, message_id="<privacy-1@app.example.com>", body=body)
    assert send(r.port, SENDER, [OK, DEFER, BOUNCE], msg) == {}
    got = up.wait_for(1)
    assert got[0].rcpt_tos == [OK] and got[0].auth == USER and got[0].tls
    assert BODY_MARKER.encode() in got[0].data
    r.wait_until(
        lambda: r.recipient_states() == {OK: "delivered", DEFER: "deferred", BOUNCE: "bounced"},
        what="delivered / deferred / bounced",
    )
    # the suppression list holds the bounced address; a CLI listing is not the daemon log
    r.wait_until(lambda: "dead_letter" in r.logs(), timeout=15, what="the dead letter")
    assert r.stop() == 0
    return r, up, r.logs()


def assert_private(out: str) -> None:
    low = out.lower()
    for addr in (OK, DEFER, BOUNCE, SENDER):
        assert addr.lower() not in low, f"{addr} in the log"
        assert addr.split("@")[0].lower() not in low, f"local part of {addr} in the log"
    assert BODY_MARKER not in out
    assert "the secret is" not in out
    assert PASSWORD not in out


def test_json_log_is_private_and_complete(upstream, relay, tmp_path: Path) -> None:
    r, _up, out = run_scenario(upstream, relay, tmp_path, {"format": "json"}, "json")
    assert_private(out)
    lines = [x for x in out.splitlines() if x.strip()]
    events = [json.loads(x) for x in lines]  # every line is one JSON object
    assert all(isinstance(e, dict) and e.get("event") for e in events)

    def named(name: str) -> list[dict[str, Any]]:
        return [e for e in events if e["event"] == name]

    qid = r.queue()[0]["id"]
    acc = named("accepted")
    assert len(acc) == 1 and acc[0]["queue_id"] == qid
    assert acc[0]["sender"] == "s***@example.com"
    assert sorted(acc[0]["rcpts"]) == sorted(
        ["a***@example.org", "b***@example.org", "c***@example.net"]
    )
    dl = named("delivered")
    assert [(e["queue_id"], e["rcpt"]) for e in dl] == [(qid, "a***@example.org")]
    de = named("deferred")
    assert [(e["queue_id"], e["rcpt"]) for e in de] == [(qid, "b***@example.org")]
    assert de[0]["reply"].startswith("451 4.3.0 <b***@example.org>")
    bo = named("bounced")
    assert [(e["queue_id"], e["rcpt"]) for e in bo] == [(qid, "c***@example.net")]
    dead = named("dead_letter")
    assert [(e["queue_id"], e["rcpt"], e["state"], e["level"]) for e in dead] == [
        (qid, "c***@example.net", "bounced", "error")
    ]
    assert "c***@example.net" in dead[0]["reply"]


def test_text_log_is_private_and_complete(upstream, relay, tmp_path: Path) -> None:
    r, _up, out = run_scenario(upstream, relay, tmp_path, {"format": "text"}, "text")
    assert_private(out)
    lines = [x for x in out.splitlines() if x.strip()]
    assert all(re.match(r"^ts=\S+ level=\w+ logger=\S+ event=\S+", x) for x in lines), [
        x for x in lines if not x.startswith("ts=")
    ][:5]
    assert not any(x.startswith("{") for x in lines)
    qid = r.queue()[0]["id"]

    def named(name: str) -> list[str]:
        return [x for x in lines if f" event={name} " in x or x.endswith(f" event={name}")]

    assert len(named("accepted")) == 1 and f"queue_id={qid}" in named("accepted")[0]
    for name, masked in (
        ("delivered", "a***@example.org"),
        ("deferred", "b***@example.org"),
        ("bounced", "c***@example.net"),
        ("dead_letter", "c***@example.net"),
    ):
        found = named(name)
        assert len(found) == 1, (name, found)
        assert f"queue_id={qid}" in found[0] and f"rcpt={masked}" in found[0], found[0]
    assert "level=error" in named("dead_letter")[0]


def test_unmask_shows_addresses_but_never_secrets(upstream, relay, tmp_path: Path) -> None:
    _r, _up, out = run_scenario(
        upstream, relay, tmp_path, {"format": "json", "unmask": True}, "unmask"
    )
    events = [json.loads(x) for x in out.splitlines() if x.strip()]
    delivered = [e for e in events if e["event"] == "delivered"]
    assert [e["rcpt"] for e in delivered] == [OK]
    assert any(e["event"] == "deferred" and e["rcpt"] == DEFER for e in events)
    assert any(e["event"] == "dead_letter" and e["rcpt"] == BOUNCE for e in events)
    assert SENDER in out
    # still never the body or the password
    assert BODY_MARKER not in out and "the secret is" not in out
    assert PASSWORD not in out


def test_check_config_never_prints_the_password(relay, tmp_path: Path) -> None:
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD)
    r = relay(
        start=False,
        config={"upstream": {"smarthost": {"username": USER, "password_file": str(pw_file)}}},
    )
    for args in (("check-config",), ("check-config", "--json")):
        res = r.cli(*args, check=True)
        assert PASSWORD not in res.stdout + res.stderr
        assert str(pw_file) in res.stdout  # the file is named, its contents are not
