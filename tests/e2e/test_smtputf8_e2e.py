"""Internationalised addresses (RFC 6531) against an upstream without SMTPUTF8."""

from __future__ import annotations

import smtplib

from tests.harness import make_message


def test_non_ascii_recipient_fails_when_upstream_lacks_smtputf8(upstream, relay) -> None:
    up = upstream()  # aiosmtpd's default: no SMTPUTF8
    r = relay(upstream=up)
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.has_extn("smtputf8")
        refused = s.sendmail(
            "app@example.com", ["jürgen@example.org"], make_message(1), mail_options=["SMTPUTF8"]
        )
    assert refused == {}
    r.wait_until(
        lambda: r.recipient_states().get("jürgen@example.org") == "failed", what="failed recipient"
    )
    rc = r.queue()[0]["recipients"][0]
    assert rc["last_reply"].startswith("553 5.6.7")
    assert rc["attempts"] == 1  # permanent: no retries
    assert up.received == []
    assert any(e.get("event") == "dead_letter" for e in r.events())
