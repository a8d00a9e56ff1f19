"""A message body while it arrives (relay/spool/incoming.py) and once stored
(relay/spool/bodies.py), in-process: the header block found whatever the chunking, the
content Message-ID equal to the whole-message one, memory then a temporary file past
inline_max, rewrite, commit to the final place, discard; stored bodies read back in
CRLF-ended blocks; the orphan sweep. Every byte and file is checked (tests/MUTANTS.md)."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from relay.mail.message import header, parse_headers, split_message
from relay.ops import faults
from relay.spool import bodies, dedup, incoming
from relay.spool.incoming import IncomingBody
from tests.bodyfiles import write_body

HOST = "relay.test"
WAIT = 10.0  # seconds: a bound on waits, never a sleep

MESSAGES = [
    b"Subject: a\r\nX-Long: b\r\n c\r\n\r\nbody line\r\nsecond\r\n",
    b"Subject: no body\r\n\r\n",
    b"\r\nno header block at all\r\n",
    b"Subject: only a header block\r\nX: y\r\n",
    b"stray line\r\nSubject: s\r\n\r\nb\r\n",
    b"Subject: x\r\n\r\n\r\n\r\nempty lines in the body\r\n",
    b"Message-ID: <kept@app.example>\r\n\r\nb\r\n",
    b"Message-ID: <>\r\n\r\nan id that normalizes to nothing\r\n",
]


def chunkings(data: bytes) -> list[list[bytes]]:
    return [
        [data],
        [data[i : i + 1] for i in range(len(data))],
        [data[i : i + 3] for i in range(0, len(data), 3)],
        [data[i : i + 5] for i in range(0, len(data), 5)],
    ]


async def fed(tmp_path: Path, chunks: list[bytes], inline_max: int = 1 << 20) -> IncomingBody:
    body = IncomingBody(tmp_path, inline_max)
    for c in chunks:
        await body.add(c)
    await body.finish()
    return body


@pytest.mark.parametrize("data", MESSAGES)
async def test_header_block_and_content_id_do_not_depend_on_the_chunking(
    tmp_path: Path, data: bytes
) -> None:
    head, rest = split_message(data)
    for chunks in chunkings(data):
        b = await fed(tmp_path, chunks)
        assert b.header_block() == head, chunks
        assert b.head == head
        # its fields parsed once, while the data arrived: the accept step reads that list
        assert b.headers() == parse_headers(head) and b.headers() is b.headers()
        assert b.size == len(data)
        assert b.inline() == data and not b.on_disk and b.tmp_path is None
        mid = header(parse_headers(head), "Message-ID") or ""
        assert b.message_id() == (mid, dedup.normalize_message_id(mid))
        assert b.message_id() is b.message_id()  # normalized once
        if not b.message_id()[1]:
            assert b.content_message_id(HOST) == dedup.content_message_id(head, rest, HOST)
        else:
            with pytest.raises(AssertionError):
                b.content_message_id(HOST)


async def test_needs_content_id(tmp_path: Path) -> None:
    async def needs(head: bytes) -> bool:
        b = IncomingBody(tmp_path, 1 << 20)
        await b.add(head + b"\r\nbody\r\n")
        await b.finish()
        return not b.message_id()[1]

    assert await needs(b"Subject: x\r\n")
    assert await needs(b"Message-ID: <>\r\n")
    assert await needs(b"")
    assert not await needs(b"Message-ID: <a@b>\r\n")
    assert not await needs(b"message-id: a@b\r\n")


async def test_the_empty_line_found_across_chunk_ends(tmp_path: Path) -> None:
    data = b"Subject: s\r\n\r\nBODY\r\n"
    for cut in range(1, len(data)):
        b = IncomingBody(tmp_path, 1 << 20)
        await b.add(data[:cut])
        await b.add(data[cut:])
        await b.finish()
        assert b.header_block() == b"Subject: s\r\n", cut
        want = dedup.content_message_id(b"Subject: s\r\n", b"BODY\r\n", HOST)
        assert b.content_message_id(HOST) == want, cut
    # an empty line only at the start of a later chunk is not "no header block"
    b = IncomingBody(tmp_path, 1 << 20)
    await b.add(b"Subject: s\r\n")
    await b.add(b"\r\nBODY\r\n")
    await b.finish()
    assert b.header_block() == b"Subject: s\r\n"


async def test_a_first_chunk_of_one_cr_still_finds_no_header_block(tmp_path: Path) -> None:
    data = b"\r\nMessage-ID: <in-the-body@x>\r\nno header block\r\n"
    b = await fed(tmp_path, [data[:1], data[1:]])
    assert b.header_block() == b""
    assert b.content_message_id(HOST) == dedup.content_message_id(b"", data[2:], HOST)


async def test_a_header_block_over_head_max_is_all_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(incoming, "HEAD_MAX", 40)
    data = b"X-A: " + b"a" * 30 + b"\r\nX-B: b\r\n\r\nbody\r\n"  # no empty line in 40 octets
    for chunks in chunkings(data):
        b = await fed(tmp_path, chunks)
        assert b.header_block() == b"", chunks
        assert b.content_message_id(HOST) == dedup.content_message_id(b"", data, HOST)
    line = b"X-A: " + b"a" * 33 + b"\r\n"  # 40 octets, no empty line yet: still waiting
    b = await fed(tmp_path, [line, b"\r\nbody\r\n"])
    assert b.header_block() == line
    assert b.content_message_id(HOST) == dedup.content_message_id(line, b"body\r\n", HOST)
    b = await fed(tmp_path, [line, b"\r", b"\nbody\r\n"])  # 41 octets, then the empty line
    assert b.header_block() == line
    b = await fed(tmp_path, [line, b"X"])  # 41 octets, no empty line, the end: all header
    assert b.header_block() == line + b"X"
    b = await fed(tmp_path, [line, b"XY", b"\r\n\r\nbody"])  # 42: too long for a block
    assert b.header_block() == b""
    assert b.content_message_id(HOST) == dedup.content_message_id(
        b"", line + b"XY\r\n\r\nbody", HOST
    )


async def test_a_header_block_over_head_max_is_all_body_in_one_chunk_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(incoming, "HEAD_MAX", 40)
    data = b"X-A: " + b"a" * 30 + b"\r\nX-B: b\r\n\r\nbody\r\n"
    one = await fed(tmp_path, [data])
    split = await fed(tmp_path, [data[:41], data[41:]])
    assert one.content_message_id(HOST) == split.content_message_id(HOST)


async def test_small_bodies_stay_in_memory_large_ones_go_to_a_file(tmp_path: Path) -> None:
    data = b"Subject: s\r\n\r\n" + b"x" * 86  # 100 octets
    b = await fed(tmp_path, [data[:50], data[50:]], inline_max=100)
    assert not b.on_disk and b.inline() == data and b.size == 100
    assert not (tmp_path / "bodies").exists()
    b2 = await fed(tmp_path, [data[:50], data[50:], b"!"], inline_max=100)
    assert b2.on_disk and b2.size == 101
    tmp = b2.tmp_path
    assert tmp is not None and tmp.parent == tmp_path / "bodies" / "tmp"
    assert tmp.name.startswith(".") and tmp.name.endswith(".tmp") and len(tmp.name) == 29
    assert tmp.read_bytes() == data + b"!"
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o640 & ~_umask()
    with pytest.raises(AssertionError):
        b2.inline()
    b2.discard()
    assert not tmp.exists() and b2.tmp_path is None


async def test_a_file_is_written_in_batches_of_flush_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(incoming, "FLUSH_AT", 64)
    writes: list[int] = []
    real = incoming._write_all

    def spy(fd: int, data: bytes) -> None:
        writes.append(len(data))
        real(fd, data)

    monkeypatch.setattr(incoming, "_write_all", spy)
    b = IncomingBody(tmp_path, 16)
    await b.add(b"Subject: s\r\n\r\n" + b"a" * 6)  # 20 octets: over inline_max, to the file
    assert writes == [20]
    for _ in range(10):
        await b.add(b"b" * 10)
    assert writes == [20, 70]  # held until FLUSH_AT octets wait
    await b.finish()
    assert writes == [20, 70, 30]
    assert b.tmp_path is not None and b.size == 120
    assert b.tmp_path.read_bytes() == b"Subject: s\r\n\r\n" + b"a" * 6 + b"b" * 100
    await b.finish()  # nothing left to write
    assert writes == [20, 70, 30]
    await b.add(b"")
    assert b.size == 120
    b.discard()


async def test_finish_fsyncs_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    b = await fed(tmp_path, [b"Subject: s\r\n\r\n" + b"x" * 50], inline_max=10)
    assert b.tmp_path is not None
    # the first large body: the spool folder gained "bodies", then the file's data
    assert synced == [str(tmp_path), str(b.tmp_path.resolve())]
    synced.clear()
    rel = await b.commit("ABCDEF0123456789")
    assert rel == "bodies/AB/ABCDEF0123456789"
    final = tmp_path / rel
    assert final.read_bytes() == b"Subject: s\r\n\r\n" + b"x" * 50
    # the new folder in bodies/, then the file's name in it
    assert synced == [str((tmp_path / "bodies").resolve()), str(final.parent.resolve())]
    assert not b.on_disk and not list((tmp_path / "bodies" / "tmp").iterdir())
    synced.clear()
    b2 = await fed(tmp_path, [b"Subject: t\r\n\r\n" + b"y" * 50], inline_max=10)
    synced.clear()
    assert await b2.commit("ABXYZ") == "bodies/AB/ABXYZ"
    assert synced == [str(final.parent.resolve())]  # the folder existed: only it
    b2.discard()  # after a commit: nothing to remove
    assert (tmp_path / "bodies/AB/ABXYZ").exists()


async def test_rewrite_in_memory_and_on_disk(tmp_path: Path) -> None:
    data = b"Subject: s\r\n\r\nbody\r\n"
    b = await fed(tmp_path, [data])
    await b.rewrite(lambda d: None)
    assert b.inline() == data and b.size == len(data)
    await b.rewrite(lambda d: d.upper() + b"MORE\r\n")
    assert b.inline() == data.upper() + b"MORE\r\n" and b.size == len(data) + 6
    assert b.header_block() == b"Subject: s\r\n"  # what the client sent
    assert b.headers() == [("Subject", "s")]  # its fields too
    big = data + b"z" * 100
    f = await fed(tmp_path, [big], inline_max=10)
    await f.rewrite(lambda d: None)
    assert f.tmp_path is not None and f.tmp_path.read_bytes() == big and f.size == len(big)
    await f.rewrite(lambda d: b"short\r\n")
    assert f.tmp_path.read_bytes() == b"short\r\n" and f.size == 7
    rel = await f.commit("QQ01")
    assert (tmp_path / rel).read_bytes() == b"short\r\n"


async def test_a_failed_write_raises_and_discard_leaves_nothing(tmp_path: Path) -> None:
    faults.arm("body.write", "enospc", times=1)
    try:
        b = IncomingBody(tmp_path, 10)
        with pytest.raises(OSError, match="No space left"):
            await b.add(b"Subject: s\r\n\r\n" + b"x" * 50)
    finally:
        faults.disarm_all()
    assert b.tmp_path is not None and b.tmp_path.exists()
    b.discard()
    assert list((tmp_path / "bodies" / "tmp").iterdir()) == []
    b.discard()  # twice is harmless


async def test_discard_during_a_write_waits_for_the_write_then_removes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone while its body is being written: the descriptor is closed and the
    file removed only once the writing thread is done with them."""
    started, release = threading.Event(), threading.Event()
    real = incoming._write_all

    def slow(fd: int, data: bytes) -> None:
        started.set()
        assert release.wait(WAIT)
        real(fd, data)

    monkeypatch.setattr(incoming, "_write_all", slow)
    b = IncomingBody(tmp_path, 10)
    task = asyncio.ensure_future(b.add(b"Subject: s\r\n\r\n" + b"x" * 50))
    assert await asyncio.to_thread(started.wait, WAIT)
    tmp = b.tmp_path
    assert tmp is not None
    b.discard()
    assert tmp.exists()  # the write is still running: nothing closed or removed yet
    release.set()
    await asyncio.wait_for(task, WAIT)  # the write itself succeeded
    for _ in range(200):
        if not tmp.exists():
            break
        await asyncio.sleep(0.01)
    assert not tmp.exists() and b.tmp_path is None


async def test_body_folders_are_private_to_the_relay(tmp_path: Path) -> None:
    b = await fed(tmp_path, [b"Subject: s\r\n\r\n" + b"x" * 50], inline_max=10)
    rel = await b.commit("ABCDEF")
    for folder in (tmp_path / "bodies", tmp_path / "bodies" / "tmp", (tmp_path / rel).parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750 & ~_umask(), folder


async def test_rewrite_on_disk_reads_the_stored_file_and_may_empty_it(tmp_path: Path) -> None:
    big = b"Subject: s\r\n\r\n" + b"z" * 100
    f = await fed(tmp_path, [big], inline_max=10)
    await f.rewrite(lambda d: d[:12] + b"X\r\n")
    assert f.tmp_path is not None and f.tmp_path.read_bytes() == b"Subject: s\r\nX\r\n"
    await f.rewrite(lambda d: b"")
    assert f.tmp_path.read_bytes() == b"" and f.size == 0


# --- stored bodies ------------------------------------------------------------------------


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_body_path() -> None:
    assert bodies.body_path(Path("/s"), "XYZ") == Path("/s/bodies/XY/XYZ")


def test_load_joins_the_rows_prefix_and_the_file(tmp_path: Path) -> None:
    rel = write_body(tmp_path, "ABC", b"file part")
    assert bodies.load(tmp_path, b"prefix ", rel) == b"prefix file part"
    assert bodies.load(tmp_path, None, rel) == b"file part"
    assert bodies.load(tmp_path, b"inline", None) == b"inline"
    assert bodies.load(tmp_path, None, None) == b""
    assert bodies.read_body(tmp_path, rel) == b"file part"


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 64, 1 << 18])
def test_stored_blocks_end_at_line_ends_and_join_to_the_message(tmp_path: Path, size: int) -> None:
    data = b"".join(b"line %d %s\r\n" % (i, b"x" * (i % 13)) for i in range(60)) + b"tail"
    rel = write_body(tmp_path, "QID1", data)
    sb = bodies.StoredBody.open(tmp_path, b"Received: x\r\n", rel)
    assert sb.size == len(data) + 13 and sb.prefix == b"Received: x\r\n"
    assert sb.path == tmp_path / rel
    blocks = list(sb.blocks(size))
    assert b"".join(blocks) == b"Received: x\r\n" + data
    assert all(b.endswith(b"\r\n") for b in blocks[:-1])
    assert blocks[-1] == b"tail"
    assert all(blocks)
    whole = list(bodies.StoredBody.open(tmp_path, None, rel).blocks())
    assert whole == [data[: -len(b"tail")], b"tail"] and sb.size - 13 == len(data)


def test_stored_blocks_of_a_message_ending_in_crlf_and_a_missing_file(tmp_path: Path) -> None:
    rel = write_body(tmp_path, "QID2", b"a\r\nb\r\n")
    sb = bodies.StoredBody.open(tmp_path, b"", rel)
    assert list(sb.blocks(2)) == [b"a\r\n", b"b\r\n"]
    assert sb.size == 6
    # an empty line read on its own is a block of its own, not carried into the next one
    rel = write_body(tmp_path, "QID3", b"ab\r\n\r\ncd")
    sb = bodies.StoredBody.open(tmp_path, b"", rel)
    assert list(sb.blocks(2)) == [b"ab\r\n", b"\r\n", b"cd"]
    with pytest.raises(FileNotFoundError):
        bodies.StoredBody.open(tmp_path, b"p", "bodies/NO/NOPE")


def test_sweep_removes_old_orphans_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert bodies.sweep(tmp_path, set()) == []  # no bodies/ yet
    kept = write_body(tmp_path, "AAKEEP", b"k")
    orphan = write_body(tmp_path, "AAORPH", b"o")
    young = write_body(tmp_path, "BBYOUNG", b"y")
    old = time.time() - 120
    for rel in (kept, orphan):
        os.utime(tmp_path / rel, (old, old))
    assert bodies.sweep(tmp_path, {kept}, grace=60) == [orphan]
    assert (tmp_path / kept).exists() and (tmp_path / young).exists()
    assert not (tmp_path / orphan).exists()
    assert bodies.sweep(tmp_path, {kept}, grace=0.0) == [young]
    # the default grace is 60 s; a file exactly that old is still spared (a write in flight)
    now = 1_800_000_000
    monkeypatch.setattr(bodies.time, "time", lambda: float(now))
    edge = write_body(tmp_path, "CCEDGE", b"e")
    older = write_body(tmp_path, "CCOLDER", b"o")
    os.utime(tmp_path / edge, ns=((now - 60) * 10**9, (now - 60) * 10**9))
    os.utime(tmp_path / older, ns=((now - 61) * 10**9, (now - 61) * 10**9))
    assert bodies.sweep(tmp_path, {kept}) == [older]
    assert (tmp_path / edge).exists()
    bodies.delete_bodies(tmp_path, [kept, "bodies/ZZ/missing"])
    assert not (tmp_path / kept).exists()


# More survivors of the spool mutation run, in-process (tests/MUTANTS.md; until issue 28 in
# tests/test_spool_mutants_more.py).
# --- an arriving body ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "block_size"),
    [
        (b"X-A: " + b"a" * 33 + b"\r\n\r\nbody\r\n", 40),
        (b"X-A: " + b"a" * 20 + b"\r\nX-B: b\r\n\r\nbody\r\n", 35),
        (b"X-A: " + b"a" * 34 + b"\r\n\r\nbody\r\n", 41),
        (b"X-A: " + b"a" * 20 + b"\r\nX-B: " + b"b" * 8 + b"\r\n\r\nbody\r\n", 42),
        (b"X-A: " + b"a" * 36 + b"\r\n\r\n", 43),
        (b"X-A: " + b"a" * 37 + b"\r\n\r\nbody\r\n", 44),
    ],
)
async def test_a_header_block_over_head_max_by_a_few_octets_is_all_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, block_size: int
) -> None:
    """HEAD_MAX bounds the header block with its final CRLF: a block of HEAD_MAX octets is
    the header block, one of HEAD_MAX + 1 or a few more makes the message all body,
    whatever the reads."""
    monkeypatch.setattr(incoming, "HEAD_MAX", 40)
    block = data[: data.find(b"\r\n\r\n") + 2]
    assert len(block) == block_size
    head, rest = (block, data[block_size + 2 :]) if block_size <= 40 else (b"", data)
    for chunks in ([data], [data[:20], data[20:]], [bytes([c]) for c in data]):
        b = await fed(tmp_path, chunks)
        assert b.header_block() == head, chunks
        assert b.content_message_id(HOST) == dedup.content_message_id(head, rest, HOST)


@pytest.mark.parametrize("tail", [b"XY", b"XYZ", b"XYZW" * 5])
async def test_a_message_without_an_empty_line_past_head_max_plus_one_is_all_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tail: bytes
) -> None:
    """No empty line at all: up to HEAD_MAX + 1 octets the message is its header block
    (as split_message); longer, all body, whatever the reads (one, or line by line)."""
    monkeypatch.setattr(incoming, "HEAD_MAX", 40)
    line = b"X-A: " + b"a" * 33 + b"\r\n"  # 40 octets
    data = line + tail  # 42 or more, no empty line
    for chunks in ([data], [line, tail], [bytes([c]) for c in data]):
        b = await fed(tmp_path, chunks)
        assert b.header_block() == b"", chunks
        assert b.content_message_id(HOST) == dedup.content_message_id(b"", data, HOST)


async def test_exactly_flush_at_waiting_octets_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a body is on disk, memory holds less than FLUSH_AT octets: a batch of exactly
    FLUSH_AT is written at once, not kept until the next read."""
    monkeypatch.setattr(incoming, "FLUSH_AT", 64)
    b = IncomingBody(tmp_path, 16)
    head = b"Subject: s\r\n\r\n" + b"a" * 6  # 20 octets: over inline_max, to the file
    await b.add(head)
    assert b.tmp_path is not None and b.tmp_path.read_bytes() == head
    await b.add(b"b" * 64)
    assert b.tmp_path.read_bytes() == head + b"b" * 64
    await b.add(b"c" * 63)
    assert b.tmp_path.read_bytes() == head + b"b" * 64  # 63 wait in memory
    await b.finish()
    assert b.tmp_path.read_bytes() == head + b"b" * 64 + b"c" * 63
    b.discard()


async def test_short_writes_still_store_every_octet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.write may write less than asked (POSIX): the rest is written, in order."""
    real = os.write
    calls: list[int] = []

    def short(fd: int, data: Any) -> int:
        calls.append(len(data))
        return real(fd, bytes(data)[:7])

    data = b"Subject: s\r\n\r\n" + bytes(range(256)) * 4
    b = IncomingBody(tmp_path, 16)
    monkeypatch.setattr(incoming.os, "write", short)
    await b.add(data)
    await b.finish()
    monkeypatch.undo()
    assert len(calls) > 1
    assert b.tmp_path is not None and b.tmp_path.read_bytes() == data
    b.discard()


class Race:
    """Two sessions at once: a folder in `folders`, found missing by this session, is
    created by the other one before this one's mkdir (both had seen it absent)."""

    def __init__(self) -> None:
        self.folders: set[Path] = set()
        self.created: list[Path] = []


@pytest.fixture
def race(monkeypatch: pytest.MonkeyPatch) -> Race:
    r = Race()
    real = Path.exists

    def exists(self: Path) -> bool:
        if self in r.folders and not real(self):
            r.folders.discard(self)
            self.mkdir(parents=True, mode=0o750)  # the other session's mkdir
            r.created.append(self)
            return False
        return real(self)

    monkeypatch.setattr(Path, "exists", exists)
    return r


async def test_two_sessions_creating_the_body_folders_at_once(tmp_path: Path, race: Race) -> None:
    """The first large bodies of two sessions, and two commits into a new folder: the
    session that loses the race to create a folder uses the one the other made."""
    tmp_folder = tmp_path / bodies.BODIES / incoming.TMP
    race.folders.add(tmp_folder)
    data = b"Subject: s\r\n\r\n" + b"x" * 100
    b = await fed(tmp_path, [data], inline_max=16)
    assert race.created == [tmp_folder]
    assert b.tmp_path is not None and b.tmp_path.parent == tmp_folder
    assert b.tmp_path.read_bytes() == data
    final = bodies.body_path(tmp_path, "AB123")
    race.folders.add(final.parent)
    rel = await b.commit("AB123")
    assert race.created == [tmp_folder, final.parent]
    assert rel == str(final.relative_to(tmp_path))
    assert final.read_bytes() == data and list(tmp_folder.iterdir()) == []


async def test_discard_after_the_temporary_file_was_swept(tmp_path: Path) -> None:
    """bodies.sweep may remove a stale temporary file of a slow session: discarding that
    body afterwards is not an error."""
    b = await fed(tmp_path, [b"Subject: s\r\n\r\n" + b"x" * 100], inline_max=16)
    tmp = b.tmp_path
    assert tmp is not None
    tmp.unlink()
    b.discard()
    assert b.tmp_path is None and not b.on_disk
    assert b.inline() == b""
