"""Implicit-TLS listeners (RFC 8314 §3: "submissions" on port 465, TLS from the first byte).

asyncio takes one SSLContext when the server starts, but a SIGHUP loads a renewed certificate
into a new context. So the server gets a front context whose SNI callback (called for every
handshake, with or without SNI) hands the connection to the listener's current context:
new connections get the new certificate, open ones keep theirs.

Rules:
- The front context starts with the same certificate, so a handshake never goes without one.
- The handshake must finish within `limits.command_timeout` (asyncio's
  `ssl_handshake_timeout`): a client that connects and never says hello does not hold a file
  descriptor for long. Connection limits apply once the handshake is done (the SMTP protocol
  only sees the connection then).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from relay.config.tree import ListenerTLS


def implicit_context(tls: ListenerTLS, current: Callable[[], ListenerTLS | None]) -> ssl.SSLContext:
    """The context for `create_server(ssl=...)`; `current()` is the listener's TLS as
    configured now (it changes on SIGHUP)."""
    front = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2+, no client certs
    front.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")

    def pick(
        obj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        now = current()
        if now is not None and now.context is not ctx:
            obj.context = now.context

    front.sni_callback = pick
    return front
