"""The console's pure parts: users file, session cookies, CSRF tokens, the per-minute
rollup's arithmetic, and the HTML helpers' escaping (relay/ops/console)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from relay.ops.console import auth, rollup
from relay.ops.console.html import chart, h, table
from relay.ops.metrics import Metrics
from relay.spool import db
from tests.pgserver import pg_dsn  # noqa: F401 - fixture

KEY = b"k" * 32


def test_user_line_round_trip_and_password_check() -> None:
    line = auth.user_line("alice", "operator", "s3cret")
    name, role, stored = line.split(":")
    assert (name, role) == ("alice", "operator") and stored.startswith("scrypt$")
    users = auth.parse_users(f"# comment\n\n{line}\n")
    assert auth.check_login(users, "alice", "s3cret") == users["alice"]
    assert auth.check_login(users, "alice", "wrong") is None
    assert auth.check_login(users, "nobody", "s3cret") is None


@pytest.mark.parametrize(
    ("name", "role", "password"),
    [
        ("", "viewer", "x"),
        ("a:b", "viewer", "x"),
        ("#a", "viewer", "x"),
        ("a", "admin", "x"),
        ("a", "viewer", ""),
    ],
)
def test_user_line_refuses(name: str, role: str, password: str) -> None:
    with pytest.raises(ValueError):
        auth.user_line(name, role, password)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("alice:operator", "line 1: expected"),
        ("alice:root:scrypt$AAAA$" + "A" * 44, "line 1: the role"),
        ("alice:viewer:plaintext", "line 1: not a scrypt"),
    ],
)
def test_users_file_errors_name_the_line_not_its_text(text: str, why: str) -> None:
    with pytest.raises(auth.UsersFileError) as e:
        auth.parse_users(text)
    assert why in str(e.value) and "plaintext" not in str(e.value)


def test_users_listed_twice() -> None:
    line = auth.user_line("a", "viewer", "x")
    with pytest.raises(auth.UsersFileError, match="line 2: user listed twice"):
        auth.parse_users(f"{line}\n{line}\n")


def test_session_cookie_signed_and_checked() -> None:
    s = auth.new_session("alice", "viewer", now=1000.0, ttl=60)
    value = auth.sign_session(KEY, s)
    assert auth.verify_session(KEY, value, 1001.0) == auth.Session("alice", "viewer", s.sid, 1060)
    assert auth.verify_session(KEY, value, 1060.0) is None  # expired
    assert auth.verify_session(b"x" * 32, value, 1001.0) is None  # another key
    payload, _dot, mac = value.partition(".")
    # a viewer who rewrites the payload to operator keeps the old MAC: refused
    forged = auth._b64(auth._unb64(payload).replace(b"viewer", b"operator"))
    assert auth.verify_session(KEY, f"{forged}.{mac}", 1001.0) is None
    for junk in ("", ".", "abc", "a.b", "!!!.???", value + "x"):
        assert auth.verify_session(KEY, junk, 1001.0) is None


def test_csrf_token_per_session() -> None:
    a = auth.new_session("alice", "operator", 0)
    b = auth.new_session("alice", "operator", 0)
    ta = auth.csrf_token(KEY, a)
    assert auth.csrf_ok(KEY, a, ta)
    assert not auth.csrf_ok(KEY, b, ta)  # another session's token
    assert not auth.csrf_ok(KEY, a, None) and not auth.csrf_ok(KEY, a, "")
    assert not auth.csrf_ok(b"y" * 32, a, ta)


def test_cookie_attributes() -> None:
    c = auth.cookie_header("v", secure=True, max_age=5)
    assert {"HttpOnly", "SameSite=Strict", "Secure", "Max-Age=5", "Path=/console"} <= set(
        c.split("; ")
    )
    assert "Secure" not in auth.cookie_header("v", secure=False)
    assert auth.parse_cookies("a=1; relay_console=xyz; b=2")[auth.COOKIE] == "xyz"


def test_key_made_once_and_private(tmp_path: Path) -> None:
    k1 = auth.load_key(tmp_path)
    assert len(k1) == 32 and auth.load_key(tmp_path) == k1
    assert (tmp_path / auth.KEY_FILE).stat().st_mode & 0o077 == 0


# --- rollup ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buckets", "q", "want"),
    [
        ([], 0.5, None),
        ([(1.0, 0.0), (float("inf"), 0.0)], 0.5, None),
        ([(1.0, 10.0), (2.0, 10.0), (float("inf"), 10.0)], 0.5, 0.5),
        ([(1.0, 0.0), (2.0, 10.0), (float("inf"), 10.0)], 0.5, 1.5),
        ([(1.0, 0.0), (2.0, 0.0), (float("inf"), 4.0)], 0.99, 2.0),  # past the last bound
    ],
)
def test_quantile(buckets: list[tuple[float, float]], q: float, want: float | None) -> None:
    assert rollup.quantile(buckets, q) == want


def test_delta_of_counters_and_a_restart() -> None:
    m = Metrics()
    prev = rollup.sample(m)
    m.accepted.labels("transactional").inc(3)
    m.accepted.labels("bulk").inc(2)
    m.delivered.labels("smarthost").inc(4)
    m.latency.observe(0.3)
    cur = rollup.sample(m)
    row = rollup.delta(prev, cur, 100, 7)
    assert row.counts["accepted"] == 5 and row.counts["delivered"] == 4
    assert row.counts["bounced"] == 0 and row.queue_depth == 7
    assert row.p50 is not None and 0 < row.p50 <= 0.5
    # a counter lower than the last sample: the daemon restarted, counted from zero
    again = rollup.delta(cur, prev, 101, 0)
    assert again.counts["accepted"] == 0
    restarted = rollup.delta(rollup.Sample({"accepted": 10.0}, ()), cur, 102, 0)
    assert restarted.counts["accepted"] == 5


def _write_and_read(conn: sqlite3.Connection) -> None:
    counts = dict.fromkeys(rollup.SERIES, 1)
    with db.transaction(conn):
        rollup.write_minute(conn, rollup.Minute(1000, counts, 5, 0.1, 0.2, 0.3))
        rollup.write_minute(conn, rollup.Minute(1000, counts, 6, None, None, None))  # adds
    rows = rollup.read_series(conn, 0)
    assert len(rows) == 1 and rows[0]["accepted"] == 2 and rows[0]["queue_depth"] == 6
    assert rows[0]["p50"] == pytest.approx(0.1)  # kept when the later one had none
    with db.transaction(conn):  # 8 days later: the old minute is pruned
        rollup.write_minute(
            conn, rollup.Minute(1000 + rollup.KEEP_MINUTES + 1, counts, 0, None, None, None)
        )
    assert [r["minute"] for r in rollup.read_series(conn, 0)] == [1001 + rollup.KEEP_MINUTES]


def test_minutes_table_sqlite(tmp_path: Path) -> None:
    conn = db.open_spool(tmp_path)
    try:
        _write_and_read(conn)
    finally:
        conn.close()


def test_minutes_table_postgresql(tmp_path: Path, pg_dsn: str) -> None:  # noqa: F811
    from relay.spool import pg

    conn = pg.connect(pg_dsn)
    try:
        _write_and_read(conn)  # type: ignore[arg-type]
    finally:
        conn.close()


# --- HTML -----------------------------------------------------------------------------------


def test_escaping() -> None:
    assert h('<script>"x"&\'') == "&lt;script&gt;&quot;x&quot;&amp;&#x27;"
    out = table(["a<b"], [[h("<img src=x onerror=alert(1)>")]])
    assert "<img" not in out and "&lt;img" in out and "a&lt;b" in out


def test_chart_points_scale() -> None:
    svg = chart("t<", [1, 2, 3], {"accepted": [0.0, 5.0, None]})
    assert 'data-series="accepted" data-max="5"' in svg
    pts = svg.split('points="')[1].split('"')[0].split()
    assert len(pts) == 2  # the missing minute draws no point
    assert "t&lt;" in svg and "t<" not in svg


def test_bulk_dry_run_counts_what_the_action_does(tmp_path: Path) -> None:
    """The confirmation's dry run and the action are the CLI's ops.bulk over the same
    selection: the same messages and recipients; a recipient filter selects that
    recipient, never the other recipient of its message; 1,234 messages ("all matching"
    over more ids than one statement takes)."""
    from relay.ops.console.app import Filters, run_bulk

    conn = db.open_spool(tmp_path)
    n = 1_234
    with db.transaction(conn):
        conn.executemany(
            "INSERT INTO messages (id, message_id, sender, size, created_at, client, peer,"
            " lane, identity, body) VALUES (?, ?, '', 1, ?, 'c', 'p', 'transactional', 'i', x'')",
            ((f"Q{i:06d}", f"m{i}", float(i)) for i in range(n)),
        )
        conn.executemany(
            "INSERT INTO recipients (msg_id, address, destination, lane_prio, state,"
            " dedup_key, updated_at) VALUES (?, ?, ?, 0, 'deferred', ?, 0)",
            (
                (f"Q{i:06d}", f"{who}{i % 7}@{dom}", dom, f"k{who}{i}")
                for i in range(n)
                for who, dom in (("u", "example.org"), ("v", "example.net"))
            ),
        )
    f = Filters(destination="example.org")
    dry = run_bulk(conn, f, [], True, "hold", 1e9, dry_run=True)
    assert len(dry.messages) == n and dry.recipients == n  # the .org recipient of each
    with db.transaction(conn):
        done = run_bulk(conn, f, [], True, "hold", 1e9, dry_run=False)
    assert (done.messages, done.recipients) == (dry.messages, dry.recipients)
    held = conn.execute(
        "SELECT destination, count(*) FROM recipients WHERE state = 'held' GROUP BY destination"
    ).fetchall()
    assert [tuple(r) for r in held] == [("example.org", n)]
    one = Filters(recipient="u3@example.org")
    dry = run_bulk(conn, one, [], True, "release", 1e9, dry_run=True)
    with db.transaction(conn):
        done = run_bulk(conn, one, [], True, "release", 1e9, dry_run=False)
    assert done.recipients == dry.recipients == len([i for i in range(n) if i % 7 == 3])
    conn.close()
