"""One-click unsubscribe (RFC 8058, RFC 2369): the List-Unsubscribe headers the relay adds to
mail of an identity that has `unsubscribe` configured, and the tokens their links carry.

Rules:
- A token names (identity, recipient), both lowercased, and carries a MAC, so it cannot be
  forged and one recipient's token says nothing about another's. The format is
  `1.<payload>.<mac>`: `payload` is base64url (no padding) of the UTF-8 text
  `identity NUL recipient`; `mac` is base64url of HMAC-SHA256(secret, MAC_LABEL + "1." +
  payload) truncated to 128 bits. The MAC covers the token's text as written, so a token has
  exactly one spelling. The token is signed, not encrypted: anyone holding it can read the
  recipient (it sits in the recipient's own mail). Tokens do not expire: an unsubscribe link
  in an old message still works, as mailbox providers expect. Rotating an identity's secret
  invalidates every token of it that is out there.
- The secret that verifies a token is the one of the identity named IN the token; a token
  naming an identity without `unsubscribe` configured is refused. A secret shorter than
  MIN_SECRET bytes is refused too (config should reject it; 32 random bytes is right).
- `add_headers` leaves a message that already has a List-Unsubscribe alone (the app's own
  wins) and otherwise inserts, above the first header line (the rest byte for byte):
  `List-Unsubscribe: <URL/TOKEN>, <mailto:ADDR?subject=unsubscribe%20TOKEN>` (folded between
  the two URIs past 78 columns; never inside the angle brackets, RFC 2369 §2) and, only when
  the URL is https, `List-Unsubscribe-Post: List-Unsubscribe=One-Click` (RFC 8058 §3.1).
  RFC 8058 §4 wants both covered by a DKIM signature: sign after adding them.
- The headers name ONE recipient, so a message carrying them goes to that recipient alone:
  the engine must send one transaction per recipient for an identity with `unsubscribe`
  configured (as it already does for `feedback.verp`: key the job by recipient row), and call
  `add_headers` per transaction. A header holding one recipient's token must never reach
  another recipient: anyone who can read it can unsubscribe that recipient.
- HTTP, under `path_prefix` (`/u/` by default): relay/authenticity/unsubscribe_http.py (this
  module is the pure part: tokens and headers; no I/O).
- Mail to the `mailto` address: `mailto_token` finds the token in a Subject
  `unsubscribe TOKEN` (any case, a `Re:` in front is fine); the daemon checks it with
  `read_token` and suppresses as the POST does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping

# a config value (identities.<name>.unsubscribe), named here too
from relay.config.records import UNSUBSCRIBE_MIN_SECRET
from relay.config.records import UnsubscribeConf as UnsubscribeConf
from relay.mail.message import header, parse_headers, split_message

VERSION = "1"
MAX_TOKEN = 800  # two RFC 5321 addresses of 254 octets make a 704-character token
MIN_SECRET = UNSUBSCRIBE_MIN_SECRET  # the config refuses a shorter key
MAC_BYTES = 16  # HMAC-SHA256 truncated to 128 bits
MAC_LABEL = b"relay-unsubscribe\n"  # domain separation, should the key serve elsewhere too
ONE_CLICK = "List-Unsubscribe=One-Click"
MAX_FORM = 64 * 1024  # a one-click body is a few dozen bytes
SOURCE = "unsubscribe"

_B64 = re.compile(r"[A-Za-z0-9_-]+")
_SUBJECT = re.compile(r"(?<![A-Za-z0-9])unsubscribe(?:\s+|%20)([A-Za-z0-9_.-]+)", re.IGNORECASE)
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_.-]+")


# --- tokens -------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, signed: str) -> str:
    digest = hmac.new(secret, MAC_LABEL + signed.encode("ascii"), hashlib.sha256).digest()
    return _b64(digest[:MAC_BYTES])


def make_token(secret: bytes, identity: str, recipient: str) -> str:
    """The token naming (identity, recipient), lowercased. ValueError for a secret shorter
    than MIN_SECRET, an empty or NUL-holding part, or a pair too long for MAX_TOKEN."""
    if len(secret) < MIN_SECRET:
        raise ValueError(f"unsubscribe secret shorter than {MIN_SECRET} bytes")
    identity, recipient = identity.lower(), recipient.lower()
    if not identity or not recipient or "\x00" in identity or "\x00" in recipient:
        raise ValueError("identity and recipient must be non-empty and hold no NUL")
    payload = identity.encode("utf-8") + b"\x00" + recipient.encode("utf-8")
    signed = f"{VERSION}.{_b64(payload)}"
    token = f"{signed}.{_mac(secret, signed)}"
    if len(token) > MAX_TOKEN:
        raise ValueError(f"identity and recipient too long for a token ({len(token)} chars)")
    return token


def parse_token(token: str) -> tuple[str, str, str, str] | None:
    """(signed part, mac, identity, recipient) of a well-formed token, MAC NOT checked."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN or not token.isascii():
        return None
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        return None
    _, payload, mac = parts
    if not _B64.fullmatch(payload) or not _B64.fullmatch(mac):
        return None
    try:
        text = _unb64(payload).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    identity, nul, recipient = text.partition("\x00")
    if not nul or not identity or not recipient or "\x00" in recipient:
        return None
    return f"{VERSION}.{payload}", mac, identity, recipient


def read_token(secret: bytes, token: str) -> tuple[str, str] | None:
    """(identity, recipient) of a token made with `secret`; None for anything else (never
    raises; the MAC is compared in constant time)."""
    parsed = parse_token(token)
    if parsed is None or not isinstance(secret, bytes) or len(secret) < MIN_SECRET:
        return None
    signed, mac, identity, recipient = parsed
    if not hmac.compare_digest(_mac(secret, signed).encode(), mac.encode()):
        return None
    return identity, recipient


def verify(confs: Mapping[str, UnsubscribeConf], token: str) -> tuple[str, str] | str:
    """(identity, recipient) of a valid token, checked with the secret of the identity the
    token names (a token for an identity without unsubscribe is invalid); else why not."""
    parsed = parse_token(token)
    if parsed is None:
        return "malformed token"
    conf = confs.get(parsed[2])
    if conf is None:
        return "no unsubscribe configured for the identity"
    pair = read_token(conf.secret, token)
    return "bad signature" if pair is None else pair


def mailto_token(subject: str, local_part_token: str | None = None) -> str | None:
    """The token of a mail to the unsubscribe address: from a Subject `unsubscribe TOKEN`
    (any case; a `Re:` or tag in front is fine), else `local_part_token` (the daemon may take
    one from the address, e.g. a plus suffix), else None. `subject` is the decoded header
    value (RFC 2047 words decoded). Only the shape is checked: verify it with `read_token`."""
    m = _SUBJECT.search(subject[: MAX_TOKEN + 1024])
    if m is not None:
        found = m.group(1).rstrip(".")  # a token never ends with "."; a sentence may
        if found and len(found) <= MAX_TOKEN:
            return found
    if (
        local_part_token
        and len(local_part_token) <= MAX_TOKEN
        and _TOKEN_CHARS.fullmatch(local_part_token)
    ):
        return local_part_token
    return None


# --- headers ------------------------------------------------------------------------------


def _fold(name: str, items: list[str]) -> str:
    """`name: a, b` with a fold (CRLF + space) before an item that would pass 78 columns;
    never inside an item (RFC 2369 §2: no whitespace inside the angle brackets)."""
    lines: list[str] = []
    line = f"{name}: {items[0]}"
    for item in items[1:]:
        if len(line) + 2 + len(item) <= 78:
            line += ", " + item
        else:
            lines.append(line + ",")
            line = " " + item
    lines.append(line)
    return "\r\n".join(lines) + "\r\n"


def _mailto_uri(mailto: str, token: str) -> str:
    addr = mailto[7:] if mailto[:7].lower() == "mailto:" else mailto
    sep = "&" if "?" in addr else "?"
    return f"<mailto:{addr}{sep}subject=unsubscribe%20{token}>"


def add_headers(
    message: bytes, conf: UnsubscribeConf, identity: str, recipient: str
) -> bytes | None:
    """`message` with List-Unsubscribe (and, for an https URL, List-Unsubscribe-Post) for
    `recipient` below its trace fields (`Received:`, `Return-Path:`: they stay on top, RFC
    5322 §3.6.7) and above every other header line; None when it already has a List-Unsubscribe or
    `conf` has neither url nor mailto. The headers name one recipient: send the result to
    that recipient alone (see the module rules). ValueError as `make_token`."""
    if not conf.url and not conf.mailto:
        return None
    head, _ = split_message(message)
    headers = parse_headers(head)
    if header(headers, "List-Unsubscribe") is not None:
        return None
    token = make_token(conf.secret, identity, recipient)
    uris: list[str] = []
    if conf.url:
        uris.append(f"<{conf.url.rstrip('/')}/{token}>")
    if conf.mailto:
        uris.append(_mailto_uri(conf.mailto, token))
    added = _fold("List-Unsubscribe", uris)
    https = conf.url is not None and conf.url[:8].lower() == "https://"
    if https and header(headers, "List-Unsubscribe-Post") is None:
        added += f"List-Unsubscribe-Post: {ONE_CLICK}\r\n"
    at = _after_trace(message)
    return message[:at] + added.encode("utf-8") + message[at:]


def _after_trace(message: bytes) -> int:
    """The offset of the first header line that is not a trace field (or its continuation)."""
    pos = 0
    in_trace = False
    while pos < len(message):
        end = message.find(b"\r\n", pos)
        if end < 0:
            return pos
        line = message[pos:end]
        if not line:
            return pos
        if line[:1] in (b" ", b"\t"):
            if not in_trace:
                return pos
        else:
            name = line.split(b":", 1)[0].strip().lower()
            in_trace = name in (b"received", b"return-path")
            if not in_trace:
                return pos
        pos = end + 2
    return pos
