"""Regressions found in review: each test failed before its fix.

- a daily ceiling smaller than a message's recipient count (the job is split);
- waiting on shaping never outlives retry.max_age (expired dead letter);
- the day roll-over keeps the spool's count and the reservations of jobs in flight;
- one busy destination cannot hold every connection slot (`delivery.workers`);
- a reload never changes restart-only keys (upstream.mode, spool.path);
- a reload that fails in the engine (bad nameserver) is rejected and later reloads work.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import yaml

from relay.config.tree import load_config
from relay.delivery import attempt
from relay.delivery.engine import Engine
from relay.delivery.jobs import Job
from relay.spool import ops
from relay.spool.model import RcptState
from relay.spool.writer import SpoolWriter
from tests.dnsserver import DnsServer
from tests.harness import deep_merge, engine_running, make_message, send, smarthost_config

pytestmark = pytest.mark.slow


def test_ceiling_smaller_than_recipients_splits_the_message(upstream, relay) -> None:
    up = upstream()
    r = relay(
        upstream=up,
        config={
            "destinations": {"*": {"daily_limit": 2}},
            "shaping": {"window_length": "3s"},
            "retry": {"max_age": "1h"},
        },
    )
    rcpts = ["a@example.org", "b@example.org", "c@example.org"]
    assert send(r.port, "app@example.com", rcpts, make_message(1)) == {}
    got = up.wait_for(1, timeout=20)
    assert len(got[0].rcpt_tos) == 2  # what fits under the ceiling goes at once
    r.wait_until(
        lambda: set(r.recipient_states().values()) == {"delivered"},
        timeout=20,
        what="all three delivered over two windows",
    )
    assert sorted(up.recipients()) == rcpts


def test_shaping_wait_expires_at_max_age(upstream, relay) -> None:
    up = upstream()
    r = relay(
        upstream=up,
        config={
            "destinations": {"*": {"daily_limit": 0}},
            "retry": {"schedule": ["1s"], "max_age": "2s", "min_delay": "0.2s"},
        },
    )
    assert send(r.port, "app@example.com", ["a@example.org"], make_message(1)) == {}
    r.wait_until(
        lambda: r.recipient_states().get("a@example.org") == "failed",
        timeout=20,
        what="expired while waiting for the daily ceiling",
    )
    rc = r.queue()[0]["recipients"][0]
    assert "expired" in rc["last_reply"] and "daily limit 0" in rc["last_reply"]
    assert rc["attempts"] == 0  # no attempt was ever made
    assert any(e.get("event") == "dead_letter" for e in r.events())
    assert up.received == []


def test_day_rollover_keeps_counts_from_the_spool(tmp_path: Path) -> None:
    cfg_path = tmp_path / "relay.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "spool": {"path": "spool"},
                "destinations": {"*": {"daily_limit": 1}},
                "shaping": {"window_length": "100s"},
            }
        )
    )
    cfg = load_config(str(cfg_path))
    w = SpoolWriter(cfg.spool_path)
    w.start()
    now = {"t": 1000.0}  # window [1000, 1100)

    async def main() -> tuple[object, dict[str, int]]:
        e = Engine(cfg, w, clock=lambda: now["t"])
        day = e.dests.ledger.day_of(now["t"])
        e.dests.ledger.load(day, await w.run(lambda c: ops.daily_counts(c, day)))
        for i in (1, 2):
            m = ops.NewMessage(
                f"M{i}",
                f"{i}@x",
                "a@x.test",
                1,
                now["t"],
                "c",
                "p",
                "transactional",
                0,
                "x.test",
                b"x",
                None,
                (ops.NewRecipient(f"u{i}@x.test", "x.test", f"k{i}"),),
            )
            await w.run(lambda c, m=m: ops.accept(c, m, 3600))
        claims = await w.run(lambda c: ops.claim_due(c, now["t"], 10))
        ids = {c.msg_id: c.rcpt_id for c in claims}

        def job(i: int) -> Job:
            cl = ops.Claim(
                ids[f"M{i}"],
                f"M{i}",
                f"u{i}@x.test",
                "x.test",
                0,
                now["t"],
                "transactional",
                "x.test",
            )
            env = ops.Envelope(f"M{i}", f"<{i}@x>", "a@x.test", 1, b"x", None)
            return Job(f"M{i}", "smarthost", "transactional", "x.test", "a@x.test", [cl], env)

        def room(j: Job) -> object:
            limits = e.dests.ledger.limits("smarthost", 1, j.identity, None, now["t"])
            return e.dests.ledger.room(limits, now["t"])

        j1 = job(1)
        r1 = room(j1)
        assert r1 is not None and r1[0] == 1
        j1.reserved = ("dest:smarthost",)
        e.dests.ledger.reserve(j1.reserved, 1)
        e.dests.dest("smarthost")
        now["t"] = 1101.0  # the next window starts; j1's delivery lands in it
        await attempt.finish(
            e.attempt,
            j1,
            [ops.RcptUpdate(ids["M1"], "M1", RcptState.DELIVERED, True, None, "250")],
            delivered=1,
        )
        room2 = room(job(2))
        db = await w.run(lambda c: ops.daily_counts(c, e.dests.ledger.day_of(now["t"])))
        return room2, db

    try:
        room2, db = asyncio.run(main())
    finally:
        w.close()
    assert db == {"dest:smarthost": 1}
    assert room2 is not None and room2[0] == 0  # the ceiling holds across the roll-over


def test_busy_destination_does_not_hold_every_slot(upstream, relay) -> None:
    up = upstream()
    up.stall = {"data": 1.0}
    with DnsServer({}) as dns:
        dns.set_zone("a.test", {"A": ["127.0.0.1"]})
        dns.set_zone("b.test", {"A": ["127.0.0.1"]})
        r = relay(
            config={
                "upstream": {
                    "mode": "mx",
                    "mx": {"nameservers": [dns.nameserver], "port": up.port, "tls": "none"},
                },
                "delivery": {"workers": 2},
                "destinations": {"*": {"max_connections": 2}},
            }
        )
        for i in range(10):
            send(r.port, "app@example.com", [f"u{i}@a.test"], make_message(i))
        time.sleep(0.5)
        send(r.port, "app@example.com", ["reset@b.test"], make_message(99))
        r.wait_until(
            lambda: r.recipient_states().get("reset@b.test") == "delivered",
            timeout=30,
            what="b.test delivered",
        )
        order = [m.rcpt_tos[0] for m in up.received]
        # it got a slot after a transaction of a.test, not after a.test's whole backlog
        assert order.index("reset@b.test") < 6, order
        r.stop()


def _hup_and_wait(r, event: str) -> dict:
    before = len([e for e in r.events() if e.get("event") == event])
    r.signal(signal.SIGHUP)
    r.wait_until(
        lambda: len([e for e in r.events() if e.get("event") == event]) > before,
        timeout=15,
        what=f"{event} after SIGHUP",
    )
    return [e for e in r.events() if e.get("event") == event][-1]


def test_reload_keeps_restart_only_keys(upstream, relay, tmp_path: Path) -> None:
    up = upstream()
    r = relay(upstream=up, config={"spool": {"inline_max": "1KiB"}})
    cfg = deep_merge(
        r.config, {"upstream": {"mode": "mx"}, "spool": {"path": str(tmp_path / "elsewhere")}}
    )
    r.write_config(cfg)
    _hup_and_wait(r, "config_reloaded")
    kept = [e for e in r.events() if e.get("event") == "config_reloaded" and e.get("keys")]
    assert kept and set(kept[-1]["keys"]) >= {"upstream.mode", "spool.path"}
    # still smarthost mode and the same spool: a large (file-stored) body still goes out
    big = make_message(1, body=b"x" * 900 + b"\r\n" * 10 + b"y" * 900 + b"\r\n")
    assert send(r.port, "app@example.com", ["user@example.org"], big) == {}
    got = up.wait_for(1)
    assert got[0].data.endswith(b"y" * 900 + b"\r\n")
    # (the CLI reads the file's new spool.path; the daemon's log says where it went)
    r.wait_until(
        lambda: any(
            e.get("event") == "delivered" and e.get("destination") == "smarthost"
            for e in r.events()
        ),
        what="delivered through the running smarthost mode",
    )


def test_reload_with_bad_nameserver_is_rejected_and_reloads_still_work(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up)
    good = dict(r.config)
    r.write_config(deep_merge(good, {"upstream": {"mx": {"nameservers": ["dns.example"]}}}))
    ev = _hup_and_wait(r, "config_rejected")
    assert "nameservers" in ev.get("error", "")
    r.write_config(deep_merge(good, {"log": {"level": "info"}}))
    _hup_and_wait(r, "config_reloaded")
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(2)) == {}
    up.wait_for(1)


def test_retry_of_an_expired_recipient_gets_a_fresh_max_age(upstream, relay) -> None:
    up = upstream()
    mode = {"fail": 10**6}

    def data_reply(env):  # 451 while mode["fail"] > 0
        if mode["fail"] > 0:
            mode["fail"] -= 1
            return "451 4.3.0 try later"
        return None

    up.data_reply = data_reply
    r = relay(
        upstream=up,
        config={
            "retry": {"schedule": ["0.5s"], "max_age": "3s", "min_delay": "0.2s"},
            "destinations": {"*": {"circuit_failures": 100}},
        },
    )
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(1)) == {}
    r.wait_until(
        lambda: r.recipient_states().get("user@example.org") == "failed", timeout=20, what="expired"
    )
    mode["fail"] = 1  # the replay's first attempt fails transiently, the next succeeds
    r.cli("queue", "retry", "--failed", check=True)
    r.wait_until(
        lambda: r.recipient_states().get("user@example.org") == "delivered",
        timeout=20,
        what="delivered after the replay",
    )
    rc = r.queue()[0]["recipients"][0]
    assert rc["attempts"] == 2  # one transient failure after the retry, then delivered


def test_a_spool_failure_at_engine_start_is_retried_not_fatal(tmp_path: Path) -> None:
    """Found by test_failure_paths under load: the engine's start-up reads (crash recovery,
    today's counts) ran outside its loop's error handling, so one failed commit right after
    `relay is ready` killed the engine task and the daemon went on accepting mail that it
    never delivered."""
    from relay.ops import faults

    cfg_path = tmp_path / "relay.yaml"
    cfg_path.write_text(
        yaml.safe_dump({"spool": {"path": "spool"}, "delivery": {"poll_interval": "0.05s"}})
    )
    cfg = load_config(str(cfg_path))
    w = SpoolWriter(cfg.spool_path)
    w.start()

    async def main() -> None:
        e = Engine(cfg, w)
        faults.arm("spool.commit", "eio", times=2)  # recover() fails twice, then works
        async with engine_running(e) as task:
            m = ops.NewMessage(
                "M1", "1@x", "a@x.test", 1, 0.0, "c", "p", "transactional", 0, "x.test",
                b"x", None, (ops.NewRecipient("u@x.test", "x.test", "k1"),),
            )  # fmt: skip
            await asyncio.sleep(0.3)
            assert not task.done(), task.exception()
            await w.run(lambda c: ops.accept(c, m, 3600))
            e.wake()
            for _ in range(100):  # the engine claims it (no upstream: it is then deferred)
                n = await w.run(
                    lambda c: c.execute(
                        "SELECT attempts + (state != 'pending') FROM recipients"
                    ).fetchone()[0]
                )
                if n:
                    break
                await asyncio.sleep(0.05)
            assert n, "the engine never claimed the recipient"

    try:
        asyncio.run(main())
    finally:
        faults.disarm_all()
        w.close()


@pytest.mark.parametrize(("gather", "passes"), [("300ms", [3]), ("0s", [1, 1, 1])])
def test_new_mail_is_gathered_into_one_claim_pass(
    upstream, tmp_path: Path, gather: str, passes: list[int]
) -> None:
    """delivery.gather: three messages queued 50 ms apart, each waking an idle engine, are
    claimed by one pass when it gathers 300 ms, and by a pass each when it gathers none.
    Every one of them is delivered either way."""
    up = upstream()
    cfg_path = tmp_path / "relay.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            deep_merge(
                smarthost_config(up),
                {
                    "spool": {"path": "spool"},
                    "delivery": {"gather": gather, "poll_interval": "10s"},
                },
            )
        )
    )
    cfg = load_config(str(cfg_path))
    w = SpoolWriter(cfg.spool_path)
    w.start()

    async def main() -> list[int]:
        e = Engine(cfg, w)
        claimed: list[int] = []
        real = e.claims.claim_and_dispatch

        async def counted() -> int:
            n = await real()
            claimed.append(n)
            return n

        e.claims.claim_and_dispatch = counted  # type: ignore[method-assign]
        task = asyncio.create_task(e.run())
        await asyncio.sleep(0.3)  # the start-up pass: nothing due, then idle
        before = len(claimed)
        for i in range(3):
            now = time.time()
            m = ops.NewMessage(
                f"G{i}",
                f"g{i}@x",
                "a@x.test",
                1,
                now,
                "c",
                "p",
                "transactional",
                0,
                "x.test",
                b"Subject: g\r\n\r\nx\r\n",
                None,
                (ops.NewRecipient(f"u{i}@x.test", "x.test", f"g{i}"),),
            )
            await w.run(lambda c, m=m: ops.accept(c, m, 3600))
            e.wake()  # as the SMTP side does for each message it queues
            await asyncio.sleep(0.05)
        for _ in range(500):  # up to 10 s for the three deliveries
            if len(up.received) >= 3:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # any pass the deliveries' ends wake
        await e.stop(2)
        await task
        return [n for n in claimed[before:] if n]

    try:
        got = asyncio.run(main())
    finally:
        w.close()
    assert len(up.received) == 3
    assert got == passes
