"""Dedup that knows content: the fingerprint (relay/spool/dedup.py, pure), and the spool's accept
(relay/spool/ops.py) on SQLite and PostgreSQL: a Message-ID key hit with another
fingerprint is queued under a variant key, the same content stays a duplicate, keys stored
before fingerprints existed keep the old rule, an Idempotency-Key keeps its own."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.mail.message import normalize_line_endings
from relay.spool import db, dedup, ops, schema
from relay.spool.incoming import IncomingBody
from tests.pgserver import BACKENDS, open_backend

# --- the fingerprint (pure) -----------------------------------------------------------------

BODY = b"Hello,\r\n\r\nyour code is 1234.\r\n"


@pytest.mark.parametrize(
    ("subject", "body", "same"),
    [
        # line endings: bare LF, bare CR, a mix: all one body
        ("hi", b"Hello,\n\nyour code is 1234.\n", True),
        ("hi", b"Hello,\r\ryour code is 1234.\r", True),
        ("hi", b"Hello,\r\n\nyour code is 1234.\r", True),
        # empty lines at the end, or no final line end: the same body (RFC 6376 3.4.3)
        ("hi", BODY + b"\r\n\r\n\r\n", True),
        ("hi", BODY[:-2], True),
        # the Subject unfolded, its white space runs one space
        ("  hi ", BODY, True),
        # other text, other Subject, empty lines inside or at the start: other content
        ("hi", b"Hello,\r\n\r\nyour code is 1235.\r\n", False),
        ("hello", BODY, False),
        (None, BODY, False),
        ("hi", b"Hello,\r\n\r\n\r\nyour code is 1234.\r\n", False),
        ("hi", b"\r\n" + BODY, False),
        ("hi", b"Hello, \r\n\r\nyour code is 1234.\r\n", False),  # white space is content
        ("hi", b"", False),
    ],
)
def test_fingerprint_table(subject: str | None, body: bytes, same: bool) -> None:
    assert (dedup.fingerprint(subject, body) == dedup.fingerprint("hi", BODY)) is same


def test_an_empty_body_and_only_empty_lines_are_the_same() -> None:
    assert dedup.fingerprint("s", b"") == dedup.fingerprint("s", b"\r\n\r\n\n\r")
    assert len(dedup.fingerprint("s", b"")) == dedup.FINGERPRINT_HEX


def test_regenerated_headers_do_not_change_a_messages_fingerprint() -> None:
    first = (
        b"Received: from app by host; Thu, 03 Dec 2026 10:00:00 +0000\r\n"
        b"From: app@example.com\r\nTo: u@example.org\r\nSubject: Your receipt\r\n"
        b"Date: Thu, 03 Dec 2026 10:00:00 +0000\r\nMessage-ID: <r1@app.example>\r\n"
        b"X-Mailer: app 1.0\r\n\r\n" + BODY
    )
    again = (
        b"From: app@example.com\r\nTo: u@example.org\r\n"
        b"Subject: Your\r\n receipt\r\nDate: Thu, 03 Dec 2026 10:05:00 +0000\r\n"
        b"Message-ID: <r1@app.example>\r\nX-Mailer: app 1.1\r\n\r\n" + BODY.replace(b"\r\n", b"\n")
    )
    other = first.replace(b"1234", b"9999")
    assert dedup.message_fingerprint(first) == dedup.message_fingerprint(again)
    assert dedup.message_fingerprint(first) != dedup.message_fingerprint(other)
    # the header block is not body: a header line that moves into the body is other content
    assert dedup.message_fingerprint(first) != dedup.message_fingerprint(
        first.replace(b"X-Mailer: app 1.0\r\n\r\n", b"\r\nX-Mailer: app 1.0\r\n")
    )


@given(
    st.lists(st.sampled_from([b"a", b" ", b"\r", b"\n", b"\r\n", b"xy", b"."]), max_size=40),
    st.lists(st.integers(0, 80), max_size=6),
)
def test_any_split_into_blocks_gives_the_whole_bodys_fingerprint(
    parts: list[bytes], cuts: list[int]
) -> None:
    body = b"".join(parts)
    fp = dedup.BodyFingerprint()
    at = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts):
        fp.update(body[at:cut])
        at = cut
    fp.update(body[at:])
    assert fp.hexdigest("s") == dedup.fingerprint("s", body)
    # and the reference: line ends as CRLF, empty lines at the end dropped, one CRLF after
    lines = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n").rstrip(b"\n")
    canon = lines.replace(b"\n", b"\r\n") + b"\r\n" if lines else b""
    assert dedup.fingerprint("s", body) == _reference("s", canon)


_crlf_pieces = st.lists(
    st.one_of(
        st.sampled_from([b"a", b"\r", b"\n", b"\r\n", b"\r\n\r\n", b"\r\n" * 3, b"xy"]),
        st.binary(max_size=8),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_crlf_pieces, st.lists(st.integers(0, 200), max_size=12), st.booleans(), st.booleans())
def test_blocks_known_to_be_crlf_give_the_general_paths_fingerprint(
    parts: list[bytes], cuts: list[int], at_lines: bool, raw_too: bool
) -> None:
    """The path for blocks whose line ends are all CRLF (`crlf=True`, what the DATA parser
    hands out) against the general path, on any bytes made CRLF and any split of them: with
    `at_lines`, cuts only after a CRLF, as the parser cuts (so blocks of only empty lines
    come often), else anywhere (also between a CR and its LF); with `raw_too`, every other
    block takes the general path in the same hash."""
    body = normalize_line_endings(b"".join(parts))
    assert body.count(b"\r") == body.count(b"\n") == body.count(b"\r\n")
    if at_lines:
        ends = [i + 1 for i in range(len(body)) if body[i : i + 1] == b"\n"] or [0]
        cuts = [ends[c % len(ends)] for c in cuts]
    fast, slow = dedup.BodyFingerprint(), dedup.BodyFingerprint()
    at = 0
    for i, cut in enumerate([*sorted(c % (len(body) + 1) for c in cuts), len(body)]):
        block = body[at:cut]
        fast.update(block, crlf=not (raw_too and i % 2))
        slow.update(block)
        at = cut
    assert fast.hexdigest("s") == slow.hexdigest("s") == dedup.fingerprint("s", body)
    lines = body.rstrip(b"\r\n")
    assert fast.hexdigest(None) == _reference_none(lines + b"\r\n" if lines else b"")


def _reference_none(canon: bytes) -> str:
    import hashlib

    h = hashlib.sha256(b"subject:\r\n")
    h.update(hashlib.sha256(canon).digest())
    return h.hexdigest()[: dedup.FINGERPRINT_HEX]


@pytest.mark.parametrize(
    "blocks",
    [
        [b"a\r\n", b"\r\n", b"\r\n", b"b\r\n"],  # empty lines held over blocks, then text
        [b"a\r\n\r\n\r\n", b"b"],  # empty lines at a block's end, text without line end
        [b"\r\n\r\n", b"a\r\n\r\n"],  # empty lines first (they are content), then at the end
        [b"a\r", b"\nb\r\n\r", b"\n"],  # a CRLF split between blocks
        [b"a\r\n", b"b\r\n\r\n"],
    ],
)
def test_crlf_blocks_table(blocks: list[bytes]) -> None:
    fp = dedup.BodyFingerprint()
    for b in blocks:
        fp.update(b, crlf=True)
    assert fp.hexdigest("s") == dedup.fingerprint("s", b"".join(blocks))


def _reference(subject: str, canon: bytes) -> str:
    import hashlib

    h = hashlib.sha256(b"subject:" + subject.encode() + b"\r\n")
    h.update(hashlib.sha256(canon).digest())
    return h.hexdigest()[: dedup.FINGERPRINT_HEX]


async def test_the_incoming_body_fingerprints_what_the_client_sent(tmp_path: Path) -> None:
    """Streamed in reads of any size, in memory or past inline_max on disk: the same as the
    whole message's; the header block is not hashed as body."""
    msg = b"Subject: hi\r\nMessage-ID: <a@b.example>\r\n\r\n" + b"line of text\r\n" * 5000
    for inline_max, step in ((1 << 20, 7), (1024, 4096)):
        inc = IncomingBody(tmp_path, inline_max)
        for i in range(0, len(msg), step):
            await inc.add(msg[i : i + step])
        await inc.finish()
        assert inc.fingerprint("hi") == dedup.message_fingerprint(msg)
        inc.discard()


def test_a_variant_key_is_per_key_and_fingerprint() -> None:
    k = dedup.dedup_key("listener:x", "<a@b>", "u@example.org")
    v = dedup.variant_key(k, "f" * 40)
    assert v != k and len(v) == len(k) == 40
    assert v == dedup.variant_key(k, "f" * 40)
    assert v != dedup.variant_key(k, "e" * 40)
    assert v != dedup.variant_key(dedup.dedup_key("listener:x", "<a@b>", "v@example.org"), "f" * 40)


# --- the spool's accept, on both backends ---------------------------------------------------

WINDOW = 7 * 86400.0
NS = "listener:test"


@pytest.fixture(params=BACKENDS)
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    c = open_backend(request, tmp_path / "spool")
    yield c
    c.close()


def new_message(
    qid: str,
    rcpts: list[str],
    fp: str | None,
    at: float = 1000.0,
    mid: str = "<m@app.example>",
    chash: str | None = None,
    key: str | None = None,
) -> ops.NewMessage:
    return ops.NewMessage(
        queue_id=qid,
        message_id=mid,
        sender="app@example.com",
        size=10,
        created_at=at,
        client=NS,
        peer="127.0.0.1",
        lane="transactional",
        lane_prio=0,
        identity="example.com",
        body=b"x",
        body_path=None,
        recipients=tuple(
            ops.NewRecipient(
                r,
                r.rpartition("@")[2],
                dedup.dedup_key(NS, mid, r)
                if key is None
                else dedup.idempotency_dedup_key(NS, key, r),
                content_hash=chash,
                fingerprint=fp,
            )
            for r in rcpts
        ),
    )


def accept(conn: Any, msg: ops.NewMessage) -> ops.AcceptResult:
    with db.transaction(conn):
        return ops.accept(conn, msg, WINDOW)


FP_A, FP_B, FP_C = "a" * 40, "b" * 40, "c" * 40


def test_same_content_is_a_duplicate_other_content_is_queued(conn: Any) -> None:
    first = accept(conn, new_message("Q1", ["u@example.org"], FP_A))
    assert first.queued == ("u@example.org",) and first.reused == ()
    # the same content again: a duplicate, nothing queued
    assert accept(conn, new_message("Q2", ["u@example.org"], FP_A, at=1001)) == ops.AcceptResult(
        None, (), ("u@example.org",)
    )
    # other content under the same Message-ID: queued, and said to reuse Q1's key
    other = accept(conn, new_message("Q3", ["u@example.org"], FP_B, at=1002))
    assert other.queue_id == "Q3" and other.queued == ("u@example.org",)
    assert other.reused == (("u@example.org", "Q1"),)
    # a resubmission of that second message is a duplicate in turn; of the first, too
    assert accept(conn, new_message("Q4", ["u@example.org"], FP_B, at=1003)).queue_id is None
    assert accept(conn, new_message("Q5", ["u@example.org"], FP_A, at=1004)).queue_id is None
    # a third content: queued again, still naming the key's first message
    third = accept(conn, new_message("Q6", ["u@example.org"], FP_C, at=1005))
    assert third.reused == (("u@example.org", "Q1"),)
    rows = conn.execute("SELECT msg_id, address, dedup_key FROM recipients ORDER BY id").fetchall()
    # the recipients keep the app's own key (dead letters name it); the variants are dedup's
    key = dedup.dedup_key(NS, "<m@app.example>", "u@example.org")
    assert [tuple(r) for r in rows] == [
        ("Q1", "u@example.org", key),
        ("Q3", "u@example.org", key),
        ("Q6", "u@example.org", key),
    ]
    stored = {
        r[0]: (r[1], r[2])
        for r in conn.execute("SELECT key, msg_id, fingerprint FROM dedup").fetchall()
    }
    assert stored == {
        key: ("Q1", FP_A),
        dedup.variant_key(key, FP_B): ("Q3", FP_B),
        dedup.variant_key(key, FP_C): ("Q6", FP_C),
    }


def test_a_mixed_message_queues_new_and_reused_recipients_only(conn: Any) -> None:
    accept(conn, new_message("Q1", ["a@example.org", "b@example.org"], FP_A))
    res = accept(
        conn, new_message("Q2", ["a@example.org", "b@example.org", "c@example.org"], FP_B, at=2)
    )
    assert res.queued == ("a@example.org", "b@example.org", "c@example.org")
    assert res.reused == (("a@example.org", "Q1"), ("b@example.org", "Q1"))


def test_keys_stored_without_a_fingerprint_keep_the_old_rule(conn: Any) -> None:
    """A key from before this change (NULL fingerprint), or a message given none (a DSN,
    the outbox): a hit is a duplicate, whatever the content."""
    accept(conn, new_message("Q1", ["u@example.org"], None))
    assert accept(conn, new_message("Q2", ["u@example.org"], FP_B, at=1001)).queue_id is None
    accept(conn, new_message("Q3", ["v@example.org"], FP_A))
    assert accept(conn, new_message("Q4", ["v@example.org"], None, at=1001)).queue_id is None


def test_a_key_past_the_window_is_taken_again_with_the_new_fingerprint(conn: Any) -> None:
    accept(conn, new_message("Q1", ["u@example.org"], FP_A, at=0))
    res = accept(conn, new_message("Q2", ["u@example.org"], FP_B, at=WINDOW + 1))
    assert res.queue_id == "Q2" and res.reused == ()
    assert accept(conn, new_message("Q3", ["u@example.org"], FP_B, at=WINDOW + 2)).queue_id is None


def test_an_idempotency_key_keeps_its_stricter_rule(conn: Any) -> None:
    """Same key, other content: refused (conflict), never queued as a reuse, even when a
    fingerprint is given; same key and content hash: a duplicate."""
    accept(conn, new_message("Q1", ["u@example.org"], FP_A, chash="h1", key="order-1"))
    res = accept(conn, new_message("Q2", ["u@example.org"], FP_B, at=2, chash="h2", key="order-1"))
    assert res == ops.AcceptResult(None, (), (), ("u@example.org",))
    res = accept(conn, new_message("Q3", ["u@example.org"], FP_B, at=3, chash="h1", key="order-1"))
    assert res.queue_id is None and res.duplicates == ("u@example.org",) and res.reused == ()


# --- the migration of an existing spool -----------------------------------------------------


def test_an_existing_sqlite_spool_is_migrated_and_its_keys_keep_the_old_rule(
    tmp_path: Path,
) -> None:
    path = tmp_path / "spool"
    path.mkdir()
    old = sqlite3.connect(db.db_path(path), isolation_level=None)
    for version, script in enumerate(schema.MIGRATIONS[:8]):
        for stmt in schema.statements(script):
            old.execute(stmt)
        old.execute(f"PRAGMA user_version={version + 1}")
    key = dedup.dedup_key(NS, "<m@app.example>", "u@example.org")
    old.execute("INSERT INTO dedup (key, msg_id, created_at) VALUES (?, 'Q0', 999)", (key,))
    old.execute(
        "INSERT INTO feedback_mail (at, peer, sender, rcpt, size, body, events)"
        " VALUES (1, 'p', 's', 'r', 5, x'6162636465', 0)"
    )
    old.close()
    conn = db.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(db.MIGRATIONS)
        assert conn.execute("SELECT fingerprint FROM dedup").fetchone()[0] is None
        assert tuple(conn.execute("SELECT stored, truncated FROM feedback_mail").fetchone()) == (
            5,
            0,
        )
        # the key from before: other content is still a duplicate (no fingerprint to compare)
        assert accept(conn, new_message("Q1", ["u@example.org"], FP_A)).queue_id is None
    finally:
        conn.close()


def test_an_existing_postgresql_spool_is_migrated(pg_dsn: str) -> None:
    import psycopg

    from relay.spool import pg

    with psycopg.connect(pg_dsn, autocommit=True) as c:  # a spool at schema version 8
        c.execute("CREATE TABLE relay_schema (version INTEGER NOT NULL)")
        c.execute("INSERT INTO relay_schema VALUES (0)")
    conn = pg.PgConnection(pg_dsn)
    saved = db.MIGRATIONS[8:]
    try:
        del db.MIGRATIONS[8:]
        pg.migrate(conn)
    finally:
        db.MIGRATIONS.extend(saved)
    key = dedup.dedup_key(NS, "<m@app.example>", "u@example.org")
    conn.execute("INSERT INTO dedup (key, msg_id, created_at) VALUES (?, 'Q0', 999)", (key,))
    conn.execute(
        "INSERT INTO feedback_mail (at, peer, sender, rcpt, size, body, events)"
        " VALUES (1, 'p', 's', 'r', 5, ?, 0)",
        (b"abcde",),
    )
    assert pg.migrate(conn) == len(db.MIGRATIONS)
    assert conn.execute("SELECT fingerprint FROM dedup").fetchone()[0] is None
    assert tuple(conn.execute("SELECT stored, truncated FROM feedback_mail").fetchone()) == (5, 0)
    assert accept(conn, new_message("Q1", ["u@example.org"], FP_A)).queue_id is None
    conn.close()
