"""The Python of one SMTP session, in-process and without sockets: relay/inbound/transport.py's
InboundProtocol and relay/inbound/handler.py's InboundHandler fed one whole session (EHLO,
MAIL, RCPT, DATA with a 2 KiB message, QUIT) by a stand-in transport, the spool writer
answered at once, on uvloop, with the inbound process's collector settings (gc.freeze and
its young threshold) and its logging (the default JSON lines at `info`, written once per
turn of the loop, here to /dev/null: the `accepted` line of each message). What it
measures is our accept path's Python alone: no syscalls, no
SQLite, no other process, so the machine's noise is small.

    .venv/bin/python bench/inbound_session.py [SESSIONS]            # microseconds per session
    .venv/bin/python bench/inbound_session.py 2000 --profile        # cProfile: calls, top 40
    SORT=cumulative TOP=80 .venv/bin/python bench/inbound_session.py 2000 --profile
    LOGLEVEL=warning .venv/bin/python bench/inbound_session.py      # without the accepted line
    PYTHONPATH=/some/other/tree .venv/bin/python bench/inbound_session.py   # another tree

Instructions per session, which do not drift with the machine (valgrind's callgrind counts
them; the same number to 0.1% run after run): run it under callgrind with two session counts
and divide the difference of the totals by the difference of the counts (the start-up
cancels out):

    for n in 200 1200; do PYTHONHASHSEED=0 valgrind --tool=callgrind \\
      --callgrind-out-file=/dev/null .venv/bin/python bench/inbound_session.py $n 2>&1 \\
      | grep refs; done

bench/README.md ("An eleventh machine") has the numbers. Not part of `make test`.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from relay.config.tree import from_mapping
from relay.inbound.handler import InboundHandler, Suppressions
from relay.ops.logs import lines_per_turn, setup_logging
from relay.ops.runtime import GC_YOUNG
from relay.spool import ops

HEAD = (
    b"From: app@b.example\r\nTo: to@dest.example\r\nSubject: hello\r\n"
    b"Date: Thu, 01 Jan 2026 00:00:00 +0000\r\nMessage-ID: <%d@b.example>\r\n\r\n"
)
BODY = (b"y" * 70 + b"\r\n") * 28  # 2 KiB with the header block
COMMANDS = (
    b"EHLO client.example\r\n",
    b"MAIL FROM:<app@b.example>\r\n",
    b"RCPT TO:<to@dest.example>\r\n",
    b"DATA\r\n",
)


class Transport:
    """What InboundProtocol uses of an asyncio transport: the bytes it writes are kept."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Writer:
    """The spool writer, answering every accept as queued in the next turn of the loop: the
    accept step waits on a future, as on relay/spool/writer.py's (whose thread hands the
    results over with `call_soon_threadsafe`), so the task that finishes it, the pause of
    reading and its resumption are counted as in the daemon."""

    pg = None

    async def run(self, job: Any, lazy: bool = False) -> Any:
        msg = job.arg[0]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        result = ops.AcceptResult(msg.queue_id, tuple(r.address for r in msg.recipients), ())
        loop.call_soon(fut.set_result, result)
        return await fut

    async def read(self, job: Any) -> Any:
        return job(None)


async def sessions(n: int, prof: cProfile.Profile | None) -> float:
    tmp = Path(tempfile.mkdtemp(prefix="relay-bench-session-"))
    cfg = from_mapping({"hostname": "relay.test", "spool": {"path": str(tmp / "spool")}}, tmp)
    handler = InboundHandler(
        cfg,
        cfg.listen[0],
        Writer(),
        Suppressions(),
        on_queued=lambda: queued[-1].set_result(None),  # type: ignore[arg-type]
    )
    queued: list[asyncio.Future[None]] = []  # the accept step's end: its line is logged

    async def one(i: int) -> bytes:
        p = handler.protocol()
        t = Transport()
        p.connection_made(t)  # type: ignore[arg-type]
        for line in COMMANDS:
            p.data_received(line)
        queued.append(asyncio.get_running_loop().create_future())
        p.data_received(HEAD % i + BODY + b".\r\n")
        await queued[-1]  # the accept step waits on the writer; then its reply, its line
        queued.pop()
        p.data_received(b"QUIT\r\n")
        p.connection_lost(None)
        return b"".join(t.out)

    first = await one(0)
    if b"250 2.0.0 Ok: queued as" not in first or not first.endswith(b"221 2.0.0 Bye\r\n"):
        raise SystemExit(f"the session did not go through: {first!r}")
    for i in range(1, 300):  # warm-up
        await one(i)
    gc.freeze()  # as relay/inbound/processes.py does once started
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    if prof is not None:
        prof.enable()
    started = time.process_time()
    for i in range(1000, 1000 + n):
        await one(i)
    took = time.process_time() - started
    if prof is not None:
        prof.disable()
    return took


async def logged(n: int, prof: cProfile.Profile | None) -> float:
    """`sessions` with the inbound process's logging (relay/inbound/processes.py)."""
    with lines_per_turn(asyncio.get_running_loop()):
        return await sessions(n, prof)


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 3000
    prof = cProfile.Profile() if "--profile" in sys.argv else None
    # left open: a write the loop has scheduled may still come after the sessions
    setup_logging(os.environ.get("LOGLEVEL", "info"), "json", stream=open(os.devnull, "w"))  # noqa: SIM115
    took = uvloop.run(logged(n, prof))
    print(f"{took / n * 1e6:.1f} us of CPU per session ({n} sessions)")
    if prof is not None:
        stats = pstats.Stats(prof)
        calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
        print(f"{calls / n:.0f} calls per session")
        top = int(os.environ.get("TOP", "40"))
        stats.sort_stats(os.environ.get("SORT", "tottime")).print_stats(top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
