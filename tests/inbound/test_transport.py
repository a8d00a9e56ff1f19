"""relay/inbound/transport.py on a fake transport: no socket, so what is written, when, and
whether reading is paused is seen exactly. The wire behaviour (replies, spool rows) is
tests/inbound/test_inprocess.py's, which runs the same protocol on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from relay.config.tree import from_mapping
from relay.inbound.core import State
from relay.inbound.handler import InboundHandler, Suppressions
from relay.inbound.transport import InboundProtocol
from relay.spool.writer import SpoolWriter
from tests.harness import deep_merge

MSG = b"From: a@example.com\r\nMessage-ID: <m1@example.com>\r\n\r\nbody\r\n"


class FakeTransport(asyncio.Transport):
    def __init__(self, peer: tuple[str, int] = ("127.0.0.1", 40000)) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.paused = False
        self.pauses = 0
        self.peer = peer

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def lines(self) -> list[str]:
        return b"".join(self.writes).decode().split("\r\n")[:-1]


Make = Callable[..., Awaitable[tuple[InboundProtocol, FakeTransport]]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    made: list[tuple[SpoolWriter, InboundHandler]] = []

    async def factory(cfg: dict[str, Any] | None = None) -> tuple[InboundProtocol, FakeTransport]:
        spool = tmp_path / f"spool{len(made)}"
        base: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(spool)}}
        config = from_mapping(deep_merge(base, cfg or {}), tmp_path)
        writer = SpoolWriter(config.spool_path)
        writer.start()
        h = InboundHandler(config, config.listen[0], writer, Suppressions())
        made.append((writer, h))
        p = InboundProtocol(h)
        t = FakeTransport()
        p.connection_made(t)
        return p, t

    yield factory
    for writer, h in made:
        h.guard.close()
        writer.close()


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met")


def up_to_data(p: InboundProtocol) -> None:
    """EHLO, MAIL, RCPT and DATA: the protocol waits for the message's data."""
    p.data_received(b"EHLO c.test\r\nMAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.org>\r\n")
    p.data_received(b"DATA\r\n")


async def test_a_pipelined_group_is_answered_in_order_in_one_write(make: Make) -> None:
    p, t = await make()
    assert t.writes == [b"220 relay.test relay ESMTP\r\n"]
    p.data_received(
        b"EHLO c.test\r\nMAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.org>\r\n"
        b"RCPT TO:<c@example.org>\r\nNOOP\r\n"
    )
    # decided without a task: the replies are out before anything was awaited
    assert len(t.writes) == 2
    assert t.lines()[-4:] == ["250 2.1.0 OK", "250 2.1.5 OK", "250 2.1.5 OK", "250 2.0.0 OK"]
    assert not t.paused


async def test_reading_pauses_while_the_accept_step_runs_and_the_rest_follows_it(
    make: Make,
) -> None:
    p, t = await make()
    p.data_received(b"EHLO c.test\r\nMAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.org>\r\n")
    p.data_received(b"DATA\r\n")
    assert t.lines()[-1] == "354 End data with <CR><LF>.<CR><LF>"
    p.data_received(MSG + b".\r\nNOOP\r\nQUIT\r\n")
    assert t.paused and p.core is not None and p.core.state is State.DECIDE
    await until(lambda: t.closed)
    lines = t.lines()
    assert lines[-3].startswith("250 2.0.0 Ok: queued as ")
    assert lines[-2:] == ["250 2.0.0 OK", "221 2.0.0 Bye"]
    assert not t.paused


async def test_the_250_is_written_before_the_accepted_line_is_made(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accepted line is formatted after the reply has gone out (bench/README.md: its
    formatting was 0.08-0.1 ms of a serial client's wait); it is still written, once."""
    from relay.inbound import handler as handler_mod

    p, t = await make()
    made: list[tuple[str, list[str]]] = []
    real = handler_mod.log_event

    def spy(logger: Any, level: int, event: str, msg: str = "", /, **fields: Any) -> None:
        made.append((event, t.lines()))
        real(logger, level, event, msg, **fields)

    monkeypatch.setattr(handler_mod, "log_event", spy)
    p.data_received(b"EHLO c.test\r\nMAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.org>\r\n")
    p.data_received(b"DATA\r\n")
    p.data_received(MSG + b".\r\n")
    await until(lambda: any(event == "accepted" for event, _lines in made))
    accepted = [lines for event, lines in made if event == "accepted"]
    assert len(accepted) == 1
    assert accepted[0][-1].startswith("250 2.0.0 Ok: queued as "), accepted[0][-3:]


async def test_a_queued_message_is_logged_and_announced_when_its_client_is_gone_first(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """The accepted line and the main process's wake-up are work left for after the reply
    (Session.after_reply); a connection lost once the spool's answer has come back, before
    the accept step has run on to its reply, still gets them: the message is queued all the
    same. (Under a task, the connection's loss threw CancelledError into the step there:
    queued, but neither logged nor announced.)"""
    p, t = await make()
    woke: list[int] = []
    p.handler.on_queued = lambda: woke.append(1)  # type: ignore[method-assign]
    writer = p.handler.writer
    real_run = writer.run
    gone = asyncio.Event()
    kept: list[asyncio.Task[None]] = []

    async def run(job: Any, lazy: bool = False) -> Any:
        fut = asyncio.get_running_loop().create_future()

        async def commit() -> None:
            fut.set_result(await real_run(job, lazy))  # the answer is on its way back...
            p.connection_lost(None)  # ...and the client hangs up before it is read
            gone.set()

        kept.append(asyncio.ensure_future(commit()))
        return await fut

    writer.run = run  # type: ignore[method-assign]
    up_to_data(p)
    with caplog.at_level("INFO", logger="relay.inbound"):
        p.data_received(MSG + b".\r\n")
        assert p._task is not None
        await asyncio.wait_for(gone.wait(), 10)
        await until(lambda: p._task is None)
    assert not t.lines()[-1].startswith("250 2.0.0 Ok: queued"), "no write after the loss"
    assert [r for r in caplog.records if getattr(r, "event", None) == "accepted"], caplog.text
    assert woke == [1]


async def test_a_client_gone_while_its_commit_waits_cancels_the_wait(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """Lost before the spool has answered: the wait is cancelled (the writer skips a job
    whose waiter gave up), the step gets CancelledError, nothing is written or logged."""
    p, t = await make()
    writer = p.handler.writer
    waiting: list[asyncio.Future[Any]] = []

    async def run(job: Any, lazy: bool = False) -> Any:
        fut = asyncio.get_running_loop().create_future()
        waiting.append(fut)
        return await fut

    writer.run = run  # type: ignore[method-assign]
    up_to_data(p)
    with caplog.at_level("INFO", logger="relay.inbound"):
        p.data_received(MSG + b".\r\n")
        await until(lambda: bool(waiting))
        # nothing behind the dot: reading goes on; the next read is the last until the end
        assert p._task is not None and not t.paused
        p.data_received(b"NOOP\r\n")
        assert t.paused and t.lines()[-1] == "354 End data with <CR><LF>.<CR><LF>"
        p.connection_lost(None)
        assert waiting[0].cancelled()
        await until(lambda: p._task is None)
    assert t.lines()[-1] == "354 End data with <CR><LF>.<CR><LF>"
    assert not [r for r in caplog.records if getattr(r, "event", None) == "accepted"]
    assert p.handler.in_flight == 0


async def test_a_client_gone_while_the_writer_runs_its_commit_still_gets_the_accepted_line(
    make: Make, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lost while the spool writer runs the very commit of the message: the wait is
    cancelled, but the writer cannot take back a job it has begun, so the message is queued;
    the writer hands its result to the accept's `orphan` hook, and the message gets its
    accepted line and the main process's wake-up as any queued message (before: queued,
    neither logged nor announced)."""

    p, t = await make()
    woke: list[int] = []
    p.handler.on_queued = lambda: woke.append(1)  # type: ignore[method-assign]
    running, release = _hold_accepts(monkeypatch)
    up_to_data(p)
    with caplog.at_level("INFO", logger="relay.inbound"):
        p.data_received(MSG + b".\r\n")
        assert await asyncio.to_thread(running.wait, 10)
        p.connection_lost(None)  # the commit is under way in the writer's thread
        await until(lambda: p._task is None)
        release.set()
        await until(lambda: bool(woke))
    assert t.lines()[-1] == "354 End data with <CR><LF>.<CR><LF>", "nothing written after"
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "accepted"]
    queue_id = line.fields["queue_id"]  # type: ignore[attr-defined]
    assert woke == [1]
    assert p.handler.in_flight == 0
    got = await p.handler.writer.run(lambda c: c.execute("SELECT id FROM messages").fetchall())
    assert [r[0] for r in got] == [queue_id]


def _hold_accepts(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold every batch of accepts in the writer's thread, its commit under way: the first
    Event is set once one runs, and it goes on once the second is set."""
    from relay.spool import ops

    running, release = threading.Event(), threading.Event()
    real = ops.accept_many

    def accept_many(conn: Any, items: Any) -> Any:
        running.set()
        assert release.wait(10)
        return real(conn, items)

    monkeypatch.setattr(ops, "accept_many", accept_many)
    return running, release


def _hold_reuse_alerts(
    h: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Hold every reused Message-ID's alert job in the writer's thread: the first Event is
    set once one runs, and it commits once the second is set."""
    running, release = threading.Event(), threading.Event()
    real = h._reuse_alert_job

    def blocking(*args: Any) -> Any:
        job = real(*args)

        def held(c: Any) -> None:
            running.set()
            assert release.wait(10)
            job(c)

        return held

    monkeypatch.setattr(h, "_reuse_alert_job", blocking)
    return running, release


async def test_a_client_gone_during_a_reused_message_ids_alert_still_gets_the_accepted_line(
    make: Make, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new message under a Message-ID used for other content is queued, and then its
    alert is a commit of its own; a client gone during that second commit cancels the step,
    and the message (queued by the first) still gets its accepted line and the main
    process's wake-up (before: the step's line was made after the alert, so neither)."""
    p, t = await make()
    woke: list[int] = []
    h = p.handler
    h.on_queued = lambda: woke.append(1)  # type: ignore[method-assign]
    up_to_data(p)
    p.data_received(MSG + b".\r\n")
    await until(lambda: t.lines()[-1].startswith("250 2.0.0 Ok: queued"))
    await until(lambda: woke == [1])
    running, release = _hold_reuse_alerts(h, monkeypatch)
    p2 = InboundProtocol(h)
    t2 = FakeTransport()
    p2.connection_made(t2)
    up_to_data(p2)
    # the first message's lines are logged by now: captured or not by the level an earlier
    # test of this worker left, they are not the second's
    caplog.clear()
    with caplog.at_level("INFO", logger="relay.inbound"):
        p2.data_received(MSG.replace(b"body", b"other text") + b".\r\n")
        assert await asyncio.to_thread(running.wait, 10)
        p2.connection_lost(None)  # during the alert's commit, after the message's
        release.set()
        await until(lambda: p2._task is None)
        await until(lambda: woke == [1, 1])
    assert t2.lines()[-1] == "354 End data with <CR><LF>.<CR><LF>", "nothing written after"
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events.count("message_id_reused") == 1 and events.count("accepted") == 1
    p.connection_lost(None)


async def test_a_shutdown_waits_for_the_alert_of_a_reused_message_id_whose_client_hung_up(
    make: Make, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone during the commit of a new message under a reused Message-ID: the
    writer's `orphan` hook queues its alert as a task of its own. That task counts as in
    flight until its commit is done, since the shutdown (relay/daemon.py, the inbound
    processes) waits for `in_flight` to reach 0 before the writer closes: the alert is not
    lost to a shutdown (before: `in_flight` was 0 while the alert was still to commit)."""

    p, t = await make()
    h = p.handler
    up_to_data(p)
    p.data_received(MSG + b".\r\n")
    await until(lambda: t.lines()[-1].startswith("250 2.0.0 Ok: queued"))
    accepting, accept_go = _hold_accepts(monkeypatch)
    alerting, alert_go = _hold_reuse_alerts(h, monkeypatch)
    p2 = InboundProtocol(h)
    p2.connection_made(FakeTransport())
    up_to_data(p2)
    caplog.clear()  # the first message's lines (as in the test above)
    with caplog.at_level("INFO", logger="relay.inbound"):
        p2.data_received(MSG.replace(b"body", b"other text") + b".\r\n")
        assert await asyncio.to_thread(accepting.wait, 10)
        p2.connection_lost(None)  # the message's own commit is under way
        await until(lambda: p2._task is None)
        accept_go.set()
        assert await asyncio.to_thread(alerting.wait, 10)  # the orphan's alert commits
        assert h.in_flight == 1, "the shutdown must wait for the alert"
        alert_go.set()
        await until(lambda: h.in_flight == 0)
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events.count("message_id_reused") == 1 and events.count("accepted") == 1
    alerts = await h.writer.run(lambda c: c.execute("SELECT event FROM alerts").fetchall())
    assert len(alerts) == 1
    p.connection_lost(None)


async def test_a_decision_that_waits_on_something_else_goes_on_as_a_task(make: Make) -> None:
    """A bare `yield` (asyncio.sleep(0)) before the spool's future: the rest runs as a
    task, and its reply and what follows it come as from a future's callback."""
    p, t = await make()
    writer = p.handler.writer
    real_run = writer.run

    async def run(job: Any, lazy: bool = False) -> Any:
        await asyncio.sleep(0)
        return await real_run(job, lazy)

    writer.run = run  # type: ignore[method-assign]
    up_to_data(p)
    p.data_received(MSG + b".\r\nQUIT\r\n")
    assert isinstance(p._task, asyncio.Task) and t.paused
    await until(lambda: t.closed)
    assert t.lines()[-2].startswith("250 2.0.0 Ok: queued as ")
    assert t.lines()[-1] == "221 2.0.0 Bye"


async def test_the_session_timeout_closes_without_a_reply(make: Make) -> None:
    p, t = await make({"limits": {"session_timeout": "0.2s", "command_timeout": "10s"}})
    p.data_received(b"NOOP\r\n")
    await until(lambda: t.closed)
    assert t.lines() == ["220 relay.test relay ESMTP", "250 2.0.0 OK"]
    p.connection_lost(None)


async def test_the_command_timeout_answers_421_and_closes(make: Make) -> None:
    p, t = await make({"limits": {"command_timeout": "0.2s"}})
    p.data_received(b"NOOP\r\nNOO")  # half a command: the timer still runs
    await until(lambda: t.closed)
    assert t.lines()[-1] == "421 4.4.2 relay.test timeout waiting for a command, closing connection"
    p.data_received(b"P\r\n")  # after the close: never acted on
    assert t.lines()[-1].startswith("421 4.4.2")
    p.connection_lost(None)


async def test_backed_up_writes_pause_reading(make: Make) -> None:
    p, t = await make()
    p.pause_writing()
    assert t.paused
    p.resume_writing()
    assert not t.paused


async def test_the_connection_counts_once_and_is_released(make: Make) -> None:
    p, _ = await make()
    guard = p.handler.guard
    assert guard.connections.total == 1 and p.handler.stats.sessions == 1
    p.connection_lost(None)
    assert guard.connections.total == 0


async def test_reading_pauses_at_once_behind_a_block_written_to_disk(make: Make) -> None:
    """Behind a DATA block that goes to disk more data is surely coming: reading pauses
    before any of it is read into memory (a session's memory bound, docs/limits.md), even
    when the read that made the block ended on a line end."""
    p, t = await make({"spool": {"inline_max": "1KiB"}})
    up_to_data(p)
    p.data_received(MSG + (b"y" * 98 + b"\r\n") * 30)  # 3 KiB of whole lines: past inline_max
    assert p._task is not None and p.core is not None and not p.core.buffered
    assert t.paused
    await until(lambda: p._task is None and not t.paused)
    p.data_received(b".\r\n")
    await until(lambda: t.lines()[-1].startswith("250 2.0.0 Ok: queued as "))
    p.connection_lost(None)


async def test_a_message_spilled_to_disk_is_written_as_a_task_and_accepted(make: Make) -> None:
    p, t = await make({"spool": {"inline_max": "1KiB"}})
    p.data_received(b"EHLO c.test\r\nMAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.org>\r\n")
    p.data_received(b"DATA\r\n")
    body = MSG + (b"y" * 998 + b"\r\n") * 200  # 200 KiB: past inline_max, written to a file
    for i in range(0, len(body), 16384):
        p.data_received(body[i : i + 16384])
        await until(lambda: not t.paused)  # a block written by a thread pauses reading
    assert t.pauses >= 1
    p.data_received(b".\r\n")
    await until(lambda: t.lines()[-1].startswith("250 2.0.0 Ok: queued as "))
    p.connection_lost(None)


@pytest.mark.parametrize("waits", [False, True])
async def test_a_hook_that_raises_is_a_451_and_the_session_goes_on(make: Make, waits: bool) -> None:
    p, t = await make()

    async def broken(*args: Any) -> str:
        if waits:  # the task path: the decision really waited before it failed
            await asyncio.sleep(0)
        raise RuntimeError("boom")

    p.handler.handle_RCPT = broken  # type: ignore[method-assign]
    p.data_received(b"EHLO c.test\r\nMAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.org>\r\n")
    p.data_received(b"NOOP\r\n")
    await until(lambda: t.lines()[-1] == "250 2.0.0 OK")
    assert t.lines()[-2] == "451 4.3.0 Internal error; message not accepted, try again later"
    p.connection_lost(None)


async def test_a_coroutine_driven_by_hand_then_by_a_task_sees_results_and_cancellation() -> None:
    from relay.inbound.transport import _drive

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    seen: list[object] = []

    async def decision() -> int:
        await asyncio.sleep(0)
        seen.append(await fut)
        try:
            await loop.create_future()  # never done: cancelled below
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return 1

    coro = decision()
    first = coro.send(None)  # by hand, as InboundProtocol._decide does
    task = loop.create_task(_drive(coro, first))
    await asyncio.sleep(0)
    fut.set_result(7)
    await until(lambda: seen == [7])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [7, "cancelled"]
