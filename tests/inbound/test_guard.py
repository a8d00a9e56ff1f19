"""relay/inbound/guard.py's AUTH pool. An orderly stop while AUTH password checks are pending
(issue 26, the flake of test_auth_checks_do_not_stall_other_clients): once the guard is closed
no check runs, in the old pool or a new one; the clients waiting get 454 4.7.0 (AuthBusy), and
none of them sees a CancelledError it did not ask for. And the pool itself: bounded, off the
loop, slots freed with the thread."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import from_mapping, load_config
from relay.inbound import auth
from relay.inbound import auth as auth_
from relay.inbound import guard as guard_mod
from relay.inbound.guard import AuthBusy, InboundGuard, PeerFacts, is_allowed, peer_facts


def _guard(tmp_path: Path, **auth: Any) -> InboundGuard:
    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": str(tmp_path / "spool")}, "auth": auth}))
    return InboundGuard(load_config(p))


async def test_close_drops_waiting_checks_and_refuses_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[float] = []
    gate = threading.Event()
    started = threading.Event()

    def slow_check(users: Any, login: bytes, password: bytes) -> str | None:
        ran.append(time.monotonic())
        started.set()
        gate.wait(5)  # the first check holds the only thread until the test lets it go
        return None

    monkeypatch.setattr(auth_, "check", slow_check)
    g = _guard(tmp_path, max_parallel=1, max_pending=10)
    tasks = [asyncio.create_task(g.check_password({}, b"a", b"b")) for _ in range(5)]
    assert await asyncio.to_thread(started.wait, 5)  # the first in its thread; four wait
    g.close()
    # the waiting ones answer at once, not when the running check frees its thread
    done, _ = await asyncio.wait(tasks[1:], timeout=2)
    assert len(done) == 4 and not tasks[0].done()
    with pytest.raises(AuthBusy):  # a new one too, at once (not behind the running one)
        await asyncio.wait_for(g.check_password({}, b"a", b"b"), 1.0)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] is None  # the one running finishes (a thread cannot be stopped)
    assert all(isinstance(r, AuthBusy) for r in results[1:]), results  # 454, not a check
    assert len(ran) == 1  # none of the waiting ones ran
    assert g._executor is None  # no new pool after close
    with pytest.raises(AuthBusy):
        await g.check_password({}, b"a", b"b")
    assert len(ran) == 1


async def test_a_check_queued_in_the_pool_and_dropped_by_close_is_authbusy_not_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job submitted but not started when close() cancels the pool's queue (a race: the
    pool has as many threads as slots, except after a reload that resized it): the session
    gets 454, not a CancelledError in a task nobody cancelled."""
    gate = threading.Event()
    started = threading.Event()

    def held(users: Any, login: bytes, password: bytes) -> str | None:
        started.set()
        gate.wait(5)
        return None

    monkeypatch.setattr(auth_, "check", held)
    g = _guard(tmp_path, max_parallel=2, max_pending=10)
    g._executor = ThreadPoolExecutor(1)  # one thread for two slots: the second job queues
    first = asyncio.create_task(g.check_password({}, b"a", b"b"))
    assert await asyncio.to_thread(started.wait, 5)
    second = asyncio.create_task(g.check_password({}, b"a", b"b"))
    await asyncio.sleep(0.05)  # submitted, waiting in the pool's queue
    g.close()
    gate.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert results[0] is None
    assert isinstance(results[1], AuthBusy), results
    assert not second.cancelled()


async def test_after_close_a_new_check_is_refused_at_once_not_behind_the_running_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    started = threading.Event()

    def held(users: Any, login: bytes, password: bytes) -> str | None:
        started.set()
        gate.wait(5)
        return None

    monkeypatch.setattr(auth_, "check", held)
    g = _guard(tmp_path, max_parallel=1, max_pending=10)
    running = asyncio.create_task(g.check_password({}, b"a", b"b"))
    assert await asyncio.to_thread(started.wait, 5)  # holds the only slot; nobody waits
    g.close()
    try:
        with pytest.raises(AuthBusy):
            await asyncio.wait_for(g.check_password({}, b"a", b"b"), 1.0)
    finally:
        gate.set()
    assert await running is None


async def test_auth_pool_is_bounded_and_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = from_mapping(
        {"spool": {"path": "s"}, "auth": {"max_parallel": 1, "max_pending": 2}}, tmp_path
    )
    guard = InboundGuard(cfg)
    users = {"alice": auth.hash_password("pw")}
    gate = threading.Event()
    real_check = auth.check
    started = []

    def slow_check(*args: object) -> str | None:
        started.append(time.monotonic())
        gate.wait(10)
        return real_check(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(auth, "check", slow_check)
    try:
        tasks = [
            asyncio.create_task(guard.check_password(users, b"alice", b"pw")) for _ in range(3)
        ]  # one runs, two wait
        await asyncio.sleep(0.1)
        assert len(started) == 1  # the loop is free while the check runs
        with pytest.raises(AuthBusy):  # a fourth: too many waiting
            await guard.check_password(users, b"alice", b"pw")
        tasks[1].cancel()  # a waiting client goes away: its place is free again
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[0] == "alice" and results[2] == "alice"
        assert isinstance(results[1], asyncio.CancelledError)
        assert len(started) == 2
        assert await guard.check_password(users, b"alice", b"nope") is None
    finally:
        gate.set()
        guard.close()


def test_peer_facts_are_remembered_per_address_and_allow_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer's facts come from one parse per (address, allow list): a second connection
    from the address asks no parse, and a reload with another allow list is answered
    afresh, not from the remembered entry."""
    parses: list[str] = []

    def counted(ip: str, allow: Any) -> tuple[bool, str]:
        parses.append(ip)
        return peer_facts(ip, allow)

    monkeypatch.setattr(guard_mod, "peer_facts", counted)
    lo = (ipaddress.ip_network("127.0.0.0/8"),)
    other = (ipaddress.ip_network("10.0.0.0/8"),)
    facts = PeerFacts(size=3)
    assert facts("127.0.0.5", lo) == (True, "127.0.0.5")
    assert facts("127.0.0.5", lo) == (True, "127.0.0.5")
    assert parses == ["127.0.0.5"]  # the second connection asked no parse
    assert facts("127.0.0.5", other) == (False, "127.0.0.5")  # the new list decides
    assert is_allowed("127.0.0.5", other) is False
    # the facts as before: an IPv4-mapped address is its IPv4 one, IPv6 by its /64
    assert facts("::ffff:127.0.0.1", lo) == (True, "127.0.0.1")
    assert facts("2001:db8::1", lo) == (False, "2001:db8::/64")
    assert facts("not an address", lo) == (False, "not an address")
    assert len(facts._facts) <= 3  # bounded: a scan starts it afresh
