"""Unqualified addresses and aliases (local.domain, local.aliases): cron's exact invocation
of sendmail to `root` arrives as the alias target with a qualified From:; an SMTP client on
an allow-listed network may send `<root>`, one outside may not."""

from __future__ import annotations

import smtplib
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.config.tree import ConfigError, Local, from_mapping, parse_aliases
from tests.e2e.test_sendmail_e2e import parsed, sendmail
from tests.harness import RelayProcess, Upstream

CRON_MAIL = (
    b"From: root (Cron Daemon)\nTo: root\nSubject: Cron <root@host> run-parts"
    b" /etc/cron.daily\nMIME-Version: 1.0\nContent-Type: text/plain; charset=UTF-8\n"
    b"Content-Transfer-Encoding: 8bit\nX-Cron-Env: <SHELL=/bin/sh>\n\n"
    b"/etc/cron.daily/logrotate: error: bad line\n"
)


@pytest.mark.slow
def test_cron_to_root_reaches_the_alias_target_with_a_qualified_from(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
    tmp_path: Path,
) -> None:
    aliases = tmp_path / "relay" / "aliases"
    aliases.parent.mkdir(parents=True, exist_ok=True)
    aliases.write_text("# aliases(5)\npostmaster: root\nroot: ops@example.com,\n  dev\n")
    up = upstream()
    r = relay(upstream=up, config={"local": {"domain": "host.example.net", "aliases": "aliases"}})
    # Debian cron: sendmail -FCronDaemon -i -B8BITMIME -oem root
    res = sendmail(
        r.config_path, "-FCronDaemon", "-i", "-B8BITMIME", "-oem", "root", stdin=CRON_MAIL
    )
    assert res.returncode == 0, res.stderr
    got = up.wait_for(1)[0]
    assert sorted(got.rcpt_tos) == ["dev@host.example.net", "ops@example.com"]
    head = got.data.split(b"\r\n\r\n", 1)[0]
    assert b"\r\nFrom: root@host.example.net (Cron Daemon)\r\n" in head
    assert b"\r\nTo: root@host.example.net\r\n" in head
    assert parsed(got.data)["Subject"].startswith("Cron <root@host>")  # untouched


@pytest.mark.slow
def test_bare_local_parts_over_smtp_only_from_allowed_clients(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    up = upstream()
    r = relay(
        upstream=up,
        config={"local": {"domain": "host.example.net", "aliases": {"root": "ops@example.com"}}},
    )
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.docmd("MAIL", "FROM:<www-data>")[0] == 250
        code, msg = s.docmd("RCPT", "TO:<root>")
        assert code == 250 and b"alias" in msg
        assert s.docmd("RCPT", "TO:<nobody>")[0] == 250
        code, _ = s.data(
            b"From: Web <www-data>\r\nTo: root, x@example.org\r\n"
            b"Subject: root and www-data stay\r\n\r\nhello root\r\n"
        )
        assert code == 250
    got = up.wait_for(1)[0]
    assert got.mail_from == "www-data@host.example.net"
    assert sorted(got.rcpt_tos) == ["nobody@host.example.net", "ops@example.com"]
    # the address headers are qualified like the envelope; nothing else is touched
    assert b"\r\nFrom: Web <www-data@host.example.net>\r\n" in got.data
    assert b"\r\nTo: root@host.example.net, x@example.org\r\n" in got.data
    assert b"\r\nSubject: root and www-data stay\r\n" in got.data
    assert got.data.endswith(b"\r\n\r\nhello root\r\n")
    # a listener that allows nobody: `<root>` is a syntax error there (no open relay trick)
    r2 = relay(
        upstream=up, name="closed", config={"local": {"domain": "host.example.net"}}, start=False
    )
    r2.config["listen"][0]["allow"] = []
    r2.write_config()
    r2.start()
    with smtplib.SMTP("127.0.0.1", r2.port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.docmd("MAIL", "FROM:<root>")[0] == 501


def test_aliases_parse_and_expand() -> None:
    aliases = parse_aliases(
        "root: ops@example.com, dev\ncron: root\nloop: loop\n", "h.example", "local.aliases"
    )
    local = Local("h.example", aliases)
    assert local.expand("cron@h.example") == ("ops@example.com", "dev@h.example")
    assert local.expand("ROOT@H.example") == ("ops@example.com", "dev@h.example")
    assert local.expand("root@other.example") == ("root@other.example",)
    assert local.expand("loop@h.example") == ("loop@h.example",)  # bounded, not endless
    for bad in (
        "root: |/bin/sh",
        "root: /var/mail/x",
        "root: :include:/etc/x",
        "root:",
        "no colon here",
        "root: a b@example.com",
    ):
        with pytest.raises(ConfigError):
            parse_aliases(bad, "h.example", "local.aliases")


def test_local_config_defaults_to_the_hostname(tmp_path: Path) -> None:
    cfg = from_mapping({"hostname": "relay.example.net"}, tmp_path)
    assert cfg.local.domain == "relay.example.net" and cfg.local.aliases == {}
    with pytest.raises(ConfigError, match=r"local\.domain"):
        from_mapping({"local": {"domain": "bad domain"}}, tmp_path)
