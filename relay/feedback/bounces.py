"""Bounces and complaints that come back by mail, and VERP return addresses (pure).

Rules:
- `parse_feedback_mail` reads one message sent to `feedback.address` and says what it
  reports, as `FeedbackEvent`s of provider "mail"; it never acts (apply.py does) and never
  raises anything but `FeedbackError` (the daemon keeps such a message for the operator).
- Three shapes, tried in this order: an ARF complaint (RFC 5965: a message/feedback-report
  part), a DSN (RFC 3464 message/delivery-status, RFC 6533 message/global-delivery-status),
  and, best effort, the plain-text failure notices of MTAs that send no DSN (qmail, Exim,
  Exchange, sendmail transcripts), recognised by their sender (MAILER-DAEMON, postmaster,
  Auto-Submitted) with their subject or wording, or by both of these. A DSN whose machine
  part names no address (a pipe, a file) is read as such a notice too.
  Anything else is a FeedbackError; so is a failure notice in which no recipient can be
  read (`UnreadableNotice`, so that a caller that knows the recipient, VERP, may count it).
- In a notice, an address is tied to the lines that follow the line that introduces it
  (qmail `<a@b>:`, Exim's indented `a@b`, Exchange's `a@b` / `<mailto:a@b>`, Postfix's
  `<a@b>: ...`, a transcript's `RCPT TO:<a@b>`), up to the next such line; with an Exim
  X-Failed-Recipients header only the addresses it lists count. A notice that introduces
  none but mentions exactly one address (the sender's and role mailboxes aside) is about
  that one. DSN fields in the text of a notice (a DSN that lost its MIME structure on the
  way) are read as a DSN.
- A hard bounce needs a permanent code tied to an address: a DSN's `Action: failed` with a
  5.x.x Status (without a Status, a 5xx Diagnostic-Code); in a failure notice, a 5xx reply
  or 5.x.x status in the lines that follow that address. `failed` with 4.x.x, `delayed`, a
  4xx, a delay warning, or a failed address without a code is a soft bounce.
  `delivered` / `relayed` / `expanded` (and any other Action without a 4/5 status) and
  ARF `not-spam` / `auth-failure` are understood and yield nothing ([]); every other
  feedback type (abuse, fraud, virus, other, opt-out, ...) is a complaint.
- The recipient is the address the report names as we sent it: a DSN's Original-Recipient
  when it has one (the address before an alias or forward), else its Final-Recipient; an
  ARF's Original-Rcpt-To, else the original's To when it names one address. Addresses are
  kept as written. message_id is the original's Message-ID (the report's third part, or
  the headers a notice copies); reason the Diagnostic-Code, or the notice's lines with the
  code, at most 500 characters; status the RFC 3463 code.
- event_id = content_id(the report's own Message-ID, recipient, type), or, for a report
  without a Message-ID, content_id("sha256:" + the raw bytes' sha256, recipient, type): the
  same report mailed twice is applied once (apply.py dedups).
- Bounded work whatever the input: the first 4 MiB are parsed (the report parts and the
  original's headers come first); a message of more than 100 MIME parts (attached
  messages' parts included; counted on the bytes before parsing, `mime_bound`, and on the
  tree after, `tree_bound`) or nested deeper than 10 is `PastBound` (kept unread, never
  parsed further; the parse itself runs in relay/feedback/worker.py's child within a time
  budget); the parts of an attached message are never searched; 1 MiB of text is
  searched, 1000 recipients a report are read, header values are capped
  (`regex_guard.bounded`), and every pattern here is linear (no unbounded
  repetition; tests/feedback/test_bounces.py runs `check_linear` and hostile text on each).
  Text declared in a charset whose decoder is not linear (idna, punycode) is read as UTF-8.
- The stdlib `email` package reads the message with compat32 rules, except that header
  values stay as received (undecodable bytes decoded here as UTF-8, RFC 6532): nothing is
  trusted from it but the structure, and everything is checked on what the message says.
- VERP: `<local>+<queue id>-<row id>-<mac>@<domain>`, all lower case so that an MTA that
  lowercases local parts does not break it (only letters, digits and '-', dot-atom safe).
  mac = 10 base32 characters (50 bits) of HMAC-SHA256 under the operator's key over the
  queue id and row id: a token cannot be made, altered or enumerated without the key.
  `verp_decode` compares in constant time and returns None for anything else.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import dataclasses
import hashlib
import hmac
import re
from email import message_from_bytes
from email.header import decode_header
from email.message import Message
from email.parser import HeaderParser
from email.policy import Compat32

from relay.feedback.events import EventType, FeedbackError, FeedbackEvent, content_id
from relay.mail.regex_guard import bounded

PROVIDER = "mail"
MAX_PARSE = 4 * 1024 * 1024  # bytes of a message given to the MIME parser
MAX_PARTS = 100  # MIME parts looked at
MAX_DEPTH = 10  # multipart nesting followed
MAX_TEXT = 1024 * 1024  # characters of text searched (a notice, a report part)
MAX_LINE = 1000  # characters of one line of a notice that the patterns see
MAX_RECIPIENTS = 1000  # recipient blocks read from one report
MAX_REASON = 500
MAX_BLOCK_LINES = 40  # lines after an address in a notice that can hold its code
MAX_ID = 998  # a Message-ID longer than a header line is not one
MAX_RECEIVED = 50  # Received lines of a returned original searched for our queue id

VERP_MAC_CHARS = 10
VERP_MAX_TOKEN = 16 + 1 + 19 + 1 + VERP_MAC_CHARS  # queue id, row id (< 2**63), mac
_VERP_CONTEXT = b"relay-verp-v1\x00"
_B32 = frozenset("abcdefghijklmnopqrstuvwxyz234567")
_HEX = frozenset("0123456789abcdef")
_MAX_ROW_ID = 2**63 - 1
_ATEXT = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*/=?^_`{|}~-+"
)


class PastBound(FeedbackError):
    """A message past one of the bounds on its structure (MAX_PARTS, MAX_DEPTH) or on the
    time its parse may take: kept for the operator unread, never parsed further."""


class UnreadableNotice(FeedbackError):
    """A failure notice (a bounce by its sender and wording) that names no recipient this
    module can read. Kept for the operator like any FeedbackError; a caller that knows the
    recipient another way (a VERP envelope recipient) may count it as a soft bounce."""


# --- patterns (linear: no unbounded repetition, fixed-width lookarounds) ------------------

# an SMTP reply code that says the delivery failed: "said: 550 ...", "#550 5.1.1", "'451 ..."
_CODE = re.compile(r"(?<![0-9A-Za-z.=+/@-])([45])[0-9]{2}(?![0-9A-Za-z@]|\.[0-9])")
# an RFC 3463 enhanced status code: "5.1.1", "(#5.5.0)"; not a version or an IP address
_STATUS = re.compile(r"(?<![0-9A-Za-z.])[245]\.[0-9]{1,3}\.[0-9]{1,3}(?![0-9A-Za-z]|\.[0-9])")
# a plain address as notices write them (checked whole, on a token of at most 320 chars)
_ADDR = re.compile(
    r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){1,10}"
)
# an address inside prose: starts where a run of atext starts (so each run is tried once)
_ADDR_IN_TEXT = re.compile(
    r"(?<![A-Za-z0-9!#$%&'*+/=?^_`{|}~.-])[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}"
    r"@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){1,10}"
)
# a multipart boundary parameter (RFC 2046 §5.1.1: 1 to 70 characters), quoted or a token;
# folding (CRLF and space) around the "=" included
_BOUNDARY_PARAM = re.compile(
    rb'(?i)boundary\s{0,20}=\s{0,20}(?:"([^"\r\n]{1,200})"|([^\s;"]{1,200}))'
)
# the same in RFC 2231's extended or continued form: boundary*=utf-8''x, boundary*0=x
_BOUNDARY_2231 = re.compile(rb"(?i)boundary\*")
# a line that may be a boundary delimiter: "--" and at most 200 more characters of it
_DASH_LINE = re.compile(rb"(?m)^--([^\r\n]{0,200})")
# our own Received line in a returned original (relay/mail/message.py received_header)
_OUR_RECEIVED = re.compile(r"\(relay\) with [A-Za-z]{1,20} id ([0-9A-Fa-f]{16})(?![0-9A-Za-z])")
# RFC 6533 embedded-unicode-char in a utf-8 address: \x{E9}
_UNITEXT = re.compile(r"\\x\{([0-9A-Fa-f]{1,6})\}")

PATTERNS: dict[str, re.Pattern[str]] = {
    "_CODE": _CODE,
    "_STATUS": _STATUS,
    "_ADDR": _ADDR,
    "_ADDR_IN_TEXT": _ADDR_IN_TEXT,
    "_UNITEXT": _UNITEXT,
    "_OUR_RECEIVED": _OUR_RECEIVED,
}

# --- the wording of failure notices (lower case, matched as substrings) -------------------

_DAEMON_SENDERS = (
    "mailer-daemon",
    "mailer_daemon",
    "mailerdaemon",
    "mail-daemon",
    "postmaster",
    "mail delivery system",
    "mail delivery subsystem",
    "mdaemon",
)
_NOTICE_SUBJECTS = (
    "undelivered mail",
    "undeliverable",
    "undelivered message",
    "mail delivery failed",
    "mail delivery failure",
    "delivery failure",
    "delivery status notification",
    "delivery notification",
    "delivery has failed",
    "failure notice",
    "returned mail",
    "returned to sender",
    "could not be delivered",
    "message not delivered",
    "non-deliverable",
    "nondeliverable",
    "mail system error",
    "mail failed",
    "delayed mail",
    "delivery delayed",
    "warning: message",
    "non remis",
    "unzustellbar",
)
_NOTICE_TEXT = (
    "this is the qmail-send program",
    "created automatically by mail delivery software",
    "delivery has failed to these recipients",
    "did not reach the following recipient",
    "remote server returned",
    "could not be delivered to",
    "the following address(es) failed",
    "wasn't able to deliver your message",
    "transcript of session follows",
    "permanent fatal errors",
    "delivery to the following recipient",
    "has not yet been delivered",
)
_DELAY_SUBJECTS = ("delay", "warning:")
_DELAY_TEXT = (
    "has not yet been delivered",
    "delivery attempts will continue",
    "will continue to try",
    "is still being retried",
    "delivery has been delayed",
    "delivery is delayed",
)
# the line after which a notice copies the original (its headers give the Message-ID)
_COPY_MARKERS = (
    "below this line is a copy of the message",  # qmail
    "below this line is a copy of the mail header",
    "below the next line is a copy of the message",
    "this is a copy of the message",  # exim ("... including all the headers", "'s headers")
    "original message headers",  # exchange
    "original message follows",
    "unsent message follows",  # sendmail
    "message headers follow",  # dma
    "----- original message -----",
    "-----original message-----",
    "headers of the original message",
    "content-type: message/rfc822",
)
_DSN_TYPES = ("message/delivery-status", "message/global-delivery-status")
_ARF_TYPE = "message/feedback-report"
_ORIGINAL_TYPES = (
    "message/rfc822",
    "message/global",
    "text/rfc822-headers",
    "message/global-headers",
    "message/rfc822-headers",
)
_ATTACHED_TYPES = ("message/rfc822", "message/global", "message/news")
_SLOW_CODECS = frozenset({"idna", "punycode"})
_ADDRESS_HEADERS = frozenset(
    f"{h}:"
    for h in (
        "to",
        "cc",
        "bcc",
        "from",
        "sender",
        "reply-to",
        "return-path",
        "delivered-to",
        "x-original-to",
        "envelope-to",
        "x-failed-recipients",
    )
)
_ROLE_MAILBOXES = frozenset({"postmaster", "mailer-daemon", "abuse", "hostmaster", "root"})


class _AsReceived(Compat32):
    """compat32, but a header value comes back as the str the parser stored (undecodable
    bytes as surrogate escapes) rather than an `email.header.Header`, so that UTF-8 fields
    (RFC 6532, 6533) can be decoded here instead of being replaced by U+FFFD."""

    def header_fetch_parse(self, name: str, value: str) -> str:
        return value


_POLICY = _AsReceived()


# --- the entry point -----------------------------------------------------------------------


def parse_feedback_mail(data: bytes) -> list[FeedbackEvent]:
    """The events a bounce or complaint mailed to the feedback address reports; [] when it
    is a report that asks for nothing (delivered, not-spam). FeedbackError otherwise."""
    try:
        return _parse(data)
    except FeedbackError:
        raise
    except Exception as e:  # the email package is lenient, not exception-free: keep the mail
        raise FeedbackError(f"unreadable message ({type(e).__name__})") from None


def _parse(data: bytes) -> list[FeedbackEvent]:
    if not data or not data.strip():
        raise FeedbackError("empty message")
    head = bytes(data[:MAX_PARSE])
    too_much = mime_bound(head)  # before the parser builds 100k parts, not after
    if too_much is not None:
        raise PastBound(too_much)
    msg = message_from_bytes(head, policy=_POLICY)
    too_much = tree_bound(msg)
    if too_much is not None:
        raise PastBound(too_much)
    report_mid = _message_id(_header(msg, "Message-ID"))
    digest = None if report_mid else "sha256:" + hashlib.sha256(data).hexdigest()
    ctx = _Ctx(report_mid=report_mid, digest=digest)
    parts = _parts(msg)
    return _with_queue_id(_events(msg, parts, ctx), parts)


def _events(msg: Message, parts: list[Message], ctx: _Ctx) -> list[FeedbackEvent]:
    for i, part in enumerate(parts):
        if part.get_content_type() == _ARF_TYPE:
            return _arf_events(part, _original(parts[i + 1 :]), ctx)
    for i, part in enumerate(parts):
        if part.get_content_type() in _DSN_TYPES:
            events = _dsn_events(part, _original(parts[i + 1 :]), ctx)
            if events is not None:
                return events
            # no recipient with an address: perhaps the notice's text names one
            return _notice_events(msg, parts, ctx, report=True)
    return _notice_events(msg, parts, ctx)


def _with_queue_id(events: list[FeedbackEvent], parts: list[Message]) -> list[FeedbackEvent]:
    """Our queue id, when the returned original's headers carry our Received line
    (relay/mail/message.py received_header: `by <host> (relay) with ESMTP id <queue id>`): with
    the Message-ID, what ties a report to one of our messages (apply.py)."""
    if not events:
        return events
    original = _original(parts)
    if original is None:
        return events
    qid = None
    for value in (original.get_all("Received") or [])[:MAX_RECEIVED]:
        m = _OUR_RECEIVED.search(_clean(value)[:MAX_LINE])
        if m is not None:
            qid = m.group(1).upper()
            break
    if qid is None:
        return events
    return [e if e.queue_id else dataclasses.replace(e, queue_id=qid) for e in events]


# --- bounds on the MIME structure --------------------------------------------------------------


def mime_bound(head: bytes) -> str | None:
    """Why `head` (the bytes the parser would be given) is past the MIME bounds, before the
    parser sees it; None when it is not. Linear: one pass for the boundaries the message
    declares (RFC 2046 §5.1.1 `boundary=` parameters), one over the lines that start with
    "--", counting those that are a declared boundary's delimiter or close delimiter. Every
    part but the top one begins at a delimiter line and each multipart adds one close
    delimiter, so more than 2 x MAX_PARTS of them is more than MAX_PARTS parts. A boundary
    in RFC 2231's form (`boundary*0=`, `boundary*=`: split or encoded, not read here) makes
    every "--" line count. The parsed tree is counted again by `tree_bound`, and the worker's
    time budget bounds the parse itself (relay/feedback/worker.py)."""
    declared: set[bytes] = set()
    for m in _BOUNDARY_PARAM.finditer(head):
        declared.add(m.group(1) or m.group(2))
        if len(declared) > MAX_PARTS:
            return f"more than {MAX_PARTS} multipart boundaries declared"
    extended = _BOUNDARY_2231.search(head) is not None
    if not declared and not extended:
        return None
    delimiters = 0
    for m in _DASH_LINE.finditer(head):
        token = m.group(1).rstrip(b" \t\r")
        if extended or token in declared or (token.endswith(b"--") and token[:-2] in declared):
            delimiters += 1
            if delimiters > 2 * MAX_PARTS:
                return f"more than {MAX_PARTS} MIME parts"
    return None


def tree_bound(msg: Message) -> str | None:
    """Why the parsed message is past the bounds (more than MAX_PARTS parts in all, the
    parts of attached messages included, or nesting deeper than MAX_DEPTH); None when not."""
    count = 0
    stack: list[tuple[Message, int]] = [(msg, 0)]
    while stack:
        part, depth = stack.pop()
        count += 1
        if count > MAX_PARTS:
            return f"more than {MAX_PARTS} MIME parts"
        if depth > MAX_DEPTH:
            return f"MIME parts nested deeper than {MAX_DEPTH}"
        # a multipart's parts, an attached message; not the header blocks the parser
        # makes of a delivery-status (one per recipient: MAX_RECIPIENTS bounds those)
        payload = part.get_payload()
        ctype = part.get_content_type()
        if isinstance(payload, list) and (
            part.get_content_maintype() == "multipart" or ctype in _ATTACHED_TYPES
        ):
            subs = payload[: MAX_PARTS + 1]
            stack.extend((p, depth + 1) for p in subs if isinstance(p, Message))
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Ctx:
    report_mid: str | None
    digest: str | None

    def event(
        self,
        type_: EventType,
        recipient: str,
        message_id: str | None,
        reason: str,
        status: str | None,
    ) -> FeedbackEvent:
        return FeedbackEvent(
            provider=PROVIDER,
            type=type_,
            recipient=recipient,
            event_id=content_id(self.report_mid or self.digest, recipient, type_),
            message_id=message_id,
            reason=reason[:MAX_REASON],
            status=status,
        )


# --- MIME structure ------------------------------------------------------------------------


def _parts(msg: Message) -> list[Message]:
    """The message and its parts, depth first in document order, at most MAX_PARTS; the
    parts of an attached message (message/rfc822) are not entered."""
    out: list[Message] = []
    stack: list[tuple[Message, int]] = [(msg, 0)]
    while stack and len(out) < MAX_PARTS:
        part, depth = stack.pop()
        out.append(part)
        if part.get_content_maintype() != "multipart" or depth >= MAX_DEPTH:
            continue
        payload = part.get_payload()
        if isinstance(payload, list):
            subs = [p for p in payload[:MAX_PARTS] if isinstance(p, Message)]
            stack.extend((p, depth + 1) for p in reversed(subs))
    return out


def _original(parts: list[Message]) -> Message | None:
    """The headers of the original message: the first message/rfc822 (or its headers) part."""
    for part in parts:
        if part.get_content_type() in _ORIGINAL_TYPES:
            return _headers_of(part)
    return None


def _headers_of(part: Message) -> Message | None:
    payload = part.get_payload()
    if isinstance(payload, list):  # message/*: the parser made it a Message already
        first = payload[0] if payload else None
        return first if isinstance(first, Message) else None
    raw = part.get_payload(decode=True)
    if not isinstance(raw, bytes):
        return None
    text = raw[:MAX_TEXT].decode("utf-8", "replace")
    return HeaderParser(policy=_POLICY).parsestr(text.lstrip("\r\n"))


def _cte(part: Message) -> str:
    return str(part.get("Content-Transfer-Encoding", "")).strip().lower()


def _part_text(part: Message) -> str:
    """A leaf part's text, decoded, at most MAX_TEXT characters."""
    raw = part.get_payload(decode=True)
    if not isinstance(raw, bytes):
        return ""
    try:
        declared = part.get_content_charset()
    except (LookupError, ValueError, TypeError):
        declared = None
    return _decode(raw[: MAX_TEXT * 4], declared)[:MAX_TEXT]


def _decode(raw: bytes, charset: str | None) -> str:
    """`raw` in its declared charset, UTF-8 when that is unknown or has a slow decoder."""
    try:
        name = codecs.lookup(charset).name if charset else "utf-8"
        return raw.decode("utf-8" if name in _SLOW_CODECS else name, "replace")
    except (LookupError, ValueError, TypeError):
        return raw.decode("utf-8", "replace")


# --- header values -------------------------------------------------------------------------


def _surrogates_to_text(s: str) -> str:
    """Bytes the parser could not decode (surrogate escapes) read as UTF-8."""
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeError:
        return s.encode("utf-8", "replace").decode("utf-8", "replace")


def _clean(value: object) -> str:
    """A header or field value as one line of text, capped."""
    s = value if isinstance(value, str) else str(value)
    return bounded(" ".join(_surrogates_to_text(s[: MAX_TEXT // 16]).split()))


def _header(msg: Message, name: str) -> str:
    value = msg.get(name)
    return "" if value is None else _clean(value)


def _subject(msg: Message) -> str:
    raw = _header(msg, "Subject")
    try:
        words = decode_header(raw)  # RFC 2047 encoded-words; the rest as raw-unicode-escape
    except (ValueError, LookupError, TypeError):
        return raw
    text = "".join(
        w if isinstance(w, str) else _decode(w, charset or "raw-unicode-escape")
        for w, charset in words
    )
    return " ".join(text.split())


def _message_id(value: str) -> str | None:
    s = value.strip()
    start = s.find("<")
    if start >= 0:
        end = s.find(">", start)
        s = s[start : end + 1] if end > start + 1 else ""
    else:
        s = s.split()[0] if s.split() else ""
    return s if s and len(s) <= MAX_ID else None


def _plain_address(value: str) -> str | None:
    """An address as a report field or a notice line gives it: `a@b`, `<a@b>`."""
    s = value.strip().strip("<>").strip()
    if not s or len(s) > 320 or "@" not in s or any(c.isspace() for c in s):
        return None
    local, _, domain = s.rpartition("@")
    return s if local and domain and "<" not in s and ">" not in s else None


def _addresses(value: str) -> list[str]:
    """The addresses of an address-list header value (To, X-Failed-Recipients), as written."""
    out: list[str] = []
    seen: set[str] = set()
    for item in value.split(","):
        item = item.strip()
        start = item.rfind("<")
        if start >= 0:
            end = item.find(">", start)
            item = item[start + 1 : end] if end > start else ""
        elif item.split():
            item = item.split()[-1]
        addr = _plain_address(item)
        if addr and addr.lower() not in seen:
            seen.add(addr.lower())
            out.append(addr)
    return out


# --- RFC 3464 / 6533 delivery status notifications -----------------------------------------

_Block = list[tuple[str, str]]


def _report_blocks(part: Message) -> list[_Block]:
    """The field blocks of a message/(global-)delivery-status or feedback-report part."""
    payload = part.get_payload()
    if not isinstance(payload, list):
        raw = part.get_payload(decode=True)
        if not isinstance(raw, bytes):
            return []
        return _parse_blocks(raw[:MAX_TEXT].decode("utf-8", "replace"))
    # the parser made message/* parts into Messages: message/delivery-status one per block,
    # any other its first block as headers and the rest as a body
    blocks: list[_Block] = []
    for sub in payload[: MAX_RECIPIENTS + 1]:
        if not isinstance(sub, Message):
            continue
        keys = sub.keys()
        if keys:
            blocks.append([(k, _clean(v)) for k, v in sub.items()])
        body = sub.get_payload(decode=True)  # bytes as received (get_payload() replaces)
        if isinstance(body, bytes) and body.strip():
            if not keys and _cte(part) == "base64":
                try:
                    body = base64.b64decode(body[: MAX_TEXT * 2])
                except (binascii.Error, ValueError):
                    body = b""
            blocks.extend(_parse_blocks(body[:MAX_TEXT].decode("utf-8", "replace")))
        if len(blocks) > MAX_RECIPIENTS:
            break
    return blocks


def _parse_blocks(text: str) -> list[_Block]:
    """`Name: value` fields (folded lines unfolded) in blocks separated by blank lines."""
    blocks: list[_Block] = []
    cur: _Block = []
    name: str | None = None
    value: list[str] = []

    def flush() -> None:
        if name is not None:
            cur.append((name, _clean(" ".join(value))))

    for line in text[:MAX_TEXT].splitlines():
        if not line.strip():
            flush()
            name = None
            if cur:
                blocks.append(cur)
                cur = []
                if len(blocks) > MAX_RECIPIENTS:
                    return blocks
            continue
        if line[0] in " \t":
            if name is not None:
                value.append(line.strip())
            continue
        flush()
        field, sep, rest = line.partition(":")
        field = field.strip()
        if sep and field and not any(c.isspace() for c in field):
            name, value = field, [rest.strip()]
        else:
            name = None
    flush()
    if cur:
        blocks.append(cur)
    return blocks


_RCPT_FIELDS = ("original-recipient", "final-recipient")


def _recipient_records(blocks: list[_Block]) -> list[dict[str, str]]:
    """One dict (lower-case field names, first value wins) per recipient block; a block that
    runs several recipients together is split at each recipient field."""
    records: list[dict[str, str]] = []
    for block in blocks:
        keys = [k.lower() for k, _ in block]
        finals, originals = keys.count("final-recipient"), keys.count("original-recipient")
        if not finals and not originals:
            continue  # the per-message block
        if finals <= 1 and originals <= 1:
            rec: dict[str, str] = {}
            for k, v in block:
                rec.setdefault(k.lower(), v)
            records.append(rec)
        else:
            cur: dict[str, str] | None = None
            for k, v in block:
                key = k.lower()
                if key in _RCPT_FIELDS and (
                    cur is None
                    or key in cur
                    or (key == "original-recipient" and "final-recipient" in cur)
                ):
                    cur = {}
                    records.append(cur)
                if cur is not None:
                    cur.setdefault(key, v)
        if len(records) >= MAX_RECIPIENTS:
            break
    return records[:MAX_RECIPIENTS]


def _unitext(s: str) -> str:
    def one(m: re.Match[str]) -> str:
        cp = int(m.group(1), 16)
        return chr(cp) if cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF else m.group(0)

    return _UNITEXT.sub(one, s)


def _dsn_address(value: str | None) -> str | None:
    """`rfc822; a@b` (or `utf-8; ...`, RFC 6533) -> the address."""
    if not value:
        return None
    kind, sep, addr = value.partition(";")
    if not sep:
        kind, addr = "", kind
    if kind.strip().lower() == "utf-8":
        addr = _unitext(addr)
    return _plain_address(addr)


def _status_of(text: str) -> str | None:
    m = _STATUS.search(bounded(text))
    return m.group(0) if m else None


def _code_class(text: str) -> str | None:
    """'5' or '4': the class of the first failure reply code in `text`."""
    m = _CODE.search(bounded(text))
    return m.group(1) if m else None


def _dsn_type(action: str, status: str | None, diagnostic: str) -> EventType | None:
    if action in ("delivered", "relayed", "expanded"):
        return None
    if action == "delayed":
        return "soft_bounce"
    if status is not None and status[0] in "45":
        permanence: str | None = status[0]
    elif status is not None:
        permanence = None  # 2.x.x: says nothing about failure
    else:
        permanence = _code_class(diagnostic)
    if action == "failed":
        return "bounce" if permanence == "5" else "soft_bounce"
    # no Action (or one RFC 3464 does not define): only a failure code speaks
    if permanence == "5":
        return "bounce"
    return "soft_bounce" if permanence == "4" else None


def _dsn_events(part: Message, original: Message | None, ctx: _Ctx) -> list[FeedbackEvent] | None:
    """The events of a delivery-status part; None when it names no recipient at all, or
    reports a failure only for recipients that are no address (a pipe, a file): the
    notice's text may still say more."""
    message_id = _message_id(_header(original, "Message-ID")) if original is not None else None
    return _record_events(_recipient_records(_report_blocks(part)), message_id, ctx)


def _record_events(
    records: list[dict[str, str]], message_id: str | None, ctx: _Ctx
) -> list[FeedbackEvent] | None:
    events: list[FeedbackEvent] = []
    seen: set[tuple[str, str]] = set()
    unaddressed = 0
    for rec in records:
        action_words = rec.get("action", "").lower().split()
        action = action_words[0] if action_words else ""
        kind, sep, diagnostic = rec.get("diagnostic-code", "").partition(";")
        diagnostic = diagnostic.strip() if sep else kind.strip()
        status = _status_of(rec.get("status", "")) or _status_of(diagnostic)
        type_ = _dsn_type(action, status, diagnostic)
        if type_ is None:
            continue
        recipient = _dsn_address(rec.get("original-recipient")) or _dsn_address(
            rec.get("final-recipient")
        )
        if recipient is None:
            unaddressed += 1
            continue
        if (recipient.lower(), type_) in seen:
            continue
        seen.add((recipient.lower(), type_))
        events.append(ctx.event(type_, recipient, message_id, diagnostic, status))
    if not records or (unaddressed and not events):
        return None
    return events


# --- RFC 5965 feedback reports (ARF) -------------------------------------------------------

_NO_COMPLAINT = ("not-spam", "auth-failure")


def _arf_events(part: Message, original: Message | None, ctx: _Ctx) -> list[FeedbackEvent]:
    fields = [(k.lower(), v) for block in _report_blocks(part) for k, v in block]
    first = {k: v for k, v in reversed(fields)}
    ftype_words = first.get("feedback-type", "").lower().split()
    if not ftype_words:
        raise FeedbackError("feedback report without a Feedback-Type")
    ftype = bounded(ftype_words[0])[:64]
    if ftype in _NO_COMPLAINT:
        return []
    recipients: list[str] = []
    seen: set[str] = set()
    for k, v in fields:
        addr = _plain_address(v) if k == "original-rcpt-to" else None
        if addr and addr.lower() not in seen and len(recipients) < MAX_RECIPIENTS:
            seen.add(addr.lower())
            recipients.append(addr)
    if not recipients and original is not None:
        to = _addresses(_header(original, "To"))
        if len(to) == 1:
            recipients = to
    if not recipients:
        raise FeedbackError(
            "feedback report names no recipient (no Original-Rcpt-To, no single To address)"
        )
    message_id = _message_id(_header(original, "Message-ID")) if original is not None else None
    agent = first.get("user-agent", "")
    reason = f"complaint: {ftype}" + (f" ({agent})" if agent else "")
    return [ctx.event("complaint", r, message_id, reason, None) for r in recipients]


# --- plain-text failure notices (qmail, Exim, Exchange, sendmail) --------------------------


@dataclasses.dataclass(slots=True)
class _Found:
    address: str
    blocks: list[list[str]] = dataclasses.field(default_factory=list)


def _notice_events(
    msg: Message, parts: list[Message], ctx: _Ctx, *, report: bool = False
) -> list[FeedbackEvent]:
    """A failure notice's events; `report`: it is a DSN whose delivery-status part named no
    address (it is a failure notice by its structure, whatever its wording)."""
    subject_text = _subject(msg)
    subject = subject_text.lower()
    sender = _header(msg, "From").lower()
    auto = _header(msg, "Auto-Submitted").lower()
    texts: list[str] = []
    size = 0
    original: Message | None = None
    for part in parts:
        ctype = part.get_content_type()
        if ctype in _ORIGINAL_TYPES:
            if original is None:
                original = _headers_of(part)
        elif size < MAX_TEXT and (ctype == "text/plain" or _broken_multipart(part)):
            text = _part_text(part)[: MAX_TEXT - size]
            texts.append(text)
            size += len(text)
    text = "\n".join(texts)
    lower = text.lower()
    automated = any(s in sender for s in _DAEMON_SENDERS) or auto.startswith("auto-")
    worded_subject = any(s in subject for s in _NOTICE_SUBJECTS)
    worded_text = any(s in lower for s in _NOTICE_TEXT)
    if not (
        report
        or (automated and (worded_subject or worded_text))
        or (worded_subject and worded_text)
    ):
        raise FeedbackError(
            "not a delivery status notification, a feedback report or a known failure notice"
        )
    delay = any(s in subject for s in _DELAY_SUBJECTS) or any(s in lower for s in _DELAY_TEXT)

    lines = [line[:MAX_LINE] for line in text.splitlines()]
    cut = next((i for i, line in enumerate(lines) if _is_copy_marker(line)), len(lines))
    notice, copy = lines[:cut], lines[cut + 1 :]
    if original is None and copy:
        original = _copied_headers(copy)
    message_id = _message_id(_header(original, "Message-ID")) if original is not None else None

    # a DSN whose MIME structure was lost on the way: its fields are in the text
    flattened = _record_events(
        _recipient_records(_parse_blocks("\n".join(notice))), message_id, ctx
    )
    if flattened:
        return flattened

    exclude = {a.lower() for a in _addresses(_header(msg, "From")) + _addresses(_header(msg, "To"))}
    if original is not None:
        for name in ("From", "Sender", "Return-Path"):
            exclude.update(a.lower() for a in _addresses(_header(original, name)))
    failed = [
        a for a in _addresses(_header(msg, "X-Failed-Recipients")) if a.lower() not in exclude
    ]

    found = _tie(notice, exclude)
    if failed:  # the MTA said which addresses failed: only those
        allowed = {a.lower() for a in failed}
        kept = {k: v for k, v in found.items() if k in allowed}
        for a in failed:
            if a.lower() not in kept:
                kept[a.lower()] = _Found(a, [notice] if len(failed) == 1 else [])
        found = kept
    if not found:  # prose ("error delivering your mail to <a@b>"): one address, or none
        named = _named(notice, exclude)
        if len(named) == 1:
            found = {named[0].lower(): _Found(named[0], [notice])}
    if not found:
        raise UnreadableNotice("failure notice names no recipient that could be read")

    events: list[FeedbackEvent] = []
    for item in found.values():
        type_, reason, status = _judge(item)
        if type_ == "bounce" and delay:
            type_ = "soft_bounce"
        events.append(ctx.event(type_, item.address, message_id, reason or subject_text, status))
    return events


def _broken_multipart(part: Message) -> bool:
    """A multipart part whose boundary never came: the parser kept its body as text."""
    return part.get_content_maintype() == "multipart" and isinstance(part.get_payload(), str)


def _is_copy_marker(line: str) -> bool:
    s = line.strip().lower()
    return len(s) <= 120 and any(m in s for m in _COPY_MARKERS)


def _copied_headers(copy: list[str]) -> Message | None:
    start = 0
    while start < len(copy) and not copy[start].strip():
        start += 1
    end = start
    while end < len(copy) and copy[end].strip() and end - start < 500:
        end += 1
    if end == start:
        return None
    return HeaderParser(policy=_POLICY).parsestr("\n".join(copy[start:end]) + "\n\n")


def _valid_address(token: str) -> str | None:
    s = token.strip().strip("<>:,;\"'").strip()
    if len(s) > 320 or not _ADDR.fullmatch(s) or ".." in s.rpartition("@")[2]:
        return None
    return s


def _heading(line: str) -> tuple[str, bool] | None:
    """The address a notice line introduces, and whether the line itself belongs to its
    block (it says more than the address): qmail `<a@b>:`, Exim `  a@b`, Exchange `a@b`,
    `Name<mailto:a@b>`, `a@b on <date>`, Postfix `<a@b>: host ... said: 550 ...`, sendmail
    `<a@b>... User unknown`, a session transcript's `RCPT TO:<a@b>`, a bullet `* a@b`."""
    s = line.strip().lstrip("*->").strip()  # bullets ("* a@b", "-- a@b") and quoting
    if "@" not in s:
        return None
    low = s.lower()
    k = low.find("rcpt to:")
    if k >= 0:
        rest = s[k + 8 :].lstrip()
        end = rest.find(">")
        if rest.startswith("<") and end > 1:
            addr = _valid_address(rest[1:end])
            return (addr, True) if addr else None
        return None
    if s.endswith(">"):
        k = low.rfind("<mailto:")
        if k >= 0:
            addr = _valid_address(s[k + 8 : -1])
            return (addr, False) if addr else None
    words = s.split(None, 1)
    first = words[0]
    rest = words[1].lower() if len(words) > 1 else ""
    said = first.endswith((":", "...")) or rest.startswith(("on ", "(", "<", "[", "..."))
    addr = _valid_address(first.rstrip("."))
    if addr and (not rest or said):
        return addr, bool(rest)
    return None


def _tie(notice: list[str], exclude: set[str]) -> dict[str, _Found]:
    """Each address a notice introduces, with the lines that follow it (up to the next
    address); an address introduced twice keeps both blocks."""
    found: dict[str, _Found] = {}
    block: list[str] | None = None
    for line in notice:
        head = _heading(line)
        if head is not None and head[0].lower() not in exclude:
            addr, included = head
            if addr.lower() not in found and len(found) >= MAX_RECIPIENTS:
                block = None
                continue
            item = found.setdefault(addr.lower(), _Found(addr))
            block = [line] if included else []
            item.blocks.append(block)
        elif head is not None:
            block = None  # the sender's own address: what follows is not about a recipient
        elif block is not None and len(block) < MAX_BLOCK_LINES:
            block.append(line)
    return found


def _named(notice: list[str], exclude: set[str]) -> list[str]:
    """The distinct addresses a notice's text mentions (at most 3 collected), but the
    sender's and the administrative mailboxes a notice refers to."""
    out: list[str] = []
    for line in notice:
        for m in _ADDR_IN_TEXT.finditer(line):
            addr = _valid_address(m.group(0).rstrip("."))
            low = addr.lower() if addr else ""
            if not addr or low in exclude or low.partition("@")[0] in _ROLE_MAILBOXES:
                continue
            if low not in (a.lower() for a in out):
                out.append(addr)
                if len(out) > 2:
                    return out
    return out


def _judge(item: _Found) -> tuple[EventType, str, str | None]:
    """bounce on a 5xx / 5.x.x in one of the address's blocks, soft_bounce on a 4xx or
    nothing; the reason is the lines around the code, the status the first in them."""
    best: tuple[EventType, str, str | None] | None = None
    for block in item.blocks:
        for i, line in enumerate(block):
            code = _CODE.search(line)
            status = _STATUS.search(line)
            if code is None and not (status and status.group(0)[0] in "45"):
                continue
            cls = code.group(1) if code else (status.group(0)[0] if status else "4")
            reason = _paragraph(block, i)
            found_status = _status_of(reason)
            type_: EventType = "bounce" if cls == "5" else "soft_bounce"
            if type_ == "bounce":
                return type_, reason, found_status
            if best is None:
                best = (type_, reason, found_status)
            break
    if best is not None:
        return best
    addr = item.address.lower()
    lines = [" ".join(ln.split()) for b in item.blocks for ln in b]
    lines = [ln for ln in lines if not _bare_heading(ln, addr)]
    said = next((ln for ln in lines if addr in ln.lower() and _prose(ln, addr)), "")
    said = said or next((ln for ln in lines if any(c.isalpha() for c in ln)), "")
    return "soft_bounce", said[:MAX_REASON], None


def _bare_heading(line: str, addr: str) -> bool:
    """A line that introduces `addr` and says nothing else (`a@b`, `a@b on <date>`)."""
    head = _heading(line)
    if head is None or head[0].lower() != addr:
        return False
    rest = line.strip().lstrip("*->").strip().split(None, 1)[1:]
    return not rest or rest[0].lower().startswith("on ")


def _prose(line: str, addr: str) -> bool:
    """Not the address alone, a header line (`To: a@b`) or a Received clause (`for <a@b>`)."""
    low = line.lower()
    first = low.split(None, 1)[0] if low.split() else ""
    return low != addr and not low.startswith("for ") and first not in _ADDRESS_HEADERS


def _paragraph(block: list[str], i: int) -> str:
    start = i - 1 if i > 0 and block[i - 1].rstrip().endswith(":") else i
    end = i + 1
    while end < len(block) and block[end].strip() and end - i < 5:
        end += 1
    return " ".join(" ".join(ln.split()) for ln in block[start:end] if ln.strip())[:MAX_REASON]


# --- VERP ----------------------------------------------------------------------------------


def _verp_mac(key: bytes, queue_id: str, rcpt_id: int) -> str:
    msg = _VERP_CONTEXT + queue_id.encode("ascii") + b"\x00" + str(rcpt_id).encode("ascii")
    digest = hmac.new(key, msg, hashlib.sha256).digest()
    return base64.b32encode(digest).decode("ascii")[:VERP_MAC_CHARS].lower()


def verp_encode(local: str, domain: str, queue_id: str, rcpt_id: int, key: bytes) -> str:
    """`<local>+<queue id>-<row id>-<mac>@<domain>` (lower case). ValueError on a queue id
    that is not 16 hex digits, a row id that is not a positive int, an empty key, or a
    local part that is not a plain dot-atom without '+'. The token is at most
    VERP_MAX_TOKEN characters: keep `local` short enough for RFC 5321's 64."""
    if not isinstance(key, bytes) or not key:
        raise ValueError("VERP key is empty")
    if not isinstance(queue_id, str) or len(queue_id) != 16 or not set(queue_id.lower()) <= _HEX:
        raise ValueError(f"VERP: queue id {queue_id!r} is not 16 hex digits")
    if isinstance(rcpt_id, bool) or not isinstance(rcpt_id, int) or not 0 < rcpt_id <= _MAX_ROW_ID:
        raise ValueError(f"VERP: recipient id {rcpt_id!r} is not a positive row id")
    if (
        not local
        or "+" in local
        or not set(local) <= _ATEXT | {"."}
        or local.startswith(".")
        or local.endswith(".")
        or ".." in local
    ):
        raise ValueError(f"VERP: local part {local!r} is not a dot-atom without '+'")
    if not domain or "@" in domain or any(c.isspace() for c in domain):
        raise ValueError(f"VERP: domain {domain!r} is not a domain")
    qid = queue_id.upper()
    return f"{local}+{qid.lower()}-{rcpt_id}-{_verp_mac(key, qid, rcpt_id)}@{domain}"


def verp_decode(address: str, local: str, domain: str, key: bytes) -> tuple[str, int] | None:
    """(queue id, row id) of a valid token sent to `<local>+token@<domain>` (any case);
    None for anything else: another local part or domain, a malformed token, a bad MAC."""
    if not isinstance(address, str) or not isinstance(key, bytes) or not key or not local:
        return None
    a = address.strip()
    if a.startswith("<") and a.endswith(">"):
        a = a[1:-1].strip()
    if len(a) > 320:
        return None
    lp, at, dom = a.rpartition("@")
    if not at or dom.lower() != domain.lower():
        return None
    prefix = local.lower() + "+"
    lp = lp.lower()
    if not lp.startswith(prefix):
        return None
    parts = lp[len(prefix) :].split("-")
    if len(parts) != 3:
        return None
    qid, row, mac = parts
    if len(qid) != 16 or not set(qid) <= _HEX:
        return None
    if not 0 < len(row) <= 19 or not row.isascii() or not row.isdigit() or row[0] == "0":
        return None
    rcpt_id = int(row)
    if rcpt_id > _MAX_ROW_ID or len(mac) != VERP_MAC_CHARS or not set(mac) <= _B32:
        return None
    if not hmac.compare_digest(_verp_mac(key, qid.upper(), rcpt_id), mac):
        return None
    return qid.upper(), rcpt_id


def is_feedback_address(address: str, local: str, domain: str) -> bool:
    """`local@domain` or `local+anything@domain`, any case."""
    if not isinstance(address, str) or not local or not domain:
        return False
    a = address.strip()
    if a.startswith("<") and a.endswith(">"):
        a = a[1:-1].strip()
    lp, at, dom = a.rpartition("@")
    if not at or dom.lower() != domain.lower():
        return False
    lp, want = lp.lower(), local.lower()
    return lp == want or lp.startswith(want + "+")


def events_for_verp(
    events: list[FeedbackEvent], queue_id: str, rcpt_id: int, *, address: str | None = None
) -> list[FeedbackEvent]:
    """The events of a report that came back to a VERP address, with the token's queue id and
    row id on those about the recipient that token names (dataclasses.replace; pure).

    - With `address` (the row's address), the events about it get the ids.
    - When none is about it (or `address` is not given), the ids go to the events if they
      all name one address: the original recipient forwarded to it (a DSN names the final
      address). Events naming several other addresses (a list our recipient expanded to)
      get none: one member's failure must not bounce the list's row.
    - [] gives []. A failure notice that yields no event raises `UnreadableNotice` in
      `parse_feedback_mail`; counting it against the token's row is the caller's decision.
    """
    if not events:
        return []
    want = (address or "").strip().strip("<>").lower()
    mine = {i for i, e in enumerate(events) if want and e.recipient.lower() == want}
    if not mine and len({e.recipient.lower() for e in events}) == 1:
        mine = set(range(len(events)))
    return [
        dataclasses.replace(e, queue_id=queue_id, rcpt_id=rcpt_id) if i in mine else e
        for i, e in enumerate(events)
    ]
