"""Our SMTP server's I/O: an asyncio.Protocol that feeds relay/inbound/core.py and writes
its bytes; InboundHandler makes the decisions (relay/inbound/handler.py).

Rules:
- One protocol object per connection and no task per command: the handler's MAIL, RCPT and
  EHLO decisions are coroutines that finish without waiting, so they are run to their end
  in `data_received`; a decision that really waits (the accept step: checks -> spool ->
  250, a DATA block written to disk) is run on from the done callback of each future it
  waits on (`_Waiting`: no task, no turn of the loop of its own), anything else that waits
  (an AUTH check off the loop, a STARTTLS handshake, a decision that waits on what is not
  a future) is a task. Backpressure: reading pauses until the decision ends, at once
  behind a DATA block written to disk (more data is surely coming: nothing more is read
  into memory meanwhile) and behind anything else once input is waiting (a read came
  meanwhile, or the read that ended the data held more: one read at most), so a client
  that sends nothing more while its message commits costs no pause and resumption. So the
  replies to a pipelined group go out in order, in one write per read (RFC 2920 §3.1).
- A connection lost while a decision waits cancels what it waits on (the spool writer
  skips an accept it has not taken up yet); once the spool has answered, the accept step
  ends as it would have, its reply unsent, its message logged and announced to the main
  process. A commit under way when the connection went cannot be taken back: the writer
  hands its result to the accept's `orphan` hook (relay/spool/writer.py), and the message
  gets its line and its announcement all the same (handler.py `_orphaned`; the alert of a
  reused Message-ID that follows counts in `in_flight`, which a shutdown waits for).
- At `connection_made`, before the greeting: a server shutting down answers `421 4.3.2` and
  closes (RFC 5321 §3.8); relay/inbound/guard.py admits the connection or we answer its `421 4.7.0`.
  The peer is read once, there.
- Timers are loop timer handles, never a wait_for per read: the command timer and the DATA
  rate meter (relay/inbound/session_watch.py: `421 4.4.2` and close), and the session timeout
  (`limits.session_timeout` without a command or a DATA block: closed without a reply, as
  aiosmtpd did). The session timeout moves a deadline; its handle is re-armed only when it
  fires early.
- STARTTLS is `loop.start_tls` (RFC 3207), its handshake bounded by `limits.command_timeout`;
  a failed handshake is logged (`tls_failed`) and closes. Implicit TLS (RFC 8314 §3) comes
  from the listener's server (relay/inbound/processes.py, relay/inbound/tls_listener.py): the
  session is
  over TLS from the first byte.
- AUTH: relay/inbound/auth_mechanisms.py runs the mechanism (its password check off the loop); it
  asks through `challenge_auth` and answers through `push`, as it did under aiosmtpd.
- When the writes back up (the client does not read its replies), reading pauses too.
- A hook's exception becomes InboundHandler.handle_exception's `451 4.3.0`, never a crash.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Protocol, cast

from relay.inbound import core as core_
from relay.inbound import longlines
from relay.inbound.auth_mechanisms import MISSING
from relay.inbound.session import Envelope, Session, TLSSetupException
from relay.inbound.session_watch import CommandTimeout, DataTooSlow, SessionWatch
from relay.ops.logs import log_event
from relay.spool.incoming import IncomingBody

if TYPE_CHECKING:
    from relay.config.tree import Config, Listener
    from relay.inbound.auth_mechanisms import AuthResult
    from relay.inbound.guard import InboundGuard, PeerFacts
    from relay.inbound.stats import InboundStats

log = logging.getLogger("relay.inbound")

_TLS_KEYS = ("ssl_object", "peercert", "cipher")
CODE_SUCCESS = "235 2.7.0 Authentication successful"
CODE_INVALID = "535 5.7.8 Authentication credentials invalid"
TOO_MANY_AUTH = "421 4.7.0 too many authentication failures"


class InboundHandler(Protocol):
    """What the transport needs of the accept step (relay/inbound/handler.py InboundHandler,
    which builds one protocol per connection): its settings, the guard and counters, and the
    hooks, named as aiosmtpd's were."""

    closing: bool
    config: Config
    guard: InboundGuard
    listener: Listener
    peer_facts: PeerFacts  # the listener's peers, parsed once each
    stats: InboundStats

    async def handle_EHLO(
        self,
        server: InboundProtocol,
        session: Session,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]: ...

    async def handle_MAIL(
        self,
        server: InboundProtocol,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str: ...

    async def handle_RCPT(
        self,
        server: InboundProtocol,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str: ...

    async def handle_exception(self, error: Exception) -> str: ...

    def spool_failed(self, queue_id: str, e: BaseException) -> str: ...

    async def accept_stream(
        self,
        session: Session,
        envelope: Envelope,
        incoming: IncomingBody,
        nuls: int,
        long_lines: bool = False,
    ) -> str: ...

    async def auth_PLAIN(self, server: InboundProtocol, args: list[str]) -> AuthResult: ...

    async def auth_LOGIN(self, server: InboundProtocol, args: list[str]) -> AuthResult: ...


_SETTINGS: dict[tuple[int, int, bool], tuple[Any, Any, core_.Settings]] = {}


def settings_for(handler: InboundHandler, listener: Listener, bare_ok: bool) -> core_.Settings:
    """The core's settings for a listener as configured now: made once per (config, listener)
    and reused by every connection (a SIGHUP brings new objects, hence new settings)."""
    cfg = handler.config
    key = (id(cfg), id(listener), bare_ok)
    hit = _SETTINGS.get(key)
    if hit is not None and hit[0] is cfg and hit[1] is listener:
        return hit[2]
    tls = listener.tls
    implicit = tls is not None and tls.implicit
    auth = listener.auth
    limits = cfg.limits
    made = core_.Settings(
        hostname=cfg.hostname,
        max_size=limits.max_message_size or 0,
        max_command=limits.max_command_length,
        max_line=limits.max_line_length + 1,  # + a transparency dot
        max_header=limits.max_header_size,
        max_errors=limits.max_errors,
        starttls=tls is not None and not implicit,
        require_tls=bool(listener.require_tls) and tls is not None and not implicit,
        implicit_tls=implicit,
        auth_offered=auth is not None,
        auth_plaintext=auth is not None and bool(auth.allow_plaintext),
        bare_ok=bare_ok,
        local_domain=cfg.local.domain,
    )
    if len(_SETTINGS) > 64:  # old configs after many SIGHUPs
        _SETTINGS.clear()
    _SETTINGS[key] = (cfg, listener, made)
    return made


def _drive(coro: Coroutine[Any, Any, Any], first: Any) -> Coroutine[Any, Any, Any]:
    """The rest of a coroutine that yielded `first` when run by hand, as a coroutine a task
    can run: each future it yields is awaited, then it is resumed (it reads the future's
    outcome itself, as under a task)."""

    @types.coroutine
    def rest() -> Generator[Any, None, Any]:
        fut = first
        while True:
            try:
                yield fut
            except GeneratorExit:  # this driver is being discarded: so is the coroutine
                coro.close()
                raise
            except BaseException as e:  # a cancellation: handed to the coroutine
                try:
                    fut = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                fut = coro.send(None)
            except StopIteration as stop:
                return stop.value

    return cast(Coroutine[Any, Any, Any], rest())


class _Waiting:
    """A decision that waits, run on from each asyncio future it waits on by that future's
    done callback, as a task would run it, without one (a task is made, scheduled, stepped
    and its end called back in turns of the loop of their own: 34k of a session's 1,335k
    instructions, bench/inbound_session.py). Resumed, the coroutine reads the future's
    outcome itself, as under a task; its end is the protocol's `_decided`, as a task's done
    callback. Anything else it waits on (not a future of this loop: a bare `yield`) hands
    the rest to a task (`_follow`). The protocol holds it as `_task` meanwhile.
    `cancel()` (the connection is gone) cancels the future it waits on, so the coroutine
    gets CancelledError; a future already done keeps its outcome: the spool's answer has
    come, so the accept step ends as it would have, its reply unsent but its after-reply
    work (the accepted line, the main process's wake-up) done (a task would have thrown
    CancelledError into it instead, and a queued message went unlogged)."""

    __slots__ = ("_coro", "_failed", "_fut", "_proto", "_then")

    def __init__(
        self,
        proto: InboundProtocol,
        coro: Coroutine[Any, Any, Any],
        then: Callable[[Any], None],
        failed: Callable[[Exception], None],
    ) -> None:
        self._proto = proto
        self._coro = coro
        self._then = then
        self._failed = failed
        self._fut: asyncio.Future[Any] | None = None

    def cancel(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.cancel()

    def wait(self, fut: Any) -> None:
        proto = self._proto
        if getattr(fut, "_asyncio_future_blocking", None) is True and fut.get_loop() is proto.loop:
            fut._asyncio_future_blocking = False  # taken, as a task takes it
            self._fut = fut
            proto._task = self
            fut.add_done_callback(self._step)
            return
        proto._task = None
        proto._follow(self._coro, fut, self._then, self._failed)

    def _step(self, fut: asyncio.Future[Any]) -> None:
        self._fut = None
        proto = self._proto
        try:
            if fut.cancelled():
                nxt = self._coro.throw(asyncio.CancelledError())
            else:
                nxt = self._coro.send(None)
        except StopIteration as stop:
            self._answer(stop.value)
            return
        except asyncio.CancelledError:
            proto._decided(True, None)
            return
        except Exception as e:
            try:
                self._failed(e)
            except Exception as e2:
                proto._decided(False, e2)
                return
            proto._decided(False, None)
            return
        self.wait(nxt)

    def _answer(self, value: Any) -> None:
        proto = self._proto
        try:
            proto._answer(self._then, value)
        except Exception as e:
            proto._decided(False, e)
            return
        proto._decided(False, None)


class InboundProtocol(asyncio.Protocol):
    """One SMTP connection. Also the `server` the handler's hooks and AUTH mechanisms get."""

    AuthLoginUsernameChallenge = "User Name\x00"  # RFC 4954 leaves the text to us; aiosmtpd's
    AuthLoginPasswordChallenge = "Password\x00"

    def __init__(self, handler: InboundHandler) -> None:
        self.handler = handler
        self.relay_listener = handler.listener  # as configured when the connection began
        self.relay_auth_failures = 0  # per connection (a STARTTLS does not reset it)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.envelope = Envelope()
        self.core: core_.ServerCore | None = None
        self.hostname = handler.config.hostname
        self._peer_ip: str | None = None  # set once the connection is counted
        self._peer_key = ""  # its per-IP key (anvil.client_key), from the same parse
        self._task: asyncio.Task[None] | _Waiting | None = None  # a decision that waits
        self._incoming: IncomingBody | None = None
        self._store_error: OSError | None = None
        self._auth_waiter: asyncio.Future[Any] | None = None
        self._auth_pushed: str | None = None
        self._write_paused = False
        self._reading_paused = False
        limits = handler.config.limits
        self._watch = SessionWatch(limits, self.loop, self._timed_out)
        self._idle = limits.session_timeout
        self._deadline = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    # --- the connection ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = cast(asyncio.Transport, transport)
        h = self.handler
        if h.closing:  # RFC 5321 §3.8: a server shutting down answers 421 and closes
            t.write(b"421 4.3.2 " + self.hostname.encode() + b" shutting down\r\n")
            t.close()
            return
        peer = t.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        lst = self.relay_listener
        allowed, key = h.peer_facts(ip, lst.allow)  # the one parse of the peer's address
        refusal = h.guard.admit(ip, allowed, lst.name, key)
        if refusal is not None:  # RFC 5321 §3.8: 421, then close
            t.write(refusal.encode() + b"\r\n")
            t.close()
            return
        self._peer_ip = ip
        self._peer_key = key
        h.stats.sessions += 1
        self.transport = t
        self.session = Session(
            peer=peer, ip=ip, allowed_by=(lst.allow, peer, allowed), after_reply=[]
        )
        settings = settings_for(h, lst, allowed)
        self.core = core_.ServerCore(settings)
        if settings.implicit_tls:  # TLS from the first byte (RFC 8314 §3)
            self.session.ssl = {k: t.get_extra_info(k) for k in _TLS_KEYS}
        t.write(self.core.greeting())
        self._watch.awaiting_command()
        self._touch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.session is None:  # refused in connection_made: no session was begun
            return
        self.transport = None
        if self.core is not None:
            self.core.close()
        self._watch.stop()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._peer_ip is not None:
            self.handler.guard.release(self._peer_ip, self._peer_key)
            self._peer_ip = None
        if self._task is not None:  # as aiosmtpd: a decision in flight is cancelled
            self._task.cancel()
        if self._auth_waiter is not None and not self._auth_waiter.done():
            self._auth_waiter.cancel()
        if self._incoming is not None:
            self._incoming.discard()
            self._incoming = None

    def data_received(self, data: bytes) -> None:
        core = self.core
        if core is None:
            return
        self._watch.received(data)
        core.receive_data(data)
        self._pump()

    def eof_received(self) -> bool | None:
        core = self.core
        if core is None:
            return False
        core.receive_data(b"")
        self._pump()
        # keep the socket open for our last replies; TLS transports cannot half-close
        return self.session is not None and self.session.ssl is None

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._task is None or self._auth_waiter is not None:
            self._resume_reading()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and not self._write_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    # --- the loop: events in, decisions, bytes out -----------------------------------------

    def _pump(self) -> None:
        core = self.core
        assert core is not None
        while self._task is None or self._auth_waiter is not None:
            ev = core.next_event()
            if isinstance(ev, core_.Sentinel):  # NEED_DATA or PAUSED
                break
            self._on_event(ev)
        if self._task is not None and self._auth_waiter is None and core.buffered:
            self._pause_reading()  # input behind a decision that waits: read no further
        self._flush()
        self._after_reply()
        if core.state is core_.State.CLOSED:
            self._close_transport()
        elif core.eof and self._task is None and self._auth_waiter is None:
            # the client closed its side (mid-DATA too): nothing more will come
            self._close_transport()

    def _flush(self) -> None:
        core = self.core
        assert core is not None
        out = core.data_to_send()
        t = self.transport
        if not out or t is None:
            return
        t.write(out)
        state = core.state
        if state is core_.State.DATA:
            self._watch.awaiting_data()
        elif state is core_.State.DECIDE:
            self._watch.waiting_on_us()
        elif state is not core_.State.CLOSED:
            self._watch.awaiting_command()

    def _close_transport(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()

    def _touch(self) -> None:
        """Activity: the session timeout starts again (aiosmtpd's _reset_timeout)."""
        self._deadline = self.loop.time() + self._idle
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_at(self._deadline, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self.transport is None:
            return
        if self.loop.time() < self._deadline:
            self._idle_timer = self.loop.call_at(self._deadline, self._idle_check)
            return
        self._close_transport()  # as aiosmtpd: the session timeout closes without a reply

    def _timed_out(self, reason: str) -> None:
        """SessionWatch's timers: answer 421 4.4.2 and close (RFC 5321 §3.8)."""
        text = CommandTimeout if reason == "command_timeout" else DataTooSlow
        self._close_with(reason, text.format(host=self.hostname))

    def _close_with(self, reason: str, reply: str | None) -> None:
        t = self.transport
        core = self.core
        if t is None or t.is_closing() or core is None:
            return
        if reply is not None:
            core.send_final(reply)
            self._flush()
        core.close()
        t.close()
        self.handler.guard.session_closed(reason, self._peer_ip or "?", self.relay_listener.name)

    # --- one event ---------------------------------------------------------------------------

    def _on_event(self, ev: core_.Event) -> None:
        """One event of the core, by its type (a table, not a chain of isinstance)."""
        _ON_EVENT.get(type(ev), InboundProtocol._on_other)(self, ev)

    def _on_mail(self, ev: core_.Mail) -> None:
        self._touch()
        core = self.core
        assert core is not None and self.session is not None
        self.envelope.smtp_utf8 = ev.smtputf8
        self._decide(
            self.handler.handle_MAIL(
                self, self.session, cast(Any, self.envelope), ev.address, list(ev.options)
            ),
            core.reply,
        )

    def _on_rcpt(self, ev: core_.Rcpt) -> None:
        self._touch()
        core = self.core
        assert core is not None and self.session is not None
        self._decide(
            self.handler.handle_RCPT(
                self, self.session, cast(Any, self.envelope), ev.address, list(ev.options)
            ),
            core.reply,
        )

    def _on_data_chunk(self, ev: core_.DataChunk) -> None:
        self._touch()
        incoming = self._incoming
        if incoming is not None and self._store_error is None:
            self._decide(incoming.add(ev.data), _ignore, self._store_failed)
            if self._task is not None:  # a block goes to disk: more data is surely coming
                self._pause_reading()

    def _on_data_start(self, ev: core_.DataStart) -> None:
        self._touch()
        cfg = self.handler.config
        self._incoming = IncomingBody(cfg.spool_path, cfg.inline_max)
        self._store_error = None

    def _on_data_end(self, ev: core_.DataEnd) -> None:
        self._touch()
        self._data_end(ev)

    def _on_ehlo(self, ev: core_.Ehlo) -> None:
        self._touch()
        core = self.core
        session = self.session
        assert core is not None and session is not None
        self.envelope = Envelope()
        session.extended_smtp = True
        self._decide(
            self.handler.handle_EHLO(
                self, session, cast(Any, self.envelope), ev.hostname, list(ev.responses)
            ),
            core.reply_lines,
        )

    def _on_helo(self, ev: core_.Helo) -> None:
        self._touch()
        session = self.session
        assert session is not None
        self.envelope = Envelope()
        session.extended_smtp = False
        session.host_name = ev.hostname

    def _on_rset(self, ev: core_.Rset) -> None:
        self._touch()
        self.envelope = Envelope()

    def _on_auth(self, ev: core_.Auth) -> None:
        self._touch()
        self._start(self._auth(ev), pause=True)

    def _on_auth_answer(self, ev: core_.AuthAnswer) -> None:
        waiter = self._auth_waiter
        self._auth_waiter = None
        self._pause_reading()
        if waiter is not None and not waiter.done():
            waiter.set_result(ev.blob)

    def _on_starttls(self, ev: core_.StartTls) -> None:
        self._start(self._starttls(), pause=True)

    def _on_refused(self, ev: core_.Refused) -> None:
        self.handler.stats.reject(ev.reason)

    def _on_bare_newline(self, ev: core_.BareNewline) -> None:
        self._bare_newline()

    def _on_closed(self, ev: core_.Closed) -> None:
        if ev.reason in ("max_errors", "421"):  # the 421s we send (relay/inbound/guard.py)
            reason = ev.reason
            if ev.reply.startswith(TOO_MANY_AUTH):
                reason = "auth_failures"
            self.handler.guard.session_closed(
                reason, self._peer_ip or "?", self.relay_listener.name
            )

    def _on_other(self, ev: core_.Event) -> None:  # Noop, Vrfy, Help, Quit: the core answered
        self._touch()

    def _decide(
        self,
        coro: Coroutine[Any, Any, Any],
        then: Callable[[Any], None],
        failed: Callable[[Exception], None] | None = None,
    ) -> None:
        """Run a decision: to its end here when it does not wait (the usual case), else on
        from each future it waits on (`_Waiting`; a task where it waits on anything else);
        `_pump` pauses reading once input is waiting behind it (see the rules)."""
        try:
            first = coro.send(None)
        except StopIteration as stop:
            then(stop.value)
            return
        except Exception as e:
            (failed or self._hook_failed)(e)
            return
        _Waiting(self, coro, then, failed or self._hook_failed).wait(first)

    def _follow(
        self,
        coro: Coroutine[Any, Any, Any],
        first: Any,
        then: Callable[[Any], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """The rest of a decision that waited on `first` (not a future of this loop: a bare
        `yield` of asyncio.sleep(0), say), as a task."""
        rest = _drive(coro, first)

        async def finish() -> None:
            try:
                value = await rest
            except Exception as e:
                failed(e)
                return
            self._answer(then, value)

        self._start(finish(), pause=True)

    def _start(self, coro: Coroutine[Any, Any, None], pause: bool) -> None:
        if pause:
            self._pause_reading()
        self._task = self.loop.create_task(coro)
        self._task.add_done_callback(self._task_done)

    def _answer(self, then: Callable[[Any], None], value: Any) -> None:
        """A decision's answer, given unless the session closed while it was made."""
        core = self.core
        if core is not None and core.state is not core_.State.CLOSED:
            then(value)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._decided(task.cancelled(), None if task.cancelled() else task.exception())

    def _decided(self, cancelled: bool, exc: BaseException | None) -> None:
        """A decision that waited is over (cancelled, failed with `exc`, or answered)."""
        self._task = None
        try:
            if cancelled or self.transport is None:
                return
            if exc is not None:  # never expected: the decisions catch their own
                log.error("inbound session error: %s: %s", type(exc).__name__, exc)
                self._close_transport()
                return
            self._resume_reading()
            self._pump()
        finally:
            self._after_reply()  # a connection gone meanwhile: its queued mail all the same

    def _after_reply(self) -> None:
        """Run what the decisions left for after their replies (Session.after_reply): the
        replies are written by now (uvloop sends at once)."""
        session = self.session
        if session is None or not session.after_reply:
            return
        todo, session.after_reply = session.after_reply, []
        for fn in todo:
            try:
                fn()
            except Exception:  # a log line or a wake-up must never take the session down
                log.exception("after-reply step failed")

    def _hook_failed(self, error: Exception) -> None:
        """aiosmtpd's rule, kept: a hook's exception is the handler's reply (451 4.3.0)."""
        core = self.core
        assert core is not None
        status: str
        try:
            coro = self.handler.handle_exception(error)
            try:
                coro.send(None)
                coro.close()
                status = "451 4.3.0 Internal error; message not accepted, try again later"
            except StopIteration as stop:
                status = stop.value
        except Exception:
            status = "451 4.3.0 Internal error; message not accepted, try again later"
        if core.state is core_.State.DECIDE:
            core.reply(status)

    # --- DATA ------------------------------------------------------------------------------

    def _store_failed(self, error: Exception) -> None:
        """A DATA block could not be stored (disk full, I/O error): read on to the end of
        the data (what follows must not be taken for commands), then answer 4xx."""
        if not isinstance(error, OSError):
            log.error("inbound session error: %s: %s", type(error).__name__, error)
            error = OSError(str(error))
        self._store_error = error
        if self._incoming is not None:
            self._incoming.discard()

    def _data_end(self, ev: core_.DataEnd) -> None:
        incoming = self._incoming
        envelope = self.envelope
        self._incoming = None
        self.envelope = Envelope()  # the transaction is over (aiosmtpd's post-DATA state)
        core = self.core
        assert core is not None and incoming is not None
        if ev.refusal is not None:  # the core answered 552 / 500
            incoming.discard()
            return
        if self._store_error is not None:
            incoming.discard()
            core.reply(self.handler.spool_failed("-", self._store_error))
            self._store_error = None
            return
        session = self.session
        assert session is not None
        self._decide(
            self.handler.accept_stream(
                session,
                envelope,
                incoming,
                ev.nuls,
                long_lines=ev.longest > longlines.MAX_LINE,
            ),
            core.reply,
        )

    # --- STARTTLS --------------------------------------------------------------------------

    async def _starttls(self) -> None:
        t = self.transport
        tls = self.relay_listener.tls
        core = self.core
        assert t is not None and tls is not None and core is not None
        try:
            new = await self.loop.start_tls(
                t,
                self,
                tls.context,
                server_side=True,
                ssl_handshake_timeout=self.handler.config.limits.command_timeout,
            )
        except (TimeoutError, OSError, ValueError) as e:
            self._tls_failed(e)
            return
        if new is None or self.transport is None:
            return
        self.transport = new
        # RFC 3207 §4.2: a new session, over TLS
        old = self.session
        self.session = Session(
            peer=old.peer if old else None,
            ip=old.ip if old else None,
            allowed_by=old.allowed_by if old else None,
        )
        self.session.ssl = {k: new.get_extra_info(k) for k in _TLS_KEYS}
        self.envelope = Envelope()
        core.tls_started()
        self._watch.awaiting_command()

    def _tls_failed(self, error: BaseException) -> None:
        exc = TLSSetupException()
        exc.__cause__ = error
        try:
            coro = self.handler.handle_exception(exc)
            try:
                coro.send(None)
            except StopIteration:
                pass
            else:
                coro.close()
        finally:
            t = self.transport
            if t is not None:
                t.abort()

    # --- AUTH (relay/inbound/auth_mechanisms.py) --------------------------------------------------

    async def challenge_auth(
        self, challenge: str | bytes, encode_to_b64: bool = True, log_client_response: bool = False
    ) -> Any:
        """`334 <base64>` and the client's decoded answer, or MISSING (the core answered
        a cancel, bad base64 or a line too long)."""
        core = self.core
        assert core is not None
        data = challenge.encode() if isinstance(challenge, str) else challenge
        waiter: asyncio.Future[Any] = self.loop.create_future()
        self._auth_waiter = waiter
        core.auth_challenge(data)
        self._flush()
        self._resume_reading()
        self._pump()  # an answer may be buffered already (pipelined)
        blob = await waiter
        return MISSING if blob is None else blob

    async def push(self, status: str | bytes) -> None:
        """A reply from an AUTH mechanism before it returns (`501 ...`): the exchange's end."""
        self._auth_pushed = status if isinstance(status, str) else status.decode()

    async def _auth(self, ev: core_.Auth) -> None:
        core = self.core
        session = self.session
        assert core is not None and session is not None
        h = self.handler
        method = h.auth_PLAIN if ev.mechanism == "PLAIN" else h.auth_LOGIN
        args = [ev.mechanism] if ev.initial is None else [ev.mechanism, ev.initial]
        self._auth_pushed = None
        try:
            result = await method(self, args)
        except Exception as e:
            self._auth_waiter = None
            if core.state is core_.State.DECIDE:
                self._hook_failed(e)
            return
        if core.state is not core_.State.DECIDE:
            return
        status: str | None
        if result.success:
            session.authenticated = True
            session.auth_data = result.auth_data
            session.login_data = getattr(result.auth_data, "login", None)
            status = result.message or CODE_SUCCESS
        elif result.handled:
            status = self._auth_pushed
        else:
            status = result.message or CODE_INVALID
        core.auth_done(bool(result.success), status)

    # --- bare CR/LF ----------------------------------------------------------------------

    def _bare_newline(self) -> None:
        """A command line with a bare CR or LF (RFC 5321 §2.3.8): the core answered and
        closed; neither this line nor anything pipelined after it was acted on."""
        self.handler.stats.reject("bare_newline")
        log_event(
            log,
            logging.WARNING,
            "bare_newline",
            "bare CR or LF in a command line; connection closed",
            peer=self._peer_ip,
            listener=self.relay_listener.name,
        )


def _ignore(_: object) -> None:
    return None


# InboundProtocol._on_event: the method for each type of event (others: _on_other)
_ON_EVENT: dict[type[core_.Event], Callable[[InboundProtocol, Any], None]] = {
    core_.Mail: InboundProtocol._on_mail,
    core_.Rcpt: InboundProtocol._on_rcpt,
    core_.DataChunk: InboundProtocol._on_data_chunk,
    core_.DataStart: InboundProtocol._on_data_start,
    core_.DataEnd: InboundProtocol._on_data_end,
    core_.Ehlo: InboundProtocol._on_ehlo,
    core_.Helo: InboundProtocol._on_helo,
    core_.Rset: InboundProtocol._on_rset,
    core_.Auth: InboundProtocol._on_auth,
    core_.AuthAnswer: InboundProtocol._on_auth_answer,
    core_.StartTls: InboundProtocol._on_starttls,
    core_.Refused: InboundProtocol._on_refused,
    core_.BareNewline: InboundProtocol._on_bare_newline,
    core_.Closed: InboundProtocol._on_closed,
}
