"""Envelope and header rewriting per route (providers such as SES accept only verified
senders).

Rules:
- `envelope_sender` replaces MAIL FROM for the upstream (bounces then go to that address;
  the null sender `<>` of a DSN is never rewritten: it must stay null).
- `from` replaces the address of the header From, keeping its display name; the original
  From is kept in `X-Original-From`. `reply_to_original` adds `Reply-To` with the original
  From when the message has no Reply-To, so replies still reach the person.
- Only the header block is touched, field by field on the exact bytes (folded lines stay
  whole); the body is never re-encoded, and a large stored one is never loaded: the new
  header block goes out in front of the file from its body on. The queue keeps the
  original: rewriting happens per attempt, on the way out.
- DMARC: with `from` set to an address of a domain the provider signs for (DKIM) and/or
  whose SPF covers the provider, the message aligns; without it, a From of a domain the
  provider cannot sign for fails DMARC at receivers with `p=reject`.
"""

from __future__ import annotations

import asyncio
from email.utils import formataddr, parseaddr

from relay.config.routes import Rewrite
from relay.spool.bodies import StoredBody


async def apply(
    rw: Rewrite, sender: str, body: bytes | StoredBody
) -> tuple[str, bytes | StoredBody]:
    if rw.envelope_sender and sender not in ("", "<>"):
        sender = rw.envelope_sender
    if rw.from_addr or rw.reply_to_original:
        if isinstance(body, StoredBody):
            stored = body
            split = await asyncio.to_thread(stored.split_head)
            if split is not None:  # the header block in memory, the body stays on disk
                head, offset = split
                return sender, stored.with_head(
                    rewrite_headers(head, rw.from_addr, rw.reply_to_original), offset
                )
            # no header block within the first MiB: whole (bounded by max_message_size)
            body = await asyncio.to_thread(lambda: b"".join(stored.blocks()))
        body = rewrite_headers(body, rw.from_addr, rw.reply_to_original)
    return sender, body


def fields(head: bytes) -> list[bytes]:
    """The header block's fields, each with its continuation lines and CRLFs."""
    out: list[bytes] = []
    for line in head.splitlines(keepends=True):
        if line[:1] in (b" ", b"\t") and out:
            out[-1] += line
        else:
            out.append(line)
    return out


def _name(field: bytes) -> bytes:
    return field.split(b":", 1)[0].strip().lower()


def rewrite_headers(data: bytes, from_addr: str | None, reply_to_original: bool) -> bytes:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return data  # no body separator: no header block we can safely edit
    head, rest = data[: end + 2], data[end + 2 :]
    fs = fields(head)
    froms = [f for f in fs if _name(f) == b"from"]
    if not froms:
        return data
    original = froms[0].split(b":", 1)[1].strip()
    out: list[bytes] = []
    for f in fs:
        if f is froms[0] and from_addr:
            text = original.decode("utf-8", errors="replace").replace("\r\n", "")
            name, _addr = parseaddr(text)
            new = formataddr((name, from_addr)) if name else f"<{from_addr}>"
            out.append(b"From: " + new.encode("utf-8") + b"\r\n")
            out.append(b"X-Original-From: " + original + b"\r\n")
        else:
            out.append(f)
    if reply_to_original and not any(_name(f) == b"reply-to" for f in fs):
        out.append(b"Reply-To: " + original + b"\r\n")
    return b"".join(out) + rest
