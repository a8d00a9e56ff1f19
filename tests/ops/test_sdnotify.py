from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.ops.sdnotify import Notifier, watchdog_loop

ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test run itself may be under systemd: never talk to the real manager.
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound in a (short) temp dir and exported as $NOTIFY_SOCKET."""
    # sun_path is limited to 108 bytes, so don't use pytest's long tmp_path.
    with tempfile.TemporaryDirectory(prefix="sdn-") as tmp:
        path = str(Path(tmp) / "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        try:
            yield sock
        finally:
            sock.close()


@pytest.fixture
def abstract_receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    name = f"relay-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        yield sock
    finally:
        sock.close()


def _drain(sock: socket.socket) -> list[bytes]:
    out: list[bytes] = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(2.0)
    return out


def test_exact_datagrams(receiver: socket.socket) -> None:
    n = Notifier()
    assert n.enabled
    assert n.ready() is True
    assert receiver.recv(4096) == b"READY=1"
    assert n.status("delivering 3 messages") is True
    assert receiver.recv(4096) == b"STATUS=delivering 3 messages"
    assert n.watchdog() is True
    assert receiver.recv(4096) == b"WATCHDOG=1"
    assert n.stopping() is True
    assert receiver.recv(4096) == b"STOPPING=1"
    assert n.extend_timeout(1.5) is True
    assert receiver.recv(4096) == b"EXTEND_TIMEOUT_USEC=1500000"
    assert n.notify("A=1", "B=2") is True
    assert receiver.recv(4096) == b"A=1\nB=2"


def test_status_newlines_are_flattened(receiver: socket.socket) -> None:
    Notifier().status("line one\nline two")
    assert receiver.recv(4096) == b"STATUS=line one line two"


def test_reloading_includes_monotonic_usec(receiver: socket.socket) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert Notifier().reloading() is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = receiver.recv(4096).decode().split("\n")
    assert first == "RELOADING=1"
    key, _, value = second.partition("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_abstract_socket(abstract_receiver: socket.socket) -> None:
    n = Notifier()
    assert n.enabled
    assert n.ready() is True
    assert abstract_receiver.recv(4096) == b"READY=1"


def test_explicit_socket_argument(receiver: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.environ["NOTIFY_SOCKET"]
    monkeypatch.delenv("NOTIFY_SOCKET")
    n = Notifier(path)
    assert n.watchdog() is True
    assert receiver.recv(4096) == b"WATCHDOG=1"
    assert Notifier("").enabled is False


def test_unset_is_a_silent_noop(caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier()
    assert not n.enabled
    with caplog.at_level(logging.DEBUG, logger="relay.ops.sdnotify"):
        assert n.ready() is False
        assert n.stopping() is False
        assert n.reloading() is False
        assert n.status("x") is False
        assert n.watchdog() is False
    assert caplog.records == []
    assert n.watchdog_interval() is None


def test_send_failure_never_raises_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with tempfile.TemporaryDirectory(prefix="sdn-") as tmp:
        monkeypatch.setenv("NOTIFY_SOCKET", str(Path(tmp) / "missing"))
        n = Notifier()
        with caplog.at_level(logging.DEBUG, logger="relay.ops.sdnotify"):
            assert n.ready() is False
            assert n.watchdog() is False
            assert n.watchdog() is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "READY" in warnings[0].getMessage()


def test_recovers_after_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with tempfile.TemporaryDirectory(prefix="sdn-") as tmp:
        path = str(Path(tmp) / "late")
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        n = Notifier()
        with caplog.at_level(logging.INFO, logger="relay.ops.sdnotify"):
            assert n.ready() is False
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.bind(path)
                sock.settimeout(2.0)
                assert n.ready() is True
                assert sock.recv(4096) == b"READY=1"
        assert any("works again" in r.getMessage() for r in caplog.records)


def test_full_receiver_queue_does_not_block_or_raise(receiver: socket.socket) -> None:
    # Nobody reads: the non-blocking sender must eventually get EAGAIN and drop pings.
    n = Notifier()
    results = [n.watchdog() for _ in range(20_000)]
    assert results[0] is True
    assert False in results


def test_invalid_notify_socket_is_ignored(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    with caplog.at_level(logging.WARNING, logger="relay.ops.sdnotify"):
        n = Notifier()
    assert not n.enabled
    assert n.ready() is False
    assert any("NOTIFY_SOCKET" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- watchdog


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 30.0),
        ("500000", None, 0.5),
        ("30000000", "self", 30.0),
        ("30000000", "other", None),
        ("30000000", "not-a-pid", None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    if usec is not None:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid == "self":
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    elif pid == "other":
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    elif pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", pid)
    assert Notifier().watchdog_interval() == expected


def test_unset_environment(receiver: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier(unset_environment=True)
    for name in ENV_VARS:
        assert name not in os.environ
    assert n.watchdog_interval() == 2.0
    assert n.ready() is True
    assert receiver.recv(4096) == b"READY=1"


async def test_watchdog_loop_pings_until_cancelled(receiver: socket.socket) -> None:
    n = Notifier()
    task = asyncio.create_task(watchdog_loop(n, 0.1))  # ping every 0.05 s
    await asyncio.sleep(0.4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pings = _drain(receiver)
    assert len(pings) >= 3
    assert set(pings) == {b"WATCHDOG=1"}
    await asyncio.sleep(0.15)
    assert _drain(receiver) == []


@pytest.mark.parametrize("interval", [None, 0.0, -1.0])
async def test_watchdog_loop_without_watchdog_returns(
    receiver: socket.socket, interval: float | None
) -> None:
    await asyncio.wait_for(watchdog_loop(Notifier(), interval), timeout=1)
    assert _drain(receiver) == []
