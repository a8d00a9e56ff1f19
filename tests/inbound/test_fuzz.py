"""A bounded property-based fuzz of the inbound dialogue, twice: against the sans-I/O core
(relay/inbound/core.py) directly, thousands of dialogues a second, and over a real socket to a
real daemon (uvloop, STARTTLS and AUTH enabled): random and mutated command sequences,
smuggling patterns, long and broken lines, pipelined bursts and mid-command disconnects.

Against the core: it never raises, answers only with well-formed replies, never lets two
messages out of one DATA, acts on nothing after a bare CR/LF, keeps its buffer bounded, and
gives the same replies and events however the bytes are split into reads.
Against the daemon: it stays alive, never logs an ERROR or a traceback, never answers with
anything but a well-formed reply, never lets two messages out of one DATA, and still serves a
normal client afterwards.

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

from relay.inbound import auth, core
from tests.harness import (
    RelayProcess,
    Upstream,
    deep_merge,
    make_message,
    send,
    smarthost_config,
)

EXAMPLES = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "150"))
CORE_EXAMPLES = int(os.environ.get("RELAY_FUZZ_CORE_EXAMPLES", "500"))
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
@pytest.mark.slow
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


@pytest.mark.slow
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


# --- the same dialogues against the core, no socket ---------------------------------------

CORE = core.Settings(
    hostname="relay.test",
    max_size=64 * 1024,
    max_command=512,
    max_line=1001,
    max_errors=10,
    starttls=True,
    auth_offered=True,
    auth_plaintext=True,
)


def _run_core(stream: bytes, cuts: list[int]) -> tuple[bytes, list[object], list[bytes]]:
    """Feed `stream` split at `cuts`, deciding every event as a simple handler would; the
    replies, the events and each accepted message's data."""
    c = core.ServerCore(CORE)
    out = [c.greeting()]
    events: list[object] = []
    data = bytearray()
    messages: list[bytes] = []
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    closed_at: int | None = None
    for piece in [p for p in pieces if p] + [b""]:
        c.receive_data(piece)
        while True:
            ev = c.next_event()
            if ev is core.NEED_DATA or ev is core.PAUSED:
                break
            assert closed_at is None, f"{ev!r} after a bare CR/LF"
            if isinstance(ev, core.DataChunk):
                data += ev.data
                continue
            if isinstance(ev, core.DataEnd):  # the parser knows the longest line only
                # when it matters (over RFC 5322's 998: re-encoded, relay/inbound/longlines.py)
                # (and a refused message is discarded: its NUL count is not compared either)
                nuls = ev.nuls if ev.refusal is None else None
                events.append((ev.refusal, nuls, ev.longest > 998, ev.needs_reply))
                if ev.refusal is None:  # a refused message's data is discarded, not compared
                    messages.append(bytes(data))
                data.clear()
            else:
                events.append(ev)
            if isinstance(ev, core.BareNewline):
                closed_at = len(events)
            elif isinstance(ev, core.Ehlo):
                c.reply_lines([*ev.responses[:-1], "250-PIPELINING", ev.responses[-1]])
            elif isinstance(ev, core.Mail):
                c.reply("250 2.1.0 OK")
            elif isinstance(ev, core.Rcpt):
                c.reply("250 2.1.5 OK")
            elif isinstance(ev, core.DataEnd) and ev.needs_reply:
                c.reply("250 2.0.0 Ok: queued as Q")
            elif isinstance(ev, core.Auth):
                if ev.initial is None:
                    c.auth_challenge(b"")
                else:
                    c.auth_done(False, "535 5.7.8 Authentication credentials invalid")
            elif isinstance(ev, core.AuthAnswer):
                c.auth_done(False, None if ev.blob is None else "535 5.7.8 no")
            elif isinstance(ev, core.StartTls):
                # what follows on the wire would be TLS records, not these plaintext lines
                # (the core drops the plaintext pipelined after STARTTLS, RFC 3207 §5)
                out.append(c.data_to_send())
                return b"".join(out), events, messages
        out.append(c.data_to_send())
        if c.state is not core.State.DECIDE:  # memory: at most one incomplete line
            assert len(c._in) <= CORE.max_line + 1
    return b"".join(out), events, messages


@settings(max_examples=CORE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dialogue(), st.lists(st.integers(1, 4000), max_size=6))
def test_fuzz_core(case: tuple[list[bytes], bool], cuts: list[int]) -> None:
    lines, _ = case
    stream = b"EHLO fuzz.test\r\n" + b"".join(lines)
    replies, events, messages = _run_core(stream, [])
    for line in replies.split(b"\r\n")[:-1]:
        assert _REPLY.match(line + b"\r\n"), (lines, line)
    ends = len(re.findall(rb"(?=\r\n\.\r\n)", b"\r\n" + stream))
    queued = sum(1 for e in events if isinstance(e, tuple) and e[3])
    assert queued <= ends, lines
    assert SMUGGLED[:10] not in b"".join(
        e.address.encode("utf-8", "surrogateescape")
        for e in events
        if isinstance(e, (core.Mail, core.Rcpt))
    )
    # the same bytes in other reads: the same replies, events and message data
    split = sorted({c % (len(stream) + 1) for c in cuts})
    assert _run_core(stream, split) == (replies, events, messages), (lines, split)
