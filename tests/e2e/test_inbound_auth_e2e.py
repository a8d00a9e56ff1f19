"""Inbound STARTTLS and AUTH for submitting applications, end to end against the daemon as a
real subprocess (uvloop when installed, as `relay serve` runs) with trustme certificates:
STARTTLS advertised and working, AUTH only after it, PLAIN and LOGIN from outside every
`allow` network, 535 then 554 5.7.1 for a wrong password, 421 and close after three, 530
before STARTTLS with `require_tls`, the dedup namespace per user, the users file reloaded on
SIGHUP, a bad certificate path exits 78, `relay auth hash`, and no password in any log line.
Plus pure tests of the hash functions, the users file and the config keys."""

from __future__ import annotations

import base64
import signal
import smtplib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import trustme

from relay.config.tree import ConfigError, from_mapping
from relay.inbound import auth
from tests.harness import ROOT, RelayProcess, Upstream, make_message

SENDER = "app@example.com"
RCPT = "user@example.org"
PASSWORDS = {
    "alice": "correct horse battery staple",
    "bob": "Tr0ub4dor&3-bob",
    "carol": "carol-s3cret-pw",
}
WRONG = "wrong-password-123"

try:
    import uvloop  # noqa: F401

    DEFAULT_LOOP = "uvloop"
except ImportError:  # pragma: no cover - uvloop is a dependency
    DEFAULT_LOOP = "asyncio"


# --- helpers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def hashes() -> dict[str, str]:
    return {u: auth.hash_password(pw) for u, pw in PASSWORDS.items()}


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def users_text(hashes: dict[str, str], names: tuple[str, ...]) -> str:
    return "# relay users\n\n" + "".join(f"{n}:{hashes[n]}\n" for n in names)


def make_relay(
    relay: Callable[..., RelayProcess],
    up: Upstream,
    ca: trustme.CA,
    hashes: dict[str, str],
    *,
    users: tuple[str, ...] = ("alice", "bob"),
    allow: list[str] | None = None,
    tls: bool = True,
    require_tls: bool = False,
    with_auth: bool = True,
    allow_plaintext: bool = False,
    config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    start: bool = True,
) -> RelayProcess:
    """A daemon whose one listener has the certificate and users file in its own folder,
    named by relative paths (relative to the config file)."""
    r = relay(upstream=up, config=config, env=env, start=False)
    lst: dict[str, Any] = r.config["listen"][0]
    lst["allow"] = [] if allow is None else allow  # [] = 127.0.0.1 is "outside"
    if tls:
        cert = ca.issue_cert("127.0.0.1", "localhost")
        cert.cert_chain_pems[0].write_to_path(str(r.workdir / "cert.pem"))
        cert.private_key_pem.write_to_path(str(r.workdir / "key.pem"))
        lst["tls"] = {"cert_file": "cert.pem", "key_file": "key.pem"}
    if require_tls:
        lst["require_tls"] = True
    if with_auth:
        (r.workdir / "users").write_text(users_text(hashes, users))
        lst["auth"] = {"users_file": "users"}
        if allow_plaintext:
            lst["auth"]["allow_plaintext"] = True
    r.write_config()
    if start:
        r.start()
    return r


@contextmanager
def session(r: RelayProcess, ca: trustme.CA | None = None) -> Iterator[smtplib.SMTP]:
    """EHLO, and STARTTLS + EHLO again when a CA is given."""
    s = smtplib.SMTP("127.0.0.1", r.port, timeout=30)
    try:
        s.ehlo("client.test")
        if ca is not None:
            s.starttls(context=client_context(ca))
            s.ehlo("client.test")
        yield s
    finally:
        with suppress(Exception):
            s.quit()
        s.close()


def auth_plain(s: smtplib.SMTP, user: str, password: str) -> tuple[int, bytes]:
    blob = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
    return s.docmd("AUTH", f"PLAIN {blob}")


def login(s: smtplib.SMTP, mechanism: str, initial: bool, user: str, password: str) -> None:
    """smtplib's own AUTH, with or without the initial response."""
    s.user, s.password = user, password
    fn = s.auth_plain if mechanism == "PLAIN" else s.auth_login
    s.auth(mechanism, fn, initial_response_ok=initial)


def submit(s: smtplib.SMTP, data: bytes, rcpts: list[str] | None = None) -> tuple[int, bytes]:
    """MAIL, RCPT(s), DATA; returns the reply to the final dot."""
    code, msg = s.mail(SENDER)
    assert code == 250, msg
    for rcpt in rcpts or [RCPT]:
        code, msg = s.rcpt(rcpt)
        assert code == 250, msg
    return s.data(data)


def secret_forms() -> list[str]:
    """Every password, and how it travels on the wire (base64 of PLAIN and LOGIN)."""
    out = []
    for user, pw in [*PASSWORDS.items(), ("alice", WRONG)]:
        out += [
            pw,
            base64.b64encode(pw.encode()).decode(),
            base64.b64encode(f"\0{user}\0{pw}".encode()).decode(),
        ]
    return out


def assert_no_secrets(r: RelayProcess, hashes: dict[str, str]) -> None:
    text = r.logs()
    for secret in [*secret_forms(), *hashes.values()]:
        assert secret not in text, "a password (or its hash) reached the daemon log"


def events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


# --- end to end -------------------------------------------------------------------------


@pytest.mark.slow
def test_starttls_advertised_and_auth_only_after_it(upstream, relay, ca, hashes) -> None:
    up = upstream()
    r = make_relay(relay, up, ca, hashes)
    startup = [e for e in events(r, "startup") if e.get("msg") == "relay is ready"]
    assert startup[0]["loop"] == DEFAULT_LOOP  # STARTTLS below runs under the spawned loop
    with session(r) as s:
        assert s.has_extn("starttls")
        assert not s.has_extn("auth"), "AUTH must not be offered in the clear"
        code, msg = auth_plain(s, "alice", PASSWORDS["alice"])
        assert code == 538, msg  # encryption required
        # not allowed, not authenticated: never an open relay
        assert s.mail(SENDER)[0] == 250
        code, msg = s.rcpt(RCPT)
        assert code == 554 and b"5.7.1" in msg
    with session(r, ca) as s:
        assert s.sock is not None
        assert isinstance(s.sock, ssl.SSLSocket) and s.sock.version() in ("TLSv1.2", "TLSv1.3")
        assert not s.has_extn("starttls")
        assert set(s.esmtp_features["auth"].split()) == {"PLAIN", "LOGIN"}
        # over TLS but still not authenticated: refused too
        assert s.mail(SENDER)[0] == 250
        code, msg = s.rcpt(RCPT)
        assert code == 554 and b"5.7.1" in msg
    # a client that fails the handshake: a WARNING, the connection closed, the daemon fine
    with socket.create_connection(("127.0.0.1", r.port), timeout=10) as raw:
        f = raw.makefile("rb")
        assert f.readline().startswith(b"220 ")
        raw.sendall(b"EHLO client.test\r\nSTARTTLS\r\n")
        while not (line := f.readline()).startswith(b"250 "):
            assert line.startswith(b"250-")
        assert f.readline().startswith(b"220 ")
        raw.sendall(b"this is not a TLS ClientHello\r\n" * 4)
        assert f.read() == b""  # closed by the server
        f.close()
    r.wait_until(lambda: bool(events(r, "tls_failed")), what="tls_failed")
    assert events(r, "tls_failed")[0]["level"] == "warning"
    with session(r, ca) as s:
        assert s.has_extn("auth")
    assert r.stop() == 0
    assert not [e for e in r.events() if e["level"] == "error"]
    assert_no_secrets(r, hashes)
    shown = r.cli("check-config", "--json", check=True).stdout
    assert "users" in shown and "cert.pem" in shown
    assert not any(h in shown or h.split("$")[2] in shown for h in hashes.values())


@pytest.mark.slow
@pytest.mark.parametrize("loop", [DEFAULT_LOOP, "asyncio"])
def test_auth_plain_and_login_relay_from_outside_allow(
    upstream, relay, ca, hashes, loop: str
) -> None:
    up = upstream()
    env = {"RELAY_EVENT_LOOP": "asyncio"} if loop == "asyncio" else None
    r = make_relay(relay, up, ca, hashes, env=env)
    assert [e["loop"] for e in events(r, "startup") if "loop" in e] == [loop]
    big = b"x" * 998 + b"\r\n"
    ways = [("PLAIN", True), ("PLAIN", False), ("LOGIN", True), ("LOGIN", False)]
    for i, (mech, initial) in enumerate(ways):
        with session(r, ca) as s:
            login(s, mech, initial, "alice", PASSWORDS["alice"])
            # the last one is large (a body file, many TLS records both ways)
            body = big * 2100 if i == len(ways) - 1 else None
            code, msg = submit(s, make_message(i, body=body))
            assert code == 250, msg
    got = up.wait_for(len(ways))
    assert sorted(m.rcpt_tos[0] for m in got) == [RCPT] * len(ways)
    assert max(len(m.data) for m in got) > 2_000_000
    assert all(b"(relay) with ESMTPSA id" in m.data for m in got)  # RFC 3848
    ok = events(r, "auth_ok")
    assert len(ok) == len(ways)
    assert {e["user"] for e in ok} == {"a***"}
    assert {e["mechanism"] for e in ok} == {"PLAIN", "LOGIN"}
    assert all(e["level"] == "info" and e["tls"] is True for e in ok)
    assert {e["client"] for e in events(r, "accepted")} == {"user:alice"}
    assert r.stop() == 0
    assert_no_secrets(r, hashes)


@pytest.mark.slow
def test_wrong_password_535_then_554_and_421_after_three(upstream, relay, ca, hashes) -> None:
    up = upstream()
    r = make_relay(relay, up, ca, hashes)
    with session(r, ca) as s:
        with pytest.raises(smtplib.SMTPAuthenticationError) as exc:
            login(s, "PLAIN", True, "alice", WRONG)
        assert exc.value.smtp_code == 535 and b"5.7.8" in exc.value.smtp_error
        assert s.mail(SENDER)[0] == 250
        code, msg = s.rcpt(RCPT)
        assert code == 554 and b"5.7.1" in msg
        assert s.rset()[0] == 250
        # LOGIN with challenges, wrong user this time: the same answer (no user enumeration)
        assert s.docmd("AUTH", "LOGIN")[0] == 334
        assert s.docmd(base64.b64encode(b"mallory").decode())[0] == 334
        code, msg = s.docmd(base64.b64encode(WRONG.encode()).decode())
        assert (code, msg[:5]) == (535, b"5.7.8")
        code, msg = auth_plain(s, "alice", WRONG)  # the third on this connection
        assert code == 421 and msg.startswith(b"4.7.0 too many authentication failures")
        with pytest.raises(smtplib.SMTPServerDisconnected):
            s.noop()
    # a new connection may try again, and the right password works
    with session(r, ca) as s:
        assert auth_plain(s, "alice", PASSWORDS["alice"])[0] == 235
        assert submit(s, make_message(1))[0] == 250
    up.wait_for(1)
    failed = events(r, "auth_failed")
    assert [e["failures"] for e in failed] == [1, 2, 3]
    assert all(e["level"] == "warning" for e in failed)
    assert [e["user"] for e in failed] == ["a***", "m***", "a***"]
    assert r.stop() == 0
    assert_no_secrets(r, hashes)


@pytest.mark.slow
def test_require_tls_530_before_starttls_and_allowed_network_needs_no_auth(
    upstream, relay, ca, hashes
) -> None:
    up = upstream()
    # loopback allowed, TLS required, no AUTH configured on this listener
    r = make_relay(relay, up, ca, hashes, allow=["127.0.0.0/8"], require_tls=True, with_auth=False)
    with session(r) as s:
        assert s.has_extn("starttls")
        code, msg = s.mail(SENDER)
        assert code == 530 and msg == b"5.7.0 Must issue a STARTTLS command first"
        assert s.noop()[0] == 250
    with session(r, ca) as s:
        assert not s.has_extn("auth")  # no users file: nothing to offer
        code, msg = s.docmd("AUTH", "PLAIN " + base64.b64encode(b"\0a\0b").decode())
        assert code == 502, msg
        assert submit(s, make_message(1))[0] == 250  # allow-listed: no AUTH needed
    got = up.wait_for(1)
    assert got[0].rcpt_tos == [RCPT] and b"(relay) with ESMTPS id" in got[0].data
    assert r.stop() == 0


@pytest.mark.slow
def test_dedup_namespace_is_the_user(upstream, relay, ca, hashes) -> None:
    up = upstream()
    r = make_relay(relay, up, ca, hashes)
    data = make_message(7, message_id="<same-id@app.example.com>")
    replies = []
    for user in ("alice", "bob", "alice"):
        with session(r, ca) as s:
            assert auth_plain(s, user, PASSWORDS[user])[0] == 235
            replies.append(submit(s, data))
    assert [c for c, _ in replies] == [250, 250, 250]
    assert b"duplicate suppressed" in replies[2][1]
    assert b"queued as" in replies[0][1] and b"queued as" in replies[1][1]
    up.wait_for(2)
    r.wait_until(
        lambda: [x["state"] for m in r.queue() for x in m["recipients"]] == ["delivered"] * 2,
        what="two messages delivered",
    )
    assert len(up.received) == 2
    dup = events(r, "deduplicated")
    assert len(dup) == 1 and dup[0]["client"] == "user:alice"
    assert sorted(e["client"] for e in events(r, "accepted")) == ["user:alice", "user:bob"]
    assert r.stop() == 0


@pytest.mark.slow
def test_users_file_reloaded_on_sighup(upstream, relay, ca, hashes) -> None:
    up = upstream()
    r = make_relay(relay, up, ca, hashes, users=("alice",))
    with session(r, ca) as s:
        assert auth_plain(s, "carol", PASSWORDS["carol"])[0] == 535
    # the operator makes carol's line with `relay auth hash` and adds it
    res = subprocess.run(
        [sys.executable, "-m", "relay", "auth", "hash", "--user", "carol"],
        input=PASSWORDS["carol"] + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        check=True,
    )
    users = r.workdir / "users"
    users.write_text(users.read_text() + res.stdout)

    def reloads() -> int:
        return sum(
            1 for e in events(r, "config_reloaded") if e.get("msg") == "configuration reloaded"
        )

    r.signal(signal.SIGHUP)
    r.wait_until(lambda: reloads() == 1, what="config_reloaded")
    with session(r, ca) as s:
        assert auth_plain(s, "carol", PASSWORDS["carol"])[0] == 235
        assert submit(s, make_message(1))[0] == 250
    up.wait_for(1)
    # a broken users file on reload is rejected, naming the key; the old users stay
    users.write_text(users.read_text() + "dave:plaintext-password-here\n")
    r.signal(signal.SIGHUP)
    r.wait_until(lambda: bool(events(r, "config_rejected")), what="config_rejected")
    err = events(r, "config_rejected")[0]["error"]
    assert err.startswith("listen[0].auth.users_file: line 5:")
    assert "plaintext-password-here" not in r.logs()
    with session(r, ca) as s:
        assert auth_plain(s, "carol", PASSWORDS["carol"])[0] == 235
    # the user removed from the file can no longer log in after the next HUP
    users.write_text(users_text(hashes, ("alice",)))
    r.signal(signal.SIGHUP)
    r.wait_until(lambda: reloads() == 2, what="second config_reloaded")
    with session(r, ca) as s:
        assert auth_plain(s, "carol", PASSWORDS["carol"])[0] == 535
        assert auth_plain(s, "alice", PASSWORDS["alice"])[0] == 235
    assert r.stop() == 0
    assert_no_secrets(r, hashes)


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["cert_file", "key_file", "users_file"])
def test_bad_tls_or_users_file_exits_78_naming_the_key(
    upstream, relay, ca, hashes, bad: str
) -> None:
    up = upstream()
    r = make_relay(relay, up, ca, hashes, start=False)
    lst = r.config["listen"][0]
    if bad == "users_file":
        lst["auth"]["users_file"] = "missing-users"
        key = "listen[0].auth.users_file"
    else:
        lst["tls"][bad] = "missing.pem"
        key = f"listen[0].tls.{bad}"
    r.write_config()
    r.start(wait=False)
    assert r.proc is not None
    assert r.proc.wait(30) == 78
    assert key in r.logs()
    res = r.cli("check-config")
    assert res.returncode == 78 and key in res.stderr


@pytest.mark.slow
def test_plaintext_auth_only_when_allowed_and_never_logged(upstream, relay, ca, hashes) -> None:
    up = upstream()
    # the most talkative logging there is: debug, unmasked (aiosmtpd logs command lines)
    r = make_relay(
        relay,
        up,
        ca,
        hashes,
        tls=False,
        allow_plaintext=True,
        config={"log": {"level": "debug", "unmask": True}},
    )
    with session(r) as s:
        assert not s.has_extn("starttls")
        assert set(s.esmtp_features["auth"].split()) == {"PLAIN", "LOGIN"}
        assert auth_plain(s, "alice", WRONG)[0] == 535
        login(s, "LOGIN", False, "alice", PASSWORDS["alice"])
        assert submit(s, make_message(1))[0] == 250
    with session(r) as s:
        login(s, "LOGIN", True, "bob", PASSWORDS["bob"])
        assert submit(s, make_message(2))[0] == 250
    assert all(b"(relay) with ESMTPA id" in m.data for m in up.wait_for(2))
    assert {e["user"] for e in events(r, "auth_ok")} == {"alice", "bob"}  # unmask: true
    assert r.stop() == 0
    assert_no_secrets(r, hashes)


def test_auth_hash_cli_output_verifies() -> None:
    pw = "p@ss word with spaces and ünïcode"
    res = subprocess.run(
        [sys.executable, "-m", "relay", "auth", "hash"],
        input=pw + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("scrypt$") and "\n" not in line
    assert pw not in res.stdout + res.stderr
    assert auth.verify_password(pw, line)
    assert not auth.verify_password(pw + "x", line)
    assert auth.parse_users(f"alice:{line}\n") == {"alice": line}
    empty = subprocess.run(
        [sys.executable, "-m", "relay", "auth", "hash"],
        input="\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert empty.returncode == 1 and "empty password" in empty.stderr


# --- pure -------------------------------------------------------------------------------


def test_hash_and_verify() -> None:
    h = auth.hash_password("s3cret")
    prefix, salt, digest = h.split("$")
    assert prefix == "scrypt"
    assert len(base64.b64decode(salt)) == auth.SALT_BYTES
    assert len(base64.b64decode(digest)) == auth.HASH_BYTES
    assert auth.verify_password("s3cret", h)
    assert auth.verify_password(b"s3cret", h)
    assert not auth.verify_password("s3cret ", h)
    assert not auth.verify_password("", h)
    assert auth.hash_password("s3cret") != h  # a new salt every time
    fixed = auth.hash_password("pw", salt=b"0123456789abcdef")
    assert fixed == auth.hash_password("pw", salt=b"0123456789abcdef")
    # the documented parameters, recomputed independently
    import hashlib

    want = hashlib.scrypt(b"pw", salt=b"0123456789abcdef", n=2**14, r=8, p=1, dklen=32)
    assert fixed.split("$")[2] == base64.b64encode(want).decode()


@pytest.mark.parametrize(
    "stored",
    [
        None,
        "",
        "scrypt",
        "scrypt$$",
        "bcrypt$AAAA$AAAA",
        "scrypt$!!!!$AAAA",
        "scrypt$AAAA$AAAA",  # digest too short
        "plaintext-password",
    ],
)
def test_verify_malformed_or_missing_is_false(stored: str | None) -> None:
    assert not auth.verify_password("plaintext-password", stored)


def test_verify_costs_the_same_for_unknown_users() -> None:
    users = {"alice": auth.hash_password("pw")}
    t0 = time.perf_counter()
    assert auth.check(users, b"nobody", b"pw") is None
    t_unknown = time.perf_counter() - t0
    assert t_unknown > 0.005  # a real scrypt ran
    assert auth.check(users, b"alice", b"pw") == "alice"
    assert auth.check(users, b"alice", b"nope") is None
    assert auth.check(users, b"\xff\xfe", b"pw") is None  # not UTF-8


def test_parse_users() -> None:
    h = auth.hash_password("x")
    text = f"# comment\n\n  alice:{h}  \nmail:user@example.com:{h}\n"
    assert auth.parse_users(text) == {"alice": h, "mail:user@example.com": h}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("bob:hunter2\n", 1),
        ("# c\n:scrypt$AAAA$" + "A" * 44 + "\n", 2),
        ("nocolon\n", 1),
        ("a:scrypt$AAAA$" + "A" * 44 + "\na:scrypt$AAAA$" + "A" * 44 + "\n", 2),
    ],
)
def test_parse_users_errors_name_the_line_not_its_contents(text: str, line: int) -> None:
    with pytest.raises(auth.UsersFileError) as exc:
        auth.parse_users(text)
    assert str(exc.value).startswith(f"line {line}:")
    assert "hunter2" not in str(exc.value) and "nocolon" not in str(exc.value)


def test_mask_user() -> None:
    assert auth.mask_user("alice") == "a***"
    assert auth.mask_user("app@Example.COM") == "a***@example.com"
    assert auth.mask_user("") == "***"


def _listener_conf(tmp_path: Path, **listener: Any) -> Any:
    return from_mapping(
        {"listen": [{"address": "127.0.0.1:2525", **listener}], "spool": {"path": "spool"}},
        tmp_path,
    )


def test_config_keys(tmp_path: Path, ca: trustme.CA) -> None:
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    (tmp_path / "users").write_text(f"alice:{auth.hash_password('pw')}\n")
    tls = {"cert_file": "cert.pem", "key_file": "key.pem"}
    cfg = _listener_conf(tmp_path, tls=tls, require_tls=True, auth={"users_file": "users"})
    lst = cfg.listen[0]
    assert lst.tls is not None and lst.tls.cert_file == tmp_path / "cert.pem"
    assert lst.require_tls and lst.auth is not None and not lst.auth.allow_plaintext
    assert set(lst.auth.users) == {"alice"}
    assert "scrypt" not in repr(cfg)
    plain = _listener_conf(tmp_path)  # defaults: nothing of this
    assert plain.listen[0].tls is None and plain.listen[0].auth is None
    assert not plain.listen[0].require_tls
    cases = [
        ({"require_tls": True}, "listen[0].require_tls: needs listen[0].tls"),
        ({"auth": {"users_file": "users"}}, "listen[0].auth: AUTH is only offered over TLS"),
        ({"tls": {"cert_file": "key.pem", "key_file": "key.pem"}}, "listen[0].tls.cert_file: "),
        ({"tls": {"cert_file": "cert.pem", "key_file": "cert.pem"}}, "listen[0].tls.key_file: "),
        ({"tls": {"cert_file": "cert.pem"}}, "listen[0].tls.key_file: required"),
        ({"tls": {**tls, "ca_file": "x"}}, "listen[0].tls.ca_file: unknown key"),
        (
            {"auth": {"users_file": "users", "allow_plaintext": "yes"}},
            "listen[0].auth.allow_plaintext: expected true or false",
        ),
    ]
    for listener, message in cases:
        with pytest.raises(ConfigError) as exc:
            _listener_conf(tmp_path, **listener)
        assert str(exc.value).startswith(message), str(exc.value)
    ok = _listener_conf(tmp_path, auth={"users_file": "users", "allow_plaintext": True})
    assert ok.listen[0].auth is not None and ok.listen[0].auth.allow_plaintext
