"""The transactional outbox: rows an application inserts into `relay_outbox` in its own
transaction are sent if and only if that transaction commits, once, by whichever relay of a
fleet takes them; their status comes back into the row.

In-process tests pin how a row becomes a message and when it is refused; daemon tests
(real subprocesses, a real aiosmtpd upstream, PostgreSQL) pin the promise end to end."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest

from relay.config.tree import ConfigError, load_config
from relay.ops.alerts import recent
from relay.spool import db, ops, outbox, pg
from tests.harness import RelayProcess, Upstream

UpFactory = Callable[..., Upstream]
RelayFactory = Callable[..., RelayProcess]

MESSAGE = b"From: app@example.com\nTo: user@example.org\nSubject: hi\n\nbody\n"


def insert(dsn: str, rows: list[tuple[str, list[str], bytes]], commit: bool = True) -> None:
    """An application's transaction: its business row and its mail, together."""
    with psycopg.connect(dsn) as c:
        c.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY)")
        for key, rcpts, data in rows:
            c.execute("INSERT INTO orders (id) VALUES (%s)", (key,))
            c.execute(
                "INSERT INTO relay_outbox (idempotency_key, sender, recipients, message)"
                " VALUES (%s, %s, %s, %s)",
                (key, "app@example.com", rcpts, data),
            )
        if commit:
            c.commit()
        else:
            c.rollback()


def outbox_rows(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn) as c:
        cur = c.execute(
            "SELECT idempotency_key, state, attempts, next_attempt_at, upstream_id, last_error,"
            " queue_id FROM relay_outbox ORDER BY id"
        )
        names = [d.name for d in cur.description or ()]
        return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


@pytest.fixture
def config(tmp_path: Path, pg_dsn: str) -> Any:
    path = tmp_path / "relay.yaml"
    path.write_text(
        "hostname: relay.test\n"
        f"spool: {{path: {tmp_path / 'spool'}, backend: postgresql, dsn: '{pg_dsn}'}}\n"
        "outbox: {enabled: true}\n"
        "limits: {max_message_size: 1000, max_recipients: 3}\n"
    )
    return load_config(path)


@pytest.fixture
def conn(pg_dsn: str) -> Any:
    c = pg.connect(pg_dsn)
    yield c
    c.close()


def take(conn: Any, config: Any, batch: int = 100) -> outbox.Taken:
    with db.transaction(cast(sqlite3.Connection, conn)):
        return outbox.take(conn, config, batch)


def test_the_outbox_needs_a_postgresql_spool(tmp_path: Path) -> None:
    path = tmp_path / "relay.yaml"
    path.write_text("spool: {path: spool}\noutbox: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"outbox\.enabled: .*PostgreSQL"):
        load_config(path)


def test_committed_rows_are_queued_once_and_rolled_back_ones_never(
    conn: Any, config: Any, pg_dsn: str
) -> None:
    insert(pg_dsn, [("order-1", ["a@example.org"], MESSAGE)])
    insert(pg_dsn, [("order-2", ["b@example.org"], MESSAGE)], commit=False)
    taken = take(conn, config)
    assert [(n) for _id, _qid, n in taken.accepted] == [1]
    assert taken.rejected == [] and taken.duplicates == []
    rows = outbox_rows(pg_dsn)
    assert list(rows) == ["order-1"]  # the rolled-back row never existed
    qid = rows["order-1"]["queue_id"]
    assert rows["order-1"]["state"] == "queued" and qid == taken.accepted[0][1]
    assert [r[0] for r in conn.execute("SELECT address FROM recipients")] == ["a@example.org"]
    # a second pass finds nothing pending: queued once
    assert take(conn, config).accepted == []
    # the message as the engine will send it: CRLF, a trace, a stable Message-ID, a Date
    env = ops.load_envelopes(cast(sqlite3.Connection, conn), [qid])[qid]
    body = env.body or b""
    assert b"\n" not in body.replace(b"\r\n", b"")
    assert body.startswith(b"Received: from relay_outbox (row ")
    assert f"with local id {qid};".encode() in body
    assert b"\r\nMessage-ID: <outbox." in body and b"\r\nDate: " in body
    assert body.endswith(b"Subject: hi\r\n\r\nbody\r\n")
    assert env.client == "outbox" and env.sender == "app@example.com"


def test_a_key_inserted_again_after_its_row_is_gone_is_not_sent_twice(
    conn: Any, config: Any, pg_dsn: str
) -> None:
    insert(pg_dsn, [("k", ["a@example.org"], MESSAGE)])
    first = take(conn, config)
    with psycopg.connect(pg_dsn) as c:  # the app cleans its outbox, then retries the key
        with pytest.raises(psycopg.errors.UniqueViolation):
            c.execute(
                "INSERT INTO relay_outbox (idempotency_key, recipients, message)"
                " VALUES ('k', ARRAY['a@example.org'], %s)",
                (MESSAGE,),
            )
        c.rollback()
        c.execute("DELETE FROM relay_outbox")
        c.execute(
            "INSERT INTO relay_outbox (idempotency_key, recipients, message)"
            " VALUES ('k', ARRAY['a@example.org'], %s)",
            (MESSAGE,),
        )
        c.commit()
    second = take(conn, config)
    assert len(first.accepted) == 1 and second.accepted == [] and len(second.duplicates) == 1
    assert outbox_rows(pg_dsn)["k"]["state"] == "duplicate"
    assert conn.execute("SELECT count(*) FROM recipients").fetchone()[0] == 1


def test_a_stable_message_id_from_the_key(config: Any) -> None:
    one, _ = outbox.prepare(config, 1, "key-1", "", ["a@example.org"], MESSAGE, "bulk")
    again, _ = outbox.prepare(config, 2, "key-1", "", ["a@example.org"], MESSAGE, "bulk")
    other, _ = outbox.prepare(config, 3, "key-2", "", ["a@example.org"], MESSAGE, "bulk")
    assert one.message_id == again.message_id != other.message_id
    assert one.message_id.startswith("outbox.") and one.message_id.endswith("@relay.test")
    own, _ = outbox.prepare(
        config, 4, "key-3", "", ["a@x.org"], b"Message-ID: <mine@app>\r\n\r\nx\r\n", "bulk"
    )
    assert own.message_id == "mine@app" and b"<outbox." not in (own.body or b"")
    assert one.lane == "bulk" and one.identity == "<>"
    assert one.recipients[0].dedup_key != other.recipients[0].dedup_key


@pytest.mark.parametrize(
    ("key", "sender", "rcpts", "data", "lane", "error"),
    [
        ("k", "not an address", ["a@x.org"], MESSAGE, "bulk", "sender 'not an address'"),
        ("k", "", [], MESSAGE, "bulk", "no recipients"),
        ("k", "", ["a@x.org", "b"], MESSAGE, "bulk", "recipient 'b'"),
        ("k", "", ["a@x.org", "a\r\nRCPT TO:<c@x.org>@x.org"], MESSAGE, "bulk", "recipient"),
        ("k", "", ["a@x.org"] * 4, MESSAGE, "bulk", "more than 3 recipients"),
        ("k", "", ["a@x.org"], b"x" * 1001, "bulk", "message larger than 1000 octets"),
        ("k", "", ["a@x.org"], MESSAGE, "urgent", "lane must be one of"),
        ("k\x00", "", ["a@x.org"], MESSAGE, "bulk", "idempotency_key must be"),
        ("", "", ["a@x.org"], MESSAGE, "bulk", "idempotency_key must be"),
    ],
)
def test_a_row_the_relay_cannot_send_is_refused_with_its_reason(
    config: Any, key: str, sender: str, rcpts: list[str], data: bytes, lane: str, error: str
) -> None:
    with pytest.raises(outbox.Rejected, match="^" + error.replace("(", r"\(")):
        outbox.prepare(config, 1, key, sender, rcpts, data, lane)


def test_rejected_rows_are_marked_and_the_rest_of_the_batch_goes(
    conn: Any, config: Any, pg_dsn: str
) -> None:
    insert(pg_dsn, [("bad", ["nobody"], MESSAGE), ("good", ["a@example.org"], MESSAGE)])
    taken = take(conn, config)
    assert len(taken.rejected) == 1
    assert taken.rejected[0][1].startswith("recipient 'nobody': ")
    rows = outbox_rows(pg_dsn)
    assert rows["bad"]["state"] == "rejected" and rows["bad"]["queue_id"] is None
    assert rows["bad"]["last_error"].startswith("recipient 'nobody'")
    assert rows["good"]["state"] == "queued"
    # no silent path: one alert, recorded in the pass's own transaction (take commits)
    [alert] = recent(conn, 10)
    assert (alert["event"], alert["severity"], alert["key"], alert["count"]) == (
        "outbox_rejected",
        "warning",
        "outbox",
        1,
    )
    assert alert["summary"].startswith(f"outbox row {taken.rejected[0][0]} rejected: recipient")
    assert take(conn, config).rejected == []  # never retried
    assert recent(conn, 10)[0]["count"] == 1


def test_two_relays_taking_one_outbox_never_take_the_same_row(
    conn: Any, config: Any, pg_dsn: str
) -> None:
    insert(pg_dsn, [(f"o{i}", [f"u{i}@example.org"], MESSAGE) for i in range(10)])
    a, b = pg.connect(pg_dsn), pg.connect(pg_dsn)
    try:
        a.execute("BEGIN")
        got_a = outbox.take(a, config, 4)
        b.execute("BEGIN")  # a still holds its rows: b skips them, without waiting
        got_b = outbox.take(b, config, 100)
        b.execute("COMMIT")
        a.execute("COMMIT")
    finally:
        a.close()
        b.close()
    assert len(got_a.accepted) == 4 and len(got_b.accepted) == 6
    states = {k: r["state"] for k, r in outbox_rows(pg_dsn).items()}
    assert set(states.values()) == {"queued"}


def test_the_app_role_needs_insert_and_select_only(conn: Any, pg_dsn: str) -> None:
    role = f"app_{uuid.uuid4().hex[:12]}"
    schema = pg_dsn.rsplit("search_path%3D", 1)[1].split("&")[0]
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role}")
        try:
            # the README's grants, verbatim but for the names
            admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
            admin.execute(f"GRANT INSERT, SELECT ON relay_outbox TO {role}")
            admin.execute(f"GRANT USAGE ON SEQUENCE relay_outbox_id_seq TO {role}")
            with psycopg.connect(pg_dsn) as app:
                app.execute(f"SET ROLE {role}")
                app.execute(
                    "INSERT INTO relay_outbox (idempotency_key, recipients, message)"
                    " VALUES ('r1', ARRAY['a@example.org'], %s)",
                    (MESSAGE,),
                )
                assert app.execute("SELECT state FROM relay_outbox").fetchall() == [("pending",)]
                app.commit()
                app.execute(f"SET ROLE {role}")
                for stmt in (
                    "UPDATE relay_outbox SET state = 'delivered'",
                    "DELETE FROM relay_outbox",
                    "SELECT count(*) FROM recipients",
                ):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        app.execute(stmt)
                    app.rollback()
                    app.execute(f"SET ROLE {role}")
        finally:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


# --- end to end: daemons, an upstream, the status written back -------------------------------


def wait_rows(dsn: str, done: Callable[[dict[str, dict[str, Any]]], bool], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        rows = outbox_rows(dsn)
        if done(rows):
            return rows
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)


def test_outbox_end_to_end_over_two_relays(
    upstream: UpFactory, relay: RelayFactory, pg_dsn: str
) -> None:
    up = upstream()
    up.ok_reply = lambda e: f"250 2.0.0 Ok: queued as UP{e.rcpt_tos[0].split('@')[0]}"
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("gone") else None
    config = {
        "spool": {"backend": "postgresql", "dsn": pg_dsn},
        "outbox": {"enabled": True, "poll_interval": "0.2s", "batch": 7},
        "destinations": {"*": {"rate": "unlimited"}},
    }
    relay(upstream=up, config={**config, "fleet": {"node": "a"}}, name="a")
    relay(upstream=up, config={**config, "fleet": {"node": "b"}}, name="b")
    n = 40
    insert(pg_dsn, [(f"ok{i}", [f"u{i}@example.org"], MESSAGE) for i in range(n)])
    insert(pg_dsn, [(f"rb{i}", [f"rb{i}@example.org"], MESSAGE) for i in range(5)], False)
    insert(pg_dsn, [("bounce", ["gone@example.org"], MESSAGE)])
    rows = wait_rows(
        pg_dsn, lambda r: all(x["state"] in ("delivered", "failed") for x in r.values()), 60
    )
    assert len(rows) == n + 1  # the rolled-back five never existed
    time.sleep(1.0)  # anything sent twice would have arrived by now
    got = sorted(m.rcpt_tos[0] for m in up.received)
    assert got == sorted(f"u{i}@example.org" for i in range(n))  # each once, none rolled back
    for i in range(n):
        row = rows[f"ok{i}"]
        assert row["state"] == "delivered", row
        assert row["attempts"] == 1 and row["last_error"] is None
        assert row["upstream_id"] == f"UPu{i}"
        assert row["next_attempt_at"] is None
    bounced = rows["bounce"]
    assert bounced["state"] == "failed"
    assert bounced["last_error"].startswith("gone@example.org: 550 5.1.1")
