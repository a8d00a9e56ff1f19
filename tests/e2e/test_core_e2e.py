"""The durable core end to end: a real daemon subprocess, a real aiosmtpd upstream, real
SQLite. Byte-for-byte relaying, dedup, SIGKILL without loss, and a spool that cannot take a
write answering 4xx."""

from __future__ import annotations

import collections
import re
import smtplib
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.harness import (
    Received,
    RelayProcess,
    Upstream,
    free_port,
    make_message,
    send,
    smtp_session,
)

UpFactory = Callable[..., Upstream]
RelayFactory = Callable[..., RelayProcess]

TRACE = re.compile(rb"\AReceived: [^\r\n]*\r\n(?:[ \t][^\r\n]*\r\n)*")
MID = re.compile(rb"^Message-ID: (<[^>\r\n]*>)\r$", re.MULTILINE | re.IGNORECASE)


def split_trace(data: bytes) -> tuple[bytes, bytes]:
    """(the relay's Received: header, everything after it)."""
    m = TRACE.match(data)
    assert m, f"no Received: header at the top: {data[:200]!r}"
    return m.group(0), data[m.end() :]


def mid_of(data: bytes) -> str:
    m = MID.search(data)
    assert m, f"no Message-ID in {data[:300]!r}"
    return m.group(1).decode()


def by_mid(up: Upstream) -> dict[str, list[Received]]:
    out: dict[str, list[Received]] = collections.defaultdict(list)
    for m in list(up.received):
        out[mid_of(m.data)].append(m)
    return out


def wait_mids(up: Upstream, mids: set[str], timeout: float = 60.0) -> dict[str, list[Received]]:
    deadline = time.monotonic() + timeout
    while True:
        got = by_mid(up)
        missing = mids - set(got)
        if not missing:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} never arrived, e.g. {sorted(missing)[:5]}")
        time.sleep(0.05)


def drained(r: RelayProcess) -> bool:
    """Nothing left to deliver (every recipient in a final state)."""
    return r.queue(all=False) == []


def sqlite_scalar(r: RelayProcess, sql: str) -> Any:
    c = sqlite3.connect(r.spool / "relay.sqlite", timeout=30)
    try:
        return c.execute(sql).fetchone()[0]
    finally:
        c.close()


# --- byte-for-byte ----------------------------------------------------------------------------


def varied_message(i: int) -> tuple[bytes, list[str]]:
    """Message i (CRLF line endings throughout) and whether it needs 8BITMIME."""
    headers = [
        b"From: App <app@example.com>",
        f"To: user{i}@example.org".encode(),
        f"Subject: message {i}".encode(),
        f"Message-ID: <bfb-{i}@app.example>".encode(),
        b"Date: Mon, 01 Jan 2024 00:00:00 +0000",
    ]
    opts: list[str] = []
    kind = i % 6
    if kind == 0:  # dot-transparency: lines that start with dots, a lone dot, two dots
        body = b".leading dot\r\n.\r\n..\r\n...three\r\nend\r\n"
    elif kind == 1:  # 8-bit UTF-8
        headers.append(b"Content-Type: text/plain; charset=utf-8")
        headers.append(b"Content-Transfer-Encoding: 8bit")
        body = "Grüße, naïve café — ✓ 日本語\r\n".encode()
        opts = ["BODY=8BITMIME"]
    elif kind == 2:  # maximum-length lines (998 octets + CRLF)
        body = b"L" * 998 + b"\r\n" + b"." + b"M" * 997 + b"\r\n"
    elif kind == 3:  # folded headers, tabs, trailing spaces, empty lines
        headers.append(b"X-Folded: first part\r\n\tsecond part\r\n  third part")
        body = b"\tindented\r\ntrailing spaces   \r\n\r\n\r\nafter blank lines\r\n"
    elif kind == 4:  # 8-bit, not UTF-8, in a header and in the body
        headers.append(b"X-Latin1: caf\xe9")
        body = b"na\xefve \xff\xfe bytes\r\n"
        opts = ["BODY=8BITMIME"]
    else:  # larger than spool.inline_max: stored in a body file
        body = b"".join(b"line %05d " % n + b"b" * 60 + b"\r\n" for n in range(200))
    return b"\r\n".join(headers) + b"\r\n\r\n" + body, opts


def test_relays_100_messages_byte_for_byte(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(
        upstream=up,
        config={"spool": {"inline_max": "4KiB"}, "destinations": {"*": {"rate": "unlimited"}}},
    )
    sent: dict[str, tuple[str, list[str], bytes]] = {}
    with smtp_session(r.port) as s:
        for i in range(100):
            data, opts = varied_message(i)
            rcpts = [f"user{i}@example.org"] + ([f"cc{i}@example.net"] if i % 10 == 0 else [])
            assert s.sendmail(f"app{i}@example.com", rcpts, data, mail_options=opts) == {}
            sent[f"<bfb-{i}@app.example>"] = (f"app{i}@example.com", rcpts, data)
    assert any(len(d) > 4096 for _s, _r, d in sent.values())

    got = wait_mids(up, set(sent))
    r.wait_until(lambda: drained(r), what="every recipient delivered")
    got = by_mid(up)  # final: nothing more can arrive once the queue is drained
    assert set(got) == set(sent)
    assert len(up.received) == 100
    queue_ids = set()
    for mid, (sender, rcpts, data) in sent.items():
        (m,) = got[mid]  # exactly once
        assert m.mail_from == sender
        assert sorted(m.rcpt_tos) == sorted(rcpts)
        trace, rest = split_trace(m.data)
        assert rest == data, mid
        first = trace.split(b"\r\n")[0]
        assert first == b"Received: from client.test ([127.0.0.1])"
        q = re.search(rb"\tby relay\.test \(relay\) with ESMTP id ([0-9A-Z]+)", trace)
        assert q, trace
        queue_ids.add(q.group(1))
        if len(rcpts) == 1:
            assert f"for <{rcpts[0]}>".encode() in trace
    assert len(queue_ids) == 100
    assert (
        sorted(x["state"] for m in r.queue(all=True) for x in m["recipients"])
        == ["delivered"] * 110
    )
    # the large ones were kept in body files, which are still there: each is what went
    # upstream minus our prefix (Received, kept in the row), and no temporary is left
    files = [f for f in (r.spool / "bodies").glob("*/*") if f.is_file()]
    assert len(files) == sum(1 for i in range(100) if i % 6 == 5)
    upstream_copies = {m.data for ms in got.values() for m in ms}
    for f in files:
        data = f.read_bytes()
        assert any(
            c.endswith(data) and c[: -len(data)].startswith(b"Received: ") for c in upstream_copies
        )
    # the operator CLI reads a body kept in a file too
    shown = r.cli_json("queue", "show", files[0].name, "--body")
    header_block, _sep, body = files[0].read_bytes().partition(b"\r\n\r\n")
    assert shown["headers"].startswith("Received: ")  # the prefix from the row, then the file
    assert shown["headers"].endswith(header_block.decode())
    assert shown["body"] == body.decode()


# --- dedup -------------------------------------------------------------------------------------


def test_dedup_same_message_id_and_recipient(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = make_message(message_id="<dup-1@app.example>")
    with smtp_session(r.port) as s:
        assert s.sendmail("app@example.com", ["user@example.org"], msg) == {}
        # the same again, on the same and on a new connection, and with the recipient's
        # case changed: 250, but not queued again
        s.mail("app@example.com")
        s.rcpt("User@Example.ORG")
        code, reply = s.data(msg)
        assert code == 250 and b"duplicate" in reply
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    # a message sent after the duplicates, as a marker that delivery got past them
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(2)) == {}
    wait_mids(up, {"<dup-1@app.example>", "<msg-2@app.example.com>"})
    r.wait_until(lambda: drained(r), what="queue drained")
    assert len(by_mid(up)["<dup-1@app.example>"]) == 1
    assert [m["message_id"] for m in r.queue(all=True)].count("dup-1@app.example") == 1


def test_dedup_only_new_recipients_are_queued(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = make_message(message_id="<dup-2@app.example>")
    assert send(r.port, "app@example.com", ["a@example.org"], msg) == {}
    assert send(r.port, "app@example.com", ["a@example.org", "b@example.org"], msg) == {}
    got = wait_mids(up, {"<dup-2@app.example>"})
    r.wait_until(lambda: drained(r), what="queue drained")
    got = by_mid(up)["<dup-2@app.example>"]
    assert sorted(tuple(m.rcpt_tos) for m in got) == [("a@example.org",), ("b@example.org",)]
    rows = [m for m in r.queue(all=True) if m["message_id"] == "dup-2@app.example"]
    assert [[x["address"] for x in m["recipients"]] for m in rows] == [
        ["a@example.org"],
        ["b@example.org"],
    ]


def test_dedup_message_without_message_id(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = make_message(subject="no id here", no_message_id=True)
    assert b"Message-ID" not in msg
    assert send(r.port, "cron@example.com", ["ops@example.org"], msg) == {}
    up.wait_for(1)
    (m,) = up.received
    _trace, rest = split_trace(m.data)
    # one Message-ID was added (derived from the content), right after the trace header
    added, _sep, original = rest.partition(b"\r\n")
    assert re.fullmatch(rb"Message-ID: <[0-9a-f]{32}\.content@relay\.test>", added)
    if b"\r\nDate: " not in b"\r\n" + msg:  # a message without Date gets one (RFC 5322)
        date, _sep, original = original.partition(b"\r\n")
        assert re.fullmatch(rb"Date: \w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d \+0000", date)
    assert original == msg
    # a byte-identical resubmission is recognised; the same text with another Date is not
    with smtp_session(r.port) as s:
        s.mail("cron@example.com")
        s.rcpt("ops@example.org")
        code, reply = s.data(msg)
        assert code == 250 and b"duplicate" in reply
    other = make_message(subject="no id here", no_message_id=True, headers={"Date": "today"})
    assert send(r.port, "cron@example.com", ["ops@example.org"], other) == {}
    up.wait_for(2)
    r.wait_until(lambda: drained(r), what="queue drained")
    assert len(up.received) == 2
    assert mid_of(up.received[1].data) != mid_of(up.received[0].data)


def test_headerless_messages_are_not_mistaken_for_duplicates(
    upstream: UpFactory, relay: RelayFactory
) -> None:
    """Scripts that send bare text (no header block, no empty line): each different text is
    a different message, a byte-identical resend is a duplicate."""
    up = upstream()
    r = relay(upstream=up)
    texts = [b"disk full on host1\r\n", b"disk full on host2\r\n", b"backup ok\r\nall done\r\n"]
    for text in [*texts, texts[0]]:
        assert send(r.port, "cron@example.com", ["ops@example.org"], text) == {}
    up.wait_for(3)
    r.wait_until(lambda: drained(r), what="drained")
    assert len(up.received) == 3
    # after our Received, the added Message-ID and the added Date (none had one)
    bodies = sorted(split_trace(m.data)[1].split(b"\r\n", 2)[2] for m in up.received)
    assert bodies == sorted(texts)


def test_dedup_survives_a_restart(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = make_message(message_id="<restart@app.example>")
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    up.wait_for(1)
    r.wait_until(lambda: drained(r), what="delivered")
    r.restart()
    with smtp_session(r.port) as s:
        s.mail("app@example.com")
        s.rcpt("user@example.org")
        code, reply = s.data(msg)
        assert code == 250 and b"duplicate" in reply
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(7)) == {}
    wait_mids(up, {"<msg-7@app.example.com>"})
    r.wait_until(lambda: drained(r), what="drained")
    assert len(by_mid(up)["<restart@app.example>"]) == 1


def test_listeners_are_separate_dedup_namespaces(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up, start=False)
    second = free_port()
    r.config["listen"] = [
        {"address": f"127.0.0.1:{r.port}", "allow": ["127.0.0.0/8"]},
        {"address": f"127.0.0.1:{second}", "allow": ["127.0.0.0/8"]},
    ]
    r.write_config()
    r.start()
    msg = make_message(message_id="<tenant@app.example>")
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    assert send(second, "app@example.com", ["user@example.org"], msg) == {}
    # ... while each listener still dedups its own resubmission
    with smtp_session(second) as s:
        s.mail("app@example.com")
        s.rcpt("user@example.org")
        assert b"duplicate" in s.data(msg)[1]
    up.wait_for(2)
    r.wait_until(lambda: drained(r), what="drained")
    assert len(by_mid(up)["<tenant@app.example>"]) == 2
    clients = sorted(
        m["message_id"] for m in r.queue(all=True) if m["message_id"] == "tenant@app.example"
    )
    assert len(clients) == 2


def test_dedup_window_expires(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    r = relay(upstream=up, config={"dedup": {"window": "3s"}})
    msg = make_message(message_id="<window@app.example>")
    with smtp_session(r.port) as s:
        assert s.sendmail("app@example.com", ["user@example.org"], msg) == {}
        first = time.monotonic()
        # within the window (right away, same connection): a duplicate
        s.mail("app@example.com")
        s.rcpt("user@example.org")
        assert b"duplicate" in s.data(msg)[1]
    up.wait_for(1)
    time.sleep(max(0.0, first + 3.5 - time.monotonic()))  # wait the window out
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    up.wait_for(2)
    r.wait_until(lambda: drained(r), what="drained")
    assert len(by_mid(up)["<window@app.example>"]) == 2


# --- SIGKILL -----------------------------------------------------------------------------------


def test_sigkill_mid_stream_loses_nothing(upstream: UpFactory, relay: RelayFactory) -> None:
    up = upstream()
    max_conns = 4
    r = relay(
        upstream=up,
        config={"destinations": {"*": {"rate": "unlimited", "max_connections": max_conns}}},
    )
    total, threads_n, kill_after = 1000, 8, 300
    lock = threading.Lock()
    accepted: set[str] = set()  # every Message-ID that got a 250, before or after the kill
    accepted_before_kill: set[str] = set()
    retried: list[str] = []
    unexpected: list[str] = []
    killing, restarted = threading.Event(), threading.Event()

    def client(t: int) -> None:
        mine = list(range(t, total, threads_n))
        conn: smtplib.SMTP | None = None
        attempts = 0
        while mine:
            i = mine[0]
            mid = f"<kill-{i}@app.example>"
            try:
                if conn is None:
                    conn = smtplib.SMTP("127.0.0.1", r.port, timeout=60)
                    conn.ehlo("client.test")
                conn.sendmail(
                    "app@example.com", [f"u{i}@example.org"], make_message(i, message_id=mid)
                )
                with lock:
                    accepted.add(mid)
                    if not killing.is_set():
                        accepted_before_kill.add(mid)
                mine.pop(0)
                attempts = 0
            except (OSError, smtplib.SMTPException) as e:
                # What a well-behaved client does with a lost connection or a 4xx: try the
                # same message again later (the dedup unit makes that safe).
                if conn is not None:
                    try:
                        conn.close()
                    finally:
                        conn = None
                attempts += 1
                with lock:
                    retried.append(mid)
                    if not killing.is_set():
                        unexpected.append(f"{mid}: {e!r}")
                if attempts > 50:
                    raise
                if killing.is_set():
                    restarted.wait(60)
                time.sleep(0.05)
        if conn is not None:
            conn.quit()

    workers = [threading.Thread(target=client, args=(t,), daemon=True) for t in range(threads_n)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 60
    while len(accepted) < kill_after:
        assert time.monotonic() < deadline, f"only {len(accepted)} accepted"
        assert all(w.is_alive() for w in workers)
        time.sleep(0.005)
    killing.set()
    r.kill()  # SIGKILL: no shutdown path runs
    with lock:
        at_kill = len(accepted)
    assert kill_after <= at_kill < total  # mid-stream

    # the spool as the kill left it: intact, and claims in flight still `sending`
    assert sqlite_scalar(r, "PRAGMA integrity_check") == "ok"
    sending_at_kill = sqlite_scalar(r, "SELECT count(*) FROM recipients WHERE state='sending'")

    r.start_again()
    restarted.set()
    for w in workers:
        w.join(90)
        assert not w.is_alive()
    assert unexpected == []
    assert len(accepted) == total and accepted_before_kill <= accepted

    # zero lost: every message that got a 250 reaches the upstream ...
    got = wait_mids(up, accepted, timeout=90)
    r.wait_until(lambda: drained(r), timeout=60, what="queue drained after recovery")
    got = by_mid(up)
    assert set(got) == accepted
    # ... and nothing is left `sending`: recovery turned every stale claim back into work
    assert sqlite_scalar(r, "SELECT count(*) FROM recipients WHERE state != 'delivered'") == 0
    assert sqlite_scalar(r, "SELECT count(*) FROM recipients") == total
    if sending_at_kill:
        recovered = [e for e in r.events(since_start=True) if e.get("event") == "recovered"]
        assert [e.get("count") for e in recovered] == [sending_at_kill], recovered

    # Duplicates. Delivery is at-least-once: a message the upstream took but whose outcome
    # was not yet committed when the process died is sent again after recovery. Each
    # connection's worker waits for its outcome to commit before it sends the next message,
    # so at most one such message per connection can exist at the kill. Resubmissions by
    # the clients (of a message whose 250 was lost in the kill) never add copies: dedup.
    dupes = {mid: len(ms) for mid, ms in got.items() if len(ms) > 1}
    print(
        f"SIGKILL after {at_kill} accepted; {sending_at_kill} claims in flight; "
        f"{len(retried)} client retries; {sum(dupes.values()) - len(dupes)} duplicate "
        f"deliveries: {dupes}"
    )
    assert all(n == 2 for n in dupes.values()), dupes
    assert len(dupes) <= max_conns, dupes
    assert len(dupes) <= sending_at_kill


# --- a spool that cannot take the write ---------------------------------------------------------


def test_locked_spool_answers_451_and_the_daemon_carries_on(
    upstream: UpFactory, relay: RelayFactory
) -> None:
    up = upstream()
    r = relay(upstream=up)
    msg = make_message(message_id="<locked@app.example>")
    locker = sqlite3.connect(r.spool / "relay.sqlite", timeout=30, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        # held until the reply arrives: longer than the writer's 5 s busy timeout
        with smtp_session(r.port) as s:
            assert s.mail("app@example.com")[0] == 250
            assert s.rcpt("user@example.org")[0] == 250
            code, reply = s.data(msg)
        assert (code, reply[:6]) == (451, b"4.3.0 "), (code, reply)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert r.proc is not None and r.proc.poll() is None
    # nothing of the refused attempt was kept (not even its dedup key): the resend goes through
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    wait_mids(up, {"<locked@app.example>"})
    r.wait_until(lambda: drained(r), what="drained")
    assert len(by_mid(up)["<locked@app.example>"]) == 1
    assert r.proc.poll() is None
    assert any(e.get("event") == "spool_error" for e in r.events())
