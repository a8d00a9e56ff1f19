"""What one SMTP connection knows, as InboundHandler's decisions read it: the session (peer,
EHLO name, TLS, authentication) and the envelope of the transaction in progress.

The attribute names are aiosmtpd's, which InboundHandler and relay/inbound/auth_mechanisms.py were
written against; they are plain records here, filled in by relay/inbound/transport.py from
the core's events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Session:
    peer: Any = None  # the transport's peername: (host, port, ...) for TCP
    host_name: str | None = None  # the EHLO/HELO argument
    extended_smtp: bool = False  # EHLO rather than HELO
    ssl: dict[str, Any] | None = None  # set once the session is over TLS
    authenticated: bool | None = None
    auth_data: Any = None  # the username an AUTH proved
    login_data: Any = None
    ip: str | None = None  # the peer's address as text (set once, by the transport)
    # (the `allow` networks and the peer it was checked for, inside them): InboundHandler's
    # peer_allowed parses the address again only when a SIGHUP changed the networks
    allowed_by: tuple[Any, Any, bool] | None = None
    # work a decision leaves for after its reply has been written (the accepted line, the
    # main process's wake-up): the transport runs it once the reply is out; None when no
    # transport drives the session (a handler called on its own runs it on the loop)
    after_reply: list[Callable[[], None]] | None = None


@dataclass(slots=True)
class Envelope:
    mail_from: str | None = None
    mail_options: list[str] = field(default_factory=list)
    smtp_utf8: bool = False
    rcpt_tos: list[str] = field(default_factory=list)
    rcpt_options: list[str] = field(default_factory=list)


class TLSSetupException(Exception):
    """A client's STARTTLS handshake failed (its cause is the TLS error)."""
