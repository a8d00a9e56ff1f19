"""MX mode end to end: the daemon subprocess resolves recipient domains through a real DNS
server on loopback and delivers to real aiosmtpd upstreams bound to 127.0.0.x addresses
(RFC 5321 §5.1 preference order, fallback and implicit MX; RFC 7505 null MX)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.dnsserver import DnsServer
from tests.harness import RelayProcess, Upstream, deep_merge, make_message, send

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
HOSTS = ("127.0.0.2", "127.0.0.3")


def common_port(hosts: tuple[str, ...] = HOSTS) -> int:
    """A port that is free on every one of `hosts` (MX mode uses one port for all hosts)."""
    for _ in range(50):
        socks: list[socket.socket] = []
        try:
            first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(first)
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            for h in hosts[1:]:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((h, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no common free port")


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    server = DnsServer({})
    with server:
        yield server
    assert server.errors == []


@pytest.fixture
def port() -> int:
    return common_port()


def mx_config(dns: DnsServer, port: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "upstream": {
            "mode": "mx",
            "mx": {
                "nameservers": [dns.nameserver],
                "port": port,
                "tls": "none",
                "dns_timeout": "2s",
            },
        },
        "retry": {"schedule": ["1s"], "max_age": "1h", "min_delay": "0.2s"},
        "destinations": {
            "*": {
                "command_timeout": "1s",
                "data_timeout": "1s",
                "connect_timeout": "1s",
                "circuit_failures": 100,  # no 60 s circuit pause in the middle of a test
            }
        },
    }
    return deep_merge(cfg, extra)


def recipient(r: RelayProcess, address: str) -> dict[str, Any]:
    for m in r.queue():
        for rc in m["recipients"]:
            if rc["address"] == address:
                return {**rc, "queue_id": m["id"]}
    raise AssertionError(f"{address} is not in the queue")


def wait_state(r: RelayProcess, address: str, state: str) -> dict[str, Any]:
    """The recipient's entry from the same look that saw it in `state`."""
    seen: dict[str, Any] = {}

    def in_state() -> bool:
        seen.clear()
        seen.update(recipient(r, address))
        return seen.get("state") == state

    r.wait_until(in_state, what=f"{address} {state}")
    return dict(seen)


def attempt_hosts(r: RelayProcess, queue_id: str) -> list[str | None]:
    return [a["host"] for a in r.cli_json("queue", "show", queue_id)["attempt_log"]]


MakeUpstream = Callable[..., Upstream]


def test_lowest_preference_gets_the_mail(upstream: MakeUpstream, relay, dns, port) -> None:
    # listed in reverse order on purpose: the preference decides, not the answer order
    dns.set_zone("pref.test", {"MX": [(20, "mx2.pref.test"), (10, "mx1.pref.test")]})
    dns.set_zone("mx1.pref.test", {"A": ["127.0.0.2"]})
    dns.set_zone("mx2.pref.test", {"A": ["127.0.0.3"]})
    primary = upstream(host="127.0.0.2", port=port)
    backup = upstream(host="127.0.0.3", port=port)
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@pref.test"], make_message(1)) == {}

    rc = wait_state(r, "user@pref.test", "delivered")
    assert [m.rcpt_tos for m in primary.wait_for(1)] == [["user@pref.test"]]
    assert backup.received == [] and backup.connections == 0
    assert attempt_hosts(r, rc["queue_id"]) == [f"mx1.pref.test[127.0.0.2]:{port}"]
    assert dns.count("pref.test", "MX") >= 1


def test_falls_back_to_second_mx_when_first_refuses(
    upstream: MakeUpstream, relay, dns, port
) -> None:
    dns.set_zone("fb.test", {"MX": [(10, "mx1.fb.test"), (20, "mx2.fb.test")]})
    dns.set_zone("mx1.fb.test", {"A": ["127.0.0.2"]})  # nothing listens there
    dns.set_zone("mx2.fb.test", {"A": ["127.0.0.3"]})
    backup = upstream(host="127.0.0.3", port=port)
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@fb.test"], make_message(2)) == {}

    rc = wait_state(r, "user@fb.test", "delivered")
    assert rc["attempts"] == 1  # one attempt: the fallback is part of it
    assert [m.rcpt_tos for m in backup.wait_for(1)] == [["user@fb.test"]]
    assert attempt_hosts(r, rc["queue_id"]) == [f"mx2.fb.test[127.0.0.3]:{port}"]


def test_falls_back_to_second_mx_when_first_greets_with_421(
    upstream: MakeUpstream, relay, dns, port
) -> None:
    dns.set_zone("busy.test", {"MX": [(10, "mx1.busy.test"), (20, "mx2.busy.test")]})
    dns.set_zone("mx1.busy.test", {"A": ["127.0.0.2"]})
    dns.set_zone("mx2.busy.test", {"A": ["127.0.0.3"]})
    busy = upstream(host="127.0.0.2", port=port, connect_reply="421 4.3.2 too busy")
    backup = upstream(host="127.0.0.3", port=port)
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@busy.test"], make_message(8)) == {}

    rc = wait_state(r, "user@busy.test", "delivered")
    assert busy.connections >= 1 and busy.received == []
    assert [m.rcpt_tos for m in backup.wait_for(1)] == [["user@busy.test"]]
    assert attempt_hosts(r, rc["queue_id"]) == [f"mx2.busy.test[127.0.0.3]:{port}"]


def test_implicit_mx_from_a_record(upstream: MakeUpstream, relay, dns, port) -> None:
    dns.set_zone("implicit.test", {"A": ["127.0.0.2"]})
    up = upstream(host="127.0.0.2", port=port)
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@implicit.test"], make_message(3)) == {}

    rc = wait_state(r, "user@implicit.test", "delivered")
    assert [m.rcpt_tos for m in up.wait_for(1)] == [["user@implicit.test"]]
    assert attempt_hosts(r, rc["queue_id"]) == [f"implicit.test[127.0.0.2]:{port}"]
    assert dns.count("implicit.test", "MX") >= 1 and dns.count("implicit.test", "A") >= 1


def test_nxdomain_bounces_with_512(relay, dns, port) -> None:
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@nowhere.test"], make_message(4)) == {}

    rc = wait_state(r, "user@nowhere.test", "bounced")
    assert rc["last_reply"].startswith("550 5.1.2")
    assert "nowhere.test" in rc["last_reply"]
    assert rc["attempts"] == 1
    dead = [e for e in r.events() if e.get("event") == "dead_letter"]
    assert len(dead) == 1 and dead[0]["state"] == "bounced"


def test_null_mx_bounces_with_556(upstream: MakeUpstream, relay, dns, port) -> None:
    dns.set_zone("nullmx.test", {"MX": [(0, ".")], "A": ["127.0.0.2"]})
    up = upstream(host="127.0.0.2", port=port)  # the A record must not be used
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@nullmx.test"], make_message(5)) == {}

    rc = wait_state(r, "user@nullmx.test", "bounced")
    assert rc["last_reply"].startswith("556 5.1.10")
    assert up.connections == 0


def test_servfail_defers_then_delivers(upstream: MakeUpstream, relay, dns, port) -> None:
    dns.set_zone("broken.test", "SERVFAIL")
    up = upstream(host="127.0.0.2", port=port)
    r = relay(config=mx_config(dns, port))
    assert send(r.port, SENDER, ["user@broken.test"], make_message(6)) == {}

    r.wait_until(lambda: recipient(r, "user@broken.test")["attempts"] >= 2, what="two attempts")
    rc = recipient(r, "user@broken.test")
    assert rc["state"] in ("deferred", "sending")
    assert rc["last_reply"].startswith("451 4.4.3")
    assert up.received == []

    # DNS is repaired: the next attempt resolves and delivers
    dns.set_zone("broken.test", {"MX": [(10, "mx.broken.test")]})
    dns.set_zone("mx.broken.test", {"A": ["127.0.0.2"]})
    wait_state(r, "user@broken.test", "delivered")
    assert [m.rcpt_tos for m in up.wait_for(1)] == [["user@broken.test"]]


def test_dns_timeout_defers(relay, dns, port) -> None:
    dns.set_zone("slow.test", "TIMEOUT")  # queries are dropped: the resolver times out
    r = relay(config=mx_config(dns, port, upstream={"mx": {"dns_timeout": "1s"}}))
    assert send(r.port, SENDER, ["user@slow.test"], make_message(9)) == {}

    r.wait_until(lambda: recipient(r, "user@slow.test")["attempts"] >= 1, what="an attempt")
    rc = recipient(r, "user@slow.test")
    assert rc["state"] in ("deferred", "sending")
    assert rc["last_reply"].startswith("451 4.4.3")
    assert "timed out" in rc["last_reply"]
    assert r.cli_json("suppression", "list") == []


def test_two_domains_two_transactions(upstream: MakeUpstream, relay, dns, port) -> None:
    dns.set_zone("a.test", {"MX": [(10, "mx.a.test")]})
    dns.set_zone("mx.a.test", {"A": ["127.0.0.2"]})
    dns.set_zone("b.test", {"MX": [(10, "mx.b.test")]})
    dns.set_zone("mx.b.test", {"A": ["127.0.0.3"]})
    up_a = upstream(host="127.0.0.2", port=port)
    up_b = upstream(host="127.0.0.3", port=port)
    r = relay(config=mx_config(dns, port))
    rcpts = ["x@a.test", "y@b.test", "z@a.test"]
    assert send(r.port, SENDER, rcpts, make_message(7)) == {}

    got_a = up_a.wait_for(1)
    got_b = up_b.wait_for(1)
    r.wait_until(lambda: set(r.recipient_states().values()) == {"delivered"}, what="all delivered")
    assert len(got_a) == 1 and sorted(got_a[0].rcpt_tos) == ["x@a.test", "z@a.test"]
    assert len(got_b) == 1 and got_b[0].rcpt_tos == ["y@b.test"]
    for got in (got_a[0], got_b[0]):
        assert b"body of message 7" in got.data
    assert len(r.queue()) == 1  # one message, two transactions
    with contextlib.suppress(AssertionError):
        up_a.wait_for(2, timeout=1.0)
    assert len(up_a.received) == 1 and len(up_b.received) == 1
