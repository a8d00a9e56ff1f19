"""No head-of-line blocking between destinations: a slow, rate-limited domain with a big
backlog must not hold up mail to another domain (MX mode, real DNS on loopback)."""

from __future__ import annotations

import time

import pytest

from tests.dnsserver import DnsServer
from tests.e2e.test_mx_e2e import common_port, mx_config
from tests.harness import make_message, smtp_session

pytestmark = pytest.mark.slow


def test_slow_domain_backlog_does_not_block_other_domains(upstream, relay) -> None:
    port = common_port(("127.0.0.2",))
    with DnsServer({}) as dns:
        dns.set_zone("slow.test", {"A": ["127.0.0.2"]})  # implicit MX
        dns.set_zone("fast.test", {"A": ["127.0.0.2"]})
        up = upstream(host="127.0.0.2", port=port)
        r = relay(
            config=mx_config(
                dns,
                port,
                destinations={"slow.test": {"rate": "1/s", "burst": 1, "max_connections": 1}},
                delivery={"batch": 20},  # a small in-memory budget makes blocking easy to see
            )
        )
        with smtp_session(r.port) as s:
            for i in range(120):
                s.sendmail("app@example.com", [f"u{i}@slow.test"], make_message(i))
        time.sleep(1.0)  # the engine has claimed what it will of the slow backlog
        sent_at = time.time()
        with smtp_session(r.port) as s:
            for i in range(5):
                s.sendmail("app@example.com", [f"v{i}@fast.test"], make_message(1000 + i))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            fast = [m for m in up.received if m.rcpt_tos[0].endswith("@fast.test")]
            if len(fast) == 5:
                break
            time.sleep(0.05)
        fast = [m for m in up.received if m.rcpt_tos[0].endswith("@fast.test")]
        slow = [m for m in up.received if m.rcpt_tos[0].endswith("@slow.test")]
        assert len(fast) == 5, "mail to fast.test was held up behind slow.test's backlog"
        assert max(m.at for m in fast) - sent_at < 10
        # the slow domain is still draining at its 1/s rate: the backlog was real
        assert len(slow) < 60
        r.stop()
