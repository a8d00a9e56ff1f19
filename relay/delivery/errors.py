"""The edge between exceptions and verdicts: what a failed delivery step means.

Rules (``classify_exception(exc, phase)`` returns a ``(Verdict, Reply)``):

- A server reply (``SMTPResponseException`` and subclasses) is classified by
  :func:`relay.delivery.replies.classify`; the exception type fixes the phase where it is
  unambiguous
  (sender refused = MAIL, recipient refused = RCPT, HELO error = EHLO, bad banner = GREETING).
  An exception never means success: a positive or malformed code in one becomes a synthetic
  ``451 4.5.0`` (RFC 3463 X.5.0 other protocol status), TRANSIENT.
- ``SMTPRecipientsRefused`` (every RCPT refused; it has no ``.code``) is summarised by its
  least final refusal, TRANSIENT > FAIL > BOUNCE, so that no recipient is bounced for
  another one's reply; :func:`classify_refused_recipients` gives each recipient its own.
- Transport failures are TRANSIENT, close the connection and apply to the whole transaction,
  with a synthetic reply: ``421 4.4.1`` when no connection was made (RFC 3463 X.4.1 "no
  answer from host"), ``451 4.4.2`` when it was lost or timed out (X.4.2 "bad connection"),
  ``451 4.4.3`` for a failed host name lookup (X.4.3 "directory server failure"),
  ``454 4.7.5`` for a TLS failure (X.7.5 "cryptographic failure"; 454 as in RFC 3207 §4).
- Authentication refused by the smarthost (``SMTPAuthenticationError``, even 535) is TRANSIENT:
  an operator's configuration fault must never bounce customers' mail.  So is a certificate
  verification failure.  :func:`is_operator_fault` tells the caller to log loudly.
- ``ValueError`` (aiosmtplib refuses bad input before sending it): at RCPT ``553 5.1.3`` bad
  recipient address syntax (BOUNCE), at MAIL ``553 5.1.7`` bad sender address syntax (FAIL),
  at DATA/DOT ``554 5.6.0`` content (FAIL); non-ASCII input (``UnicodeError``) is ``553
  5.6.7`` (RFC 6531 §3.7.4.2, FAIL); before MAIL it is our own settings: ``451 4.3.5`` system
  incorrectly configured (TRANSIENT).
- ``SMTPNotSupported`` (aiosmtplib: the message needs SMTPUTF8 the server lacks) is ``554
  5.6.7`` FAIL.  Other plain ``SMTPException`` and anything unknown are ``451 4.3.0``
  TRANSIENT: our own bugs must not bounce mail.
- DNS errors raised by the MX resolver carry their reply: :class:`DnsPermanentError` is BOUNCE
  (NXDOMAIN 5.1.2, RFC 7505 null MX 556 5.1.10), :class:`DnsTransientError` TRANSIENT.

Ambiguity (RFC 5321 §6.1, RFC 1047): once the final "." is sent, a timeout or a lost
connection does not tell whether the server took responsibility for the message.  Retrying
may deliver it twice, not retrying may lose it; the verdict stays TRANSIENT (a duplicate
beats a loss) and :func:`is_ambiguous` lets the caller record it.  aiosmtplib's ``data()``
sends DATA and the content in one call: a caller that cannot tell DATA from DOT should pass
DOT, which errs towards "ambiguous".
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Final, TypeVar

from aiosmtplib import (
    SMTPAuthenticationError,
    SMTPConnectError,
    SMTPConnectResponseError,
    SMTPException,
    SMTPHeloError,
    SMTPNotSupported,
    SMTPRecipientRefused,
    SMTPRecipientsRefused,
    SMTPResponseException,
    SMTPSenderRefused,
    SMTPServerDisconnected,
)

from relay.delivery.replies import Outcome, Phase, Reply, Scope, Verdict, classify, synthetic

__all__ = [
    "DnsError",
    "DnsPermanentError",
    "DnsTransientError",
    "classify_exception",
    "classify_refused_recipients",
    "is_after_dot",
    "is_ambiguous",
    "is_operator_fault",
]


class DnsError(Exception):
    """A failed MX/address lookup for a recipient domain, with the reply to report."""

    reply: Reply

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


class DnsTransientError(DnsError):
    """SERVFAIL, timeout ...: ``451 4.4.3 DNS lookup for <domain> failed: ...``."""

    def __init__(self, reply: Reply) -> None:
        if not reply.is_transient:
            raise ValueError(f"DnsTransientError needs a 4xx reply, got {reply}")
        super().__init__(reply)


class DnsPermanentError(DnsError):
    """NXDOMAIN (``550 5.1.2``), null MX (``556 5.1.10``, RFC 7505 §3) ..."""

    def __init__(self, reply: Reply) -> None:
        if not reply.is_permanent:
            raise ValueError(f"DnsPermanentError needs a 5xx reply, got {reply}")
        super().__init__(reply)


# Failures that leave no usable connection: TRANSIENT, close, whole transaction.
_TRANSPORT_VERDICT: Final = Verdict(
    outcome=Outcome.TRANSIENT, closes_connection=True, throttled=False, scope=Scope.TRANSACTION
)

_PHASE_LABEL: Final[dict[Phase, str]] = {
    Phase.CONNECT: "connect",
    Phase.GREETING: "greeting",
    Phase.EHLO: "EHLO",
    Phase.STARTTLS: "STARTTLS",
    Phase.AUTH: "AUTH",
    Phase.MAIL: "MAIL FROM",
    Phase.RCPT: "RCPT TO",
    Phase.DATA: "DATA",
    Phase.DOT: "final dot",
}

# The reply answering these exception types can only come from one command.
_IMPLIED_PHASE: Final[tuple[tuple[type[SMTPResponseException], Phase], ...]] = (
    (SMTPConnectResponseError, Phase.GREETING),
    (SMTPHeloError, Phase.EHLO),
    (SMTPAuthenticationError, Phase.AUTH),
    (SMTPSenderRefused, Phase.MAIL),
    (SMTPRecipientRefused, Phase.RCPT),
)

_DETAIL_MAX: Final = 200

_E = TypeVar("_E", bound=BaseException)


def is_after_dot(phase: Phase) -> bool:
    """True when the whole content, final "." included, may have reached the server."""
    return phase is Phase.DOT


def is_ambiguous(exc: BaseException, phase: Phase) -> bool:
    """True when ``exc`` in ``phase`` leaves unknown whether the message was delivered.

    That is a timeout, disconnect or other transport error (or a cancellation) while waiting
    for the reply to the final dot.  A server reply is never ambiguous.
    """
    if not is_after_dot(phase):
        return False
    if isinstance(exc, SMTPResponseException | SMTPRecipientsRefused | DnsError):
        return False
    # OSError covers ConnectionError (SMTPServerDisconnected), TimeoutError (SMTPTimeoutError,
    # asyncio.TimeoutError) and ssl.SSLError.
    return isinstance(exc, OSError | asyncio.CancelledError)


def is_operator_fault(exc: BaseException, *, verified_smarthost: bool = True) -> bool:
    """True for failures only the operator can fix: log them loudly.

    * The smarthost refused our credentials (we AUTH nowhere else), or offers no usable AUTH.
    * A certificate failed verification.  We verify certificates where the configuration
      asks for it (the smarthost); pass ``verified_smarthost=False`` when the connection
      was to a recipient's MX, where a bad certificate is the destination's problem.
    """
    if isinstance(exc, SMTPAuthenticationError):
        return True
    if type(exc) is SMTPException and "auth" in exc.message.lower():
        # aiosmtplib: "The SMTP AUTH extension is not supported by this server.",
        # "No suitable authentication method found."
        return True
    return verified_smarthost and _find_cause(exc, ssl.SSLCertVerificationError) is not None


def classify_exception(
    exc: BaseException, phase: Phase, *, peer: str | None = None
) -> tuple[Verdict, Reply]:
    """Map a delivery exception raised in ``phase`` to a verdict and the reply to record.

    ``peer`` (``"host:port"``) only makes synthetic texts more useful.
    """
    if isinstance(exc, DnsError):
        outcome = Outcome.BOUNCE if isinstance(exc, DnsPermanentError) else Outcome.TRANSIENT
        return _with_outcome(outcome), exc.reply
    if isinstance(exc, SMTPRecipientsRefused):
        return _recipients_refused(exc)
    if isinstance(exc, SMTPResponseException):
        return _response(exc, phase)
    reply = _transport_reply(exc, phase, peer)
    if reply is not None:
        return _TRANSPORT_VERDICT, reply
    if isinstance(exc, SMTPNotSupported):
        # RFC 6531 §3.7.4.2: X.6.7 non-ASCII addresses not permitted; the server lacks
        # SMTPUTF8, so this destination can never take the message as it is.
        reply = synthetic(554, "5.6.7", _detail("SMTPUTF8 required", exc))
        return classify(reply, phase), reply
    if isinstance(exc, ValueError):
        return _value_error(exc, phase)
    # Plain SMTPException ("STARTTLS extension not supported", "already connected" ...),
    # cancellation and our own bugs: X.3.0 other mail system status.
    reply = synthetic(451, "4.3.0", _detail("delivery error", exc))
    return _TRANSPORT_VERDICT, reply


def classify_refused_recipients(
    exc: SMTPRecipientsRefused,
) -> dict[str, tuple[Verdict, Reply]]:
    """Each refused recipient's own verdict and reply (RCPT phase)."""
    return {refusal.recipient: _response(refusal, Phase.RCPT) for refusal in exc.recipients}


def _with_outcome(outcome: Outcome) -> Verdict:
    # A failed lookup concerns every recipient at the domain, and there is no connection
    # to reuse.
    return Verdict(
        outcome=outcome, closes_connection=True, throttled=False, scope=Scope.TRANSACTION
    )


_FINALITY: Final[dict[Outcome, int]] = {
    Outcome.TRANSIENT: 0,
    Outcome.FAIL: 1,
    Outcome.BOUNCE: 2,
    Outcome.DELIVERED: 3,
}


def _recipients_refused(exc: SMTPRecipientsRefused) -> tuple[Verdict, Reply]:
    results = list(classify_refused_recipients(exc).values())
    if not results:
        # aiosmtplib raises it with an empty list when it was given no recipients: our bug.
        return _TRANSPORT_VERDICT, synthetic(451, "4.3.0", "no recipients to deliver to")
    # min() keeps the first of equally final refusals.
    return min(results, key=lambda result: _FINALITY[result[0].outcome])


def _response(exc: SMTPResponseException, phase: Phase) -> tuple[Verdict, Reply]:
    for exc_type, implied in _IMPLIED_PHASE:
        if isinstance(exc, exc_type):
            phase = implied
            break
    try:
        reply = Reply.parse(exc.code, exc.message)
    except ValueError:
        # aiosmtplib reports a malformed or over-long reply line with code -1.
        reply = synthetic(451, "4.5.0", _detail("malformed reply", exc))
        return _TRANSPORT_VERDICT, reply
    verdict = classify(reply, phase)
    if isinstance(exc, SMTPAuthenticationError) and verdict.outcome is not Outcome.TRANSIENT:
        # classify() already treats AUTH replies as TRANSIENT; this also covers the 334 that
        # aiosmtplib reports for a bad CRAM-MD5 challenge.
        reply = synthetic(454, "4.7.0", f"authentication failed: {reply}")
        verdict = Verdict(
            outcome=Outcome.TRANSIENT,
            closes_connection=False,
            throttled=False,
            scope=verdict.scope,
        )
    elif not (reply.is_transient or reply.is_permanent):
        # aiosmtplib raised, so the reply was not the one the command needed (e.g. 250 to
        # DATA instead of 354): the session is out of step.  Never record a positive code
        # as the reason a delivery failed.
        # The whole session is suspect, so every recipient of the transaction is affected.
        reply = synthetic(451, "4.5.0", f"unexpected reply to {_PHASE_LABEL[phase]}: {reply}")
        verdict = _TRANSPORT_VERDICT
    return verdict, reply


def _transport_reply(exc: BaseException, phase: Phase, peer: str | None) -> Reply | None:
    """The synthetic reply for a transport failure, ``None`` if ``exc`` is not one."""
    if not isinstance(exc, OSError):  # SMTPConnectError, SMTPTimeoutError ... are OSErrors
        return None
    at = f" {peer}" if peer else ""
    by = f" by {peer}" if peer else ""
    label = _PHASE_LABEL[phase]
    connecting = phase is Phase.CONNECT or isinstance(exc, SMTPConnectError)

    # ssl.SSLError is an OSError (and SSLCertVerificationError also a ValueError): check it
    # before those.  aiosmtplib wraps an implicit-TLS handshake failure in SMTPConnectError.
    cert_error = _find_cause(exc, ssl.SSLCertVerificationError)
    if cert_error is not None:
        # verify_message ("self-signed certificate", "Hostname mismatch ...") is set by the
        # ssl module on real handshake failures only.
        reason = getattr(cert_error, "verify_message", None)
        prefix = f"TLS certificate verification failed{at}"
        return synthetic(
            454, "4.7.5", f"{prefix}: {reason}" if reason else _detail(prefix, cert_error)
        )
    tls_error = _find_cause(exc, ssl.SSLError)
    if tls_error is not None:
        return synthetic(454, "4.7.5", _detail(f"TLS handshake failed{at}", tls_error))
    if _find_cause(exc, socket.gaierror) is not None:
        return synthetic(451, "4.4.3", _detail(f"DNS lookup failed{at}", exc))
    if isinstance(exc, TimeoutError):
        if connecting:
            return synthetic(421, "4.4.1", f"timeout connecting to{at or ' host'}")
        if phase is Phase.GREETING:
            return synthetic(451, "4.4.2", f"timeout waiting for greeting{by}")
        return synthetic(451, "4.4.2", f"timeout waiting for reply to {label}")
    if _find_cause(exc, ConnectionRefusedError) is not None:
        return synthetic(421, "4.4.1", f"connection refused{by}")
    if _find_cause(exc, SMTPServerDisconnected) is not None:
        where = "before greeting" if connecting or phase is Phase.GREETING else f"during {label}"
        return synthetic(451, "4.4.2", f"connection lost {where}")
    if connecting:
        # ENETUNREACH, EHOSTUNREACH ...: we never got an answer.
        return synthetic(421, "4.4.1", _detail(f"cannot connect to{at or ' host'}", exc))
    # ConnectionResetError, BrokenPipeError and other socket errors mid-session.
    return synthetic(451, "4.4.2", _detail(f"connection lost during {label}", exc))


def _value_error(exc: ValueError, phase: Phase) -> tuple[Verdict, Reply]:
    reply: Reply
    if phase in (Phase.MAIL, Phase.RCPT) and isinstance(exc, UnicodeError):
        # RFC 6531 §3.7.4.2 X.6.7: a non-ASCII address is valid, just not without SMTPUTF8.
        reply = synthetic(553, "5.6.7", _detail("non-ASCII address needs SMTPUTF8", exc))
    elif phase is Phase.RCPT:
        # RFC 3463 §3.2 X.1.3 bad destination mailbox address syntax (e.g. a CR or LF).
        reply = synthetic(553, "5.1.3", _detail("invalid recipient address", exc))
    elif phase is Phase.MAIL:
        # RFC 3463 §3.2 X.1.7 bad sender's mailbox address syntax.
        reply = synthetic(553, "5.1.7", _detail("invalid sender address", exc))
    elif phase in (Phase.DATA, Phase.DOT):
        # RFC 3463 §3.7 X.6.0 other or undefined media error.
        reply = synthetic(554, "5.6.0", _detail("message cannot be sent", exc))
    else:
        # Before MAIL only our settings are used (local hostname, TLS and AUTH options):
        # X.3.5 system incorrectly configured.  Retry once the operator fixes it.
        reply = synthetic(451, "4.3.5", _detail("configuration error", exc))
        return _TRANSPORT_VERDICT, reply
    return classify(reply, phase), reply


def _find_cause(exc: BaseException, wanted: type[_E]) -> _E | None:
    """``exc`` or the first exception of type ``wanted`` in its cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, wanted):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _detail(prefix: str, exc: BaseException) -> str:
    """``prefix: <exception text>``, bounded (it ends up in DSNs and logs)."""
    text = (str(exc).strip() if exc.args else "") or type(exc).__name__
    if len(text) > _DETAIL_MAX:
        text = text[: _DETAIL_MAX - 3] + "..."
    return f"{prefix}: {text}"
