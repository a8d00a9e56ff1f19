"""A message body while it arrives: in memory while small, then a temporary file in the spool.

Rules:
- Up to `inline_max` octets stay in memory (they go inline into the row, as before). Past
  that, everything is written to `bodies/tmp/.<random>.tmp` in batches of `FLUSH_AT`
  octets, each write in a thread (the event loop never waits on the disk), so a session's
  memory is bounded by about `FLUSH_AT` + one read block, whatever the message size.
- `finish()` fsyncs the file; `commit(queue_id)` renames it to its final place
  (`bodies.body_path`) and fsyncs that folder, before the row that names it is written (the
  rule of relay/spool/bodies.py). A refused, deduplicated or abandoned message is
  `discard()`ed; a crash leaves only a temporary file, which `bodies.sweep` removes once it
  is older than its grace period (every write refreshes the file's mtime).
- The header block (up to the first empty line, RFC 5322 §2.1) is kept in memory, up to
  `HEAD_MAX`; the Message-ID and lanes need it. For a message without a Message-ID the body
  is hashed as it arrives (relay/spool/dedup.py's `ContentHasher`, the same id as for the whole
  message at once). A message with no empty line in its first `HEAD_MAX` octets is hashed
  as all body (deterministic, so a resubmission is still recognised).
- Every body is also fed, as it arrives, to its content fingerprint (relay/spool/dedup.py's
  `BodyFingerprint`): the dedup check that tells a resubmission from another message
  reusing its Message-ID never reads the stored body again, nor hashes it in the event loop
  in one piece.
- What `add()` is given is the DATA parser's output (relay/inbound/dataflow.py): every line
  end a CRLF (the parser makes bare CR and LF CRLF), so the fingerprint hashes the blocks as
  they are (`crlf=True`) rather than making the line ends CRLF again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from relay.mail.message import header, parse_headers
from relay.ops import faults
from relay.spool import bodies
from relay.spool.db import fsync_dir
from relay.spool.dedup import BodyFingerprint, ContentHasher, normalize_message_id

FLUSH_AT = 1 << 20
HEAD_MAX = 1 << 20
TMP = "tmp"


class IncomingBody:
    def __init__(self, spool_dir: Path, inline_max: int) -> None:
        self.spool_dir = spool_dir
        self.inline_max = inline_max
        self.size = 0
        self._mem = bytearray()  # everything while small; then the unwritten tail
        self._tmp: Path | None = None
        self._fd: int | None = None
        # header block detection
        self._head = bytearray()
        self.head: bytes | None = None  # the header block once known (with its final CRLF)
        self._fields: list[tuple[str, str]] | None = None  # `head` parsed (`headers()`)
        self._mid: tuple[str, str] | None = None  # its Message-ID (`message_id()`)
        self._hasher: ContentHasher | None = None  # for a message without a Message-ID
        self._fingerprint = BodyFingerprint()  # of every message: the dedup check
        self._writing: asyncio.Future[None] | None = None  # a write running in a thread

    @property
    def on_disk(self) -> bool:
        return self._tmp is not None

    @property
    def tmp_path(self) -> Path | None:
        return self._tmp

    def inline(self, prefix: bytes = b"") -> bytes:
        """The message held in memory, after `prefix` (our Received: line and such): one
        copy of the data, not one to bytes and another to put the prefix in front."""
        assert self._tmp is None
        return prefix + self._mem  # bytes + bytearray: bytes

    # --- the header block ---------------------------------------------------------------

    def _scan_head(self, data: bytes) -> bytes:
        """Collect the header block; returns the part of `data` that is body.

        What is decided depends on the octets alone, never on how the reads split them
        (the content Message-ID of a resubmission must not change with TCP segmentation):
        the header block is everything up to the first empty line when that block (with its
        final CRLF) is at most HEAD_MAX octets; a message that starts with an empty line has
        none; a message whose first empty line comes later is all body."""
        if self.head is not None:
            return data
        if not self._head:  # the first block: searched where it is, not copied to be searched
            return self._scan_first(data)
        start = max(0, len(self._head) - 3)
        self._head += data
        if self._head.startswith(b"\r\n"):  # no header block at all
            return self._decided(b"", 2)
        i = self._head.find(b"\r\n\r\n", start)
        if i >= 0 and i + 2 <= HEAD_MAX:
            return self._decided(bytes(self._head[: i + 2]), i + 4)
        # a later match starts at len - 3 or after, so past len - 1 the block cannot fit
        if i >= 0 or len(self._head) > HEAD_MAX + 1:
            return self._decided(b"", 0)  # all body (see `header_block`)
        return b""

    def _scan_first(self, data: bytes) -> bytes:
        """`_scan_head` of the first block (nothing held yet): the same decisions, with one
        copy of the body part and none of the whole block when its header block ends in it."""
        if data.startswith(b"\r\n"):
            self.head = b""
            return data[2:]
        i = data.find(b"\r\n\r\n")
        if i >= 0 and i + 2 <= HEAD_MAX:
            self.head = data[: i + 2]
            return data[i + 4 :]
        self._head += data  # not decided yet, or all body: the general path
        if i >= 0 or len(self._head) > HEAD_MAX + 1:
            return self._decided(b"", 0)
        return b""

    def _decided(self, head: bytes, body_at: int) -> bytes:
        self.head = head
        body = bytes(self._head[body_at:])
        self._head = bytearray()
        return body

    def header_block(self) -> bytes:
        """The header block; at the end, a message with no empty line is all header block
        (as relay/mail/message.py's `split_message`) when it is at most HEAD_MAX + 1 octets (a
        longer one was all body as soon as that length was reached)."""
        if self.head is not None:
            return self.head
        return bytes(self._head)

    def headers(self) -> list[tuple[str, str]]:
        """The header block's fields (relay/mail/message.py `parse_headers`), parsed once: the
        content id's check while the data arrives and the accept step read the same list
        (not to be changed). The header block is what the client sent: `rewrite` keeps it."""
        if self.head is None:  # not decided yet: nothing to keep
            return parse_headers(self.header_block())
        if self._fields is None:
            self._fields = parse_headers(self.head)
        return self._fields

    def message_id(self) -> tuple[str, str]:
        """The Message-ID field as sent and normalized (relay/spool/dedup.py), '' for none;
        read once the header block is known (the content id's check while the data arrives
        and the accept step: one normalization a message)."""
        if self._mid is not None:
            return self._mid
        mid = header(self.headers(), "Message-ID") or ""
        got = (mid, normalize_message_id(mid))
        if self.head is not None:
            self._mid = got
        return got

    # --- data -----------------------------------------------------------------------------

    async def add(self, data: bytes) -> None:
        if not data:
            return
        known = self.head is not None
        body = self._scan_head(data)
        if not known and self.head is not None and not self.message_id()[1]:
            self._hasher = ContentHasher(self.head)
        if self._hasher is not None and body:
            self._hasher.update(body)
        self._fingerprint.update(body, crlf=True)
        self.size += len(data)
        self._mem += data
        if self._tmp is None and len(self._mem) <= self.inline_max:
            return
        if len(self._mem) >= FLUSH_AT or self._tmp is None:
            await self._flush()

    async def _flush(self) -> None:
        chunk = bytes(self._mem)
        self._mem = bytearray()
        if self._tmp is None:
            self._tmp, self._fd = await asyncio.to_thread(self._create)
        fd = self._fd
        assert fd is not None
        # shielded: if the session is cancelled meanwhile, the write still ends before
        # discard() closes the descriptor (a descriptor closed under a writing thread could
        # be reused by another file, which would then receive these octets)
        self._writing = asyncio.ensure_future(asyncio.to_thread(_write_all, fd, chunk))
        await asyncio.shield(self._writing)

    def _create(self) -> tuple[Path, int]:
        folder = self.spool_dir / bodies.BODIES / TMP
        if not folder.exists():
            new_root = not folder.parent.exists()  # the first large body: bodies/ is new
            # bodies/ with its own mode (mkdir(parents=True) gives parents the default one)
            folder.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            folder.mkdir(exist_ok=True, mode=0o750)
            if new_root:  # the spool folder's "bodies" entry, before any row names a body
                fsync_dir(self.spool_dir)
        path = folder / f".{secrets.token_hex(12)}.tmp"
        return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)

    async def finish(self) -> None:
        """All data is in: the content hash is complete, the file (if any) written and
        fsync'd."""
        if self.head is None:  # the message ended inside its header block (no body)
            self.head = self.header_block()
            self._head = bytearray()
            if not self.message_id()[1]:
                self._hasher = ContentHasher(self.head)
        if self._tmp is None:
            return
        if self._mem:
            await self._flush()
        fd = self._fd
        assert fd is not None
        await asyncio.to_thread(os.fsync, fd)

    async def rewrite(self, fn: Callable[[bytes], bytes | None]) -> None:
        """After `finish()`: replace the stored message by `fn(message)` when that is not
        None (relay/inbound/longlines.py), in a thread, holding it whole in memory meanwhile. The
        header block and the content hash stay those of what the client sent."""
        if self._tmp is None:
            new = await asyncio.to_thread(fn, bytes(self._mem))
            if new is not None:
                self._mem = bytearray(new)
                self.size = len(new)
            return
        assert self._fd is not None
        size = await asyncio.to_thread(_rewrite_file, self._tmp, self._fd, fn)
        if size is not None:
            self.size = size

    def fingerprint(self, subject: str | None) -> str:
        """The content fingerprint of what the client sent (relay/spool/dedup.py), after
        `finish()`; `subject` is its Subject header."""
        return self._fingerprint.hexdigest(subject)

    def content_message_id(self, hostname: str) -> str:
        """Only for a message that needs one (`message_id()` normalized is empty), after
        `finish()`."""
        assert self._hasher is not None
        return self._hasher.message_id(hostname)

    async def commit(self, queue_id: str) -> str:
        """Move the file to its final place, durably; returns the path stored in the row."""
        assert self._tmp is not None
        return await asyncio.to_thread(self._commit, queue_id)

    def _commit(self, queue_id: str) -> str:
        assert self._tmp is not None and self._fd is not None
        os.close(self._fd)
        self._fd = None
        final = bodies.body_path(self.spool_dir, queue_id)
        folder = final.parent
        if not folder.exists():
            folder.mkdir(exist_ok=True, mode=0o750)  # bodies/ exists: the temporary file is in it
            fsync_dir(folder.parent)
        os.replace(self._tmp, final)
        fsync_dir(folder)
        self._tmp = None
        return str(final.relative_to(self.spool_dir))

    def discard(self) -> None:
        """Drop what was received (refused, deduplicated, or the client went away)."""
        writing = self._writing
        if writing is not None and not writing.done():
            writing.add_done_callback(lambda _f: self.discard())  # after the thread's write
            return
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
        self._mem = bytearray()


def _write_all(fd: int, data: bytes) -> None:
    faults.hit("body.write")
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _rewrite_file(path: Path, fd: int, fn: Callable[[bytes], bytes | None]) -> int | None:
    new = fn(path.read_bytes())
    if new is None:
        return None
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    _write_all(fd, new)
    os.fsync(fd)
    return len(new)
