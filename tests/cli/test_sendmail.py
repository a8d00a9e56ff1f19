"""relay-sendmail's pure parts: arguments (issue 26 items 2-3, issue 27 item 6), the bare CR,
-F as a display name, and the three audit items (-f root, Resent-*, a folded CTE). The
subprocess cases at the end are refused before any connection: no daemon needed."""

from __future__ import annotations

import email
import email.header
import email.policy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relay.cli import sendmail
from relay.cli.sendmail import (
    DataError,
    Options,
    UsageError,
    build_message,
    check_arguments,
    display_name,
    envelope_sender,
    fields,
    from_header,
    header_recipients,
    parse_args,
    parse_recipients,
    read_message,
    split_headers,
)
from relay.inbound.longlines import conform

# --- recipients: strict, one address or a comma-separated list per argument ----------------


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["a@example.org"], ["a@example.org"]),
        (["a@example.org, b@example.net"], ["a@example.org", "b@example.net"]),
        (
            ["a@example.org,b@example.net", "c@example.com"],
            ["a@example.org", "b@example.net", "c@example.com"],
        ),
        (["<a@example.org>"], ["a@example.org"]),
        ([" a@example.org "], ["a@example.org"]),
        (["a@example.org,"], ["a@example.org"]),
        (["root"], ["root@host.example.net"]),  # qualified like the headers
        (['"a,b"@example.org'], ['"a,b"@example.org']),  # the comma is quoted
        (["user@[192.0.2.1]"], ["user@[192.0.2.1]"]),
    ],
)
def test_recipient_arguments_accepted(args: list[str], want: list[str]) -> None:
    assert parse_recipients(args, "host.example.net") == want


@pytest.mark.parametrize(
    "bad",
    [
        "user@exa mple.org",  # getaddresses made this user@example.org
        "root admin",  # getaddresses made this root
        "Root <root@example.org>",  # a display name is not an address
        "a@example.org b@example.org",
        ",",
        "",
        "a@@example.org",
        "a@example.org>",
        '"unclosed@example.org',
    ],
)
def test_recipient_arguments_refused_naming_the_argument(bad: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_recipients(["ok@example.org", bad], "host.example.net")
    assert f"'{bad}'" in str(e.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["a@x.example\r\nRCPT TO:<evil@y.example>"],
        ["-f", "a@x.example\r\nRCPT TO:<evil@y.example>", "b@x.example"],
        ["-F", "Name\r\nBcc: evil@y.example", "b@x.example"],
        ["-FName\nBcc: evil@y.example", "b@x.example"],
        ["b@x.example\x00"],
        ["-f", "a@x.example\r", "b@x.example"],
    ],
)
def test_cr_lf_nul_in_any_argument_refused(argv: list[str]) -> None:
    with pytest.raises(UsageError, match="CR, LF or NUL"):
        check_arguments(argv)


def test_ordinary_arguments_pass_the_check() -> None:
    check_arguments(["-t", "-i", "-F", 'Jöhn "x" Smith\t', "-f", "a@x.example", "b@y.example"])


def test_config_options() -> None:
    assert parse_args(["-C", "/etc/r.yaml", "a@x.example"]).config == "/etc/r.yaml"
    assert parse_args(["-c", "/etc/r.yaml", "a@x.example"]).config == "/etc/r.yaml"
    assert parse_args(["-C/etc/r.yaml", "a@x.example"]).config == "/etc/r.yaml"
    assert parse_args(["--config", "/etc/r.yaml", "a@x.example"]).config == "/etc/r.yaml"
    assert parse_args(["-c", "/etc/r.yaml", "a@x.example"]).recipients == ["a@x.example"]


# --- the envelope sender ------------------------------------------------------------------


def test_f_root_is_root_at_local_domain() -> None:
    """Audit: `relay-sendmail -f root` gives root@<local.domain>."""
    assert envelope_sender("root", "host.example.net") == "root@host.example.net"
    assert envelope_sender("<root>", "other.example") == "root@other.example"
    assert envelope_sender("app@example.com", "host.example.net") == "app@example.com"
    assert envelope_sender("<>", "host.example.net") == ""
    with pytest.raises(UsageError, match="bad sender"):
        envelope_sender("root admin", "host.example.net")


def test_default_sender_is_the_login_user_at_local_domain() -> None:
    user = sendmail.login_user()
    assert envelope_sender(None, "host.example.net") == f"{user}@host.example.net"


def test_find_relay_reads_local_domain_and_maildrop(tmp_path: Path) -> None:
    cfg = tmp_path / "etc" / "relay.yaml"
    cfg.parent.mkdir()
    cfg.write_text(
        yaml.safe_dump(
            {
                "hostname": "relay.test",
                "local": {"domain": "host.example.net"},
                "listen": [{"address": "0.0.0.0:2600"}],
                "spool": {"path": "../var/spool"},
            }
        )
    )
    t = sendmail.find_relay(str(cfg))
    assert (t.host, t.port, t.hostname, t.local_domain) == (
        "127.0.0.1",
        2600,
        "relay.test",
        "host.example.net",
    )
    # relative to the config file's folder, as the daemon's config loader resolves it
    assert t.maildrop == tmp_path / "var" / "spool" / "maildrop"
    from relay.config.tree import load_config

    assert load_config(str(cfg)).maildrop_dir() == t.maildrop
    data = yaml.safe_load(cfg.read_text())
    data["spool"]["maildrop"] = "drop"
    cfg.write_text(yaml.safe_dump(data))
    assert sendmail.find_relay(str(cfg)).maildrop == tmp_path / "etc" / "drop"
    assert load_config(str(cfg)).maildrop_dir() == tmp_path / "etc" / "drop"


# --- -t: Resent-* ---------------------------------------------------------------------------


def _flds(text: bytes) -> list[tuple[str, str, int, int]]:
    headers, _body = split_headers(read_message(io.BytesIO(text), True))
    return fields(headers)


def test_t_with_resent_headers_uses_only_resent_recipients() -> None:
    """Audit: RFC 5322 §3.6.6: a resent message goes to Resent-To/Cc/Bcc only."""
    msg = (
        b"To: to@example.org\nCc: cc@example.org\nBcc: bcc@example.org\n"
        b"Resent-To: rto@example.org\nResent-Cc: rcc@example.org\n"
        b"Resent-Bcc: rbcc@example.org\nSubject: x\n\nbody\n"
    )
    assert header_recipients(_flds(msg)) == [
        "rto@example.org",
        "rcc@example.org",
        "rbcc@example.org",
    ]
    # any one of them makes it a resent message
    only_bcc = b"To: to@example.org\nResent-Bcc: rbcc@example.org\n\nbody\n"
    assert header_recipients(_flds(only_bcc)) == ["rbcc@example.org"]
    only_cc = b"To: to@example.org\nResent-Cc: rcc@example.org\n\nbody\n"
    assert header_recipients(_flds(only_cc)) == ["rcc@example.org"]
    # Resent-From alone does not: the original recipients
    plain = (
        b"To: to@example.org\nCc: cc@example.org\nBcc: bcc@example.org\nResent-From: x@y.org\n\n"
    )
    assert header_recipients(_flds(plain)) == [
        "to@example.org",
        "cc@example.org",
        "bcc@example.org",
    ]


@pytest.mark.parametrize(
    "value",
    [
        "user@exa mple.org",
        "root admin",
        "a@example.org;b@example.org",
        "a@example.org b@x.org",
        ".a.a\t:(",  # email.headerregistry raises AttributeError on this one
    ],
)
def test_t_refuses_an_address_field_it_cannot_read_with_certainty(value: str) -> None:
    with pytest.raises(DataError, match="with certainty"):
        header_recipients(_flds(b"Subject: x\nTo: " + value.encode() + b"\n\nbody\n"))


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ('"Smith, J" <j@example.org>, b@example.net (Bob)', ["j@example.org", "b@example.net"]),
        ("team: a@example.org, b@example.org;", ["a@example.org", "b@example.org"]),
        ("=?utf-8?q?J=C3=B6?= <j@example.org>", ["j@example.org"]),
        ("Undisclosed recipients:;", []),
        ("Cron <root>", ["root@host.example.net"]),
    ],
)
def test_t_reads_ordinary_address_fields(value: str, want: list[str]) -> None:
    flds = _flds(b"To: " + value.encode() + b"\n\nbody\n")
    assert header_recipients(flds, "host.example.net") == want


def test_t_qualifies_bare_header_recipients() -> None:
    assert header_recipients(_flds(b"To: root\n\nx\n"), "host.example.net") == [
        "root@host.example.net"
    ]


# --- a bare CR is not a line end ------------------------------------------------------------


def test_bare_cr_in_a_header_is_refused_not_split() -> None:
    """Issue 27: `Subject: hi\\rBcc: evil@...` with -t delivered to evil."""
    lines = read_message(
        io.BytesIO(b"To: a@example.org\nSubject: hi\rBcc: evil@evil.example\n\nx\n"), False
    )
    assert lines[1] == b"Subject: hi\rBcc: evil@evil.example"  # one line, not two
    with pytest.raises(DataError, match="bare CR"):
        build_message(lines, Options(extract=True), "s@example.org", "s@example.org", "h.example")
    folded = b"To: a@example.org\nSubject: hi\n there\rBcc: evil@evil.example\n\nx\n"
    with pytest.raises(DataError, match="bare CR"):
        build_message(
            read_message(io.BytesIO(folded), False),
            Options(extract=True),
            "s@example.org",
            "s@example.org",
            "h.example",
        )


def test_bare_cr_in_the_body_is_kept_and_crlf_is_a_line_end() -> None:
    lines = read_message(
        io.BytesIO(b"Subject: hi\r\nTo: a@example.org\n\none\rtwo\r\nthree\n"), False
    )
    data, found = build_message(
        lines, Options(extract=True), "s@example.org", "s@example.org", "h.example"
    )
    assert found == ["a@example.org"]
    assert data.endswith(b"\r\n\r\none\rtwo\r\nthree\r\n")
    assert b"Subject: hi\r\n" in data


# --- -F as a display name -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "Cron Daemon",
        'Jo "the" Smith, Jr.',
        "back\\slash",
        "Jöhn Smïth",
        "=?utf-8?q?hi?=",
        "Bcc: evil@evil.example",
        "ü" * 100,
        "x" * 300,
        "a\tb",
    ],
)
def test_F_is_a_display_name_that_reads_back(name: str) -> None:
    line = from_header(name, "root@host.example.net")
    head = line + b"\r\nSubject: x\r\n\r\nbody\r\n"
    # folded lines only: every CRLF is followed by white space, so one field
    assert all(part[:1] in (b" ", b"\t") for part in line.split(b"\r\n")[1:])
    assert b"\n" not in line.replace(b"\r\n", b"")
    msg = email.message_from_bytes(head, policy=email.policy.default)
    assert msg["From"].addresses[0].addr_spec == "root@host.example.net"
    phrase = line[len(b"From: ") :].decode().replace("\r\n", "").rsplit(" <", 1)[0]
    if phrase.startswith('"'):  # a quoted string
        assert msg["From"].addresses[0].display_name == name
    else:  # atoms or encoded words (the white space between two of them is not text)
        assert str(email.header.make_header(email.header.decode_header(phrase))) == name
    assert list(msg.keys()) == ["From", "Subject"]
    assert display_name(name) != "" and len(max(line.split(b"\r\n"), key=len)) < 998


# --- audit: a folded Content-Transfer-Encoding is removed whole -----------------------------


def test_folded_cte_is_removed_whole_when_reencoding() -> None:
    """relay/inbound/longlines.py `_drop_field` (a long line re-encoded): the old field goes with
    its continuation line; another folded field stays whole."""
    body = b"x" * 1500 + b"\r\n"
    msg = (
        b"Subject: a folded\r\n subject\r\nContent-Type: text/plain\r\n"
        b"Content-Transfer-Encoding:\r\n 8bit\r\nX-After: kept\r\n\r\n" + body
    )
    out = conform(msg)
    assert out is not None
    head = out.split(b"\r\n\r\n", 1)[0]
    lines = head.split(b"\r\n")
    assert b" 8bit" not in lines
    assert [x for x in lines if x.lower().startswith(b"content-transfer-encoding")] == [
        b"Content-Transfer-Encoding: quoted-printable"
    ]
    assert b"Subject: a folded\r\n subject" in head
    assert b"X-After: kept" in lines
    parsed = email.message_from_bytes(out, policy=email.policy.default)
    assert parsed.get_content().rstrip("\r\n") == "x" * 1500


# --- the attack cases, as the program runs them (refused before any connection) -------------


def _run(cfg: Path, *args: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "relay.cli.sendmail", "-C", str(cfg), *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=60,
    )


def test_attack_cases_exit_before_sending(tmp_path: Path) -> None:
    import socket

    # a listener that accepts and records: nothing may connect to it
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    cfg = tmp_path / "relay.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"listen": [{"address": f"127.0.0.1:{port}"}], "spool": {"path": str(tmp_path)}}
        )
    )
    cases = [
        (["a@x.example\r\nRCPT TO:<evil@y.example>"], b"Subject: x\n\nhi\n", 64),
        (["-F", "Me\r\nBcc: evil@y.example", "a@x.example"], b"Subject: x\n\nhi\n", 64),
        (["-t"], b"To: a@x.example\nSubject: hi\rBcc: evil@y.example\n\nhi\n", 65),
        (["user@exa mple.org"], b"Subject: x\n\nhi\n", 64),
        (["root admin"], b"Subject: x\n\nhi\n", 64),
    ]
    for args, stdin, code in cases:
        res = _run(cfg, *args, stdin=stdin)
        assert res.returncode == code, (args, res.stderr)
        assert b"nothing sent" in res.stderr or b"CR, LF or NUL" in res.stderr, res.stderr
    with pytest.raises(TimeoutError):
        srv.accept()  # no case connected
    srv.close()
    assert not list(tmp_path.glob("**/*.msg"))
    res = _run(cfg, "root admin", stdin=b"x\n")
    assert b"'root admin'" in res.stderr


def test_header_fields_unfold_in_linear_time() -> None:
    """A long folded field: the work grows with the input, not with its square (counted in
    CPU time at 1x and 4x the size; quadratic unfolding grows ~16x)."""
    import time

    from relay.cli import sendmail as sm

    def cpu(n: int) -> float:
        headers = [b"Subject: x\r\n"] + [b" " + b"y" * 60 + b"\r\n"] * n
        best = float("inf")
        for _ in range(3):
            t = time.process_time()
            (field,) = sm.fields(headers)
            best = min(best, time.process_time() - t)
        assert len(field[1]) == 1 + 61 * n
        return best

    small, large = cpu(20_000), cpu(80_000)
    assert large < small * 8, (small, large)
