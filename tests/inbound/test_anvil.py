"""Pure tables for the inbound limits: relay/inbound/anvil.py (connections, AUTH failures and bans,
log-once), relay/inbound/session_limits.py (which replies are errors, the DATA rate meter),
relay/inbound/fdlimit.py, and their config keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relay.config.tree import ConfigError, from_mapping
from relay.inbound import anvil, fdlimit
from relay.inbound.session_limits import DataRate, counts_as_error, resets_errors

LIMITS = anvil.ConnectionLimits(max_connections=10, per_ip=3, per_ip_allowed=8, allowed_reserve=2)


# The docstring's order, row by row: (total open, open from this IP, allowed, banned) -> reason
@pytest.mark.parametrize(
    ("total", "from_ip", "allowed", "banned", "reason"),
    [
        (0, 0, False, False, None),
        (10, 0, True, False, "total"),  # 1. the hard bound, for everyone
        (10, 0, False, False, "total"),
        (9, 0, True, False, None),  # the reserve is the allow-listed clients'
        (8, 0, False, False, "total"),  # 2. outsiders stop at max - reserve
        (7, 0, False, False, None),
        (7, 3, False, False, "per_ip"),  # 3. per IP
        (7, 2, False, False, None),
        (7, 3, True, False, None),  # allowed IPs have their own, higher, per-IP limit
        (7, 8, True, False, "per_ip"),
        (0, 0, False, True, "auth_ban"),  # 4. a banned outsider could only AUTH
        (0, 0, True, True, None),  # an allow-listed one still relays without AUTH
        (10, 0, False, True, "total"),  # the first rule that applies is the reason
    ],
)
def test_refuse_connection(
    total: int, from_ip: int, allowed: bool, banned: bool, reason: str | None
) -> None:
    assert anvil.refuse_connection(LIMITS, total, from_ip, allowed, banned) == reason


@pytest.mark.parametrize(
    ("ip", "key"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),  # the same /64
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),  # IPv4-mapped
        ("::1", "::/64"),
        ("not-an-ip", "not-an-ip"),
    ],
)
def test_client_key(ip: str, key: str) -> None:
    assert anvil.client_key(ip) == key


def test_connection_table_counts_and_forgets() -> None:
    t = anvil.ConnectionTable()
    for ip in ("a", "a", "b"):
        t.opened(ip)
    assert (t.total, t.from_ip("a"), t.from_ip("b")) == (3, 2, 1)
    t.closed("a")
    t.closed("b")
    t.closed("b")  # more closes than opens: ignored
    t.closed("nobody")
    assert (t.total, t.by_ip) == (1, {"a": 1})
    t.closed("a")
    assert (t.total, t.by_ip) == (0, {})


POLICY = anvil.AuthPolicy(
    failure_delay=0.5, max_failure_delay=4.0, max_failures=5, window=60.0, ban_time=300.0
)


@pytest.mark.parametrize(
    ("failures", "delay"), [(0, 0.0), (1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 4.0), (1000, 4.0)]
)
def test_failure_delay_doubles_and_is_capped(failures: int, delay: float) -> None:
    assert anvil.failure_delay(POLICY, failures) == delay


def test_failure_delay_zero_disables() -> None:
    off = anvil.AuthPolicy(0.0, 4.0, 5, 60.0, 300.0)
    assert anvil.failure_delay(off, 3) == 0.0


def test_auth_failures_ban_after_n_in_the_window() -> None:
    f = anvil.AuthFailures(POLICY)
    verdicts = [f.failure("1.2.3.4", t) for t in (0.0, 1.0, 2.0, 3.0)]
    assert [v.failures for v in verdicts] == [1, 2, 3, 4]
    assert [v.delay for v in verdicts] == [0.5, 1.0, 2.0, 4.0]
    assert all(v.banned_until is None for v in verdicts)
    assert f.banned_until("1.2.3.4", 3.0) is None
    fifth = f.failure("1.2.3.4", 4.0)
    assert fifth.banned_until == 304.0 and fifth.failures == 5
    assert f.banned_until("1.2.3.4", 303.9) == 304.0
    assert f.banned_until("5.6.7.8", 10.0) is None  # per IP
    assert f.banned_until("1.2.3.4", 304.0) is None  # over
    # after the ban: counted afresh
    assert f.failure("1.2.3.4", 305.0).failures == 1


def test_auth_failures_outside_the_window_are_forgotten() -> None:
    f = anvil.AuthFailures(POLICY)
    for t in (0.0, 10.0, 20.0, 30.0):
        f.failure("ip", t)
    # the first two are more than 60 s old at 75 s: 3 in the window, no ban
    v = f.failure("ip", 75.0)
    assert (v.failures, v.banned_until) == (3, None)


def test_auth_failures_zero_max_never_bans() -> None:
    f = anvil.AuthFailures(anvil.AuthPolicy(0.5, 4.0, 0, 60.0, 300.0))
    assert all(f.failure("ip", float(t)).banned_until is None for t in range(100))


def test_auth_failures_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anvil, "MAX_TRACKED", 100)
    f = anvil.AuthFailures(POLICY)
    for i in range(1000):
        f.failure(f"10.0.{i // 256}.{i % 256}", float(i))  # one each, 1 s apart
    assert f.tracked() <= 100 + 61  # swept: only those within the last window stay


def test_log_once_per_key_per_interval() -> None:
    once = anvil.LogOnce(60.0)
    assert once.check("a", 0.0) == 0
    assert once.check("a", 1.0) is None
    assert once.check("b", 1.0) == 0  # another key
    assert once.check("a", 59.0) is None
    assert once.check("a", 60.0) == 2  # two were not logged since
    assert once.check("a", 61.0) is None


# --- session limits -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error"),
    [
        ("250 2.1.0 OK", False),
        ("354 End data with <CR><LF>.<CR><LF>", False),
        ("221 2.0.0 Bye", False),
        ("503 5.5.1 Error: need MAIL command", True),
        ("500 5.5.2 Error: bad syntax", True),
        ("535 5.7.8 Authentication credentials invalid", True),
        ("554 5.7.1 Relay access denied", True),
        ("452 4.5.3 Too many recipients", False),  # flow control, RFC 5321 §4.5.3.1.10
        ("501 5.5.4 Syntax error in parameters", True),
        ("552 5.3.4 Message size exceeds fixed maximum message size", False),  # X.3.Y
        ("451 4.3.0 Spool unavailable; message not accepted", False),  # ours, not the client's
        ("452 4.3.1 Insufficient system storage", False),
        ("421 4.7.0 too many authentication failures", False),  # closes anyway
        ("550 5.1.1 Recipient is suppressed since 2026-01-01T00:00:00Z: bounced", False),
        ("550 5.1.1 no such user", True),
        ("250-SIZE 1000", False),
        ("501 Syntax: HELO hostname", True),  # no enhanced code
        ("", False),
        ("junk", False),
    ],
)
def test_counts_as_error(status: str, error: bool) -> None:
    assert counts_as_error(status) is error


def test_resets_errors() -> None:
    assert resets_errors("250 2.0.0 Ok: queued as 0123")
    assert resets_errors("250 2.0.0 Ok: already queued (duplicate suppressed)")
    assert not resets_errors("250 2.1.5 OK")


def test_data_rate_needs_a_full_window_first() -> None:
    m = DataRate(min_rate=100, window=10.0, start=0.0)
    assert not m.feed(0, 9.9)  # nothing yet, but the window has not passed
    assert m.feed(0, 10.0)  # a whole window and not a byte


def test_data_rate_steady_enough_and_too_slow() -> None:
    m = DataRate(min_rate=100, window=10.0, start=0.0)
    for t in range(0, 60):  # 150 B/s
        assert not m.feed(150, float(t))
    # then it stalls: fine while the last window still holds enough bytes
    assert not m.feed(0, 62.0)
    assert m.feed(0, 70.5)
    assert m.total == 150 * 60


def test_data_rate_fast_then_stalled_is_caught() -> None:
    m = DataRate(min_rate=100, window=10.0, start=0.0)
    assert not m.feed(10_000_000, 0.5)  # a fast start earns no credit for later
    assert not m.feed(0, 9.5)
    assert m.feed(0, 11.0)


def test_data_rate_off() -> None:
    m = DataRate(min_rate=0, window=10.0, start=0.0)
    assert not m.feed(0, 1000.0)


# --- file descriptors and config ------------------------------------------------------------


def conf(tmp_path: Path, **top: Any) -> Any:
    return from_mapping({"spool": {"path": "spool"}, **top}, tmp_path)


def test_fd_budget(tmp_path: Path) -> None:
    c = conf(tmp_path, limits={"max_connections": 500})
    need = 500 + 50 + 1 + 256 + fdlimit.HEADROOM  # 256: admin.max_connections
    assert fdlimit.needed(c) == need
    assert fdlimit.problem(c, need) is None
    msg = fdlimit.problem(c, 600)
    assert msg is not None and msg.startswith("limits.max_connections: 500 connections")
    assert "at most 193" in msg  # 600 - (50 + 1 + 256 + 100)
    assert fdlimit.problem(c, 65536) is None  # the systemd unit's LimitNOFILE
    # each HTTP listener's connection bound counts: the feedback one only when it has its own
    c = conf(
        tmp_path,
        limits={"max_connections": 500},
        admin={"max_connections": 10},
        feedback={"listen": "127.0.0.1:9026", "max_connections": 20},
    )
    assert fdlimit.needed(c) == 500 + 50 + 1 + 10 + 20 + fdlimit.HEADROOM
    c = conf(tmp_path, admin={"listen": None}, feedback={"max_connections": 20})
    assert fdlimit.needed(c) == 500 + 50 + 1 + fdlimit.HEADROOM


def test_config_defaults(tmp_path: Path) -> None:
    c = conf(tmp_path)
    lim = c.limits
    assert (
        lim.max_connections,
        lim.max_connections_per_ip,
        lim.max_connections_per_ip_allowed,
        lim.allowed_reserve,
        lim.max_errors,
    ) == (500, 50, 500, 50, 10)
    assert (lim.command_timeout, lim.min_data_rate, lim.min_data_rate_window) == (60, 500, 30)
    a = c.auth
    assert (
        a.max_parallel,
        a.max_pending,
        a.failure_delay,
        a.max_failure_delay,
        a.max_failures_per_ip,
        a.failure_window,
        a.ban_time,
    ) == (2, 100, 0.5, 8, 10, 600, 600)
    assert c.listen[0].tls is None


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({"limits": {"max_connections": 0}}, "limits.max_connections: 0 is below the minimum 1"),
        (
            {"limits": {"max_connections": 10, "allowed_reserve": 10}},
            "limits.allowed_reserve: 10 must be below limits.max_connections (10)",
        ),
        (
            {"limits": {"max_connections_per_ip": "many"}},
            "limits.max_connections_per_ip: expected a whole number",
        ),
        ({"limits": {"command_timeout": 0}}, "limits.command_timeout: must be more than 0"),
        ({"limits": {"command_timeout": "soon"}}, "limits.command_timeout: 'soon' is not a"),
        ({"limits": {"min_data_rate": "fast"}}, "limits.min_data_rate: 'fast' is not a size"),
        (
            {"limits": {"min_data_rate_window": 0}},
            "limits.min_data_rate_window: must be more than 0",
        ),
        ({"limits": {"max_errors": -1}}, "limits.max_errors: -1 is below the minimum 0"),
        ({"auth": {"max_parallel": 0}}, "auth.max_parallel: 0 is below the minimum 1"),
        ({"auth": {"ban_time": "x"}}, "auth.ban_time: 'x' is not a duration"),
        ({"auth": {"bantime": "1m"}}, "auth.bantime: unknown key"),
        (
            {"listen": [{"address": "127.0.0.1:465", "tls": {"mode": "ssl"}}]},
            "listen[0].tls.mode: 'ssl' is not one of starttls, implicit",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, top: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        conf(tmp_path, **top)
    assert str(exc.value).startswith(message), str(exc.value)


def test_implicit_tls_mode(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    tls = {"cert_file": "cert.pem", "key_file": "key.pem"}
    c = conf(
        tmp_path,
        listen=[
            {"address": "127.0.0.1:465", "tls": {**tls, "mode": "implicit"}},
            {"address": "127.0.0.1:587", "tls": tls},
        ],
    )
    assert c.listen[0].tls is not None and c.listen[0].tls.implicit
    assert c.listen[1].tls is not None and c.listen[1].tls.mode == "starttls"
