"""More survivors of the spool mutation run, in-process (tests/MUTANTS.md): the dedup
window's edge, `queue hold` of some messages, a node's heartbeat as stored, and an
arriving body's edges: a header block at HEAD_MAX, a write batch of exactly FLUSH_AT
octets, short writes, two sessions creating the body folders at once, a temporary file
already swept when the body is discarded. Each spool test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from relay.spool import bodies, dedup, incoming, ops
from relay.spool.incoming import IncomingBody
from tests.pgserver import BACKENDS, open_backend
from tests.spool.test_incoming import fed
from tests.spool.test_ops import T0, put, rcpt, run, spool_message

HOST = "relay.test"


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    yield c
    c.close()


# --- the spool -----------------------------------------------------------------------------


def new_message(qid: str, address: str, key: str, created_at: float) -> ops.NewMessage:
    """One recipient under the dedup key `key`, arrived at `created_at`."""
    return dataclasses.replace(
        spool_message(qid, [address], created_at=created_at, listener=None),
        recipients=(ops.NewRecipient(address, address.rpartition("@")[2], key),),
    )


@pytest.mark.parametrize(
    ("age", "queued"),
    [(59.0, False), (60.0, True), (61.0, True)],
)
def test_the_dedup_window_ends_exactly_window_seconds_later(
    conn: sqlite3.Connection, age: float, queued: bool
) -> None:
    """A key seen `dedup_window` seconds ago or more is no longer a duplicate: the message
    is queued again (and takes the key); inside the window it is reported a duplicate."""
    run(conn, ops.accept, new_message("M1", "a@x.test", "k", T0), 60)
    res = run(conn, ops.accept, new_message("M2", "a@x.test", "k", T0 + age), 60)
    if queued:
        assert (res.queue_id, res.queued, res.duplicates) == ("M2", ("a@x.test",), ())
        row = conn.execute("SELECT msg_id, created_at FROM dedup WHERE key = 'k'").fetchone()
        assert tuple(row) == ("M2", T0 + age)
    else:
        assert (res.queue_id, res.queued, res.duplicates) == (None, (), ("a@x.test",))
    n = conn.execute("SELECT count(*) FROM recipients WHERE msg_id = 'M2'").fetchone()[0]
    assert n == (1 if queued else 0)


def test_hold_holds_the_given_messages_only(conn: sqlite3.Connection) -> None:
    put(conn, "M1", ["a@x.test"])
    put(conn, "M2", ["b@x.test"])
    assert run(conn, ops.hold, ["M1"], T0 + 5) == 1
    assert rcpt(conn, "a@x.test")["state"] == "held"
    assert rcpt(conn, "b@x.test")["state"] == "pending"
    assert run(conn, ops.release, ["M1"], T0 + 6) == 1
    assert rcpt(conn, "a@x.test")["state"] == "deferred"


def test_a_heartbeat_stores_the_nodes_info_with_sorted_keys(conn: sqlite3.Connection) -> None:
    """The nodes row's info is canonical JSON (sorted keys): the same facts always read
    the same in the table, whatever order the node built them in."""
    info: dict[str, Any] = {"pid": 7, "host": "h1", "version": "1", "addr": "10.0.0.1"}
    run(conn, ops.heartbeat, "n1", T0, T0 + 5, 2, info)
    stored = conn.execute("SELECT info FROM nodes WHERE name = 'n1'").fetchone()[0]
    assert stored == json.dumps(info, sort_keys=True)
    assert list(json.loads(stored)) == ["addr", "host", "pid", "version"]


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
