"""What a mutation run of this session's new code found unpinned (tests/MUTANTS.md, "New
code, spot check"): the DATA parser's contract around the end of the data, its counters
and limits at their boundaries, data handed out as soon as a line is complete; the
streamed DKIM body hash on white space other than space and tab; the SNS certificate URL
rules and fetch."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterator
from pathlib import Path

import dkim.canonicalization
import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from relay.authenticity.dkim import RelaxedBodyHash
from relay.feedback import sns
from relay.feedback.providers import SignatureError
from relay.inbound.dataflow import DataParser, DataState, Feed
from tests.feedback.test_sns import CertServer, Signer, serving

# --- relay/inbound/dataflow.py --------------------------------------------------------------------


def test_done_and_what_comes_after_the_end() -> None:
    p = DataParser(0, 1000)
    assert p.done is False
    f = p.feed(b"abc\r\n.\r\nQUIT\r\n")
    assert f == Feed(b"abc\r\n", True, b"QUIT\r\n")
    assert p.done is True
    # fed again after the end: nothing is data, all of it is handed back as it came
    assert p.feed(b"MAIL FROM:<a@b>\r\n") == Feed(b"", True, b"MAIL FROM:<a@b>\r\n")
    assert p.done is True


def test_counters_start_at_zero_and_add_up() -> None:
    p = DataParser(0, 1000)
    p.feed(b"\r\n.\r\n")
    assert (p.raw_size, p.longest, p.nul_count) == (2, 0, 0)
    q = DataParser(0, 1000)
    q.feed(b"a\x00b\r\n")
    q.feed(b"c\x00\x00\r\n.\r\n")
    assert q.nul_count == 3  # over both blocks
    assert q.raw_size == len(b"a\x00b\r\nc\x00\x00\r\n")


def test_a_complete_line_is_handed_out_at_once() -> None:
    p = DataParser(0, 1000)
    assert p.feed(b"\r\n").data == b"\r\n"  # an empty first line (no header block)
    assert p.feed(b"a\r\nb\r\nc").data == b"a\r\nb\r\n"  # every complete line, not the first
    assert p.feed(b"\r\nxyz").data == b"c\r\n"  # the CRLF that completes the pending line
    q = DataParser(0, 1000)
    assert q.feed(b"ab\r").data == b""
    assert q.feed(b"\nc").data == b"ab\r\n"  # a CRLF split between two blocks


def test_an_incomplete_line_at_the_limit_is_not_yet_too_long() -> None:
    p = DataParser(0, 100)
    p.feed(b"x" * 97)  # with its CRLF it will be 99 octets: within the limit
    f = p.feed(b"y\r\n.\r\n")
    assert f.done and p.state is DataState.NOMINAL and f.data == b"x" * 97 + b"y\r\n"


def test_raw_size_counts_a_too_long_line_once() -> None:
    p = DataParser(0, 100)
    p.feed(b"ok\r\n")
    p.feed(b"z" * 500)  # over the limit before its CRLF: kept short, counted
    p.feed(b"z" * 500)
    f = p.feed(b"\r\n.\r\n")
    assert f.done and p.state is DataState.TOO_LONG
    assert p.raw_size == 4 + 1000 + 2


def test_a_message_of_exactly_max_size_is_not_too_large() -> None:
    p = DataParser(10, 1000)
    f = p.feed(b"12345678\r\n.\r\n")  # 10 octets before the end line
    assert f.done and p.state is DataState.NOMINAL
    q = DataParser(10, 1000)
    q.feed(b"123456789\r\n.\r\n")
    assert q.state is DataState.TOO_MUCH


def test_a_refused_line_hands_out_no_data() -> None:
    p = DataParser(0, 100)
    assert p.feed(b"x" * 200 + b"\r\n").data == b""
    assert p.state is DataState.TOO_LONG


@pytest.mark.parametrize(
    ("line", "longest"),
    [
        (b"." + b"d" * 998, 998),  # the transparency dot is not part of the message
        (b"n" * 998 + b"\x00", 998),  # nor is a NUL
        (b"s " * 500, 1000),  # spaces are not line ends
        (b"s " * 500 + b"\n", 1000),  # ... also on the normalising path (a bare LF)
    ],
)
def test_longest_line_of_the_message_as_stored(line: bytes, longest: int) -> None:
    p = DataParser(0, 10_000)
    p.feed(b"a\r\n" + line + b"\r\n.\r\n")
    assert p.longest == longest


# --- relay/authenticity/dkim.py: RelaxedBodyHash --------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"abc\x0c\r\n", b"abc\x0b\r\n", b"endsX\r\n", b"X\r\n\r\n", b"a\r\n\x0c\r\n"],
)
def test_only_space_and_tab_are_white_space(body: bytes) -> None:
    h = RelaxedBodyHash()
    h.update(body)
    relaxed = dkim.canonicalization.Relaxed.canonicalize_body(body)
    assert h.digest() == hashlib.sha256(relaxed).digest()


def test_digest_twice_gives_the_same() -> None:
    h = RelaxedBodyHash()
    h.update(b"line\r\nno end")
    assert h.digest() == h.digest()


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
