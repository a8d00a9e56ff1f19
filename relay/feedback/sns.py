"""Amazon SNS message signatures (`feedback.providers.ses.verify_signatures`).

Rules (AWS, "Verifying the signatures of Amazon SNS messages"):
- The signed text is `name\\nvalue\\n` for a fixed list of fields in byte order of their
  names: a Notification signs Message, MessageId, Subject (only when present), Timestamp,
  TopicArn, Type; a SubscriptionConfirmation or UnsubscribeConfirmation signs Message,
  MessageId, SubscribeURL, Timestamp, Token, TopicArn, Type.
- `Signature` is base64 of an RSA PKCS#1 v1.5 signature over that text, SHA1 for
  `SignatureVersion` "1", SHA256 for "2"; the key is in the X.509 certificate at
  `SigningCertURL`.
- That URL is fetched only when it is https, on the default port, on a host
  `sns.<region>.amazonaws.com` (or `.amazonaws.com.cn`) or one the operator lists in
  `signing_cert_hosts` (exact `host` or `host:port`), with a path ending in `.pem`: anyone
  can sign with a certificate of their own, so where it comes from is the check.
- The certificate must be valid now. Certificates are kept in memory by URL (at most 32):
  AWS rotates them rarely, and a notification burst must not fetch once per message.
- A missing or malformed field, an unknown version, a refused URL or a signature that does
  not verify is a `SignatureError` (HTTP 401); a certificate that cannot be fetched now
  (network, TLS, HTTP status) is a `CertFetchError` (HTTP 503: SNS retries).
"""

from __future__ import annotations

import base64
import binascii
import ssl
import urllib.parse
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from relay.feedback.providers import SignatureError

__all__ = ["CertCache", "CertFetchError", "check_cert_url", "string_to_sign", "verify"]

_NOTIFICATION = ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type")
_CONFIRMATION = ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type")
_FIELDS = {
    "Notification": _NOTIFICATION,
    "SubscriptionConfirmation": _CONFIRMATION,
    "UnsubscribeConfirmation": _CONFIRMATION,
}
_HASHES: dict[str, type[hashes.HashAlgorithm]] = {"1": hashes.SHA1, "2": hashes.SHA256}
MAX_CERT = 64 * 1024  # octets; AWS's certificates are about 2 KiB
CACHE_SIZE = 32
FETCH_TIMEOUT = 5.0  # seconds


class CertFetchError(Exception):
    """The signing certificate could not be fetched now: a transient failure (HTTP 503)."""


def string_to_sign(doc: dict[str, Any]) -> bytes:
    kind = doc.get("Type")
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise SignatureError(f"no SNS message Type to check the signature of ({kind!r})")
    out = []
    for name in fields:
        value = doc.get(name)
        if value is None and name == "Subject":
            continue  # signed only when the notification has one
        if not isinstance(value, str):
            raise SignatureError(f"the signed field {name} is missing or not a string")
        out.append(f"{name}\n{value}\n")
    return "".join(out).encode("utf-8")


def check_cert_url(url: str, extra_hosts: tuple[str, ...] = ()) -> None:
    """Raise SignatureError unless `url` is where an SNS signing certificate may come from."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError:
        raise SignatureError(f"SigningCertURL is not a URL: {url[:200]!r}") from None
    host = (u.hostname or "").lower()
    if u.scheme != "https" or u.username is not None or u.password is not None:
        raise SignatureError(f"SigningCertURL must be a plain https URL: {url[:200]!r}")
    if not u.path.endswith(".pem") or u.query or u.fragment:
        raise SignatureError(f"SigningCertURL must name a .pem file: {url[:200]!r}")
    named = host if port is None else f"{host}:{port}"
    if named in extra_hosts:
        return
    if port is None and _aws_sns_host(host):
        return
    raise SignatureError(
        f"SigningCertURL host {named!r} is not sns.<region>.amazonaws.com"
        " (nor in signing_cert_hosts)"
    )


def _aws_sns_host(host: str) -> bool:
    labels = host.split(".")
    if labels[2:] not in (["amazonaws", "com"], ["amazonaws", "com", "cn"]):
        return False
    region = labels[1] if len(labels) > 1 else ""
    return labels[0] == "sns" and region != "" and all(c.isalnum() or c == "-" for c in region)


def verify(doc: dict[str, Any], cert: x509.Certificate, now: datetime | None = None) -> None:
    """Raise SignatureError unless `doc`'s Signature verifies with `cert`'s key."""
    version = doc.get("SignatureVersion")
    algorithm = _HASHES.get(version) if isinstance(version, str) else None
    if algorithm is None:
        raise SignatureError(f"unknown SNS SignatureVersion {version!r} (known: 1, 2)")
    sig_b64 = doc.get("Signature")
    if not isinstance(sig_b64, str):
        raise SignatureError("no Signature in the SNS message")
    try:
        signature = base64.b64decode(sig_b64, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("the SNS Signature is not base64") from None
    text = string_to_sign(doc)
    moment = now or datetime.now(UTC)
    if not cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc:
        raise SignatureError("the SNS signing certificate is not valid now")
    key = cert.public_key()
    if not isinstance(key, rsa.RSAPublicKey):
        raise SignatureError("the SNS signing certificate does not hold an RSA key")
    try:
        key.verify(signature, text, padding.PKCS1v15(), algorithm())
    except InvalidSignature:
        raise SignatureError("the SNS signature does not match the message") from None


class CertCache:
    """Signing certificates by URL, fetched over https with `ca_file` (None: the system's
    trust store)."""

    def __init__(self, ca_file: Path | None = None) -> None:
        self.ca_file = ca_file
        self._certs: OrderedDict[str, x509.Certificate] = OrderedDict()
        self.fetches = 0  # how many times a certificate was fetched (tests, metrics)

    async def get(self, url: str) -> x509.Certificate:
        cert = self._certs.get(url)
        if cert is not None:
            self._certs.move_to_end(url)
            return cert
        cert = await self._fetch(url)
        self._certs[url] = cert
        while len(self._certs) > CACHE_SIZE:
            self._certs.popitem(last=False)
        return cert

    async def _fetch(self, url: str) -> x509.Certificate:
        self.fetches += 1
        ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        try:
            async with (
                httpx.AsyncClient(verify=ctx, timeout=FETCH_TIMEOUT, trust_env=False) as client,
                client.stream("GET", url) as resp,
            ):
                if resp.status_code != 200:
                    raise CertFetchError(f"{url}: HTTP {resp.status_code}")
                body = b""
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_CERT:
                        raise SignatureError(f"{url}: more than {MAX_CERT} octets")
        except httpx.HTTPError as e:
            raise CertFetchError(f"{url}: {type(e).__name__}: {e}") from None
        try:
            return x509.load_pem_x509_certificate(body)
        except ValueError:
            raise SignatureError(f"{url}: not a PEM certificate") from None
