"""What the relay adds to a message on its way out, per attempt, after any route rewriting:
the one-click unsubscribe headers, then the DKIM signatures.

Rules:
- Per attempt, not at acceptance: the signature must cover the exact bytes that go
  upstream, and those depend on the route (a rewritten From) and on the recipient (the
  List-Unsubscribe token). The queue keeps the message as accepted; a key rotated in the
  config signs the next attempt.
- One-click unsubscribe (RFC 8058, relay/authenticity/unsubscribe.py): bulk-lane mail of an identity
  with `identities.<name>.unsubscribe` and no List-Unsubscribe of its own gets
  `List-Unsubscribe` (and, for an https URL, `List-Unsubscribe-Post`) naming its one
  recipient; the engine gives such mail one transaction per recipient, so a token never
  reaches anyone but the person it names. Added before signing, so the signature covers
  them (RFC 8058 §4).
- DKIM (relay/authenticity/dkim.py): the keys configured for the header From's domain (or its
  nearest configured parent) sign; no key, no signature. A signing failure raises
  `OutboundError`: the attempt is deferred with the reason and logged at ERROR, never sent
  unsigned and never lost.
- A file-stored (large) message is not loaded: its header block (found within the first
  MiB) is changed in memory and the DKIM body hash is computed while the body streams from
  the file; what goes out is the new header block, then the file from the body on. Only a
  message whose header block does not end within that MiB is read whole (bounded by
  `limits.max_message_size`). Signing runs in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from relay.authenticity import dkim as dkim_sign
from relay.authenticity import unsubscribe
from relay.delivery.jobs import Job
from relay.ops import faults
from relay.spool.bodies import StoredBody

if TYPE_CHECKING:
    from relay.authenticity.unsubscribe import UnsubscribeConf
    from relay.config.tree import Config


class OutboundError(Exception):
    """The message cannot go out as configured now (a DKIM signing failure)."""


def one_per_recipient(config: Config, lane: str, identity: str) -> bool:
    """Mail that gets per-recipient headers needs one transaction per recipient."""
    ident = config.identity(identity)
    return lane == "bulk" and ident is not None and ident.unsubscribe is not None


async def prepare(config: Config, job: Job, body: bytes | StoredBody) -> bytes | StoredBody:
    ident = config.identity(job.identity)
    unsub = ident.unsubscribe if ident is not None and job.lane == "bulk" else None
    if unsub is not None and len(job.claims) != 1:
        unsub = None  # never a token in a message several people receive
    if unsub is None and not config.dkim:
        return body
    if isinstance(body, StoredBody):
        split = await asyncio.to_thread(body.split_head)
        if split is not None:  # the header block in memory, the body streamed from disk
            return await _prepare_stored(config, job, body, unsub, *split)
        stored = body
        data = await asyncio.to_thread(lambda: b"".join(stored.blocks()))
    else:
        data = body
    if unsub is not None:
        data = _with_unsubscribe(data, unsub, job)
    keys = _keys(config, data)
    if keys:
        message = data

        def sign() -> bytes:
            faults.hit("dkim.sign")
            return dkim_sign.sign(message, keys)

        data = await _signature(keys, sign) + message
    return data


def _with_unsubscribe(message: bytes, unsub: UnsubscribeConf, job: Job) -> bytes:
    """`message` (or its header block alone) with the one-click headers for its recipient."""
    try:
        added = unsubscribe.add_headers(message, unsub, job.identity, job.claims[0].address)
    except ValueError as e:
        raise OutboundError(f"List-Unsubscribe: {e}") from e
    return added if added is not None else message


def _keys(config: Config, message: bytes) -> Sequence[dkim_sign.DkimKey]:
    """The keys that sign for the header From of `message` (or its header block)."""
    domain = dkim_sign.header_from_domain(message) if config.dkim else None
    return dkim_sign.keys_for(domain, config.dkim) if domain else ()


async def _signature(keys: Sequence[dkim_sign.DkimKey], sign: Callable[[], bytes]) -> bytes:
    """`sign()` in a worker thread; any failure (DkimSignError, an unreadable file, a bug)
    is an OutboundError: the message is never sent unsigned."""
    try:
        return await asyncio.to_thread(sign)
    except Exception as e:
        names = ", ".join(f"{k.selector}._domainkey.{k.domain}" for k in keys)
        raise OutboundError(f"DKIM signing failed ({names}): {e}") from e


async def _prepare_stored(
    config: Config,
    job: Job,
    body: StoredBody,
    unsub: UnsubscribeConf | None,
    head: bytes,
    offset: int,
) -> StoredBody:
    """`prepare` for a large stored message without loading it: the header fields are
    added to its header block, and the DKIM body hash is computed while the body streams
    from the file (relay/authenticity/dkim.py `RelaxedBodyHash`)."""
    rest = body.with_head(b"", offset)
    if unsub is not None:
        head = _with_unsubscribe(head, unsub, job)
    signature = b""
    keys = _keys(config, head)
    if keys:
        header_block = head

        def sign() -> bytes:
            faults.hit("dkim.sign")
            hasher = dkim_sign.RelaxedBodyHash()
            for block in rest.blocks():
                hasher.update(block)
            return dkim_sign.sign(header_block, keys, body_hash=hasher.digest())

        signature = await _signature(keys, sign)
    return rest.with_head(signature + head, offset)
