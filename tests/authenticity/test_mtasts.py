"""MTA-STS (RFC 8461): the pure rules, then the resolver against a real loopback DNS server
(tests/dnsserver.py) and a real HTTPS policy server (trustme certificates)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme

from relay.authenticity.mtasts import (
    BODY_LIMIT,
    FAILURE_REASONS,
    MAX_AGE_LIMIT,
    MtaStsResolver,
    Policy,
    PolicyError,
    Verdict,
    check_mx,
    mx_matches,
    parse_policy,
    parse_txt,
    tls_failure_reason,
)
from relay.delivery.replies import Reply
from tests.dnsserver import DnsServer, dns_server  # noqa: F401  (pytest fixture)

DOMAIN = "example.test"
POLICY_HOST = f"mta-sts.{DOMAIN}"
TXT_NAME = f"_mta-sts.{DOMAIN}"
POLICY = "version: STSv1\nmode: enforce\nmx: mx1.example.test\nmx: *.backup.test\nmax_age: 86400\n"

# -- parse_policy -------------------------------------------------------------------------


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_parse_policy_lf_and_crlf(newline: str) -> None:
    text = newline.join(
        [
            "version: STSv1",
            "mode: enforce",
            "mx: MX1.Example.Test.",
            "mx: *.backup.test",
            "max_age: 604800",
        ]
    )
    policy = parse_policy(text + newline)
    assert policy == Policy("enforce", ("mx1.example.test", "*.backup.test"), 604800)
    assert (policy.id, policy.fetched_at, policy.domain) == ("", 0.0, "")


def test_parse_policy_keeps_id_and_time_when_given() -> None:
    policy = parse_policy(POLICY, id="abc", fetched_at=12.5, domain=DOMAIN)
    assert (policy.id, policy.fetched_at, policy.domain) == ("abc", 12.5, DOMAIN)
    assert policy.expires_at == 12.5 + 86400
    assert not policy.expired(12.5 + 86399) and policy.expired(12.5 + 86400)


def test_parse_policy_ignores_unknown_fields_blank_lines_and_spaces() -> None:
    text = "\n  version:STSv1\t\nfoo: bar\nmode:   testing\n\nmx: a.test\nmax_age: 0\nx-y: z"
    assert parse_policy(text) == Policy("testing", ("a.test",), 0)


def test_parse_policy_mode_none_needs_no_mx() -> None:
    assert parse_policy("version: STSv1\nmode: none\nmax_age: 86400\n") == Policy("none", (), 86400)


def test_parse_policy_max_age_limit_is_inclusive() -> None:
    text = f"version: STSv1\nmode: enforce\nmx: a.test\nmax_age: {MAX_AGE_LIMIT}"
    assert parse_policy(text).max_age == MAX_AGE_LIMIT


def _policy(**fields: str | None) -> str:
    base: dict[str, str | None] = {
        "version": "STSv1",
        "mode": "enforce",
        "mx": "mx.a.test",
        "max_age": "86400",
    }
    base.update(fields)
    return "\r\n".join(f"{k}: {v}" for k, v in base.items() if v is not None) + "\r\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_policy(version=None), "no version field"),
        (_policy(version="STSv2"), "not 'STSv1'"),
        (_policy(version="stsv1"), "not 'STSv1'"),
        (_policy(mode=None), "no mode field"),
        (_policy(mode="strict"), "not one of enforce, testing, none"),
        (_policy(mode="Enforce"), "not one of enforce, testing, none"),
        (_policy(mx=None), "mode enforce has no mx field"),
        (_policy(mode="testing", mx=None), "mode testing has no mx field"),
        (_policy(max_age=None), "no max_age field"),
        (_policy(max_age=str(MAX_AGE_LIMIT + 1)), "not an integer in 0..31557600"),
        (_policy(max_age="-1"), "not an integer"),
        (_policy(max_age="1e5"), "not an integer"),
        (_policy(max_age=""), "not an integer"),
        (_policy(mx="*.*.a.test"), "is not a domain name"),
        (_policy(mx="mx a.test"), "is not a domain name"),
        (_policy(mx=""), "is not a domain name"),
        (_policy() + "this line has no colon\r\n", "line 5 is not 'name: value'"),
        (_policy() + "mode: testing\r\n", "more than one mode"),
        ("", "no version field"),
    ],
)
def test_parse_policy_rejects(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(text)
    assert issubclass(PolicyError, ValueError)


# -- TXT records --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ("v=STSv1; id=20160831085700Z;", "20160831085700Z"),
        ("v=STSv1;id=abc", "abc"),
        ("v=STSv1; id=abc; ext_1=val-ue", "abc"),
        ("v=STSv1 ;\tid=A1 ; ", "A1"),
    ],
)
def test_parse_txt_good(record: str, expected: str) -> None:
    assert parse_txt(record) == expected


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("v=STSv2; id=abc", "does not start with v=STSv1"),
        ("id=abc; v=STSv1", "does not start with v=STSv1"),
        ("v=STSv1;", "no id"),
        ("v=STSv1; id=", "1-32 letters or digits"),
        ("v=STSv1; id=" + "a" * 33, "1-32 letters or digits"),
        ("v=STSv1; id=a-b", "1-32 letters or digits"),
        ("v=STSv1; id=a; id=b", "more than one id"),
        ("v=STSv1; id=a; junk", "not name=value"),
    ],
)
def test_parse_txt_bad(record: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_txt(record)


# -- mx_matches ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "host", "expected"),
    [
        ("mail.example.com", "mail.example.com", True),
        ("mail.example.com", "MAIL.Example.COM", True),
        ("Mail.Example.com.", "mail.example.com", True),
        ("mail.example.com", "mail.example.com.", True),
        ("mail.example.com", "mail2.example.com", False),
        ("mail.example.com", "a.mail.example.com", False),
        ("*.example.com", "mx1.example.com", True),
        ("*.example.com", "MX1.EXAMPLE.COM.", True),
        ("*.Example.Com.", "mx1.example.com", True),
        ("*.example.com", "example.com", False),  # the bare domain
        ("*.example.com", "a.b.example.com", False),  # two labels
        ("*.example.com", ".example.com", False),  # an empty label
        ("*.example.com", "mx1.example.org", False),
        ("*.example.com", "mx1example.com", False),
        ("*.example.com", "*.example.com", True),  # only a literal label "*"; harmless
        ("example.com", "*.example.com", False),
        ("*", "example.com", False),
        ("", "", False),
    ],
)
def test_mx_matches(pattern: str, host: str, expected: bool) -> None:
    assert mx_matches(pattern, host) is expected


# -- check_mx and the TLS failure reason --------------------------------------------------

ENFORCE = Policy("enforce", ("mx1.d.test", "*.pool.d.test"), 86400, "id1", 0.0, "d.test")


def test_check_mx_enforce_matching_requires_verified_tls() -> None:
    verdict = check_mx(ENFORCE, "A.Pool.D.Test.")
    assert verdict == Verdict(
        True,
        True,
        False,
        "MX host a.pool.d.test matches the MTA-STS policy of d.test: verified TLS required",
        "enforce",
    )


def test_check_mx_enforce_non_matching_is_refused() -> None:
    verdict = check_mx(ENFORCE, "mx2.d.test")
    assert not verdict.allowed and not verdict.log_only
    assert verdict.reason == (
        "MX host mx2.d.test does not match the MTA-STS policy of d.test"
        " (mx: mx1.d.test, *.pool.d.test)"
    )


def test_check_mx_testing_allows_and_logs_what_would_fail() -> None:
    testing = Policy("testing", ENFORCE.mx, 86400, "id1", 0.0, "d.test")
    miss = check_mx(testing, "mx2.d.test")
    assert (miss.allowed, miss.require_verified_tls, miss.log_only, miss.mode) == (
        True,
        False,
        True,
        "testing",
    )
    assert miss.reason == (
        "MTA-STS testing: MX host mx2.d.test does not match the MTA-STS policy of d.test"
        " (mx: mx1.d.test, *.pool.d.test); delivering anyway"
    )
    hit = check_mx(testing, "mx1.d.test")
    assert (hit.allowed, hit.require_verified_tls, hit.log_only) == (True, False, True)
    assert "enforce would require verified TLS" in hit.reason


@pytest.mark.parametrize(
    "policy", [None, Policy("none", (), 86400, "id1", 0.0, "d.test")], ids=["absent", "none"]
)
def test_check_mx_none_or_absent_allows_everything(policy: Policy | None) -> None:
    verdict = check_mx(policy, "anything.else.test")
    assert (verdict.allowed, verdict.require_verified_tls, verdict.log_only) == (
        True,
        False,
        False,
    )
    assert verdict.mode == "none"


def test_tls_failure_reason_for_a_certificate_error() -> None:
    cause = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] x")
    cause.verify_message = "certificate has expired"
    try:
        try:
            raise cause
        except ssl.SSLError as inner:
            raise ConnectionError("starttls failed") from inner
    except ConnectionError as outer:
        error = outer
    text = tls_failure_reason("D.test.", "MX.d.test", error)
    assert text == (
        "4.7.5 MTA-STS: certificate of mx.d.test not verified (certificate has expired);"
        " the policy of d.test requires it"
    )
    reply = Reply.parse(454, text)
    assert (reply.code, reply.enhanced) == (454, "4.7.5")
    assert reply.text.startswith("MTA-STS: certificate of mx.d.test")


def test_tls_failure_reason_for_another_error() -> None:
    text = tls_failure_reason("d.test", "mx.d.test", RuntimeError("server does not\nSTARTTLS"))
    assert text == (
        "4.7.5 MTA-STS: no verified TLS with mx.d.test (server does not STARTTLS);"
        " the policy of d.test requires it"
    )


# -- a real HTTPS policy server -----------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    good: trustme.LeafCert  # mta-sts.example.test, by our CA
    wrong_name: trustme.LeafCert  # another name, by our CA
    other_ca: trustme.LeafCert  # mta-sts.example.test, by a CA the resolver does not trust


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca, other = trustme.CA(), trustme.CA()
    ca_file = tmp_path_factory.mktemp("pki") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return Pki(
        ca_file,
        ca.issue_cert(POLICY_HOST),
        ca.issue_cert("mta-sts.other.test"),
        other.issue_cert(POLICY_HOST),
    )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: PolicyServer

    def finish_request(self, request: Any, client_address: Any) -> None:
        try:  # the TLS handshake in the request's thread, not in the accept loop
            tls = self.owner.context.wrap_socket(request, server_side=True)
        except OSError:
            return  # the client refused our certificate, or went away
        try:
            self.RequestHandlerClass(tls, client_address, self)  # type: ignore[arg-type]
        finally:
            tls.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up early (body too large) is expected


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection; the end of a body is EOF
    server: _Server

    def do_GET(self) -> None:
        owner = self.server.owner
        with owner.lock:
            owner.hits.append(self.path)
            owner.hosts.append(self.headers.get("Host", ""))
        self.send_response(owner.status)
        if owner.content_type is not None:
            self.send_header("Content-Type", owner.content_type)
        for name, value in owner.headers.items():
            self.send_header(name, value)
        if owner.send_length:
            self.send_header("Content-Length", str(len(owner.body)))
        self.end_headers()
        if owner.trickle:  # one byte at a time: no read times out, the whole fetch does
            for _ in range(100):
                self.wfile.write(b"\n")
                self.wfile.flush()
                time.sleep(0.02)
        self.wfile.write(owner.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class PolicyServer:
    """HTTPS on 127.0.0.1 (ephemeral port) answering every GET with the configured reply."""

    def __init__(self, cert: trustme.LeafCert) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(self.context)
        self.context.sni_callback = self._on_sni
        self.lock = threading.Lock()
        self.hits: list[str] = []
        self.hosts: list[str] = []
        self.sni: list[str | None] = []
        self.status = 200
        self.content_type: str | None = "text/plain"
        self.headers: dict[str, str] = {}
        self.body = POLICY.encode()
        self.send_length = True
        self.trickle = False
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def _on_sni(self, sslobj: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        with self.lock:
            self.sni.append(name)

    def use_cert(self, cert: trustme.LeafCert) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(context)
        self.context = context

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(5)
            self._httpd.server_close()


@pytest.fixture
def server(pki: Pki) -> Iterator[PolicyServer]:
    srv = PolicyServer(pki.good)
    yield srv
    srv.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


MakeResolver = Callable[..., MtaStsResolver]


@pytest.fixture
def make(
    dns_server: DnsServer,  # noqa: F811
    pki: Pki,
    server: PolicyServer,
    clock: Clock,
) -> MakeResolver:
    def make(**kwargs: Any) -> MtaStsResolver:
        args: dict[str, Any] = {
            "nameservers": [dns_server.nameserver],
            "timeout": 5.0,  # generous: a loaded 2-core CI machine
            "https_port": server.port,
            "ca_file": str(pki.ca_file),
            "connect_host": lambda host: "127.0.0.1",
            "clock": clock,
        }
        args.update(kwargs)
        return MtaStsResolver(**args)

    return make


def set_txt(dns: DnsServer, *records: str) -> None:
    dns.set_zone(TXT_NAME, {"TXT": [f'"{r}"' for r in records]})


@pytest.fixture
def txt(dns_server: DnsServer) -> DnsServer:  # noqa: F811
    set_txt(dns_server, "v=STSv1; id=v1;")
    return dns_server


# -- the resolver end to end --------------------------------------------------------------


async def test_policy_fetched_then_cached_while_the_id_is_unchanged(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, clock: Clock
) -> None:
    resolver = make()
    policy = await resolver.policy("Example.Test.")
    assert policy == Policy(
        "enforce", ("mx1.example.test", "*.backup.test"), 86400, "v1", clock.now, DOMAIN
    )
    # the name was spoken, not the address connected to: SNI, Host, certificate
    assert server.hits == ["/.well-known/mta-sts.txt"]
    assert server.sni == [POLICY_HOST]
    assert server.hosts == [f"{POLICY_HOST}:{server.port}"]

    clock.now += 3600
    assert await resolver.policy(DOMAIN) == policy
    assert len(server.hits) == 1  # same TXT id: no fetch
    assert txt.count(TXT_NAME, "TXT") == 2  # but the TXT record is checked each time
    assert resolver.fetches[DOMAIN] == 1 and not resolver.failures
    assert resolver.cached(DOMAIN) == policy


async def test_changed_id_refetches(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    resolver = make()
    first = await resolver.policy(DOMAIN)
    assert first is not None and first.mode == "enforce"
    server.body = b"version: STSv1\nmode: testing\nmx: mx9.example.test\nmax_age: 600\n"
    set_txt(txt, "v=STSv1; id=v2")
    second = await resolver.policy(DOMAIN)
    assert second is not None
    assert (second.id, second.mode, second.mx) == ("v2", "testing", ("mx9.example.test",))
    assert len(server.hits) == 2


async def test_max_age_expiry_refetches(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, clock: Clock
) -> None:
    resolver = make()
    await resolver.policy(DOMAIN)
    clock.now += 86399
    await resolver.policy(DOMAIN)
    assert len(server.hits) == 1
    clock.now += 1  # fetched_at + max_age: expired
    policy = await resolver.policy(DOMAIN)
    assert len(server.hits) == 2
    assert policy is not None and policy.fetched_at == clock.now


async def test_server_down_with_a_valid_cache_keeps_the_cached_policy(
    make: MakeResolver,
    server: PolicyServer,
    txt: DnsServer,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    resolver = make()
    cached = await resolver.policy(DOMAIN)
    server.stop()
    set_txt(txt, "v=STSv1; id=v2")  # a new id, but its policy cannot be fetched
    clock.now += 60
    with caplog.at_level(logging.WARNING, logger="relay.authenticity.mtasts"):
        assert await resolver.policy(DOMAIN) == cached
    assert resolver.failures == {(DOMAIN, "connect"): 1}
    assert "cannot connect" in resolver.last_failure[DOMAIN]
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "mta_sts_failure"]
    assert record.levelno == logging.WARNING
    assert "cached policy keeps applying" in record.getMessage()

    clock.now += 86400  # the cached policy expires: not used any more
    assert await resolver.policy(DOMAIN) is None


async def test_server_down_without_cache_is_no_policy_counted_and_backed_off(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, clock: Clock
) -> None:
    server.stop()
    resolver = make(failure_backoff=300.0)
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "connect"): 1}
    clock.now += 299
    assert await resolver.policy(DOMAIN) is None  # not tried again yet
    assert resolver.fetches[DOMAIN] == 1
    clock.now += 1
    assert await resolver.policy(DOMAIN) is None
    assert resolver.fetches[DOMAIN] == 2
    assert resolver.failures == {(DOMAIN, "connect"): 2}


async def test_a_new_id_is_tried_at_once_despite_the_backoff(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    server.status = 500
    resolver = make()
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "http_status"): 1}
    server.status = 200
    set_txt(txt, "v=STSv1; id=v2")
    policy = await resolver.policy(DOMAIN)
    assert policy is not None and policy.id == "v2"


@pytest.mark.parametrize(
    ("settings", "reason", "detail"),
    [
        ({"content_type": "text/html"}, "content_type", "not text/plain"),
        ({"content_type": None}, "content_type", "not text/plain"),
        ({"headers": {"Content-Encoding": "gzip"}}, "content_type", "gzip"),
        ({"status": 404}, "http_status", "HTTP 404"),
        ({"body": b"version: STSv1\nmode: x\n"}, "policy_invalid", "mode"),
        ({"body": b"\xff\xfe"}, "policy_invalid", "not UTF-8"),
        ({"body": b"x" * (BODY_LIMIT + 1)}, "too_large", "65537 bytes"),
        (
            {"body": b"x" * (BODY_LIMIT + 1), "send_length": False},
            "too_large",
            "body over 65536 bytes",
        ),
    ],
    ids=[
        "html",
        "no-content-type",
        "gzip",
        "404",
        "invalid",
        "not-utf8",
        "too-large",
        "too-large-no-length",
    ],
)
async def test_bad_answers_are_failures(
    make: MakeResolver,
    server: PolicyServer,
    txt: DnsServer,
    settings: dict[str, Any],
    reason: str,
    detail: str,
) -> None:
    for name, value in settings.items():
        setattr(server, name, value)
    resolver = make()
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, reason): 1}
    assert detail in resolver.last_failure[DOMAIN]
    assert reason in FAILURE_REASONS


async def test_content_type_parameters_are_accepted(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    server.content_type = "Text/Plain; charset=utf-8"
    server.send_length = False
    assert await make().policy(DOMAIN) is not None


async def test_a_policy_of_exactly_the_limit_is_read(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    server.body = POLICY.encode().ljust(BODY_LIMIT, b"\n")
    assert await make().policy(DOMAIN) is not None


async def test_redirect_is_not_followed(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    server.status = 301
    server.headers = {"Location": f"https://{POLICY_HOST}:{server.port}/elsewhere"}
    resolver = make()
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "redirect"): 1}
    assert server.hits == ["/.well-known/mta-sts.txt"]
    assert "/elsewhere" in resolver.last_failure[DOMAIN]


@pytest.mark.parametrize("which", ["other_ca", "wrong_name"])
async def test_unverified_certificate_is_a_failure(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, pki: Pki, which: str
) -> None:
    server.use_cert(getattr(pki, which))
    resolver = make()
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "tls"): 1}
    assert "certificate not verified" in resolver.last_failure[DOMAIN]
    assert server.hits == []


async def test_a_silent_server_times_out(make: MakeResolver, txt: DnsServer) -> None:
    with socket.socket() as silent:  # accepts TCP (backlog) but never speaks TLS
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        resolver = make(https_port=silent.getsockname()[1], timeout=0.3)
        assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "timeout"): 1}


async def test_a_trickling_server_hits_the_overall_deadline(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    server.trickle = True
    resolver = make(timeout=0.3)
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "timeout"): 1}
    assert "not complete within 0.3s" in resolver.last_failure[DOMAIN]


async def test_no_txt_record_is_no_policy_and_no_fetch(
    make: MakeResolver,
    server: PolicyServer,
    dns_server: DnsServer,  # noqa: F811
) -> None:
    resolver = make()
    assert await resolver.policy(DOMAIN) is None  # NXDOMAIN
    dns_server.set_zone(TXT_NAME, {"TXT": ['"v=spf1 -all"']})  # not an STS record
    assert await resolver.policy(DOMAIN) is None
    dns_server.set_zone(TXT_NAME, {"A": ["127.0.0.1"]})  # NODATA
    assert await resolver.policy(DOMAIN) is None
    assert server.hits == [] and not resolver.failures


async def test_txt_absent_keeps_a_valid_cached_policy(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, clock: Clock
) -> None:
    resolver = make()
    cached = await resolver.policy(DOMAIN)
    txt.set_zone(TXT_NAME, None)  # §5.1/§10.2: removing the record does not drop the policy
    clock.now += 86000
    assert await resolver.policy(DOMAIN) == cached
    clock.now += 400
    assert await resolver.policy(DOMAIN) is None
    assert len(server.hits) == 1


async def test_txt_lookup_failure_keeps_the_cache_and_is_counted(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    resolver = make()
    cached = await resolver.policy(DOMAIN)
    txt.set_zone(TXT_NAME, "SERVFAIL")
    assert await resolver.policy(DOMAIN) == cached
    assert resolver.failures == {(DOMAIN, "dns"): 1}
    assert await make().policy(DOMAIN) is None  # a resolver without the cached policy


@pytest.mark.parametrize(
    "records",
    [("v=STSv1; id=a", "v=STSv1; id=b"), ("v=STSv1; id=not-valid",)],
    ids=["two", "malformed"],
)
async def test_invalid_txt_is_no_policy(
    make: MakeResolver,
    server: PolicyServer,
    dns_server: DnsServer,  # noqa: F811
    records: tuple[str, ...],
) -> None:
    set_txt(dns_server, *records, "v=spf1 -all")
    resolver = make()
    assert await resolver.policy(DOMAIN) is None
    assert resolver.failures == {(DOMAIN, "txt_invalid"): 1}
    assert server.hits == []


async def test_txt_strings_of_one_record_are_joined(
    make: MakeResolver,
    server: PolicyServer,
    dns_server: DnsServer,  # noqa: F811
) -> None:
    dns_server.set_zone(TXT_NAME, {"TXT": ['"v=STSv1; " "id=split1"']})
    policy = await make().policy(DOMAIN)
    assert policy is not None and policy.id == "split1"


async def test_concurrent_calls_share_one_fetch(
    make: MakeResolver, server: PolicyServer, txt: DnsServer
) -> None:
    resolver = make()
    results = await asyncio.gather(*(resolver.policy(DOMAIN) for _ in range(5)))
    assert len(set(results)) == 1 and results[0] is not None
    assert len(server.hits) == 1


async def test_address_literal_and_bad_names_are_not_looked_up(
    make: MakeResolver,
    dns_server: DnsServer,  # noqa: F811
) -> None:
    resolver = make()
    for domain in ("[127.0.0.1]", "[IPv6:::1]", "", ".", "a..b"):
        assert await resolver.policy(domain) is None
    assert dns_server.query_count == 0


# -- the cache file -----------------------------------------------------------------------


async def test_cache_file_survives_a_new_resolver(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, clock: Clock, tmp_path: Path
) -> None:
    path = tmp_path / "state" / "mta-sts.json"
    policy = await make(cache_path=path).policy(DOMAIN)
    assert policy is not None
    doc = json.loads(path.read_text())
    assert doc == {
        "version": 1,
        "policies": {
            DOMAIN: {
                "mode": "enforce",
                "mx": ["mx1.example.test", "*.backup.test"],
                "max_age": 86400,
                "id": "v1",
                "fetched_at": clock.now,
            }
        },
    }
    assert [p.name for p in path.parent.iterdir()] == ["mta-sts.json"]  # no temporary left

    restarted = make(cache_path=path)
    assert restarted.cached(DOMAIN) == policy
    assert await restarted.policy(DOMAIN) == policy
    assert len(server.hits) == 1  # same id: the file's policy, no fetch

    server.stop()  # the policy host and the TXT record gone: the cached policy still applies
    txt.set_zone(TXT_NAME, None)
    assert await make(cache_path=path).policy(DOMAIN) == policy

    clock.now += 86400  # expired entries are not loaded
    assert make(cache_path=path).cached(DOMAIN) is None


async def test_corrupt_cache_file_is_ignored_and_rewritten(
    make: MakeResolver,
    server: PolicyServer,
    txt: DnsServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "mta-sts.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="relay.authenticity.mtasts"):
        resolver = make(cache_path=path)
    assert any(getattr(r, "event", "") == "mta_sts_cache" for r in caplog.records)
    assert await resolver.policy(DOMAIN) is not None
    assert DOMAIN in json.loads(path.read_text())["policies"]


async def test_bad_cache_entries_are_skipped(
    make: MakeResolver, tmp_path: Path, clock: Clock
) -> None:
    path = tmp_path / "mta-sts.json"
    good = {"mode": "testing", "mx": ["a.test"], "max_age": 600, "id": "x", "fetched_at": clock.now}
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "policies": {
                    "good.test": good,
                    "badmode.test": {**good, "mode": "strict"},
                    "badage.test": {**good, "max_age": -1},
                    "badmx.test": {**good, "mx": "a.test"},
                    "nodict.test": 3,
                },
            }
        )
    )
    resolver = make(cache_path=path)
    assert resolver.cached("good.test") == Policy(
        "testing", ("a.test",), 600, "x", clock.now, "good.test"
    )
    for name in ("badmode.test", "badage.test", "badmx.test", "nodict.test"):
        assert resolver.cached(name) is None


async def test_unwritable_cache_is_counted_but_the_policy_is_used(
    make: MakeResolver, server: PolicyServer, txt: DnsServer, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    resolver = make(cache_path=blocker / "mta-sts.json")  # its folder is a file
    assert await resolver.policy(DOMAIN) is not None
    assert resolver.failures == {(DOMAIN, "cache_write"): 1}
