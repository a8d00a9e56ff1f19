"""What the CLI writes to an operator's terminal (issue 26 item 10, issue 27 LOW items):
stored mail, headers and feedback come from outsiders, so control characters (ESC, OSC 8
hyperlinks, C1 CSI), bidi overrides and zero-width characters are escaped unless `--raw`
asks for the bytes; a folded header reads as the indented line it is; `destination list`
shows the upstream's host and a configuration error instead of a bare `closed`."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from relay.cli import main as cli
from relay.mail.address import printable
from relay.spool import db, ops

T0 = 1_800_000_000.0
# an OSC 8 hyperlink, a colour, a C1 CSI (U+009B), a bidi override and a zero-width space
HOSTILE = (
    "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"
    " \x1b[31mred \u009b2J \u202eexe.txt\u200b"
)
UNSAFE = ("\x1b", "\x07", "\u009b", "\u202e", "\u200b", "\ufeff")


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[tuple[Path, sqlite3.Connection]]:
    c = db.connect(tmp_path / "spool")
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump({"hostname": "relay.test", "spool": {"path": "spool"}}))
    yield path, c
    c.close()


@pytest.fixture(autouse=True)
def _keep_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run(config: Path, *argv: str) -> tuple[int, bytes]:
    """cli.main in-process; stdout as the bytes a terminal would get."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", write_through=True)
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        rc = cli.main(["-c", str(config), *argv])
    out.flush()
    return rc, raw.getvalue()


def assert_terminal_safe(data: bytes) -> None:
    text = data.decode("utf-8")  # strictly: no stray byte either
    for ch in text:
        assert ch in "\n\t" or ch.isprintable(), f"{ch!r} written raw"
    assert not any(u in text for u in UNSAFE)


@pytest.mark.parametrize(
    ("text", "keep", "shown"),
    [
        ("plain text", "", "plain text"),
        ("caf\u00e9 \u4e2d", "", "caf\u00e9 \u4e2d"),  # letters of any script stay letters
        ("a\x1bb", "", "a\\x1bb"),
        ("a\tb", "", "a\\x09b"),
        ("a\tb", "\t", "a\tb"),
        ("a\x1bb", "\t", "a\\x1bb"),
        ("x\u202ey", "", "x\\u202ey"),  # RIGHT-TO-LEFT OVERRIDE
        ("x\u200by", "", "x\\u200by"),  # ZERO WIDTH SPACE
        ("\ufeffx", "", "\\ufeffx"),  # BOM
        ("x\u2066y\u2069", "", "x\\u2066y\\u2069"),  # isolates
        ("x\u2028y", "", "x\\u2028y"),  # LINE SEPARATOR
        ("x\U000e0041", "", "x\\U000e0041"),  # TAG LATIN CAPITAL LETTER A (Cf)
        ("x\u009by", "", "x\\x9by"),  # C1 CSI
        ("x\udc9by", "", "x\\x9by"),  # an undecodable byte (surrogateescape)
        ("x\x7fy", "", "x\\x7fy"),
    ],
)
def test_printable(text: str, keep: str, shown: str) -> None:
    assert printable(text, keep=keep) == shown


def _feedback_mail(c: sqlite3.Connection, body: bytes) -> int:
    with db.transaction(c):
        c.execute(
            "INSERT INTO feedback_mail (at, peer, sender, rcpt, size, body, events, error)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (T0, "192.0.2.1", "x@evil.example", "fb@relay.test", len(body), body, 0, None),
        )
    row = c.execute("SELECT max(id) FROM feedback_mail").fetchone()
    return int(row[0])


def test_feedback_show_escapes_what_an_outsider_wrote_and_raw_gives_the_bytes(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    config, c = spool
    body = (
        f"From: x@evil.example\r\nSubject: {HOSTILE}\r\n\tfolded\r\n\r\n{HOSTILE}\r\n"
    ).encode() + b"bad byte \xff\x9b end\r\n"
    fid = _feedback_mail(c, body)
    rc, out = run(config, "feedback", "show", str(fid))
    assert rc == 0
    assert_terminal_safe(out)
    text = out.decode()
    assert "Subject: \\x1b]8;;https://evil.example/\\x1b\\click" in text
    assert "\\u202eexe.txt\\u200b" in text and "\\x9b2J" in text
    assert "\n\tfolded\n" in text  # a folded line reads as one
    assert "bad byte \\xff\\x9b end" in text
    rc, out = run(config, "feedback", "show", str(fid), "--raw")
    assert (rc, out) == (0, body)


def _message(c: sqlite3.Connection, head: str, body: bytes) -> str:
    with db.transaction(c):
        res = ops.accept(
            c,
            ops.NewMessage(
                queue_id="Q1",
                message_id="m@x",
                sender="app@x.test",
                size=10,
                created_at=T0,
                client="c",
                peer="p",
                lane="transactional",
                lane_prio=0,
                identity="x.test",
                body=head.encode() + b"\r\n\r\n" + body,
                body_path=None,
                recipients=(ops.NewRecipient("u@example.org", "example.org", "k"),),
            ),
            3600,
        )
    assert res.queue_id == "Q1"
    return "Q1"


def test_queue_show_prints_folded_headers_readably_and_escapes_the_rest(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    config, c = spool
    head = (
        "From: App <app@x.test>\r\nTo: A Long Name <u@example.org>,\r\n\tB <v@example.org>"
        f"\r\nSubject: {HOSTILE}"
    )
    qid = _message(c, head, f"hello {HOSTILE}\r\nbye\r\n".encode())
    rc, out = run(config, "queue", "show", qid, "--body")
    assert rc == 0
    assert_terminal_safe(out)
    text = out.decode()
    assert "  To: A Long Name <u@example.org>,\n  \tB <v@example.org>\n" in text
    assert "\\x09" not in text
    assert "  Subject: \\x1b]8;;https://evil.example/" in text
    assert "\nhello \\x1b]8;;" in text and "\nbye\n" in text
    # --json: the same strings to a parser, no raw escape to a terminal
    rc, out = run(config, "queue", "show", qid, "--body", "--json")
    assert_terminal_safe(out)
    doc = json.loads(out)
    assert HOSTILE in doc["headers"] and doc["body"].startswith(f"hello {HOSTILE}")
    # --raw with --body: the stored bytes
    rc, out = run(config, "queue", "show", qid, "--body", "--raw")
    assert out == head.encode() + b"\r\n\r\n" + f"hello {HOSTILE}\r\nbye\r\n".encode()


def test_destination_list_shows_the_upstream_host_and_its_config_error(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    config, c = spool
    view = {
        "circuit": "closed",
        "config_error": "smtp.example.net:587: 535 5.7.8 authentication failed",
        "upstream": "smtp.example.net:587",
        "effective_connections": 1,
        "delivered_today": 0,
    }
    ok = {**view, "config_error": None, "upstream": "backup.example.net:25"}
    import time

    with db.transaction(c):
        ops.put_runtime(c, "daemon", {"destinations": {"primary": view, "backup": ok}}, time.time())
    rc, out = run(config, "destination", "list")
    assert rc == 0
    lines = out.decode().splitlines()
    primary = next(x for x in lines if x.startswith("primary "))
    assert "smtp.example.net:587" in primary and "CONFIG-ERROR" in primary
    assert " closed " not in primary
    i = lines.index(primary)
    assert (
        lines[i + 1]
        .strip()
        .startswith("config error: smtp.example.net:587: 535 5.7.8 authentication failed")
    )
    backup = next(x for x in lines if x.startswith("backup "))
    assert "backup.example.net:25" in backup and " closed " in backup


def test_alerts_listing_escapes_a_summary_built_from_outside_text(
    spool: tuple[Path, sqlite3.Connection],
) -> None:
    from relay.ops import alerts

    config, c = spool
    ev = alerts.Event("late_bounce", "warning", "smarthost", f"bounce: {HOSTILE}")
    with db.transaction(c):
        alerts.record(c, ev, T0, 300.0, ["command"])
    rc, out = run(config, "alerts")
    assert rc == 0
    assert_terminal_safe(out)
    assert "bounce: \\x1b]8;;https://evil.example/" in out.decode()
