"""After the 250, end to end: one real daemon (a subprocess), a real aiosmtpd upstream that
answers like Postfix (`queued as <id>`), provider webhooks posted over real HTTP, bounce and
complaint reports mailed over SMTP to the feedback address, VERP, and Idempotency-Key.

Payloads are shaped after each provider's documented examples (see the parsers' tests in
tests/feedback/test_providers.py for the references); the daemon is shared by the module
and every test uses its own addresses."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import itertools
import json
import re
import smtplib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from aiosmtpd.smtp import Envelope
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.harness import RelayProcess, Upstream, deep_merge, fast_config, make_message, send

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
TOKENS = {p: f"token-{p}-0123456789" for p in ("ses", "postmark", "sendgrid", "mailgun", "generic")}
MAILGUN_KEY = b"key-mailgun-signing-0123456789"
SG_KEY = ec.generate_private_key(ec.SECP256R1())


class World:
    def __init__(self, relay: RelayProcess, up: Upstream, ids: dict[str, str]) -> None:
        self.relay = relay
        self.up = up
        self.ids = ids  # Message-ID (as sent) -> the upstream's queue id
        self._n = itertools.count(1)

    def unique(self, name: str) -> str:
        return f"{name}-{next(self._n)}-{uuid.uuid4().hex[:6]}@example.org"

    def deliver(self, rcpt: str, sender: str = SENDER, **kw: Any) -> str:
        """Send one message to `rcpt` and wait until it is delivered; returns the upstream's
        id for it."""
        mid = f"<{uuid.uuid4().hex}@app.example.com>"
        data = make_message(message_id=mid, **kw)
        assert send(self.relay.port, sender, [rcpt], data) == {}
        self.relay.wait_until(lambda: mid in self.ids, timeout=20, what=f"delivery to {rcpt}")
        r = self.relay
        r.wait_until(lambda: state(r, rcpt) == "delivered", timeout=10, what="delivered")
        return self.ids[mid]

    def post(
        self,
        provider: str,
        body: bytes,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        h = {"Content-Type": "application/json", **(headers or {})}
        tok = TOKENS[provider] if token is None else token
        if tok:
            h["Authorization"] = "Basic " + base64.b64encode(f"{provider}:{tok}".encode()).decode()
        c = http.client.HTTPConnection("127.0.0.1", self.relay.admin_port, timeout=10)
        c.request("POST", f"/feedback/{provider}", body=body, headers=h)
        resp = c.getresponse()
        out = (resp.status, resp.read())
        c.close()
        return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("feedback")
    ids: dict[str, str] = {}
    counter = itertools.count(1)

    def ok(env: Envelope) -> str:
        data = bytes(env.original_content or b"")
        m = re.search(rb"^Message-ID:\s*(\S+)", data, re.MULTILINE | re.IGNORECASE)
        qid = f"4F{next(counter):06X}Z{uuid.uuid4().hex[:4].upper()}"
        if m:
            ids[m.group(1).decode()] = qid
        return f"250 2.0.0 Ok: queued as {qid}"

    up = Upstream(ok_reply=ok).start()
    providers: dict[str, Any] = {}
    for name, tok in TOKENS.items():
        f = tmp / f"{name}.token"
        f.write_text(tok + "\n")
        providers[name] = {"token_file": str(f)}
    (tmp / "mailgun.key").write_bytes(MAILGUN_KEY + b"\n")
    providers["mailgun"]["signing_key_file"] = str(tmp / "mailgun.key")
    spki = SG_KEY.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp / "sendgrid.pub").write_text(base64.b64encode(spki).decode() + "\n")
    providers["sendgrid"]["public_key_file"] = str(tmp / "sendgrid.pub")
    cfg = deep_merge(
        fast_config("2s"),
        {
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": up.port, "tls": "none"},
            },
            "feedback": {
                "address": "bounces@relay.test",
                "verp": True,
                "max_body": "64KiB",
                "providers": providers,
            },
            "dedup": {"window": "7d"},
            "retry": {"max_age": "1h"},
        },
    )
    relay = RelayProcess(tmp / "relay", cfg).start()
    try:
        yield World(relay, up, ids)
    finally:
        relay.close()
        up.stop()


def state(r: RelayProcess, rcpt: str) -> str | None:
    res = r.cli("queue", "find", "--recipient", rcpt, "--json")
    found = json.loads(res.stdout) if res.stdout.strip() else []
    states = [x["state"] for m in found for x in m["recipients"] if x["address"] == rcpt]
    return states[-1] if states else None


def suppression(r: RelayProcess, addr: str) -> list[dict[str, Any]]:
    return [e for e in r.cli_json("suppression", "list") if e["address"] == addr.lower()]


def rcpt_reply(port: int, rcpt: str, sender: str = SENDER) -> tuple[int, bytes]:
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as s:
        s.ehlo("client.test")
        s.mail(sender)
        return s.rcpt(rcpt)


def log_events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


# --- payloads (after the providers' documented examples) ---------------------------------------


def ses_bounce(rcpt: str, upstream_id: str, sns_id: str | None = None) -> bytes:
    message = {
        "notificationType": "Bounce",
        "bounce": {
            "bounceType": "Permanent",
            "bounceSubType": "General",
            "bouncedRecipients": [
                {
                    "emailAddress": rcpt,
                    "action": "failed",
                    "status": "5.1.1",
                    "diagnosticCode": "smtp; 550 5.1.1 user unknown",
                }
            ],
            "timestamp": "2026-12-03T10:00:00.000Z",
            "feedbackId": "0100018c-feedback-000000",
            "reportingMTA": "dsn; a8-70.smtp-out.amazonses.com",
        },
        "mail": {
            "timestamp": "2026-12-03T09:59:58.000Z",
            "source": SENDER,
            "sourceArn": "arn:aws:ses:us-east-1:123456789012:identity/example.com",
            "messageId": upstream_id,
            "destination": [rcpt],
        },
    }
    return json.dumps(
        {
            "Type": "Notification",
            "MessageId": sns_id or str(uuid.uuid4()),
            "TopicArn": "arn:aws:sns:us-east-1:123456789012:ses-bounces",
            "Message": json.dumps(message),
            "Timestamp": "2026-12-03T10:00:01.000Z",
            "SignatureVersion": "1",
            "Signature": "EXAMPLE",
            "SigningCertURL": "https://sns.us-east-1.amazonaws.com/SimpleNotificationService.pem",
            "UnsubscribeURL": "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe",
        }
    ).encode()


def postmark_complaint(rcpt: str, upstream_id: str) -> bytes:
    return json.dumps(
        {
            "RecordType": "SpamComplaint",
            "MessageStream": "outbound",
            "ID": 4242,
            "Type": "SpamComplaint",
            "TypeCode": 512,
            "Name": "Spam complaint",
            "Tag": "",
            "MessageID": upstream_id,
            "Metadata": {},
            "ServerID": 23,
            "Description": "The subscriber explicitly marked this message as spam.",
            "Details": "Test spam complaint details",
            "Email": rcpt,
            "From": SENDER,
            "BouncedAt": "2026-12-03T10:00:00Z",
            "DumpAvailable": True,
            "Inactive": True,
            "CanActivate": False,
            "Subject": "Test subject",
        }
    ).encode()


def sendgrid_bounce(rcpt: str, upstream_id: str) -> bytes:
    return json.dumps(
        [
            {
                "email": rcpt,
                "timestamp": int(time.time()),
                "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
                "event": "bounce",
                "category": "cat facts",
                "sg_event_id": base64.b64encode(uuid.uuid4().bytes).decode(),
                "sg_message_id": f"{upstream_id}.filter0001.16648.5515E0B88.0",
                "reason": "500 unknown recipient",
                "status": "5.0.0",
                "type": "bounce",
            }
        ]
    ).encode()


def sendgrid_headers(body: bytes, key: ec.EllipticCurvePrivateKey = SG_KEY) -> dict[str, str]:
    ts = str(int(time.time()))
    sig = key.sign(ts.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {
        "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(sig).decode(),
        "X-Twilio-Email-Event-Webhook-Timestamp": ts,
    }


def mailgun_failed(
    rcpt: str, key: bytes = MAILGUN_KEY, message_id: str = "20261203100000.1.abc@mg.example.com"
) -> bytes:
    ts = str(int(time.time()))
    token = uuid.uuid4().hex + uuid.uuid4().hex[:18]
    sig = hmac.new(key, (ts + token).encode(), hashlib.sha256).hexdigest()
    return json.dumps(
        {
            "signature": {"timestamp": ts, "token": token, "signature": sig},
            "event-data": {
                "event": "failed",
                "severity": "permanent",
                "reason": "bounce",
                "recipient": rcpt,
                "id": uuid.uuid4().hex[:22],
                "timestamp": time.time(),
                "log-level": "error",
                "message": {"headers": {"message-id": message_id}},
                "delivery-status": {
                    "code": 550,
                    "message": "5.1.1 The email account that you tried to reach does not exist",
                    "description": "",
                    "attempt-no": 1,
                },
            },
        }
    ).encode()


# --- upstream ids ---------------------------------------------------------------------------


def test_upstream_id_is_kept_shown_and_found(world: World) -> None:
    r = world.relay
    rcpt = world.unique("uid")
    uid = world.deliver(rcpt)
    found = r.cli_json("queue", "find", "--upstream-id", uid)
    assert [x["upstream_id"] for m in found for x in m["recipients"]] == [uid]
    qid = found[0]["id"]
    shown = r.cli("queue", "show", qid, check=True).stdout
    assert f"upstream id: {uid}" in shown
    assert any(
        e.get("upstream_id") == uid and e.get("queue_id") == qid for e in log_events(r, "delivered")
    )
    by_mid = r.cli_json("queue", "find", "--message-id", found[0]["message_id"])
    assert [m["id"] for m in by_mid] == [qid]
    assert r.cli("queue", "find", "--upstream-id", "NOPE").returncode == 1
    assert r.cli("queue", "find").returncode == 2


# --- webhooks ---------------------------------------------------------------------------------


def test_ses_bounce_marks_bounced_suppresses_and_counts_once(world: World) -> None:
    r = world.relay
    rcpt = world.unique("ses")
    uid = world.deliver(rcpt)
    before = r.metric('relay_feedback_events_total{provider="ses",type="bounce"}')
    body = ses_bounce(rcpt, uid, sns_id="sns-fixed-" + uid)
    status, resp = world.post("ses", body)
    assert status == 200, resp
    assert json.loads(resp)["applied"] == 1
    assert state(r, rcpt) == "bounced"
    (entry,) = suppression(r, rcpt)
    assert entry["scope"] == "global" and "550 5.1.1 user unknown" in entry["reason"]
    assert entry["source"] == "feedback:ses"
    # the same notification again (SNS redelivers): nothing more happens
    status, resp = world.post("ses", body)
    assert status == 200 and json.loads(resp)["duplicates"] == 1
    after = r.metric('relay_feedback_events_total{provider="ses",type="bounce"}')
    assert after - before == 1
    # the attempt log keeps both: delivered, then the late bounce
    qid = r.cli_json("queue", "find", "--recipient", rcpt)[0]["id"]
    outcomes = [a["outcome"] for a in r.cli_json("queue", "show", qid)["attempt_log"]]
    assert outcomes == ["delivered", "late_bounce"]
    assert any(e.get("queue_id") == qid for e in log_events(r, "late_bounce"))
    code, text = rcpt_reply(r.port, rcpt)
    assert code == 550 and b"suppressed" in text
    # and the operator is told: an alert in the outbox
    assert any(a["event"] == "late_bounce" for a in r.cli_json("alerts"))


def test_sns_subscription_confirmation_is_logged_for_the_operator(world: World) -> None:
    r = world.relay
    body = json.dumps(
        {
            "Type": "SubscriptionConfirmation",
            "MessageId": str(uuid.uuid4()),
            "Token": "2336412f37fb687f5d51e6e2425c464d",
            "TopicArn": "arn:aws:sns:us-east-1:123456789012:ses-bounces",
            "Message": "You have chosen to subscribe to the topic ...",
            "SubscribeURL": "https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription"
            "&TopicArn=arn:aws:sns:us-east-1:123456789012:ses-bounces&Token=2336412f",
            "Timestamp": "2026-12-03T10:00:00.000Z",
            "SignatureVersion": "1",
            "Signature": "EXAMPLE",
            "SigningCertURL": "https://sns.us-east-1.amazonaws.com/x.pem",
        }
    ).encode()
    assert world.post("ses", body)[0] == 200
    (ev,) = [e for e in r.events() if e.get("event") == "sns_subscription"]
    assert ev["level"] == "warning" and "ConfirmSubscription" in ev["subscribe_url"]


def test_postmark_complaint_suppresses_for_that_identity_only(world: World) -> None:
    r = world.relay
    rcpt = world.unique("pm")
    uid = world.deliver(rcpt)
    status, resp = world.post("postmark", postmark_complaint(rcpt, uid))
    assert status == 200, resp
    (entry,) = suppression(r, rcpt)
    assert entry["scope"] == "example.com" and entry["reason"].startswith("complaint (postmark)")
    assert rcpt_reply(r.port, rcpt)[0] == 550  # same identity: refused
    assert rcpt_reply(r.port, rcpt, sender="news@other.example")[0] == 250
    assert state(r, rcpt) == "delivered"  # a complaint is not a bounce
    assert any(e.get("identity") == "example.com" for e in log_events(r, "complaint"))
    stats = r.cli_json("stats")["feedback"]
    mine = next(f for f in stats if f["identity"] == "example.com")
    assert mine["24h"]["complained"] >= 1 and mine["24h"]["delivered"] >= 1
    assert 0 < mine["24h"]["complaint_rate"] <= 1


def test_sendgrid_signed_events_are_checked(world: World) -> None:
    r = world.relay
    rcpt = world.unique("sg")
    uid = world.deliver(rcpt)
    body = sendgrid_bounce(rcpt, uid)
    # unsigned, wrongly signed, signed by another key, no token: all refused, nothing done
    assert world.post("sendgrid", body)[0] == 401
    bad = sendgrid_headers(body + b" ")
    assert world.post("sendgrid", body, headers=bad)[0] == 401
    other = sendgrid_headers(body, ec.generate_private_key(ec.SECP256R1()))
    assert world.post("sendgrid", body, headers=other)[0] == 401
    assert world.post("sendgrid", body, token="", headers=sendgrid_headers(body))[0] == 401
    assert world.post("sendgrid", body, token="wrong", headers=sendgrid_headers(body))[0] == 401
    assert suppression(r, rcpt) == []
    status, resp = world.post("sendgrid", body, headers=sendgrid_headers(body))
    assert status == 200, resp
    assert state(r, rcpt) == "bounced"
    assert suppression(r, rcpt)[0]["scope"] == "global"


def test_mailgun_hmac_is_checked_and_its_message_id_matches(world: World) -> None:
    """Mailgun's message-id is the id its 250 gave (our upstream id). An event naming only
    the address (another message-id) is no longer enough: it is `unverified` and suppresses
    nothing (issue 27: anyone who can post could name any address we delivered to)."""
    r = world.relay
    rcpt = world.unique("mg")
    uid = world.deliver(rcpt)
    assert world.post("mailgun", mailgun_failed(rcpt, key=b"not-the-key"))[0] == 401
    assert suppression(r, rcpt) == []
    status, resp = world.post("mailgun", mailgun_failed(rcpt))  # an id that is not ours
    assert status == 202 and json.loads(resp)["unverified"] == 1, resp
    assert suppression(r, rcpt) == [] and state(r, rcpt) == "delivered"
    status, resp = world.post("mailgun", mailgun_failed(rcpt, message_id=f"<{uid}>"))
    assert status == 200, resp
    assert state(r, rcpt) == "bounced"


def test_generic_bad_input_and_unknown_recipients(world: World) -> None:
    r = world.relay
    assert world.post("generic", b"{not json")[0] == 400
    assert (
        world.post("generic", json.dumps({"type": "explode", "recipient": "x@y.z"}).encode())[0]
        == 400
    )
    assert world.post("generic", b"[" + b" " * 70000 + b"]")[0] == 413  # over max_body
    stranger = world.unique("stranger")
    status, resp = world.post(
        "generic", json.dumps({"type": "bounce", "recipient": stranger}).encode()
    )
    assert status == 202 and json.loads(resp)["unmatched"] == 1
    assert suppression(r, stranger) == []  # mail we never sent suppresses no one
    assert any(e.get("event") == "feedback_unmatched" for e in r.events())
    # an unknown provider or path, and GET
    assert world.post("nosuch", b"{}", token="x")[0] == 404
    c = http.client.HTTPConnection("127.0.0.1", r.admin_port, timeout=10)
    c.request("GET", "/feedback/generic")
    assert c.getresponse().status == 405
    c.close()
    # a generic event by upstream id, with our soft-bounce type: logged, not suppressed
    rcpt = world.unique("soft")
    uid = world.deliver(rcpt)
    doc = {"type": "soft_bounce", "recipient": rcpt, "upstream_id": uid, "id": "evt-" + uid}
    assert world.post("generic", json.dumps([doc]).encode())[0] == 200
    assert suppression(r, rcpt) == [] and state(r, rcpt) == "delivered"
    # the daemon is still fine
    assert world.post("generic", json.dumps(doc).encode())[0] == 200


# --- feedback by mail -----------------------------------------------------------------------


def dsn(rcpt: str, original_mid: str) -> bytes:
    return (
        "From: MAILER-DAEMON@mx.example.org (Mail Delivery System)\r\n"
        "To: bounces@relay.test\r\n"
        "Subject: Undelivered Mail Returned to Sender\r\n"
        f"Message-ID: <{uuid.uuid4().hex}@mx.example.org>\r\n"
        "MIME-Version: 1.0\r\n"
        'Content-Type: multipart/report; report-type=delivery-status; boundary="B1"\r\n'
        "\r\n"
        "--B1\r\nContent-Type: text/plain\r\n\r\nYour message could not be delivered.\r\n"
        "--B1\r\nContent-Type: message/delivery-status\r\n\r\n"
        "Reporting-MTA: dns; mx.example.org\r\n\r\n"
        f"Final-Recipient: rfc822; {rcpt}\r\n"
        "Action: failed\r\n"
        "Status: 5.1.1\r\n"
        "Diagnostic-Code: smtp; 550 5.1.1 <" + rcpt + ">: Recipient address rejected\r\n"
        "--B1\r\nContent-Type: text/rfc822-headers\r\n\r\n"
        f"From: {SENDER}\r\nTo: {rcpt}\r\nMessage-ID: {original_mid}\r\nSubject: hi\r\n"
        "--B1--\r\n"
    ).encode()


def arf(rcpt: str, original_mid: str) -> bytes:
    return (
        "From: <abuse@mailbox.example.net>\r\n"
        "To: bounces@relay.test\r\n"
        "Subject: FW: Earn money\r\n"
        f"Message-ID: <{uuid.uuid4().hex}@mailbox.example.net>\r\n"
        "MIME-Version: 1.0\r\n"
        'Content-Type: multipart/report; report-type=feedback-report; boundary="part1"\r\n'
        "\r\n"
        "--part1\r\nContent-Type: text/plain\r\n\r\nThis is an email abuse report.\r\n"
        "--part1\r\nContent-Type: message/feedback-report\r\n\r\n"
        "Feedback-Type: abuse\r\nUser-Agent: SomeGenerator/1.0\r\nVersion: 1\r\n"
        f"Original-Mail-From: <{SENDER}>\r\nOriginal-Rcpt-To: <{rcpt}>\r\n"
        "--part1\r\nContent-Type: message/rfc822\r\nContent-Disposition: inline\r\n\r\n"
        f"From: {SENDER}\r\nTo: {rcpt}\r\nMessage-ID: {original_mid}\r\nSubject: Earn money\r\n"
        "\r\nbody\r\n"
        "--part1--\r\n"
    ).encode()


def test_verp_dsn_over_smtp_bounces_the_recipient(world: World) -> None:
    r, up = world.relay, world.up
    rcpt = world.unique("verp")
    world.deliver(rcpt)
    (got,) = [m for m in up.received if rcpt in m.rcpt_tos]
    verp = got.mail_from
    assert re.fullmatch(r"bounces\+[^@]+@relay\.test", verp), verp
    # the bounce comes back from anyone (no allow-listed network needed: not relaying)
    assert send(r.port, "", [verp], dsn(rcpt, "<unrelated@elsewhere>")) == {}
    r.wait_until(lambda: state(r, rcpt) == "bounced", timeout=10, what="late bounce")
    assert suppression(r, rcpt)[0]["source"] == "feedback:mail"
    # it was not relayed
    assert not [m for m in up.received if verp in m.rcpt_tos]


def test_dsn_and_arf_to_the_plain_feedback_address(world: World) -> None:
    r = world.relay
    rcpt = world.unique("dsn")
    world.deliver(rcpt)
    qid = r.cli_json("queue", "find", "--recipient", rcpt)[0]["id"]
    mid = "<" + r.cli_json("queue", "show", qid)["message_id"] + ">"
    # a forged DSN (no VERP token, a Message-ID that is not ours): nothing (the 250 comes
    # after the report was applied)
    assert send(r.port, "", ["bounces@relay.test"], dsn(rcpt, "<forged@elsewhere>")) == {}
    assert state(r, rcpt) == "delivered" and suppression(r, rcpt) == []
    assert any(e.get("event") == "feedback_unverified" for e in r.events())
    assert send(r.port, "", ["bounces@relay.test"], dsn(rcpt, mid)) == {}
    r.wait_until(lambda: state(r, rcpt) == "bounced", timeout=10, what="late bounce by DSN")

    rcpt2 = world.unique("arf")
    world.deliver(rcpt2)
    qid2 = r.cli_json("queue", "find", "--recipient", rcpt2)[0]["id"]
    mid2 = "<" + r.cli_json("queue", "show", qid2)["message_id"] + ">"
    assert send(r.port, "abuse@mailbox.example.net", ["bounces@relay.test"], arf(rcpt2, mid2)) == {}
    r.wait_until(lambda: bool(suppression(r, rcpt2)), timeout=10, what="complaint by ARF")
    assert suppression(r, rcpt2)[0]["scope"] == "example.com"

    # mail that is neither: kept, visible, logged; still 250 (it is ours now)
    junk = b"From: someone@else.example\r\nSubject: hello\r\n\r\nnot a bounce at all\r\n"
    assert send(r.port, "someone@else.example", ["bounces@relay.test"], junk) == {}
    r.wait_until(lambda: bool(r.cli_json("feedback", "mail", "--unread")), timeout=10, what="kept")
    kept = r.cli_json("feedback", "mail", "--unread")[0]
    assert kept["error"] and kept["sender"] == "someone@else.example"
    assert b"not a bounce at all" in r.cli("feedback", "show", str(kept["id"])).stdout.encode()
    assert any(e.get("event") == "feedback_unreadable" for e in r.events())


# --- Idempotency-Key -----------------------------------------------------------------------------


def test_idempotency_key_dedups_is_stripped_and_refuses_other_content(world: World) -> None:
    r, up = world.relay, world.up
    rcpt = world.unique("idem")
    key = f"order-{uuid.uuid4().hex}"
    first = make_message(message_id="<a1@app.example.com>", headers={"Idempotency-Key": key})
    again = make_message(message_id="<a2@app.example.com>", headers={"Idempotency-Key": key})
    assert send(r.port, SENDER, [rcpt], first) == {}
    with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as s:
        s.sendmail(SENDER, [rcpt], again)  # a new Message-ID, the same key: a duplicate
    r.wait_until(lambda: state(r, rcpt) == "delivered", timeout=20, what="delivered")
    time.sleep(0.5)
    got = [m for m in up.received if rcpt in m.rcpt_tos]
    assert len(got) == 1
    assert b"idempotency-key" not in got[0].data.lower()
    other = make_message(
        message_id="<a3@app.example.com>", headers={"Idempotency-Key": key}, body=b"other\r\n"
    )
    with pytest.raises(smtplib.SMTPDataError) as err:
        send(r.port, SENDER, [rcpt], other)
    assert err.value.smtp_code == 554 and b"5.6.0" in err.value.smtp_error
    assert key.encode() in err.value.smtp_error
    bad = make_message(headers={"Idempotency-Key": "x" * 201})
    with pytest.raises(smtplib.SMTPDataError) as err:
        send(r.port, SENDER, [rcpt], bad)
    assert err.value.smtp_code == 554


def test_check_config_warns_when_dedup_window_is_shorter_than_max_age(world: World) -> None:
    r = world.relay
    cfg = deep_merge(r.config, {"dedup": {"window": "1h"}, "retry": {"max_age": "5d"}})
    path = r.workdir / "short-window.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = r.cli("check-config")
    # the module's SES endpoint takes unsigned test payloads: its warning is the only one
    # (tests/feedback/test_sns.py has SNS signatures on)
    warnings = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "ses: verify_signatures is off" in warnings[0], res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(path)],
        cwd=r.workdir,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0
    assert "dedup.window" in res.stderr and "retry.max_age" in res.stderr
