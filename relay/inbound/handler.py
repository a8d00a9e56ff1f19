"""Inbound SMTP: checks, then the spool, then `250`. It never delivers.

Rules:
- `250` after DATA only once the message and all its recipients are committed (WAL fsync'd);
  any failure on that path answers `451 4.3.0` (or `452 4.3.1` when the disk is full), never
  5xx: the client keeps the message and retries (RFC 5321 §4.2.5).
- A hook exception becomes `451 4.3.0` too (relay/inbound/transport.py), never a permanent 5xx.
- A client outside every `allow` network, not authenticated, gets `554 5.7.1` at RCPT for any
  domain: never an open relay.
- Suppressed recipients are refused at RCPT with `550 5.1.1` saying why and since when.
- Limits answer with their RFC 5321 replies: too many recipients `452 4.5.3`
  (§4.5.3.1.10), too much data `552 5.3.4` (§4.5.3.1.7), over-long lines `500 5.5.2`
  (§4.5.3.1.6). The session carries on.
- Only <CRLF>.<CRLF> ends DATA (relay/inbound/dataflow.py); bare CR/LF become CRLF in the stored
copy.
- Paths are parsed by relay/mail/address.py (RFC 5321 §4.1.2, linear time) and stored exactly as
  checked: a malformed path is `501 5.1.7` (MAIL) or `501 5.1.3` (RCPT), never 451. A bare
  CR or LF in a command line is `500 5.5.2` and the connection is closed (relay/inbound/core.py).
- STARTTLS (`listen[].tls`) and AUTH PLAIN/LOGIN (`listen[].auth`) for submitting apps. AUTH is
  offered only after STARTTLS unless `auth.allow_plaintext`; an authenticated client relays
  from anywhere and its dedup namespace is `user:<username>`. A wrong password gets
  `535 5.7.8`; the third on one connection gets `421 4.7.0` and the connection is closed.
  `require_tls` refuses MAIL before STARTTLS with `530 5.7.0`. Passwords are checked off the
  event loop, with per-IP delays and bans (relay/inbound/auth_mechanisms.py,
  relay/inbound/guard.py).
- `listen[].tls.mode: implicit` (RFC 8314 §3): the listener speaks TLS from the first byte
  (relay/inbound/tls_listener.py); no STARTTLS is offered, AUTH counts as over TLS and the Received
  line says ESMTPS/ESMTPSA.
- Connection limits (relay/inbound/anvil.py): over one, `421 4.7.0` and close, before the greeting.
  Slow and erring clients (relay/inbound/session_watch.py): `421 4.4.2` after
  `limits.command_timeout`
  waiting for a command or below `limits.min_data_rate` in DATA, `421 4.7.0` after
  `limits.max_errors` error replies (RFC 5321 §3.8, §4.2.5). Every 421 we send closes.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import TypeAlias

from relay.config.tree import Config, Listener
from relay.delivery import shaping
from relay.delivery.lanes import LANE_PRIORITY, classify_lane
from relay.feedback import bounces
from relay.feedback.service import FeedbackService
from relay.inbound import longlines
from relay.inbound.auth_mechanisms import AuthMechanisms
from relay.inbound.guard import InboundGuard, PeerFacts, is_allowed
from relay.inbound.session import Envelope, Session, TLSSetupException
from relay.inbound.stats import InboundStats
from relay.inbound.transport import InboundProtocol
from relay.mail import address as address_
from relay.mail.message import (
    content_hash,
    date_header,
    header,
    qualify_header_block,
    received_header,
    strip_header,
)
from relay.ops import alerts, faults
from relay.ops.logs import log_event
from relay.spool import bodies, dedup, ops
from relay.spool.incoming import IncomingBody
from relay.spool.writer import Grouped, SpoolError, SpoolWriter

log = logging.getLogger("relay.inbound")  # the name its log lines have always carried

# The `server` the hooks get: our protocol (relay/inbound/transport.py). The hooks' signatures
# keep aiosmtpd's names, so their code reads as before.
SMTP: TypeAlias = InboundProtocol


class Suppressions:
    """An in-memory copy of the suppression list, refreshed from the spool (so that a CLI
    change takes effect within the refresh interval). An entry's scope is '' (every sender)
    or one sending identity (a complaint, an unsubscribe)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], tuple[str, float]] = {}
        self.version: tuple[int, int, float] | None = None

    def get(self, address: str, identity: str | None = None) -> tuple[str, float] | None:
        addr = address.lower()
        hit = self.entries.get((addr, ""))
        if hit is None and identity:
            hit = self.entries.get((addr, identity.lower()))
        return hit

    async def refresh(self, writer: SpoolWriter) -> None:
        version = await writer.run(ops.suppression_version)
        if version == self.version:
            return
        rows = await writer.run(ops.suppression_list)
        self.entries = {
            (r["address"], "" if r["scope"] == "global" else r["scope"]): (
                r["reason"],
                r["created_at"],
            )
            for r in rows
        }
        self.version = version

    def add_local(self, address: str, reason: str, when: float, scope: str = "") -> None:
        self.entries[(address.lower(), scope.lower())] = (reason, when)
        # The entries no longer match the version they were loaded at: reload at the next
        # refresh. Otherwise an operator `suppression remove` before that refresh brings the
        # spool back to the remembered version and the address stays suppressed here.
        self.version = None


class InboundHandler(AuthMechanisms):
    def __init__(
        self,
        config: Config,
        listener: Listener,
        writer: SpoolWriter,
        suppressions: Suppressions,
        on_queued: Callable[[], None] = lambda: None,
        stats: InboundStats | None = None,
        guard: InboundGuard | None = None,
        gate: Callable[[], str | None] = lambda: None,
        feedback: FeedbackService | None = None,
    ) -> None:
        self.config = config
        # mail to feedback.address: bounces and complaints, read here, never relayed
        self.feedback = feedback
        # the daemon's health says the spool or the disk cannot keep mail: this reply
        # (451 4.3.0 / 452 4.3.1) at MAIL and at the end of DATA instead of a 250
        self.gate = gate
        self.listener = listener
        self.peer_facts = PeerFacts()  # per listener: its allow list (relay/inbound/guard.py)
        self.writer = writer
        self.suppressions = suppressions
        self.on_queued = on_queued
        self.stats: InboundStats = stats or InboundStats()
        # shared by every listener of the daemon: connection counts, AUTH checks and bans
        self.guard = guard or InboundGuard(config, self.stats.metrics)
        self.closing = False
        self.in_flight = 0
        self._lane_rules = config.lanes.rules
        # a reused Message-ID's alert for an accept whose client hung up (`_orphaned`)
        self._orphan_tasks: set[asyncio.Task[None]] = set()

    def reconfigure(self, config: Config) -> None:
        self._lane_rules = config.lanes.rules
        self.config = config

    def protocol(self) -> InboundProtocol:
        """One connection's protocol (relay/inbound/transport.py); the listener as configured
        now (SIGHUP replaces it: new connections get the new TLS and users)."""
        return InboundProtocol(self)

    # --- hooks ------------------------------------------------------------------------

    async def handle_EHLO(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]:
        session.host_name = hostname
        if server.relay_listener.auth is None:  # else the core lists LOGIN and PLAIN
            responses = [r for r in responses if not r.startswith("250-AUTH")]
        last = responses.pop()  # "250 HELP"
        responses.extend(["250-PIPELINING", "250-ENHANCEDSTATUSCODES", last])
        return responses

    def peer_allowed(self, session: Session | None) -> bool:
        return session is not None and self._peer_allowed(session)

    def _peer_allowed(self, session: Session) -> bool:
        if session.authenticated:
            return True
        allow = self.listener.allow
        peer = session.peer
        known = session.allowed_by
        if known is not None and known[0] is allow and known[1] is peer:  # decided already
            return known[2]
        if not peer:
            return False
        ok = is_allowed(_peer_text(peer), allow)
        session.allowed_by = (allow, peer, ok)
        return ok

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        if self.feedback is not None and self.feedback.is_feedback_rcpt(address):
            # not relaying: a bounce or complaint for us, from anyone (no open relay); at
            # most feedback.rate_per_ip such messages per client and window (counted once
            # per transaction): an outsider cannot fill the spool with them
            if not any(self.feedback.is_feedback_rcpt(r) for r in envelope.rcpt_tos):
                ip = session.ip or _peer_text(session.peer)
                allowed = self._peer_allowed(session)
                refusal = self.guard.feedback_mail(ip, allowed, self.listener.name)
                if refusal is not None:
                    self.stats.reject("feedback_rate")
                    return refusal
            if address.lower() not in (r.lower() for r in envelope.rcpt_tos):
                envelope.rcpt_tos.append(address)
            return "250 2.1.5 OK (feedback address)"
        if not self._peer_allowed(session):
            self.stats.reject("relay_denied")
            return "554 5.7.1 Relay access denied: authenticate or connect from an allowed network"
        local, at, domain = address.rpartition("@")
        if not at or not local or not domain or not _valid_domain(domain) or not _utf8(address):
            self.stats.reject("bad_address")
            return "553 5.1.3 Recipient address must be a fully qualified mailbox"
        targets = self.config.local.expand(address)  # local.aliases (root -> ops@...)
        if len(envelope.rcpt_tos) + len(targets) > self.config.limits.max_recipients:
            self.stats.reject("too_many_recipients")
            return "452 4.5.3 Too many recipients"
        refusal = ""
        accepted = 0
        identity = self.identity_of(str(envelope.mail_from or ""))
        for target in targets:
            supp = self.suppressions.get(target, identity)
            if supp is not None:
                self.stats.reject("suppressed")
                since = ops.iso_utc(supp[1])
                refusal = (
                    f"550 5.1.1 Recipient is suppressed since {since}: {_printable(supp[0])[:200]}"
                )
                continue
            if target.lower() not in (r.lower() for r in envelope.rcpt_tos):
                envelope.rcpt_tos.append(target)
                accepted += 1
        if not accepted and refusal:
            return refusal
        envelope.rcpt_options.extend(rcpt_options)
        if targets != (address,):
            return f"250 2.1.5 OK (alias: {len(targets)} recipient{'s' * (len(targets) > 1)})"
        return "250 2.1.5 OK"

    async def handle_MAIL(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str:
        refusal = self.gate()
        if refusal is not None:
            self.stats.reject("spool_unavailable")
            return refusal
        if address not in ("", "<>"):
            local, at, domain = address.rpartition("@")
            if not at or not local or not _valid_domain(domain) or not _utf8(address):
                return "553 5.1.7 Sender address must be a fully qualified mailbox or <>"
        envelope.mail_from = address or "<>"
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 OK"

    async def accept_stream(
        self,
        session: Session,
        envelope: Envelope,
        incoming: IncomingBody,
        nuls: int,
        long_lines: bool = False,
    ) -> str:
        """The end of a DATA (the transport calls it once the final dot is in): spool it,
        then the reply. Any failure is 451/452 and leaves nothing behind (the client keeps
        the message)."""
        self.in_flight += 1
        try:
            faults.hit("inbound.accept")
            return await self._accept(session, envelope, incoming, nuls, long_lines)
        except BaseException:
            incoming.discard()
            raise
        finally:
            self.in_flight -= 1

    async def handle_exception(self, error: Exception) -> str:
        if isinstance(error, TLSSetupException):  # a client's failed handshake: its problem
            cause = error.__cause__
            log_event(
                log,
                logging.WARNING,
                "tls_failed",
                "STARTTLS handshake failed",
                listener=self.listener.name,
                error=f"{type(cause).__name__}: {cause}" if cause else "handshake",
            )
            return "454 4.7.0 TLS not available due to temporary reason"  # never sent
        log.error("inbound session error: %s: %s", type(error).__name__, error)
        return "451 4.3.0 Internal error; message not accepted, try again later"

    # --- accepting --------------------------------------------------------------------

    async def _accept(
        self,
        session: Session,
        envelope: Envelope,
        incoming: IncomingBody,
        nuls: int,
        long_lines: bool = False,
    ) -> str:
        """The accept step, in its order: the body made ready (qualified headers, long
        lines), feedback mail taken out, the Idempotency-Key checked, the message built,
        spooled, and the reply (with the accepted line after it)."""
        cfg = self.config
        now = time.time()
        queue_id = ops.new_queue_id(now)
        peer_ip = session.ip or _peer_text(session.peer)
        try:
            await self._ready_body(session, incoming, long_lines, queue_id)
        except OSError as e:
            return self.spool_failed(queue_id, e)
        headers = incoming.headers()  # parsed once, as the data arrived
        sender = "" if envelope.mail_from in (None, "<>") else str(envelope.mail_from)
        rcpts = list(envelope.rcpt_tos)
        if self.feedback is not None:
            rcpts, reply = await self._take_feedback(incoming, rcpts, peer_ip, sender, queue_id)
            if reply is not None:
                return reply
        if nuls:
            log_event(
                log,
                logging.WARNING,
                "nul_stripped",
                "NUL characters removed from the message (RFC 5322 2.3)",
                queue_id=queue_id,
                count=nuls,
                peer=peer_ip,
            )
        ikey, chash, reply = await self._idempotency_key(headers, incoming, queue_id)
        if reply is not None:
            return reply

        added = b""
        mid, normalized = incoming.message_id()
        if not normalized:
            mid = incoming.content_message_id(cfg.hostname)
            normalized = dedup.normalize_message_id(mid)
            added = f"Message-ID: {mid}\r\n".encode()
        if header(headers, "Date") is None:
            added += date_header(now)  # after the content id: a resubmission keeps its id
        trace = received_header(
            helo=session.host_name or "unknown",
            peer_ip=peer_ip,
            hostname=cfg.hostname,
            queue_id=queue_id,
            recipient=rcpts[0] if len(rcpts) == 1 else None,
            protocol=_with_protocol(session, bool(getattr(envelope, "smtp_utf8", False))),
            now=now,
        )
        prefix = trace + added
        size = len(prefix) + incoming.size
        namespace = self._namespace(session)
        # what tells a resubmission from another message reusing the Message-ID (streamed
        # as the body arrived: relay/spool/incoming.py); an Idempotency-Key has its own rule
        fingerprint = incoming.fingerprint(header(headers, "Subject")) if ikey is None else None
        lane = self.listener.lane or classify_lane(
            self._lane_rules, sender=sender, headers=headers, listener=self.listener.name
        )
        # the namespace and Message-ID (or key) hashed once for all the recipients
        keys = (
            dedup.dedup_keys(namespace, mid, rcpts)
            if ikey is None
            else dedup.idempotency_dedup_keys(namespace, ikey, rcpts)
        )
        new_rcpts = tuple(
            ops.NewRecipient(
                address=r,
                destination=r.rpartition("@")[2].lower(),
                dedup_key=key,
                content_hash=chash,
                fingerprint=fingerprint,
            )
            for r, key in zip(rcpts, keys, strict=True)
        )
        identity = self.identity_of(sender)
        body_path: str | None = None
        try:
            if incoming.on_disk:
                # the file holds the data; the row holds our prefix (Received, Message-ID):
                # a 20 MiB message is never copied again to put 300 octets in front of it
                body_path = await incoming.commit(queue_id)
                inline = prefix
            else:
                inline = incoming.inline(prefix)  # one copy of the data, after our prefix
            msg = ops.NewMessage(
                queue_id=queue_id,
                message_id=_storable(normalized),
                sender=sender,
                size=size,
                created_at=now,
                client=namespace,
                peer=peer_ip,
                lane=lane,
                lane_prio=LANE_PRIORITY.get(lane, 0),
                identity=identity,
                body=inline,
                body_path=body_path,
                recipients=new_rcpts,
                listener=self.listener.name,
            )
            window = cfg.dedup_window
            refusal = self.gate()
            if refusal is not None:  # the spool went bad while the client sent its data
                raise SpoolError(refusal)
            # grouped: the accepts of one writer batch are three statements on PostgreSQL,
            # one INSERT on SQLite (atomic: no SAVEPOINT of the writer's); gathered
            # (spool.gather)
            # orphan: the client hung up while the writer ran this very commit (the
            # step is cancelled, the message queued all the same): logged and announced
            orphan = functools.partial(self._orphaned, msg, mid, ikey, now)
            result = await self.writer.run(
                Grouped(
                    ops.accept_many,
                    (msg, window),
                    sqlite=True,
                    gather=True,
                    atomic=True,
                    orphan=orphan,
                )
            )
        except (SpoolError, OSError) as e:
            if body_path:
                bodies.delete_bodies(cfg.spool_path, [body_path])
            incoming.discard()
            return self.spool_failed(queue_id, e)
        if result.conflicts or result.queue_id is None:
            return self._not_queued(msg, result, ikey, mid)
        # counted and its line left for after the reply before the reuse alert's own
        # commit: a client gone during that one still leaves its message logged (the
        # transport runs what is left for after the reply when a decision is cancelled)
        self._queued(msg, result, mid, ikey, session.after_reply)
        if result.reused:
            await self._reused(msg, result, mid, namespace, now)
        return f"250 2.0.0 Ok: queued as {queue_id}"

    def _queued(
        self,
        msg: ops.NewMessage,
        result: ops.AcceptResult,
        mid: str,
        ikey: str | None,
        after_reply: list[Callable[[], None]] | None,
    ) -> None:
        """A queued message counted; its line and the main process's wake-up left for after
        the 250 has gone out (`after_reply`, else the next turn of the loop): no part of the
        client's wait (0.08-0.1 ms of a serial client's 2.3 ms, bench/README.md)."""
        self.stats.accept(msg.lane)
        after = functools.partial(
            self._queued_after_reply,
            queue_id=msg.queue_id,
            message_id=mid,
            idempotency_key=ikey,
            sender=msg.sender or "<>",
            rcpts=list(result.queued),
            duplicates=len(result.duplicates),
            size=msg.size,
            lane=msg.lane,
            client=msg.client,
        )
        if after_reply is not None:
            after_reply.append(after)
        else:
            asyncio.get_running_loop().call_soon(after)

    def _orphaned(
        self,
        msg: ops.NewMessage,
        mid: str,
        ikey: str | None,
        now: float,
        result: ops.AcceptResult,
    ) -> None:
        """The spool writer's `orphan` hook of an accept (relay/spool/writer.py): its client
        hung up while the writer ran the commit, so the accept step was cancelled, and the
        message is queued all the same. It gets what an answered accept gets after its
        reply (the line, the wake-up, a reused Message-ID said loudly); a resubmission the
        spool recognised queued nothing, and its body file, if any, goes."""
        if result.conflicts or result.queue_id is None:
            self._not_queued(msg, result, ikey, mid)
            return
        if result.reused:
            # the alert's commit counts as in flight: a shutdown waits for it as for an
            # accept (relay/daemon.py, relay/inbound/processes.py), so the alert is recorded
            self.in_flight += 1
            task = asyncio.get_running_loop().create_task(
                self._reused(msg, result, mid, msg.client, now)
            )
            self._orphan_tasks.add(task)
            task.add_done_callback(self._orphan_done)
        self._queued(msg, result, mid, ikey, None)

    def _orphan_done(self, task: asyncio.Task[None]) -> None:
        self._orphan_tasks.discard(task)
        self.in_flight -= 1

    async def _ready_body(
        self, session: Session, incoming: IncomingBody, long_lines: bool, queue_id: str
    ) -> None:
        """The body as it is spooled: the header block qualified for an allow-listed app,
        lines over 998 octets re-encoded. OSError: the spool's disk."""
        await incoming.finish()
        head = incoming.header_block()
        domain = self.config.local.domain
        # `To: root` from an allow-listed app: qualified like the envelope; a header
        # block over QUALIFY_INLINE octets (up to limits.max_header_size) is read in a
        # thread, off the event loop; a small one here (tens of microseconds: less than
        # the hop to a thread and back)
        if (
            self._peer_allowed(session)
            and head
            and (
                qualify_header_block(head, domain)
                if len(head) <= QUALIFY_INLINE
                else await asyncio.to_thread(qualify_header_block, head, domain)
            )
            is not None
        ):
            await incoming.rewrite(lambda d: qualify_header_block(d, domain))
        if long_lines:  # RFC 5322 §2.1.1: re-encode, do not refuse (relay/inbound/longlines.py)
            before = incoming.size
            await incoming.rewrite(longlines.conform)
            if incoming.size != before:
                log_event(
                    log,
                    logging.INFO,
                    "reencoded",
                    "lines over 998 octets re-encoded",
                    queue_id=queue_id,
                    size=incoming.size,
                )

    async def _take_feedback(
        self, incoming: IncomingBody, rcpts: list[str], peer_ip: str, sender: str, queue_id: str
    ) -> tuple[list[str], str | None]:
        """Mail to the feedback addresses (bounces, complaints, unsubscribe requests) goes to
        the feedback service, not the queue: the other recipients, and the reply when none
        is left (or the spool failed)."""
        assert self.feedback is not None
        fb = [r for r in rcpts if self.feedback.is_feedback_rcpt(r)]
        if not fb:
            return rcpts, None
        try:
            # read no more than is parsed or stored (an outsider's 20 MiB mail to
            # the feedback address is never held in memory whole)
            conf = self.feedback.config().feedback
            data = await asyncio.to_thread(
                _head_of, incoming, max(bounces.MAX_PARSE, conf.mail_max_stored)
            )
            unsub = [r for r in fb if self.feedback.is_unsubscribe_rcpt(r)]
            if unsub:
                await self.feedback.unsubscribe_mail(data, peer=peer_ip, sender=sender)
            bounce_rcpts = [r for r in fb if r not in unsub]
            if bounce_rcpts:
                await self.feedback.mail(
                    data,
                    peer=peer_ip,
                    sender=sender,
                    rcpts=bounce_rcpts,
                    size=incoming.size,
                )
        except (SpoolError, OSError, sqlite3.Error) as e:
            incoming.discard()
            return rcpts, self.spool_failed(queue_id, e)
        rcpts = [r for r in rcpts if r not in fb]
        if not rcpts:
            incoming.discard()
            return rcpts, "250 2.0.0 Ok: feedback received"
        return rcpts, None

    async def _idempotency_key(
        self, headers: list[tuple[str, str]], incoming: IncomingBody, queue_id: str
    ) -> tuple[str | None, str | None, str | None]:
        """The message's Idempotency-Key (README "Dedup"), checked and removed before
        relaying (it is ours, not the recipient's): (key, content hash, None), (None, None,
        None) without one, or a refusal as the third."""
        ikey = header(headers, IDEMPOTENCY_KEY)
        if ikey is None:
            return None, None, None
        ikey = ikey.strip()
        if not dedup.valid_idempotency_key(ikey):
            incoming.discard()
            self.stats.reject("bad_idempotency_key")
            return (
                None,
                None,
                "554 5.6.0 Idempotency-Key must be 1 to"
                f" {dedup.IDEMPOTENCY_KEY_MAX} printable ASCII characters",
            )
        hashed: list[str] = []

        def strip_key(data: bytes) -> bytes | None:
            hashed.append(content_hash(data))
            return strip_header(data, IDEMPOTENCY_KEY)

        try:
            await incoming.rewrite(strip_key)
        except OSError as e:
            return None, None, self.spool_failed(queue_id, e)
        return ikey, hashed[0], None

    def _not_queued(
        self, msg: ops.NewMessage, result: ops.AcceptResult, ikey: str | None, mid: str
    ) -> str:
        """The reply to a message the spool did not queue: an Idempotency-Key reused for
        other content (refused), or a resubmission of what is queued (250, no copy). Its
        body file, if it had one, goes."""
        if msg.body_path:
            bodies.delete_bodies(self.config.spool_path, [msg.body_path])
        namespace = msg.client
        if result.conflicts:
            self.stats.reject("idempotency_conflict")
            log_event(
                log,
                logging.WARNING,
                "idempotency_conflict",
                "Idempotency-Key reused for other content; refused",
                idempotency_key=ikey,
                rcpts=list(result.conflicts),
                client=namespace,
            )
            return (
                f"554 5.6.0 Idempotency-Key {_printable(ikey or '')!s:.60} was already used"
                " for a message with other content; use a new key for a new message"
            )
        self.stats.deduplicated += 1
        if self.stats.metrics is not None:
            self.stats.metrics.deduplicated.inc()
        log_event(
            log,
            logging.INFO,
            "deduplicated",
            "resubmission not queued again",
            message_id=mid,
            rcpts=list(result.duplicates),
            client=namespace,
        )
        return "250 2.0.0 Ok: already queued (duplicate suppressed)"

    def _queued_after_reply(self, **fields: object) -> None:
        log_event(log, logging.INFO, "accepted", "message queued", **fields)
        self.on_queued()

    def _reuse_alert_job(
        self, msg: ops.NewMessage, result: ops.AcceptResult, mid: str, now: float
    ) -> Callable[[sqlite3.Connection], None]:
        """The alert of a reused Message-ID (one per client namespace and `alerts.coalesce`
        window: a burst makes one alert)."""
        conf = self.config.alerts

        def job(c: sqlite3.Connection) -> None:
            if result.reused:
                rcpt, first = result.reused[0]
                ev = alerts.Event(
                    REUSED,
                    "warning",
                    msg.client,
                    f"Message-ID reused for other content by {msg.client}: queued, not"
                    " dropped (fix the app's Message-IDs)",
                    {
                        **alerts.sample(msg.queue_id, rcpt, f"Message-ID {mid}"),
                        "first_queue_id": first,
                    },
                )
                alerts.record(c, ev, now, conf.coalesce, alerts.sinks_of(conf))

        return job

    async def _reused(
        self, msg: ops.NewMessage, result: ops.AcceptResult, mid: str, namespace: str, now: float
    ) -> None:
        """README "Dedup": a new message under a Message-ID already used for other content
        within `dedup.window`: queued, and said loudly (WARNING, metric, alert). The alert is
        its own small job after the accept's commit."""
        if self.stats.metrics is not None:
            self.stats.metrics.message_id_reused.inc()
        log_event(
            log,
            logging.WARNING,
            REUSED,
            "Message-ID reused for other content within dedup.window: queued, not a duplicate",
            queue_id=msg.queue_id,
            first_queue_id=",".join(sorted({first for _r, first in result.reused})),
            message_id=mid,
            rcpts=[r for r, _first in result.reused],
            client=namespace,
        )
        try:
            await self.writer.run(self._reuse_alert_job(msg, result, mid, now))
        except (SpoolError, OSError, sqlite3.Error) as e:
            # the message is safe; only the alert is not recorded (the line above says why)
            log.warning("%s: reuse alert not recorded: %s", msg.queue_id, e)

    def spool_failed(self, queue_id: str, e: BaseException) -> str:
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        full = full or "full" in str(e).lower()
        log_event(
            log,
            logging.ERROR,
            "spool_error",
            "message not accepted",
            queue_id=queue_id,
            error=str(e),
        )
        self.stats.reject("spool_error")
        if isinstance(e, SpoolError) and str(e)[:4] in ("451 ", "452 "):
            return str(e)  # the daemon's health gate: its own reply
        if full:
            return "452 4.3.1 Insufficient system storage; try again later"
        return "451 4.3.0 Spool unavailable; message not accepted, try again later"

    def identity_of(self, sender: str) -> str:
        """The sending identity of an envelope sender (shaping.sending_identity)."""
        return shaping.sending_identity(self.config.shaping.identity_by, sender)

    def _namespace(self, session: Session) -> str:
        user = getattr(session, "auth_data", None)
        if session.authenticated and user is not None:
            login = getattr(user, "login", user)
            if isinstance(login, bytes):
                login = login.decode("utf-8", errors="replace")
            return f"user:{login}"
        return f"listener:{self.listener.namespace}"


def _strip_keyword(arg: str | None, keyword: str) -> str | None:
    """The text after `FROM:` / `TO:` (case-insensitive; RFC 5321 §4.1.1.2 has no space
    before the path, but many clients send one)."""
    if arg is None or arg[: len(keyword)].upper() != keyword:
        return None
    return arg[len(keyword) :]


def _with_protocol(session: Session, utf8: bool = False) -> str:
    """The `with` of our Received: line: SMTP, ESMTP, or RFC 3848's ESMTPS (TLS), ESMTPA
    (authenticated), ESMTPSA (both); with SMTPUTF8, RFC 6531 §4.3's UTF8SMTP, UTF8SMTPS,
    UTF8SMTPA, UTF8SMTPSA."""
    if not session.extended_smtp:
        return "SMTP"
    return (
        ("UTF8SMTP" if utf8 else "ESMTP")
        + ("S" if session.ssl is not None else "")
        + ("A" if session.authenticated else "")
    )


def _valid_domain(domain: str) -> bool:
    try:
        address_.check_domain(domain)
    except address_.AddressError:
        return False
    return True


def _utf8(text: str) -> bool:
    """False when aiosmtpd kept bytes that are not UTF-8 (as surrogates): such an address can
    never be stored or relayed, so it is refused at once rather than with 451 after DATA."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


IDEMPOTENCY_KEY = "Idempotency-Key"
# a header block up to this size is checked for bare local parts in the event loop (a
# typical app's block: ~20 us; 1 KiB of nothing but address fields: ~0.5 ms at worst)
QUALIFY_INLINE = 1024
REUSED = "message_id_reused"  # the log event and alert of a Message-ID reused (README "Dedup")


def _head_of(incoming: IncomingBody, limit: int) -> bytes:
    """The first `limit` octets of the message as received (feedback and unsubscribe mail:
    what the parser reads and the store keeps, never a whole large body in memory)."""
    path = incoming.tmp_path
    if path is None:
        return incoming.inline()[:limit]
    with path.open("rb") as f:
        return f.read(limit)


def _peer_text(peer: object) -> str:
    return str(peer[0]) if isinstance(peer, tuple) else str(peer)


def _storable(text: str) -> str:
    """Header text for the spool's TEXT columns: bytes that are not UTF-8 become \\xNN."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _printable(text: str) -> str:
    return "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)
