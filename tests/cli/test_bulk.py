"""Bulk queue actions that tell the truth (issue 26, item 9): every action's answer counts
messages and recipients; a dry run reports exactly what the real run then changes (one
WHERE, `ops.bulk`); `--domain` and `--recipient` select recipients, never the other
recipients of the same message. On SQLite and on PostgreSQL, through `relay queue ...`
run in-process."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from relay.cli import main as cli
from relay.spool import db, ops
from tests.pgserver import BACKENDS, open_backend

T0 = 1_800_000_000.0

# (queue id, [(address, state)]): M1 mixes two domains, M4 is finished
SPOOL = [
    (
        "M1",
        [("a@example.net", "deferred"), ("b@example.org", "deferred"), ("c@Example.NET", "held")],
    ),
    ("M2", [("d@example.org", "pending")]),
    ("M3", [("e@example.net", "held"), ("f@example.net", "deferred")]),
    ("M4", [("g@example.net", "delivered"), ("h@example.org", "failed")]),
]


@pytest.fixture(params=BACKENDS)
def spool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    c = cast(sqlite3.Connection, open_backend(request, tmp_path / "spool"))
    with db.transaction(c):
        for n, (qid, rcpts) in enumerate(SPOOL):
            ops.accept(
                c,
                ops.NewMessage(
                    queue_id=qid,
                    message_id=f"{qid}@x",
                    sender="app@x.test",
                    size=10,
                    created_at=T0 + n,
                    client="c",
                    peer="p",
                    lane="transactional",
                    lane_prio=0,
                    identity="x.test",
                    body=b"Subject: x\r\n\r\nx\r\n",
                    body_path=None,
                    recipients=tuple(
                        ops.NewRecipient(a, a.rpartition("@")[2].lower(), f"k-{a}")
                        for a, _s in rcpts
                    ),
                ),
                3600,
            )
            for a, st in rcpts:
                c.execute(
                    "UPDATE recipients SET state = ?, next_attempt_at = ? WHERE address = ?",
                    (st, T0 + 10_000, a),
                )
    conf: dict[str, Any] = {"hostname": "relay.test", "spool": {"path": str(tmp_path / "spool")}}
    if request.param == "postgresql":
        conf["spool"].update(backend="postgresql", dsn=request.getfixturevalue("pg_dsn"))
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(conf))
    yield path, c
    c.close()


@pytest.fixture(autouse=True)
def _keep_logging() -> Iterator[None]:
    """cli.main installs its log handler on the root logger: put the old ones back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run(config: Path, *argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["-c", str(config), *argv])
    return rc, out.getvalue()


def states(c: sqlite3.Connection) -> dict[str, str]:
    return {r[0]: r[1] for r in c.execute("SELECT address, state FROM recipients")}


def rows(c: sqlite3.Connection) -> dict[str, tuple[str, float]]:
    """Each recipient's state and due time: what any of the actions changes."""
    q = "SELECT address, state, next_attempt_at FROM recipients"
    return {r[0]: (r[1], r[2]) for r in c.execute(q)}


CASES = [
    # argv, the recipients that change
    (["hold", "--all", "--domain", "example.net"], {"a@example.net", "f@example.net"}),
    (["hold", "--all", "--recipient", "B@example.org"], {"b@example.org"}),
    (["hold", "M1"], {"a@example.net", "b@example.org"}),
    (["release", "--all"], {"c@Example.NET", "e@example.net"}),
    (["release", "--all", "--domain", "EXAMPLE.net"], {"c@Example.NET", "e@example.net"}),
    (["release", "--all", "--domain", "example.org"], set()),
    (["release", "M2"], set()),
    (["retry", "--all", "--domain", "example.org"], {"b@example.org", "d@example.org"}),
    (["retry", "--failed"], {"h@example.org"}),
    (
        ["delete", "--all", "--domain", "example.org"],
        {"b@example.org", "d@example.org", "h@example.org"},
    ),
    (["delete", "--all", "--recipient", "c@example.net"], {"c@Example.NET"}),
    (["delete", "M3"], {"e@example.net", "f@example.net"}),
    (["flush"], {"a@example.net", "b@example.org", "d@example.org", "f@example.net"}),
]


@pytest.mark.parametrize(("argv", "changed"), CASES, ids=[" ".join(a) for a, _c in CASES])
def test_the_dry_run_counts_what_the_real_run_changes(
    spool: tuple[Path, sqlite3.Connection], argv: list[str], changed: set[str]
) -> None:
    config, c = spool
    before = rows(c)
    expect_msgs = sorted({q for q, rs in SPOOL for a, _s in rs if a in changed})
    rc, text = run(config, "queue", *argv, "--dry-run", "--json")
    assert rc == 0
    dry = json.loads(text)
    assert rows(c) == before  # a dry run changes nothing
    assert dry["dry_run"] is True
    assert (dry["messages"], dry["recipients"]) == (len(expect_msgs), len(changed))
    assert dry["ids"] == expect_msgs

    rc, text = run(config, "queue", *argv, "--json")
    assert rc == 0
    real = json.loads(text)
    after = rows(c)
    moved = {a for a in before if after.get(a) != before[a]}
    assert moved == changed  # nothing else, in particular no co-recipient
    assert real["dry_run"] is False
    assert (real["messages"], real["recipients"], real["ids"]) == (
        dry["messages"],
        dry["recipients"],
        dry["ids"],
    )
    assert real["recipients_changed"] == real["recipients"]


def test_release_dry_run_with_nothing_held_says_nothing_would_change(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    config, c = spool
    with db.transaction(c):
        c.execute("UPDATE recipients SET state = 'deferred' WHERE state = 'held'")
    rc, text = run(config, "queue", "release", "--all", "--dry-run")
    assert (rc, text) == (0, "release: would change 0 recipients of 0 messages\n")
    rc, text = run(config, "queue", "release", "--all")
    assert (rc, text) == (0, "release: 0 recipients of 0 messages changed\n")


def test_hold_by_domain_leaves_the_other_domain_of_the_same_message(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    config, c = spool
    rc, text = run(config, "queue", "hold", "--all", "--domain", "example.net")
    assert (rc, text) == (0, "hold: 2 recipients of 2 messages changed\n")
    st = states(c)
    assert st["b@example.org"] == "deferred"  # M1's example.org recipient goes on
    assert st["a@example.net"] == st["f@example.net"] == "held"


def test_deleting_some_recipients_keeps_the_message_for_the_others(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    config, c = spool
    rc, text = run(config, "queue", "delete", "--all", "--domain", "example.org", "--dry-run")
    assert text == (
        "delete: would delete 3 recipients of 3 messages"
        " (1 message left with no recipient would be removed)\n"
    )
    rc, text = run(config, "queue", "delete", "--all", "--domain", "example.org", "--json")
    assert rc == 0
    doc = json.loads(text)
    assert (doc["messages"], doc["recipients"], doc["messages_removed"]) == (3, 3, 1)
    left = {r[0] for r in c.execute("SELECT id FROM messages")}
    assert left == {"M1", "M3", "M4"}  # M2 had only d@example.org
    shown = ops.show_message(c, "M1")
    assert shown is not None
    assert [r["address"] for r in shown["recipients"]] == ["a@example.net", "c@Example.NET"]


def test_hold_of_a_recipient_in_its_attempt_says_it_is_held_when_the_attempt_ends(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    """`sending` cannot become `held` (the attempt's outcome would find nothing to record):
    the hold marks it, and says so apart from the recipients it changed; a release before
    the attempt ends takes the mark off (relay/spool/model.py)."""
    config, c = spool
    with db.transaction(c):
        c.execute("UPDATE recipients SET state = 'sending' WHERE address = 'b@example.org'")
    rc, text = run(config, "queue", "hold", "M1", "--dry-run", "--json")
    assert (rc, json.loads(text)["recipients"], json.loads(text)["after_attempt"]) == (0, 1, 1)
    rc, text = run(config, "queue", "hold", "M1")
    assert (rc, text) == (
        0,
        "hold: 1 recipient of 1 message changed; 1 recipient in an attempt now will be held"
        " when it ends, unless it delivers\n",
    )
    assert states(c)["b@example.org"] == "sending"
    mark = "SELECT hold_after FROM recipients WHERE address = 'b@example.org'"
    assert c.execute(mark).fetchone()[0] == 1
    rc, text = run(config, "queue", "show", "M1", "--json")
    shown = {r["address"]: r.get("hold_after_attempt") for r in json.loads(text)["recipients"]}
    assert shown == {"a@example.net": None, "b@example.org": True, "c@Example.NET": None}
    rc, text = run(config, "queue", "show", "M1")
    assert "b@example.org  sending  attempts=0  next=-\n      held when this attempt ends" in text
    rc, text = run(config, "queue", "release", "M1", "--json")
    doc = json.loads(text)
    assert (rc, doc["messages"], doc["recipients"], doc["after_attempt"]) == (0, 1, 2, 1)
    assert c.execute(mark).fetchone()[0] == 0
    rc, text = run(config, "queue", "delete", "M1", "--json")
    assert "after_attempt" not in json.loads(text)  # only hold and release mark


def test_hold_all_in_state_sending_marks_those_in_their_attempt_and_holds_the_rest(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    """`--state sending` selects the messages with a recipient in its attempt; the hold
    marks that recipient and holds the message's waiting ones, as for any message."""
    config, c = spool
    with db.transaction(c):
        c.execute("UPDATE recipients SET state = 'sending' WHERE address = 'b@example.org'")
    rc, text = run(config, "queue", "hold", "--all", "--state", "sending", "--json")
    doc = json.loads(text)
    assert (rc, doc["ids"], doc["recipients"], doc["after_attempt"]) == (0, ["M1"], 1, 1)
    st = states(c)
    assert (st["a@example.net"], st["b@example.org"]) == ("held", "sending")
    assert (st["d@example.org"], st["f@example.net"]) == ("pending", "deferred")  # not selected
    mark = "SELECT address FROM recipients WHERE hold_after = 1"
    assert [r[0] for r in c.execute(mark)] == ["b@example.org"]
