"""The end of DATA (`InboundHandler._accept`), in the test process where mutation testing sees
it (tests/MUTANTS.md): what the survivors of the first inbound.py run showed untested. The
one instant of an arrival (queue id, row, Received, Date), the stored copy byte for byte,
header qualification, feedback mail (bounces and unsubscribe requests, never relayed), the
spool failures after the data is in, and the log events an operator reads."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from relay.authenticity import unsubscribe
from relay.config.tree import Config, from_mapping
from relay.feedback.service import FeedbackService
from relay.inbound import handler as inbound
from relay.inbound.handler import InboundHandler, InboundStats, Suppressions
from relay.mail.message import rfc5322_date
from relay.ops import faults
from relay.ops.metrics import Metrics
from relay.spool.writer import SpoolWriter
from tests.harness import deep_merge
from tests.inbound.test_inprocess import (
    FULL,
    MSG,
    QUEUED,
    WAIT,
    Client,
    Relay,
    events,
    message,
    serve,
    shut_down,
)

BOUNCES = "bounces@relay.test"
UNSUB = "unsub@relay.test"
SECRET = b"s" * 40
FEEDBACK_OK = "250 2.0.0 Ok: feedback received"
DUPLICATE = "250 2.0.0 Ok: already queued (duplicate suppressed)"
# not a bounce or complaint report: kept unread in feedback_mail
NOT_A_REPORT = (
    b"From: someone@example.net\r\nTo: root\r\nSubject: hello there\r\n"
    b"Message-ID: <fb1@example.net>\r\n\r\njust a note\r\n"
)


async def handler_with_feedback(
    config: Config,
    writer: SpoolWriter,
    suppressions: Suppressions,
    queued: list[int],
    feedback: bool,
    stats: InboundStats | None = None,
) -> InboundHandler:
    """The listener's handler, with a started FeedbackService when `feedback` (feedback
    mail is taken at DATA, never relayed); every queued message appends to `queued`."""
    service = None
    if feedback:
        service = FeedbackService(
            lambda: config, writer, Metrics(), lambda: (0.0, []), suppressions.add_local
        )
        await service.start()
    return InboundHandler(
        config,
        config.listen[0],
        writer,
        suppressions,
        on_queued=lambda: queued.append(1),
        stats=stats,
        feedback=service,
    )


@pytest.fixture(autouse=True)
def _clean_faults() -> Iterator[None]:
    faults.disarm_all()
    yield
    faults.disarm_all()


Start = Callable[..., Awaitable[Relay]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """As tests/inbound/test_inprocess.py's, with an optional FeedbackService (the daemon's
    wiring: relay/daemon.py) and the feedback and unsubscribe addresses configured."""
    made: list[tuple[Relay, asyncio.AbstractServer]] = []

    async def factory(cfg: dict[str, Any] | None = None, *, feedback: bool = False) -> Relay:
        spool = tmp_path / f"spool{len(made)}"
        base: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(spool)}}
        if feedback:
            secret = tmp_path / "unsub.secret"
            secret.write_bytes(SECRET)
            base["feedback"] = {"address": BOUNCES}
            base["identities"] = {
                "example.com": {"unsubscribe": {"mailto": UNSUB, "secret_file": str(secret)}}
            }
        config = from_mapping(deep_merge(base, cfg or {}), tmp_path)
        writer = SpoolWriter(config.spool_path)
        writer.start()
        queued: list[int] = []
        handler = await handler_with_feedback(config, writer, Suppressions(), queued, feedback)
        server, port = await serve(handler)
        relay = Relay(config, config.spool_path, writer, handler, port, queued)
        made.append((relay, server))
        return relay

    yield factory
    await shut_down(made)


def qid_of(text: str) -> str:
    m = QUEUED.match(text)
    assert m, text
    return m.group(1)


def split_trace(stored: bytes) -> tuple[bytes, bytes]:
    """(our Received: field with its continuation lines, everything after it)."""
    assert stored.startswith(b"Received: ")
    lines = stored.split(b"\r\n")
    n = 1
    while lines[n][:1] == b"\t":
        n += 1
    trace = b"\r\n".join(lines[:n]) + b"\r\n"
    return trace, stored[len(trace) :]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def logged(
    caplog: pytest.LogCaptureFixture, event: str, logger: str = "relay.inbound"
) -> list[tuple[str, str, dict[str, Any]]]:
    """(level, message text, fields) of each `event` logged by `logger`."""
    return [
        (r.levelname, r.getMessage(), dict(getattr(r, "fields", {})))
        for r in caplog.records
        if r.name == logger and getattr(r, "event", "") == event
    ]


async def send_in_two(r: Relay, c: Client, first: bytes, rest: bytes) -> str:
    """One DATA whose data arrives in two reads: `first` (over `spool.inline_max`) is on disk
    in bodies/tmp before `rest` and the final dot are sent, so `finish()` has a last block to
    write: the order of the body writes is known (for `faults.arm(..., after=N)`)."""
    assert (await c.cmd("MAIL FROM:<app@example.com>"))[0] == 250
    assert (await c.cmd("RCPT TO:<a@example.org>"))[0] == 250
    assert (await c.cmd("DATA"))[0] == 354
    c.writer.write(first)
    await c.writer.drain()
    tmp = r.spool / "bodies" / "tmp"
    deadline = time.monotonic() + WAIT
    while not files_under(tmp):  # a condition, bounded: the server's first block written
        assert time.monotonic() < deadline, "the first block never reached bodies/tmp"
        await asyncio.sleep(0.005)
    c.writer.write(rest + b".\r\n")
    await c.writer.drain()
    return (await c.reply())[1]


# --- one arrival, one instant -----------------------------------------------------------------


async def test_the_queue_id_row_received_and_date_share_the_arrival_time(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrival = 1767225600.25  # Thu, 01 Jan 2026 00:00:00.250 UTC, long before the test runs
    monkeypatch.setattr(inbound, "time", SimpleNamespace(time=lambda: arrival))
    r = await start()
    qid = qid_of(await r.send("app@example.com", ["a@example.org"], message(Date="")))
    assert qid[:11] == f"{int(arrival * 1000):011X}"  # the queue id's milliseconds
    assert r.rows("SELECT created_at FROM messages") == [(arrival,)]
    trace, rest = split_trace(r.body(qid))
    date = rfc5322_date(arrival)
    assert date == "Thu, 01 Jan 2026 00:00:00 +0000"
    assert trace.endswith(f"; {date}\r\n".encode())
    assert rest.startswith(f"Date: {date}\r\n".encode())  # added, with the same instant


# --- the stored copy ----------------------------------------------------------------------------


async def test_the_stored_copy_is_our_trace_then_the_message_byte_for_byte(start: Start) -> None:
    r = await start()
    qid = qid_of(await r.send("app@example.com", ["a@example.org"], MSG))
    stored = r.body(qid)
    trace, rest = split_trace(stored)
    assert rest == MSG  # nothing between our Received: and the message (it had its ids)
    assert trace.startswith(b"Received: from client.test ([127.0.0.1])\r\n")
    assert r.messages()[0][3] == len(stored)


async def test_dedup_rows_hold_a_content_hash_only_for_an_idempotency_key(start: Start) -> None:
    r = await start()
    plain = qid_of(await r.send("app@example.com", ["a@example.org"], MSG))
    keyed = message("<k@app.example>", Idempotency_Key="key-7")
    with_key = qid_of(await r.send("app@example.com", ["b@example.org"], keyed))
    sql = "SELECT content_hash FROM dedup WHERE msg_id = ?"
    assert r.rows(sql, plain) == [(None,)]  # NULL, not '': no key, no content to hold it to
    [(chash,)] = r.rows(sql, with_key)
    assert isinstance(chash, str) and re.fullmatch(r"[0-9a-f]{16,}", chash), chash


async def test_the_destination_is_the_domain_after_the_last_at(start: Start) -> None:
    r = await start()
    c = await r.connect()
    text = await c.send("app@example.com", ['"a@b"@Example.ORG'], MSG)
    qid = qid_of(text)
    assert r.recipients() == [
        (qid, '"a@b"@Example.ORG', "example.org", 0, "pending", 0, r.recipients()[0][6])
    ]


async def test_a_lane_rule_on_the_listener_name(start: Start) -> None:
    r = await start({"lanes": {"rules": [{"lane": "bulk", "listener": "127.0.0.1:2525"}]}})
    assert QUEUED.match(await r.send("app@example.com", ["a@example.org"], MSG))
    assert [m[6] for m in r.messages()] == ["bulk"]
    assert [x[3] for x in r.recipients()] == [1]  # bulk's priority


# --- header qualification (allow-listed apps only) ---------------------------------------------


async def test_a_bare_local_part_in_the_last_header_line_is_qualified(start: Start) -> None:
    r = await start({"local": {"domain": "corp.test"}})
    # not an address field first, and the only bare name on the very last line (one letter)
    content = (
        b"Subject: report\r\nFrom: app@example.com\r\n"
        b"Date: Thu, 01 Jan 2026 00:00:00 +0000\r\nMessage-ID: <q@app.example>\r\nTo: x\r\n"
        b"\r\nbody\r\n"
    )
    qid = qid_of(await r.send("app@example.com", ["a@example.org"], content))
    _, rest = split_trace(r.body(qid))
    assert rest == content.replace(b"To: x\r\n", b"To: x@corp.test\r\n")


# --- feedback mail: read here, never relayed ---------------------------------------------------


def feedback_rows(r: Relay) -> list[tuple[Any, ...]]:
    return r.rows("SELECT peer, sender, rcpt, size, body, events FROM feedback_mail ORDER BY id")


async def test_feedback_mail_from_anywhere_is_kept_as_sent_and_not_queued(start: Start) -> None:
    # not an allowed network: only the feedback address is taken, and nothing is qualified
    r = await start(
        {"local": {"domain": "corp.test"}, "listen": [{"address": "127.0.0.1:2525", "allow": []}]},
        feedback=True,
    )
    c = await r.connect()
    assert await c.send("daemon@example.net", [BOUNCES], NOT_A_REPORT) == FEEDBACK_OK
    assert await c.send("", ["Bounces+x@relay.test"], NOT_A_REPORT) == FEEDBACK_OK
    assert feedback_rows(r) == [
        ("127.0.0.1", "daemon@example.net", BOUNCES, len(NOT_A_REPORT), NOT_A_REPORT, 0),
        ("127.0.0.1", "", "Bounces+x@relay.test", len(NOT_A_REPORT), NOT_A_REPORT, 0),
    ]
    assert r.messages() == [] and r.queued == []
    assert r.handler.stats.accepted == 0


async def test_mail_to_feedback_and_to_others_relays_only_the_others(start: Start) -> None:
    r = await start(feedback=True)
    c = await r.connect()
    qid = qid_of(await c.send("app@example.com", [BOUNCES, "a@example.org"], MSG))
    assert [(x[0], x[1]) for x in r.recipients()] == [(qid, "a@example.org")]
    assert feedback_rows(r) == [("127.0.0.1", "app@example.com", BOUNCES, len(MSG), MSG, 0)]
    trace, rest = split_trace(r.body(qid))
    assert rest == MSG and b"\tfor <a@example.org>; " in trace  # one recipient left


def unsubscribe_request(mid: str, token: str) -> bytes:
    return (
        f"From: reader@example.org\r\nTo: {UNSUB}\r\nSubject: unsubscribe {token}\r\n"
        f"Message-ID: {mid}\r\n\r\nplease\r\n"
    ).encode()


async def test_an_unsubscribe_mail_suppresses_and_is_not_kept(start: Start) -> None:
    r = await start(feedback=True)
    token = unsubscribe.make_token(SECRET, "example.com", "reader@example.org")
    request = unsubscribe_request("<u1@example.org>", token)
    c = await r.connect()
    assert await c.send("reader@example.org", [UNSUB], request) == FEEDBACK_OK
    assert r.rows("SELECT address, scope FROM suppression") == [
        ("reader@example.org", "example.com")
    ]
    assert feedback_rows(r) == [] and r.messages() == []
    # to both: the unsubscribe is applied, the bounce address alone keeps a copy
    token2 = unsubscribe.make_token(SECRET, "example.com", "other@example.org")
    both = unsubscribe_request("<u2@example.org>", token2)
    assert await c.send("other@example.org", [UNSUB, BOUNCES], both) == FEEDBACK_OK
    assert ("other@example.org", "example.com") in r.rows("SELECT address, scope FROM suppression")
    assert feedback_rows(r) == [("127.0.0.1", "other@example.org", BOUNCES, len(both), both, 0)]


async def test_an_unsubscribe_mail_without_a_token_is_logged_with_its_sender_and_peer(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay.feedback.service")
    r = await start(feedback=True, cfg={"log": {"unmask": True}})
    c = await r.connect()
    assert await c.send("reader@example.org", [UNSUB], MSG) == FEEDBACK_OK
    [(level, _, fields)] = logged(caplog, "unsubscribe_refused", "relay.feedback.service")
    assert level == "WARNING"
    assert fields == {
        "sender": "reader@example.org",
        "peer": "127.0.0.1",
        "reason": "no token in the Subject",
    }
    assert r.rows("SELECT count(*) FROM suppression") == [(0,)]


async def test_feedback_mail_the_spool_cannot_keep_is_4xx_and_kept_nowhere(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay.inbound")
    r = await start(feedback=True)
    c = await r.connect()
    faults.arm("spool.commit", "enospc", times=1)
    assert await c.send("daemon@example.net", [BOUNCES], NOT_A_REPORT) == FULL
    assert feedback_rows(r) == []
    [(level, _, fields)] = logged(caplog, "spool_error")
    assert level == "ERROR" and fields["error"] == "database or disk is full"
    assert re.fullmatch(r"[0-9A-F]{16}", str(fields["queue_id"]))
    assert r.handler.stats.by_reason == {"spool_error": 1}
    # the client tries again: kept
    assert await c.send("daemon@example.net", [BOUNCES], NOT_A_REPORT) == FEEDBACK_OK
    assert len(feedback_rows(r)) == 1


# --- spool failures once the data is in --------------------------------------------------------


LONG_BODY = b"q" * 1500 + b"\r\n"  # over 998 octets: re-encoded (a rewrite of the file)


@pytest.mark.parametrize(
    ("case", "after"),
    [
        ("finish", 1),  # the last block of the temporary file
        ("reencode", 2),  # rewriting it with its long lines re-encoded
        ("idempotency_key", 2),  # rewriting it without the Idempotency-Key field
    ],
)
async def test_a_body_write_failing_after_the_data_is_in_is_452(
    start: Start, caplog: pytest.LogCaptureFixture, case: str, after: int
) -> None:
    caplog.set_level("INFO", logger="relay.inbound")
    r = await start({"spool": {"inline_max": "1KiB"}})
    c = await r.connect()
    extra = {"Idempotency_Key": "key-9"} if case == "idempotency_key" else {}
    body = (b"y" * 70 + b"\r\n") * 40 + (LONG_BODY if case == "reencode" else b"")
    content = message(body=body, **extra)
    faults.arm("body.write", "enospc", times=1, after=after)
    assert await send_in_two(r, c, content[:2000], content[2000:]) == FULL
    [(level, msg, fields)] = logged(caplog, "spool_error")
    assert (level, msg) == ("ERROR", "message not accepted")
    assert re.fullmatch(r"[0-9A-F]{16}", str(fields["queue_id"]))
    assert "No space left on device" in str(fields["error"])
    assert r.messages() == [] and r.handler.stats.by_reason == {"spool_error": 1}
    # nothing remembered: the retry is queued
    assert QUEUED.match(await c.send("app@example.com", ["a@example.org"], content))


@pytest.mark.xfail(
    strict=True,
    reason="BUG relay/inbound.py _accept: an OSError from finish()/rewrite() (and from the"
    " Idempotency-Key rewrite) returns spool_failed() without incoming.discard(): the"
    " temporary body file stays in bodies/tmp and its descriptor stays open",
)
@pytest.mark.parametrize(
    ("case", "after"), [("finish", 1), ("reencode", 2), ("idempotency_key", 2)]
)
async def test_a_body_write_failing_after_the_data_is_in_leaves_no_temporary_file(
    start: Start, case: str, after: int
) -> None:
    r = await start({"spool": {"inline_max": "1KiB"}})
    c = await r.connect()
    extra = {"Idempotency_Key": "key-9"} if case == "idempotency_key" else {}
    body = (b"y" * 70 + b"\r\n") * 40 + (LONG_BODY if case == "reencode" else b"")
    content = message(body=body, **extra)
    faults.arm("body.write", "enospc", times=1, after=after)
    assert await send_in_two(r, c, content[:2000], content[2000:]) == FULL
    assert files_under(r.spool / "bodies") == []  # "leaves nothing behind" (accept_stream)


async def test_an_idempotency_conflict_of_a_large_body_leaves_no_file(start: Start) -> None:
    r = await start({"spool": {"inline_max": "1KiB"}})
    body = (b"v" * 70 + b"\r\n") * 40
    first = qid_of(
        await r.send(
            "app@example.com", ["a@example.org"], message(body=body, Idempotency_Key="k-1")
        )
    )
    other = message(body=body + b"more\r\n", Idempotency_Key="k-1")
    assert await r.send("app@example.com", ["a@example.org"], other) == (
        "554 5.6.0 Idempotency-Key k-1 was already used for a message with other content;"
        " use a new key for a new message"
    )
    assert [p.name for p in files_under(r.spool / "bodies")] == [first]
    assert r.handler.stats.by_reason == {"idempotency_conflict": 1}


async def test_every_resubmission_is_counted(start: Start) -> None:
    r = await start()
    assert QUEUED.match(await r.send("app@example.com", ["a@example.org"], MSG))
    assert await r.send("app@example.com", ["a@example.org"], MSG) == DUPLICATE
    assert await r.send("app@example.com", ["a@example.org"], MSG) == DUPLICATE
    assert r.handler.stats.deduplicated == 2 and r.handler.stats.accepted == 1


# --- the log -----------------------------------------------------------------------------------


async def test_the_outcome_events_say_what_happened(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay.inbound")
    r = await start()
    assert QUEUED.match(await r.send("app@example.com", ["a@example.org"], MSG))
    assert await r.send("app@example.com", ["a@example.org"], MSG) == DUPLICATE
    keyed = message("<k@app.example>", Idempotency_Key="key-1")
    assert QUEUED.match(await r.send("app@example.com", ["c@example.org"], keyed))
    other = message("<k@app.example>", body=b"other\r\n", Idempotency_Key="key-1")
    assert (await r.send("app@example.com", ["c@example.org"], other)).startswith("554 ")
    assert [(lvl, msg) for lvl, msg, _ in logged(caplog, "accepted")] == [
        ("INFO", "message queued"),
        ("INFO", "message queued"),
    ]
    assert [(lvl, msg) for lvl, msg, _ in logged(caplog, "deduplicated")] == [
        ("INFO", "resubmission not queued again")
    ]
    assert [(lvl, msg) for lvl, msg, _ in logged(caplog, "idempotency_conflict")] == [
        ("WARNING", "Idempotency-Key reused for other content; refused")
    ]
    assert [e[1] for e in events(caplog)].count("accepted") == 2


async def test_nul_characters_removed_are_logged_with_the_queue_id_count_and_peer(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    r = await start()
    qid = qid_of(await r.send("app@example.com", ["a@example.org"], message(body=b"a\0b\0c\0\r\n")))
    assert logged(caplog, "nul_stripped") == [
        (
            "WARNING",
            "NUL characters removed from the message (RFC 5322 2.3)",
            {"queue_id": qid, "count": 3, "peer": "127.0.0.1"},
        )
    ]


async def test_reencoding_is_logged_with_the_queue_id_and_new_size(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay.inbound")
    r = await start()
    qid = qid_of(await r.send("app@example.com", ["a@example.org"], message(body=LONG_BODY)))
    _, rest = split_trace(r.body(qid))
    assert b"Content-Transfer-Encoding: quoted-printable\r\n" in rest
    assert logged(caplog, "reencoded") == [
        ("INFO", "lines over 998 octets re-encoded", {"queue_id": qid, "size": len(rest)})
    ]


async def test_a_long_header_line_alone_is_kept_and_not_logged_as_reencoded(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay.inbound")
    r = await start()
    content = message(X_Long="h" * 1200)
    qid = qid_of(await r.send("app@example.com", ["a@example.org"], content))
    assert split_trace(r.body(qid))[1] == content  # header lines are never folded
    assert logged(caplog, "reencoded") == []
    assert len(logged(caplog, "accepted")) == 1
