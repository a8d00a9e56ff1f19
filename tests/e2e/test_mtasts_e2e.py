"""MTA-STS in MX mode, end to end: a real daemon, the loopback DNS server publishing
`_mta-sts` records and MX hosts, a loopback HTTPS policy server (trustme certificates), and
an aiosmtpd MX host that offers STARTTLS with a certificate for some names only.

- enforce, MX listed, certificate verified: delivered over TLS;
- enforce, MX not listed: deferred `4.7.5`, saying why, counted per policy domain;
- enforce, certificate not valid for the MX name: deferred `4.7.5`, never sent in clear;
- testing, MX not listed: delivered, and what enforce would have refused is logged;
- the policy is fetched once and then served from the cache."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.dnsserver import DnsServer
from tests.harness import RelayProcess, Upstream, fast_config, make_message, send

pytestmark = pytest.mark.slow

SENDER = "app@example.com"


def policy(mode: str, *mx: str) -> bytes:
    lines = ["version: STSv1", f"mode: {mode}", *(f"mx: {m}" for m in mx), "max_age: 86400"]
    return ("\r\n".join(lines) + "\r\n").encode()


POLICIES = {
    "mta-sts.good.test": policy("enforce", "mx.good.test"),
    "mta-sts.wrongmx.test": policy("enforce", "mx.elsewhere.test"),
    "mta-sts.badcert.test": policy("enforce", "*.badcert.test"),
    "mta-sts.testing.test": policy("testing", "mx.elsewhere.test"),
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server: Any

    def do_GET(self) -> None:
        host = self.headers.get("Host", "").split(":")[0]
        with self.server.lock:
            self.server.hits.append(host)
        body = POLICIES.get(host)
        if body is None or self.path != "/.well-known/mta-sts.txt":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class PolicyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, ctx: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.ctx = ctx
        self.lock = threading.Lock()
        self.hits: list[str] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def finish_request(self, request: Any, client_address: Any) -> None:
        try:
            tls = self.ctx.wrap_socket(request, server_side=True)
        except OSError:
            return
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            tls.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class World:
    def __init__(self, relay: RelayProcess, up: Upstream, policies: PolicyServer) -> None:
        self.relay, self.up, self.policies = relay, up, policies


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("mtasts")
    ca = trustme.CA()
    ca_file = tmp / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    https = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(*POLICIES).configure_cert(https)
    policies = PolicyServer(https)
    # the MX host's certificate covers these names only (not mx.badcert.test)
    smtp_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("mx.good.test", "mx.wrongmx.test", "mx.testing.test").configure_cert(smtp_tls)
    up = Upstream(tls_context=smtp_tls).start()
    zones: dict[str, Any] = {}
    for domain in ("good.test", "wrongmx.test", "badcert.test", "testing.test"):
        zones[domain] = {"MX": [(10, f"mx.{domain}")]}
        zones[f"mx.{domain}"] = {"A": ["127.0.0.1"]}
        zones[f"_mta-sts.{domain}"] = {"TXT": ['"v=STSv1; id=20261203"']}
        zones[f"mta-sts.{domain}"] = {"A": ["127.0.0.1"]}
    with DnsServer(zones) as dns_:
        cfg = fast_config("2s")
        cfg["upstream"] = {
            "mode": "mx",
            "mx": {
                "port": up.port,
                "nameservers": [dns_.nameserver],
                "ca_file": str(ca_file),
                "mta_sts_port": policies.server_address[1],
            },
        }
        relay = RelayProcess(tmp / "relay", cfg).start()
        try:
            yield World(relay, up, policies)
        finally:
            relay.close()
            up.stop()
            policies.shutdown()
            policies.server_close()


def deferred_reply(r: RelayProcess, domain: str) -> str:
    def found() -> list[dict[str, Any]]:
        return [
            e for e in r.events() if e.get("event") == "deferred" and e.get("destination") == domain
        ]

    r.wait_until(lambda: bool(found()), timeout=20, what=f"mail to {domain} deferred")
    return str(found()[0]["reply"])


def test_enforce_with_a_listed_mx_delivers_over_verified_tls_and_caches(world: World) -> None:
    r = world.relay
    send(r.port, SENDER, ["a@good.test"], make_message(1))
    (got,) = world.up.wait_for(1, timeout=20)
    assert got.rcpt_tos == ["a@good.test"] and got.tls
    send(r.port, SENDER, ["b@good.test"], make_message(2))
    world.up.wait_for(2, timeout=20)
    assert world.policies.hits.count("mta-sts.good.test") == 1  # the cached policy
    assert (r.spool / "mta-sts.json").exists()  # kept over restarts


def test_enforce_refuses_an_mx_the_policy_does_not_list(world: World) -> None:
    r = world.relay
    send(r.port, SENDER, ["a@wrongmx.test"], make_message(3))
    reply = deferred_reply(r, "wrongmx.test")
    assert "4.7.5" in reply and "mx.wrongmx.test does not match" in reply
    assert not [m for m in world.up.received if "a@wrongmx.test" in m.rcpt_tos]
    assert r.metric('relay_mta_sts_failures_total{domain="wrongmx.test",reason="mx_mismatch"}')
    assert any(e.get("event") == "mta_sts_refused" for e in r.events())


def test_enforce_refuses_a_certificate_not_valid_for_the_mx(world: World) -> None:
    r = world.relay
    send(r.port, SENDER, ["a@badcert.test"], make_message(4))
    reply = deferred_reply(r, "badcert.test")
    assert "4.7.5" in reply and "MTA-STS" in reply and "mx.badcert.test" in reply
    assert not [m for m in world.up.received if "a@badcert.test" in m.rcpt_tos]
    assert r.metric('relay_mta_sts_failures_total{domain="badcert.test",reason="tls"}')


def test_testing_mode_delivers_and_logs_what_enforce_would_refuse(world: World) -> None:
    r = world.relay
    send(r.port, SENDER, ["a@testing.test"], make_message(5))
    r.wait_until(
        lambda: any("a@testing.test" in m.rcpt_tos for m in world.up.received),
        timeout=20,
        what="delivered under a testing policy",
    )
    logged = [e for e in r.events() if e.get("event") == "mta_sts_testing"]
    assert logged and "does not match" in str(logged[0]["msg"])


def test_the_policy_cache_file_is_valid_json(world: World, tmp_path: Path) -> None:
    """On its own: under xdist this module's tests may run in another process, each with a
    `world` of its own, so the policy is fetched here (a delivery to good.test)."""
    import json

    r = world.relay
    send(r.port, SENDER, ["c@good.test"], make_message(40))
    cache = r.spool / "mta-sts.json"

    def cached() -> bool:
        try:
            doc = json.loads(cache.read_text())
        except FileNotFoundError:
            return False
        return "good.test" in doc["policies"]  # valid JSON whenever it is there

    r.wait_until(cached, timeout=20, what="good.test's policy in mta-sts.json")
