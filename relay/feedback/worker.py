"""Feedback mail is parsed in a child process, never on the event loop, within a time budget.

Rules:
- Why a process, not a thread: the stdlib `email` parser and the patterns of
  relay/feedback/bounces.py are pure Python; in a thread they hold the GIL and take the
  loop's time anyway (one 4 MB message of 100k MIME parts froze the loop 2.7 s), and a
  thread cannot be stopped. A child process runs on the other core at a lower priority
  (nice 10), and one that takes longer than the budget is killed: the message is kept
  unread (`PastBound`), never parsed forever.
- One child per FeedbackService, started on first use (`python -m relay.feedback.worker`,
  the interpreter of the daemon), used by one request at a time (an asyncio.Lock), reused
  until it is killed, dies, or has been idle IDLE_EXIT seconds (it exits by itself, so a
  service that is never closed leaves nothing behind for long). A child gone before it
  answered is started again once for that message (an idle exit may race a request);
  gone twice, the message is kept unread.
- The protocol on its stdin/stdout: an 8-byte big-endian length and the message; an
  8-byte length and JSON: `{"events": [...]}` or `{"error": "...", "past_bound": bool}`.
- What the child does is `parse` (pure; tests call it directly): bounces.parse_feedback_mail,
  whose own bounds (MIME parts, nesting, text searched) come first: see bounces.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import select
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import IO, Any

from relay.feedback import bounces
from relay.feedback.events import FeedbackError, FeedbackEvent

log = logging.getLogger(__name__)

PARSE_BUDGET = 2.0  # seconds of wall time one message's parse may take in the child
IDLE_EXIT = 60.0  # seconds a child waits for work before it exits
_LEN = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a feedback mail says: its events, or why it is kept unread."""

    events: tuple[FeedbackEvent, ...] = ()
    error: str | None = None  # None: read; else the reason it is kept unread
    past_bound: bool = False  # the reason is a bound (parts, nesting, time), not the content


def parse(data: bytes) -> Parsed:
    """The child's work, pure: bounces.parse_feedback_mail as a Parsed."""
    try:
        return Parsed(tuple(bounces.parse_feedback_mail(data)))
    except bounces.PastBound as e:
        return Parsed(error=f"past a bound: {e}", past_bound=True)
    except FeedbackError as e:
        return Parsed(error=str(e) or "not a bounce or complaint report")


def encode(p: Parsed) -> bytes:
    if p.error is not None:
        doc: dict[str, Any] = {"error": p.error, "past_bound": p.past_bound}
    else:
        doc = {"events": [dataclasses.asdict(e) for e in p.events]}
    return json.dumps(doc).encode("ascii")  # ensure_ascii: surrogate escapes survive


_FIELDS = frozenset(f.name for f in dataclasses.fields(FeedbackEvent))


def decode(raw: bytes) -> Parsed:
    doc = json.loads(raw)
    if "error" in doc:
        return Parsed(error=str(doc["error"]), past_bound=bool(doc.get("past_bound")))
    return Parsed(
        tuple(FeedbackEvent(**{k: v for k, v in e.items() if k in _FIELDS}) for e in doc["events"])
    )


class _Gone(Exception):
    """The child exited (or closed its pipes) before it answered."""


def _exchange(proc: subprocess.Popen[bytes], data: bytes) -> bytes:
    """One request and its answer (blocking: run in a thread)."""
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    try:
        stdin.write(_LEN.pack(len(data)))
        stdin.write(data)
        stdin.flush()
        n = _LEN.unpack(_read(stdout, _LEN.size))[0]
        return _read(stdout, n)
    except (OSError, ValueError, struct.error) as e:
        raise _Gone(str(e) or type(e).__name__) from None


def _read(f: IO[bytes], n: int) -> bytes:
    buf = f.read(n)
    if buf is None or len(buf) != n:
        raise _Gone("end of output")
    return buf


START_TIMEOUT = 30.0  # a child that has not imported its modules by then is not coming
_READY = b"R"


class ParserWorker:
    """The parent's side: `await parse(data)` never blocks the loop and never takes longer
    than about `budget` seconds (the child's start is not counted: it says when it is ready)."""

    def __init__(self, budget: float = PARSE_BUDGET, idle_exit: float = IDLE_EXIT) -> None:
        self.budget = budget
        self.idle_exit = idle_exit
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: asyncio.Lock | None = None
        self.started = 0  # children started (tests; a log line each)
        self.killed = 0  # children killed over the budget

    def _child(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        self._reap()
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-m", "relay.feedback.worker", str(self.idle_exit)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.started += 1
        # The budget measures parsing, not the child's start (imports take 0.1 s idle, and
        # seconds on a loaded machine): the child says it is ready with one byte first.
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout.fileno()], [], [], START_TIMEOUT)
        if not ready or proc.stdout.read(1) != _READY:
            self._reap()
            raise OSError(f"not ready within {START_TIMEOUT:g} s")
        log.debug("feedback parser process %d started", proc.pid)
        return proc

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)

    async def parse(self, data: bytes) -> Parsed:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            for attempt in (1, 2):
                try:
                    proc = await asyncio.to_thread(self._child)
                except OSError as e:
                    log.error("cannot start the feedback parser process: %s", e)
                    return Parsed(error=f"the parser process could not start ({e})")
                work = asyncio.ensure_future(asyncio.to_thread(_exchange, proc, data))
                done, _ = await asyncio.wait({work}, timeout=self.budget)
                if not done:
                    self.killed += 1
                    await asyncio.to_thread(self._reap)  # kill: the thread's read ends too
                    with contextlib.suppress(_Gone):
                        await work
                    return Parsed(
                        error=f"past a bound: parsing took longer than {self.budget:g} s",
                        past_bound=True,
                    )
                try:
                    return decode(work.result())
                except _Gone as e:
                    await asyncio.to_thread(self._reap)
                    if attempt == 2:
                        log.warning("the feedback parser process died twice on a message: %s", e)
                        return Parsed(
                            error="past a bound: the parser process died on it", past_bound=True
                        )
                except (ValueError, TypeError, KeyError) as e:  # not our protocol
                    await asyncio.to_thread(self._reap)
                    return Parsed(error=f"the parser process answered nonsense ({e})")
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await asyncio.to_thread(self._reap)

    def __del__(self) -> None:
        # a service dropped without close() (tests, a failed start): no child left running,
        # no pipe left open (kill and wait: immediate)
        with contextlib.suppress(Exception):
            self._reap()


# --- the child --------------------------------------------------------------------------


def _serve(idle_exit: float) -> int:
    with contextlib.suppress(OSError):
        os.nice(10)  # the daemon's work first
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(_READY)  # imports done: the parent's budget starts now
    stdout.flush()
    fd = stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], idle_exit)
        if not ready:
            return 0  # idle: the parent starts another when it needs one
        head = stdin.read(_LEN.size)
        if len(head) != _LEN.size:
            return 0  # the parent is gone
        n = _LEN.unpack(head)[0]
        data = stdin.read(n)
        if len(data) != n:
            return 0
        out = encode(parse(data))
        stdout.write(_LEN.pack(len(out)) + out)
        stdout.flush()


if __name__ == "__main__":
    sys.exit(_serve(float(sys.argv[1]) if len(sys.argv) > 1 else IDLE_EXIT))
