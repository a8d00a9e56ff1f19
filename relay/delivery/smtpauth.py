"""SMTP AUTH to an upstream: PLAIN/LOGIN with a password, or XOAUTH2 / OAUTHBEARER with
an OAuth2 access token (relay/delivery/oauth.py), through aiosmtplib's public API.

Rules:
- `auto` lets aiosmtplib pick among what the server offers (PLAIN, LOGIN); `plain` and
  `login` force one.
- OAuth2: a token the server refuses (535, or RFC 7628's 334 error challenge, answered with
  %x01) is invalidated and a fresh one is tried once; a second refusal stands (an operator's
  fault, critical in /health). Failing to get a token raises OAuthError.
"""

from __future__ import annotations

import aiosmtplib

from relay.delivery.oauth import TokenSource, oauthbearer


async def authenticate(
    smtp: aiosmtplib.SMTP,
    auth: str,
    user: str,
    password: str | None,
    tokens: TokenSource | None,
    *,
    host: str,
    port: int,
    timeout: float,
) -> None:
    if auth not in ("xoauth2", "oauthbearer"):
        if auth == "plain":
            await smtp.auth_plain(user, password or "", timeout=timeout)
        elif auth == "login":
            await smtp.auth_login(user, password or "", timeout=timeout)
        else:
            await smtp.login(user, password or "", timeout=timeout)
        return
    assert tokens is not None
    for last in (False, True):
        token = await tokens.token()
        try:
            if auth == "xoauth2":
                await smtp.auth_xoauth2(user, token, timeout=timeout)
            else:
                initial = oauthbearer(user, token, host, port).encode()
                resp = await smtp.execute_command(b"AUTH", b"OAUTHBEARER", initial, timeout=timeout)
                if resp.code == 334:  # RFC 7628 §3.2.3: the error; answer %x01
                    resp = await smtp.execute_command(b"AQ==", timeout=timeout)
                if resp.code != 235:
                    raise aiosmtplib.SMTPAuthenticationError(resp.code, resp.message)
            return
        except aiosmtplib.SMTPAuthenticationError:
            # the token may have been revoked or expired early: one fresh one, then the
            # refusal stands
            tokens.invalidate(token)
            if last:
                raise
