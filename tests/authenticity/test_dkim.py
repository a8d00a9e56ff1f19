"""DKIM signing (relay/authenticity/dkim.py): keys made by `keygen`, loaded by `load_key`,
signatures
made by `sign` and checked by dkimpy's verifier against the TXT record `keygen` printed, as a
receiver would; what breaks a signature and what relaxed canonicalisation lets through; key
formats and the refusals; which keys sign which From domain."""

from __future__ import annotations

import base64
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

import dkim  # type: ignore[import-untyped]
import dkim.util  # type: ignore[import-untyped]
import nacl.encoding
import nacl.signing
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from relay.authenticity import dkim as dkim_sign
from relay.authenticity.dkim import (
    DEFAULT_HEADERS,
    DkimConfigError,
    DkimKey,
    DkimSignError,
    by_domain,
    header_from_domain,
    keygen,
    keys_for,
    load_key,
    public_record,
    sign,
    zone_line,
)

Dns = Callable[..., bytes | None]

MSG = (
    b"From: Alice Example <alice@example.com>\r\n"
    b"To: bob@example.org\r\n"
    b"Subject: Quarterly report\r\n"
    b"Date: Mon, 02 Mar 2026 10:00:00 +0000\r\n"
    b"Message-ID: <q1-2026@example.com>\r\n"
    b"MIME-Version: 1.0\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"\r\n"
    b"Hello Bob,\r\n"
    b"\r\n"
    b"the numbers are in.\r\n"
)

# a throwaway 512-bit key (`cryptography` refuses to generate one)
RSA_512 = b"""-----BEGIN PRIVATE KEY-----
MIIBVAIBADANBgkqhkiG9w0BAQEFAASCAT4wggE6AgEAAkEAzcuavNr5VwHK/1k7
iUnTRTgXjsgBvdY1AAZl8kkK0NWQpw9Ie+NJo29aQqzmR97pziq/vXGFJNKPXRZ5
74h0PwIDAQABAkB8zTzJywHrAetZb4PrfhnhoGKo9CIaPg1mNnscs68bdVIKRDSl
LRPukG/8pQ2z7m5YZlzdhQ7XIBKFr6QODlQBAiEA6ylMEScBaz+H0y44PCDGxkRp
shMPWbxPXp5fRi7tUNcCIQDgCCGgL5BKN/kOnz6YQ/nTG42XvYpIfuImMiDg6ETC
2QIgWBKqc44ZQPKVSyl3VEWuTJlYwKHU0PXu/+/unNl8dhcCIHaT1zhx9G1UMv8K
SpdNY23Zp5gpOogkoI6W+dARIFQBAiEAuyfmo2WYjED82LOImXT+dsmVpd6pmzsZ
cc9f+qg37b4=
-----END PRIVATE KEY-----
"""


def parse_zone(line: str) -> tuple[bytes, bytes]:
    """(owner, TXT value) from keygen's zone line; the strings are joined as verifiers do."""
    m = re.fullmatch(r'(\S+)\. IN TXT \( ((?:"[^"]*" ?)+)\)', line)
    assert m, line
    strings = re.findall(r'"([^"]*)"', m.group(2))
    assert all(len(s) <= 255 for s in strings)
    return m.group(1).encode() + b".", "".join(strings).encode()


def make_dns(*zone_lines: str) -> Dns:
    records = dict(parse_zone(z) for z in zone_lines)

    def dnsfunc(name: bytes, timeout: float = 5) -> bytes | None:
        return records.get(name)

    return dnsfunc


def verify_all(signed: bytes, dns: Dns) -> list[bool]:
    """Each DKIM-Signature of `signed`, topmost first, verified on its own."""
    head = signed.split(b"\r\n\r\n", 1)[0]
    n = sum(1 for line in head.split(b"\r\n") if line.lower().startswith(b"dkim-signature:"))
    return [_verify(signed, i, dns) for i in range(n)]


def _verify(signed: bytes, idx: int, dns: Dns) -> bool:
    try:
        return bool(dkim.DKIM(signed).verify(idx=idx, dnsfunc=dns))
    except dkim.DKIMException:  # e.g. "body hash mismatch": a failed signature
        return False


def tags(signature: bytes) -> dict[bytes, bytes]:
    """The tags of the first DKIM-Signature field in `signature`."""
    fields = re.split(rb"\r\n(?=\S)", signature)
    name, _, value = fields[0].partition(b":")
    assert name == b"DKIM-Signature"
    return dict(dkim.util.parse_tag_value(value))


def h_names(signature: bytes) -> list[str]:
    return [n.strip().decode() for n in tags(signature)[b"h"].split(b":")]


def with_header(message: bytes, field: bytes, *, top: bool = True) -> bytes:
    head, body = message.split(b"\r\n\r\n", 1)
    head = field + b"\r\n" + head if top else head + b"\r\n" + field
    return head + b"\r\n\r\n" + body


# -- fixtures: one key of each kind for the module -----------------------------------------------


@pytest.fixture(scope="module")
def keydir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dkim")


@pytest.fixture(scope="module")
def rsa_zone(keydir: Path) -> str:
    return keygen("Example.COM", "rsa2026", keydir / "rsa.pem")


@pytest.fixture(scope="module")
def ed_zone(keydir: Path) -> str:
    return keygen("example.com", "ed2026", keydir / "ed.pem", algorithm="ed25519-sha256")


@pytest.fixture(scope="module")
def rsa_key(keydir: Path, rsa_zone: str) -> DkimKey:
    return load_key("example.com", "rsa2026", keydir / "rsa.pem")


@pytest.fixture(scope="module")
def ed_key(keydir: Path, ed_zone: str) -> DkimKey:
    return load_key("example.com", "ed2026", keydir / "ed.pem", "ed25519-sha256")


@pytest.fixture(scope="module")
def keys(rsa_key: DkimKey, ed_key: DkimKey) -> list[DkimKey]:
    return [rsa_key, ed_key]


@pytest.fixture(scope="module")
def dns(rsa_zone: str, ed_zone: str) -> Dns:
    return make_dns(rsa_zone, ed_zone)


@pytest.fixture(scope="module")
def signed(keys: list[DkimKey]) -> bytes:
    return sign(MSG, keys) + MSG


# -- keygen, load, sign, verify ------------------------------------------------------------------


def test_keygen_zone_lines_publish_the_loaded_keys(
    rsa_zone: str, ed_zone: str, rsa_key: DkimKey, ed_key: DkimKey
) -> None:
    assert rsa_zone.startswith('rsa2026._domainkey.example.com. IN TXT ( "v=DKIM1; k=rsa; " "p=')
    assert ed_zone.startswith('ed2026._domainkey.example.com. IN TXT ( "v=DKIM1; k=ed25519; " "p=')
    owner, record = parse_zone(rsa_zone)
    assert owner == b"rsa2026._domainkey.example.com."
    assert record.decode() == public_record(rsa_key) == rsa_key.record
    assert len(re.findall(r'"[^"]*"', rsa_zone)) == 3  # a 2048-bit p= needs two strings
    owner, record = parse_zone(ed_zone)
    assert owner == b"ed2026._domainkey.example.com."
    assert record.decode() == public_record(ed_key)
    p = ed_key.record.removeprefix("v=DKIM1; k=ed25519; p=")
    assert len(base64.b64decode(p)) == 32  # RFC 8463 §4.2: the raw public key
    assert rsa_key.name == "rsa2026._domainkey.example.com"
    assert zone_line(rsa_key.domain, rsa_key.selector, rsa_key.record) == rsa_zone


def test_loaded_keys(rsa_key: DkimKey, ed_key: DkimKey) -> None:
    assert (rsa_key.domain, rsa_key.selector, rsa_key.algorithm) == (
        "example.com",
        "rsa2026",
        "rsa-sha256",
    )
    assert rsa_key.private_key.startswith(b"-----BEGIN RSA PRIVATE KEY-----\n")  # PKCS#1
    assert ed_key.algorithm == "ed25519-sha256"
    assert len(base64.b64decode(ed_key.private_key)) == 32  # dkimpy's seed
    assert rsa_key.headers == ed_key.headers == DEFAULT_HEADERS
    assert rsa_key.warnings == ed_key.warnings == ()
    for key in (rsa_key, ed_key):
        assert key.private_key.decode() not in repr(key)
        assert "PRIVATE" not in repr(key)


def test_rsa_and_ed25519_signatures_side_by_side(signed: bytes, dns: Dns) -> None:
    assert verify_all(signed, dns) == [True, True]
    first, second = re.findall(rb"a=([\w-]+);", signed)
    assert (first, second) == (b"rsa-sha256", b"ed25519-sha256")
    assert dkim.verify(signed, dnsfunc=dns)  # the module function checks the topmost


@pytest.mark.parametrize("which", ["rsa", "ed"])
def test_each_key_alone(which: str, rsa_key: DkimKey, ed_key: DkimKey, dns: Dns) -> None:
    key = rsa_key if which == "rsa" else ed_key
    assert verify_all(sign(MSG, [key]) + MSG, dns) == [True]


def test_signature_fields(keys: list[DkimKey]) -> None:
    out = sign(MSG, keys, now=1_770_000_000)
    assert out.startswith(b"DKIM-Signature: ")
    assert out.endswith(b"\r\n")
    assert out.count(b"\r\nDKIM-Signature: ") == 1
    lines = out.split(b"\r\n")[:-1]
    assert all(len(line) <= 78 for line in lines)
    assert all(line[:1] == b" " for line in lines if not line.startswith(b"DKIM-Signature: "))
    t = tags(out)
    assert t[b"v"] == b"1"
    assert t[b"c"] == b"relaxed/relaxed"
    assert t[b"d"] == b"example.com"
    assert t[b"s"] == b"rsa2026"
    assert t[b"t"] == b"1770000000"
    assert b"l" not in t and b"x" not in t


def test_now_fixes_t_and_the_signature_is_deterministic(keys: list[DkimKey]) -> None:
    assert sign(MSG, keys, now=1_770_000_000) == sign(MSG, keys, now=1_770_000_000)
    assert sign(MSG, keys, now=1_770_000_000) != sign(MSG, keys, now=1_770_000_001)
    t = int(tags(sign(MSG, keys[:1]))[b"t"])
    assert abs(t - time.time()) < 60


def test_no_keys_no_signature() -> None:
    assert sign(MSG, []) == b""


# -- what a signature covers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda m: m.replace(b"Quarterly report", b"Quarterly rep0rt"), id="subject"),
        pytest.param(lambda m: m.replace(b"numbers are in", b"numbers are out"), id="body"),
        pytest.param(lambda m: m + b"PS: wire the money\r\n", id="body-appended"),
        pytest.param(
            lambda m: with_header(m, b"From: Mallory <mallory@evil.example>"), id="from-above"
        ),
        pytest.param(
            lambda m: with_header(m, b"From: Mallory <mallory@evil.example>", top=False),
            id="from-below",
        ),
        pytest.param(lambda m: m.replace(b"alice@example.com", b"alice@evil.example"), id="from"),
        pytest.param(
            lambda m: with_header(m, b"Reply-To: mallory@evil.example"), id="reply-to-added"
        ),
        pytest.param(
            lambda m: with_header(m, b"List-Unsubscribe: <https://evil.example/u>"),
            id="list-unsubscribe-added",
        ),
        pytest.param(lambda m: m.replace(b"Date: Mon, 02", b"Date: Tue, 03"), id="date"),
    ],
)
def test_tampering_breaks_both_signatures(
    tamper: Callable[[bytes], bytes], keys: list[DkimKey], dns: Dns
) -> None:
    tampered = sign(MSG, keys) + tamper(MSG)
    assert verify_all(tampered, dns) == [False, False]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.replace(b"Subject: ", b"SUBJECT:  \t "), id="name-case-and-ws"),
        pytest.param(
            lambda m: m.replace(b"Quarterly report", b"Quarterly \t  report"), id="ws-run"
        ),
        pytest.param(
            lambda m: m.replace(b"Quarterly report", b"Quarterly\r\n report"), id="refold"
        ),
        pytest.param(lambda m: m.replace(b"bob@example.org", b"bob@example.org  "), id="trailing"),
        pytest.param(lambda m: m.replace(b"Hello Bob,", b"Hello   Bob,\t "), id="body-ws"),
        pytest.param(lambda m: m + b"\r\n\r\n\r\n", id="body-trailing-blank-lines"),
        pytest.param(lambda m: with_header(m, b"Received: from a by b; Mon, 2 Mar 2026"), id="rcv"),
        pytest.param(lambda m: with_header(m, b"X-Spam-Score: 0.1", top=False), id="unlisted"),
    ],
)
def test_relaxed_canonicalisation_survives(
    change: Callable[[bytes], bytes], keys: list[DkimKey], dns: Dns
) -> None:
    assert verify_all(sign(MSG, keys) + change(MSG), dns) == [True, True]


def test_long_lines_8bit_body_and_folded_headers(keys: list[DkimKey], dns: Dns) -> None:
    message = (
        b"From: =?utf-8?q?J=C3=BCrgen?= <juergen@example.com>\r\n"
        b"To: one@example.org,\r\n two@example.org,\r\n\tthree@example.org\r\n"
        b"Subject: a subject long enough that the writer folded it\r\n"
        b"  over two lines, \xc3\xbcnd raw UTF-8 (RFC 6532)\r\n"
        b"Date: Mon, 02 Mar 2026 10:00:00 +0000\r\n"
        b"Message-ID: <long@example.com>\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n"
        b"\r\n"
        b"Gr\xc3\xbc\xc3\x9fe, caf\xe9 \x80\xff\r\n" + b"x" * 998 + b"\r\n" + b"y " * 3000 + b"\r\n"
    )
    out = sign(message, keys)
    assert verify_all(out + message, dns) == [True, True]
    assert h_names(out).count("to") == 1


def test_list_unsubscribe_is_signed_when_present(keys: list[DkimKey], dns: Dns) -> None:
    message = with_header(
        MSG,
        b"List-Unsubscribe: <https://example.com/u/123>, <mailto:u-123@example.com>\r\n"
        b"List-Unsubscribe-Post: List-Unsubscribe=One-Click",
        top=False,
    )
    out = sign(message, keys)
    names = h_names(out)
    assert "list-unsubscribe" in names
    assert "list-unsubscribe-post" in names
    assert verify_all(out + message, dns) == [True, True]
    changed = message.replace(b"One-Click", b"Two-Click")
    assert verify_all(out + changed, dns) == [False, False]


def test_h_signs_every_instance_absence_and_oversigns_from(rsa_key: DkimKey) -> None:
    message = with_header(MSG, b"To: carol@example.org")
    names = h_names(sign(message, [rsa_key]))
    assert names.count("from") == 2  # one From, oversigned
    assert names.count("to") == 2  # both instances
    assert names.count("cc") == 1  # absent: signed as absent
    assert names.count("subject") == 1
    assert "received" not in names and "x-spam-score" not in names


def test_custom_headers_list(keydir: Path, rsa_zone: str, dns: Dns) -> None:
    once, twice = (
        load_key("example.com", "rsa2026", keydir / "rsa.pem", headers=["from", *subject])
        for subject in (["subject"], ["subject", "subject"])
    )
    assert twice.headers == ("from", "subject", "subject")
    out_once, out_twice = sign(MSG, [once]), sign(MSG, [twice])
    assert h_names(out_once) == ["from", "subject"]
    assert h_names(out_twice) == ["from", "subject", "subject"]
    assert verify_all(out_once + MSG, dns) == verify_all(out_twice + MSG, dns) == [True]
    # signed once, a second Subject can be added above (verifiers pick the bottom one) ...
    above = with_header(MSG, b"Subject: URGENT: wire the money")
    assert verify_all(out_once + above, dns) == [True]
    # ... oversigned, it cannot
    assert verify_all(out_twice + above, dns) == [False]


# -- messages that cannot be signed --------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (MSG.replace(b"From: Alice Example <alice@example.com>\r\n", b""), "no From"),
        (with_header(MSG, b"From: other@example.com"), "2 From"),
        (MSG.replace(b"Subject: Quarterly report\r\n", b"Subject: a\nb\r\n"), "bare CR or LF"),
        (MSG.replace(b"Hello Bob,\r\n", b"Hello\rBob,\r\n"), "bare CR or LF"),
        (with_header(MSG, b"this is not a header field"), "cannot be parsed"),
    ],
)
def test_unsignable_messages(message: bytes, match: str, keys: list[DkimKey]) -> None:
    with pytest.raises(DkimSignError, match=match):
        sign(message, keys)


def test_a_dkimpy_failure_is_a_sign_error(rsa_key: DkimKey) -> None:
    broken = DkimKey(
        "example.com",
        "bad",
        "rsa-sha256",
        b"-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n",
        DEFAULT_HEADERS,
        rsa_key.record,
    )
    with pytest.raises(DkimSignError, match=r"bad\._domainkey\.example\.com"):
        sign(MSG, [rsa_key, broken])


# -- keygen --------------------------------------------------------------------------------------


def test_keygen_files_are_0600(keydir: Path, rsa_zone: str, ed_zone: str) -> None:
    for name in ("rsa.pem", "ed.pem"):
        st = (keydir / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
    assert (keydir / "rsa.pem").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----\n")
    assert (keydir / "ed.pem").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----\n")


def test_keygen_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        keygen("example.com", "u", tmp_path / "k.pem", "ed25519-sha256")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k.pem").stat().st_mode) == 0o600


def test_keygen_refuses_an_existing_file(keydir: Path, rsa_zone: str) -> None:
    before = (keydir / "rsa.pem").read_bytes()
    with pytest.raises(DkimConfigError, match="already exists"):
        keygen("example.com", "rsa2026", keydir / "rsa.pem", "ed25519-sha256")
    assert (keydir / "rsa.pem").read_bytes() == before


def test_keygen_does_not_follow_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "link.pem").symlink_to(tmp_path / "target.pem")
    with pytest.raises(DkimConfigError, match="already exists"):
        keygen("example.com", "s", tmp_path / "link.pem", "ed25519-sha256")
    assert not (tmp_path / "target.pem").exists()


def test_keygen_removes_a_half_written_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DkimConfigError, match=r"cannot write .*No space left"):
        keygen("example.com", "s1", tmp_path / "k.pem", "ed25519-sha256")
    assert not (tmp_path / "k.pem").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 1024}, "2048 to 4096"),
        ({"bits": 8192}, "2048 to 4096"),
        ({"algorithm": "rsa-sha1"}, "unknown"),
        ({"domain": "example"}, "at least 2 labels"),
        ({"selector": "s_1"}, "letters, digits and hyphens"),
        ({"path": Path("/nonexistent-dir/k.pem")}, "cannot create"),
    ],
)
def test_keygen_refusals(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"domain": "example.com", "selector": "s1", "path": tmp_path / "k"}
    args.update(kwargs)
    with pytest.raises(DkimConfigError, match=match):
        keygen(**args)  # type: ignore[arg-type]
    assert not (tmp_path / "k").exists()


# -- load_key: formats ---------------------------------------------------------------------------


def write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_rsa_pkcs1_pkcs8_and_crlf_pem_are_the_same_key(
    tmp_path: Path, keydir: Path, rsa_key: DkimKey
) -> None:
    pem = serialization.load_pem_private_key((keydir / "rsa.pem").read_bytes(), None)
    assert isinstance(pem, rsa.RSAPrivateKey)
    pkcs1 = pem.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    crlf = (keydir / "rsa.pem").read_bytes().replace(b"\n", b"\r\n")
    for name, data in (("pkcs1.pem", pkcs1), ("crlf.pem", crlf)):
        key = load_key("example.com", "rsa2026", write(tmp_path / name, data))
        assert key == rsa_key


def test_ed25519_dkimpy_raw_seed(tmp_path: Path, dns: Dns) -> None:
    seed = nacl.signing.SigningKey.generate()
    raw = seed.encode(encoder=nacl.encoding.Base64Encoder)  # what dknewkey writes
    key = load_key("example.com", "raw", write(tmp_path / "raw.key", raw), "ed25519-sha256")
    public = seed.verify_key.encode(encoder=nacl.encoding.Base64Encoder).decode()
    assert key.record == f"v=DKIM1; k=ed25519; p={public}"
    zone = zone_line(key.domain, key.selector, key.record)
    assert verify_all(sign(MSG, [key]) + MSG, make_dns(zone)) == [True]
    # the 64-byte layout (seed, then public key) of libsodium
    full = base64.b64encode(bytes(seed) + bytes(seed.verify_key)) + b"\n"
    again = load_key("example.com", "raw", write(tmp_path / "full.key", full), "ed25519-sha256")
    assert again == key


def test_ed25519_pem_and_raw_are_the_same_key(
    tmp_path: Path, keydir: Path, ed_key: DkimKey
) -> None:
    pem = serialization.load_pem_private_key((keydir / "ed.pem").read_bytes(), None)
    assert isinstance(pem, ed25519.Ed25519PrivateKey)
    raw = base64.b64encode(pem.private_bytes_raw()) + b"\n"
    key = load_key("example.com", "ed2026", write(tmp_path / "raw", raw), "ed25519-sha256")
    assert key == ed_key


# -- load_key: refusals and warnings -------------------------------------------------------------


def ed25519_pem(encryption: serialization.KeySerializationEncryption) -> bytes:
    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


@pytest.mark.parametrize(
    ("data", "algorithm", "match"),
    [
        (b"", "rsa-sha256", "empty"),
        (b"this is not a key\n", "rsa-sha256", "no -----BEGIN"),
        (b"this is not a key\n", "ed25519-sha256", "neither PEM nor a base64"),
        (
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            "rsa-sha256",
            "not a valid PEM private key",
        ),
        (RSA_512, "rsa-sha256", "512 bits"),
        (RSA_512, "ed25519-sha256", "an RSA key: use algorithm rsa-sha256"),
        (ed25519_pem(serialization.NoEncryption()), "rsa-sha256", "an Ed25519 key"),
        (ed25519_pem(serialization.BestAvailableEncryption(b"pw")), "ed25519-sha256", "encrypted"),
        (base64.b64encode(b"x" * 31), "ed25519-sha256", "this one is 31"),
        (base64.b64encode(b"x" * 64), "ed25519-sha256", "does not match"),
    ],
)
def test_bad_key_files(tmp_path: Path, data: bytes, algorithm: str, match: str) -> None:
    path = write(tmp_path / "bad.key", data)
    with pytest.raises(DkimConfigError, match=match) as e:
        load_key("example.com", "s1", path, algorithm)
    assert str(path) in str(e.value)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(DkimConfigError, match=r"missing\.pem.*cannot read: No such file"):
        load_key("example.com", "s1", tmp_path / "missing.pem")
    with pytest.raises(DkimConfigError, match="cannot read"):
        load_key("example.com", "s1", tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "rsa-sha1"}, "unknown; use one of rsa-sha256, ed25519-sha256"),
        ({"algorithm": "ed25519"}, "unknown"),
        ({"domain": "exa mple.com"}, "letters, digits and hyphens"),
        ({"domain": "-bad.example.com"}, "letters, digits and hyphens"),
        ({"domain": "localhost"}, "at least 2 labels"),
        ({"domain": "b\u00fccher.example"}, "xn--"),
        ({"domain": "a..example.com"}, "1-63"),
        ({"selector": ""}, "empty"),
        ({"selector": "s" * 64}, "1-63"),
        ({"headers": ["To", "Subject"]}, "From must be signed"),
        ({"headers": ["From", "Received"]}, "Received must not be signed"),
        ({"headers": ["From", "DKIM-Signature"]}, "must not be signed"),
        ({"headers": ["From", "Bad Name"]}, "not a header field name"),
        ({"headers": "From"}, "not a string"),
    ],
)
def test_bad_settings(keydir: Path, rsa_zone: str, kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "domain": "example.com",
        "selector": "s1",
        "key_file": keydir / "rsa.pem",
    }
    args.update(kwargs)
    with pytest.raises(DkimConfigError, match=match):
        load_key(**args)  # type: ignore[arg-type]


def test_names_are_normalised(keydir: Path, rsa_zone: str) -> None:
    key = load_key("Mail.Example.COM.", "Rsa2026", keydir / "rsa.pem")
    assert (key.domain, key.selector) == ("mail.example.com", "rsa2026")


def test_weak_rsa_key_and_open_mode_warn(tmp_path: Path) -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key = load_key("example.com", "old", write(tmp_path / "weak.pem", weak, 0o644))
    assert len(key.warnings) == 2
    readable, small = key.warnings
    assert "readable or writable by other users (mode 0644)" in readable
    assert "1024 bits" in small and "2048" in small
    assert str(tmp_path / "weak.pem") in small


def test_a_key_dkimpy_cannot_sign_with_fails_at_load(
    keydir: Path, rsa_zone: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: object, key: DkimKey, t: int) -> bytes:
        raise dkim.KeyFormatError("unsupported")

    monkeypatch.setattr(dkim_sign._Signer, "sign_with", broken)
    with pytest.raises(DkimConfigError, match="dkimpy cannot sign with this key"):
        load_key("example.com", "rsa2026", keydir / "rsa.pem")


# -- which keys sign -----------------------------------------------------------------------------


def fake(domain: str, selector: str) -> DkimKey:
    return DkimKey(domain, selector, "ed25519-sha256", b"", DEFAULT_HEADERS, "")


def test_keys_for() -> None:
    ex1, ex2, sub, other = (
        fake("example.com", "a"),
        fake("example.com", "b"),
        fake("b.example.com", "a"),
        fake("example.org", "a"),
    )
    keys = by_domain([ex1, ex2, sub, other])
    assert keys == {"example.com": (ex1, ex2), "b.example.com": (sub,), "example.org": (other,)}
    assert keys_for("example.com", keys) == (ex1, ex2)  # exact
    assert keys_for("Example.COM.", keys) == (ex1, ex2)
    assert keys_for("mail.example.com", keys) == (ex1, ex2)  # parent
    assert keys_for("x.y.example.org", keys) == (other,)
    assert keys_for("a.b.example.com", keys) == (sub,)  # the nearest parent
    assert keys_for("b.example.com", keys) == (sub,)
    assert keys_for("notexample.com", keys) == ()  # labels, not suffixes
    assert keys_for("example.net", keys) == ()
    assert keys_for("com", keys) == ()
    assert keys_for("", keys) == ()
    assert keys_for("example.com", {}) == ()
    idn = fake("xn--bcher-kva.example", "a")
    assert keys_for("B\u00fccher.example", by_domain([idn])) == (idn,)


def test_by_domain_refuses_a_selector_twice() -> None:
    with pytest.raises(DkimConfigError, match=r"two keys for a\._domainkey\.example\.com"):
        by_domain([fake("example.com", "a"), fake("example.com", "a")])


@pytest.mark.parametrize(
    ("from_field", "domain"),
    [
        (b"From: Alice <alice@Example.COM>", "example.com"),
        (b'From: "bob@evil.example" <bob@example.com>', "example.com"),
        (b"From: alice@example.com", "example.com"),
        (b"From: Alice\r\n <alice@example.com>", "example.com"),
        (b"From: a@example.com, b@example.com", "example.com"),
        (b"From: a@example.com, b@example.org", None),
        (b"From: undisclosed-recipients:;", None),
        (b"From: nobody", None),
        (b"From: a@example.com\r\nFrom: b@example.com", None),
        (b"Sender: a@example.com", None),
    ],
)
def test_header_from_domain(from_field: bytes, domain: str | None) -> None:
    message = from_field + b"\r\nSubject: x\r\n\r\nbody\r\n"
    assert header_from_domain(message) == domain


def test_wiring(keys: list[DkimKey], dns: Dns) -> None:
    """The daemon's path: From domain -> keys -> signature in front of the message."""
    by = by_domain(keys)
    message = MSG.replace(b"alice@example.com", b"alice@news.example.com")
    chosen = keys_for(header_from_domain(message) or "", by)
    assert chosen == tuple(keys)
    assert verify_all(sign(message, chosen) + message, dns) == [True, True]
    assert keys_for(header_from_domain(b"Subject: x\r\n\r\n") or "", by) == ()
