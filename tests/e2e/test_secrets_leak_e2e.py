"""Secrets never printed (issue 26 item 6): a secret is planted in every secret-bearing key
of the config (webhook URL with userinfo, path and query token; smarthost and route
passwords; OAuth client secret and refresh token and a token_url with a key; DKIM and TLS
private keys; the PostgreSQL DSN's password and password_file; the alert signing secret;
the feedback tokens, Mailgun signing key and VERP secret; an unsubscribe secret), each file
named through `${CREDENTIALS_DIRECTORY}` as the systemd unit does. The daemon then runs a
real day: a smarthost that refuses connections (its circuit opens: an alert), an alert to a
webhook that is down, then answers 500, then 200; a route that authenticates with its
password; an OAuth token endpoint that is down. Every output surface is then searched for
every secret: the daemon's log, `relay check-config` (text and --json), `relay status`,
/health, /healthz, /metrics, the alert payloads, and the errors of bad configs."""

from __future__ import annotations

import http.client
import secrets as pysecrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from relay.authenticity.dkim import keygen
from tests.harness import RelayProcess, Upstream, free_port, make_message, send
from tests.webhook import Receiver

CRED = "${CREDENTIALS_DIRECTORY}"


def _secret(name: str) -> str:
    return f"{name}S3cr3t{pysecrets.token_hex(8)}"


def _pem_body_lines(pem: str) -> list[str]:
    """The base64 lines of a PEM private key: any one of them printed is a leak."""
    return [ln for ln in pem.splitlines() if ln and not ln.startswith("-----")]


def _get(port: int, path: str) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    text = c.getresponse().read().decode(errors="replace")
    c.close()
    return text


def _leaks(surface: str, secrets: dict[str, str]) -> list[str]:
    return [name for name, value in secrets.items() if value in surface]


@pytest.fixture
def planted(tmp_path: Path, pg_dsn: str) -> tuple[dict[str, str], Path, str]:
    """The secrets (name -> value), the credentials folder holding them, and the DSN."""
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    s = {
        name: _secret(name)
        for name in (
            "smarthost_pw",
            "route_pw",
            "oauth_client_secret",
            "oauth_refresh",
            "oauth_url_key",
            "webhook_path",
            "webhook_token",
            "webhook_userpw",
            "webhook_signing",
            "pg_url_pw",
            "pg_file_pw",
            "verp",
            "postmark_token",
            "mailgun_token",
            "mailgun_signing",
            "unsubscribe",
        )
    }
    files = {
        "smarthost.pass": s["smarthost_pw"],
        "route.pass": s["route_pw"],
        "oauth.secret": s["oauth_client_secret"],
        "oauth.refresh": s["oauth_refresh"],
        "webhook.secret": s["webhook_signing"],
        "pg.pass": s["pg_file_pw"],
        "verp.secret": s["verp"],
        "postmark.token": s["postmark_token"],
        "mailgun.token": s["mailgun_token"],
        "mailgun.signing": s["mailgun_signing"],
        "unsubscribe.key": s["unsubscribe"],
    }
    for name, value in files.items():
        (creds / name).write_text(value + "\n")
    keygen("example.com", "s1", creds / "dkim.key")
    for i, line in enumerate(_pem_body_lines((creds / "dkim.key").read_text())):
        s[f"dkim_key_line{i}"] = line
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(creds / "tls.crt"))
    cert.private_key_pem.write_to_path(str(creds / "tls.key"))
    for i, line in enumerate(_pem_body_lines((creds / "tls.key").read_text())):
        s[f"tls_key_line{i}"] = line
    # trust auth on the test server: the password is carried, never checked
    dsn = pg_dsn.replace("postgresql://root@", f"postgresql://root:{s['pg_url_pw']}@", 1)
    assert s["pg_url_pw"] in dsn
    return s, creds, dsn


def _config(
    s: dict[str, str], dsn: str, up: Upstream, hook: Receiver, closed: int
) -> dict[str, Any]:
    return {
        "hostname": "relayhost",  # no dot: the hostname warning (issue 26 item 8) at start
        "listen": [
            {
                "address": "127.0.0.1:{port}",
                "allow": ["127.0.0.0/8"],
                "tls": {"cert_file": f"{CRED}/tls.crt", "key_file": f"{CRED}/tls.key"},
            }
        ],
        "spool": {
            "path": "spool",
            "backend": "postgresql",
            "dsn": dsn,
            "password_file": f"{CRED}/pg.pass",
        },
        "upstream": {
            "mode": "smarthost",
            "smarthost": {
                "host": "127.0.0.1",
                "port": closed,  # nothing listens: connection refused, the circuit opens
                "tls": "none",
                "username": "app",
                "password_file": f"{CRED}/smarthost.pass",
            },
        },
        "upstreams": {
            "authed": {
                "host": "127.0.0.1",
                "port": up.port,
                "tls": "none",
                "username": "app",
                "password_file": f"{CRED}/route.pass",
            },
            "oauthed": {
                "host": "127.0.0.1",
                "port": up.port,
                "tls": "none",
                "username": "app",
                "auth": "xoauth2",
                "oauth": {
                    # nothing listens: the token request fails, and says so
                    "token_url": f"http://127.0.0.1:{closed}/token?key={s['oauth_url_key']}",
                    "client_id": "relay",
                    "client_secret_file": f"{CRED}/oauth.secret",
                    "refresh_token_file": f"{CRED}/oauth.refresh",
                },
            },
        },
        "routes": [
            {"recipient_domain": "authed.example", "via": ["authed"]},
            {"recipient_domain": "oauth.example", "via": ["oauthed"]},
            {"via": ["smarthost"]},
        ],
        "destinations": {
            "*": {"circuit_failures": 1, "connect_timeout": "1s", "command_timeout": "2s"}
        },
        "retry": {"schedule": ["1s"], "max_age": "1h", "min_delay": "0.2s"},
        "alerts": {
            "webhook": {
                "url": f"http://hook:{s['webhook_userpw']}@127.0.0.1:{hook.port}"
                f"/hook/{s['webhook_path']}?token={s['webhook_token']}",
                "secret_file": f"{CRED}/webhook.secret",
                "timeout": "2s",
            }
        },
        "feedback": {
            "address": "bounces@relay.example.com",
            "verp": True,
            "verp_secret_file": f"{CRED}/verp.secret",
            "providers": {
                "postmark": {"token_file": f"{CRED}/postmark.token"},
                "mailgun": {
                    "token_file": f"{CRED}/mailgun.token",
                    "signing_key_file": f"{CRED}/mailgun.signing",
                },
            },
        },
        "identities": {
            "example.com": {
                "unsubscribe": {
                    "url": "https://relay.example.com/u",
                    "secret_file": f"{CRED}/unsubscribe.key",
                }
            }
        },
        "dkim": {"example.com": {"selector": "s1", "key_file": f"{CRED}/dkim.key"}},
    }


def test_no_secret_on_any_output_surface(
    tmp_path: Path,
    planted: tuple[dict[str, str], Path, str],
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    s, creds, dsn = planted
    up = upstream(auth={"app": s["route_pw"]})
    hook = Receiver(status=500)  # not started yet: the webhook is down at first
    closed = free_port()
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    r = relay(_config(s, dsn, up, hook, closed), env=env)
    try:
        _run_the_day(r, up, hook)
        surfaces = _surfaces(r, hook)
    finally:
        hook.stop()
    # the secrets were in use, so a clean output means hidden, not absent
    # (the upstream requires AUTH with route_pw: it received the message, so it was used)
    assert up.auth == {"app": s["route_pw"]} and len(up.received) == 1
    assert any(p.signed_by(s["webhook_signing"].encode()) for p in hook.posts)
    got = up.received[0]
    assert b"DKIM-Signature:" in got.data and b"s=s1" in got.data
    leaks = {name: _leaks(text, s) for name, text in surfaces.items()}
    assert {k: v for k, v in leaks.items() if v} == {}


def _run_the_day(r: RelayProcess, up: Upstream, hook: Receiver) -> None:
    # a route that authenticates with its password, a DKIM signature on the way
    send(r.port, "app@example.com", ["user@authed.example"], make_message(1))
    up.wait_for(1)
    # the OAuth token endpoint is down: the attempt fails and says why
    send(r.port, "app@example.com", ["user@oauth.example"], make_message(2))
    # the smarthost refuses connections: deferred, the circuit opens, an alert goes out to a
    # webhook that is down, then answers 500, then 200
    send(r.port, "app@example.com", ["user@down.example"], make_message(3))
    r.wait_until(
        lambda: any(e.get("event") == "alert_failed" for e in r.events()),
        what="an alert refused by the webhook that is down",
    )
    hook.start()
    r.wait_until(lambda: bool(hook.posts), what="an alert post answered 500")
    hook.status = 200
    hook.wait(lambda ok: bool(ok), what="an alert post answered 200")
    r.wait_until(lambda: any(e.get("event") == "alert_sent" for e in r.events()), what="alert_sent")
    r.wait_until(
        lambda: any("oauth" in str(e).lower() for e in r.events() if e.get("level") != "info"),
        what="the OAuth failure logged",
    )
    # the refused connection upstream was logged, and so was the hostname warning
    text = r.logs()
    assert "relayhost" in text and "set `hostname`" in text, text[-3000:]


def _surfaces(r: RelayProcess, hook: Receiver) -> dict[str, str]:
    out: dict[str, str] = {}
    for args in (
        ("check-config",),
        ("check-config", "--json"),
        ("status",),
        ("status", "--json"),
        ("alerts",),
        ("alerts", "--json"),
        ("queue", "list", "--all"),
    ):
        res = r.cli(*args)
        assert res.returncode in (0, 1, 2), (args, res.stdout, res.stderr)
        out["relay " + " ".join(args)] = res.stdout + res.stderr
    assert "OK" in out["relay check-config"]
    for path in ("/health", "/healthz", "/metrics"):
        out[path] = _get(r.admin_port, path)
    out["alert payloads"] = "\n".join(p.body.decode(errors="replace") for p in hook.posts)
    assert '"event"' in out["alert payloads"]
    r.stop()
    out["daemon log"] = r.logs()
    out.update(_bad_config_errors(r))
    return out


def _bad_config_errors(r: RelayProcess) -> dict[str, str]:
    """The errors of configs that are wrong where a secret sits: `relay check-config` and
    `relay serve` both print them."""
    good = yaml.safe_load(r.config_path.read_text())
    wh = good["alerts"]["webhook"]["url"]
    token_url = good["upstreams"]["oauthed"]["oauth"]["token_url"]
    bad: dict[str, dict[str, Any]] = {
        "webhook scheme": {"alerts": {"webhook": {"url": "ftp" + wh.removeprefix("http")}}},
        "token_url scheme": {
            "upstreams": {"oauthed": {"oauth": {"token_url": "ftp" + token_url[4:]}}}
        },
        "unknown key": {"spool": {"nonsense": 1}},
    }
    out: dict[str, str] = {}
    for name, over in bad.items():
        cfg = yaml.safe_load(r.config_path.read_text())
        for section, value in over.items():
            cfg[section] = _merge(cfg[section], value)
        path = r.workdir / f"bad-{name.replace(' ', '-')}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for cmd in (["check-config"], ["serve"]):
            res = subprocess.run(
                [sys.executable, "-m", "relay", *cmd, "-c", str(path)],
                env=r.env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert res.returncode == 78, (name, cmd, res.stdout, res.stderr)
            out[f"{name} ({cmd[0]})"] = res.stdout + res.stderr
    # the credentials folder not set: the error names the key, and nothing secret
    env = {k: v for k, v in r.env.items() if k != "CREDENTIALS_DIRECTORY"}
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(r.config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 78
    assert "CREDENTIALS_DIRECTORY" in res.stderr and "password_file" in res.stderr
    out["no CREDENTIALS_DIRECTORY"] = res.stdout + res.stderr
    assert "'ftp://***@127.0.0.1:" in out["webhook scheme (check-config)"]
    return out


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in over.items()}}
    return over
