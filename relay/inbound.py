"""Inbound SMTP: checks, then the spool, then `250`. It never delivers.

Rules:
- `250` after DATA only once the message and all its recipients are committed (WAL fsync'd);
  any failure on that path answers `451 4.3.0` (or `452 4.3.1` when the disk is full), never
  5xx: the client keeps the message and retries (RFC 5321 §4.2.5).
- A hook exception becomes `451 4.3.0` too (aiosmtpd would answer a permanent `500`).
- A client outside every `allow` network, not authenticated, gets `554 5.7.1` at RCPT for any
  domain: never an open relay.
- Suppressed recipients are refused at RCPT with `550 5.1.1` saying why and since when.
- Limits answer with their RFC 5321 replies: too many recipients `452 4.5.3`
  (§4.5.3.1.10), too much data `552 5.3.4` (§4.5.3.1.7), over-long lines `500 5.5.2`
  (§4.5.3.1.6). The session carries on.
- Only <CRLF>.<CRLF> ends DATA (aiosmtpd >= 1.4.5); bare CR/LF become CRLF in the stored copy.
- Paths are parsed by relay/address.py (RFC 5321 §4.1.2, linear time) and stored exactly as
  checked: a malformed path is `501 5.1.7` (MAIL) or `501 5.1.3` (RCPT), never 451. A bare
  CR or LF in a command line is `500 5.5.2` and the connection is closed (relay/smtpd_adapter.py).
- STARTTLS (`listen[].tls`) and AUTH PLAIN/LOGIN (`listen[].auth`) for submitting apps. AUTH is
  offered only after STARTTLS unless `auth.allow_plaintext`; an authenticated client relays
  from anywhere and its dedup namespace is `user:<username>`. A wrong password gets
  `535 5.7.8`; the third on one connection gets `421 4.7.0` and the connection is closed.
  `require_tls` refuses MAIL before STARTTLS with `530 5.7.0`. Passwords are checked off the
  event loop, with per-IP delays and bans (relay/auth_mechanisms.py, relay/guard.py).
- `listen[].tls.mode: implicit` (RFC 8314 §3): the listener speaks TLS from the first byte
  (relay/tls_listener.py); no STARTTLS is offered, AUTH counts as over TLS and the Received
  line says ESMTPS/ESMTPSA.
- Connection limits (relay/anvil.py): over one, `421 4.7.0` and close, before the greeting.
  Slow and erring clients (relay/session_watch.py): `421 4.4.2` after `limits.command_timeout`
  waiting for a command or below `limits.min_data_rate` in DATA, `421 4.7.0` after
  `limits.max_errors` error replies (RFC 5321 §3.8, §4.2.5). Every 421 we send closes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import ipaddress
import logging
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from aiosmtpd.smtp import (
    MISSING,
    SMTP,
    Envelope,
    Session,
    TLSSetupException,
    syntax,
)

from relay import address as address_
from relay import auth as auth_
from relay import dedup, faults, longlines, shaping, smtpd_adapter
from relay.auth_mechanisms import AuthMechanisms
from relay.config import Config, Listener
from relay.dataflow import DataParser, DataState
from relay.feedback.service import FeedbackService
from relay.guard import InboundGuard, is_allowed
from relay.lanes import LANE_PRIORITY, classify_lane
from relay.logs import log_event
from relay.message import (
    content_hash,
    date_header,
    header,
    parse_headers,
    qualify_header_block,
    qualify_headers,
    received_header,
    strip_header,
)
from relay.metrics import Metrics
from relay.session_watch import CommandTimeout, DataTooSlow, SessionWatch, TooManyErrors
from relay.spool import bodies, ops
from relay.spool.incoming import IncomingBody
from relay.spool.writer import Grouped, SpoolError, SpoolWriter

log = logging.getLogger(__name__)

# Enhanced status codes (RFC 3463, advertised per RFC 2034) for aiosmtpd's built-in replies,
# which carry none.
_ENHANCED_BY_CODE = {
    "221": "2.0.0",
    "250": "2.0.0",
    "251": "2.1.5",
    "252": "2.0.0",
    "421": "4.3.2",
    "450": "4.2.0",
    "451": "4.3.0",
    "452": "4.3.1",
    "454": "4.7.0",
    "500": "5.5.2",
    "501": "5.5.4",
    "502": "5.5.1",
    "503": "5.5.1",
    "504": "5.5.4",
    "530": "5.7.0",
    "550": "5.0.0",
    "552": "5.3.4",
    "553": "5.1.3",
    "554": "5.0.0",
    "555": "5.5.4",
}
_HAS_ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3}\b")


def with_enhanced(status: str) -> str:
    if status == "250 HELP":  # last line of the EHLO reply: no status code (RFC 2034 §3)
        return status
    if len(status) < 4 or status[3] != " " or _HAS_ENHANCED.match(status):
        return status
    code = status[:3]
    enh = _ENHANCED_BY_CODE.get(code)
    if enh is None:
        return status
    text = status[4:]
    if text.startswith("Error: "):
        text = text[7:]
    return f"{code} {enh} {text}"


smtpd_adapter.install_member_caches()

DATA_BLOCK = 1 << 16  # octets read from the socket at a time during DATA


@dataclass(slots=True)
class InboundStats:
    accepted: int = 0
    deduplicated: int = 0
    rejected: int = 0
    sessions: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    metrics: Metrics | None = None

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()


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


class _RelaySession(Session):
    """aiosmtpd's Session without the deprecation WARNING it logs each time a successful
    AUTH sets `login_data` (one useless line per login)."""

    @property
    def login_data(self) -> Any:
        return self._login_data

    @login_data.setter
    def login_data(self, value: Any) -> None:
        self._login_data = value


class RelaySMTP(SMTP):
    """aiosmtpd's protocol with our limits, enhanced codes, a 421 while shutting down, and a
    limit on wrong AUTH passwords per connection.

    Nothing here may be named `auth_*`: aiosmtpd takes every such member of the protocol
    and of the handler for an AUTH mechanism."""

    def __init__(self, handler: InboundHandler, listener: Listener, **kwargs: Any) -> None:
        limits = handler.config.limits
        self.line_length_limit = limits.max_line_length + 1  # + transparent dot
        self.command_size_limit = limits.max_command_length
        self.relay_listener = listener  # as configured when this connection began
        self.relay_auth_failures = 0  # per connection (a STARTTLS does not reset it)
        super().__init__(handler, **kwargs)
        self._relay_handler = handler
        self._relay_peer_ip: str | None = None  # set once the connection is counted
        self._relay_watch = SessionWatch(limits, self.loop, self._relay_timed_out)

    def _create_session(self) -> Session:
        return _RelaySession(self.loop)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._relay_handler.closing and self.transport is None:
            # RFC 5321 §3.8: a server shutting down answers 421 and closes.
            msg = b"421 4.3.2 " + self.hostname.encode() + b" shutting down\r\n"
            cast(asyncio.Transport, transport).write(msg)
            transport.close()
            return
        first = self.transport is None  # not again for the TLS layer after STARTTLS
        if first:
            peer = transport.get_extra_info("peername")
            ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            lst = self.relay_listener
            refusal = self._relay_handler.guard.admit(ip, is_allowed(ip, lst.allow), lst.name)
            if refusal is not None:  # RFC 5321 §3.8: 421, then close
                cast(asyncio.Transport, transport).write(refusal.encode() + b"\r\n")
                transport.close()
                return
            self._relay_peer_ip = ip
            self._relay_handler.stats.sessions += 1
        super().connection_made(transport)
        if first and self.relay_listener.tls is not None and self.relay_listener.tls.implicit:
            # TLS from the first byte (RFC 8314 §3): the session is over TLS as after a
            # STARTTLS (Received: ESMTPS, auth_ok tls=true)
            assert self.session is not None
            self.session.ssl = {
                k: transport.get_extra_info(k) for k in ("ssl_object", "peercert", "cipher")
            }

    def connection_lost(self, error: Exception | None) -> None:
        if self.session is None:  # refused in connection_made: no session was begun
            return
        self._relay_watch.stop()
        if self._relay_peer_ip is not None:
            self._relay_handler.guard.release(self._relay_peer_ip)
            self._relay_peer_ip = None
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        if self.session is None:
            return False
        result: bool | None = super().eof_received()
        return result

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._relay_watch.received(data)

    def _relay_timed_out(self, reason: str) -> None:
        """SessionWatch's timers: answer 421 4.4.2 and close (RFC 5321 §3.8)."""
        text = CommandTimeout if reason == "command_timeout" else DataTooSlow
        self._relay_close(reason, text.format(host=self.hostname))

    def _relay_close(self, reason: str, reply: str | None) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if reply is not None:
            cast(asyncio.Transport, transport).write(reply.encode() + b"\r\n")
        transport.close()
        if self._handler_coroutine is not None:  # as aiosmtpd's QUIT: read no more commands
            self._handler_coroutine.cancel()
            # not even those already received (the reader exists: the loop started after it)
            smtpd_adapter.discard_unread(smtpd_adapter.reader_of(self))
        self._relay_handler.guard.session_closed(
            reason, self._relay_peer_ip or "?", self.relay_listener.name
        )

    @syntax("AUTH <mechanism>")
    async def smtp_AUTH(self, arg: str) -> None:
        if self.relay_listener.auth is None and self.relay_listener.tls is not None:
            # TLS without AUTH on this listener: aiosmtpd would offer its always-failing
            # default mechanisms after STARTTLS. (Without TLS it answers 538, as before.)
            await self.push("502 5.5.1 AUTH not available on this listener")
            return
        await super().smtp_AUTH(arg)
        if self.relay_auth_failures >= auth_.MAX_FAILURES and self.transport is not None:
            self.transport.close()  # after its 421 (relay/auth_mechanisms.py); push closed too

    def _cb_client_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        super()._cb_client_connected(reader, writer)
        smtpd_adapter.make_strict(reader, self._bare_newline)

    def _bare_newline(self) -> None:
        """A command line with a bare CR or LF (RFC 5321 §2.3.8): answer and close, so that
        neither this line nor anything pipelined after it is acted on."""
        self._relay_handler.stats.reject("bare_newline")
        peer = self.session.peer if self.session is not None else None
        log_event(
            log,
            logging.WARNING,
            "bare_newline",
            "bare CR or LF in a command line; connection closed",
            peer=peer[0] if isinstance(peer, tuple) else peer,
            listener=self.relay_listener.name,
        )
        if self.transport is not None:
            cast(asyncio.Transport, self.transport).write(smtpd_adapter.BARE_NEWLINE_REPLY)
            self.transport.close()

    async def challenge_auth(
        self, challenge: str | bytes, encode_to_b64: bool = True, log_client_response: bool = False
    ) -> Any:
        """aiosmtpd's AUTH challenge (RFC 4954 §4), with an over-long answer refused with
        `500 5.5.6` (its own version fails with an internal error on a line over the
        reader's limit)."""
        data = challenge.encode() if isinstance(challenge, str) else challenge
        await self.push(b"334 " + (base64.b64encode(data) if encode_to_b64 else data))
        reader = smtpd_adapter.reader_of(self)
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError as e:
            await _discard_line(reader, e.consumed)
            await self.push("500 5.5.6 Authentication exchange line is too long")
            return MISSING
        except asyncio.IncompleteReadError:
            return MISSING
        blob = line.strip()
        if blob == b"*":  # RFC 4954 §4: the client cancels the exchange
            await self.push("501 5.7.0 Auth aborted")
            return MISSING
        try:
            return base64.b64decode(blob, validate=True)
        except binascii.Error:
            await self.push("501 5.5.2 Can't decode base64")
            return MISSING

    # --- MAIL and RCPT: our own path parser (relay/address.py) --------------------------

    async def _path_and_params(
        self,
        arg: str | None,
        keyword: str,
        *,
        null_ok: bool,
        bad: str,
    ) -> tuple[address_.Path, list[str], dict[str, str | bool]] | None:
        """`FROM:<path> params` / `TO:<path> params`: the checked path, the parameter words
        and their map; or None once the error reply has been pushed."""
        assert self.session is not None
        syntaxerr = f"501 5.5.4 Syntax: {'MAIL FROM' if null_ok else 'RCPT TO'}:<address>" + (
            " [SP <mail-parameters>]" if self.session.extended_smtp else ""
        )
        rest = _strip_keyword(arg, keyword)
        if rest is None:
            await self.push(syntaxerr)
            return None
        # a bare local part (`<root>`, cron's habit) from a client that may relay is
        # qualified with local.domain, as Postfix's myorigin / nullmailer's defaultdomain
        handler = self._relay_handler
        bare_ok = handler.peer_allowed(self.session)
        try:
            path = address_.parse_path(rest, null_ok=null_ok, bare_ok=bare_ok)
        except address_.AddressError as e:
            handler.stats.reject("bad_address")
            await self.push(f"{bad}: {e}")
            return None
        if path.address and "@" not in path.address.rpartition('"')[2]:
            path = address_.Path(handler.config.local.qualify(path.address), path.params)
        if null_ok and self.envelope is not None and self.envelope.mail_from:
            await self.push("503 5.5.1 Error: nested MAIL command")
            return None
        options = path.params.upper().split()
        params = self._getparams(options)
        if (path.params and not self.session.extended_smtp) or params is None:
            await self.push(syntaxerr)
            return None
        return path, options, params

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        if await self.check_helo_needed() or await self.check_auth_needed("MAIL"):
            return
        assert self.session is not None and self.envelope is not None
        got = await self._path_and_params(
            arg, "FROM:", null_ok=True, bad="501 5.1.7 Bad sender address syntax"
        )
        if got is None:
            return
        path, options, params = got
        body = params.pop("BODY", "7BIT")
        if body not in ("7BIT", "8BITMIME"):  # RFC 6152
            await self.push("501 5.5.4 BODY can only be one of 7BIT, 8BITMIME")
            return
        smtputf8 = params.pop("SMTPUTF8", False)
        if smtputf8 is not False and smtputf8 is not True:
            await self.push("501 5.5.4 SMTPUTF8 takes no arguments")
            return
        self.envelope.smtp_utf8 = bool(smtputf8)
        size = params.pop("SIZE", None)
        if size is not None:  # RFC 1870 §6
            if isinstance(size, bool) or not size.isascii() or not size.isdigit():
                await self.push("501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]")
                return
            if self.data_size_limit and int(size) > self.data_size_limit:
                await self.push("552 5.3.4 Message size exceeds fixed maximum message size")
                return
        if params:
            await self.push("555 5.5.4 MAIL FROM parameters not recognized or not implemented")
            return
        status = await self._relay_handler.handle_MAIL(
            self, self.session, self.envelope, path.address, options
        )
        await self.push(status)

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed() or await self.check_auth_needed("RCPT"):
            return
        assert self.session is not None and self.envelope is not None
        if not self.envelope.mail_from:
            await self.push("503 5.5.1 Error: need MAIL command")
            return
        got = await self._path_and_params(
            arg, "TO:", null_ok=False, bad="501 5.1.3 Bad recipient address syntax"
        )
        if got is None:
            return
        path, options, params = got
        if params:
            await self.push("555 5.5.4 RCPT TO parameters not recognized or not implemented")
            return
        status = await self._relay_handler.handle_RCPT(
            self, self.session, self.envelope, path.address, options
        )
        await self.push(status)

    # --- DATA: streamed (relay/dataflow.py, relay/spool/incoming.py) -------------------

    @syntax("DATA")
    async def smtp_DATA(self, arg: str | None) -> None:
        """Our DATA: read in blocks, parsed as it arrives, spooled to a file past
        `spool.inline_max`, so a session holds about 1 MiB whatever the message size
        (aiosmtpd's own reads line by line and keeps the whole message in memory)."""
        if await self.check_helo_needed() or await self.check_auth_needed("DATA"):
            return
        assert self.envelope is not None and self.session is not None
        if not self.envelope.rcpt_tos:
            await self.push("503 5.5.1 Error: need RCPT command")
            return
        if arg:
            await self.push("501 5.5.4 Syntax: DATA")
            return
        handler = self._relay_handler
        envelope = self.envelope
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        parser = DataParser(self.data_size_limit or 0, self.line_length_limit)
        incoming = IncomingBody(handler.config.spool_path, handler.config.inline_max)
        reader = smtpd_adapter.reader_of(self)
        store_error: OSError | None = None
        try:
            while True:
                block = await reader.read(DATA_BLOCK)
                if not block:  # the client closed mid-DATA (aiosmtpd cancels us on EOF too)
                    raise ConnectionResetError("connection closed during DATA")
                self._reset_timeout()  # bytes keep arriving: the session is not idle
                out = parser.feed(block)
                if out.data and store_error is None:
                    try:
                        await incoming.add(out.data)
                    except OSError as e:
                        # disk full or I/O error: read on to the end of the data (what
                        # follows must not be taken for commands), then answer 4xx
                        store_error = e
                        incoming.discard()
                if out.done:
                    if out.rest:  # pipelined commands after the final dot (RFC 2920)
                        smtpd_adapter.unread(reader, out.rest)
                    break
        except BaseException:
            incoming.discard()
            raise
        self._set_post_data_state()  # type: ignore[no-untyped-call]
        if parser.state is not DataState.NOMINAL:
            incoming.discard()
            if parser.state is DataState.TOO_MUCH:  # RFC 5321 §4.5.3.1.7
                await self.push("552 5.3.4 Message size exceeds fixed maximum message size")
            else:  # §4.5.3.1.6
                await self.push("500 5.5.2 Line too long (see RFC 5321 4.5.3.1.6)")
            return
        if store_error is not None:
            await self.push(handler.spool_failed("-", store_error))
            return
        status = await handler.accept_stream(
            self.session,
            envelope,
            incoming,
            parser.nul_count,
            long_lines=parser.longest > longlines.MAX_LINE,
        )
        await self.push(status)

    async def push(self, status: Any) -> None:
        if isinstance(status, str):
            status = with_enhanced(status)
            if status.startswith("552 5.3.4 Too much mail data"):
                status = "552 5.3.4 Message size exceeds fixed maximum message size"
        await super().push(status)
        text = status if isinstance(status, str) else status.decode("utf-8", "replace")
        if text.startswith("421"):  # RFC 5321 §3.8: a 421 closes the channel
            auth = text.startswith("421 4.7.0 too many authentication failures")
            self._relay_close("auth_failures" if auth else "421", None)
        elif self._relay_watch.replied(text):
            self._relay_watch.stop()
            self._relay_close("max_errors", TooManyErrors.format(host=self.hostname))


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
        self.writer = writer
        self.suppressions = suppressions
        self.on_queued = on_queued
        self.stats = stats or InboundStats()
        # shared by every listener of the daemon: connection counts, AUTH checks and bans
        self.guard = guard or InboundGuard(config, self.stats.metrics)
        self.closing = False
        self.in_flight = 0
        self._lane_rules = config.lanes.rules

    def reconfigure(self, config: Config) -> None:
        self._lane_rules = config.lanes.rules
        self.config = config

    def protocol(self) -> RelaySMTP:
        cfg = self.config
        lst = self.listener  # replaced on SIGHUP: new connections get the new TLS and users
        # implicit TLS: the connection is TLS already, so no STARTTLS and AUTH needs no more
        implicit = lst.tls is not None and lst.tls.implicit
        return RelaySMTP(
            self,
            lst,
            hostname=cfg.hostname,
            ident="relay ESMTP",
            data_size_limit=cfg.limits.max_message_size,
            timeout=cfg.limits.session_timeout,
            decode_data=False,
            enable_SMTPUTF8=True,
            loop=asyncio.get_running_loop(),
            tls_context=lst.tls.context if lst.tls is not None and not implicit else None,
            require_starttls=lst.require_tls and not implicit,
            # allow-listed networks still relay without AUTH
            auth_required=False,
            auth_require_tls=not implicit
            and not (lst.auth is not None and lst.auth.allow_plaintext),
            # AUTH PLAIN/LOGIN are AuthMechanisms.auth_PLAIN/auth_LOGIN (off the event loop)
        )

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
        if cast(RelaySMTP, server).relay_listener.auth is None:  # else aiosmtpd lists its own
            responses = [r for r in responses if not r.startswith("250-AUTH")]
        last = responses.pop()  # "250 HELP"
        responses.extend(["250-PIPELINING", "250-ENHANCEDSTATUSCODES", last])
        return responses

    def peer_allowed(self, session: Session | None) -> bool:
        return session is not None and self._peer_allowed(session)

    def _peer_allowed(self, session: Session) -> bool:
        if session.authenticated:
            return True
        peer = session.peer
        if not peer:
            return False
        try:
            ip = ipaddress.ip_address(peer[0] if isinstance(peer, tuple) else str(peer))
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.listener.allow)

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        if self.feedback is not None and self.feedback.is_feedback_rcpt(address):
            # not relaying: a bounce or complaint for us, from anyone (no open relay)
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
        """The end of a DATA (RelaySMTP.smtp_DATA): spool it, then the reply. Any failure
        is 451/452 and leaves nothing behind (the client keeps the message)."""
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
        cfg = self.config
        now = time.time()
        queue_id = ops.new_queue_id(now)
        peer_ip = session.peer[0] if isinstance(session.peer, tuple) else str(session.peer)
        try:
            await incoming.finish()
            head_lines = incoming.header_block()[:-2].split(b"\r\n")
            if (
                self._peer_allowed(session)
                and incoming.header_block()
                and qualify_headers(head_lines, cfg.local.domain) != head_lines
            ):
                # `To: root` from an allow-listed app: qualified like the envelope
                domain = cfg.local.domain
                await incoming.rewrite(lambda d: qualify_header_block(d, domain))
            if long_lines:  # RFC 5322 §2.1.1: re-encode, do not refuse (relay/longlines.py)
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
        except OSError as e:
            return self.spool_failed(queue_id, e)
        head = incoming.header_block()
        headers = parse_headers(head)
        sender = "" if envelope.mail_from in (None, "<>") else str(envelope.mail_from)
        rcpts = list(envelope.rcpt_tos)
        if self.feedback is not None:
            fb = [r for r in rcpts if self.feedback.is_feedback_rcpt(r)]
            if fb:
                try:
                    data = await asyncio.to_thread(_whole, incoming)
                    unsub = [r for r in fb if self.feedback.is_unsubscribe_rcpt(r)]
                    if unsub:
                        await self.feedback.unsubscribe_mail(data, peer=peer_ip, sender=sender)
                    bounce_rcpts = [r for r in fb if r not in unsub]
                    if bounce_rcpts:
                        await self.feedback.mail(
                            data, peer=peer_ip, sender=sender, rcpts=bounce_rcpts
                        )
                except (SpoolError, OSError, sqlite3.Error) as e:
                    incoming.discard()
                    return self.spool_failed(queue_id, e)
                rcpts = [r for r in rcpts if r not in fb]
                if not rcpts:
                    incoming.discard()
                    return "250 2.0.0 Ok: feedback received"
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

        ikey = header(headers, IDEMPOTENCY_KEY)
        chash: str | None = None
        if ikey is not None:
            ikey = ikey.strip()
            if not dedup.valid_idempotency_key(ikey):
                incoming.discard()
                self.stats.reject("bad_idempotency_key")
                return (
                    "554 5.6.0 Idempotency-Key must be 1 to"
                    f" {dedup.IDEMPOTENCY_KEY_MAX} printable ASCII characters"
                )
            hashed: list[str] = []

            def strip_key(data: bytes) -> bytes | None:
                hashed.append(content_hash(data))
                return strip_header(data, IDEMPOTENCY_KEY)

            try:  # the key is ours, not the recipient's: removed before relaying
                await incoming.rewrite(strip_key)
            except OSError as e:
                return self.spool_failed(queue_id, e)
            chash = hashed[0]

        added = b""
        mid = header(headers, "Message-ID")
        if not mid or not dedup.normalize_message_id(mid):
            mid = incoming.content_message_id(cfg.hostname)
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
        lane = self.listener.lane or classify_lane(
            self._lane_rules, sender=sender, headers=headers, listener=self.listener.name
        )
        new_rcpts = tuple(
            ops.NewRecipient(
                address=r,
                destination=r.rpartition("@")[2].lower(),
                dedup_key=(
                    dedup.dedup_key(namespace, mid, r)
                    if ikey is None
                    else dedup.idempotency_dedup_key(namespace, ikey, r)
                ),
                content_hash=chash,
            )
            for r in rcpts
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
                inline = prefix + incoming.inline()
            msg = ops.NewMessage(
                queue_id=queue_id,
                message_id=_storable(dedup.normalize_message_id(mid)),
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
            # grouped: the accepts of one writer batch are three statements on PostgreSQL
            result = await self.writer.run(Grouped(ops.accept_many, (msg, window)))
        except (SpoolError, OSError) as e:
            if body_path:
                bodies.delete_bodies(cfg.spool_path, [body_path])
            incoming.discard()
            return self.spool_failed(queue_id, e)
        if result.conflicts:
            if body_path:
                bodies.delete_bodies(cfg.spool_path, [body_path])
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
        if result.queue_id is None:
            if body_path:
                bodies.delete_bodies(cfg.spool_path, [body_path])
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
        self.stats.accepted += 1
        if self.stats.metrics is not None:
            self.stats.metrics.accepted.labels(lane).inc()
        log_event(
            log,
            logging.INFO,
            "accepted",
            "message queued",
            queue_id=queue_id,
            message_id=mid,
            idempotency_key=ikey,
            sender=sender or "<>",
            rcpts=list(result.queued),
            duplicates=len(result.duplicates),
            size=size,
            lane=lane,
            client=namespace,
        )
        self.on_queued()
        return f"250 2.0.0 Ok: queued as {queue_id}"

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


async def _discard_line(reader: asyncio.StreamReader, consumed: int) -> None:
    """After a LimitOverrunError: drop the over-long line up to and including its LF."""
    await reader.readexactly(consumed)
    while True:
        try:
            await reader.readuntil(b"\n")
            return
        except asyncio.LimitOverrunError as e:
            await reader.readexactly(e.consumed)


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


def _whole(incoming: IncomingBody) -> bytes:
    """The message as received (feedback mail is read whole; it is bounded by the size limit)."""
    path = incoming.tmp_path
    return incoming.inline() if path is None else path.read_bytes()


def _storable(text: str) -> str:
    """Header text for the spool's TEXT columns: bytes that are not UTF-8 become \\xNN."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _printable(text: str) -> str:
    return "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)
