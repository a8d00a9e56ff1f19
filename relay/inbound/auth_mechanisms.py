"""AUTH PLAIN and LOGIN (RFC 4954, RFC 4616) for the inbound handler, checked off the event
loop.

Our SMTP server (relay/inbound/transport.py) runs `auth_PLAIN` / `auth_LOGIN`, which
`InboundHandler` inherits from `AuthMechanisms`: a mechanism asks with `challenge_auth`, may
answer with `push`, and ends with an `AuthResult` (the shapes aiosmtpd defined, kept). The
scrypt check runs in a thread: never in the event loop, where it would stall every other
session for tens of milliseconds per attempt.

Rules:
- The exchanges are RFC 4954's (initial response or `334` challenges, `*` aborts, bad base64
  is `501 5.5.2`: relay/inbound/core.py); the credentials are checked by
  `InboundGuard.check_password` in a thread.
- A wrong password gets `535 5.7.8` after the per-IP failure delay; the third on one
  connection (auth.MAX_FAILURES) gets `421 4.7.0` and the connection is closed.
- An IP banned for AUTH failures (relay/inbound/anvil.py) gets `421 4.7.0` and is closed, and no
  check runs. Too many checks waiting: `454 4.7.0` (RFC 4954 §6), the client may retry.
- Unknown users cost the same scrypt as known ones (relay/inbound/auth.py); the log shows the user
  masked unless `log.unmask`, never a password.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
from base64 import b64decode
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay.inbound import auth as auth_
from relay.inbound.guard import AuthBusy, InboundGuard
from relay.ops.logs import log_event

if TYPE_CHECKING:
    from relay.config.tree import Config
    from relay.inbound.handler import InboundStats
    from relay.inbound.transport import InboundProtocol as SMTP

log = logging.getLogger(__name__)

INVALID = "535 5.7.8 Authentication credentials invalid"
TOO_MANY = "421 4.7.0 too many authentication failures"
BANNED = "421 4.7.0 too many authentication failures from your address, try again later"
BUSY = "454 4.7.0 Temporary authentication failure, try again later"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # no answer to a 334 (cancelled, bad base64, too long: answered)


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthResult:
    """The end of a mechanism (RFC 4954 §4): `success`; else `handled` (the reply is out
    already) or `message` (the reply to send; `535 5.7.8` when None)."""

    success: bool
    handled: bool = True
    message: str | None = None
    auth_data: Any = None


def _b64(text: str) -> bytes | None:
    try:
        return b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError):
        return None


class AuthMechanisms:
    """Mixed into InboundHandler: the AUTH mechanisms our server offers."""

    config: Config
    stats: InboundStats
    guard: InboundGuard

    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        blob: bytes | None
        if len(args) == 1:
            answer = await server.challenge_auth("")
            if answer is MISSING:
                return AuthResult(success=False, handled=True)
            blob = answer
        else:
            blob = _b64(args[1])
            if blob is None:
                await server.push("501 5.5.2 Can't decode base64")
                return AuthResult(success=False, handled=True)
        try:  # authzid NUL authcid NUL passwd (RFC 4616 §2); the authzid is ignored
            _, login, password = blob.split(b"\x00")
        except ValueError:
            await server.push("501 5.5.2 Can't split auth value")
            return AuthResult(success=False, handled=True)
        return await self._verify(server, "PLAIN", login, password)

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        login: bytes | None
        if len(args) == 1:
            answer = await server.challenge_auth(server.AuthLoginUsernameChallenge)
            if answer is MISSING:
                return AuthResult(success=False, handled=True)
            login = answer
        else:
            login = _b64(args[1])
            if login is None:
                await server.push("501 5.5.2 Can't decode base64")
                return AuthResult(success=False, handled=True)
        password = await server.challenge_auth(server.AuthLoginPasswordChallenge)
        if password is MISSING:
            return AuthResult(success=False, handled=True)
        return await self._verify(server, "LOGIN", login, password)

    async def _verify(
        self, proto: SMTP, mechanism: str, login: bytes, password: bytes
    ) -> AuthResult:
        lst = proto.relay_listener
        users = lst.auth.users if lst.auth is not None else {}
        session = proto.session
        assert session is not None  # a connection that was admitted
        peer = session.peer[0] if isinstance(session.peer, tuple) else str(session.peer)
        if self.guard.auth_banned(peer):
            return AuthResult(success=False, handled=False, message=BANNED)
        try:
            name = await self.guard.check_password(users, login, password)
        except AuthBusy:
            self.guard.auth_busy(peer, lst.name)
            return AuthResult(success=False, handled=False, message=BUSY)
        text = login.decode("utf-8", errors="replace")
        shown = text if self.config.log.unmask else auth_.mask_user(text)
        if name is not None:
            log_event(
                log,
                logging.INFO,
                "auth_ok",
                "client authenticated",
                user=shown,
                mechanism=mechanism,
                peer=peer,
                listener=lst.name,
                tls=session.ssl is not None,
            )
            # stored as session.auth_data (transport.py): _namespace makes it `user:<name>`
            return AuthResult(success=True, auth_data=name)
        proto.relay_auth_failures += 1
        self.stats.reject("auth_failed")
        if self.stats.metrics is not None:
            self.stats.metrics.auth_failures.inc()
        verdict = self.guard.auth_failed(peer, lst.name)
        log_event(
            log,
            logging.WARNING,
            "auth_failed",
            "authentication failed",
            user=shown,
            mechanism=mechanism,
            peer=peer,
            listener=lst.name,
            failures=proto.relay_auth_failures,
            failures_from_peer=verdict.failures,
        )
        if verdict.banned_until is not None:
            return AuthResult(success=False, handled=False, message=BANNED)
        if proto.relay_auth_failures >= auth_.MAX_FAILURES:
            return AuthResult(success=False, handled=False, message=TOO_MANY)
        if verdict.delay > 0:
            # RFC 4954 §4 leaves the pace to the server: each recent failure from this
            # address waits longer for its answer (relay/inbound/anvil.py)
            await asyncio.sleep(verdict.delay)
        return AuthResult(success=False, handled=False, message=INVALID)
