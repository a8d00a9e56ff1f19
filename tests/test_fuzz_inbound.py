"""A bounded property-based fuzz of the inbound dialogue over a real socket to a real daemon
(uvloop, STARTTLS and AUTH enabled): random and mutated command sequences, smuggling
patterns, long and broken lines, pipelined bursts and mid-command disconnects.

It asserts that the daemon stays alive, never logs an ERROR or a traceback, never answers
with anything but a well-formed reply, never lets two messages out of one DATA, and still
serves a normal client afterwards.

`make test` runs RELAY_FUZZ_EXAMPLES (default 150) examples, well under a minute;
`make fuzz` runs many more."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay import auth
from tests.harness import (
    RelayProcess,
    Upstream,
    deep_merge,
    make_message,
    send,
    smarthost_config,
)

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "150"))
_REPLY = re.compile(rb"^[2-5][0-9][0-9][ -]")
SMUGGLED = b"<smuggled-%d@fuzz.test>"


@pytest.fixture(scope="module")
def fuzz_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RelayProcess, Upstream]]:
    up = Upstream().start()
    workdir = tmp_path_factory.mktemp("fuzz")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(workdir / "cert.pem"))
    cert.private_key_pem.write_to_path(str(workdir / "key.pem"))
    (workdir / "users").write_text(f"alice:{auth.hash_password('secret-pw')}\n")
    cfg = deep_merge(
        smarthost_config(up),
        {
            "destinations": {"*": {"rate": "unlimited"}},
            "limits": {"max_message_size": "64KiB", "max_recipients": 5},
        },
    )
    r = RelayProcess(workdir, cfg)
    lst = r.config["listen"][0]
    lst["tls"] = {"cert_file": "cert.pem", "key_file": "key.pem"}
    lst["auth"] = {"users_file": "users", "allow_plaintext": True}
    r.write_config()
    r.start()
    try:
        yield r, up
    finally:
        r.close()
        up.stop()


# --- the grammar of what a client may send -------------------------------------------------

_addresses = st.sampled_from(
    [
        b"<app@example.com>",
        b"<>",
        b"<user@example.org>",
        b'<"q d"@example.org>',
        b"<a@aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa_>",
        b"<",
        b"<a@",
        b"<@>",
        b'<"\r<x@evil.example>"@example.org>',
        b"<ok@example.com\n>",
        b"<\x00@x>",
        b"<j\xc3\xb6s\xc3\xa9@ex\xc3\xa4mple.org>",
        b"<caf\xe9@example.com>",
        b"user@example.org",
    ]
)
_params = st.sampled_from(
    [
        b"",
        b" SIZE=100",
        b" BODY=8BITMIME",
        b" SMTPUTF8",
        b" SIZE=x",
        b" SIZE=99999999999",
        b" FOO=bar",
        b" BODY=BINARYMIME",
    ]
)
_smuggle = st.sampled_from(
    [
        b"\n.\n",
        b"\r.\r",
        b"\n.\r\n",
        b"\r\n.\n",
        b"\r\n.\r",
        b".\r\n",
        b"..\r\n",
        b"\r\n.\r\n",
    ]
)


@st.composite
def _body(draw: Any) -> bytes:
    head = b"Subject: fuzz\r\nMessage-ID: <fuzz-%d@fuzz.test>\r\n\r\n" % draw(st.integers(0, 10**9))
    parts = draw(
        st.lists(
            st.one_of(
                st.binary(max_size=60),
                _smuggle,
                st.builds(
                    lambda n: (
                        b"MAIL FROM:<a@b.c>\r\nRCPT TO:<evil@example.org>\r\nDATA\r\n"
                        b"Message-ID: " + SMUGGLED % n + b"\r\n\r\nsmuggled\r\n"
                    ),
                    st.integers(0, 10**12),
                ),
                st.just(b"x" * 1100 + b"\r\n"),  # over the line limit
            ),
            max_size=6,
        )
    )
    return head + b"".join(parts)


_commands = st.one_of(
    st.sampled_from(
        [
            b"EHLO client.test",
            b"HELO client.test",
            b"EHLO",
            b"RSET",
            b"NOOP",
            b"HELP",
            b"VRFY x",
            b"EXPN x",
            b"QUIT",
            b"STARTTLS",
            b"AUTH PLAIN",
            b"AUTH LOGIN",
            b"AUTH PLAIN AGFsaWNlAHdyb25n",
            b"AUTH CRAM-MD5",
            b"*",
            b"DATA",
            b"BDAT 10 LAST",
            b"",
            b" ",
            b"\x00",
            b"\xff\xfe",
        ]
    ),
    st.builds(lambda a, p: b"MAIL FROM:" + a + p, _addresses, _params),
    st.builds(lambda a, p: b"RCPT TO:" + a + p, _addresses, _params),
    st.builds(lambda n: b"NOOP " + b"x" * n, st.integers(0, 3000)),
    st.binary(max_size=40),
)


@st.composite
def dialogue(draw: Any) -> tuple[list[bytes], bool]:
    """Lines (each with its own ending: CRLF mostly, sometimes bare LF/CR or none), and
    whether to hang up in the middle."""
    lines: list[bytes] = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            lines.append(
                b"DATA\r\n" + draw(_body()) + draw(st.sampled_from([b"\r\n.\r\n", b"\n.\n", b""]))
            )
        else:
            ending = draw(st.sampled_from([b"\r\n"] * 6 + [b"\n", b"\r", b""]))
            lines.append(draw(_commands) + ending)
    return lines, draw(st.booleans())


def _exchange(port: int, lines: list[bytes], hang_up: bool) -> list[bytes]:
    """Send everything in one pipelined burst (then maybe hang up), collect the replies."""
    replies: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        f = sock.makefile("rb")
        try:
            sock.sendall(b"EHLO fuzz.test\r\n" + b"".join(lines))
            if hang_up:
                return replies
            sock.settimeout(0.15)  # replies come at once; waiting longer only counts fewer
            while True:
                try:
                    line = f.readline(4096)
                except (TimeoutError, OSError):
                    break
                if not line:
                    break
                replies.append(line)
        finally:
            f.close()
    return replies


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(dialogue())
def test_fuzz_dialogue(
    fuzz_relay: tuple[RelayProcess, Upstream], case: tuple[list[bytes], bool]
) -> None:
    r, _up = fuzz_relay
    lines, hang_up = case
    replies = _exchange(r.port, lines, hang_up)
    # Never two messages out of one DATA: each message accepted needs a <CRLF>.<CRLF> of
    # its own in what the client sent (a bare-LF/CR variant must never end a DATA).
    stream = b"\r\nEHLO fuzz.test\r\n" + b"".join(lines)
    ends = len(re.findall(rb"(?=\r\n\.\r\n)", stream))
    queued = sum(1 for line in replies if line.startswith(b"250 2.0.0 Ok:"))
    assert queued <= ends, (lines, replies)
    for line in replies:
        # the TLS handshake bytes after a 220 to STARTTLS are not SMTP: stop there
        if not _REPLY.match(line):
            break
        assert b"Internal error" not in line, (lines, replies)
    assert r.proc is not None and r.proc.poll() is None, r.logs()[-3000:]


def test_after_the_fuzz(fuzz_relay: tuple[RelayProcess, Upstream]) -> None:
    """Runs after test_fuzz_dialogue (same module, file order)."""
    r, up = fuzz_relay
    assert r.proc is not None and r.proc.poll() is None
    send(
        r.port,
        "app@example.com",
        ["user@example.org"],
        make_message(message_id="<after-fuzz@fuzz.test>"),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
        b"<after-fuzz@fuzz.test>" in m.data for m in up.received
    ):
        time.sleep(0.1)
    assert any(b"<after-fuzz@fuzz.test>" in m.data for m in up.received)
    bad = [
        e for e in r.events() if e.get("level") in ("ERROR", "CRITICAL") or "Traceback" in str(e)
    ]
    assert not bad, bad[:5]
    assert "Traceback" not in r.logs()
