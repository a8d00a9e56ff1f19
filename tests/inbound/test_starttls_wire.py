"""STARTTLS over a real socket (relay/inbound/transport.py's loop.start_tls): what a client
pipelines after STARTTLS in plaintext is never acted on (RFC 3207 §5; CVE-2011-0411)."""

from __future__ import annotations

import asyncio

import trustme

from tests.inbound.test_handler import Start, client_context, start
from tests.inbound.test_inprocess import WAIT, Client

__all__ = ["start"]  # the fixture


async def test_commands_pipelined_after_starttls_are_dropped(start: Start, ca: trustme.CA) -> None:
    r = await start(tls="starttls")
    c: Client = await r.connect()
    c.writer.write(b"STARTTLS\r\nMAIL FROM:<evil@attacker.example>\r\n")
    await c.writer.drain()
    assert await c.reply() == (220, "220 Ready to start TLS")
    await asyncio.wait_for(
        c.writer.start_tls(client_context(ca), server_hostname="127.0.0.1"), WAIT
    )
    # a new session under TLS: the injected MAIL was not taken, and EHLO is needed again
    assert await c.cmd("RCPT TO:<user@example.org>") == (
        503,
        "503 5.5.1 send HELO first",
    )
    code, text = await c.cmd("EHLO client.test")
    assert code == 250 and "250-STARTTLS" not in text
    assert await c.cmd("RCPT TO:<user@example.org>") == (503, "503 5.5.1 Error: need MAIL command")
