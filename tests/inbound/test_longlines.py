"""relay/inbound/longlines.py: lines over 998 octets are re-encoded so what goes upstream conforms
to RFC 5322, and what a reader sees (the decoded text) is unchanged."""

from __future__ import annotations

import email
import email.policy

from relay.inbound.longlines import MAX_LINE, conform, longest_line


def _decoded_text(data: bytes) -> list[bytes]:
    msg = email.message_from_bytes(data, policy=email.policy.compat32)
    return [p.get_payload(decode=True) for p in msg.walk() if not p.is_multipart()]


def test_conforming_messages_are_left_alone() -> None:
    msg = b"Subject: x\r\n\r\n" + b"a" * 998 + b"\r\nshort\r\n"
    assert conform(msg) is None


def test_single_part_html_with_a_7828_octet_line() -> None:
    html = b"<html><body>" + b"<td>cell</td>" * 600 + b"</body></html>"
    assert len(html) > 7800
    msg = (
        b"From: app@example.com\r\nSubject: report\r\nContent-Type: text/html;"
        b" charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n" + html + b"\r\n"
    )
    out = conform(msg)
    assert out is not None and longest_line(out) <= MAX_LINE
    assert out.startswith(b"From: app@example.com\r\nSubject: report\r\nContent-Type: text/html;")
    assert b"Content-Transfer-Encoding: quoted-printable\r\n" in out
    assert b"Content-Transfer-Encoding: 8bit" not in out
    assert b"MIME-Version: 1.0\r\n" in out
    assert _decoded_text(out)[0].replace(b"\r\n", b"\n") == (html + b"\r\n").replace(b"\r\n", b"\n")


def test_utf8_text_keeps_its_characters() -> None:
    text = ("zażółć gęślą jaźń " * 4000).encode()
    out = conform(b"Content-Type: text/plain; charset=utf-8\r\n\r\n" + text + b"\r\n")
    assert out is not None and longest_line(out) <= MAX_LINE
    assert _decoded_text(out)[0].rstrip(b"\r\n") == text


def test_multipart_reencodes_only_the_long_part() -> None:
    long_html = b"<p>" + b"y" * 60_000 + b"</p>"
    msg = (
        b"MIME-Version: 1.0\r\nContent-Type: multipart/alternative; boundary=BB\r\n\r\n"
        b"--BB\r\nContent-Type: text/plain\r\n\r\nshort text\r\n"
        b"--BB\r\nContent-Type: text/html\r\n\r\n" + long_html + b"\r\n--BB--\r\n"
    )
    out = conform(msg)
    assert out is not None and longest_line(out) <= MAX_LINE
    parts = _decoded_text(out)
    assert parts[0] == b"short text"
    assert parts[1].rstrip(b"\r\n") == long_html


def test_already_encoded_parts_and_long_headers_are_left() -> None:
    assert conform(b"X-Long: " + b"h" * 2000 + b"\r\n\r\nbody\r\n") is None
    b64 = b"Content-Transfer-Encoding: base64\r\n\r\n" + b"QUFB" * 400 + b"\r\n"
    assert conform(b64) is None
