"""The daemon on a PostgreSQL spool (`spool.backend: postgresql`), end to end: a real daemon
subprocess, a real aiosmtpd upstream, the machine's PostgreSQL (one schema per test).

What the SQLite spool promises holds here too: byte-for-byte relaying of small and large
messages (every body in its row), dedup of a resubmission, nothing lost across a SIGKILL,
the CLI reading and changing the same spool, and a DSN's password never shown."""

from __future__ import annotations

import re
import signal
import smtplib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.harness import RelayProcess, Upstream, make_message, send, smtp_session

UpFactory = Callable[..., Upstream]
TRACE = re.compile(rb"\AReceived: [^\r\n]*\r\n(?:[ \t][^\r\n]*\r\n)*")
RelayFactory = Callable[..., RelayProcess]


def pg_config(dsn: str, **extra: Any) -> dict[str, Any]:
    return {"spool": {"backend": "postgresql", "dsn": dsn, **extra}}


def scalar(dsn: str, sql: str) -> Any:
    with psycopg.connect(dsn) as c:
        row = c.execute(sql).fetchone()
        assert row is not None
        return row[0]


def test_relays_small_and_large_mail_byte_for_byte_with_bodies_in_rows(
    upstream: UpFactory, relay: RelayFactory, pg_dsn: str
) -> None:
    up = upstream()
    r = relay(upstream=up, config=pg_config(pg_dsn))
    big = b"x" * 998 + b"\r\n"
    date = {"Date": "Thu, 03 Dec 2026 10:00:00 +0000"}  # else the relay adds one
    sent = {
        "<small@app.example>": make_message(1, message_id="<small@app.example>", headers=date),
        "<large@app.example>": make_message(
            2, message_id="<large@app.example>", headers=date, body=big * 600
        ),  # 600 KB: over spool.inline_max, still in the row on PostgreSQL
    }
    for data in sent.values():
        assert send(r.port, "app@example.com", ["user@example.org"], data) == {}
    got = up.wait_for(2)
    bodies = {TRACE.sub(b"", m.data, count=1) for m in got}  # past the relay's Received:
    assert bodies == set(sent.values())
    assert scalar(pg_dsn, "SELECT count(*) FROM messages WHERE body_path IS NOT NULL") == 0
    assert scalar(pg_dsn, "SELECT max(length(body)) FROM messages") > 600_000
    assert not (r.spool / "bodies").exists() or not any((r.spool / "bodies").rglob("*.eml"))
    r.wait_until(
        lambda: r.recipient_states() and set(r.recipient_states().values()) == {"delivered"}
    )


def test_a_resubmission_is_deduplicated_in_the_database(
    upstream: UpFactory, relay: RelayFactory, pg_dsn: str
) -> None:
    up = upstream()
    r = relay(upstream=up, config=pg_config(pg_dsn))
    data = make_message(1, message_id="<once@app.example>")
    assert send(r.port, "app@example.com", ["user@example.org"], data) == {}
    up.wait_for(1)
    assert send(r.port, "app@example.com", ["user@example.org"], data) == {}  # 250 again
    time.sleep(1.0)  # a second copy, if queued, would go out within the poll interval
    assert len(up.received) == 1
    assert scalar(pg_dsn, "SELECT count(*) FROM messages") == 1
    assert scalar(pg_dsn, "SELECT count(*) FROM dedup") == 1


def test_sigkill_loses_nothing_and_the_restart_delivers_the_rest(
    upstream: UpFactory, relay: RelayFactory, pg_dsn: str
) -> None:
    up = upstream()
    # a stable fleet.node: the restarted daemon takes its own claims back at once (under
    # the default name, <hostname>:<pid>, they come back when their lease expires)
    r = relay(upstream=up, config={**pg_config(pg_dsn), "fleet": {"node": "one"}})
    n = 40
    for i in range(n):
        data = make_message(i, message_id=f"<k{i}@app.example>")
        assert send(r.port, "app@example.com", [f"u{i}@example.org"], data) == {}
    r.signal(signal.SIGKILL)  # some may be out, some in flight, the rest queued
    assert r.proc is not None
    r.proc.wait(10)
    assert scalar(pg_dsn, "SELECT count(*) FROM messages") == n  # every 250 was committed
    with psycopg.connect(pg_dsn) as c:
        in_flight = {
            row[0] for row in c.execute("SELECT address FROM recipients WHERE state = 'sending'")
        }
    r.start_again()
    up.wait_for(n, timeout=60)
    r.wait_until(lambda: set(r.recipient_states().values()) == {"delivered"})
    got = sorted(m.rcpt_tos[0] for m in up.received)
    assert set(got) == {f"u{i}@example.org" for i in range(n)}
    # at least once, as on SQLite: only a claim the kill caught in flight (the upstream may
    # have taken it before its outcome was committed) can go out a second time
    twice = {a for a in got if got.count(a) > 1}
    assert twice <= in_flight


def test_the_cli_reads_and_changes_the_same_spool(
    upstream: UpFactory, relay: RelayFactory, pg_dsn: str
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.3.0 try later"  # the mail stays queued
    r = relay(upstream=up, config=pg_config(pg_dsn))
    assert send(r.port, "app@example.com", ["a@example.org"], make_message(1)) == {}
    rows = r.queue()
    assert [row["recipients"][0]["address"] for row in rows] == ["a@example.org"]
    out = r.cli("suppression", "add", "blocked@example.org", "--reason", "test")
    assert out.returncode == 0, out.stderr
    assert scalar(pg_dsn, "SELECT count(*) FROM suppression") == 1

    def refused() -> bool:
        with smtp_session(r.port) as s:
            s.mail("app@example.com")
            code, _ = s.rcpt("blocked@example.org")
            s.rset()
            return code == 550

    r.wait_until(refused, timeout=10)


def test_check_config_hides_the_dsn_password_and_a_bad_server_is_a_clear_error(
    tmp_path: Path, relay: RelayFactory
) -> None:
    secret = "s3cret-pw"
    dsn = f"postgresql://relay:{secret}@127.0.0.1:1/relay"
    r = relay(config=pg_config(dsn), start=False)
    out = r.cli("check-config")
    assert out.returncode == 0, out.stderr
    assert secret not in out.stdout and "relay:***@127.0.0.1:1" in out.stdout
    q = r.cli("queue", "list")
    assert q.returncode == 1
    assert secret not in q.stderr and "cannot open the spool at postgresql://relay:***@" in (
        q.stderr
    )


def test_password_file_is_used(tmp_path: Path, pg_dsn: str) -> None:
    from relay.spool import pg

    pw = tmp_path / "pw"
    pw.write_text("anything\n")
    conn = pg.connect(pg_dsn, pw)  # trust auth: accepted, the file was read without error
    try:
        assert conn.execute("SELECT 1").fetchone()[0] == 1
    finally:
        conn.close()
    with pytest.raises(FileNotFoundError):
        pg.connect(pg_dsn, tmp_path / "missing")


def test_a_dropped_connection_fails_one_batch_then_the_writer_reconnects(
    tmp_path: Path, pg_dsn: str
) -> None:
    from relay.config.tree import PgSpool
    from relay.spool.writer import SpoolWriter

    w = SpoolWriter(tmp_path / "spool", PgSpool(pg_dsn))
    w.start()
    try:
        pid = w.run_sync(lambda c: c.execute("SELECT pg_backend_pid()").fetchone()[0])
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(Exception):  # noqa: B017  (the batch in flight fails: 4xx upstream)
            w.run_sync(lambda c: c.execute("SELECT 1").fetchone()[0])
        assert w.run_sync(lambda c: c.execute("SELECT 2").fetchone()[0]) == 2
        assert w.failures >= 1 and w.healthy
    finally:
        w.close()


def test_smtp_answers_4xx_when_the_database_is_gone(
    upstream: UpFactory, relay: RelayFactory, pg_dsn: str
) -> None:
    """A spool that cannot take the write is a 4xx (the client keeps the message)."""
    up = upstream()
    r = relay(upstream=up, config=pg_config(pg_dsn))
    schema = pg_dsn.rsplit("search_path%3D", 1)[1]
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"ALTER TABLE {schema}.messages RENAME TO messages_gone")
    try:
        with pytest.raises(smtplib.SMTPDataError) as e:
            send(r.port, "app@example.com", ["a@example.org"], make_message(1))
        assert 400 <= e.value.smtp_code < 500
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"ALTER TABLE {schema}.messages_gone RENAME TO messages")
    assert send(r.port, "app@example.com", ["a@example.org"], make_message(2)) == {}
    up.wait_for(1)
