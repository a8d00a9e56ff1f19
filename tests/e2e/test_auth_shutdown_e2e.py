"""An orderly stop while AUTH password checks are pending (issue 26: the daemon exited 1 on
SIGTERM right after an AUTH flood): a real daemon, 30 clients whose AUTH waits behind one
check thread, SIGTERM. It exits 0, runs no password check after the stop began, and the
clients still waiting get 454 4.7.0 (try again later)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_inbound_hardening_e2e import WRONG, Raw, alice_hash, daemon, plain

__all__ = ["alice_hash"]  # the module-scoped fixture, for this module too

pytestmark = pytest.mark.slow


def test_sigterm_while_auth_checks_are_pending_stops_checking_and_exits_0(
    upstream, relay, alice_hash
) -> None:
    up = upstream()
    r = daemon(
        relay,
        up,
        users=alice_hash,
        auth_conf={
            "max_parallel": 1,
            "max_pending": 100,
            "failure_delay": 0,
            "max_failures_per_ip": 0,
        },
        limits={"max_errors": 0},
    )
    clients = [Raw(r.port, f"127.0.0.{2 + i % 5}") for i in range(30)]
    try:
        for c in clients:
            c.reply()
            c.cmd("EHLO client.test")
        for c in clients:  # 30 scrypts (tens of ms each) queued behind one thread
            c.sock.sendall((plain("alice", WRONG) + "\r\n").encode())
        time.sleep(0.1)
        assert r.stop() == 0, r.logs()[-3000:]
        replies = [c.reply() for c in clients]
    finally:
        for c in clients:
            c.close()
    events = r.events()
    stopping = next(
        i for i, e in enumerate(events) if e.get("event") == "shutdown" and "stopping" in e["msg"]
    )
    late = [e for e in events[stopping:] if e.get("event") == "auth_failed"]
    # at most the one check that was in its thread when the stop began finishes
    assert len(late) <= 1, late
    assert sum(x.startswith(b"454 4.7.0") for x in replies) >= 20, replies
