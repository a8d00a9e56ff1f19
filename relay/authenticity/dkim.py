"""DKIM signing (RFC 6376; Ed25519 per RFC 8463) of messages on their way out (pure but for
key files).

Rules:
- `load_key` reads a key once, at start: RSA as PEM (PKCS#1 `BEGIN RSA PRIVATE KEY` or
  PKCS#8 `BEGIN PRIVATE KEY`); Ed25519 as PKCS#8 PEM or as dkimpy's own format, the base64
  32-byte seed (a 64-byte seed+public key, libsodium's layout, is accepted when its halves
  agree). It derives the public key with `cryptography`, converts the key to the form
  dkimpy signs with (PKCS#1 PEM / base64 seed), and signs and verifies a probe message, so
  a key that cannot sign fails at start with `DkimConfigError` (the daemon exits 78), never
  per message. Encrypted keys are refused (the daemon has no passphrase to give).
- RSA: under 1024 bits is refused (RFC 8301 §3.2: verifiers treat such signatures as
  failed); under 2048 or over 4096 bits loads with a warning (RFC 8301: signers SHOULD use
  2048; verifiers need not check more than 4096). A key file readable or writable by other
  users also warns. Warnings are returned in `DkimKey.warnings`, not logged: the caller
  prints them as it does `Config.warnings()` (check-config prints, the daemon logs at start).
- Domains and selectors are ASCII DNS names (letters, digits, hyphens; labels of 1-63; use
  the xn-- form of an internationalised domain); a signing domain has at least two labels.
- Signed header fields (h=), per message, from the key's `headers` (default
  `DEFAULT_HEADERS`): every instance present of a listed field is signed; a listed field
  the message lacks is signed once, as absent (RFC 6376 §5.4.2: nobody can add it later
  without breaking the signature: no added Reply-To, Cc or List-Unsubscribe on a replayed
  message); a field listed twice is oversigned: signed once more than it occurs, so no
  instance can be added above or below (RFC 6376 §8.15). `DEFAULT_HEADERS` oversigns From.
  The cost: a downstream system that adds one of these fields (a mailing list adding
  List-Unsubscribe) breaks our signature, which it usually does anyway by changing the
  Subject or body. The relay adds Date and Message-ID at accept, so those are present.
- A message must have exactly one From field (RFC 5322 §3.6): none or several is a
  `DkimSignError`, as is a header block dkimpy cannot parse and a bare CR or LF (the
  relay stores CRLF-only messages, relay/mail/message.py; a signature over other line ends
  would not verify at the receiver). Any dkimpy failure is a `DkimSignError` too.
- Canonicalisation relaxed/relaxed; tags v, a, c, d, s, t, h, bh, b (i= defaults to @d);
  no l= (a body length limit lets anyone append content) and no x=.
- `sign` returns only the DKIM-Signature fields, one per key in the order given, each
  CRLF-terminated; the signed message is exactly `sign(m, keys) + m`: the message bytes are
  never re-serialised. Each signature covers the message, not the other signatures, so
  RSA and Ed25519 signatures stand side by side (RFC 8463: sign with both while verifiers
  learn Ed25519). Sign last, after any header rewriting (relay/delivery/rewrite.py) and
  long-line re-encoding (relay/inbound/longlines.py): the signature covers From and the body.
  Signing is CPU work linear in the message size plus one RSA operation (about 7 ms for
  2048 bits, pure Python in dkimpy): call it from a worker thread for large messages. It is
  thread-safe.
- Which keys sign: those configured for the domain of the header From (`header_from_domain`),
  else those of the nearest configured parent domain (relaxed DMARC alignment: d=example.com
  aligns with From a.example.com); none -> the message goes unsigned (`keys_for` -> ()).
- `keygen` creates the key file with mode 0600 and O_EXCL (never replaces a file, never
  exists with a wider mode), as PKCS#8 PEM for both algorithms, and returns the zone-file
  line to publish, its TXT value split into strings of at most 255 octets (RFC 6376
  §3.6.2.2; verifiers join them without separators). New RSA keys are 2048-4096 bits.
- dkimpy internals used (dkimpy has no way to set t=): `DomainSigner.gen_header`,
  `.hasher`, `.headers`, `.body`, `dkim.crypto.parse_pem_private_key`. `load_key`'s probe
  exercises all of them, so a dkimpy release without them fails at start.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import functools
import hashlib
import os
import re
import stat
import string
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import dkim  # type: ignore[import-untyped]
import dkim.canonicalization  # type: ignore[import-untyped]
import dkim.crypto  # type: ignore[import-untyped]
import nacl.encoding
import nacl.signing
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from relay.mail.message import parse_headers, split_message

Algorithm = Literal["rsa-sha256", "ed25519-sha256"]
ALGORITHMS: tuple[Algorithm, ...] = ("rsa-sha256", "ed25519-sha256")

DEFAULT_HEADERS: tuple[str, ...] = (
    "From",
    "From",  # oversigned: a second From cannot be added
    "To",
    "Cc",
    "Subject",
    "Date",
    "Message-ID",
    "Reply-To",
    "In-Reply-To",
    "References",
    "List-Unsubscribe",
    "List-Unsubscribe-Post",
    "MIME-Version",
    "Content-Type",
    "Content-Transfer-Encoding",
)

MIN_RSA_BITS = 1024  # refused below (RFC 8301 §3.2)
GOOD_RSA_BITS = 2048  # warned below; keygen's minimum
MAX_RSA_BITS = 4096  # warned above; keygen's maximum
MAX_KEY_FILE = 64 * 1024  # a PEM key of 16384 bits is about 12 KiB
TXT_STRING = 255  # octets per character-string in a TXT record (RFC 1035 §3.3)

_CANON = b"relaxed/relaxed"
_LDH = frozenset(string.ascii_letters + string.digits + "-")
# never signed: they change in transit, or must not be seen (RFC 6376 §5.4.1)
_NEVER_SIGNED = frozenset(x.decode() for x in dkim.DKIM.SHOULD_NOT)
_PROBE = (
    b"From: probe@example.com\r\nTo: probe@example.com\r\nSubject: probe\r\n"
    b"Date: Thu, 01 Jan 2026 00:00:00 +0000\r\nMessage-ID: <probe@example.com>\r\n\r\nprobe\r\n"
)


class DkimConfigError(Exception):
    """A key that cannot be used: missing, unreadable, malformed, too weak, or a bad domain,
    selector or header list (the daemon exits 78). Also keygen's refusals."""


class DkimSignError(Exception):
    """A message that could not be signed (the daemon defers it, loudly)."""


@dataclass(frozen=True, slots=True)
class DkimKey:
    domain: str  # d=, lowercase ASCII
    selector: str  # s=
    algorithm: Algorithm
    private_key: bytes = field(repr=False)  # as dkimpy signs with: PKCS#1 PEM / base64 seed
    headers: tuple[str, ...]  # h= names; a name listed twice is oversigned
    record: str  # the TXT value to publish: "v=DKIM1; k=rsa; p=..."
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        """The DNS name of the key's record: `<selector>._domainkey.<domain>`."""
        return f"{self.selector}._domainkey.{self.domain}"


# -- names ------------------------------------------------------------------------------------


def _dns_name(what: str, value: str, min_labels: int) -> str:
    name = value.strip().lower()
    if name.endswith("."):
        name = name[:-1]
    if not name:
        raise DkimConfigError(f"dkim {what}: empty")
    if not name.isascii():
        raise DkimConfigError(
            f"dkim {what} {value!r}: not ASCII; use the xn-- (A-label) form of the name"
        )
    if len(name) > 253:
        raise DkimConfigError(f"dkim {what} {value!r}: longer than 253 characters")
    labels = name.split(".")
    for label in labels:
        if not 1 <= len(label) <= 63:
            raise DkimConfigError(
                f"dkim {what} {value!r}: each label must be 1-63 characters (got {label!r})"
            )
        if not set(label) <= _LDH or label[0] == "-" or label[-1] == "-":
            raise DkimConfigError(
                f"dkim {what} {value!r}: labels are letters, digits and hyphens, not starting"
                f" or ending with a hyphen (got {label!r})"
            )
    if len(labels) < min_labels:
        raise DkimConfigError(f"dkim {what} {value!r}: needs at least {min_labels} labels")
    return name


def _names(domain: str, selector: str) -> tuple[str, str]:
    d = _dns_name("domain", domain, 2)
    s = _dns_name("selector", selector, 1)
    if len(f"{s}._domainkey.{d}") > 253:
        raise DkimConfigError(f"dkim {s}._domainkey.{d}: longer than 253 characters")
    return d, s


def _algorithm(algorithm: str) -> Algorithm:
    if algorithm not in ALGORITHMS:
        raise DkimConfigError(
            f"dkim algorithm {algorithm!r}: unknown; use one of {', '.join(ALGORITHMS)}"
        )
    return algorithm


def _headers(headers: Sequence[str] | None) -> tuple[str, ...]:
    if headers is None:
        return DEFAULT_HEADERS
    if isinstance(headers, str):
        raise DkimConfigError("dkim headers: a list of header field names, not a string")
    out = tuple(h.strip() for h in headers)
    for h in out:
        if not h or any(not 33 <= ord(c) <= 126 or c == ":" for c in h):
            raise DkimConfigError(f"dkim headers: {h!r} is not a header field name")
        if h.lower() in _NEVER_SIGNED:
            raise DkimConfigError(
                f"dkim headers: {h} must not be signed (RFC 6376 §5.4.1: it changes in"
                " transit or must not be seen)"
            )
    if "from" not in (h.lower() for h in out):
        raise DkimConfigError("dkim headers: From must be signed (RFC 6376 §5.4)")
    return out


# -- keys -------------------------------------------------------------------------------------


def _rsa_record(key: rsa.RSAPrivateKey) -> str:
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return f"v=DKIM1; k=rsa; p={base64.b64encode(spki).decode()}"


def _ed25519_record(key: ed25519.Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes_raw()
    return f"v=DKIM1; k=ed25519; p={base64.b64encode(raw).decode()}"


def _kind(key: object) -> str:
    if isinstance(key, rsa.RSAPrivateKey):
        return "an RSA key: use algorithm rsa-sha256"
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "an Ed25519 key: use algorithm ed25519-sha256"
    return f"a {type(key).__name__.removeprefix('_')} key, which DKIM cannot use"


def _load_pem(where: str, data: bytes) -> object:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError as e:  # "Password was not given but private key is encrypted"
        raise DkimConfigError(
            f"{where}: the key is encrypted; store it unencrypted, readable only by the relay"
            " (openssl pkey -in KEY -out KEY.plain)"
        ) from e
    except (ValueError, UnsupportedAlgorithm) as e:
        raise DkimConfigError(f"{where}: not a valid PEM private key ({e})") from e


def _read(where: str, key_file: Path) -> tuple[bytes, list[str]]:
    try:
        with open(key_file, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise DkimConfigError(f"{where}: not a regular file")
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as e:
        raise DkimConfigError(f"{where}: cannot read: {e.strerror or e}") from e
    if len(data) > MAX_KEY_FILE:
        raise DkimConfigError(f"{where}: larger than {MAX_KEY_FILE} bytes: not a key file")
    warnings = []
    if st.st_mode & 0o007:
        warnings.append(
            f"{where}: the private key is readable or writable by other users"
            f" (mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 (or 640 for a group)"
        )
    return data, warnings


def load_key(
    domain: str,
    selector: str,
    key_file: Path,
    algorithm: str = "rsa-sha256",
    headers: Sequence[str] | None = None,
) -> DkimKey:
    """The key in `key_file`, checked; raises DkimConfigError saying what is wrong."""
    d, s = _names(domain, selector)
    alg = _algorithm(algorithm)
    names = _headers(headers)
    where = f"dkim key {key_file} ({s}._domainkey.{d}, {alg})"
    data, warnings = _read(where, key_file)
    text = data.strip()
    if not text:
        raise DkimConfigError(f"{where}: the file is empty")
    if alg == "rsa-sha256":
        if b"-----BEGIN" not in text:
            raise DkimConfigError(f"{where}: not a PEM private key (no -----BEGIN line)")
        key = _load_pem(where, data)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise DkimConfigError(f"{where}: {_kind(key)}")
        bits = key.key_size
        if bits < MIN_RSA_BITS:
            raise DkimConfigError(
                f"{where}: an RSA key of {bits} bits; at least {MIN_RSA_BITS} are needed"
                f" (RFC 8301), {GOOD_RSA_BITS} recommended: generate a new key"
            )
        if bits < GOOD_RSA_BITS:
            warnings.append(
                f"{where}: an RSA key of {bits} bits; RFC 8301 recommends {GOOD_RSA_BITS}:"
                " rotate to a new key"
            )
        elif bits > MAX_RSA_BITS:
            warnings.append(
                f"{where}: an RSA key of {bits} bits; verifiers need not check keys over"
                f" {MAX_RSA_BITS} bits (RFC 8301 §3.2)"
            )
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        record = _rsa_record(key)
    else:
        if b"-----BEGIN" in text:
            pem = _load_pem(where, data)
            if not isinstance(pem, ed25519.Ed25519PrivateKey):
                raise DkimConfigError(f"{where}: {_kind(pem)}")
            ed = pem
        else:
            ed = _ed25519_raw(where, text)
        private = base64.b64encode(ed.private_bytes_raw())
        record = _ed25519_record(ed)
    key_ = DkimKey(d, s, alg, private, names, record, tuple(warnings))
    _probe(where, key_)
    return key_


def _ed25519_raw(where: str, text: bytes) -> ed25519.Ed25519PrivateKey:
    try:
        raw = base64.b64decode(b"".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise DkimConfigError(f"{where}: neither PEM nor a base64 Ed25519 private key ({e})") from e
    if len(raw) not in (32, 64):
        raise DkimConfigError(
            f"{where}: a base64 Ed25519 private key is 32 bytes (dkimpy's seed) or 64 (seed"
            f" and public key); this one is {len(raw)}"
        )
    key = ed25519.Ed25519PrivateKey.from_private_bytes(raw[:32])
    if len(raw) == 64 and key.public_key().public_bytes_raw() != raw[32:]:
        raise DkimConfigError(
            f"{where}: the 64-byte Ed25519 key's public half does not match its seed"
        )
    return key


def _probe(where: str, key: DkimKey) -> None:
    """Sign and verify a probe message with dkimpy, as a verifier would."""

    def dnsfunc(name: bytes, timeout: float = 5) -> bytes:
        return key.record.encode()

    try:
        signed = sign(_PROBE, [key], now=int(time.time())) + _PROBE
        ok = dkim.DKIM(signed).verify(dnsfunc=dnsfunc)
    except Exception as e:
        raise DkimConfigError(f"{where}: dkimpy cannot sign with this key: {e}") from e
    if not ok:
        raise DkimConfigError(f"{where}: a probe signature made with this key does not verify")


def public_record(key: DkimKey) -> str:
    """The TXT value to publish at `key.name`: `v=DKIM1; k=rsa; p=...` (for check-dns)."""
    return key.record


def zone_line(domain: str, selector: str, record: str) -> str:
    """`record` as a zone-file line, split into quoted strings of at most 255 octets."""
    head, sep, p = record.partition("p=")
    parts = [head] if head else []
    value = sep + p
    parts += [value[i : i + TXT_STRING] for i in range(0, len(value), TXT_STRING)]
    strings = " ".join(f'"{part}"' for part in parts)
    return f"{selector}._domainkey.{domain}. IN TXT ( {strings} )"


def keygen(
    domain: str, selector: str, path: Path, algorithm: str = "rsa-sha256", bits: int = 2048
) -> str:
    """Write a new private key to `path` (mode 0600; an existing file is never replaced) and
    return the zone-file line to publish. `bits` is for RSA only."""
    d, s = _names(domain, selector)
    alg = _algorithm(algorithm)
    if alg == "rsa-sha256" and not GOOD_RSA_BITS <= bits <= MAX_RSA_BITS:
        raise DkimConfigError(
            f"dkim keygen: RSA keys of {GOOD_RSA_BITS} to {MAX_RSA_BITS} bits (RFC 8301);"
            f" not {bits}"
        )
    fd = _create(path)  # before the key is made: a refused path costs nothing
    try:
        try:
            key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
            if alg == "rsa-sha256":
                key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
                record = _rsa_record(key)
            else:
                key = ed25519.Ed25519PrivateKey.generate()
                record = _ed25519_record(key)
            pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
            view = memoryview(pem)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as e:
        path.unlink(missing_ok=True)  # ours: O_EXCL created it; a half-written key is no key
        if isinstance(e, OSError):
            raise DkimConfigError(f"dkim keygen: cannot write {path}: {e.strerror or e}") from e
        raise
    return zone_line(d, s, record)


def _create(path: Path) -> int:
    """A new file at `path`, mode 0600 from the start; never an existing file or symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError as e:
        raise DkimConfigError(
            f"dkim keygen: {path} already exists; not replaced (remove it first, or write"
            " the new key to another file: rotate keys under a new selector)"
        ) from e
    except OSError as e:
        raise DkimConfigError(f"dkim keygen: cannot create {path}: {e.strerror or e}") from e


# -- which keys -------------------------------------------------------------------------------


def by_domain(keys: Iterable[DkimKey]) -> dict[str, tuple[DkimKey, ...]]:
    """Keys grouped by domain, in the order given, for `keys_for`; the same selector twice
    for a domain is a DkimConfigError (DNS holds one key per selector)."""
    out: dict[str, tuple[DkimKey, ...]] = {}
    for key in keys:
        got = out.get(key.domain, ())
        if any(k.selector == key.selector for k in got):
            raise DkimConfigError(f"dkim: two keys for {key.name}: one selector, one key")
        out[key.domain] = (*got, key)
    return out


def keys_for(message_from_domain: str, keys: Mapping[str, Sequence[DkimKey]]) -> Sequence[DkimKey]:
    """The keys that sign a message whose header From is at `message_from_domain`: those of
    that domain, else of its nearest configured parent; () when none. `keys` is keyed by
    `DkimKey.domain` (lowercase, see `by_domain`)."""
    name = message_from_domain.strip().lower().removesuffix(".")
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError:
            return ()
    labels = name.split(".")
    for i in range(len(labels) - 1):
        found = keys.get(".".join(labels[i:]))
        if found:
            return tuple(found)
    return ()


def header_from_domain(message: bytes) -> str | None:
    """The lowercase domain of the message's header From, for `keys_for`; None when there is
    no From, several From fields, no address, or addresses of different domains."""
    head, _ = split_message(message)
    froms = [v for n, v in parse_headers(head) if n.lower() == "from"]
    if len(froms) != 1:
        return None
    domains = set()
    for _, addr in email.utils.getaddresses(froms):
        local, at, domain = addr.rpartition("@")
        if not (local and at and domain):
            return None
        domains.add(domain.strip().lower().removesuffix("."))
    return domains.pop() if len(domains) == 1 else None


# -- signing ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _private(algorithm: Algorithm, private_key: bytes) -> Any:
    """The key as dkimpy's signer takes it (parsed once per key)."""
    if algorithm == "rsa-sha256":
        return dkim.crypto.parse_pem_private_key(private_key)
    return nacl.signing.SigningKey(private_key, encoder=nacl.encoding.Base64Encoder)


def _signed_names(present: Sequence[bytes], headers: Sequence[str]) -> list[bytes]:
    """h=: each listed field as often as it occurs (at least once: an absent field is signed
    as absent), plus one for each extra listing (oversigning)."""
    listed: dict[bytes, int] = {}
    for h in headers:
        name = h.lower().encode("ascii")
        listed[name] = listed.get(name, 0) + 1
    out: list[bytes] = []
    for name, times in listed.items():
        out += [name] * max(present.count(name) + times - 1, 1)
    return out


_BARE = "the message has a bare CR or LF: only CRLF line ends can be signed"
_WSP_RUN = re.compile(rb"[\t ]+")  # one character class, no nesting: linear
_WSP_EOL = re.compile(rb"[\t ]+\r\n")


class RelaxedBodyHash:
    """The SHA-256 of a body under relaxed canonicalization (RFC 6376 §3.4.4), fed in
    blocks of any size, byte for byte what dkimpy computes from the whole body: white space
    before each CRLF removed, other runs of it one space, empty lines at the end dropped,
    an empty body hashed as empty. Only one partial line and a count of pending empty
    lines are held, so a large stored message is never in memory whole. A bare CR or LF
    raises DkimSignError (as `sign`)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._tail = b""  # the unfinished last line
        self._empty = 0  # empty lines seen since the last line with text

    def update(self, block: bytes) -> None:
        data = self._tail + block if self._tail else block
        cut = data.rfind(b"\r\n")
        if cut < 0:
            self._tail = data
            return
        self._tail = data[cut + 2 :]
        lines = data[: cut + 2]
        crlf = lines.count(b"\r\n")
        if lines.count(b"\r") != crlf or lines.count(b"\n") != crlf:
            raise DkimSignError(_BARE)
        canon = _WSP_RUN.sub(b" ", _WSP_EOL.sub(b"\r\n", lines))
        text = canon.rstrip(b"\r\n")  # only CRLF pairs are left: whole empty lines
        if not text:
            self._empty += len(canon) // 2
            return
        self._h.update(b"\r\n" * self._empty + text + b"\r\n")
        self._empty = (len(canon) - len(text)) // 2 - 1

    def digest(self) -> bytes:
        tail = self._tail
        if tail:  # a last line without CRLF: dkimpy ends it with one (its WSP stays, as one)
            if b"\r" in tail or b"\n" in tail:
                raise DkimSignError(_BARE)
            self._h.update(b"\r\n" * self._empty + _WSP_RUN.sub(b" ", tail) + b"\r\n")
            self._tail, self._empty = b"", 0
        return self._h.digest()


_FIELD_NAME = re.compile(rb"([\x21-\x7e]+?):")  # dkimpy's; anchored, one class: linear


def _rfc822_parse(message: bytes) -> tuple[list[list[bytes]], bytes]:
    """dkimpy's `rfc822_parse` (the same fields, values and body, the same refusals), in
    linear time: it grows a field's value by `+=` per continuation line, a copy of the
    whole value each time (a 1 MiB folded field: seconds of CPU in a signing thread)."""
    names: list[bytes] = []
    values: list[list[bytes]] = []
    lines = re.split(b"\r?\n", message)
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line:  # the end of the header block; the body follows the empty line
            break
        if line[0] in (0x09, 0x20):
            if not values:
                raise dkim.MessageFormatError("a continuation line before any header field")
            values[-1] += (line, b"\r\n")
            continue
        m = _FIELD_NAME.match(line)
        if m is not None:
            names.append(m.group(1))
            values.append([line[m.end(0) :], b"\r\n"])
        elif not line.startswith(b"From "):
            raise dkim.MessageFormatError(f"Unexpected characters in RFC822 header: {line!r}")
    headers = [[n, b"".join(v)] for n, v in zip(names, values, strict=True)]
    return headers, b"\r\n".join(lines[i:])


class _Signer(dkim.DKIM):  # type: ignore[misc]
    """dkimpy's DKIM.sign with our own t= (and no i=, q=, l=), and its message parser
    replaced by a linear one (`_rfc822_parse`)."""

    def set_message(self, message: bytes | None) -> None:
        super().set_message(None)
        if message:
            self.headers, self.body = _rfc822_parse(message)

    def sign_with(self, key: DkimKey, t: int, body_hash: bytes | None = None) -> bytes:
        alg = key.algorithm.encode("ascii")
        self.signature_algorithm = alg
        self.hasher = dkim.HASH_ALGORITHMS[alg]
        policy = dkim.canonicalization.CanonicalizationPolicy.from_c_value(_CANON)
        present = [name.lower() for name, _ in self.headers]
        include = _signed_names(present, key.headers)
        if body_hash is None:
            body_hash = self.hasher(policy.canonicalize_body(self.body)).digest()
        fields = [
            (b"v", b"1"),
            (b"a", alg),
            (b"c", _CANON),
            (b"d", key.domain.encode("ascii")),
            (b"s", key.selector.encode("ascii")),
            (b"t", str(t).encode("ascii")),
            (b"h", b" : ".join(include)),
            (b"bh", base64.b64encode(body_hash)),
            # a placeholder as long as a signature line, so b= folds onto its own line
            (b"b", b"0" * 60),
        ]
        pk = _private(key.algorithm, key.private_key)
        value = self.gen_header(fields, include, policy, b"DKIM-Signature", pk)
        return b"DKIM-Signature: " + cast(bytes, value)


def sign(
    message: bytes,
    keys: Sequence[DkimKey],
    *,
    now: int | None = None,
    body_hash: bytes | None = None,
) -> bytes:
    """The DKIM-Signature fields for `message` (CRLF line ends), one per key, to put in front
    of it: the signed message is `sign(message, keys) + message`. b"" without keys.
    With `body_hash` (a `RelaxedBodyHash` digest of a body streamed apart), `message` is the
    header block and its empty line alone, and the signatures are those of the header block
    followed by that body."""
    if not keys:
        return b""
    crlf = message.count(b"\r\n")
    if message.count(b"\r") != crlf or message.count(b"\n") != crlf:
        raise DkimSignError(_BARE)
    if body_hash is not None and not message.endswith(b"\r\n\r\n"):
        raise DkimSignError("a body hash goes with a header block that ends in an empty line")
    try:
        signer = _Signer(message)
    except Exception as e:
        raise DkimSignError(f"the message header cannot be parsed for signing: {e}") from e
    froms = sum(1 for name, _ in signer.headers if name.lower() == b"from")
    if froms != 1:
        what = "no From field" if froms == 0 else f"{froms} From fields"
        raise DkimSignError(
            f"the message has {what}; DKIM signs for the one From (RFC 5322 §3.6, RFC 6376 §5.4)"
        )
    t = int(time.time() if now is None else now)
    out = []
    for key in keys:
        try:
            out.append(signer.sign_with(key, t, body_hash))
        except Exception as e:
            raise DkimSignError(f"DKIM signing as {key.name} ({key.algorithm}) failed: {e}") from e
    return b"".join(out)
