"""Data kept no longer than needed: `spool.retention` (0: a finished message and its body go
at once) and `relay queue purge --older-than`; dedup keys outlive them (dedup.window)."""

from __future__ import annotations

import smtplib
from collections.abc import Callable

import pytest

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
