"""relay/delivery/oauth.py against a real HTTP token endpoint on loopback (a
ThreadingHTTPServer in a thread, scripted per request): the grants' form fields, caching,
expiry, single flight, invalidation, errors that never carry a secret, token commands
(including one that hangs with a child), and the SASL strings' exact bytes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import pytest

from relay.delivery.oauth import (
    OAuthConf,
    OAuthError,
    TokenSource,
    oauthbearer,
    parse_oauthbearer_error,
    xoauth2,
)

T = TypeVar("T")
SECRET = "S3CR3T-client-secret"
REFRESH = "R3FR3SH-refresh-token"
SCOPE = "https://outlook.office365.com/.default"


# --- a token endpoint -----------------------------------------------------------------------


@dataclass
class Answer:
    status: int = 200
    doc: dict[str, Any] | None = None  # None: a fresh token "tok-<n>"
    raw: bytes | None = None  # this body instead of JSON
    delay: float = 0.0
    trickle: float = 0.0  # seconds between the body's bytes


@dataclass
class Request:
    path: str
    content_type: str
    pairs: list[tuple[str, str]]

    @property
    def form(self) -> dict[str, str]:
        assert len({k for k, _ in self.pairs}) == len(self.pairs), self.pairs  # no repeats
        return dict(self.pairs)


@dataclass
class Endpoint:
    expires_in: int = 3600
    default: Answer = field(default_factory=Answer)
    script: list[Answer] = field(default_factory=list)  # answered first, in order
    requests: list[Request] = field(default_factory=list)
    issued: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/oauth2/v2.0/token"

    def _answer(self, req: Request) -> tuple[Answer, bytes]:
        with self.lock:
            self.requests.append(req)
            a = self.script.pop(0) if self.script else self.default
            doc = a.doc
            if doc is None and a.status == 200:
                self.issued += 1
                doc = {
                    "access_token": f"tok-{self.issued}",
                    "token_type": "Bearer",
                    "expires_in": self.expires_in,
                }
        return a, a.raw if a.raw is not None else json.dumps(doc or {}).encode()

    def start(self) -> Endpoint:
        ep = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                req = Request(
                    self.path,
                    self.headers.get("Content-Type", ""),
                    parse_qsl(body.decode(), keep_blank_values=True, strict_parsing=True),
                )
                a, out = ep._answer(req)
                time.sleep(a.delay)
                try:
                    self.send_response(a.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    if not a.trickle:
                        self.wfile.write(out)
                    for i in range(len(out) if a.trickle else 0):
                        self.wfile.write(out[i : i + 1])
                        self.wfile.flush()
                        time.sleep(a.trickle)
                except OSError:
                    pass  # the client gave up (a timeout test)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.block_on_close = False
        self.server = server
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def ep() -> Iterator[Endpoint]:
    e = Endpoint().start()
    yield e
    e.stop()


def conf(ep: Endpoint, **kw: Any) -> OAuthConf:
    base: dict[str, Any] = {
        "token_url": ep.url,
        "client_id": "cid",
        "client_secret": SECRET,
        "scope": SCOPE,
        "timeout": 2.0,
    }
    return OAuthConf(**{**base, **kw})


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def tokens(ts: TokenSource, n: int) -> list[str]:
    try:
        return [await ts.token() for _ in range(n)]
    finally:
        await ts.aclose()


async def failure(ts: TokenSource) -> OAuthError:
    try:
        await ts.token()
    except OAuthError as e:
        return e
    finally:
        await ts.aclose()
    raise AssertionError("no OAuthError")


def assert_clean(e: OAuthError, *secrets: str) -> None:
    for text in (str(e), repr(e)):
        assert "\n" not in text and "\r" not in text, text
        for s in (SECRET, REFRESH, *secrets):
            assert s not in text, text


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- grants ----------------------------------------------------------------------------------


def test_client_credentials_grant_form(ep: Endpoint) -> None:
    assert run(tokens(TokenSource(conf(ep)), 1)) == ["tok-1"]
    (req,) = ep.requests
    assert req.path == "/oauth2/v2.0/token"
    assert req.content_type.startswith("application/x-www-form-urlencoded")
    assert req.form == {
        "grant_type": "client_credentials",
        "client_id": "cid",
        "client_secret": SECRET,
        "scope": SCOPE,
    }


def test_refresh_token_grant_form(ep: Endpoint) -> None:
    assert run(tokens(TokenSource(conf(ep, refresh_token=REFRESH)), 1)) == ["tok-1"]
    assert ep.requests[0].form == {
        "grant_type": "refresh_token",
        "refresh_token": REFRESH,
        "client_id": "cid",
        "client_secret": SECRET,
        "scope": SCOPE,
    }


def test_unset_fields_are_not_sent(ep: Endpoint) -> None:
    # a public client (Google installed app style): no secret, no scope
    c = conf(ep, refresh_token=REFRESH, client_secret=None, scope=None)
    run(tokens(TokenSource(c), 1))
    assert ep.requests[0].form == {
        "grant_type": "refresh_token",
        "refresh_token": REFRESH,
        "client_id": "cid",
    }


def test_conf_repr_hides_secrets() -> None:
    c = OAuthConf(
        token_url="https://x.test/t", client_secret=SECRET, refresh_token=REFRESH, timeout=3
    )
    assert SECRET not in repr(c) and REFRESH not in repr(c) and "x.test" in repr(c)


# --- cache, expiry, single flight, invalidation ---------------------------------------------


def test_cached_token_makes_no_request(ep: Endpoint) -> None:
    ts = TokenSource(conf(ep))
    assert run(tokens(ts, 3)) == ["tok-1"] * 3
    assert len(ep.requests) == 1 and ts.fetches == 1


def test_expiry_with_a_margin(ep: Endpoint) -> None:
    ep.expires_in = 100
    now = [1000.0]

    async def main() -> list[str]:
        ts = TokenSource(conf(ep), clock=lambda: now[0], margin=60.0)
        got = [await ts.token()]
        now[0] = 1039.9  # 60.1 s left: still good
        got.append(await ts.token())
        now[0] = 1040.0  # 60 s left: refreshed
        got.append(await ts.token())
        now[0] = 1079.9
        got.append(await ts.token())
        await ts.aclose()
        return got

    assert run(main()) == ["tok-1", "tok-1", "tok-2", "tok-2"]
    assert len(ep.requests) == 2


def test_expires_in_defaults_to_an_hour(ep: Endpoint) -> None:
    ep.script = [Answer(doc={"access_token": "no-expiry", "token_type": "Bearer"})]
    now = [0.0]

    async def main() -> list[str]:
        ts = TokenSource(conf(ep), clock=lambda: now[0], margin=60.0)
        got = [await ts.token()]
        now[0] = 3539.0
        got.append(await ts.token())
        now[0] = 3540.0
        got.append(await ts.token())
        await ts.aclose()
        return got

    assert run(main()) == ["no-expiry", "no-expiry", "tok-1"]


def test_fifty_concurrent_callers_make_one_request(ep: Endpoint) -> None:
    ep.default = Answer(delay=0.3)

    async def main() -> tuple[list[str], int]:
        ts = TokenSource(conf(ep))
        got = await asyncio.gather(*(ts.token() for _ in range(50)))
        await ts.aclose()
        return list(got), ts.fetches

    got, fetches = run(main())
    assert got == ["tok-1"] * 50
    assert len(ep.requests) == 1 and fetches == 1


def test_concurrent_callers_share_one_error_and_it_is_not_cached(ep: Endpoint) -> None:
    ep.script = [Answer(status=503, doc={"error": "server_error"}, delay=0.3)]

    async def main() -> tuple[list[Any], str]:
        ts = TokenSource(conf(ep))
        got = await asyncio.gather(*(ts.token() for _ in range(20)), return_exceptions=True)
        after = await ts.token()  # the next call asks again
        await ts.aclose()
        return list(got), after

    got, after = run(main())
    assert all(isinstance(g, OAuthError) and g.transient for g in got), got
    assert len({id(g) for g in got}) == 1  # the very same error
    assert after == "tok-1"
    assert len(ep.requests) == 2


def test_a_caller_that_gives_up_does_not_cancel_the_request_for_others(ep: Endpoint) -> None:
    ep.default = Answer(delay=0.4)

    async def main() -> tuple[str, bool, int]:
        ts = TokenSource(conf(ep))
        first = asyncio.create_task(ts.token())  # starts the request
        await asyncio.sleep(0.05)
        second = asyncio.create_task(ts.token())
        await asyncio.sleep(0.05)
        first.cancel()
        got = await second
        try:
            await first
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        await ts.token()  # cached
        await ts.aclose()
        return got, cancelled, ts.fetches

    assert run(main()) == ("tok-1", True, 1)
    assert len(ep.requests) == 1


def test_invalidate_refetches_but_a_stale_invalidation_keeps_the_new_token(ep: Endpoint) -> None:
    async def main() -> list[str]:
        ts = TokenSource(conf(ep))
        t1 = await ts.token()
        ts.invalidate(t1)  # e.g. 535 to XOAUTH2
        t2 = await ts.token()
        ts.invalidate(t1)  # a late refusal of the old token
        ts.invalidate("never-issued")
        t3 = await ts.token()
        await ts.aclose()
        return [t1, t2, t3]

    assert run(main()) == ["tok-1", "tok-2", "tok-2"]
    assert len(ep.requests) == 2


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (400, "invalid_client", False),
        (401, "invalid_client", False),
        (400, "invalid_grant", False),
        (403, "unauthorized_client", False),
        (404, None, False),
        (400, "temporarily_unavailable", True),
        (408, None, True),
        (429, None, True),
        (500, "server_error", True),
        (503, None, True),
    ],
)
def test_refusals_say_what_without_secrets(
    ep: Endpoint, status: int, code: str | None, transient: bool
) -> None:
    # the server echoes our secrets in its description: they must not reach the message
    doc: dict[str, Any] = {"error_description": f"AADSTS7000215: bad {SECRET} for {REFRESH}"}
    if code:
        doc["error"] = code
    ep.default = Answer(status=status, doc=doc)
    e = run(failure(TokenSource(conf(ep, refresh_token=REFRESH))))
    assert e.transient is transient
    assert f"HTTP {status}" in str(e)
    if code:
        assert code in str(e)
    assert_clean(e)


def test_a_hostile_error_code_is_one_line_and_secret_free(ep: Endpoint) -> None:
    ep.default = Answer(status=400, doc={"error": f"invalid_client\r\n550 {SECRET} {REFRESH}"})
    e = run(failure(TokenSource(conf(ep, refresh_token=REFRESH))))
    assert not e.transient and "HTTP 400 (invalid_client" in str(e)
    assert_clean(e)
    # only a code's own characters are echoed, and not many
    ep.default = Answer(status=400, doc={"error": "invalid_client <b>see</b> " + "x" * 200})
    e = run(failure(TokenSource(conf(ep))))
    assert re.fullmatch(r"token endpoint answered HTTP 400 \(invalid_client[\w.:-]{1,46}\)", str(e))


@pytest.mark.parametrize(
    ("answer", "fragment"),
    [
        (Answer(raw=b"<html>gateway</html>"), "not JSON"),
        (Answer(doc={"token_type": "Bearer", "expires_in": 3600}), "no access_token"),
        (Answer(doc={"access_token": "two words"}), "spaces or control"),
    ],
)
def test_unusable_answers(ep: Endpoint, answer: Answer, fragment: str) -> None:
    ep.default = answer
    e = run(failure(TokenSource(conf(ep))))
    assert fragment in str(e)
    assert_clean(e, "two words")


def test_connection_refused_is_transient() -> None:
    c = OAuthConf(
        token_url=f"http://127.0.0.1:{closed_port()}/t", client_id="c", client_secret=SECRET
    )
    e = run(failure(TokenSource(c)))
    assert e.transient and "unreachable" in str(e)
    assert_clean(e)


def test_slow_endpoint_times_out_transient(ep: Endpoint) -> None:
    ep.default = Answer(delay=3.0)
    started = time.monotonic()
    e = run(failure(TokenSource(conf(ep, timeout=0.3))))
    assert time.monotonic() - started < 1.5
    assert e.transient and "timed out" in str(e)


def test_trickling_endpoint_is_bounded_by_the_timeout_as_a_whole(ep: Endpoint) -> None:
    # every byte comes well within a read timeout, the whole answer does not
    ep.default = Answer(trickle=0.1)
    started = time.monotonic()
    e = run(failure(TokenSource(conf(ep, timeout=0.5))))
    assert time.monotonic() - started < 2.0
    assert e.transient and "timed out" in str(e)


def test_misconfiguration_is_not_transient() -> None:
    ts = TokenSource(OAuthConf(client_id="c", client_secret=SECRET))
    e = run(failure(ts))
    assert not e.transient and "token_url" in str(e) and ts.fetches == 0
    e = run(failure(TokenSource(OAuthConf(token_url="ftp://x.test/t", client_secret=SECRET))))
    assert not e.transient and "usable" in str(e)
    assert_clean(e)


# --- token commands --------------------------------------------------------------------------


def test_token_command_bare_token_first_line() -> None:
    now = [0.0]

    async def main() -> tuple[list[str], int]:
        ts = TokenSource(
            OAuthConf(token_command="printf 'bare.tok-1\\nsecond line\\n'"),
            clock=lambda: now[0],
        )
        got = [await ts.token()]
        now[0] = 3539.0  # a bare token lives an hour
        got.append(await ts.token())
        await ts.aclose()
        return got, ts.fetches

    assert run(main()) == (["bare.tok-1", "bare.tok-1"], 1)


def test_token_command_json_with_expiry(tmp_path: Path) -> None:
    counter = tmp_path / "n"
    cmd = (
        f"n=$(cat {counter} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {counter}; "
        'printf \'{"access_token": "cmd-%s", "expires_in": 120}\\n\' $n'
    )
    now = [0.0]

    async def main() -> tuple[list[str], int]:
        ts = TokenSource(OAuthConf(token_command=cmd), clock=lambda: now[0], margin=60.0)
        got = [await ts.token()]
        now[0] = 59.9
        got.append(await ts.token())
        now[0] = 60.0
        got.append(await ts.token())
        await ts.aclose()
        return got, ts.fetches

    assert run(main()) == (["cmd-1", "cmd-1", "cmd-2"], 2)
    assert counter.read_text().strip() == "2"


@pytest.mark.parametrize(
    ("command", "fragment", "transient"),
    [
        (f"echo {SECRET} >&2; echo partial-{REFRESH}; exit 1", "exited 1", True),
        ("true", "printed no token", True),
        ("echo '{\"nope\": 1}'", "no access_token", True),
        ("echo 'Bearer abc.def'", "spaces or control", False),
    ],
)
def test_token_command_failures(command: str, fragment: str, transient: bool) -> None:
    e = run(failure(TokenSource(OAuthConf(token_command=command, timeout=2.0))))
    assert fragment in str(e) and e.transient is transient
    assert_clean(e, "abc.def", command)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # dead, not yet reaped


def test_hanging_token_command_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    # the shell's child holds stdout open: killing only the shell would leave us waiting
    cmd = f"sleep 30 & echo $! > {pidfile}; wait"
    started = time.monotonic()
    e = run(failure(TokenSource(OAuthConf(token_command=cmd, timeout=0.5))))
    assert time.monotonic() - started < 3.0
    assert e.transient and "timed out after 0.5s" in str(e)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 2.0
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not _gone(pid):
        os.kill(pid, 9)
        raise AssertionError("the token command's child survived the timeout")


# --- SASL ------------------------------------------------------------------------------------


def test_xoauth2_bytes() -> None:
    assert base64.b64decode(xoauth2("u@x.test", "ya29.T0K")) == (
        b"user=u@x.test\x01auth=Bearer ya29.T0K\x01\x01"
    )


def test_oauthbearer_bytes_escape_the_authzid() -> None:
    assert base64.b64decode(oauthbearer("u@x.test", "T0K", "smtp.office365.com", 587)) == (
        b"n,a=u@x.test,\x01host=smtp.office365.com\x01port=587\x01auth=Bearer T0K\x01\x01"
    )
    assert base64.b64decode(oauthbearer("a,b=c@x.test", "T0K", "smtp.gmail.com", 465)) == (
        b"n,a=a=2Cb=3Dc@x.test,\x01host=smtp.gmail.com\x01port=465\x01auth=Bearer T0K\x01\x01"
    )


def test_sasl_helpers_refuse_the_separator() -> None:
    with pytest.raises(ValueError):
        xoauth2("u\x01auth=Bearer evil", "T")
    with pytest.raises(ValueError):
        oauthbearer("u", "T\x01", "h", 587)


def test_parse_oauthbearer_error() -> None:
    doc = {"status": "invalid_token", "scope": "https://mail.google.com/"}
    b64 = base64.b64encode(json.dumps(doc).encode()).decode()
    assert parse_oauthbearer_error(b64) == doc
    assert parse_oauthbearer_error(b64 + "\r\n") == doc
    for bad in ("%%%", "", base64.b64encode(b"not json").decode(), base64.b64encode(b"[1]")):
        assert parse_oauthbearer_error(bad if isinstance(bad, str) else bad.decode()) == {}
