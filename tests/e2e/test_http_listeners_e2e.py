"""The HTTP listeners of a real daemon (uvloop, aiohttp's C parser) under abuse: idle
connections past the per-IP and total bounds on the feedback port are refused at once
while the admin port still answers and the daemon's open files stay bounded; a webhook
refuses a stranger (or a body over max_body) before the body is sent; ambiguous framing
before the token is a 400 with no ERROR in the log (issue 27, items 6 and 8)."""

from __future__ import annotations

import http.client
import os
import socket
import time
from pathlib import Path

import pytest

from tests.harness import RelayProcess, free_port

pytestmark = pytest.mark.slow

PER_IP = 8
TOTAL = 12


def _fds(r: RelayProcess) -> int:
    assert r.proc is not None
    return len(os.listdir(f"/proc/{r.proc.pid}/fd"))


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    return s


def _exchange(port: int, raw: bytes, source: str = "127.0.0.1", timeout: float = 5) -> bytes:
    with _connect(port, source) as s:
        s.settimeout(timeout)
        s.sendall(raw)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def _get(port: int, path: str) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    status = c.getresponse().status
    c.close()
    return status


def test_http_listeners_hold_their_bounds(relay, tmp_path: Path) -> None:
    token = tmp_path / "generic.token"
    token.write_text("s3cret-token-0123456789\n")
    fb_port = free_port()
    r = relay(
        config={
            "admin": {"max_connections": 16, "max_connections_per_ip": 4},
            "feedback": {
                "listen": f"127.0.0.1:{fb_port}",
                "max_body": "64KiB",
                "max_connections": TOTAL,
                "max_connections_per_ip": PER_IP,
                "providers": {"generic": {"token_file": str(token)}},
            },
        }
    )
    assert _get(r.admin_port, "/healthz") == 200
    base = _fds(r)
    held: list[socket.socket] = []
    try:
        for _ in range(PER_IP):  # slow clients: a head that never ends
            s = _connect(fb_port)
            s.sendall(b"POST /feedback/generic HTTP/1.1\r\n")
            held.append(s)
        time.sleep(0.3)
        t0 = time.monotonic()
        refused = _exchange(fb_port, b"GET /feedback/generic HTTP/1.1\r\nHost: a\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503") and b"from your address" in refused
        assert time.monotonic() - t0 < 1.5
        # the admin port is a listener of its own: it still answers
        assert _get(r.admin_port, "/healthz") == 200
        # another client fills the total; past it everyone is refused
        for _ in range(TOTAL - PER_IP):
            s = _connect(fb_port, "127.0.0.2")
            s.sendall(b"POST /feedback/generic HTTP/1.1\r\n")
            held.append(s)
        time.sleep(0.3)
        refused = _exchange(fb_port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", "127.0.0.3")
        assert refused.startswith(b"HTTP/1.1 503")
        # a flood of refused connections holds no descriptor in the daemon
        for i in range(100):
            _exchange(fb_port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", f"127.0.1.{i % 50 + 1}")
        assert _fds(r) <= base + TOTAL + 4
        assert _get(r.admin_port, "/metrics") == 200
        text = _exchange(r.admin_port, b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n").decode()
        assert (
            'relay_http_connections_refused_total{listener="feedback",reason="per_ip"} 1.0' in text
        )
        assert (
            'relay_http_connections_refused_total{listener="feedback",reason="total"} 101.0' in text
        )
    finally:
        for s in held:
            s.close()
    # the slow heads were closed by the head timeout, or by us: the slots come back
    r.wait_until(lambda: _fds(r) <= base + 2, timeout=10, what="connections released")
    ok = _exchange(fb_port, b"GET /feedback/generic HTTP/1.1\r\nHost: a\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 405")

    # the token is checked at the head: a stranger's 60 KiB are never waited for
    head = b"POST /feedback/generic HTTP/1.1\r\nHost: a\r\nContent-Length: 60000\r\n"
    t0 = time.monotonic()
    assert _exchange(fb_port, head + b"\r\n").startswith(b"HTTP/1.1 401")
    assert time.monotonic() - t0 < 2
    # a Content-Length over max_body: 413 before a byte of the body
    big = b"POST /feedback/generic HTTP/1.1\r\nHost: a\r\nContent-Length: 70000\r\n\r\n"
    assert _exchange(fb_port, big).startswith(b"HTTP/1.1 413")
    # ambiguous framing before the token: 400, and nothing at ERROR in the log
    chunked = b"POST /feedback/generic HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    for raw in (
        chunked + b"5;" + b"x" * 16384 + b"\r\nhello\r\n0\r\n\r\n",
        chunked + b"0x5\r\nhello\r\n0\r\n\r\n",
        head + b"Content-Length: 5\r\n\r\nhello",
        b"POST /feedback/generic HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n",
    ):
        assert b" 400 " in _exchange(fb_port, raw).split(b"\r\n", 1)[0]
    assert _get(r.admin_port, "/healthz") == 200
    loud = [e for e in r.events() if e.get("level") in ("ERROR", "CRITICAL", "error")]
    assert not loud, loud
    assert "Traceback" not in r.logs()
