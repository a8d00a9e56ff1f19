"""Raw message bytes: line endings, the header block, and the headers we add.

Rules:
- Stored and relayed messages end every line with CRLF (RFC 5321 §2.3.8). A bare LF or bare
  CR inside the DATA (the raw material of SMTP smuggling) is turned into CRLF at accept, so
  what goes upstream never carries a bare line ending and never a second message: aiosmtpd
  ends DATA only at <CRLF>.<CRLF>, and aiosmtplib dot-stuffs every line that begins with ".".
- The header block is everything up to the first empty line (RFC 5322 §2.1).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from datetime import UTC, datetime
from email.utils import format_datetime

from relay.mail import addrlist

_BARE = re.compile(rb"\r\n|\r|\n")
_HEADER_END = b"\r\n\r\n"


def normalize_line_endings(data: bytes) -> bytes:
    if b"\r" not in data and b"\n" not in data:
        return data
    # fast path: already CRLF-only
    if data.count(b"\n") == data.count(b"\r\n") and data.count(b"\r") == data.count(b"\r\n"):
        return data
    return _BARE.sub(b"\r\n", data)


# find_dot_line: dots looked at one by one before one search for the whole pattern
_FEW = 16
_SHORT = 4096  # octets: below this, one search costs less than a few steps of Python


def find_dot_line(buf: bytes | bytearray, start: int, pattern: bytes) -> int:
    """The first index >= `start` of `pattern`, a line end and then a dot (and maybe more:
    the DATA parser's CRLF "." and CRLF "." CRLF, delivery's LF "."): found from the dots
    (`find` of one octet is a memchr), each of the first `_FEW` checked in place, then one
    search for the pattern from the next. Most large bodies have few dots (a base64 one
    none, the header block some), so this is one memchr pass where a search for the pattern
    would be one of CPython's slower scans over CRLF-dense text (70-90 us per 100 KiB); text
    full of dots costs `_FEW` steps more than that search alone, so a short buffer is
    searched at once."""
    if len(buf) - start < _SHORT:
        return buf.find(pattern, start)
    at = pattern.index(b".")  # the dot's place in the pattern
    dot = buf.find(b".", start + at)
    for _ in range(_FEW):
        if dot < 0:
            return -1
        if buf.startswith(pattern, dot - at):
            return dot - at
        dot = buf.find(b".", dot + 1)
    return -1 if dot < 0 else buf.find(pattern, dot - at)


def split_message(data: bytes) -> tuple[bytes, bytes]:
    """(header block including its final CRLF, body after the empty line)."""
    if data.startswith(b"\r\n"):
        return b"", data[2:]
    i = data.find(_HEADER_END)
    if i < 0:
        return data, b""
    return data[: i + 2], data[i + 4 :]


def parse_headers(block: bytes) -> list[tuple[str, str]]:
    """Unfolded (name, value) pairs; undecodable bytes survive as surrogates. A field's
    lines are collected and joined once: linear time, whatever the folding (a value grown
    line by line copied it again for each line, quadratic in a 1 MiB folded field)."""
    out: list[tuple[str, str]] = []
    name: str | None = None
    parts: list[str] = []
    text = block.decode("utf-8", errors="surrogateescape")
    for line in text.split("\r\n"):
        if not line:
            continue
        if line[0] in " \t" and name is not None:
            parts.append(line.strip())
            continue
        field, sep, value = line.partition(":")
        if sep and field and " " not in field.strip():
            if name is not None:
                out.append((name, " ".join(parts)))
            name, parts = field.strip(), [value.strip()]
        # any other line is skipped; a continuation after it still belongs to the field
        # before it, as it always did (content Message-IDs hash these values)
    if name is not None:
        out.append((name, " ".join(parts)))
    return out


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    low = name.lower()
    for n, v in headers:
        if n.lower() == low:
            return v
    return None


# Trace and transport headers that differ between two submissions of the same message
# (RFC 5321 §4.4; RFC 5322 §3.6.7), left out when deriving a content Message-ID. `Date` stays
# in: a daily cron report with the same text but a new Date is a new message.
TRACE_HEADERS = frozenset(
    {"received", "return-path", "x-received", "delivered-to", "x-originating-ip"}
)


def rfc5322_date(now: float | None = None) -> str:
    """A Date: value with a numeric zone (RFC 5322 §3.3): `Wed, 02 Dec 2026 19:00:00 +0000`.
    Formatted once a second (email.utils' format_datetime takes ~14 us; every accepted
    message has a Received: line and often a Date: of ours)."""
    global _date_cache
    t = time.time() if now is None else now
    second = math.floor(t)
    cached = _date_cache
    if cached[0] == second:
        return cached[1]
    text = format_datetime(datetime.fromtimestamp(second, UTC))
    _date_cache = (second, text)
    return text


_date_cache: tuple[int, str] = (-(2**62), "")  # (a second, its text)


# what of a HELO name a Received: line leaves out (compiled once: `re.sub` with a pattern
# string looks it up in re's cache at every call)
_HELO_UNSAFE = re.compile(r"[^\w.\-\[\]:]", re.ASCII)


def received_header(
    *,
    helo: str,
    peer_ip: str,
    hostname: str,
    queue_id: str,
    recipient: str | None,
    protocol: str,
    now: float | None = None,
) -> bytes:
    """The Received: trace header (RFC 5321 §4.4), folded below 78 columns. A UTF-8
    recipient stays UTF-8 (RFC 6532 §3.7 allows it in a message sent with SMTPUTF8); our
    own parts are ASCII."""
    helo_clean = _HELO_UNSAFE.sub("", helo)[:100] or "unknown"
    lines = [
        f"Received: from {helo_clean} ([{peer_ip}])",
        f"\tby {hostname} (relay) with {protocol} id {queue_id}",
    ]
    if recipient:
        lines.append(f"\tfor <{recipient}>")
    lines[-1] += f"; {rfc5322_date(now)}"
    return ("\r\n".join(lines) + "\r\n").encode("utf-8", errors="replace")


def date_header(now: float | None = None) -> bytes:
    """The Date: a legacy app forgot (RFC 5322 §3.6.1 requires one), as Postfix adds it."""
    return f"Date: {rfc5322_date(now)}\r\n".encode("ascii")


_ADDRESS_FIELDS = frozenset({b"from", b"to", b"cc", b"reply-to", b"sender"})


def qualify_headers(headers: list[bytes], domain: str) -> list[bytes]:
    """`From: root (Cron Daemon)` -> `From: root@<domain> (Cron Daemon)`: bare local parts
    in the address fields get the local domain, as nullmailer and Postfix's myorigin do.
    `headers` are the header lines as split (without CRLF). Each field is read whole, folds
    included, as an RFC 5322 address list (relay/mail/addrlist.py): only an addr-spec without "@"
    (`root`, `<root>`, `Root <root>`) changes, by an insertion in place; display names,
    comments, quoted strings, groups, encoded words and the folding stay byte for byte,
    and a field that cannot be read with certainty is left exactly as it came. Nothing to
    change: `headers` itself is returned (no copy)."""
    out: list[bytes] | None = None  # a copy from the first field that changes; else `headers`
    i = 0
    n = len(headers)
    while i < n:
        j = i + 1
        while j < n and headers[j][:1] in (b" ", b"\t"):
            j += 1
        first = headers[i]
        name, colon, _ = first.partition(b":")
        if colon and first[:1] not in (b" ", b"\t") and name.strip().lower() in _ADDRESS_FIELDS:
            new = addrlist.qualify_field(b"\r\n".join(headers[i:j]), domain)
            if new is not None:
                if out is None:
                    out = headers[:i]
                out += new.split(b"\r\n")
                i = j
                continue
        if out is not None:
            out += headers[i:j]
        i = j
    return headers if out is None else out


def qualify_header_block(data: bytes, domain: str) -> bytes | None:
    """`qualify_headers` over a whole message's header block; None when nothing changed."""
    head, body = split_message(data)
    if not head:
        return None
    lines = head[:-2].split(b"\r\n")
    new = qualify_headers(lines, domain)
    if new is lines:
        return None
    return b"\r\n".join(new) + b"\r\n\r\n" + body


def strip_header(data: bytes, name: str) -> bytes | None:
    """`data` (a whole message) without every field `name` of its header block (with its
    continuation lines); None when it has none. The body and every other line are kept byte
    for byte."""
    head, sep, _ = data.partition(_HEADER_END)
    if not sep:
        head = data
    low = name.lower().encode() + b":"
    lines = head.split(b"\r\n")
    kept: list[bytes] = []
    dropping = False
    for line in lines:
        if line[:1] in (b" ", b"\t") and dropping:
            continue
        dropping = line[: len(low)].lower() == low
        if not dropping:
            kept.append(line)
    if len(kept) == len(lines):
        return None
    return b"\r\n".join(kept) + data[len(head) :]


# What makes "the same message" for an Idempotency-Key (RFC-free, the chapter's rule): the
# body and the headers a reader sees as content. Message-ID, Date and trace headers may
# change between two submissions of one message and are left out.
CONTENT_HEADERS = (
    "from",
    "sender",
    "to",
    "cc",
    "reply-to",
    "subject",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
)


def content_hash(data: bytes) -> str:
    """A hash of `data`'s CONTENT_HEADERS (in that order, each occurrence) and its body."""
    head, body = split_message(data)
    headers = parse_headers(head)
    h = hashlib.sha256()
    for name in CONTENT_HEADERS:
        for n, v in headers:
            if n.lower() == name:
                h.update(
                    name.encode() + b":" + " ".join(v.split()).encode("utf-8", "surrogateescape")
                )
                h.update(b"\r\n")
    h.update(b"\r\n")
    h.update(body)
    return h.hexdigest()[:40]
