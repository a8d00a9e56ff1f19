"""DATA as it arrives (RFC 5321 §4.1.1.4, §4.5.2): a sans-I/O parser fed byte blocks.

Rules:
- Only a line that is exactly "." after a CRLF (`<CRLF>.<CRLF>`) ends the data. A bare LF or
  bare CR before "." (`\\n.\\n`, `\\r.\\r`, `\\n.\\r\\n`, `\\r\\n.\\n`: the raw material of SMTP
  smuggling) never does: it stays inside the body.
- The parser works on complete CRLF-terminated lines, many at a time (`bytes.find`,
  `bytes.replace` in C), never one Python step per line; an incomplete last line waits for
  the next block. So every transformation below sees whole lines and gives the same result
  for any split of the input into blocks (tests/inbound/test_dataflow.py checks this property).
- Transparency (§4.5.2): a leading "." of a line is removed. Then bare CR and bare LF inside
  a line become CRLF (as relay/mail/message.py's `normalize_line_endings`), and NUL bytes are
  removed (RFC 5322 §2.3 forbids them; an app that sends one gets its message relayed
  without it, and the count is logged).
- Limits, decided at the end of the data like aiosmtpd did (the client is still sending):
  over `max_size` raw octets the message is too large (552 5.3.4); a line longer than
  `max_line` octets (with its CRLF and any transparency dot) is too long (500 5.5.2). Once
  over a limit the parser keeps only what it needs to find the end of the data: memory
  stays bounded whatever the client sends.
- The header block (everything up to the first empty line, RFC 5322 §2.1; a message with none
  is all header block, as relay/mail/message.py's `split_message` reads it) is measured as it
  goes out, on the normalised lines: over `max_header` octets (with its final CRLF) the
  header is too large (552 5.3.4, RFC 5321 §4.5.3.1.7, RFC 3463 §3.4), so no later step
  ever parses an unbounded header. Only a count is kept, nothing more is buffered.
- What comes after the end of the data in the last block (a pipelined QUIT or MAIL) is
  handed back as `rest`, to be read as commands.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from relay.mail.message import find_dot_line, normalize_line_endings

_END = b"\r\n.\r\n"


class DataState(Enum):
    NOMINAL = "nominal"
    TOO_MUCH = "too_much"  # over the size limit
    TOO_LONG = "too_long"  # a line over the line limit
    HEADER_TOO_BIG = "header_too_big"  # a header block over the header limit


@dataclass(slots=True)
class Feed:
    """What one `feed()` produced: normalised message bytes, and once the end of the data was
    seen, `done` and the bytes after it."""

    data: bytes
    done: bool = False
    rest: bytes = b""


class DataParser:
    def __init__(self, max_size: int, max_line: int, max_header: int = 0) -> None:
        self.max_size = max_size  # 0: no limit
        self.max_line = max_line
        self.max_header = max_header  # 0: no limit
        self.header_size = 0  # octets of the header block so far (with its final CRLF)
        self._in_head = True  # the empty line that ends the header block is still to come
        self.state = DataState.NOMINAL
        self.raw_size = 0  # octets received, with transparency dots, before the end line
        self.nul_count = 0
        self.longest = 0  # the longest line of the normalised message, without its CRLF
        self._pending = bytearray()  # an incomplete last line
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, block: bytes | bytearray) -> Feed:
        if self._done:
            return Feed(b"", True, bytes(block))
        old = len(self._pending)
        self._pending += block
        buf = self._pending
        # The end line: "." CRLF at a line start; the start of the data is a line start.
        # What was pending holds no CRLF (it was cut at the last one): search only the new
        # octets and the few before them, so a long incomplete line costs linear time.
        if buf.startswith(b".\r\n"):
            end = 0
        else:
            i = find_dot_line(buf, max(0, old - 4), _END)
            end = -1 if i < 0 else i + 2
        if end >= 0:
            with memoryview(buf) as view:  # one copy each, not a slice and then bytes()
                lines = bytes(view[:end])
                rest = bytes(view[end + 3 :])
            self._pending = bytearray()
            self._done = True
            return Feed(self._lines(lines), True, rest)
        cut = buf.rfind(b"\r\n", max(0, old - 1))
        if cut < 0:
            self._check_partial()
            return Feed(b"")
        with memoryview(buf) as view:
            lines = bytes(view[: cut + 2])
        del buf[: cut + 2]
        self._check_partial()
        return Feed(self._lines(lines))

    def _check_partial(self) -> None:
        """An incomplete line already over the limit: it can only be too long. Keep its last
        few octets (a possible CR of the CRLF, and the "\\r\\n.\\r" of an end line) so the
        end of the data is still found, and drop the rest."""
        if len(self._pending) > self.max_line + 4:
            self.raw_size += len(self._pending) - 4
            self._over(DataState.TOO_LONG)
            del self._pending[:-4]

    def _over(self, state: DataState) -> None:
        if self.state is DataState.NOMINAL:
            self.state = state

    def _lines(self, lines: bytes) -> bytes:
        """Complete CRLF lines (each starting at a line start) to normalised message bytes,
        the header block measured on the way."""
        out = self._normalised(lines)
        if self._in_head and out:
            self._measure_head(out)
            if self.state is not DataState.NOMINAL:
                return b""
        return out

    def _measure_head(self, out: bytes) -> None:
        """`out` is whole CRLF lines, and what went out before it ended with a CRLF: an empty
        line is `out`'s start or a CRLF CRLF inside it (`bytes.find`, in C)."""
        if out.startswith(b"\r\n"):
            end = 0
        else:
            i = out.find(b"\r\n\r\n")
            end = -1 if i < 0 else i + 2
        if end >= 0:
            self._in_head = False
            self.header_size += end
        else:
            self.header_size += len(out)
        if self.max_header and self.header_size > self.max_header:
            self._over(DataState.HEADER_TOO_BIG)

    def _normalised(self, lines: bytes) -> bytes:
        """`_lines` without the header measure."""
        self.raw_size += len(lines)
        if self.max_size and self.raw_size > self.max_size:
            self._over(DataState.TOO_MUCH)
        if self.state is not DataState.NOMINAL:
            return b""
        # One split at every line end (in C: `splitlines` cuts at CRLF, bare CR and bare LF)
        # gives the longest line and whether any line end is bare: `lines` is whole lines
        # ending in CRLF, so it has len(parts) line ends, all CRLFs exactly when they take two
        # octets each. A 100 KiB message used to take a split and two one-byte counts (and
        # before those, five passes).
        parts = lines.splitlines()
        # Bare CR or LF: any CR or LF that is not part of a CRLF. Removing transparency dots
        # and NULs below never makes one (a NUL between a bare CR and a bare LF joins them into
        # a CRLF: the slow path, which gives the same bytes).
        bare = len(lines) - sum(map(len, parts)) != 2 * len(parts)  # the octets of the line ends
        if bare:  # the line limit counts from CRLF to CRLF
            parts = lines.split(b"\r\n")
        longest = max(map(len, parts), default=0)
        if self.max_line and longest + 2 > self.max_line:
            self._over(DataState.TOO_LONG)
            return b""
        # §4.5.2 transparency: every line start is the block's start or after a CRLF
        dots = lines.startswith(b".") or find_dot_line(lines, 0, b"\r\n.") >= 0
        if dots:
            if lines.startswith(b"."):
                lines = lines[1:]
            lines = lines.replace(b"\r\n.", b"\r\n")
        nuls = b"\x00" in lines
        if nuls:
            self.nul_count += lines.count(b"\x00")
            lines = lines.replace(b"\x00", b"")
        if not bare and not dots and not nuls:
            self.longest = max(self.longest, longest)  # the lines went out as they came
            return lines
        out = normalize_line_endings(lines) if bare else lines
        if (
            len(out) > 1000
        ):  # a line over RFC 5322's 998 octets is possible (relay/inbound/longlines.py)
            self.longest = max(self.longest, max(map(len, out.split(b"\r\n"))))
        return out
