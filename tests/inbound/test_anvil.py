"""Pure tables for the inbound limits: relay/inbound/anvil.py (connections, AUTH failures and bans,
log-once) and the limits' config keys. (session_limits.py and fdlimit.py, once tested here too,
are in test_session_limits.py and test_fdlimit.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relay.config.tree import ConfigError, from_mapping
from relay.inbound import anvil

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


# --- config ------------------------------------------------------------------------------


def conf(tmp_path: Path, **top: Any) -> Any:
    return from_mapping({"spool": {"path": "spool"}, **top}, tmp_path)


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
