"""Amazon SNS signatures on /feedback/ses (relay/feedback/sns.py): AWS's own signed sample
message and certificate (tests/data/README.md), messages signed here with a key of our own
whose certificate a real HTTPS server on loopback serves (trustme CA), the certificate URL
rules, and one daemon that checks them end to end."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import http.client
import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID

from relay.config.tree import ConfigError, from_mapping
from relay.feedback import sns
from relay.feedback.providers import SignatureError
from tests.harness import (
    RelayProcess,
    Upstream,
    deep_merge,
    fast_config,
    server_context,
    smarthost_config,
)

DATA = Path(__file__).parents[1] / "data"
UTC = dt.UTC


# --- AWS's own sample -----------------------------------------------------------------------


def aws_sample() -> tuple[dict[str, Any], x509.Certificate]:
    doc = json.loads((DATA / "aws-sns-sample-message.json").read_text())
    cert = x509.load_pem_x509_certificate((DATA / "aws-sns-sample-cert.pem").read_bytes())
    return doc, cert


WHILE_VALID = dt.datetime(2015, 9, 20, 2, 0, tzinfo=UTC)  # the sample certificate's lifetime


def test_aws_signed_sample_verifies() -> None:
    doc, cert = aws_sample()
    sns.verify(doc, cert, now=WHILE_VALID)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("Message", "boo!"),
        ("Subject", "this is cooked"),
        ("TopicArn", "arn:aws:sns:x"),
        ("Type", "Notification "),
    ],
)
def test_aws_sample_with_any_signed_field_changed_fails(field: str, value: str) -> None:
    doc, cert = aws_sample()
    doc[field] = value
    with pytest.raises(SignatureError):
        sns.verify(doc, cert, now=WHILE_VALID)


def test_aws_sample_unsigned_fields_may_change() -> None:
    doc, cert = aws_sample()
    doc["UnsubscribeURL"] = "https://example.invalid/"  # not part of the signed text
    sns.verify(doc, cert, now=WHILE_VALID)


def test_aws_sample_after_its_certificate_expired_fails() -> None:
    doc, cert = aws_sample()
    with pytest.raises(SignatureError, match="not valid now"):
        sns.verify(doc, cert)  # 2016-08-21 is long gone


def test_string_to_sign_fields_and_order() -> None:
    note = {
        "Type": "Notification",
        "MessageId": "m",
        "TopicArn": "t",
        "Message": "x\ny",
        "Timestamp": "ts",
        "Subject": "s",
        "UnsubscribeURL": "u",
    }
    assert sns.string_to_sign(note) == (
        b"Message\nx\ny\nMessageId\nm\nSubject\ns\nTimestamp\nts\nTopicArn\nt\nType\nNotification\n"
    )
    del note["Subject"]  # no Subject: not signed at all (not an empty one)
    assert b"Subject" not in sns.string_to_sign(note)
    conf = {
        "Type": "SubscriptionConfirmation",
        "MessageId": "m",
        "TopicArn": "t",
        "Message": "x",
        "Timestamp": "ts",
        "Token": "k",
        "SubscribeURL": "https://s",
    }
    assert sns.string_to_sign(conf) == (
        b"Message\nx\nMessageId\nm\nSubscribeURL\nhttps://s\nTimestamp\nts\nToken\nk\n"
        b"TopicArn\nt\nType\nSubscriptionConfirmation\n"
    )
    del conf["Token"]
    with pytest.raises(SignatureError, match="Token is missing"):
        sns.string_to_sign(conf)
    with pytest.raises(SignatureError, match="no SNS message Type"):
        sns.string_to_sign({"Type": "Other"})


# --- messages signed here ---------------------------------------------------------------------


class Signer:
    def __init__(self, days: int = 30) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sns.test")])
        now = dt.datetime.now(UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=days))
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def sign(self, doc: dict[str, Any], version: str = "2") -> dict[str, Any]:
        algorithm = hashes.SHA1() if version == "1" else hashes.SHA256()
        sig = self.key.sign(sns.string_to_sign(doc), padding.PKCS1v15(), algorithm)
        return {**doc, "SignatureVersion": version, "Signature": base64.b64encode(sig).decode()}


def notification(message: str, cert_url: str) -> dict[str, Any]:
    return {
        "Type": "Notification",
        "MessageId": "5f8e3c1a-0000-4000-8000-000000000001",
        "TopicArn": "arn:aws:sns:eu-west-1:123456789012:ses-feedback",
        "Message": message,
        "Timestamp": "2026-12-04T09:00:00.000Z",
        "SigningCertURL": cert_url,
        "UnsubscribeURL": "https://sns.eu-west-1.amazonaws.com/?Action=Unsubscribe",
    }


@pytest.mark.parametrize("version", ["1", "2"])
def test_both_signature_versions(version: str) -> None:
    s = Signer()
    doc = s.sign(notification("hello", "https://x/a.pem"), version)
    sns.verify(doc, s.cert)
    other = "2" if version == "1" else "1"  # the same bytes claimed under the other hash
    with pytest.raises(SignatureError, match="does not match"):
        sns.verify({**doc, "SignatureVersion": other}, s.cert)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SignatureVersion": "3"}, "unknown SNS SignatureVersion '3'"),
        ({"SignatureVersion": None}, "unknown SNS SignatureVersion None"),
        ({"Signature": "***"}, "not base64"),
        ({"Signature": None}, "no Signature"),
        ({"Signature": base64.b64encode(b"x" * 256).decode()}, "does not match"),
    ],
)
def test_bad_signatures(change: dict[str, Any], message: str) -> None:
    s = Signer()
    doc = {**s.sign(notification("hello", "https://x/a.pem")), **change}
    with pytest.raises(SignatureError, match=message):
        sns.verify(doc, s.cert)


def test_someone_elses_certificate_does_not_verify() -> None:
    doc = Signer().sign(notification("hello", "https://x/a.pem"))
    with pytest.raises(SignatureError, match="does not match"):
        sns.verify(doc, Signer().cert)


# --- where the certificate may come from ---------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-bb750dd4.pem",
        "https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-1.pem",
        "https://SNS.EU-WEST-1.AMAZONAWS.COM/x.pem",
    ],
)
def test_aws_certificate_urls_are_accepted(url: str) -> None:
    sns.check_cert_url(url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://sns.us-east-1.amazonaws.com/x.pem", "plain https"),
        ("https://u:p@sns.us-east-1.amazonaws.com/x.pem", "plain https"),
        ("https://sns.us-east-1.amazonaws.com.evil.test/x.pem", "not sns.<region>"),
        ("https://evil.test/sns.us-east-1.amazonaws.com/x.pem", "not sns.<region>"),
        ("https://sqs.us-east-1.amazonaws.com/x.pem", "not sns.<region>"),
        ("https://sns..amazonaws.com/x.pem", "not sns.<region>"),
        ("https://sns.us_east.amazonaws.com/x.pem", "not sns.<region>"),
        ("https://sns.us-east-1.amazonaws.com:8443/x.pem", "not sns.<region>"),
        ("https://sns.us-east-1.amazonaws.com/x.pem?redirect=1", "a .pem file"),
        ("https://sns.us-east-1.amazonaws.com/x.crt", "a .pem file"),
        ("https://sns.us-east-1.amazonaws.com:x/x.pem", "not a URL"),
        ("https://127.0.0.1:4443/x.pem", "not sns.<region>"),
    ],
)
def test_other_certificate_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(SignatureError, match=message):
        sns.check_cert_url(url)


def test_listed_hosts_are_accepted_exactly() -> None:
    sns.check_cert_url("https://127.0.0.1:4443/x.pem", ("127.0.0.1:4443",))
    with pytest.raises(SignatureError):
        sns.check_cert_url("https://127.0.0.1:4444/x.pem", ("127.0.0.1:4443",))


# --- fetching over real HTTPS ----------------------------------------------------------------


class CertServer:
    """An HTTPS server on loopback (trustme certificate) serving `files`; counts requests."""

    def __init__(self, ca: trustme.CA, files: dict[str, tuple[int, bytes]]) -> None:
        self.files = files
        self.hits = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                status, body = outer.files.get(self.path, (404, b"not found"))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = server_context(ca)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"https://{self.host}{path}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def serving(
    ca: trustme.CA, files: Callable[[Signer], dict[str, tuple[int, bytes]]]
) -> Iterator[tuple[CertServer, Signer]]:
    """A signer of our own and a CertServer serving `files(signer)`, stopped after."""
    s = Signer()
    server = CertServer(ca, files(s))
    try:
        yield server, s
    finally:
        server.stop()


@pytest.fixture
def served(ca: trustme.CA) -> Iterator[tuple[CertServer, Signer]]:
    with serving(ca, lambda s: {"/cert.pem": (200, s.pem), "/junk.pem": (200, b"junk")}) as sv:
        yield sv


async def test_cache_fetches_each_certificate_once(
    served: tuple[CertServer, Signer], ca_file: Path
) -> None:
    server, s = served
    cache = sns.CertCache(ca_file)
    first, second = await asyncio.gather(
        cache.get(server.url("/cert.pem")), cache.get(server.url("/cert.pem"))
    )
    third = await cache.get(server.url("/cert.pem"))
    assert first == second == third == s.cert
    assert server.hits <= 2 and cache.fetches <= 2  # the two at once may both fetch
    await cache.get(server.url("/cert.pem"))
    assert cache.fetches == server.hits  # and never again


async def test_fetch_failures(served: tuple[CertServer, Signer], ca_file: Path) -> None:
    server, _s = served
    cache = sns.CertCache(ca_file)
    with pytest.raises(sns.CertFetchError, match="HTTP 404"):
        await cache.get(server.url("/missing.pem"))
    with pytest.raises(SignatureError, match="not a PEM certificate"):
        await cache.get(server.url("/junk.pem"))
    # the system's trust store does not know the test CA: a TLS failure, transient
    with pytest.raises(sns.CertFetchError):
        await sns.CertCache(None).get(server.url("/cert.pem"))
    server.stop()
    with pytest.raises(sns.CertFetchError):
        await cache.get(server.url("/cert.pem"))


# --- the daemon ---------------------------------------------------------------------------------

TOKEN = "token-ses-sns-0123456789"


def post(relay: RelayProcess, body: bytes) -> tuple[int, bytes]:
    auth = base64.b64encode(f"ses:{TOKEN}".encode()).decode()
    c = http.client.HTTPConnection("127.0.0.1", relay.admin_port, timeout=15)
    c.request(
        "POST",
        "/feedback/ses",
        body=body,
        headers={"Content-Type": "text/plain", "Authorization": f"Basic {auth}"},
    )
    resp = c.getresponse()
    out = (resp.status, resp.read())
    c.close()
    return out


@pytest.mark.slow
def test_daemon_checks_sns_signatures(
    served: tuple[CertServer, Signer], ca_file: Path, tmp_path: Path
) -> None:
    server, s = served
    up = Upstream().start()
    (tmp_path / "ses.token").write_text(TOKEN + "\n")
    ses = {
        "token_file": str(tmp_path / "ses.token"),
        "verify_signatures": True,
        "signing_cert_hosts": [server.host],
        "signing_cert_ca_file": str(ca_file),
    }
    cfg = deep_merge(fast_config("2s"), smarthost_config(up, feedback={"providers": {"ses": ses}}))
    relay = RelayProcess(tmp_path / "relay", cfg).start()
    try:
        bounce = json.dumps(
            {
                "notificationType": "Bounce",
                "bounce": {
                    "bounceType": "Permanent",
                    "bouncedRecipients": [{"emailAddress": "nobody-we-sent-to@example.org"}],
                },
                "mail": {"messageId": "0100018c-unknown", "destination": []},
            }
        )
        good = s.sign(notification(bounce, server.url("/cert.pem")))
        status, body = post(relay, json.dumps(good).encode())
        assert status == 202, body  # verified, parsed, matched no recipient of ours
        status, body = post(relay, json.dumps({**good, "MessageId": "another"}).encode())
        assert status == 401 and b"does not match" in body
        assert server.hits == 1  # the certificate was fetched once
        status, body = post(relay, bounce.encode())  # raw message delivery: nothing signed
        assert status == 401 and b"raw message delivery" in body
        aws_url = {**good, "SigningCertURL": "https://sns.evil.test/cert.pem"}
        status, body = post(relay, json.dumps(aws_url).encode())
        assert status == 401 and b"SigningCertURL host" in body
        server.stop()  # a certificate not yet fetched, and its server down: SNS retries
        gone = s.sign(notification(bounce, server.url("/other.pem")))
        status, body = post(relay, json.dumps(gone).encode())
        assert status == 503 and b"cannot check the signature now" in body
        refused = [e for e in relay.events() if e.get("event") == "feedback_refused"]
        assert len(refused) == 3
        deferred = [e for e in relay.events() if e.get("event") == "feedback_deferred"]
        assert len(deferred) == 1
    finally:
        relay.close()
        up.stop()


# --- configuration ------------------------------------------------------------------------------


def ses_config(tmp_path: Path, **ses: object) -> dict[str, Any]:
    (tmp_path / "t").write_text("token\n")
    return {"feedback": {"providers": {"ses": {"token_file": str(tmp_path / "t"), **ses}}}}


def test_config_keys(tmp_path: Path, ca_file: Path) -> None:
    off = from_mapping(ses_config(tmp_path), tmp_path)
    assert not off.feedback.providers["ses"].verify_signatures
    assert any("ses: verify_signatures is off" in w for w in off.warnings())
    on = from_mapping(
        ses_config(
            tmp_path,
            verify_signatures=True,
            signing_cert_hosts=["Certs.Example.test:8443"],
            signing_cert_ca_file=str(ca_file),
        ),
        tmp_path,
    )
    ses = on.feedback.providers["ses"]
    assert ses.verify_signatures and ses.signing_cert_hosts == ("certs.example.test:8443",)
    assert ses.signing_cert_ca_file == ca_file
    assert not any("ses:" in w for w in on.warnings())


@pytest.mark.parametrize(
    ("ses", "message"),
    [
        ({"verify_signatures": "yes"}, "verify_signatures: expected true or false"),
        ({"verify_signatures": True, "signing_cert_hosts": "h"}, "a list of host or host:port"),
        ({"verify_signatures": True, "signing_cert_ca_file": "nope.pem"}, "is not a file"),
        ({"signing_cert_hosts": ["h"]}, "need verify_signatures: true"),
    ],
)
def test_config_errors(tmp_path: Path, ses: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(ses_config(tmp_path, **ses), tmp_path)


def test_other_providers_have_no_sns_keys(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("token\n")
    cfg = {
        "feedback": {
            "providers": {
                "postmark": {"token_file": str(tmp_path / "t"), "verify_signatures": True}
            }
        }
    }
    with pytest.raises(ConfigError, match="verify_signatures"):
        from_mapping(cfg, tmp_path)


# What a mutation run of the then new code found unpinned (tests/MUTANTS.md, "New code, spot
# check"; until issue 28 in tests/test_mutants_new_code.py).
# --- relay/feedback/sns.py -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "https://u@sns.us-east-1.amazonaws.com/x.pem",
            "SigningCertURL must be a plain https URL: 'https://u@sns.us-east-1.amazonaws.com/x.pem'",
        ),
        (
            "https://evil.test/x.pem",
            "SigningCertURL host 'evil.test' is not sns.<region>.amazonaws.com"
            " (nor in signing_cert_hosts)",
        ),
        (
            "https://sns/x.pem",
            "SigningCertURL host 'sns' is not sns.<region>.amazonaws.com"
            " (nor in signing_cert_hosts)",
        ),
        (
            "https://x/" + "a" * 300 + ".crt",
            "SigningCertURL must name a .pem file: " + repr(("https://x/" + "a" * 300)[:200]),
        ),
    ],
)
def test_certificate_url_refusal_texts(url: str, message: str) -> None:
    with pytest.raises(SignatureError) as raised:
        sns.check_cert_url(url)
    assert str(raised.value) == message


def test_a_listed_host_without_a_port() -> None:
    sns.check_cert_url("https://certs.internal.test/x.pem", ("certs.internal.test",))


def test_string_to_sign_needs_a_type_string() -> None:
    with pytest.raises(SignatureError, match="no SNS message Type"):
        sns.string_to_sign({"Type": ["Notification"]})
    with pytest.raises(SignatureError, match="unknown SNS SignatureVersion"):
        sns.verify({"SignatureVersion": 2}, Signer().cert)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"Signature": None}, "no Signature in the SNS message"),
        ({"Signature": "***"}, "the SNS Signature is not base64"),
        ({"Signature": "AAAA"}, "the SNS signature does not match the message"),
    ],
)
def test_signature_refusal_texts(change: dict[str, object], message: str) -> None:
    s = Signer()
    doc = {
        **s.sign(
            {
                "Type": "Notification",
                "MessageId": "m",
                "TopicArn": "t",
                "Message": "x",
                "Timestamp": "ts",
            }
        ),
        **change,
    }
    with pytest.raises(SignatureError) as raised:
        sns.verify(doc, s.cert)
    assert str(raised.value) == message


@pytest.fixture
def big_pem_server(ca: trustme.CA) -> Iterator[tuple[CertServer, Signer]]:
    # text before the PEM block is allowed and makes the body arrive in several chunks
    with serving(
        ca,
        lambda s: {
            "/padded.pem": (200, b"# " + b"p" * 40_000 + b"\n" + s.pem),
            "/huge.pem": (200, b"#" * (sns.MAX_CERT + 1) + s.pem),
        },
    ) as sv:
        yield sv


async def test_a_certificate_in_several_chunks_and_one_too_large(
    big_pem_server: tuple[CertServer, Signer], ca_file: Path
) -> None:
    server, s = big_pem_server
    cache = sns.CertCache(ca_file)
    assert await cache.get(server.url("/padded.pem")) == s.cert
    with pytest.raises(SignatureError) as raised:
        await cache.get(server.url("/huge.pem"))
    assert str(raised.value) == f"{server.url('/huge.pem')}: more than {sns.MAX_CERT} octets"


def test_more_certificate_url_texts() -> None:
    long_path = "https://u@sns.us-east-1.amazonaws.com/" + "a" * 300 + ".pem"
    with pytest.raises(SignatureError) as raised:
        sns.check_cert_url(long_path)
    assert str(raised.value) == f"SigningCertURL must be a plain https URL: {long_path[:200]!r}"
    bad_port = "https://sns.us-east-1.amazonaws.com:x/" + "a" * 300 + ".pem"
    with pytest.raises(SignatureError) as raised:
        sns.check_cert_url(bad_port)
    assert str(raised.value) == f"SigningCertURL is not a URL: {bad_port[:200]!r}"
    with pytest.raises(SignatureError) as raised:
        sns.check_cert_url("https:///x.pem")
    assert str(raised.value) == (
        "SigningCertURL host '' is not sns.<region>.amazonaws.com (nor in signing_cert_hosts)"
    )


def test_an_unhashable_signature_version_is_refused() -> None:
    with pytest.raises(SignatureError, match="unknown SNS SignatureVersion"):
        sns.verify({"SignatureVersion": ["1"]}, Signer().cert)


def test_certificate_validity_is_inclusive_and_its_texts() -> None:
    s = Signer()
    doc = s.sign(
        {
            "Type": "Notification",
            "MessageId": "m",
            "TopicArn": "t",
            "Message": "x",
            "Timestamp": "ts",
        }
    )
    sns.verify(doc, s.cert, now=s.cert.not_valid_before_utc)
    sns.verify(doc, s.cert, now=s.cert.not_valid_after_utc)
    with pytest.raises(SignatureError) as raised:
        sns.verify(doc, s.cert, now=s.cert.not_valid_after_utc + dt.timedelta(seconds=1))
    assert str(raised.value) == "the SNS signing certificate is not valid now"
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ec.test")])
    now = dt.datetime.now(dt.UTC)
    ec_cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(SignatureError) as raised:
        sns.verify(doc, ec_cert)
    assert str(raised.value) == "the SNS signing certificate does not hold an RSA key"


@pytest.fixture
def many_server(ca: trustme.CA) -> Iterator[tuple[CertServer, Signer]]:
    def files(s: Signer) -> dict[str, tuple[int, bytes]]:
        out = {f"/c{i}.pem": (200, s.pem) for i in range(sns.CACHE_SIZE + 1)}
        out["/exact.pem"] = (200, s.pem + b"#" * (sns.MAX_CERT - len(s.pem)))
        return out

    with serving(ca, files) as sv:
        yield sv


async def test_the_cache_keeps_the_32_most_recent(
    many_server: tuple[CertServer, Signer], ca_file: Path
) -> None:
    server, _s = many_server
    cache = sns.CertCache(ca_file)
    for i in range(sns.CACHE_SIZE + 1):
        await cache.get(server.url(f"/c{i}.pem"))
    assert server.hits == sns.CACHE_SIZE + 1
    await cache.get(server.url("/c1.pem"))  # the oldest still kept
    await cache.get(server.url(f"/c{sns.CACHE_SIZE}.pem"))  # the newest
    assert server.hits == sns.CACHE_SIZE + 1
    await cache.get(server.url("/c0.pem"))  # the one that made room
    assert server.hits == sns.CACHE_SIZE + 2


async def test_a_certificate_of_exactly_the_limit_and_a_fetch_error_text(
    many_server: tuple[CertServer, Signer], ca_file: Path
) -> None:
    server, s = many_server
    cache = sns.CertCache(ca_file)
    assert await cache.get(server.url("/exact.pem")) == s.cert
    gone = server.url("/c0.pem")
    server.stop()
    with pytest.raises(sns.CertFetchError) as raised:
        await cache.get(gone)
    assert str(raised.value).startswith(f"{gone}: ConnectError: ")
