"""Inbound SMTP against a live daemon: limits and their RFC 5321 replies, malformed input,
the relay-access check, SMTP smuggling, pipelining, the null sender. After every refusal the
session and the daemon carry on."""

from __future__ import annotations

import contextlib
import smtplib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness import (
    Received,
    RelayProcess,
    Upstream,
    deep_merge,
    make_message,
    smarthost_config,
    smtp_session,
)

UpFactory = Callable[..., Upstream]
RelayFactory = Callable[..., RelayProcess]

MAX_SIZE = 10_000
MAX_RCPTS = 3


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RelayProcess, Upstream]]:
    """One daemon for the module (each test uses its own Message-IDs)."""
    up = Upstream().start()
    cfg = deep_merge(
        smarthost_config(up),
        {
            "limits": {
                "max_message_size": MAX_SIZE,
                "max_recipients": MAX_RCPTS,
                "max_line_length": 1000,
            },
            "destinations": {"*": {"rate": "unlimited"}},
        },
    )
    r = RelayProcess(tmp_path_factory.mktemp("limits"), cfg).start()
    try:
        yield r, up
    finally:
        r.close()
        up.stop()


def wait_mid(up: Upstream, mid: str, timeout: float = 30.0) -> list[Received]:
    """Every upstream message carrying this Message-ID, once at least one arrived."""
    needle = f"Message-ID: {mid}\r\n".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [m for m in list(up.received) if needle in m.data]
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{mid} never reached the upstream")


def with_mid(up: Upstream, mid: str) -> list[Received]:
    needle = f"Message-ID: {mid}\r\n".encode()
    return [m for m in list(up.received) if needle in m.data]


def spool_mids(r: RelayProcess) -> list[str]:
    return [m["message_id"] for m in r.queue(all=True)]


def bare_line_endings(data: bytes) -> int:
    rest = data.replace(b"\r\n", b"")
    return rest.count(b"\r") + rest.count(b"\n")


def alive(r: RelayProcess) -> bool:
    return r.proc is not None and r.proc.poll() is None


# --- EHLO ------------------------------------------------------------------------------------


def test_ehlo_advertises_the_extensions(live: tuple[RelayProcess, Upstream]) -> None:
    r, _up = live
    with smtp_session(r.port) as s:
        code, _msg = s.ehlo("client.test")
        assert code == 250
        feats = s.esmtp_features
        for ext in ("size", "8bitmime", "pipelining", "enhancedstatuscodes"):
            assert ext in feats, (ext, feats)
        assert feats["size"] == str(MAX_SIZE)
        # replies carry enhanced status codes (RFC 2034)
        assert s.noop() == (250, b"2.0.0 OK")


# --- size ------------------------------------------------------------------------------------


def test_declared_size_over_the_limit_is_refused_at_mail(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, up = live
    with smtp_session(r.port) as s:
        code, msg = s.mail("app@example.com", [f"SIZE={MAX_SIZE + 1}"])
        assert code == 552 and msg.startswith(b"5.3.4 ")
        # the session carries on: a declared size within the limit is fine
        msg_bytes = make_message(subject="declared size", message_id="<size-ok@limits>")
        assert s.mail("app@example.com", [f"SIZE={len(msg_bytes)}"])[0] == 250
        assert s.rcpt("user@example.org")[0] == 250
        assert s.data(msg_bytes)[0] == 250
    assert len(wait_mid(up, "<size-ok@limits>")) == 1
    assert alive(r)


def test_too_much_data_is_refused_and_the_session_continues(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, up = live
    # lines of 500 octets: no single line is too long, only the total is
    big = make_message(message_id="<too-big@limits>", body=(b"y" * 498 + b"\r\n") * 40)
    assert len(big) > MAX_SIZE
    after = make_message(message_id="<after-too-big@limits>")
    with smtp_session(r.port) as s:
        assert s.mail("app@example.com")[0] == 250  # no SIZE declared: caught during DATA
        assert s.rcpt("user@example.org")[0] == 250
        code, reply = s.data(big)  # smtplib returns the reply to the final dot
        assert code == 552 and reply.startswith(b"5.3.4 "), (code, reply)
        # same connection, next transaction
        assert s.sendmail("app@example.com", ["user@example.org"], after) == {}
    assert len(wait_mid(up, "<after-too-big@limits>")) == 1
    mids = spool_mids(r)
    assert "after-too-big@limits" in mids and "too-big@limits" not in mids
    assert with_mid(up, "<too-big@limits>") == []
    assert alive(r)


def _sized(mid: str, size: int) -> bytes:
    """A message of exactly `size` octets in lines of at most 100."""
    head = make_message(message_id=mid, body=b"")
    n = size - len(head)
    k = (n - 2) // 100
    rest = n - 100 * k  # 2..101
    msg = head + (b"z" * 98 + b"\r\n") * k + b"w" * (rest - 2) + b"\r\n"
    assert len(msg) == size
    return msg


def test_size_limit_boundary(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    at = _sized("<at-limit@limits>", MAX_SIZE)
    over = _sized("<over-limit@limits>", MAX_SIZE + 1)
    with smtp_session(r.port) as s:
        # what counts is the DATA as sent, before the final dot
        assert s.sendmail("app@example.com", ["user@example.org"], at) == {}
        assert s.mail("app@example.com")[0] == 250
        assert s.rcpt("user@example.org")[0] == 250
        assert s.data(over)[0] == 552
    got = wait_mid(up, "<at-limit@limits>")
    assert got[0].data.endswith(at)
    assert "over-limit@limits" not in spool_mids(r)


# --- recipients ------------------------------------------------------------------------------


def test_too_many_recipients(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    rcpts = [f"many{i}@example.org" for i in range(MAX_RCPTS + 2)]
    with smtp_session(r.port) as s:
        assert s.mail("app@example.com")[0] == 250
        replies = [s.rcpt(a) for a in rcpts]
        assert [c for c, _m in replies[:MAX_RCPTS]] == [250] * MAX_RCPTS
        for code, msg in replies[MAX_RCPTS:]:
            assert code == 452 and msg.startswith(b"4.5.3 ")
        assert s.data(make_message(message_id="<many@limits>"))[0] == 250
    got = wait_mid(up, "<many@limits>")
    # the accepted recipients get it, the refused ones do not (the client retries them)
    assert sorted(a for m in got for a in m.rcpt_tos) == sorted(rcpts[:MAX_RCPTS])
    assert alive(r)


# --- line length -----------------------------------------------------------------------------


def test_over_long_line_in_data_and_the_session_continues(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, up = live
    # over limits.max_line_length (1000 here; 64 KiB by default): refused
    long_line = make_message(message_id="<long-line@limits>", body=b"x" * 2000 + b"\r\n")
    after = make_message(message_id="<after-long-line@limits>")
    with smtp_session(r.port) as s:
        assert s.mail("app@example.com")[0] == 250
        assert s.rcpt("user@example.org")[0] == 250
        code, reply = s.data(long_line)
        assert code == 500 and reply.startswith(b"5.5.2 "), (code, reply)
        assert s.sendmail("app@example.com", ["user@example.org"], after) == {}
    wait_mid(up, "<after-long-line@limits>")
    assert "long-line@limits" not in spool_mids(r)
    assert alive(r)


def test_998_octet_lines_are_fine_even_when_dot_stuffed(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, up = live
    body = b"a" * 998 + b"\r\n" + b"." + b"b" * 997 + b"\r\n"
    msg = make_message(message_id="<max-line@limits>", body=body)
    with smtp_session(r.port) as s:
        assert s.sendmail("app@example.com", ["user@example.org"], msg) == {}
    assert wait_mid(up, "<max-line@limits>")[0].data.endswith(msg)


def test_over_long_command_line(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    with smtp_session(r.port) as s:
        code, msg = s.docmd("MAIL", "FROM:<" + "a" * 600 + "@example.com>")
        assert code == 500 and msg.startswith(b"5.5.2 ")
        code, msg = s.docmd("NOOP", "x" * 2000)
        assert code == 500
        assert (
            s.sendmail(
                "app@example.com",
                ["user@example.org"],
                make_message(message_id="<after-cmd@limits>"),
            )
            == {}
        )
    wait_mid(up, "<after-cmd@limits>")


# --- malformed addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rcpt",
    [
        "<no domain>",  # (a bare `<nodomain>` from an allowed client is qualified: local.domain)
        "<@@>",
        "<user@>",
        "<@example.org>",
        "<a@b..example>",
        "<a@exa_mple.org>",
        "<a@-bad.example>",
    ],
)
def test_malformed_recipient(live: tuple[RelayProcess, Upstream], rcpt: str) -> None:
    r, _up = live
    with smtp_session(r.port) as s:
        assert s.mail("app@example.com")[0] == 250
        code, msg = s.docmd("RCPT", f"TO:{rcpt}")
        assert code in (501, 553), (rcpt, code, msg)
        assert msg[:2] == b"5."  # enhanced code
        # the transaction is still usable
        assert s.rcpt("user@example.org")[0] == 250
        assert s.rset()[0] == 250
    assert alive(r)


@pytest.mark.parametrize("sender", ["<no domain>", "<a@b..example>", "<@>", "<x@exa_mple.org>"])
def test_malformed_sender(live: tuple[RelayProcess, Upstream], sender: str) -> None:
    r, _up = live
    with smtp_session(r.port) as s:
        code, msg = s.docmd("MAIL", f"FROM:{sender}")
        assert code in (501, 553), (sender, code, msg)
        assert msg[:2] == b"5."
        assert s.mail("app@example.com")[0] == 250  # no transaction was started
    assert alive(r)


def test_addresses_that_are_not_utf8_are_refused_at_once(
    live: tuple[RelayProcess, Upstream],
) -> None:
    """Not "451 try again later" after the DATA, forever: the address can never be valid."""
    r, _up = live
    with raw_session(r.port) as (sock, f):
        sock.sendall(b"MAIL FROM:<caf\xe9@example.com>\r\n")
        reply = read_reply(f)[-1]
        assert reply[:3] in (b"501", b"553") and reply[4:6] == b"5.", reply
        sock.sendall(b"MAIL FROM:<app@example.com>\r\nRCPT TO:<caf\xe9@example.org>\r\n")
        assert read_reply(f)[-1].startswith(b"250 ")
        reply = read_reply(f)[-1]
        assert reply[:3] in (b"501", b"553") and reply[4:6] == b"5.", reply
        sock.sendall(b"QUIT\r\n")
        assert read_reply(f)[-1].startswith(b"221 ")
    assert alive(r)


def test_message_id_with_8bit_bytes_is_accepted_and_relayed(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, up = live
    msg = make_message(message_id="<cafX-8bit@limits>").replace(b"cafX", b"caf\xe9")
    assert b"\xe9" in msg
    with smtp_session(r.port) as s:
        assert s.mail("app@example.com", ["BODY=8BITMIME"])[0] == 250
        assert s.rcpt("user@example.org")[0] == 250
        code, reply = s.data(msg)
        assert code == 250, reply
    deadline = time.monotonic() + 30
    while not [m for m in list(up.received) if b"<caf\xe9-8bit@limits>" in m.data]:
        assert time.monotonic() < deadline, "never relayed"
        time.sleep(0.05)
    (m,) = [m for m in list(up.received) if b"<caf\xe9-8bit@limits>" in m.data]
    assert m.data.endswith(msg)
    # a resend is still recognised as the same message
    with smtp_session(r.port) as s:
        s.mail("app@example.com", ["BODY=8BITMIME"])
        s.rcpt("user@example.org")
        assert b"duplicate" in s.data(msg)[1]
    assert any("8bit@limits" in m["message_id"] for m in r.queue(all=True))


# --- the null sender ---------------------------------------------------------------------------


def test_null_sender_is_accepted_and_relayed_as_null(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    msg = make_message(message_id="<null-sender@limits>", subject="Delivery Status Notification")
    with smtp_session(r.port) as s:
        assert s.docmd("MAIL", "FROM:<>") == (250, b"2.1.0 OK")
        assert s.rcpt("user@example.org")[0] == 250
        assert s.data(msg)[0] == 250
    got = wait_mid(up, "<null-sender@limits>")
    assert len(got) == 1
    assert got[0].mail_from == "<>"  # aiosmtpd's rendering of MAIL FROM:<>
    assert "MAIL <>" in up.commands
    assert got[0].data.endswith(msg)
    (entry,) = [m for m in r.queue(all=True) if m["message_id"] == "null-sender@limits"]
    assert entry["sender"] == ""


# --- pipelining --------------------------------------------------------------------------------


def read_reply(f: Any) -> list[bytes]:
    lines = []
    while True:
        line = f.readline()
        assert line, f"connection closed; got {lines}"
        lines.append(line)
        if line[3:4] == b" ":
            return lines


@contextlib.contextmanager
def raw_session(port: int, ehlo: bool = True) -> Iterator[tuple[socket.socket, Any]]:
    """A plain socket (for bytes smtplib would not send) and a reader of its replies."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        f = sock.makefile("rb")
        try:
            assert read_reply(f)[0].startswith(b"220 ")
            if ehlo:
                sock.sendall(b"EHLO client.test\r\n")
                assert b"250-PIPELINING\r\n" in read_reply(f)
            yield sock, f
        finally:
            f.close()


def test_pipelined_transaction(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    msg = make_message(message_id="<pipelined@limits>")
    with raw_session(r.port) as (sock, f):
        # one write for the whole envelope (RFC 2920)
        sock.sendall(
            b"MAIL FROM:<app@example.com>\r\nRCPT TO:<p1@example.org>\r\n"
            b"RCPT TO:<bad address>\r\nRCPT TO:<p2@example.org>\r\nDATA\r\n"
        )
        codes = [read_reply(f)[-1][:3] for _ in range(5)]
        assert codes == [b"250", b"250", b"501", b"250", b"354"]
        sock.sendall(msg + b".\r\nQUIT\r\n")
        assert read_reply(f)[-1].startswith(b"250 2.0.0 ")
        assert read_reply(f)[-1].startswith(b"221 ")
    got = wait_mid(up, "<pipelined@limits>")
    assert sorted(got[0].rcpt_tos) == ["p1@example.org", "p2@example.org"]


# --- SMTP smuggling ----------------------------------------------------------------------------

SMUGGLED = (
    b"MAIL FROM:<evil@example.com>\r\nRCPT TO:<victim@example.org>\r\nDATA\r\n"
    b"From: ceo@example.com\r\nSubject: smuggled\r\n\r\nsend money\r\n"
)


@pytest.mark.parametrize(
    "fake_end",
    [b"\n.\r\n", b"\r\n.\n", b"\n.\n", b"\r.\r\n", b"\r\n.\r", b"\r.\r"],
    ids=["LF.CRLF", "CRLF.LF", "LF.LF", "CR.CRLF", "CRLF.CR", "CR.CR"],
)
def test_smuggling_never_makes_a_second_message(
    live: tuple[RelayProcess, Upstream], fake_end: bytes
) -> None:
    r, up = live
    tag = fake_end.hex()
    mid = f"<smuggle-{tag}@limits>"
    head = (
        b"From: app@example.com\r\nTo: user@example.org\r\nSubject: innocent\r\n"
        b"Message-ID: " + mid.encode() + b"\r\n\r\nhello"
    )
    with raw_session(r.port) as (sock, f):
        sock.sendall(b"MAIL FROM:<app@example.com>\r\nRCPT TO:<user@example.org>\r\nDATA\r\n")
        assert [read_reply(f)[-1][:3] for _ in range(3)] == [b"250", b"250", b"354"]
        sock.sendall(head + fake_end + SMUGGLED + b".\r\nQUIT\r\n")
        replies = [read_reply(f)[-1]]
        replies.append(read_reply(f)[-1])
        sock.settimeout(5)
        assert f.read() == b""  # closed after 221: no reply to any smuggled command
    # exactly one reply for the DATA, then the 221. Our documented choice (README, "SMTP
    # smuggling") is to keep the bare CR/LF inside the body: accepted, not refused.
    assert replies[0].startswith(b"250 2.0.0 "), replies
    assert replies[1].startswith(b"221 "), replies
    got = wait_mid(up, mid)
    assert len(got) == 1
    m = got[0]
    assert m.mail_from == "app@example.com" and m.rcpt_tos == ["user@example.org"]
    assert bare_line_endings(m.data) == 0
    assert b"send money" in m.data  # kept inside the one message's body
    # and nothing else was queued from this session: the spool has this one message only
    r.wait_until(
        lambda: (
            [
                (x["message_id"], x["state"])
                for x in r.queue(all=True)
                if x["message_id"] == mid.strip("<>") or x["sender"] == "evil@example.com"
            ]
            == [(mid.strip("<>"), "sent")]
        ),
        what="one sent message",
    )
    assert "victim@example.org" not in up.recipients()


# --- relay access ------------------------------------------------------------------------------


def test_client_outside_allow_is_refused_at_rcpt(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up, start=False)
    r.config["listen"] = [{"address": f"127.0.0.1:{r.port}", "allow": ["10.0.0.0/8"]}]
    r.write_config()
    r.start()
    with smtp_session(r.port) as s:
        assert s.mail("app@example.com")[0] == 250
        for rcpt in ("user@example.org", "someone@relay.test", "postmaster@localhost.localdomain"):
            code, msg = s.rcpt(rcpt)
            assert code == 554 and msg.startswith(b"5.7.1 "), (rcpt, code, msg)
        code, _msg = s.docmd("DATA")
        assert code == 503  # no valid recipient: no transaction to send
    with pytest.raises(smtplib.SMTPRecipientsRefused), smtp_session(r.port) as s:
        s.sendmail("app@example.com", ["user@example.org"], make_message(1))
    assert r.queue(all=True) == []
    assert up.received == []
    assert alive(r)
