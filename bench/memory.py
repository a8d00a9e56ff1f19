"""Benchmark: the daemon's peak memory while many large messages are uploaded at once.

    python bench/memory.py [--clients 50] [--size-mib 20] [--max-connections 10]

Starts a real relay daemon (subprocess, its own temporary spool, default limits except
`max_message_size` and an unlimited rate) and a real aiosmtpd sink on loopback that keeps
only a SHA-256 of each message it receives. --clients threads each upload one message of
--size-mib MiB at the same moment (smtplib, one connection each); every message has its
own content (lines starting with dots included, to exercise transparency both ways).

Checks that every message was accepted (250) and delivered byte for byte (the sink's hash
of what arrived, minus our Received header, equals the hash of what was sent), and prints
the daemon's peak RSS (VmHWM from /proc) and the timings. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import smtplib
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiosmtpd.smtp import SMTP, Envelope, Session  # noqa: E402

from tests.harness import RelayProcess, deep_merge, free_port  # noqa: E402

_RECEIVED = re.compile(rb"\AReceived: [^\r]*\r\n(?:[ \t][^\r]*\r\n)*")


class HashingSink:
    """An aiosmtpd upstream that keeps one hash per message (never the message)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hashes: dict[str, str] = {}
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        data = envelope.original_content or b""
        m = _RECEIVED.match(data)
        body = data[m.end() :] if m else data
        mid = re.search(rb"^Message-ID: <([^>]+)>", body, re.M)
        with self.lock:
            self.hashes[mid.group(1).decode() if mid else "?"] = hashlib.sha256(body).hexdigest()
        return "250 2.0.0 OK"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def boot() -> None:
            await self._loop.create_server(
                lambda: SMTP(self, data_size_limit=None, decode_data=False), "127.0.0.1", self.port
            )

        self._loop.run_until_complete(boot())
        self._loop.run_forever()

    def start(self) -> HashingSink:
        self._thread.start()
        return self


def message(i: int, size: int) -> bytes:
    head = (
        f"From: app@example.com\r\nTo: big{i}@example.org\r\nSubject: big {i}\r\n"
        f"Message-ID: <mem-{i}@bench>\r\n\r\n"
    ).encode()
    line = f"{i:06d} ".encode() + b"m" * 70 + b"\r\n"
    dotted = b".starts with a dot " + f"{i}".encode() + b"\r\n"
    block = (line * 49 + dotted) * 64
    reps = max(1, size // len(block))
    return head + block * reps


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--size-mib", type=int, default=20)
    ap.add_argument("--max-connections", type=int, default=10)
    ap.add_argument(
        "--relay-tree",
        default=None,
        help="run the daemon from another checkout (e.g. an older commit, for a"
        " before/after comparison): its folder goes first on PYTHONPATH",
    )
    args = ap.parse_args()
    size = args.size_mib << 20

    sink = HashingSink().start()
    work = Path(tempfile.mkdtemp(prefix="relay-memory-"))
    relay = RelayProcess(
        work,
        deep_merge(
            {
                "upstream": {
                    "mode": "smarthost",
                    "smarthost": {"host": "127.0.0.1", "port": sink.port, "tls": "none"},
                },
                "limits": {"max_message_size": f"{args.size_mib + 5}MiB"},
                "destinations": {
                    "*": {"rate": "unlimited", "max_connections": args.max_connections}
                },
                "log": {"level": "info"},
            },
            {},
        ),
        env={"PYTHONPATH": args.relay_tree} if args.relay_tree else None,
    ).start()
    assert relay.proc is not None
    pid = relay.proc.pid
    idle_kib = vm_hwm_kib(pid)

    expected: dict[str, str] = {}
    replies: dict[int, Any] = {}
    barrier = threading.Barrier(args.clients)

    def upload(i: int) -> None:
        data = message(i, size)
        expected[f"mem-{i}@bench"] = hashlib.sha256(data).hexdigest()
        barrier.wait()
        started = time.monotonic()
        try:
            with smtplib.SMTP("127.0.0.1", relay.port, timeout=600) as s:
                s.ehlo("bench.test")
                s.mail("app@example.com")
                s.rcpt(f"big{i}@example.org")
                code, msg = s.data(data)
            replies[i] = (code, msg, time.monotonic() - started)
        except Exception as e:  # reported below
            replies[i] = (None, repr(e), time.monotonic() - started)

    started = time.monotonic()
    threads = [threading.Thread(target=upload, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    accepted_s = time.monotonic() - started
    accepted = sum(1 for r in replies.values() if r[0] == 250)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        with sink.lock:
            if len(sink.hashes) >= accepted:
                break
        time.sleep(0.2)
    delivered_s = time.monotonic() - started
    peak_kib = vm_hwm_kib(pid)
    relay.stop()
    with sink.lock:
        exact = sum(1 for k, v in expected.items() if sink.hashes.get(k) == v)
    print(
        f"clients={args.clients} size={args.size_mib}MiB "
        f"max_connections={args.max_connections} tree={args.relay_tree or ROOT}"
    )
    print(
        f"accepted={accepted}/{args.clients} in {accepted_s:.1f}s; delivered byte for byte="
        f"{exact}/{args.clients} after {delivered_s:.1f}s"
    )
    print(f"daemon peak RSS (VmHWM): {peak_kib / 1024:.0f} MiB (idle {idle_kib / 1024:.0f} MiB)")
    failed = [r for r in replies.values() if r[0] != 250]
    if failed:
        print("failures:", failed[:3])
    return 0 if exact == args.clients and accepted == args.clients else 1


if __name__ == "__main__":
    raise SystemExit(main())
