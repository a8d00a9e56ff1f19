"""The framing of one HTTP/1.1 request, checked as its bytes arrive (RFC 9112): sans-I/O.

relay/ops/http.py feeds every byte a client sends through `RequestFraming` before aiohttp's
parser sees it. aiohttp's parsers (llhttp in C, and the pure-Python fallback) already refuse
most smuggling shapes; this check is the one place that decides, the same for both, and it
bounds what they do not (tests/ops/test_framing.py pins each case on the wire).

Rules:
- One request per connection: the bytes after the end of the first request belong to no
  request (`feed` says how many of the bytes given belong to it; the rest are dropped).
- The head (request line, header fields, the blank line) is at most `max_head` bytes.
- Every line ends in CRLF: a bare CR or LF anywhere in the head, a chunk-size line or a
  trailer is refused (RFC 9112 §2.2 lets a server take a bare LF as a line end; two parsers
  that disagree on where a line ends are how requests are smuggled).
- The request line is `method SP target SP HTTP/1.1` (or `HTTP/1.0`), nothing else
  (RFC 9112 §3): no HTTP/0.9 request without a version.
- No obsolete line folding (RFC 9112 §5.2: a server may reject it with 400) and no field
  name with whitespace in or around it (§5.1).
- At most one Content-Length, digits only (RFC 9110 §8.6; a list, even of equal values,
  is refused); Transfer-Encoding only as exactly `chunked` (codings are case-insensitive),
  never together with Content-Length (RFC 9112 §6.3 point 3) and never in HTTP/1.0
  (§6.1); any other coding list (`xchunked`, `chunked, identity`, `gzip, chunked`) is
  refused.
- A Content-Length over `max_body` is refused (413) before a byte of the body is read; a
  chunked body is counted as it arrives and refused (413) the moment it passes `max_body`.
- A chunk-size line is 1-16 hex digits (RFC 9112 §7.1: no `0x`, no `_`, no sign, no
  whitespace), then optional extensions, at most `max_chunk_line` bytes in all; the chunk
  data is followed by CRLF; trailer lines are bounded like the head.
- Every refusal is a `FramingError(status, reason)`: 400, or 413 for a body over the bound.
"""

from __future__ import annotations

import enum

MAX_HEAD = 16 * 1024
MAX_CHUNK_LINE = 1024
_MAX_SIZE_DIGITS = 16  # 2**64: a chunk bigger than that is not a chunk we will ever take
_MAX_LENGTH_DIGITS = 15
_HEX = frozenset(b"0123456789abcdefABCDEF")
_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")
# RFC 9110 §5.6.2: token characters (a method and a field name are tokens)
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class FramingError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.consumed = 0  # bytes of the last `feed` that were fine before this one


class _State(enum.Enum):
    HEAD = "head"
    BODY = "body"  # Content-Length bytes
    CHUNK_SIZE = "chunk size line"
    CHUNK_DATA = "chunk data"
    CHUNK_END = "CRLF after chunk data"
    TRAILER = "trailer"
    DONE = "done"


class RequestFraming:
    def __init__(
        self,
        max_head: int = MAX_HEAD,
        max_body: int = 1024 * 1024,
        max_chunk_line: int = MAX_CHUNK_LINE,
    ) -> None:
        self.max_head = max_head
        self.max_body = max_body
        self.max_chunk_line = max_chunk_line
        self.state = _State.HEAD
        self.body_size = 0  # body bytes so far (chunk data only, for a chunked body)
        self._buf = bytearray()  # the head, a chunk-size line or a trailer line so far
        self._left = 0  # bytes still to come: of the Content-Length body, or of the chunk
        self._trailer_size = 0

    @property
    def head_done(self) -> bool:
        return self.state is not _State.HEAD

    @property
    def done(self) -> bool:
        return self.state is _State.DONE

    def feed(self, data: bytes) -> int:
        """Check the next bytes; returns how many of them belong to the request (the rest
        come after its end). Raises FramingError at the first byte that breaks a rule."""
        pos = 0
        try:
            while pos < len(data) and self.state is not _State.DONE:
                pos = self._step(data, pos)
        except FramingError as e:
            e.consumed = pos
            raise
        return pos

    def _step(self, data: bytes, pos: int) -> int:
        if self.state is _State.HEAD:
            return self._head(data, pos)
        if self.state is _State.BODY or self.state is _State.CHUNK_DATA:
            take = min(self._left, len(data) - pos)
            self._left -= take
            if self._left == 0:
                self.state = _State.DONE if self.state is _State.BODY else _State.CHUNK_END
            return pos + take
        if self.state is _State.CHUNK_END:
            # the two bytes may come in two reads: `_left` counts the CRLF's bytes seen
            if data[pos] != b"\r\n"[self._left]:
                raise FramingError(400, "chunk data not followed by CRLF")
            self._left += 1
            if self._left == 2:
                self._left = 0
                self.state = _State.CHUNK_SIZE
            return pos + 1
        return self._line(data, pos)

    # --- the head -------------------------------------------------------------------------

    def _head(self, data: bytes, pos: int) -> int:
        start = max(0, len(self._buf) - 3)
        room = self.max_head + 4 - len(self._buf)
        chunk = data[pos : pos + room]
        self._buf += chunk
        end = self._buf.find(b"\r\n\r\n", start)
        # the body after the head may hold any bytes
        _no_bare_line_ends(self._buf, start + 2 if start else 0, end + 4 if end >= 0 else None)
        if end < 0:
            if len(self._buf) > self.max_head:
                raise FramingError(400, f"request head over {self.max_head} bytes")
            return pos + len(chunk)
        used = end + 4 - (len(self._buf) - len(chunk))
        head = bytes(self._buf[:end])
        self._buf.clear()
        self._start_body(head)
        return pos + used

    def _start_body(self, head: bytes) -> None:
        if b"\r" in head.replace(b"\r\n", b"") or b"\n" in head.replace(b"\r\n", b""):
            raise FramingError(400, "bare CR or LF in the request head")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TCHAR or not parts[1]:
            raise FramingError(400, "malformed request line")
        if parts[2] not in _VERSIONS:
            raise FramingError(400, "malformed request line (HTTP/1.1 or HTTP/1.0 only)")
        lengths: list[bytes] = []
        codings: list[bytes] = []
        for line in lines[1:]:
            name, value = _field(line)
            if name == b"content-length":
                lengths.append(value)
            elif name == b"transfer-encoding":
                codings += [c.strip().lower() for c in value.split(b",")]
        if codings:
            if lengths:
                raise FramingError(400, "Transfer-Encoding together with Content-Length")
            if parts[2] == b"HTTP/1.0":
                raise FramingError(400, "Transfer-Encoding in an HTTP/1.0 request")
            if codings != [b"chunked"]:
                raise FramingError(400, "unsupported Transfer-Encoding (only chunked)")
            self.state = _State.CHUNK_SIZE
            return
        if len(lengths) > 1:
            raise FramingError(400, "more than one Content-Length")
        if not lengths:
            self.state = _State.DONE
            return
        raw = lengths[0]
        if not raw.isdigit() or len(raw) > _MAX_LENGTH_DIGITS:
            raise FramingError(400, "bad Content-Length")
        size = int(raw)
        if size > self.max_body:
            raise FramingError(413, f"request body over {self.max_body} bytes")
        self.body_size = size
        self._left = size
        self.state = _State.BODY if size else _State.DONE

    # --- chunk-size and trailer lines -------------------------------------------------------

    def _line(self, data: bytes, pos: int) -> int:
        limit = self.max_chunk_line if self.state is _State.CHUNK_SIZE else self.max_head
        start = max(0, len(self._buf) - 1)
        chunk = data[pos : pos + limit + 2 - len(self._buf)]
        self._buf += chunk
        end = self._buf.find(b"\r\n", start)
        what = "chunk-size line" if self.state is _State.CHUNK_SIZE else "trailer line"
        _no_bare_line_ends(self._buf, start, end + 2 if end >= 0 else None, what)
        if end < 0:
            if len(self._buf) > limit:
                raise FramingError(400, f"{what} over {limit} bytes")
            return pos + len(chunk)
        used = end + 2 - (len(self._buf) - len(chunk))
        line = bytes(self._buf[:end])
        self._buf.clear()
        if self.state is _State.CHUNK_SIZE:
            self._chunk_size(line)
        elif not line:
            self.state = _State.DONE
        else:
            self._trailer_size += len(line) + 2
            if self._trailer_size > self.max_head:
                raise FramingError(400, f"trailer section over {self.max_head} bytes")
            _field(line)
        return pos + used

    def _chunk_size(self, line: bytes) -> None:
        digits = line.split(b";", 1)[0]
        if not digits or len(digits) > _MAX_SIZE_DIGITS or not set(digits) <= _HEX:
            raise FramingError(400, "bad chunk size")
        size = int(digits, 16)
        if size == 0:
            self.state = _State.TRAILER
            return
        self.body_size += size
        if self.body_size > self.max_body:
            raise FramingError(413, f"request body over {self.max_body} bytes")
        self._left = size
        self.state = _State.CHUNK_DATA


def _no_bare_line_ends(
    buf: bytearray, lo: int, hi: int | None, what: str = "the request head"
) -> None:
    """Refuse a LF not after a CR, or a CR not before a LF, in buf[lo:hi] (the bytes before
    `lo` were checked by the previous call; a CR at the very end waits for the next byte).
    Linear: each call looks at the new bytes only."""
    hi = len(buf) if hi is None else hi
    i = buf.find(b"\n", lo, hi)
    while i >= 0:
        if i == 0 or buf[i - 1] != 0x0D:
            raise FramingError(400, f"bare LF in {what}")
        i = buf.find(b"\n", i + 1, hi)
    i = buf.find(b"\r", max(0, lo - 1), hi)
    while 0 <= i < hi - 1:
        if buf[i + 1] != 0x0A:
            raise FramingError(400, f"bare CR in {what}")
        i = buf.find(b"\r", i + 1, hi)


def _field(line: bytes) -> tuple[bytes, bytes]:
    """(lowercased name, value without surrounding whitespace) of one field line."""
    if line[:1] in (b" ", b"\t"):
        raise FramingError(400, "obsolete line folding")
    name, colon, value = line.partition(b":")
    if not colon or not name or not set(name) <= _TCHAR:
        raise FramingError(400, "malformed header line")
    return name.lower(), value.strip(b" \t")
