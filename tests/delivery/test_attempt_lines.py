"""One delivery attempt's outcomes (relay/delivery/attempt.py `apply`): the recipients' log
lines leave in one write, not one each, and each counter moves by the recipients it counts.
A real engine over a real SQLite spool delivers to a real aiosmtpd upstream on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import load_config
from relay.delivery.engine import Engine
from relay.spool import ops
from relay.spool.writer import SpoolWriter
from tests.harness import (
    LogWrites,
    Upstream,
    deep_merge,
    engine_running,
    fast_config,
    smarthost_config,
)


@pytest.fixture
def smarthost() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


RCPTS = ("a1@x.test", "a2@x.test", "a3@x.test", "no1@x.test", "later@x.test")
REPLIES = {"no1@x.test": "550 5.1.1 no such user", "later@x.test": "451 4.3.0 try again later"}


def test_a_delivery_logs_its_recipients_in_one_write_and_counts_each(
    smarthost: Upstream, tmp_path: Path, log_writes: LogWrites
) -> None:
    smarthost.rcpt_reply = lambda a: REPLIES.get(a)
    p = tmp_path / "relay.yaml"
    conf = deep_merge(fast_config(), smarthost_config(smarthost))
    conf["retry"] |= {"schedule": ["1h"], "max_age": "1d"}
    conf["spool"] = {"path": "spool"}
    p.write_text(yaml.safe_dump(conf))
    cfg = load_config(str(p))
    w = SpoolWriter(cfg.spool_path)
    w.start()
    now = time.time()
    msg = ops.NewMessage(
        "M1", "1@x", "a@x.test", 1, now, "c", "p", "transactional", 0, "x.test",
        b"Subject: s\r\n\r\nx\r\n", None,
        tuple(ops.NewRecipient(r, "x.test", f"k-{r}") for r in RCPTS),
    )  # fmt: skip

    async def main() -> tuple[dict[str, str], Engine]:
        e = Engine(cfg, w)
        async with engine_running(e):
            await w.run(lambda c: ops.accept(c, msg, 3600))
            e.wake()
            deadline = time.monotonic() + 20
            while True:
                got = await w.run(
                    lambda c: dict(c.execute("SELECT address, state FROM recipients").fetchall())
                )
                if "sending" not in got.values() and "pending" not in got.values():
                    return got, e
                assert time.monotonic() < deadline, got
                await asyncio.sleep(0.05)

    try:
        got, e = asyncio.run(main())
    finally:
        w.close()
    assert got == {
        "a1@x.test": "delivered",
        "a2@x.test": "delivered",
        "a3@x.test": "delivered",
        "no1@x.test": "bounced",
        "later@x.test": "deferred",
    }
    # the attempt's lines (each recipient's, the dead letter's, the destination's): one write
    mine = [w for w in log_writes.writes if '"queue_id":"M1"' in w]
    assert len(mine) == 1, log_writes.writes
    lines = [json.loads(line) for line in mine[0].splitlines()]
    assert [(x.get("rcpt"), x["event"]) for x in lines] == [
        ("a***@x.test", "delivered"),
        ("a***@x.test", "delivered"),
        ("a***@x.test", "delivered"),
        ("l***@x.test", "deferred"),
        (None, "slowdown"),  # the 451's "try again later" (the destination's line)
        ("n***@x.test", "bounced"),  # the dead letter's lines (relay/delivery/deadletters.py)
        ("n***@x.test", "dead_letter"),
    ], lines
    # each counter by the recipients it counts (labels once per attempt, incremented by n)
    m = e.attempt.metrics.registry.get_sample_value

    def attempts(outcome: str) -> Any:
        return m("relay_delivery_attempts_total", {"destination": "smarthost", "outcome": outcome})

    assert m("relay_delivered_recipients_total", {"destination": "smarthost"}) == 3
    assert attempts("delivered") == 3
    assert attempts("bounce") == 1
    assert attempts("transient") == 1
    assert m("relay_bounced_recipients_total", {"destination": "smarthost"}) == 1
    deferred = {"destination": "smarthost", "reason": "transient"}
    assert m("relay_deferred_recipients_total", deferred) == 1
