"""The outcome table (relay/delivery/outcomes.py): complete against every part that reads it,
and every row true end to end: a real engine over a real SQLite spool delivers to a real
aiosmtpd upstream on loopback, and each kind ends with its row's state, log line, counter,
alert and DSN action.

Adding an outcome is its row and a stimulus here (`STIMULI`): the walk then checks the row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import load_config
from relay.delivery import attempt, decide, dsn
from relay.delivery.engine import Engine
from relay.delivery.jobs import DeadLetter
from relay.delivery.outcomes import ATTEMPTLESS, ROWS, Kind
from relay.delivery.replies import Outcome, Phase, Reply, classify
from relay.ops import alerts, logs
from relay.ops.metrics import OUTCOME_COUNTERS, Metrics
from relay.spool import ops
from relay.spool.model import DEAD, FINAL, RcptState, can_move
from relay.spool.writer import SpoolWriter
from tests.harness import Upstream, deep_merge, engine_running, fast_config, smarthost_config

# --- the table is complete -----------------------------------------------------------------


def test_every_kind_has_its_row_and_every_decision_kind_is_a_kind() -> None:
    assert set(ROWS) == set(Kind)
    assert all(k is r.kind for k, r in ROWS.items())
    # what `decide` can make: each reply verdict's kind, and a transient one past max_age
    assert set(decide.KIND_OF) == set(Outcome)
    assert set(decide.KIND_OF.values()) | {Kind.EXPIRED} <= set(ROWS)


def test_every_row_state_is_one_an_attempt_may_record() -> None:
    for r in ROWS.values():
        assert isinstance(r.state, RcptState)
        # the spool records every outcome over a claim (`sending`): the one transition table
        assert can_move(RcptState.SENDING, r.state), r
        assert r.dead == (r.state in DEAD), r  # a dead letter is exactly a dead state
        assert r.state in FINAL or r.kind is Kind.DEFERRED, r


def test_every_event_is_a_standard_log_event() -> None:
    for r in ROWS.values():
        assert r.event in logs.EVENTS, r
        assert r.level in (logging.INFO, logging.WARNING, logging.ERROR), r
        assert set(r.log_fields) <= set(attempt._DETAILS), r
    assert {k.value for k in ATTEMPTLESS} <= logs.EVENTS


def test_every_metric_is_exported_with_its_labels() -> None:
    m = Metrics()
    labels_of = {name: labels for name, _doc, labels in OUTCOME_COUNTERS}
    assert len(labels_of) == len(OUTCOME_COUNTERS)
    assert {r.metric for r in ROWS.values()} == set(labels_of)  # each counter is some row's
    for r in ROWS.values():
        assert (r.reason is not None) == ("reason" in labels_of[r.metric]), r
        m.count_outcome(r.metric, "d", r.reason)
        labels = {"destination": "d"} | ({"reason": r.reason} if r.reason else {})
        assert (m.registry.get_sample_value(f"{r.metric}_total", labels) or 0) >= 1, r


def test_alerts_dsn_actions_and_words() -> None:
    for r in ROWS.values():
        assert r.dsn in (None, "delivered", "failed", "delayed", "relayed", "expanded"), r
        assert r.words.strip(), r
        if r.dead:  # a dead letter: its alert, a failed DSN, its words as its reason
            assert (r.alert, r.dsn) == ("dead_letter", "failed"), r
            d = DeadLetter("Q", "u@x", "s@y", "<m>", r.kind.value, "550", "d", 1, "k", "t")
            assert d.reason == r.words
            assert d.as_doc()["reason"] == r.words
        assert r.suppresses <= r.dead  # only a dead letter puts its address on the list
    assert [k for k, r in ROWS.items() if r.counts] == [Kind.DELIVERED]
    # the DSN hook's documents: a delay warning, a dead letter, one without a kind of ours
    assert dsn.action_of({"event": "delayed"}) == ROWS[Kind.DEFERRED].dsn == "delayed"
    assert dsn.action_of({"event": "dead_letter", "state": "expired"}) == "failed"
    assert dsn.action_of({"recipient": "u@x"}) == "failed"


# --- every row end to end -------------------------------------------------------------------


@dataclass(frozen=True)
class Stimulus:
    """What makes a kind: the upstream's RCPT reply, the recipient's age, suppressed."""

    reply: str | None = None  # None: 250
    age: float = 0.0
    suppressed: bool = False


MAX_AGE, WARN_AFTER = 3600.0, 600.0

STIMULI: dict[Kind, Stimulus] = {
    Kind.DELIVERED: Stimulus(),
    # past retry.warn_after: the deferral's delay warning (its alert, its DSN) too
    Kind.DEFERRED: Stimulus("451 4.3.0 try again later", age=WARN_AFTER + 60),
    Kind.BOUNCED: Stimulus("550 5.1.1 no such user"),
    Kind.FAILED: Stimulus("554 5.7.1 refused by policy"),
    Kind.EXPIRED: Stimulus("451 4.3.0 try again later", age=MAX_AGE + 60),
    Kind.SUPPRESSED: Stimulus(suppressed=True),
}


def test_every_kind_has_a_stimulus() -> None:
    assert set(STIMULI) == set(Kind)


@pytest.fixture
def smarthost() -> Any:
    up = Upstream().start()
    yield up
    up.stop()


async def _until(pred: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", list(Kind))
def test_each_row_end_to_end(
    kind: Kind, smarthost: Upstream, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    row, how = ROWS[kind], STIMULI[kind]
    smarthost.rcpt_reply = lambda a: how.reply
    p = tmp_path / "relay.yaml"
    conf = deep_merge(fast_config(), smarthost_config(smarthost))
    conf["retry"] |= {"schedule": ["1h"], "max_age": "1h", "warn_after": "10m"}
    conf["spool"] = {"path": "spool"}
    p.write_text(yaml.safe_dump(conf))
    cfg = load_config(str(p))
    w = SpoolWriter(cfg.spool_path)
    w.start()
    hooked: list[dict[str, Any]] = []

    async def hook(doc: dict[str, Any]) -> None:
        hooked.append(doc)

    def suppressed(address: str, identity: str | None) -> tuple[str, float] | None:
        return ("by the test", 0.0) if how.suppressed else None

    now = time.time()
    msg = ops.NewMessage(
        "M1", "1@x", "a@x.test", 1, now - how.age, "c", "p", "transactional", 0, "x.test",
        b"Subject: s\r\n\r\nx\r\n", None, (ops.NewRecipient("u@x.test", "x.test", "k1"),),
    )  # fmt: skip

    async def state() -> str:
        return str(await w.run(lambda c: c.execute("SELECT state FROM recipients").fetchone()[0]))

    async def main() -> tuple[
        str, list[tuple[str, str]], list[dict[str, Any]], float | None, object
    ]:
        e = Engine(cfg, w, on_dead_letter=hook, is_suppressed=suppressed)
        async with engine_running(e):
            await w.run(lambda c: ops.accept(c, msg, 3600))
            if how.suppressed:  # the spool's entry has the last word (dispatch's rules)
                await w.run(lambda c: ops.suppression_add(c, "u@x.test", "by the test", now))
            e.wake()

            async def settled() -> bool:
                return await state() not in ("pending", "sending")

            await _until(settled, f"{kind} recorded")
            want_hooks = int(row.dsn is not None)

            async def hooks_ran() -> bool:
                return len(hooked) >= want_hooks

            await _until(hooks_ran, "the DSN hook")
        labels = {"destination": "smarthost"} | ({"reason": row.reason} if row.reason else {})
        counted = e.attempt.metrics.registry.get_sample_value(f"{row.metric}_total", labels)
        tried = await w.run(lambda c: c.execute("SELECT outcome, reply FROM attempts").fetchall())
        raised = await w.run(lambda c: alerts.recent(c, 10))
        listed = await w.run(lambda c: ops.suppression_get(c, "u@x.test"))
        return await state(), [(a[0], a[1]) for a in tried], raised, counted, listed

    with caplog.at_level(logging.INFO, logger="relay.delivery.engine"):
        try:
            got, tried, raised, counted, listed = asyncio.run(main())
        finally:
            w.close()

    assert got == row.state
    lines = [r for r in caplog.records if getattr(r, "event", None) == row.event]
    assert [r.levelno for r in lines] == [row.level], caplog.records
    assert counted == 1
    assert [a["event"] for a in raised] == ([row.alert] if row.alert else [])
    assert [dsn.action_of(d) for d in hooked] == ([row.dsn] if row.dsn else [])
    assert (listed is not None) == (row.suppresses or how.suppressed)
    # the attempt log: the reply's verdict, or the kind itself when no attempt was made
    if how.suppressed:
        assert kind in ATTEMPTLESS
        assert [t[0] for t in tried] == [kind.value]
    else:
        verdict = classify(Reply.from_str(how.reply or "250 2.0.0 ok"), Phase.RCPT)
        assert [t[0] for t in tried] == [verdict.outcome.value]
