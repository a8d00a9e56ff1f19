"""Secrets never printed, unit level (issue 26 item 6): the URL printing rules
(relay/ops/logs.py), the formatter's redaction of every field, the chatty libraries held at
WARNING, check-config's redacted tree and repr, the alert webhook's errors, and the
`${CREDENTIALS_DIRECTORY}` expansion of file keys (relay/config/credentials.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.config import credentials
from relay.config.redact import dsn_passwords
from relay.config.redact import redact_dsn as redact
from relay.config.tree import ConfigError, from_mapping
from relay.ops import logs
from relay.ops.alerts import post_webhook
from relay.ops.logs import log_event, redact_text, redact_url, redact_webhook_url, set_secrets


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.example/x?token=abc123", "https://hooks.example/x?token=***"),
        ("https://h/x?a=1&b=&c", "https://h/x?a=***&b=***&***"),
        ("https://user:pw@host/", "https://user:***@host/"),
        ("https://user:pw@host:8443/p?q=1#frag", "https://user:***@host:8443/p?q=***#***"),
        ("https://user@host/p", "https://user@host/p"),  # a user alone is no secret
        ("https://host/p#frag", "https://host/p#***"),
        ("https://host/services/T/B/X", "https://host/services/T/B/X"),  # general rule
        ("postgresql://u:p@h/db?password=x", "postgresql://u:***@h/db?password=***"),
        ("https://u:p:q@h/", "https://u:***@h/"),  # ":" in the password
        ("https://a@b:c@h/", "https://a@b:***@h/"),  # the last "@" ends the userinfo
        ("https://host", "https://host"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T0/B0/XXXX", "https://hooks.slack.com/***"),
        ("https://chat.googleapis.com/v1/spaces/S/messages?key=K&token=T",
         "https://chat.googleapis.com/***"),
        ("https://user:pw@hooks.example:8443/x", "https://***@hooks.example:8443/***"),
        ("https://hooks.example/?token=x", "https://hooks.example/***"),
        ("https://hooks.example/", "https://hooks.example"),
        ("https://hooks.example", "https://hooks.example"),
        ("hooks.example/x", "***"),
    ],
)  # fmt: skip
def test_redact_webhook_url(url: str, shown: str) -> None:
    assert redact_webhook_url(url) == shown


@pytest.fixture
def no_secrets() -> Iterator[None]:
    set_secrets({})
    yield
    set_secrets({})


def test_redact_text_urls_and_registered_secrets(no_secrets: None) -> None:
    text = 'POST https://h.example/a?token=t0ps3cret "HTTP/1.1 200" and pw hunter22 (x://y@z)'
    assert redact_text(text) == (
        'POST https://h.example/a?token=*** "HTTP/1.1 200" and pw hunter22 (x://y@z)'
    )
    set_secrets({"hunter22": "***", "abc": "***"})  # too short to hide: would blank words
    assert redact_text("pw hunter22, abc") == "pw ***, abc"
    # the longest first: a secret containing another goes whole
    set_secrets({"/services/T/B/XYZ": "/***", "XYZ123": "***", "/services/T/B/XYZ123": "/***"})
    assert redact_text("at /services/T/B/XYZ123.") == "at /***."


def _capture(level: str = "info", unmask: bool = False, fmt: str = "json") -> io.StringIO:
    stream = io.StringIO()
    logs.setup_logging(level, fmt, unmask, stream=stream)
    return stream


@pytest.mark.parametrize("fmt", ["json", "text"])
@pytest.mark.parametrize("unmask", [False, True])
def test_formatter_hides_secrets_in_every_field(no_secrets: None, fmt: str, unmask: bool) -> None:
    stream = _capture("debug", unmask, fmt)
    set_secrets({"sup3rs3cret": "***"})
    log = logging.getLogger("relay.test_secrets")
    try:
        raise RuntimeError("connect to https://u:sup3rs3cret@h/x?token=tok3n failed")
    except RuntimeError as e:
        log_event(
            log,
            logging.ERROR,
            "alert_failed",
            "posting to https://h/x?token=tok3n",
            error="webhook: https://h/?sig=tok3n",
            nested={"list": ["the password is sup3rs3cret"]},
            exc=e,
        )
    out = stream.getvalue()
    assert out.count("\n") == 1 and "alert_failed" in out
    assert "tok3n" not in out and "sup3rs3cret" not in out
    assert "token=***" in out and "sig=***" in out and "traceback" in out


def test_httpx_request_lines_never_reach_the_log(no_secrets: None) -> None:
    """httpx logs every request with its full URL at INFO: held at WARNING."""
    stream = _capture("info")
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    with httpx.Client(transport=transport) as client:
        client.post("https://hooks.example/services/T/B/s3cretpath?token=s3crettoken")
    logging.getLogger("relay.test_secrets").info("after")
    out = stream.getvalue()
    assert "after" in out  # the handler is there and writes
    assert "HTTP Request" not in out and "s3cret" not in out
    for name in ("httpx", "httpcore"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING
    _capture("debug")  # even at debug: the formatter would hide query values, not paths
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_webhook_errors_never_carry_the_url() -> None:
    url = "https://hooks.example/services/T/B/s3cretpath?token=s3crettoken"

    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot connect to {request.url}", request=request)

    async def go() -> str | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fail)) as client:
            return await post_webhook(client, url, None, {"event": "x", "id": 1}, 1.0)

    err = asyncio.run(go())
    assert err is not None and err.startswith("webhook: ConnectError: cannot connect to")
    assert "s3cret" not in err and "https://hooks.example/***" in err


def _config(tmp_path: Path, **over: Any) -> dict[str, Any]:
    (tmp_path / "hook.secret").write_text("signingS3cret\n")
    base: dict[str, Any] = {
        "hostname": "relay.example.net",
        "spool": {"path": str(tmp_path / "spool")},
        "alerts": {
            "webhook": {
                "url": "https://hook:userS3cret@hooks.example/services/T/B/pathS3cret?t=qS3cret",
                "secret_file": "hook.secret",
            }
        },
    }
    base.update(over)
    return base


SECRET_MARKS = ("userS3cret", "pathS3cret", "qS3cret", "signingS3cret", "pgS3cret", "keyS3cret")


def test_check_config_tree_and_repr_hide_secrets(tmp_path: Path) -> None:
    (tmp_path / "client.secret").write_text("clientS3cret\n")
    cfg = from_mapping(
        _config(
            tmp_path,
            upstreams={
                "o": {
                    "host": "smtp.example.net",
                    "username": "app",
                    "auth": "xoauth2",
                    "oauth": {
                        "token_url": "https://login.example/tenant/token?key=keyS3cret",
                        "client_id": "relay",
                        "client_secret_file": "client.secret",
                    },
                }
            },
            routes=[{"via": ["o"]}],
        ),
        tmp_path,
    )
    shown = json.dumps(cfg.redacted(), default=str) + repr(cfg)
    for mark in (*SECRET_MARKS, "clientS3cret"):
        assert mark not in shown, mark
    tree = cfg.redacted()
    assert tree["alerts"]["webhook"]["url"] == "https://***@hooks.example/***"
    assert (
        tree["upstreams"]["o"]["oauth"]["token_url"] == "https://login.example/tenant/token?key=***"
    )
    # and the formatter is told every secret value the config holds
    assert {"signingS3cret", "clientS3cret"} <= set(cfg.secrets())
    assert cfg.secrets()["/services/T/B/pathS3cret?t=qS3cret"] == "/***"


def test_dsn_redaction_and_passwords() -> None:
    url = "postgresql://root:pgS3cret@127.0.0.1/test?sslmode=require&password=pgS3cret2"
    assert redact(url) == "postgresql://root:***@127.0.0.1/test?sslmode=***&password=***"
    assert redact("host=db password=pgS3cret dbname=x") == "host=db password=*** dbname=x"
    assert redact("postgresql://root@127.0.0.1/test") == "postgresql://root@127.0.0.1/test"
    assert set(dsn_passwords(url)) == {"pgS3cret", "pgS3cret2"}
    # as written and as sent: either may turn up in a message
    assert set(dsn_passwords("postgresql://root:p%40ss@h/db")) == {"p@ss", "p%40ss"}
    assert dsn_passwords("postgresql://root@h/db") == ()


def test_bad_urls_are_quoted_redacted_in_config_errors(tmp_path: Path) -> None:
    bad = _config(tmp_path)
    bad["alerts"]["webhook"]["url"] = "ftp://hook:userS3cret@hooks.example/pathS3cret?t=qS3cret"
    with pytest.raises(ConfigError) as e:
        from_mapping(bad, tmp_path)
    assert "alerts.webhook.url: 'ftp://***@hooks.example/***'" in str(e.value)
    for mark in SECRET_MARKS:
        assert mark not in str(e.value)
    with pytest.raises(ConfigError) as e:
        from_mapping(
            _config(
                tmp_path,
                upstreams={
                    "o": {
                        "host": "h.example",
                        "username": "a",
                        "auth": "xoauth2",
                        "oauth": {"token_url": "ftp://u:keyS3cret@h/t?k=keyS3cret"},
                    }
                },
                routes=[{"via": ["o"]}],
            ),
            tmp_path,
        )
    assert "keyS3cret" not in str(e.value) and "ftp://u:***@h/t?k=***" in str(e.value)


# --- ${CREDENTIALS_DIRECTORY} -----------------------------------------------------------


@pytest.fixture(autouse=True)
def no_source_folder() -> Iterator[None]:
    """The CLI's fallback is process-wide: off for these tests, whatever ran before."""
    credentials.use_source_folder(None)
    yield
    credentials.use_source_folder(None)


@pytest.mark.parametrize(
    ("value", "env", "expanded"),
    [
        ("${CREDENTIALS_DIRECTORY}/relay_pw", {"CREDENTIALS_DIRECTORY": "/run/c/relay"},
         "/run/c/relay/relay_pw"),
        ("${CREDENTIALS_DIRECTORY}/x", {"CREDENTIALS_DIRECTORY": "/run/c/"}, "/run/c/x"),
        ("/etc/relay/pw", {}, "/etc/relay/pw"),
        ("$CREDENTIALS_DIRECTORY/x", {}, "$CREDENTIALS_DIRECTORY/x"),  # only ${...}
        ("${HOME}/x", {"HOME": "/root"}, "${HOME}/x"),  # only this variable
    ],
)  # fmt: skip
def test_expand(value: str, env: dict[str, str], expanded: str) -> None:
    assert credentials.expand(value, "k", env) == expanded


@pytest.mark.parametrize("env", [{}, {"CREDENTIALS_DIRECTORY": ""}])
def test_expand_unset_names_the_key(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"^upstream\.smarthost\.password_file: .*not set"):
        credentials.expand("${CREDENTIALS_DIRECTORY}/pw", "upstream.smarthost.password_file", env)


def test_every_file_key_expands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "relay_smarthost").write_text("smarthostS3cret\n")
    (creds / "relay_route").write_text("routeS3cret\n")
    (creds / "relay_hook").write_text("hookS3cret\n")
    c = "${CREDENTIALS_DIRECTORY}"
    data = {
        "hostname": "relay.example.net",
        "spool": {"path": str(tmp_path / "spool")},
        "upstream": {"smarthost": {"username": "a", "password_file": f"{c}/relay_smarthost"}},
        "upstreams": {
            "r": {"host": "h.example", "username": "a", "password_file": f"{c}/relay_route"}
        },
        "routes": [{"via": ["r"]}],
        "alerts": {"webhook": {"url": "https://h/x", "secret_file": f"{c}/relay_hook"}},
    }
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    cfg = from_mapping(data, tmp_path)
    assert cfg.upstream.smarthost.password == "smarthostS3cret"
    assert cfg.upstream.smarthost.password_file == creds / "relay_smarthost"
    assert cfg.routing.upstreams["r"].password == "routeS3cret"
    assert cfg.alerts.webhook is not None and cfg.alerts.webhook.secret == b"hookS3cret"
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError) as e:
        from_mapping(data, tmp_path)
    # every key that names the folder is listed, each by its path
    for key in (
        "upstream.smarthost.password_file",
        "upstreams.r.password_file",
        "alerts.webhook.secret_file",
    ):
        assert f"{key}: '${{CREDENTIALS_DIRECTORY}}/" in str(e.value), (key, str(e.value))


def test_sns_subscribe_url_is_printed_whole(no_secrets: None) -> None:
    """The one URL the operator must open (SNS SubscriptionConfirmation) keeps its query;
    the same URL in any other field does not."""
    stream = _capture()
    url = "https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription&Token=t0k"
    log_event(logging.getLogger("relay.test_secrets"), logging.WARNING, "x", subscribe_url=url)
    log_event(logging.getLogger("relay.test_secrets"), logging.WARNING, "x", other=url)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["subscribe_url"] == url
    assert second["other"] == "https://sns.us-east-1.amazonaws.com/?Action=***&Token=***"


def test_outside_the_service_the_source_folder(tmp_path: Path) -> None:
    """The CLI (use_source_folder) reads `${CREDENTIALS_DIRECTORY}/relay_<name>` as
    `<config folder>/credentials/<name>` when the variable is unset; the variable, when set,
    wins; a name without the unit's `relay_` prefix is still an error."""
    src = tmp_path / "credentials"
    credentials.use_source_folder(src)
    c = "${CREDENTIALS_DIRECTORY}"
    assert credentials.expand(f"{c}/relay_pw", "k", {}) == str(src / "pw")
    assert credentials.expand(f"{c}/relay_pw", "k", {"CREDENTIALS_DIRECTORY": "/run/x"}) == (
        "/run/x/relay_pw"
    )
    for value in (f"{c}/pw", f"/x{c}/relay_pw", f"{c}/relay_"):
        with pytest.raises(ValueError, match=r"^k: .*not set"):
            credentials.expand(value, "k", {})
