"""OAuth2 access tokens for SMTP AUTH XOAUTH2 / OAUTHBEARER (Microsoft 365, Google
Workspace), and the SASL strings that carry them.

Rules:
- A token comes from `token_command` (run through `/bin/sh -c`, killed after `timeout`;
  its stdout is the token, or JSON with `access_token` and `expires_in`), or from an HTTP
  POST to `token_url`: the refresh-token grant when a refresh token is configured, else the
  client-credentials grant (RFC 6749 §6, §4.4), form-encoded, over httpx.
- A token is cached until `margin` seconds before it expires. However many connections ask
  at once, one request is made (single flight); they all get its token or its error.
- `invalidate(token)`: the upstream refused it (revoked, expired early): the next `token()`
  fetches a new one. A stale token's invalidation never drops a newer one.
- Errors say what failed in one line and never carry a secret, a refresh token or an
  access token. 5xx, 429, timeouts and network errors are transient; a refusal of our
  credentials (400/401/403) is the operator's to fix.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

DEFAULT_EXPIRES = 3600.0


@dataclass(frozen=True, slots=True)
class OAuthConf:
    token_url: str | None = None
    client_id: str | None = None
    client_secret: str | None = field(default=None, repr=False)
    refresh_token: str | None = field(default=None, repr=False)
    scope: str | None = None
    token_command: str | None = None
    timeout: float = 10.0


class OAuthError(Exception):
    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class TokenSource:
    def __init__(
        self, conf: OAuthConf, clock: Callable[[], float] = time.time, margin: float = 60.0
    ) -> None:
        self.conf = conf
        self.clock = clock
        self.margin = margin
        self.fetches = 0
        self._token: str | None = None
        self._expires = 0.0
        self._inflight: asyncio.Future[str] | None = None
        self._client: httpx.AsyncClient | None = None

    async def token(self) -> str:
        if self._token is not None and self.clock() < self._expires - self.margin:
            return self._token
        if self._inflight is None:
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._inflight = fut
            try:
                token, expires_in = await self._fetch()
                self._token, self._expires = token, self.clock() + expires_in
                fut.set_result(token)
            except BaseException as e:
                fut.set_exception(
                    e
                    if isinstance(e, OAuthError)
                    else OAuthError(f"token request failed: {type(e).__name__}", True)
                )
                fut.exception()  # retrieved: no "never retrieved" warning if none waits
                if not isinstance(e, OAuthError):
                    raise
            finally:
                self._inflight = None
            return await fut
        return await asyncio.shield(self._inflight)

    def invalidate(self, token: str) -> None:
        if token == self._token:
            self._token, self._expires = None, 0.0

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _fetch(self) -> tuple[str, float]:
        self.fetches += 1
        if self.conf.token_command:
            return await self._command(self.conf.token_command)
        return await self._post()

    async def _command(self, command: str) -> tuple[str, float]:
        try:
            proc = await asyncio.create_subprocess_shell(
                command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise OAuthError(f"token_command did not start: {e.strerror or e}", True) from None
        try:
            out, _err = await asyncio.wait_for(proc.communicate(), self.conf.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise OAuthError(
                f"token_command timed out after {self.conf.timeout:g}s", True
            ) from None
        if proc.returncode != 0:
            raise OAuthError(f"token_command exited {proc.returncode}", True)
        text = out.decode("utf-8", errors="replace").strip()
        if text.startswith("{"):
            return _from_json(text, "token_command")
        token = text.splitlines()[0].strip() if text else ""
        if not token:
            raise OAuthError("token_command printed no token", True)
        return token, DEFAULT_EXPIRES

    async def _post(self) -> tuple[str, float]:
        c = self.conf
        assert c.token_url is not None
        form: dict[str, str] = {}
        if c.refresh_token:
            form["grant_type"] = "refresh_token"
            form["refresh_token"] = c.refresh_token
        else:
            form["grant_type"] = "client_credentials"
        for k, v in (
            ("client_id", c.client_id),
            ("client_secret", c.client_secret),
            ("scope", c.scope),
        ):
            if v:
                form[k] = v
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False)
        try:
            r = await self._client.post(
                c.token_url, data=form, timeout=c.timeout, headers={"Accept": "application/json"}
            )
        except httpx.TimeoutException:
            raise OAuthError(f"token endpoint timed out after {c.timeout:g}s", True) from None
        except httpx.HTTPError as e:
            raise OAuthError(f"token endpoint unreachable: {type(e).__name__}", True) from None
        if r.status_code != 200:
            code = ""
            try:
                doc = r.json()
                if isinstance(doc, dict) and isinstance(doc.get("error"), str):
                    code = f" ({doc['error'][:60]})"
            except ValueError:
                pass
            transient = r.status_code >= 500 or r.status_code == 429
            raise OAuthError(f"token endpoint answered HTTP {r.status_code}{code}", transient)
        return _from_json(r.text, "token endpoint")


def _from_json(text: str, what: str) -> tuple[str, float]:
    try:
        doc = json.loads(text)
    except ValueError:
        raise OAuthError(f"{what}: not JSON", True) from None
    token = doc.get("access_token") if isinstance(doc, dict) else None
    if not isinstance(token, str) or not token:
        raise OAuthError(f"{what}: no access_token in the answer", True)
    exp = doc.get("expires_in", DEFAULT_EXPIRES)
    try:
        expires = float(exp)
    except (TypeError, ValueError):
        expires = DEFAULT_EXPIRES
    return token, max(0.0, expires)


# --- SASL ------------------------------------------------------------------------------------


def xoauth2(user: str, token: str) -> str:
    """The XOAUTH2 initial response (Google, Microsoft)."""
    raw = f"user={user}\x01auth=Bearer {token}\x01\x01"
    return base64.b64encode(raw.encode()).decode()


def oauthbearer(user: str, token: str, host: str, port: int) -> str:
    """The OAUTHBEARER initial client response (RFC 7628 §3.1, GS2 header RFC 5801)."""
    saslname = user.replace("=", "=3D").replace(",", "=2C")
    raw = f"n,a={saslname},\x01host={host}\x01port={port}\x01auth=Bearer {token}\x01\x01"
    return base64.b64encode(raw.encode()).decode()


def parse_oauthbearer_error(b64_challenge: str) -> dict[str, object]:
    """The JSON error a server sends in its 334 challenge (RFC 7628 §3.2.2); {} if none."""
    try:
        doc = json.loads(base64.b64decode(b64_challenge, validate=True))
    except (binascii.Error, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
