"""Real parts for end-to-end tests: a scriptable aiosmtpd upstream running in its own thread,
and the relay daemon as a real subprocess with its own config and spool.

Usage (see tests/conftest.py for the fixtures):

    up = upstream()                      # started, on a free loopback port
    up.rcpt_reply = lambda addr: "550 5.1.1 no such user" if addr.startswith("x") else None
    r = relay(upstream=up, config={"retry": {"schedule": ["1s"]}})
    send(r.port, "a@example.com", ["b@example.org"], b"Subject: x\\r\\n\\r\\nhi\\r\\n")
    up.wait_for(1)
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import copy
import http.client
import io
import json
import logging
import os
import random
import re
import signal
import smtplib
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session

ROOT = Path(__file__).resolve().parent.parent


# Ports for servers a test starts later (the daemon's listeners, upstreams): picked below
# the kernel's ephemeral range (32768-60999 on Linux), which outgoing connections draw
# from, and split between pytest-xdist workers, so that a port we picked and released is
# not taken meanwhile by another worker or by some client's source port.
_PORTS_LOW, _PORTS_HIGH = 20000, 32000
_ports = random.Random()


# the last ports free_port gave out in this process: not given again while their daemon
# may still be starting (a worker's span of ports is a few thousand; 512 recent ones)
_given: collections.deque[int] = collections.deque(maxlen=512)


def free_port(host: str = "127.0.0.1") -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    span = (_PORTS_HIGH - _PORTS_LOW) // max(count, 1)
    low = _PORTS_LOW + index * span
    for _ in range(200):
        port = _ports.randrange(low, low + span)
        if port in _given:  # handed out already: its daemon may not have bound it yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _given.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is busy
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    data: bytes
    peer: Any
    tls: bool
    auth: str | None
    at: float


Reply = str | None  # None = default positive reply


@dataclass
class Upstream:
    """A real aiosmtpd server in a background thread. Behaviour is scripted by assigning
    the hook attributes (each may be changed while it runs):

    - connect_reply: str | None  -- e.g. "421 4.7.0 go away" to refuse at greeting
    - mail_reply(sender) -> str | None
    - rcpt_reply(address) -> str | None
    - data_reply(envelope) -> str | None   (the reply to the final ".")
    - stall: dict phase -> seconds to sleep before replying ("rcpt", "data", "mail")
    - disconnect_after_dot: bool -- drop the connection instead of replying to "."
    - pipelining: bool -- offer PIPELINING (RFC 2920) in the EHLO reply; `chunks` are the
      bytes of each read the server made, to see what a client wrote at once
    """

    host: str = "127.0.0.1"
    port: int = 0
    tls_context: ssl.SSLContext | None = None
    require_starttls: bool = False
    implicit_tls: bool = False
    auth: dict[str, str] | None = None  # username -> password
    # XOAUTH2 / OAUTHBEARER: username -> the access tokens accepted now (a test may change it)
    oauth: dict[str, set[str]] | None = None
    auth_seen: list[tuple[str, str, str]] = field(default_factory=list)  # (mech, user, token)
    connect_reply: str | None = None
    mail_reply: Callable[[str], Reply] = lambda s: None
    rcpt_reply: Callable[[str], Reply] = lambda a: None
    data_reply: Callable[[Envelope], Reply] = lambda e: None
    # the 250 to the final dot of a message it keeps (e.g. with a queue id, like Postfix)
    ok_reply: Callable[[Envelope], str] = lambda e: "250 2.0.0 OK queued"
    stall: dict[str, float] = field(default_factory=dict)
    disconnect_after_dot: bool = False
    pipelining: bool = False
    chunks: list[bytes] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    connections: int = 0
    commands: list[str] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> Upstream:
        if not self.port:
            self.port = free_port(self.host)
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)

            async def boot() -> None:
                self._server = await loop.create_server(
                    self._protocol,
                    self.host,
                    self.port,
                    ssl=self.tls_context if self.implicit_tls else None,
                )
                ready.set()

            loop.run_until_complete(boot())
            loop.run_forever()
            # drain
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name=f"upstream-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("upstream did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def _protocol(self) -> SMTP:
        kwargs: dict[str, Any] = {"hostname": "upstream.test", "decode_data": False, "timeout": 600}
        if self.tls_context is not None and not self.implicit_tls:
            kwargs["tls_context"] = self.tls_context
            kwargs["require_starttls"] = self.require_starttls
        if self.auth is not None:
            kwargs["authenticator"] = self._authenticate
            kwargs["auth_required"] = True
            kwargs["auth_require_tls"] = self.tls_context is not None
        else:
            kwargs["auth_require_tls"] = False
        self.connections += 1
        handler = _OAuthHandler(self) if self.oauth is not None else _Handler(self)
        if self.oauth is not None:
            kwargs["authenticator"] = self._authenticate
            kwargs["auth_required"] = True
            kwargs["auth_require_tls"] = self.tls_context is not None
        with warnings.catch_warnings():  # AUTH without TLS: on loopback, on purpose
            warnings.filterwarnings("ignore", "Requiring AUTH while not requiring TLS")
            return _ScriptedSMTP(self, handler, **kwargs)

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, auth_data: Any
    ) -> AuthResult:
        if isinstance(auth_data, LoginPassword) and self.auth is not None:
            user = auth_data.login.decode()
            if self.auth.get(user) == auth_data.password.decode():
                return AuthResult(success=True, auth_data=user)
        return AuthResult(success=False, handled=False)

    # --- assertions ---------------------------------------------------------------------

    def record(self, item: Received) -> None:
        with self._cond:
            self.received.append(item)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 30.0) -> list[Received]:
        """Wait until at least `n` messages arrived; returns them all."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.received) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"upstream got {len(self.received)} messages, expected {n}"
                    )
                self._cond.wait(left)
            return list(self.received)

    def recipients(self) -> list[str]:
        with self._cond:
            return [r for m in self.received for r in m.rcpt_tos]


class _ScriptedSMTP(SMTP):
    def __init__(self, up: Upstream, handler: Any, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._up = up

    async def _handle_client(self) -> None:
        if self._up.connect_reply:
            await self.push(self._up.connect_reply)
            self.transport.close()
            return
        await super()._handle_client()

    async def smtp_DATA(self, arg: str) -> None:
        self._up.commands.append("DATA")
        await super().smtp_DATA(arg)

    async def push(self, status: str) -> None:
        if status == "250 HELP" and self._up.pipelining:  # the EHLO reply's last line
            await super().push("250-PIPELINING")
        await super().push(status)

    def data_received(self, data: bytes) -> None:
        self._up.chunks.append(bytes(data))
        super().data_received(data)


class _Handler:
    def __init__(self, up: Upstream) -> None:
        self.up = up

    async def _stall(self, phase: str) -> None:
        s = self.up.stall.get(phase)
        if s:
            await asyncio.sleep(s)

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        self.up.commands.append(f"MAIL {address}")
        await self._stall("mail")
        r = self.up.mail_reply(address)
        if r:
            return r
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        self.up.commands.append(f"RCPT {address}")
        await self._stall("rcpt")
        r = self.up.rcpt_reply(address)
        if r:
            return r
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        await self._stall("data")
        if self.up.disconnect_after_dot:
            # the message reached us, but the client never learns it: the ambiguous case
            self.up.record(
                Received(
                    envelope.mail_from,
                    list(envelope.rcpt_tos),
                    bytes(envelope.original_content or b""),
                    session.peer,
                    session.ssl is not None,
                    None,
                    time.time(),
                )
            )
            server.transport.close()
            return "250 OK"  # never reaches the client
        r = self.up.data_reply(envelope)
        if r:
            return r
        auth = session.auth_data if isinstance(session.auth_data, str) else None
        self.up.record(
            Received(
                envelope.mail_from,
                list(envelope.rcpt_tos),
                bytes(envelope.original_content or b""),
                session.peer,
                session.ssl is not None,
                auth,
                time.time(),
            )
        )
        return self.up.ok_reply(envelope)


def _sasl_kv(b64: str) -> dict[str, str]:
    """key=value fields split by %x01 (XOAUTH2, OAUTHBEARER); a first field without `=`
    (OAUTHBEARER's GS2 header) is kept under the key ""."""
    raw = base64.b64decode(b64).decode() if b64 else ""
    out: dict[str, str] = {}
    for i, item in enumerate(raw.split("\x01")):
        if i == 0 and not item.startswith(("user=", "auth=")) and item:
            out[""] = item
        elif "=" in item:
            k, _sep, v = item.partition("=")
            out[k] = v
    return out


class _OAuthHandler(_Handler):
    """XOAUTH2 (Google/Microsoft) and OAUTHBEARER (RFC 7628) against `Upstream.oauth`."""

    async def _check(self, server: SMTP, mech: str, user: str, token: str) -> AuthResult:
        self.up.auth_seen.append((mech, user, token))
        assert self.up.oauth is not None
        if token in self.up.oauth.get(user, set()):
            return AuthResult(success=True, auth_data=user)
        err = base64.b64encode(
            json.dumps(
                {"status": "401", "schemes": "bearer", "scope": "https://mail.test/"}
            ).encode()
        )
        await server.push(b"334 " + err)  # the error challenge; the client answers %x01/empty
        await server._reader.readline()
        return AuthResult(
            success=False, handled=False, message="535 5.7.8 Username and Password not accepted"
        )

    async def auth_XOAUTH2(self, server: SMTP, args: list[str]) -> AuthResult:
        parts = _sasl_kv(args[1] if len(args) > 1 else "")
        token = parts.get("auth", "").removeprefix("Bearer ")
        return await self._check(server, "XOAUTH2", parts.get("user", ""), token)

    async def auth_OAUTHBEARER(self, server: SMTP, args: list[str]) -> AuthResult:
        parts = _sasl_kv(args[1] if len(args) > 1 else "")
        gs2 = parts.pop("", "")  # the GS2 header: n,a=USER,
        user = next((p[2:] for p in gs2.split(",") if p.startswith("a=")), "")
        user = user.replace("=2C", ",").replace("=3D", "=")
        token = parts.get("auth", "").removeprefix("Bearer ")
        return await self._check(server, "OAUTHBEARER", user, token)


# --- the daemon ---------------------------------------------------------------------------


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class RelayProcess:
    """The daemon as a real subprocess (`python -m relay serve -c FILE`)."""

    def __init__(
        self, workdir: Path, config: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.admin_port = free_port()
        base: dict[str, Any] = {
            "hostname": "relay.test",
            "listen": [{"address": f"127.0.0.1:{self.port}", "allow": ["127.0.0.0/8", "::1/128"]}],
            "spool": {"path": "spool"},
            "admin": {"listen": f"127.0.0.1:{self.admin_port}"},
            "log": {"level": "info", "format": "json"},
            "retry": {"schedule": ["1s", "2s"], "max_age": "1h", "min_delay": "0.2s"},
            "delivery": {"poll_interval": "0.2s"},
            "shutdown_timeout": "10s",
            # SMTP in the main process, as the tests were written (their counters, metrics
            # and fault files are that process's); the default, auto, may start a child
            "inbound": {"processes": 0},
        }
        self.config = deep_merge(base, config)
        for lst in self.config["listen"]:  # a listener given by the test: "{port}" is ours
            lst["address"] = lst["address"].replace("{port}", str(self.port))
        self.config_path = workdir / "relay.yaml"
        self.write_config()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop("RELAY_CONFIG", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "relay.log"
        self._log_offset = 0
        self.starts = 0

    @property
    def spool(self) -> Path:
        return self.workdir / "spool"

    def write_config(self, config: dict[str, Any] | None = None) -> None:
        if config is not None:
            self.config = config
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def start(self, wait: bool = True) -> RelayProcess:
        assert self.proc is None or self.proc.poll() is not None
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "-c", str(self.config_path)],
            cwd=self.workdir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.starts += 1
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay exited with {self.proc.returncode}:\n{self.logs()}")
            if any(
                e.get("event") == "startup" and e.get("msg") == "relay is ready"
                for e in self.events(since_start=True)
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"relay not ready after {timeout}s:\n{self.logs()}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"the daemon did not exit {timeout}s after SIGTERM:\n{self.logs()[-6000:]}"
            ) from e

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Teardown: SIGKILL, except under `make coverage`, where a SIGTERM first lets the
        daemon write its coverage data."""
        if os.environ.get("COVERAGE_PROCESS_START"):
            with contextlib.suppress(Exception):
                self.stop(timeout=10)
        self.kill()

    def restart(self) -> RelayProcess:
        self.stop()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        return self.start()

    def start_again(self) -> RelayProcess:
        """Start after a kill, only reading log lines written from now on for readiness."""
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        return self.start()

    # --- observation --------------------------------------------------------------------

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def events(self, since_start: bool = False) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        data = self.log_path.read_bytes()
        if since_start:
            data = data[self._log_offset :]
        out = []
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def cli(
        self, *args: str, check: bool = False, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [sys.executable, "-m", "relay", *args, "-c", str(self.config_path)],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and res.returncode != 0:
            raise AssertionError(
                f"relay {' '.join(args)} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
            )
        return res

    def cli_json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json", check=True).stdout)

    def queue(self, all: bool = True) -> list[dict[str, Any]]:
        return list(self.cli_json("queue", "list", *(["--all"] if all else [])))

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(
            f"timed out waiting for {what}\n--- relay log tail ---\n"
            + "\n".join(self.logs().splitlines()[-30:])
        )

    def metric(self, name: str) -> float:
        """One sample of /metrics (`name` with its labels, as exposed); 0 when absent."""
        c = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=10)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def recipient_states(self) -> dict[str, str]:
        return {r["address"]: r["state"] for m in self.queue() for r in m["recipients"]}


def server_context(ca: Any, *names: str) -> ssl.SSLContext:
    """A server-side TLS context with a certificate from a trustme CA (default name:
    127.0.0.1)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*(names or ("127.0.0.1",))).configure_cert(ctx)
    return ctx


def fast_config(timeout: str = "1s") -> dict[str, Any]:
    """Short timeouts and retries so a test takes seconds, not minutes. The circuit breaker
    (default: open for 60 s after 5 connection failures) is kept out of the way: a test that
    lets a few attempts fail sees the recovery at once (the breaker's own tests set it)."""
    return {
        "retry": {"schedule": ["1s"], "max_age": "1h", "min_delay": "0.2s"},
        "destinations": {
            "*": {
                "command_timeout": timeout,
                "data_timeout": timeout,
                "connect_timeout": timeout,
                "circuit_failures": 100,
            }
        },
    }


def smarthost_config(up: Upstream, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "upstream": {
            "mode": "smarthost",
            "smarthost": {"host": "127.0.0.1", "port": up.port, "tls": "none"},
        }
    }
    return deep_merge(cfg, extra)


def make_message(
    i: int = 0,
    *,
    message_id: str | None = None,
    subject: str | None = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    no_message_id: bool = False,
) -> bytes:
    lines = [
        "From: app@example.com",
        "To: user@example.org",
        f"Subject: {subject or f'message {i}'}",
    ]
    if not no_message_id:
        lines.append(f"Message-ID: {message_id or f'<msg-{i}@app.example.com>'}")
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    text = "\r\n".join(lines).encode() + b"\r\n\r\n"
    return text + (body if body is not None else f"body of message {i}\r\n".encode())


def send(
    port: int, sender: str, rcpts: list[str], data: bytes, host: str = "127.0.0.1"
) -> dict[str, tuple[int, bytes]]:
    """Send one message; returns smtplib's refused-recipients dict (empty: all accepted)."""
    with smtplib.SMTP(host, port, timeout=30) as s:
        return s.sendmail(sender, rcpts, data)


@contextlib.contextmanager
def smtp_session(port: int, host: str = "127.0.0.1") -> Iterator[smtplib.SMTP]:
    s = smtplib.SMTP(host, port, timeout=30)
    try:
        s.ehlo("client.test")
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.quit()


class LogWrites(io.StringIO):
    """A log stream that remembers each write (how many system calls the lines took)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


@contextlib.contextmanager
def logging_into(stream: io.StringIO) -> Iterator[None]:
    """The relay's logging (JSON, info) into `stream`; the root logger as it was after."""
    from relay.ops.logs import setup_logging

    with root_logger_kept():
        setup_logging("info", "json", stream=stream)
        yield


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """The root logger's level and handlers after the block as before it (a handler added
    inside is removed)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)


@contextlib.asynccontextmanager
async def engine_running(engine: Any) -> AsyncIterator[asyncio.Task[None]]:
    """`engine.run()` as a task for the block; then stopped (1 s for its deliveries) and
    the task cancelled, whatever the block raised."""
    task = asyncio.create_task(engine.run())
    try:
        yield task
    finally:
        await engine.stop(1.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
