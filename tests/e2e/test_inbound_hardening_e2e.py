"""Inbound hardening against the daemon as a real subprocess: connection limits (per IP, in
total, a reserve for allow-listed clients), `max_errors`, the command timeout and the minimum
DATA rate, AUTH failure delays and bans across connections, AUTH checks off the event loop,
implicit TLS (RFC 8314) with a certificate reloaded on SIGHUP, and the RLIMIT_NOFILE check.

Flooding clients connect from 127.0.0.2 and up (loopback, but outside the listener's `allow`
of 127.0.0.1/32); the app that must keep working connects from 127.0.0.1."""

from __future__ import annotations

import base64
import contextlib
import http.client
import re
import resource
import signal
import smtplib
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from relay.inbound import auth
from tests.harness import RelayProcess, Upstream, make_message

RelayFactory = Callable[..., RelayProcess]
UpFactory = Callable[..., Upstream]

SENDER = "app@example.com"
RCPT = "user@example.org"
APP = "127.0.0.1"  # allow-listed
PASSWORD = "correct horse battery staple"
WRONG = "wrong-password-123"


@pytest.fixture(scope="module")
def alice_hash() -> str:
    return auth.hash_password(PASSWORD)


def daemon(
    relay: RelayFactory,
    up: Upstream,
    limits: dict[str, Any] | None = None,
    auth_conf: dict[str, Any] | None = None,
    users: str | None = None,
    **listener: Any,
) -> RelayProcess:
    r = relay(
        upstream=up,
        start=False,
        config={
            "limits": limits or {},
            "auth": auth_conf or {},
            "destinations": {"*": {"rate": "unlimited"}},
        },
    )
    lst = r.config["listen"][0]
    lst["allow"] = [f"{APP}/32"]
    if users is not None:
        (r.workdir / "users").write_text(f"alice:{users}\n")
        lst["auth"] = {"users_file": "users", "allow_plaintext": True}
    lst.update(listener)
    r.write_config()
    return r.start()


class Raw:
    """A raw SMTP client socket from a chosen source address."""

    def __init__(self, port: int, source: str, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=timeout, source_address=(source, 0)
        )
        self.file = self.sock.makefile("rb")

    def reply(self) -> bytes:
        """One whole reply (all its lines), b"" at EOF."""
        out = b""
        while True:
            line = self.file.readline()
            out += line
            if not line or line[3:4] != b"-":
                return out

    def cmd(self, line: str) -> bytes:
        self.sock.sendall(line.encode() + b"\r\n")
        return self.reply()

    def closed(self) -> bool:
        return self.file.read() == b""

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@contextlib.contextmanager
def raws(port: int, sources: list[str]) -> Iterator[list[Raw]]:
    made: list[Raw] = []
    try:
        for src in sources:
            made.append(Raw(port, src))
        yield made
    finally:
        for c in made:
            c.close()


def send_app(port: int, i: int, host: str = APP) -> float:
    """One message from the allow-listed app; seconds from connect to the 250."""
    t0 = time.monotonic()
    with smtplib.SMTP(host, port, timeout=30, source_address=(APP, 0)) as s:
        assert s.sendmail(SENDER, [RCPT], make_message(i)) == {}
    return time.monotonic() - t0


def metrics(r: RelayProcess) -> str:
    c = http.client.HTTPConnection("127.0.0.1", r.admin_port, timeout=10)
    c.request("GET", "/metrics")
    body = c.getresponse().read().decode()
    c.close()
    return body


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


def plain(user: str, password: str) -> str:
    return "AUTH PLAIN " + base64.b64encode(f"\0{user}\0{password}".encode()).decode()


# --- connections ----------------------------------------------------------------------------


@pytest.mark.slow
def test_per_ip_and_total_limits_421_while_the_app_gets_through(upstream, relay) -> None:
    up = upstream()
    r = daemon(
        relay, up, limits={"max_connections": 12, "allowed_reserve": 4, "max_connections_per_ip": 3}
    )
    with raws(r.port, ["127.0.0.2"] * 3) as held:
        assert all(c.reply().startswith(b"220 ") for c in held)
        for _ in range(2):  # over the per-IP limit: 421 before any greeting, then closed
            extra = Raw(r.port, "127.0.0.2")
            assert extra.reply() == (
                b"421 4.7.0 too many connections from your address, try again later\r\n"
            )
            assert extra.closed()
            extra.close()
        # 3 + 3 + 2 = 8 = max_connections - allowed_reserve: the next outsider is refused
        with raws(r.port, ["127.0.0.3"] * 3 + ["127.0.0.4"] * 2) as more:
            assert all(c.reply().startswith(b"220 ") for c in more)
            late = Raw(r.port, "127.0.0.5")
            assert late.reply() == b"421 4.7.0 too many connections, try again later\r\n"
            assert late.closed()
            late.close()
            # the reserve is the app's: it still gets its mail accepted
            assert send_app(r.port, 1) < 5
            text = metrics(r)
            assert metric(text, 'relay_connections_refused_total{reason="per_ip"}') == 2
            assert metric(text, 'relay_connections_refused_total{reason="total"}') == 1
            r.wait_until(
                lambda: metric(metrics(r), "relay_connections_open") == 8,
                timeout=10,
                what="the app's connection released",
            )
    up.wait_for(1)
    # closed connections are released: 127.0.0.2 may connect again
    r.wait_until(
        lambda: metric(metrics(r), "relay_connections_open") == 0,
        timeout=10,
        what="connections released",
    )
    with raws(r.port, ["127.0.0.2"] * 3) as again:
        assert all(c.reply().startswith(b"220 ") for c in again)
    # the limits reload on SIGHUP
    r.config["limits"]["max_connections_per_ip"] = 1
    r.write_config()
    r.signal(signal.SIGHUP)
    r.wait_until(
        lambda: any(e.get("msg") == "configuration reloaded" for e in events(r, "config_reloaded")),
        what="reload",
    )
    with raws(r.port, ["127.0.0.2"] * 2) as now:
        assert now[0].reply().startswith(b"220 ")
        assert now[1].reply().startswith(b"421 4.7.0 too many connections from your address")
    limited = events(r, "connection_limit")
    # logged once per (reason, client) per minute, the per-IP one refused twice
    assert sorted((e["reason"], e["peer"]) for e in limited) == [
        ("per_ip", "127.0.0.2"),
        ("total", "127.0.0.5"),
    ]
    assert all(e["level"] == "warning" for e in limited)
    assert r.stop() == 0


@pytest.mark.slow
def test_max_errors_421_and_close(upstream, relay) -> None:
    up = upstream()
    r = daemon(relay, up, limits={"max_errors": 3})
    c = Raw(r.port, APP)
    assert c.reply().startswith(b"220 ")
    assert c.cmd("EHLO client.test").startswith(b"250-")
    assert c.cmd("RCPT TO:<a@example.org>").startswith(b"503 ")  # no MAIL yet
    # an accepted message starts the count again
    assert c.cmd(f"MAIL FROM:<{SENDER}>").startswith(b"250 ")
    assert c.cmd(f"RCPT TO:<{RCPT}>").startswith(b"250 ")
    assert c.cmd("DATA").startswith(b"354 ")
    assert c.cmd(make_message(1).decode() + ".").startswith(b"250 2.0.0 Ok: queued")
    assert c.cmd("RCPT TO:<a@example.org>").startswith(b"503 ")
    assert c.cmd("MAIL FROM:<not an address").startswith(b"5")
    third = c.cmd("RCPT TO:<a@example.org>")
    assert third.startswith(b"503 ")
    assert c.reply() == b"421 4.7.0 relay.test too many errors, closing connection\r\n"
    assert c.closed()
    c.close()
    closed = events(r, "session_closed")
    assert [e["reason"] for e in closed] == ["max_errors"]
    assert metric(metrics(r), 'relay_sessions_closed_total{reason="max_errors"}') == 1
    assert r.stop() == 0


@pytest.mark.slow
def test_command_timeout_and_min_data_rate(upstream, relay) -> None:
    up = upstream()
    r = daemon(
        relay,
        up,
        limits={"command_timeout": "1s", "min_data_rate": 1000, "min_data_rate_window": "1s"},
    )
    # a client that dribbles a command and never ends the line
    slow = Raw(r.port, "127.0.0.2")
    assert slow.reply().startswith(b"220 ")
    t0 = time.monotonic()
    slow.sock.sendall(b"EHL")
    assert slow.reply() == (
        b"421 4.4.2 relay.test timeout waiting for a command, closing connection\r\n"
    )
    assert 0.8 < time.monotonic() - t0 < 5
    assert slow.closed()
    slow.close()
    # a client that connects and says nothing at all
    idle = Raw(r.port, "127.0.0.2")
    assert idle.reply().startswith(b"220 ")
    assert idle.reply().startswith(b"421 4.4.2 ")
    idle.close()
    # below the data rate in DATA
    data = Raw(r.port, APP)
    assert data.reply().startswith(b"220 ")
    assert data.cmd("EHLO client.test").startswith(b"250")
    assert data.cmd(f"MAIL FROM:<{SENDER}>").startswith(b"250 ")
    assert data.cmd(f"RCPT TO:<{RCPT}>").startswith(b"250 ")
    assert data.cmd("DATA").startswith(b"354 ")
    t0 = time.monotonic()
    data.sock.sendall(b"Subject: slow\r\n")
    assert data.reply() == (
        b"421 4.4.2 relay.test data arriving too slowly, closing connection\r\n"
    )
    assert time.monotonic() - t0 < 5
    data.close()
    # pauses between commands shorter than the timeout are fine, and so is a normal DATA
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
        s.ehlo("client.test")
        time.sleep(0.5)
        body = (b"x" * 998 + b"\r\n") * 200
        assert s.sendmail(SENDER, [RCPT], make_message(2, body=body)) == {}
    up.wait_for(1)
    assert sorted(e["reason"] for e in events(r, "session_closed")) == [
        "command_timeout",
        "data_rate",
    ]  # the second timeout from 127.0.0.2: not logged again
    text = metrics(r)
    assert metric(text, 'relay_sessions_closed_total{reason="command_timeout"}') == 2
    assert metric(text, 'relay_sessions_closed_total{reason="data_rate"}') == 1
    assert r.stop() == 0


# --- AUTH -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_auth_failures_delayed_then_banned_across_connections(upstream, relay, alice_hash) -> None:
    up = upstream()
    r = daemon(
        relay,
        up,
        users=alice_hash,
        auth_conf={
            "failure_delay": "0.3s",
            "max_failure_delay": "1s",
            "max_failures_per_ip": 4,
            "ban_time": "60s",
        },
    )
    src = "127.0.0.2"  # outside allow: it can only AUTH

    def attempt(c: Raw) -> tuple[bytes, float]:
        t0 = time.monotonic()
        return c.cmd(plain("alice", WRONG)), time.monotonic() - t0

    first = Raw(r.port, src)
    first.reply()
    first.cmd("EHLO client.test")
    reply, took = attempt(first)
    assert reply.startswith(b"535 5.7.8") and took >= 0.25  # 1st failure: 0.3 s
    reply, took = attempt(first)
    assert reply.startswith(b"535 5.7.8") and took >= 0.55  # 2nd: 0.6 s
    first.close()
    second = Raw(r.port, src)  # a new connection does not start afresh
    second.reply()
    second.cmd("EHLO client.test")
    reply, took = attempt(second)
    assert reply.startswith(b"535 5.7.8") and took >= 0.9  # 3rd: capped at 1 s
    reply, _ = attempt(second)  # the 4th within the window: banned
    assert reply == (
        b"421 4.7.0 too many authentication failures from your address, try again later\r\n"
    )
    assert second.closed()
    second.close()
    # banned: refused at connect (it could do nothing but AUTH), even the right password
    third = Raw(r.port, src)
    assert third.reply().startswith(b"421 4.7.0 too many authentication failures")
    third.close()
    # other addresses are not affected; the app's allow-listed address relays as always
    other = Raw(r.port, "127.0.0.3")
    other.reply()
    other.cmd("EHLO client.test")
    assert other.cmd(plain("alice", PASSWORD)).startswith(b"235 ")
    other.close()
    assert send_app(r.port, 1) < 5
    bans = events(r, "auth_ban")
    assert len(bans) == 1 and bans[0]["peer"] == src and bans[0]["failures"] == 4
    assert [e["failures_from_peer"] for e in events(r, "auth_failed")] == [1, 2, 3, 4]
    text = metrics(r)
    assert metric(text, "relay_auth_bans_total") == 1
    assert metric(text, "relay_auth_failures_total") == 4
    assert metric(text, 'relay_connections_refused_total{reason="auth_ban"}') == 1
    assert metric(text, 'relay_sessions_closed_total{reason="auth_failures"}') == 1
    assert WRONG not in r.logs() and PASSWORD not in r.logs()
    assert r.stop() == 0


@pytest.mark.slow
def test_auth_checks_do_not_stall_other_clients(upstream, relay, alice_hash) -> None:
    """20 clients guessing passwords as fast as they can; the app's messages are still
    accepted quickly. (Old code: each scrypt ran inside the event loop, ~40 ms each, so every
    command of the app waited behind up to 20 of them: seconds per message.)"""
    up = upstream()
    r = daemon(
        relay,
        up,
        users=alice_hash,
        auth_conf={"failure_delay": 0, "max_failures_per_ip": 0},
        limits={"max_errors": 0},
    )
    stop = threading.Event()
    tries = [0] * 20

    def hammer(n: int) -> None:
        while not stop.is_set():
            try:
                c = Raw(r.port, f"127.0.0.{2 + n % 5}")
                c.reply()
                c.cmd("EHLO client.test")
                for _ in range(3):  # the third gets 421 and the connection closes
                    if stop.is_set():
                        break
                    c.cmd(plain("alice", WRONG))
                    tries[n] += 1
                c.close()
            except OSError:
                pass

    threads = [threading.Thread(target=hammer, args=(n,), daemon=True) for n in range(20)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # let them get going
        took = [send_app(r.port, i) for i in range(5)]
        time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert sum(tries) >= 20, "the guessers did not get going"
    assert max(took) < 2.0, took
    up.wait_for(5)
    assert r.stop() == 0


@pytest.mark.slow
def test_auth_checks_beyond_max_pending_get_454(upstream, relay, alice_hash) -> None:
    up = upstream()
    r = daemon(
        relay,
        up,
        users=alice_hash,
        auth_conf={"max_parallel": 1, "max_pending": 0, "failure_delay": 0},
    )
    clients = [Raw(r.port, f"127.0.0.{2 + i}") for i in range(8)]
    for c in clients:
        c.reply()
        c.cmd("EHLO client.test")
    for c in clients:  # all at once: one check runs, none may wait
        c.sock.sendall(plain("alice", WRONG).encode() + b"\r\n")
    replies = [c.reply()[:9] for c in clients]
    for c in clients:
        c.close()
    assert b"535 5.7.8" in replies
    assert b"454 4.7.0" in replies
    assert set(replies) == {b"535 5.7.8", b"454 4.7.0"}
    assert len(events(r, "auth_busy")) >= 1
    assert r.stop() == 0


# --- implicit TLS ---------------------------------------------------------------------------


@pytest.mark.slow
def test_implicit_tls_send_auth_and_certificate_reload(
    upstream, relay, alice_hash, tmp_path: Path
) -> None:
    up = upstream()
    ca = trustme.CA()
    r = relay(upstream=up, start=False)
    lst = r.config["listen"][0]
    lst["allow"] = []  # nobody relays without AUTH
    first = ca.issue_cert("127.0.0.1")
    first.cert_chain_pems[0].write_to_path(str(r.workdir / "cert.pem"))
    first.private_key_pem.write_to_path(str(r.workdir / "key.pem"))
    (r.workdir / "users").write_text(f"alice:{alice_hash}\n")
    lst["tls"] = {"cert_file": "cert.pem", "key_file": "key.pem", "mode": "implicit"}
    lst["auth"] = {"users_file": "users"}
    r.write_config()
    r.start()
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)

    def peer_cert() -> bytes:
        with smtplib.SMTP_SSL("127.0.0.1", r.port, timeout=30, context=ctx) as s:
            assert isinstance(s.sock, ssl.SSLSocket)
            return s.sock.getpeercert(binary_form=True) or b""

    with smtplib.SMTP_SSL("127.0.0.1", r.port, timeout=30, context=ctx) as s:
        s.ehlo("client.test")
        assert not s.has_extn("starttls")  # TLS already (RFC 8314 §3)
        assert set(s.esmtp_features["auth"].split()) == {"PLAIN", "LOGIN"}
        s.login("alice", PASSWORD)
        assert s.sendmail(SENDER, [RCPT], make_message(1)) == {}
    with smtplib.SMTP_SSL("127.0.0.1", r.port, timeout=30, context=ctx) as s:
        s.ehlo("client.test")
        assert s.mail(SENDER)[0] == 250
        assert s.rcpt(RCPT)[0] == 554  # TLS alone does not let anyone relay
    got = up.wait_for(1)
    assert b"(relay) with ESMTPSA id" in got[0].data
    ok = events(r, "auth_ok")
    assert len(ok) == 1 and ok[0]["tls"] is True
    # a renewed certificate: new connections get it after SIGHUP
    before = peer_cert()
    renewed = ca.issue_cert("127.0.0.1", "localhost")
    renewed.cert_chain_pems[0].write_to_path(str(r.workdir / "cert.pem"))
    renewed.private_key_pem.write_to_path(str(r.workdir / "key.pem"))
    r.signal(signal.SIGHUP)
    r.wait_until(
        lambda: any(e.get("msg") == "configuration reloaded" for e in events(r, "config_reloaded")),
        what="reload",
    )
    after = peer_cert()
    assert before and after and before != after
    assert after == ssl.PEM_cert_to_DER_cert(renewed.cert_chain_pems[0].bytes().decode())
    # a plaintext client on the implicit-TLS port gets nothing SMTP, and the daemon carries on
    with socket.create_connection(("127.0.0.1", r.port), timeout=10) as raw:
        raw.sendall(b"EHLO client.test\r\n")
        with contextlib.suppress(OSError):
            assert not raw.recv(100).startswith(b"220")
    assert peer_cert() == after
    assert r.stop() == 0


# --- file descriptors -----------------------------------------------------------------------


def _serve(r: RelayProcess, soft: int, hard: int) -> subprocess.Popen[bytes]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "-c", str(r.config_path)],
        cwd=r.workdir,
        env=r.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=limit,
    )


@pytest.mark.slow
def test_max_connections_must_fit_the_fd_limit(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up, start=False, config={"limits": {"max_connections": 2000}})
    proc = _serve(r, 512, 1024)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 78
    text = err.decode()
    assert text.startswith("relay: limits.max_connections: 2000 connections need about")
    assert "file-descriptor limit (RLIMIT_NOFILE) is 1024" in text and "LimitNOFILE=" in text
    # the soft limit is raised to the hard one when that is enough
    # 600 + 50 workers + 1 listener + 256 (admin.max_connections) + 100 fit under 1024
    r.write_config({**r.config, "limits": {"max_connections": 600}})
    proc = _serve(r, 256, 1024)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            limits = Path(f"/proc/{proc.pid}/limits").read_text()
            line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
            if line.split()[3:5] == ["1024", "1024"]:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert line.split()[3:5] == ["1024", "1024"], line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
