"""Dedup keys (pure).

Rules:
- The dedup unit is (client namespace, Message-ID, recipient): the namespace is the listener
  (`host:port` as configured) or, once AUTH exists, the authenticated user, so two tenants
  that happen to reuse a Message-ID never swallow each other's mail.
- Message-IDs compare without angle brackets and surrounding space, with the part after "@"
  lowercased (domains are case-insensitive, RFC 5321 §2.4); the local part keeps its case.
- Recipients compare lowercased: in practice no provider has two mailboxes that differ only
  in case, and a false "new" would send a duplicate.
- An `Idempotency-Key` header, when present, takes the Message-ID's place in the key (an app
  whose mail library makes a new Message-ID per retry keeps one key); a second message with
  the same key but other content is refused, never dropped (relay/inbound/handler.py).
- A message without a Message-ID gets one derived from a hash of its content (headers minus
  trace headers, plus the body), so a byte-identical resubmission gets the same key.
- A Message-ID key is stored with the message's content fingerprint (`BodyFingerprint`): the
  Subject (unfolded, white space runs as one space) and the body after the header block,
  its line endings made CRLF and the empty lines at its end dropped (as RFC 6376 §3.4.3's
  simple body canonicalization). Date, Received, Message-ID and every other header are left
  out: an app that regenerates them on a resubmission is still recognised. A key hit whose
  fingerprint differs is another message reusing the Message-ID: it is queued under the
  key's `variant_key` (so a resubmission of that second message is a duplicate in turn),
  never dropped. A key stored without a fingerprint (before there were any) stays a plain
  duplicate. An Idempotency-Key keeps its stricter rule above (the content hash).
"""

from __future__ import annotations

import hashlib

from relay.mail.message import TRACE_HEADERS, header, parse_headers, split_message


def normalize_message_id(value: str) -> str:
    v = value.strip()
    if v.startswith("<") and ">" in v:
        v = v[1 : v.index(">")]
    v = v.strip()
    local, at, dom = v.rpartition("@")
    return f"{local}@{dom.lower()}" if at else v


def normalize_address(address: str) -> str:
    return address.strip().strip("<>").lower()


def dedup_key(namespace: str, message_id: str, recipient: str) -> str:
    h = hashlib.sha256()
    for part in (namespace, normalize_message_id(message_id), normalize_address(recipient)):
        h.update(part.encode("utf-8", errors="surrogateescape"))
        h.update(b"\x00")
    return h.hexdigest()[:40]


def dedup_keys(namespace: str, message_id: str, recipients: list[str]) -> list[str]:
    """`dedup_key` of each recipient of one message: the namespace and Message-ID are
    normalized and hashed once, and each recipient's key continues a copy of that hash."""
    head = hashlib.sha256()
    for part in (namespace, normalize_message_id(message_id)):
        head.update(part.encode("utf-8", errors="surrogateescape"))
        head.update(b"\x00")
    return [_finish(head, r) for r in recipients]


def idempotency_dedup_keys(namespace: str, key: str, recipients: list[str]) -> list[str]:
    """`idempotency_dedup_key` of each recipient of one message (as `dedup_keys`)."""
    head = hashlib.sha256(b"idempotency-key\x00")
    head.update(namespace.encode("utf-8", errors="surrogateescape"))
    head.update(b"\x00")
    head.update(key.encode("utf-8", errors="surrogateescape"))
    head.update(b"\x00")
    return [_finish(head, r) for r in recipients]


def _finish(head: hashlib._Hash, recipient: str) -> str:
    h = head.copy()
    h.update(normalize_address(recipient).encode("utf-8", errors="surrogateescape"))
    h.update(b"\x00")
    return h.hexdigest()[:40]


def idempotency_dedup_key(namespace: str, key: str, recipient: str) -> str:
    """An `Idempotency-Key` header's dedup key: in place of the Message-ID, compared exactly
    (a key is the app's own token: no case folding), still per namespace and recipient."""
    h = hashlib.sha256(b"idempotency-key\x00")
    for part in (namespace, key, normalize_address(recipient)):
        h.update(part.encode("utf-8", errors="surrogateescape"))
        h.update(b"\x00")
    return h.hexdigest()[:40]


IDEMPOTENCY_KEY_MAX = 200


def valid_idempotency_key(value: str) -> bool:
    """1 to 200 printable ASCII characters (space allowed inside)."""
    return 0 < len(value) <= IDEMPOTENCY_KEY_MAX and all(" " <= ch <= "~" for ch in value)


FINGERPRINT_HEX = 40  # 160 bits of SHA-256: as the dedup keys themselves


class BodyFingerprint:
    """The content fingerprint of a message (see the rules), fed the body in blocks of any
    size as it arrives: the same digest for any split of the same octets, and the same as
    `fingerprint` of the whole. Only a held-back CR and a count of pending empty lines are
    kept between blocks; each block costs a few passes in C (`bytes.replace`), never one
    Python step per line, so even a 25 MiB body never holds the event loop for long.

    A caller that knows every CR and LF of the body is part of a CRLF (`crlf=True`: the DATA
    parser's output, relay/inbound/dataflow.py, makes bare ones CRLF) has its blocks hashed
    as they are, with no replace pass: only the empty lines at a block's end are held back
    (found from the block's last four octets). A block that ends in CR, or follows one,
    takes the general path all the same."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._cr = False  # the last block ended in CR: its LF may open the next one
        self._empty = 0  # line ends seen since the last text, not yet hashed
        self._text = False  # any text hashed yet

    def update(self, block: bytes, crlf: bool = False) -> None:
        if not block:
            return
        if crlf and not self._cr and not block.endswith(b"\r"):
            self._update_crlf(block)
            return
        if self._cr:
            block = b"\r" + block
        self._cr = block.endswith(b"\r")
        if self._cr:
            block = block[:-1]
        # every line end (CRLF, bare LF, bare CR) as LF, then as CRLF (RFC 5322 §2.3)
        lf = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        text = lf.rstrip(b"\n")
        if not text:
            self._empty += len(lf)
            return
        self._h.update(b"\r\n" * self._empty + text.replace(b"\n", b"\r\n"))
        self._text = True
        self._empty = len(lf) - len(text)

    def _update_crlf(self, block: bytes) -> None:
        """`update` of a block whose CRs and LFs are all CRLF pairs inside it: the same
        effect as the general path (its line ends are already CRLF), without its copies.
        The CRLFs at its end are a run of whole pairs (no LF of the run can lack its CR: the
        block neither starts with an LF that a held CR completes nor ends in CR)."""
        n = len(block)
        if block.endswith(b"\r\n\r\n"):  # empty lines at the end: rare, one copy
            end = len(block.rstrip(b"\r\n"))
        elif block.endswith(b"\r\n"):
            end = n - 2
        else:
            end = n
        if not end:
            self._empty += n // 2
            return
        if self._empty:
            self._h.update(b"\r\n" * self._empty)
        if end == n:
            self._h.update(block)
        else:
            with memoryview(block) as view:
                self._h.update(view[:end])
        self._text = True
        self._empty = (n - end) // 2

    def hexdigest(self, subject: str | None) -> str:
        """The fingerprint: the Subject, then the body ended by one CRLF (none if empty)."""
        body = self._h.copy()
        if self._text:
            body.update(b"\r\n")
        h = hashlib.sha256(b"subject:")
        if subject is not None:
            h.update(" ".join(subject.split()).encode("utf-8", errors="surrogateescape"))
        h.update(b"\r\n")
        h.update(body.digest())
        return h.hexdigest()[:FINGERPRINT_HEX]


def fingerprint(subject: str | None, body: bytes) -> str:
    """`BodyFingerprint` of a whole body at once."""
    fp = BodyFingerprint()
    fp.update(body)
    return fp.hexdigest(subject)


def message_fingerprint(data: bytes) -> str:
    """The fingerprint of a whole message (header block, empty line, body)."""
    head, body = split_message(data)
    return fingerprint(header(parse_headers(head), "Subject"), body)


def variant_key(key: str, fp: str) -> str:
    """The dedup key of another message that reused `key`'s Message-ID (fingerprint `fp`)."""
    return hashlib.sha256(f"variant\x00{key}\x00{fp}".encode()).hexdigest()[:40]


def content_message_id(header_block: bytes, body: bytes, hostname: str) -> str:
    """A stable Message-ID for a message that has none: `<sha256-prefix@relay.hostname>`."""
    hasher = ContentHasher(header_block)
    hasher.update(body)
    return hasher.message_id(hostname)


class ContentHasher:
    """`content_message_id`, with the body fed in pieces as it arrives (same result)."""

    def __init__(self, header_block: bytes) -> None:
        h = hashlib.sha256()
        for name, value in parse_headers(header_block):
            if name.lower() in TRACE_HEADERS:
                continue
            h.update(name.lower().encode("utf-8", errors="surrogateescape"))
            h.update(b":")
            h.update(value.encode("utf-8", errors="surrogateescape"))
            h.update(b"\r\n")
        h.update(b"\r\n")
        self._h = h
        self._stray = _non_field_lines(header_block)

    def update(self, body: bytes) -> None:
        self._h.update(body)

    def message_id(self, hostname: str) -> str:
        h = self._h.copy()
        # Lines of the header block that are not header fields (parse_headers drops them): a
        # message with no empty line is all "header block", so without these two different
        # texts would share an id and the second would be dropped as a duplicate. Only
        # messages with such lines hash them, so well-formed messages keep their ids.
        if self._stray:
            h.update(b"\x00non-field lines\r\n")
            h.update(b"\r\n".join(self._stray))
        return f"<{h.hexdigest()[:32]}.content@{hostname}>"


def _non_field_lines(block: bytes) -> list[bytes]:
    """The lines `parse_headers` skips: neither a field nor the continuation of one."""
    out: list[bytes] = []
    field_seen = False
    for line in block.split(b"\r\n"):
        if not line:
            continue
        if line[:1] in (b" ", b"\t") and field_seen:
            continue
        name, sep, _value = line.partition(b":")
        if sep and name and b" " not in name.strip():
            field_seen = True
            continue
        out.append(line)
    return out
