"""Long lines against a live daemon: a generated HTML line of 7,828 octets and a 60 KiB line
are accepted (Postfix takes them; a legacy app would drop the mail on a 5xx) and arrive with
every line at most 998 octets and the same decoded text; conforming mail stays byte-exact."""

from __future__ import annotations

import email
import email.policy
import time
from collections.abc import Callable

import pytest

from relay.inbound.longlines import MAX_LINE, longest_line
from tests.harness import RelayProcess, Upstream, send

pytestmark = pytest.mark.slow


def _wait(up: Upstream, needle: bytes) -> bytes:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for m in list(up.received):
            if needle in m.data:
                return m.data
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never arrived")


@pytest.mark.parametrize("length", [7828, 60 * 1024])
def test_long_lines_are_accepted_and_reencoded(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
    length: int,
) -> None:
    up = upstream()
    r = relay(upstream=up, config={"destinations": {"*": {"rate": "unlimited"}}})
    line = (b"<td>" + b"x" * 20 + b"</td>") * (length // 29 + 1)
    line = line[:length]
    mid = f"<long-{length}@longlines>".encode()
    msg = (
        b"From: app@example.com\r\nTo: user@example.org\r\nSubject: wide\r\nMessage-ID: "
        + mid
        + b"\r\nContent-Type: text/html; charset=utf-8\r\n\r\n"
        + line
        + b"\r\n"
    )
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    got = _wait(up, mid)
    assert longest_line(got) <= MAX_LINE
    part = email.message_from_bytes(got, policy=email.policy.compat32)
    assert part["Content-Transfer-Encoding"] == "quoted-printable"
    assert part.get_payload(decode=True).rstrip(b"\r\n") == line
    assert any(e.get("event") == "reencoded" for e in r.events())
