"""Large messages against a live daemon: streamed in, spooled to a file, streamed out, byte
for byte; over-size refused after the data; a client that hangs up mid-DATA leaves nothing
behind; a large resubmission without Message-ID is still recognised."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from relay.mail.message import normalize_line_endings, split_message
from relay.spool import dedup
from tests.harness import RelayProcess, Upstream, deep_merge, smarthost_config

pytestmark = pytest.mark.slow

MAX = 8 << 20


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RelayProcess, Upstream]]:
    up = Upstream().start()
    cfg = deep_merge(
        smarthost_config(up),
        {"destinations": {"*": {"rate": "unlimited"}}, "limits": {"max_message_size": MAX}},
    )
    r = RelayProcess(tmp_path_factory.mktemp("streaming"), cfg).start()
    try:
        yield r, up
    finally:
        r.close()
        up.stop()


def _reply(f: object) -> bytes:
    while True:
        line: bytes = f.readline()  # type: ignore[attr-defined]
        if not line or line[3:4] != b"-":
            return line


def _session(port: int) -> tuple[socket.socket, object]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    f = sock.makefile("rb")
    assert _reply(f).startswith(b"220")
    sock.sendall(b"EHLO client.test\r\n")
    assert _reply(f).startswith(b"250 ")
    return sock, f


def _send_raw(port: int, wire: bytes, rcpt: bytes = b"<user@example.org>") -> bytes:
    sock, f = _session(port)
    with sock:
        sock.sendall(b"MAIL FROM:<app@example.com> BODY=8BITMIME\r\nRCPT TO:" + rcpt + b"\r\n")
        assert _reply(f).startswith(b"250") and _reply(f).startswith(b"250")
        sock.sendall(b"DATA\r\n")
        assert _reply(f).startswith(b"354")
        sock.sendall(wire)
        reply = _reply(f)
        sock.sendall(b"NOOP\r\n")
        assert _reply(f).startswith(b"250")  # the session carries on
        return reply


def _wait(up: Upstream, needle: bytes, timeout: float = 60) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in list(up.received):
            if needle in m.data[:4096]:
                return m.data
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never arrived")


def test_a_large_message_arrives_byte_for_byte(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    head = b"Subject: big\r\nMessage-ID: <big-1@streaming>\r\n\r\n"
    line_kinds = [
        b"plain text line\r\n",
        b"..leading dot (stuffed)\r\n",
        b"bare LF\n",
        b"bare CR\r",
        b"\xc3\xa9t\xc3\xa9 8bit\r\n",
        b"x\n.\nnot the end\r\n",
        b"\r.\r also not\r\n",
    ]
    body = b"".join(line_kinds[i % len(line_kinds)] for i in range(250_000))  # ~5.5 MB
    wire = head + body + b"\r\n.\r\n"
    reply = _send_raw(r.port, wire)
    assert reply.startswith(b"250 2.0.0 Ok: queued as"), reply
    got = _wait(up, b"<big-1@streaming>")
    # what the relay promises: dots un-stuffed, bare CR/LF made CRLF, our Received on top
    expected_lines = []
    for line in (head + body + b"\r\n").split(b"\r\n")[:-1]:
        expected_lines.append(line[1:] if line.startswith(b".") else line)
    expected = normalize_line_endings(b"\r\n".join(expected_lines) + b"\r\n")
    assert got.startswith(b"Received: ")
    assert got.endswith(expected)
    assert len(got) - len(expected) < 300
    # the "." lines inside (from bare-LF/CR smuggling patterns) arrived as text: the
    # transparency dots were added on the way out and removed by the upstream
    assert b"x\r\n.\r\nnot the end\r\n" in got
    # no temporary left behind; the body is a file of its own
    tmp = r.spool / "bodies" / "tmp"
    assert not tmp.exists() or not any(tmp.iterdir())


def test_over_size_is_refused_after_the_data_and_the_session_continues(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, _up = live
    wire = b"Subject: huge\r\n\r\n" + (b"y" * 998 + b"\r\n") * (MAX // 1000 + 10) + b".\r\n"
    reply = _send_raw(r.port, wire)
    assert reply.startswith(b"552 5.3.4 "), reply


def test_a_client_that_hangs_up_mid_data_leaves_nothing(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, up = live
    sock, f = _session(r.port)
    with sock:
        sock.sendall(b"MAIL FROM:<app@example.com>\r\nRCPT TO:<user@example.org>\r\nDATA\r\n")
        assert _reply(f).startswith(b"250") and _reply(f).startswith(b"250")
        assert _reply(f).startswith(b"354")
        sock.sendall(
            b"Subject: cut\r\nMessage-ID: <cut@streaming>\r\n\r\n"
            + b"z" * 76
            + b"\r\n" * 1
            + (b"z" * 78 + b"\r\n") * 40_000
        )
        time.sleep(0.5)
        f.close()  # type: ignore[attr-defined]  # (makefile keeps the socket open)
    tmp = r.spool / "bodies" / "tmp"
    deadline = time.monotonic() + 10
    while tmp.exists() and any(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tmp.exists() or not any(tmp.iterdir())
    assert not any(m["message_id"] == "cut@streaming" for m in r.queue(all=True))
    assert _send_raw(
        r.port, b"Subject: next\r\nMessage-ID: <after-cut@s>\r\n\r\nok\r\n.\r\n"
    ).startswith(b"250 ")
    _wait(up, b"<after-cut@s>")


def test_a_large_resubmission_without_message_id_is_recognised(
    live: tuple[RelayProcess, Upstream],
) -> None:
    r, _up = live
    data = b"Subject: no id\r\nFrom: app@example.com\r\n\r\n" + (b"w" * 70 + b"\r\n") * 40_000
    first = _send_raw(r.port, data + b".\r\n", rcpt=b"<noid@example.org>")
    second = _send_raw(r.port, data + b".\r\n", rcpt=b"<noid@example.org>")
    assert first.startswith(b"250 2.0.0 Ok: queued as"), first
    assert second.startswith(b"250 2.0.0 Ok: already queued"), second
    head, body = split_message(data)
    mid = dedup.content_message_id(head, body, "relay.test")  # the whole-message formula
    assert any(m["message_id"] == mid.strip("<>") for m in r.queue(all=True))


def test_nul_bytes_are_stripped_and_logged(live: tuple[RelayProcess, Upstream]) -> None:
    r, up = live
    reply = _send_raw(r.port, b"Subject: nul\r\nMessage-ID: <nul@streaming>\r\n\r\na\x00b\r\n.\r\n")
    assert reply.startswith(b"250 ")
    got = _wait(up, b"<nul@streaming>")
    assert got.endswith(b"\r\n\r\nab\r\n") and b"\x00" not in got
    assert any(e.get("event") == "nul_stripped" and e.get("count") == 1 for e in r.events())


def test_the_event_loop_keeps_serving_during_a_large_upload(
    live: tuple[RelayProcess, Upstream],
) -> None:
    """Commit d13da60's promise (large messages are processed off the event loop) for the
    streamed DATA: while 7 MiB full of bare LFs (the normalising path) arrives, another
    client's NOOPs are answered promptly."""
    import threading

    r, up = live
    body = (
        b"Subject: lf\r\nMessage-ID: <lf-big@streaming>\r\n\r\n"
        + (b"bare lf line\n" * 40 + b"\r\n") * 14_000
    )  # CRLF lines of 522 octets (limit 1000)
    done = threading.Event()

    def upload() -> None:
        try:
            assert _send_raw(r.port, body + b"\r\n.\r\n").startswith(b"250 ")
        finally:
            done.set()

    sock, f = _session(r.port)
    worst = 0.0
    with sock:
        t = threading.Thread(target=upload)
        t.start()
        while not done.is_set():
            started = time.monotonic()
            sock.sendall(b"NOOP\r\n")
            assert _reply(f).startswith(b"250")
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.01)
        t.join()
        f.close()  # type: ignore[attr-defined]
    assert worst < 0.5, worst
    _wait(up, b"<lf-big@streaming>")
