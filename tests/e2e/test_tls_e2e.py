"""Outbound TLS end to end, with real certificates (trustme): verified STARTTLS and implicit
TLS to the smarthost, refusal of a certificate from another CA and of a missing STARTTLS
(deferred, never bounced: an operator problem), opportunistic unverified STARTTLS in MX mode,
and AUTH PLAIN/LOGIN over STARTTLS."""

from __future__ import annotations

import smtplib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session

from tests.dnsserver import DnsServer
from tests.harness import RelayProcess, Upstream, deep_merge, make_message, send, server_context

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
RCPT = "user@example.org"

FAST: dict[str, Any] = {
    "retry": {"schedule": ["1s"], "max_age": "1h", "min_delay": "0.2s"},
    "destinations": {"*": {"command_timeout": "2s", "data_timeout": "2s", "connect_timeout": "2s"}},
}


def smarthost(up: Upstream, **settings: Any) -> dict[str, Any]:
    return deep_merge(
        FAST,
        {
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": up.port, **settings},
            }
        },
    )


def recipient(r: RelayProcess, address: str = RCPT) -> dict[str, Any]:
    for m in r.queue():
        for rc in m["recipients"]:
            if rc["address"] == address:
                return {**rc, "queue_id": m["id"]}
    raise AssertionError(f"{address} is not in the queue")


def wait_delivered(r: RelayProcess, address: str = RCPT) -> dict[str, Any]:
    r.wait_until(
        lambda: r.recipient_states().get(address) == "delivered", what=f"{address} delivered"
    )
    return recipient(r, address)


def config_errors(r: RelayProcess) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == "upstream_config_error"]


# --- smarthost ---------------------------------------------------------------------------


def test_starttls_verified_with_ca_file(upstream, relay, ca, ca_file) -> None:
    up = upstream(tls_context=server_context(ca), require_starttls=True)
    r = relay(config=smarthost(up, tls="starttls", ca_file=str(ca_file), verify=True))
    assert send(r.port, SENDER, [RCPT], make_message(1)) == {}

    wait_delivered(r)
    got = up.wait_for(1)
    assert got[0].tls is True
    assert got[0].rcpt_tos == [RCPT]
    assert config_errors(r) == []


def test_starttls_certificate_from_other_ca_is_deferred(upstream, relay, ca_file) -> None:
    other = trustme.CA()  # the upstream's certificate is not signed by the configured CA
    up = upstream(tls_context=server_context(other))
    r = relay(config=smarthost(up, tls="starttls", ca_file=str(ca_file), verify=True))
    assert send(r.port, SENDER, [RCPT], make_message(2)) == {}

    r.wait_until(lambda: recipient(r)["attempts"] >= 2, what="two attempts")
    rc = recipient(r)
    assert rc["state"] in ("deferred", "sending")  # kept: never bounced, never failed
    assert rc["last_reply"].startswith("454 4.7.5")
    assert "certificate" in rc["last_reply"].lower()
    errs = config_errors(r)
    assert errs and errs[0]["level"] == "error"
    assert "certificate" in errs[0]["reply"].lower()
    assert up.received == []
    assert r.cli_json("suppression", "list") == []
    assert not [e for e in r.events() if e.get("event") == "dead_letter"]


def test_starttls_required_but_not_offered_is_deferred(upstream, relay, ca_file) -> None:
    up = upstream()  # plain text only: no STARTTLS in its EHLO reply
    r = relay(config=smarthost(up, tls="starttls", ca_file=str(ca_file), verify=True))
    assert send(r.port, SENDER, [RCPT], make_message(3)) == {}

    r.wait_until(lambda: recipient(r)["attempts"] >= 1, what="an attempt")
    rc = recipient(r)
    assert rc["state"] in ("deferred", "sending")
    assert "STARTTLS" in rc["last_reply"]
    assert config_errors(r)
    assert up.received == [] and up.commands == []  # never sent mail in the clear


def test_implicit_tls(upstream, relay, ca, ca_file) -> None:
    up = upstream(tls_context=server_context(ca), implicit_tls=True)
    r = relay(config=smarthost(up, tls="implicit", ca_file=str(ca_file), verify=True))
    assert send(r.port, SENDER, [RCPT], make_message(4)) == {}

    wait_delivered(r)
    got = up.wait_for(1)
    assert got[0].rcpt_tos == [RCPT]
    # aiosmtpd only fills session.ssl after STARTTLS, so Received.tls cannot tell here; the
    # port itself proves it: it speaks TLS from the first byte, a plain-text client gets
    # no greeting
    with pytest.raises((smtplib.SMTPException, OSError)):
        smtplib.SMTP("127.0.0.1", up.port, timeout=2).quit()


def test_implicit_tls_certificate_from_other_ca_is_deferred(upstream, relay, ca_file) -> None:
    up = upstream(tls_context=server_context(trustme.CA()), implicit_tls=True)
    r = relay(config=smarthost(up, tls="implicit", ca_file=str(ca_file), verify=True))
    assert send(r.port, SENDER, [RCPT], make_message(5)) == {}

    r.wait_until(lambda: recipient(r)["attempts"] >= 1, what="an attempt")
    rc = recipient(r)
    assert rc["state"] in ("deferred", "sending")
    assert rc["last_reply"].startswith("454 4.7.5")
    assert config_errors(r)
    assert up.received == []


# --- AUTH over STARTTLS ------------------------------------------------------------------


@dataclass
class AuthUpstream(Upstream):
    """The harness upstream, offering only `mechanisms` and recording the one used."""

    mechanisms: tuple[str, ...] = ("PLAIN", "LOGIN")
    used: list[str] = field(default_factory=list)

    def _protocol(self) -> SMTP:
        proto = super()._protocol()
        methods: dict[str, Any] = proto._auth_methods
        for name in list(methods):
            if name not in self.mechanisms:
                del methods[name]
        return proto

    def _authenticate(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        mechanism: str,
        auth_data: Any,
    ) -> AuthResult:
        self.used.append(mechanism)
        return super()._authenticate(server, session, envelope, mechanism, auth_data)


@pytest.fixture
def auth_upstream() -> Iterator[Callable[..., AuthUpstream]]:
    made: list[AuthUpstream] = []

    def factory(**kwargs: Any) -> AuthUpstream:
        up = AuthUpstream(**kwargs).start()
        made.append(up)
        return up

    yield factory
    for up in made:
        up.stop()


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_auth_over_starttls(
    auth_upstream, relay, ca, ca_file, tmp_path: Path, mechanism: str
) -> None:
    up = auth_upstream(
        tls_context=server_context(ca),
        auth={"relayuser": "s3cret-pass"},
        mechanisms=(mechanism,),
    )
    pw = tmp_path / "smarthost.password"
    pw.write_text("s3cret-pass\n")
    r = relay(
        config=smarthost(
            up, tls="starttls", ca_file=str(ca_file), username="relayuser", password_file=str(pw)
        )
    )
    assert send(r.port, SENDER, [RCPT], make_message(6)) == {}

    wait_delivered(r)
    got = up.wait_for(1)
    assert got[0].auth == "relayuser"
    assert got[0].tls is True
    assert up.used == [mechanism]
    assert "s3cret-pass" not in r.logs()
    check = r.cli("check-config")
    assert check.returncode == 0 and "s3cret-pass" not in check.stdout + check.stderr


# --- MX mode: opportunistic, unverified ----------------------------------------------------


def test_mx_opportunistic_starttls_accepts_untrusted_certificate(upstream, relay) -> None:
    untrusted = trustme.CA()  # nobody trusts this CA, and the name does not match either
    up = upstream(host="127.0.0.2", tls_context=server_context(untrusted, "elsewhere.test"))
    with DnsServer(
        {"tls.test": {"MX": [(10, "mx.tls.test")]}, "mx.tls.test": {"A": ["127.0.0.2"]}}
    ) as dns:
        r = relay(
            config=deep_merge(
                FAST,
                {
                    "upstream": {
                        "mode": "mx",
                        "mx": {
                            "nameservers": [dns.nameserver],
                            "port": up.port,
                            "tls": "opportunistic",
                        },
                    }
                },
            )
        )
        assert send(r.port, SENDER, ["user@tls.test"], make_message(7)) == {}
        wait_delivered(r, "user@tls.test")
    got = up.wait_for(1)
    assert got[0].tls is True
    assert got[0].rcpt_tos == ["user@tls.test"]
    assert config_errors(r) == []
