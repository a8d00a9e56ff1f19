"""`relay queue list` reads the spool a page at a time (keyset pagination) and streams its
output: same messages, same order, same JSON text as reading it whole, at any page size."""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import cast

import pytest

from relay.cli import main as cli
from relay.spool import db, ops
from tests.pgserver import BACKENDS, open_backend

T0 = 1_800_000_000.0


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    with db.transaction(c):
        for i in range(23):
            # several messages share one arrival time: the cursor must break the tie by id
            at = T0 + i // 4
            msg = ops.NewMessage(
                queue_id=f"Q{i:03d}",
                message_id=f"m{i}@x",
                sender="a@x.test",
                size=100 + i,
                created_at=at,
                client="c",
                peer="p",
                lane="transactional",
                lane_prio=0,
                identity="x.test",
                body=b"x",
                body_path=None,
                recipients=(ops.NewRecipient(f"u{i}@y.test", "y.test", f"k{i}"),),
            )
            ops.accept(c, msg, 3600)
        # every third message finished
        c.execute(
            "UPDATE recipients SET state = 'delivered' WHERE"
            " CAST(substr(msg_id, 2) AS INTEGER) % 3 = 0"
        )
    yield c
    c.close()


@pytest.mark.parametrize("page", [1, 2, 3, 4, 5, 500])
def test_pages_give_every_message_once_in_order(conn: sqlite3.Connection, page: int) -> None:
    everything = [m["id"] for m in ops.iter_messages(conn, include_finished=True, page=page)]
    assert everything == [f"Q{i:03d}" for i in range(23)]
    waiting = [m["id"] for m in ops.iter_messages(conn, page=page)]
    assert waiting == [f"Q{i:03d}" for i in range(23) if i % 3]
    sent = [m["id"] for m in ops.iter_messages(conn, state="sent", page=page)]
    assert sent == [f"Q{i:03d}" for i in range(23) if i % 3 == 0]
    first = [m["id"] for m in ops.iter_messages(conn, include_finished=True, page=page, limit=7)]
    assert first == everything[:7]


def test_the_streamed_json_is_the_same_text_as_the_whole_list(conn: sqlite3.Connection) -> None:
    msgs = ops.list_messages(conn, include_finished=True)
    for items in (msgs, msgs[:1], []):
        whole, streamed = io.StringIO(), io.StringIO()
        with redirect_stdout(whole):
            cli._print_json(items)
        with redirect_stdout(streamed):
            cli._stream_json_array(iter(items))
        assert streamed.getvalue() == whole.getvalue()
        assert json.loads(streamed.getvalue()) == items


def test_the_mailq_listing_streams_with_its_totals(conn: sqlite3.Connection) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        cli._print_mailq(ops.iter_messages(conn, include_finished=True, page=4))
    text = out.getvalue()
    assert text.startswith("-Queue ID-")
    assert text.count("[delivered]") == 8 and text.count("[pending]") == 15
    assert text.rstrip().endswith("in 23 Requests.")
    out = io.StringIO()
    with redirect_stdout(out):
        cli._print_mailq(iter(()))
    assert out.getvalue() == "Mail queue is empty\n"
