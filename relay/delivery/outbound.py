"""What the relay adds to a message on its way out, per attempt, after any route rewriting:
the one-click unsubscribe headers, then the DKIM signatures.

Rules:
- Per attempt, not at acceptance: the signature must cover the exact bytes that go
  upstream, and those depend on the route (a rewritten From) and on the recipient (the
  List-Unsubscribe token). The queue keeps the message as accepted; a key rotated in the
  config signs the next attempt.
- One-click unsubscribe (RFC 8058, relay/unsubscribe.py): bulk-lane mail of an identity
  with `identities.<name>.unsubscribe` and no List-Unsubscribe of its own gets
  `List-Unsubscribe` (and, for an https URL, `List-Unsubscribe-Post`) naming its one
  recipient; the engine gives such mail one transaction per recipient, so a token never
  reaches anyone but the person it names. Added before signing, so the signature covers
  them (RFC 8058 §4).
- DKIM (relay/dkim_sign.py): the keys configured for the header From's domain (or its
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
from typing import TYPE_CHECKING

from relay import dkim_sign, faults, unsubscribe
from relay.delivery.jobs import Job
from relay.spool.bodies import StoredBody

if TYPE_CHECKING:
    from relay.config import Config
    from relay.unsubscribe import UnsubscribeConf


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
        try:
            added = unsubscribe.add_headers(data, unsub, job.identity, job.claims[0].address)
        except ValueError as e:
            raise OutboundError(f"List-Unsubscribe: {e}") from e
        data = added if added is not None else data
    if config.dkim:
        domain = dkim_sign.header_from_domain(data)
        keys = dkim_sign.keys_for(domain, config.dkim) if domain else ()
        if keys:
            message = data

            def sign() -> bytes:
                faults.hit("dkim.sign")
                return dkim_sign.sign(message, keys)

            try:
                signature = await asyncio.to_thread(sign)
            except Exception as e:  # DkimSignError, or a bug: never sent unsigned
                names = ", ".join(f"{k.selector}._domainkey.{k.domain}" for k in keys)
                raise OutboundError(f"DKIM signing failed ({names}): {e}") from e
            data = signature + message
    return data


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
    from the file (relay/dkim_sign.py `RelaxedBodyHash`)."""
    rest = body.with_head(b"", offset)
    if unsub is not None:
        try:
            added = unsubscribe.add_headers(head, unsub, job.identity, job.claims[0].address)
        except ValueError as e:
            raise OutboundError(f"List-Unsubscribe: {e}") from e
        head = added if added is not None else head
    signature = b""
    domain = dkim_sign.header_from_domain(head) if config.dkim else None
    keys = dkim_sign.keys_for(domain, config.dkim) if domain else ()
    if keys:
        header_block = head

        def sign() -> bytes:
            faults.hit("dkim.sign")
            hasher = dkim_sign.RelaxedBodyHash()
            for block in rest.blocks():
                hasher.update(block)
            return dkim_sign.sign(header_block, keys, body_hash=hasher.digest())

        try:
            signature = await asyncio.to_thread(sign)
        except Exception as e:  # DkimSignError, an unreadable file, or a bug: never unsigned
            names = ", ".join(f"{k.selector}._domainkey.{k.domain}" for k in keys)
            raise OutboundError(f"DKIM signing failed ({names}): {e}") from e
    return rest.with_head(signature + head, offset)
