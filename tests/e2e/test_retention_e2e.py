"""Data kept no longer than needed: `spool.retention` (0: a finished message and its body go
at once) and `relay queue purge --older-than`; dedup keys outlive them (dedup.window)."""

from __future__ import annotations

import smtplib
import time
from collections.abc import Callable

import pytest

from relay.spool import db, dedup, ops
from tests.harness import RelayProcess, Upstream, make_message, send

pytestmark = pytest.mark.slow

BIG = (b"r" * 998 + b"\r\n") * 200  # a body file (over spool.inline_max, 128 KiB)


def _files(r: RelayProcess) -> list[str]:
    return (
        [str(p) for p in (r.spool / "bodies").glob("*/*") if p.is_file()]
        if (r.spool / "bodies").exists()
        else []
    )


def test_retention_zero_forgets_a_finished_message_at_once(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    up = upstream()
    r = relay(upstream=up, config={"spool": {"retention": 0}})
    msg = make_message(message_id="<gone-soon@retention>") + BIG
    assert send(r.port, "app@example.com", ["user@example.org"], msg) == {}
    up.wait_for(1)
    r.wait_until(
        lambda: r.queue(all=True) == [] and _files(r) == [],
        timeout=10,
        what="the finished message and its body gone",
    )
    with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:  # its dedup key is kept
        s.ehlo("client.test")
        s.mail("app@example.com")
        s.rcpt("user@example.org")
        code, reply = s.data(msg)
    assert code == 250 and b"duplicate" in reply


def test_queue_purge_deletes_finished_messages_only(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    up = upstream()
    r = relay(upstream=up)
    for i in range(2):
        assert (
            send(
                r.port,
                "app@example.com",
                ["user@example.org"],
                make_message(message_id=f"<done-{i}@retention>") + BIG,
            )
            == {}
        )
    up.wait_for(2)
    r.wait_until(lambda: all(m["state"] == "sent" for m in r.queue(all=True)), what="sent")
    r.cli("destination", "suspend", "smarthost", check=True)
    assert (
        send(
            r.port,
            "app@example.com",
            ["user@example.org"],
            make_message(message_id="<waiting@retention>"),
        )
        == {}
    )
    dry = r.cli("queue", "purge", "--older-than", "0", "--dry-run", check=True).stdout
    assert "would delete 2 finished messages" in dry
    assert len(r.queue(all=True)) == 3 and len(_files(r)) == 2
    out = r.cli_json("queue", "purge", "--older-than", "0")
    assert out == {"action": "purge", "dry_run": False, "messages": 2}
    assert [m["message_id"] for m in r.queue(all=True)] == ["waiting@retention"]
    assert _files(r) == []
    assert r.cli("queue", "purge", "--older-than", "soon").returncode == 2


def test_the_prune_works_off_a_backlog_beyond_one_batch_in_one_pass(
    upstream: Callable[..., Upstream],
    relay: Callable[..., RelayProcess],
) -> None:
    """12,000 finished messages past `spool.retention` (a node that accepted ~20/s for a
    week more than the old prune removed): gone within seconds of the start, while a
    message still waiting stays. The old prune removed at most 5,000 per 600 s (~8.3/s):
    7,000 were left for ten minutes, and above that rate the spool grew without bound."""
    up = upstream()
    r = relay(upstream=up, start=False, config={"spool": {"retention": "1d"}})
    old = time.time() - 2 * 86400
    conn = db.open_spool(r.spool)
    with db.transaction(conn):
        for i in range(12_001):
            rcpt = f"u{i}@example.org"
            mid = f"<old-{i}@retention>"
            ops.accept(
                conn,
                ops.NewMessage(
                    queue_id=f"OLD{i:06d}",
                    message_id=dedup.normalize_message_id(mid),
                    sender="app@example.com",
                    size=20,
                    created_at=old,
                    client="listener:test",
                    peer="127.0.0.1",
                    lane="transactional",
                    lane_prio=0,
                    identity="example.com",
                    body=b"Subject: s\r\n\r\nhi\r\n",
                    body_path=None,
                    recipients=(
                        ops.NewRecipient(rcpt, "example.org", dedup.dedup_key("t", mid, rcpt)),
                    ),
                ),
                86400.0,
            )
        # all but the last delivered long ago; OLD012000 still waits (a later retry)
        conn.execute("UPDATE recipients SET state = 'delivered' WHERE msg_id <> 'OLD012000'")
        conn.execute(
            "UPDATE recipients SET state = 'deferred', next_attempt_at = ?"
            " WHERE msg_id = 'OLD012000'",
            (time.time() + 86400,),
        )
    conn.close()
    r.start()

    def left() -> int:
        c = db.open_spool(r.spool, create=False)
        try:
            return int(c.execute("SELECT count(*) FROM messages").fetchone()[0])
        finally:
            c.close()

    def pruned() -> int:
        return sum(e["messages"] for e in r.events() if e.get("event") == "pruned")

    r.wait_until(lambda: left() == 1, timeout=30, what="the backlog pruned")
    # the `pruned` line is written once the commit is back on the event loop: a moment
    # after the rows are gone (a fresh-clone CI run read the log in between)
    r.wait_until(lambda: pruned() >= 12_000, timeout=10, what="the pruned lines")
    assert pruned() == 12_000
    assert [m["id"] for m in r.queue(all=True)] == ["OLD012000"]
