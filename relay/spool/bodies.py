"""Message bodies too large to keep inline in the database.

Rules:
- A body file is written to a temporary name, fsync'd, renamed into place, and its folder
  fsync'd, all before the row that names it commits (relay/spool/incoming.py writes them). So
  a committed row always has its body on disk; a crash in between leaves only an orphan
  file, which `sweep` removes.
- Small bodies (below `spool.inline_max`) are stored inline in the message row instead: the
  same group commit that makes the row durable makes the body durable, with no extra fsync.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

BODIES = "bodies"


def body_path(spool_dir: Path, queue_id: str) -> Path:
    return spool_dir / BODIES / queue_id[:2] / queue_id


def read_body(spool_dir: Path, rel: str) -> bytes:
    return (spool_dir / rel).read_bytes()


def load(spool_dir: Path, inline: bytes | None, rel: str | None) -> bytes:
    """A whole stored message: the row's `body`, then the file's contents when it has one
    (the row then holds only our prefix: Received and an added Message-ID)."""
    if rel is None:
        return inline or b""
    return (inline or b"") + read_body(spool_dir, rel)


HEAD_READ = 1 << 20  # octets read at most to find the end of a stored message's header block
HEAD_STEP = 1 << 16


@dataclass(frozen=True, slots=True)
class StoredBody:
    """A large message as delivery sends it: the row's prefix, then the file, read in
    blocks (never whole in memory)."""

    prefix: bytes
    path: Path
    size: int  # prefix + file past `skip`
    skip: int = 0  # octets at the start of the file not sent (`prefix` stands for them)

    @classmethod
    def open(cls, spool_dir: Path, prefix: bytes | None, rel: str) -> StoredBody:
        """Raises OSError when the file is missing or unreadable (checked before sending)."""
        path = spool_dir / rel
        return cls(prefix or b"", path, len(prefix or b"") + path.stat().st_size)

    def with_head(self, head: bytes, file_offset: int) -> StoredBody:
        """`head`, then the file from `file_offset` on: a message whose header block was
        changed in memory (DKIM, List-Unsubscribe) while its body stays on disk."""
        file_size = self.size - len(self.prefix) + self.skip
        return StoredBody(head, self.path, len(head) + file_size - file_offset, file_offset)

    def split_head(self, limit: int = HEAD_READ) -> tuple[bytes, int] | None:
        """(the header block with its empty line, the file offset where the body starts),
        or None when that block does not end within the first `limit` octets of the file
        after `skip`, ends inside the prefix, or the message has none."""
        data = self.prefix
        end = data.find(b"\r\n\r\n")
        if end < 0:  # read on in steps: a header block is a few KiB, the limit a MiB
            with open(self.path, "rb") as f:
                f.seek(self.skip)
                read = 0
                while end < 0 and read < limit:
                    chunk = f.read(min(HEAD_STEP, limit - read))
                    if not chunk:
                        break
                    read += len(chunk)
                    start = max(0, len(data) - 3)  # a CRLFCRLF may span the old end
                    data += chunk
                    end = data.find(b"\r\n\r\n", start)
        if end < 0 or data.startswith(b"\r\n") or end + 4 < len(self.prefix):
            return None
        return data[: end + 4], self.skip + end + 4 - len(self.prefix)

    def blocks(self, size: int = 1 << 18) -> Iterator[bytes]:
        """Blocks that each end at a line end (CRLF), except possibly the last; the stored
        copy is CRLF-normalised, so transparency can be applied per block."""
        carry = self.prefix
        with open(self.path, "rb") as f:
            f.seek(self.skip)
            while True:
                chunk = f.read(size)
                if not chunk:
                    break
                data = carry + chunk
                cut = data.rfind(b"\r\n")
                if cut < 0:
                    carry = data
                    continue
                carry = data[cut + 2 :]
                yield data[: cut + 2]
        if carry:
            yield carry


def delete_bodies(spool_dir: Path, rels: Iterable[str]) -> None:
    for rel in rels:
        try:
            (spool_dir / rel).unlink()
        except FileNotFoundError:
            pass


def sweep(spool_dir: Path, known: set[str], grace: float = 60.0) -> list[str]:
    """Remove body files that no row names (a crash between write and commit), older than
    `grace` seconds so that a write in flight is never touched."""
    root = spool_dir / BODIES
    removed: list[str] = []
    if not root.exists():
        return removed
    cutoff = time.time() - grace
    for f in root.glob("*/*"):
        rel = str(f.relative_to(spool_dir))
        if rel in known:
            continue
        try:
            if f.stat().st_mtime < cutoff:
                f.unlink()
                removed.append(rel)
        except FileNotFoundError:
            pass
    return removed
