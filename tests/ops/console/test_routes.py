"""The console over HTTP against a real daemon (one per module): login, slowed and counted
failures, CSRF, roles, a bulk action whose confirmation count is what it then does (and
what the CLI sees), escaping and the security headers; and the access rules that need no
daemon (open read-only on loopback, refused elsewhere without users)."""

from __future__ import annotations

import asyncio
import http.client
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml

from relay.config.tree import ConfigError, load_config
from relay.ops.console import auth
from relay.ops.console.app import Console
from relay.ops.http import Request
from relay.ops.metrics import Metrics
from relay.spool.writer import SpoolWriter
from tests.harness import RelayProcess, free_port, make_message, send

PASSWORDS = {"olga": "operator-pw", "vic": "viewer-pw"}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    work = tmp_path_factory.mktemp("console")
    (work / "users").write_text(
        auth.user_line("olga", "operator", PASSWORDS["olga"])
        + "\n"
        + auth.user_line("vic", "viewer", PASSWORDS["vic"])
        + "\n"
    )
    dead = free_port()  # nothing listens: mail stays queued (deferred)
    r = RelayProcess(
        work,
        {
            "admin": {"users_file": "users"},
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": dead, "tls": "none"},
            },
        },
    )
    r.start()
    try:
        yield r
    finally:
        r.stop()


class Client:
    def __init__(self, port: int) -> None:
        self.port = port
        self.cookie = ""

    def req(
        self, method: str, path: str, form: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, str], str]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Cookie": self.cookie} if self.cookie else {}
        body = None
        if form is not None:
            body = urlencode(form, doseq=True)
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        c.request(method, path, body=body, headers=headers)
        resp = c.getresponse()
        text = resp.read().decode()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        c.close()
        return resp.status, hdrs, text

    def login(self, name: str, password: str) -> int:
        status, hdrs, _ = self.req("POST", "/console/login", {"name": name, "password": password})
        if "set-cookie" in hdrs:
            self.cookie = hdrs["set-cookie"].split(";")[0]
        return status

    def csrf(self) -> str:
        _s, _h, text = self.req("GET", "/console/queue")
        m = re.search(r'name="csrf" value="([^"]+)"', text)
        assert m, text[:500]
        return m.group(1)


def test_login_required_and_wrong_password_slowed_and_counted(relay: RelayProcess) -> None:
    c = Client(relay.admin_port)
    status, hdrs, _ = c.req("GET", "/console/queue")
    assert status == 303 and hdrs["location"] == "/console/login"
    assert c.req("POST", "/console/queue/act", {"action": "hold"})[0] == 403
    before = relay.metric("relay_console_login_failures_total")
    t0 = time.monotonic()
    assert c.login("olga", "not-her-password") == 401
    assert time.monotonic() - t0 >= 0.9  # LOGIN_FAIL_DELAY (1 s), doubling after
    assert c.cookie == ""
    assert relay.metric("relay_console_login_failures_total") == before + 1
    assert any(e.get("event") == "console_login_failed" for e in relay.events())


def test_csrf_roles_and_bulk_count(relay: RelayProcess) -> None:
    for i in range(3):
        send(relay.port, "app@example.com", [f"held{i}@example.org"], make_message(i))
    send(relay.port, "app@example.com", ["other@example.net"], make_message(9))
    op = Client(relay.admin_port)
    assert op.login("olga", PASSWORDS["olga"]) == 303
    token = op.csrf()
    sel = {"action": "hold", "scope": "all", "destination": "example.org"}
    # no token, a wrong one: 403, and nothing held
    assert op.req("POST", "/console/queue/act", sel)[0] == 403
    assert op.req("POST", "/console/queue/act", {**sel, "csrf": token + "x"})[0] == 403
    assert not [m for m in relay.queue() if m["state"] == "held"]
    # the confirmation counts what the action then does, and the CLI agrees
    status, _h, text = op.req("POST", "/console/queue/confirm", {**sel, "csrf": token})
    assert status == 200
    shown = int(re.search(r'id="dry-run-count">(\d+)<', text).group(1))  # type: ignore[union-attr]
    status, _h, text = op.req("POST", "/console/queue/act", {**sel, "csrf": token})
    done = int(re.search(r'id="action-count">(\d+)<', text).group(1))  # type: ignore[union-attr]
    held = [m for m in relay.queue() if m["state"] == "held"]
    assert shown == done == len(held) == 3
    acts = [e for e in relay.events() if e.get("event") == "operator_action"]
    assert acts[-1]["msg"] == "hold" and acts[-1]["user"] == "olga"
    # the overview counts what `relay stats` counts
    _s, _h, text = op.req("GET", "/console/")
    shown_states = {k: int(v) for k, v in re.findall(r'data-state="(\w+)">(\d+)<', text)}
    by_state = relay.cli_json("stats")["recipients"]
    assert shown_states["held"] == 3
    assert shown_states == {k: by_state[k] for k in shown_states}
    # a viewer reads, but cannot act even with its own valid token
    v = Client(relay.admin_port)
    assert v.login("vic", PASSWORDS["vic"]) == 303
    status, _h, text = v.req("GET", "/console/queue?state=held")
    assert status == 200 and held[0]["id"] in text and "queue/confirm" not in text
    vt = re.search(r'name="csrf" value="([^"]+)"', text).group(1)  # type: ignore[union-attr]
    status, _h, text = v.req(
        "POST", "/console/queue/act", {"action": "release", "scope": "all", "csrf": vt}
    )
    assert status == 403 and "only operators act" in text
    assert len([m for m in relay.queue() if m["state"] == "held"]) == 3
    # logout clears the cookie, and the old cookie, replayed, no longer opens a session
    status, hdrs, _ = op.req("POST", "/console/logout", {"csrf": token})
    assert status == 303 and "Max-Age=0" in hdrs["set-cookie"]
    status, hdrs, _ = op.req("GET", "/console/queue")
    assert status == 303 and hdrs["location"] == "/console/login"


def test_pages_escape_and_send_security_headers(relay: RelayProcess) -> None:
    evil = "<script>alert(1)</script>"
    send(
        relay.port,
        "app@example.com",
        ["x@example.org"],
        make_message(50, subject=evil, body=f"{evil}\r\n".encode()),
    )
    qid = next(m["id"] for m in relay.queue() if m["recipients"][0]["address"] == "x@example.org")
    op = Client(relay.admin_port)
    op.login("olga", PASSWORDS["olga"])
    for path in (
        "/console/",
        f"/console/message/{qid}",
        "/console/queue",
        "/console/dead",
        "/console/destinations",
        "/console/suppressions",
        "/console/alerts",
        "/console/feedback",
        "/console/overview.json",
    ):
        status, hdrs, text = op.req("GET", path)
        assert status == 200, path
        assert "script-src 'self'" in hdrs["content-security-policy"]
        assert "<script>alert" not in text, path
    _s, _h, text = op.req("GET", f"/console/message/{qid}")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<h2>Body</h2>" in text
    v = Client(relay.admin_port)
    v.login("vic", PASSWORDS["vic"])
    _s, _h, text = v.req("GET", f"/console/message/{qid}")
    assert "shown to operators only" in text and "<h2>Body</h2>" not in text


# --- access rules without a daemon ------------------------------------------------------------


def _config(tmp_path: Path, admin: dict[str, Any]) -> Any:
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump({"spool": {"path": "spool"}, "admin": admin}))
    return load_config(path)


def test_non_loopback_admin_needs_users(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not loopback: the console there needs"):
        _config(tmp_path, {"listen": "0.0.0.0:9025"})
    assert not _config(tmp_path, {"listen": "0.0.0.0:9025", "console": False}).admin_console
    (tmp_path / "users").write_text(auth.user_line("a", "viewer", "pw") + "\n")
    cfg = _config(tmp_path, {"listen": "0.0.0.0:9025", "users_file": "users"})
    assert cfg.admin_users_file == tmp_path / "users"
    assert _config(tmp_path, {"listen": "[::1]:9025"}).admin_users_file is None
    (tmp_path / "bad").write_text("a:viewer:nope\n")
    with pytest.raises(ConfigError, match=r"admin\.users_file: line 1"):
        _config(tmp_path, {"users_file": "bad"})


def test_without_users_loopback_reads_but_never_acts(tmp_path: Path) -> None:
    async def main() -> None:
        writer = SpoolWriter(tmp_path)
        writer.start()
        try:
            con = Console(writer, Metrics(), lambda: {"status": "ok", "checks": []}, tmp_path)
            r = await con.handle(Request("GET", "/console/queue", "", {}, None, "127.0.0.1"))
            assert r.status == 200 and b"read-only" in r.body and b"queue/confirm" not in r.body
            token = auth.csrf_token(con.key, auth.Session("local", "viewer", "anonymous", 0))
            body = urlencode({"action": "hold", "scope": "all", "csrf": token}).encode()
            r = await con.handle(Request("POST", "/console/queue/act", "", {}, body, "127.0.0.1"))
            assert r.status == 403
            # an operator's cookie signed while a users file was configured (same key)
            # acts no more once it is gone
            old = auth.new_session("olga", "operator", time.time())
            cookie = {"cookie": f"{auth.COOKIE}={auth.sign_session(con.key, old)}"}
            body = urlencode(
                {"action": "hold", "scope": "all", "csrf": auth.csrf_token(con.key, old)}
            ).encode()
            r = await con.handle(
                Request("POST", "/console/queue/act", "", cookie, body, "127.0.0.1")
            )
            assert r.status == 403
        finally:
            writer.close()

    asyncio.run(main())


def test_login_failures_ban_the_address(tmp_path: Path) -> None:
    (tmp_path / "users").write_text(auth.user_line("a", "operator", "right") + "\n")

    async def main() -> None:
        writer = SpoolWriter(tmp_path)
        writer.start()
        try:
            m = Metrics()
            con = Console(
                writer,
                m,
                lambda: {"status": "ok", "checks": []},
                tmp_path,
                tmp_path / "users",
                fail_delay=0.0,
            )

            def login(pw: str, peer: str = "192.0.2.7") -> Request:
                body = urlencode({"name": "a", "password": pw}).encode()
                return Request("POST", "/console/login", "", {}, body, peer)

            for _ in range(10):
                assert (await con.handle(login("wrong"))).status == 401
            # banned: even the right password is not looked at from there
            assert (await con.handle(login("right"))).status == 429
            assert (await con.handle(login("right", "192.0.2.8"))).status == 303
            assert m.registry.get_sample_value("relay_console_login_failures_total") == 10
            assert m.registry.get_sample_value("relay_console_login_bans_total") == 1
        finally:
            writer.close()

    asyncio.run(main())


def test_admin_passwd_command(tmp_path: Path) -> None:
    import subprocess
    import sys

    def run(*args: str, pw: str = "pw1") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "relay", "admin", "passwd", *args],
            input=pw + "\n",
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )

    res = run("alice", "--role", "viewer")
    assert res.returncode == 0 and "pw1" not in res.stdout
    users = auth.parse_users(res.stdout)
    assert users["alice"].role == "viewer"
    assert run("bob", "--role", "operator", "--file", "u").returncode == 0
    assert run("bob", "--role", "viewer", "--file", "u").returncode == 1  # already there
    assert run("carol", "--role", "operator", "--file", "u", pw="pw3").returncode == 0
    users = auth.load_users(tmp_path / "u")
    assert auth.check_login(users, "carol", "pw3") is not None
    assert (tmp_path / "u").stat().st_mode & 0o077 == 0
    assert run("x:y", "--role", "viewer").returncode == 2


@pytest.fixture(params=["sqlite", "postgresql"])
def writer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpoolWriter]:
    from tests.pgserver import backend_writer

    w = backend_writer(request, tmp_path / "spool")
    assert isinstance(w, SpoolWriter)
    w.start()
    try:
        yield w
    finally:
        w.close()


def test_rollup_and_every_page_on_both_backends(writer: SpoolWriter, tmp_path: Path) -> None:
    """The minute written from the counters, and every page's queries, on SQLite and on
    PostgreSQL (a message with a bounced recipient and a deferred one)."""
    from relay.ops.console import rollup
    from relay.spool import ops

    async def main() -> None:
        m = Metrics()
        (tmp_path / "users").write_text(auth.user_line("o", "operator", "pw") + "\n")
        con = Console(
            writer, m, lambda: {"status": "ok", "checks": []}, tmp_path, tmp_path / "users"
        )
        con.start()
        try:
            m.accepted.labels("transactional").inc(4)
            m.delivered.labels("smarthost").inc(3)
            now = time.time()
            row = await con.rollup_once(now)
            assert row.counts["accepted"] == 4 and row.minute == int(now // 60) - 1
            series = await writer.read(lambda c: rollup.read_series(c, 0))
            assert [(r["minute"], r["accepted"], r["delivered"]) for r in series] == [
                (row.minute, 4, 3)
            ]
            assert (await con.rollup_once(now + 60)).counts["accepted"] == 0  # a delta

            msg = ops.NewMessage(
                queue_id="Q1",
                message_id="m1@x",
                sender="a@example.com",
                size=20,
                created_at=now,
                client="c",
                peer="127.0.0.1",
                lane="transactional",
                lane_prio=0,
                identity="example.com",
                body=b"Subject: <hi>\r\n\r\nbody",
                body_path=None,
                recipients=(
                    ops.NewRecipient("b@example.org", "example.org", "k1"),
                    ops.NewRecipient("c@example.org", "example.org", "k2"),
                ),
            )
            await writer.run(lambda c: ops.accept(c, msg, 0))
            await writer.run(
                lambda c: c.execute(
                    "UPDATE recipients SET state = 'bounced', last_reply = '550 no'"
                    " WHERE address = 'b@example.org'"
                )
            )
            await writer.run(
                lambda c: c.execute(
                    "UPDATE recipients SET state = 'sending', hold_after = 1"
                    " WHERE address = 'c@example.org'"
                )
            )
            login = urlencode({"name": "o", "password": "pw"}).encode()
            r = await con.handle(Request("POST", "/console/login", "", {}, login, "127.0.0.1"))
            cookie = {"cookie": r.headers["Set-Cookie"].split(";")[0]}
            for path, query in [
                ("/console/", ""),
                ("/console/overview.json", ""),
                ("/console/queue", "recipient=c@example.org"),
                ("/console/queue", "sender=a@example.com&state=deferred"),
                ("/console/message/Q1", ""),
                ("/console/dead", ""),
                ("/console/destinations", ""),
                ("/console/suppressions", ""),
                ("/console/alerts", ""),
                ("/console/feedback", ""),
            ]:
                r = await con.handle(Request("GET", path, query, cookie, None, "127.0.0.1"))
                assert r.status == 200, (path, r.body[:300])
                if path == "/console/message/Q1":
                    assert b"Subject: &lt;hi&gt;" in r.body
                    # c: held during its attempt (relay/spool/model.py)
                    assert b"sending, held after this attempt" in r.body
            r = await con.handle(Request("GET", "/console/dead", "", cookie, None, "127.0.0.1"))
            assert b"b@example.org" in r.body and b"c@example.org" not in r.body
            # the suppression search: a literal substring (_ and % are not wildcards)
            for a in ("a_b@x.org", "axb@x.org", "100%@x.org"):
                await writer.run(lambda c, a=a: ops.suppression_add(c, a, "r", now))
            for needle, want, not_want in (
                ("a_b", b"a_b@x.org", b"axb@x.org"),
                ("0%", b"100%@x.org", b"a_b@x.org"),
            ):
                r = await con.handle(
                    Request("GET", "/console/suppressions", f"q={needle}", cookie, None, "l")
                )
                assert want in r.body and not_want not in r.body, needle
                assert b"1 of 3 entries" in r.body
        finally:
            await con.stop()

    asyncio.run(main())


def test_too_many_fields_is_a_bad_request(relay: RelayProcess) -> None:
    c = Client(relay.admin_port)
    status, _h, text = c.req("GET", "/console/login?" + "&".join(f"a{i}=1" for i in range(300)))
    assert status == 200  # the login page reads no query
    c.login("olga", PASSWORDS["olga"])
    status, _h, text = c.req("GET", "/console/queue?" + "&".join(f"a{i}=1" for i in range(300)))
    assert status == 400 and "more than 100 form fields" in text


def test_a_hold_says_which_recipients_are_held_only_when_their_attempt_ends() -> None:
    """The console's banners say what the CLI says of recipients in their attempt (the
    spool marks them: relay/spool/model.py), apart from the recipients changed."""
    from relay.ops.console.app import _in_attempt

    assert _in_attempt("hold", 2, dry=True) == (
        '; <span id="after-attempt">2</span> recipients in an attempt now would be held'
        " when it ends, unless it delivers"
    )
    assert _in_attempt("hold", 1, dry=False).endswith(
        "1</span> recipient in an attempt now will be held when it ends, unless it delivers"
    )
    assert _in_attempt("release", 1, dry=False).endswith("will no longer be held")
    assert _in_attempt("hold", 0, dry=False) == _in_attempt("delete", 3, dry=False) == ""
