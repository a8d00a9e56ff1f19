"""The smallest end-to-end path: a real daemon relays to a real upstream."""

from __future__ import annotations

from tests.harness import make_message, send


def test_relays_one_message(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(1)) == {}
    got = up.wait_for(1)
    assert got[0].rcpt_tos == ["user@example.org"]
    assert b"body of message 1" in got[0].data
    r.wait_until(
        lambda: r.recipient_states() == {"user@example.org": "delivered"}, what="delivered state"
    )
    assert r.stop() == 0
