"""relay-sendmail end to end: the real program as a subprocess, submitting to a real daemon
(or to a scripted SMTP server standing in for it, to drive each reply class) over a real
socket. Exit codes follow sysexits.h: 0 spooled, 64 usage, 65 data, 67 user, 75 tempfail."""

from __future__ import annotations

import os
import re
import smtplib
import stat
import subprocess
import sys
from email.parser import BytesParser
from email.policy import default as default_policy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import Upstream, free_port

pytestmark = pytest.mark.slow

SENDER = "app@example.com"


def sendmail(
    config: Path | None,
    *args: str,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    script: bool = False,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[bytes]:
    cmd = (
        [str(Path(sys.executable).parent / "relay-sendmail")]
        if script
        else [sys.executable, "-m", "relay.cli.sendmail"]
    )
    if config is not None:
        cmd += ["--config", str(config)]
    full_env = {**os.environ, **(env or {})}
    if env is None or "RELAY_CONFIG" not in env:
        full_env.pop("RELAY_CONFIG", None)
    return subprocess.run(
        [*cmd, *args], input=stdin, capture_output=True, env=full_env, timeout=timeout
    )


def parsed(data: bytes) -> Any:
    return BytesParser(policy=default_policy).parsebytes(data)


def by_message_id(up: Upstream, mid: str) -> list[Any]:
    return [m for m in up.received if f"<{mid}>".encode() in m.data]


def one_line_error(res: subprocess.CompletedProcess[bytes]) -> str:
    err = res.stderr.decode()
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert err.startswith("relay-sendmail: ")
    return lines[0]


def fake_relay_config(tmp_path: Path, port: int) -> Path:
    """A config whose first listener is a scripted server standing in for the daemon."""
    p = tmp_path / "fake-relay.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "hostname": "relay.test",
                "listen": [{"address": f"127.0.0.1:{port}"}, {"address": "127.0.0.1:1"}],
                # no maildrop there (the daemon never ran): a 4xx is EX_TEMPFAIL
                "spool": {"path": str(tmp_path / "no-spool")},
            }
        )
    )
    return p


# --- with the daemon ------------------------------------------------------------------------


def test_delivers_with_envelope_and_crlf(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = (
        b"Subject: plain LF\nMessage-ID: <sm-1@app.example.com>\n"
        b"To: user@example.org\n\nfirst line\nsecond line\n"
    )
    res = sendmail(r.config_path, "-f", SENDER, "user@example.org", stdin=msg)
    assert res.returncode == 0, res.stderr
    assert res.stderr == b"" and res.stdout == b""
    # exit 0 means the relay already has it on disk
    assert [m["message_id"] for m in r.queue()] == ["sm-1@app.example.com"]
    got = up.wait_for(1)[0]
    assert got.mail_from == SENDER
    assert got.rcpt_tos == ["user@example.org"]
    assert re.search(rb"(?<!\r)\n", got.data) is None, "a bare LF went upstream"
    assert b"\r\n\r\nfirst line\r\nsecond line\r\n" in got.data
    m = parsed(got.data)
    assert m["Subject"] == "plain LF"
    assert m["From"] == SENDER  # added: the message had none
    assert m["Date"] is not None  # added: the message had none
    assert len(m.get_all("Message-ID")) == 1


def test_daemon_down_goes_to_the_maildrop_else_tempfail(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    assert r.stop() == 0
    res = sendmail(r.config_path, "-f", SENDER, "user@example.org", stdin=b"Subject: x\n\nhello\n")
    assert res.returncode == 0, res.stderr
    line = one_line_error(res)
    assert f"127.0.0.1:{r.port}" in line
    assert "queued locally in the maildrop" in line
    # the daemon made the maildrop at start: setgid + sticky, group -wx (relay/spool/maildrop.py)
    assert stat.S_IMODE((r.spool / "maildrop").stat().st_mode) == 0o3730
    drops = [p for p in (r.spool / "maildrop").iterdir() if p.name.endswith(".msg")]
    assert len(drops) == 1 and drops[0].name in line
    # neither the daemon nor the maildrop: 75, nothing claimed
    drops[0].unlink()
    (r.spool / "maildrop").rmdir()
    res = sendmail(r.config_path, "-f", SENDER, "user@example.org", stdin=b"Subject: x\n\nhello\n")
    assert res.returncode == 75
    line = one_line_error(res)
    assert f"127.0.0.1:{r.port}" in line and "maildrop" in line


def test_extract_recipients_and_remove_bcc(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = (
        b"From: App <app@example.com>\n"
        b"To: Ann <ann@example.org>\n"
        b'Cc: "Bob, B." <bob@example.net>\n'
        b"Bcc: carol@example.com,\n"
        b"  dave@example.com\n"
        b"Subject: -t test\n"
        b"Message-ID: <sm-t@app.example.com>\n\nbody\n"
    )
    res = sendmail(r.config_path, "-t", "-i", "-f", SENDER, stdin=msg)
    assert res.returncode == 0, res.stderr
    up.wait_for(1)
    r.wait_until(lambda: len(up.recipients()) >= 4, timeout=30, what="4 recipients upstream")
    assert sorted(up.recipients()) == [
        "ann@example.org",
        "bob@example.net",
        "carol@example.com",
        "dave@example.com",
    ]
    for m in up.received:
        assert b"bcc" not in m.data.lower()
        assert b"carol@" not in m.data and b"dave@" not in m.data
        p = parsed(m.data)
        assert p["To"] == "Ann <ann@example.org>"
        assert p["From"] == "App <app@example.com>"  # kept as written, not added


def test_extract_adds_command_line_recipients(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = b"To: ann@example.org\nSubject: both\nMessage-ID: <sm-t2@app.example.com>\n\nx\n"
    res = sendmail(r.config_path, "-t", "-f", SENDER, "extra@example.org", stdin=msg)
    assert res.returncode == 0, res.stderr
    r.wait_until(lambda: len(up.recipients()) >= 2, timeout=30, what="2 recipients upstream")
    assert sorted(up.recipients()) == ["ann@example.org", "extra@example.org"]


def test_default_sender_is_user_at_local_domain(upstream, relay) -> None:
    """Issue 26 item 2: the envelope sender is the login user at local.domain (the name the
    headers get), not at the hostname: a smarthost refuses root@localhost."""
    import pwd

    up = upstream()
    r = relay(upstream=up, config={"local": {"domain": "host.example.net"}})
    res = sendmail(
        r.config_path,
        "user@example.org",
        stdin=b"Subject: who\nMessage-ID: <sm-who@x.example>\n\nhi\n",
    )
    assert res.returncode == 0, res.stderr
    got = up.wait_for(1)[0]
    user = pwd.getpwuid(os.getuid()).pw_name
    assert got.mail_from == f"{user}@host.example.net"
    assert parsed(got.data)["From"] == f"{user}@host.example.net"


def test_f_attached_and_F_adds_from(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    res = sendmail(
        r.config_path,
        "-fjane@example.com",
        "-F",
        "Jane Doe",
        "-oi",
        "user@example.org",
        stdin=b"Subject: named\nMessage-ID: <sm-F@x.example>\n\nhi\n",
    )
    assert res.returncode == 0, res.stderr
    got = up.wait_for(1)[0]
    assert got.mail_from == "jane@example.com"
    froms = parsed(got.data).get_all("From")
    assert froms == ["Jane Doe <jane@example.com>"]


def test_F_does_not_touch_an_existing_from(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    res = sendmail(
        r.config_path,
        "-f",
        SENDER,
        "-F",
        "Ignored Name",
        "user@example.org",
        stdin=b"From: Real <real@example.com>\nSubject: s\nMessage-ID: <sm-F2@x.example>\n\nhi\n",
    )
    assert res.returncode == 0, res.stderr
    got = up.wait_for(1)[0]
    assert parsed(got.data).get_all("From") == ["Real <real@example.com>"]
    assert b"Ignored Name" not in got.data


@pytest.mark.parametrize("flag", [None, "-i", "-oi"])
def test_lone_dot(upstream, relay, flag: str | None) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = b"Subject: dots\nMessage-ID: <sm-dot@x.example>\n\nbefore\n.\nafter\n..two\n"
    args = [flag] if flag else []
    res = sendmail(r.config_path, *args, "-f", SENDER, "user@example.org", stdin=msg)
    assert res.returncode == 0, res.stderr
    got = up.wait_for(1)[0]
    body = got.data.split(b"\r\n\r\n", 1)[1]
    if flag is None:
        # classic sendmail: the lone dot ended the message
        assert body == b"before\r\n"
    else:
        assert body == b"before\r\n.\r\nafter\r\n..two\r\n"


def test_suppressed_recipient_is_permanent_not_tempfail(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    r.cli("suppression", "add", "gone@example.org", "--reason", "hard bounce", check=True)

    def refused() -> bool:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as s:
            s.ehlo()
            s.mail(SENDER)
            code, _msg = s.rcpt("gone@example.org")
            s.rset()
            return code == 550

    r.wait_until(refused, timeout=10, what="the daemon to load the suppression")
    res = sendmail(
        r.config_path,
        "-f",
        SENDER,
        "gone@example.org",
        stdin=b"Subject: s\nMessage-ID: <sm-supp@x.example>\n\nhi\n",
    )
    assert res.returncode == 67
    line = one_line_error(res)
    assert f"127.0.0.1:{r.port}" in line
    assert "550 5.1.1" in line and "suppressed" in line and "gone@example.org" in line
    assert r.queue() == []

    # one good, one suppressed: the good one gets it, the exit status still says "no user"
    res = sendmail(
        r.config_path,
        "-f",
        SENDER,
        "ok@example.org",
        "gone@example.org",
        stdin=b"Subject: s\nMessage-ID: <sm-supp2@x.example>\n\nhi\n",
    )
    assert res.returncode == 67
    line = one_line_error(res)
    assert "gone@example.org" in line and "1 of 2" in line
    got = up.wait_for(1)
    assert [m.rcpt_tos for m in got] == [["ok@example.org"]]


def test_usage_errors(upstream, relay) -> None:
    r = relay(upstream=upstream())
    res = sendmail(r.config_path, "-f", SENDER, stdin=b"Subject: x\n\nhi\n")
    assert res.returncode == 64
    assert "no recipients" in one_line_error(res)
    # -t but no recipient headers
    res = sendmail(r.config_path, "-t", stdin=b"Subject: x\n\nhi\n")
    assert res.returncode == 64
    assert "no recipients" in one_line_error(res)
    res = sendmail(r.config_path, "-Q", "user@example.org", stdin=b"x\n")
    assert res.returncode == 64
    assert r.queue() == []


def test_legacy_flags_are_ignored(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    res = sendmail(
        r.config_path,
        "-odi",
        "-oem",
        "-v",
        "-N",
        "never",
        "-oQ/tmp",
        "-f",
        SENDER,
        "--",
        "user@example.org",
        stdin=b"Subject: legacy\nMessage-ID: <sm-legacy@x.example>\n\nhi\n",
    )
    assert res.returncode == 0, res.stderr
    assert up.wait_for(1)[0].rcpt_tos == ["user@example.org"]


def test_console_script_and_relay_config_env(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    res = sendmail(
        None,
        "-f",
        SENDER,
        "user@example.org",
        script=True,
        env={"RELAY_CONFIG": str(r.config_path)},
        stdin=b"Subject: env\nMessage-ID: <sm-env@x.example>\n\nhi\n",
    )
    assert res.returncode == 0, res.stderr
    assert up.wait_for(1)[0].mail_from == SENDER


def test_bad_config_is_ex_config(tmp_path: Path) -> None:
    res = sendmail(tmp_path / "missing.yaml", "user@example.org", stdin=b"x\n")
    assert res.returncode == 78
    assert "missing.yaml" in one_line_error(res)
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  - address: 127.0.0.1:notaport\n")
    res = sendmail(bad, "user@example.org", stdin=b"x\n")
    assert res.returncode == 78
    assert "listen[0].address" in one_line_error(res)


def test_bs_speaks_smtp_on_stdio(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    session = (
        b"EHLO app.example\r\nMAIL FROM:<app@example.com>\r\n"
        b"RCPT TO:<user@example.org>\r\nDATA\r\n"
        b"Subject: bs\r\nMessage-ID: <sm-bs@x.example>\r\n\r\nvia -bs\r\n.\r\nQUIT\r\n"
    )
    res = sendmail(r.config_path, "-bs", stdin=session)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert out.startswith("220 ")
    assert re.search(r"^250 2\.0\.0 Ok: queued as \w+", out, re.M), out
    assert re.search(r"^221 ", out, re.M), out
    got = up.wait_for(1)[0]
    assert got.rcpt_tos == ["user@example.org"] and b"via -bs" in got.data


# --- against a scripted stand-in for the daemon: each reply class -------------------------


@pytest.mark.parametrize(
    ("hook", "reply", "code", "expect_data"),
    [
        ("data_reply", "451 4.3.0 Spool unavailable", 75, True),
        ("data_reply", "554 5.6.0 Content rejected", 65, True),
        ("rcpt_reply", "450 4.2.0 Mailbox busy", 75, False),
        ("rcpt_reply", "550 5.1.1 No such user", 67, False),
        ("mail_reply", "553 5.1.7 Bad sender", 65, False),
        ("mail_reply", "421 4.3.2 Shutting down", 75, False),
    ],
)
def test_reply_classes(
    upstream, tmp_path: Path, hook: str, reply: str, code: int, expect_data: bool
) -> None:
    fake = upstream()
    setattr(fake, hook, lambda *_a: reply)
    cfg = fake_relay_config(tmp_path, fake.port)
    res = sendmail(cfg, "-f", SENDER, "user@example.org", stdin=b"Subject: x\n\nhi\n")
    assert res.returncode == code
    line = one_line_error(res)
    assert f"127.0.0.1:{fake.port}" in line  # the first listener, not the second
    assert reply in line
    assert ("DATA" in fake.commands) is expect_data
    assert fake.received == []


def test_temporary_rcpt_failure_sends_nothing(upstream, tmp_path: Path) -> None:
    """One recipient deferred: nothing is sent, so the caller's retry is complete."""
    fake = upstream()
    fake.rcpt_reply = lambda a: "451 4.3.0 try later" if a.startswith("b") else None
    cfg = fake_relay_config(tmp_path, fake.port)
    res = sendmail(cfg, "-f", SENDER, "a@example.org", "b@example.org", stdin=b"Subject: x\n\nhi\n")
    assert res.returncode == 75
    assert "b@example.org" in one_line_error(res)
    assert "DATA" not in fake.commands and fake.received == []


def test_greeting_refusal(upstream, tmp_path: Path) -> None:
    fake = upstream()
    fake.connect_reply = "421 4.3.2 relay.test shutting down"
    res = sendmail(fake_relay_config(tmp_path, fake.port), "user@example.org", stdin=b"x\n")
    assert res.returncode == 75
    assert "421 4.3.2" in one_line_error(res)
    fake.connect_reply = "554 5.7.1 go away"
    res = sendmail(fake_relay_config(tmp_path, fake.port), "user@example.org", stdin=b"x\n")
    assert res.returncode == 69
    assert "554 5.7.1" in one_line_error(res)


def test_nothing_listening_is_tempfail(tmp_path: Path) -> None:
    port = free_port()
    res = sendmail(fake_relay_config(tmp_path, port), "user@example.org", stdin=b"x\n")
    assert res.returncode == 75
    assert f"127.0.0.1:{port}" in one_line_error(res)


def test_bp_and_mailq_list_the_queue_and_q_flushes(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    r.cli("destination", "suspend", "smarthost", check=True)
    res = sendmail(
        r.config_path,
        "-f",
        SENDER,
        "user@example.org",
        stdin=b"Subject: queued\nMessage-ID: <mailq-1@app.example.com>\n\nhi\n",
    )
    assert res.returncode == 0, res.stderr
    listing = sendmail(r.config_path, "-bp")
    assert listing.returncode == 0, listing.stderr
    assert b"user@example.org" in listing.stdout and b"Request" in listing.stdout
    script = Path(sys.executable).parent / "mailq"
    as_mailq = subprocess.run(
        [str(script), "--config", str(r.config_path)], capture_output=True, timeout=60
    )
    assert as_mailq.returncode == 0 and as_mailq.stdout == listing.stdout
    flushed = sendmail(r.config_path, "-q")
    assert flushed.returncode == 0 and b"flush" in flushed.stdout
