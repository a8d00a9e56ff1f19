"""OAuth2 access tokens for SMTP AUTH XOAUTH2 / OAUTHBEARER (Microsoft 365, Google
Workspace), and the SASL strings that carry them.

Rules:
- A token comes from `token_command` (run through `/bin/sh -c` in its own process group,
  the whole group killed after `timeout`; its stdout is the token on the first line, or JSON
  with `access_token` and optional `expires_in`), or from an HTTP POST to `token_url`: the
  refresh-token grant when a refresh token is configured, else the client-credentials grant
  (RFC 6749 §6, §4.4), form-encoded, over httpx, the whole request bounded by `timeout`.
  `expires_in` defaults to 3600 s.
- A token is cached until `margin` seconds before it expires (counted from when its request
  began). However many connections ask at once, one request is made (single flight, in a
  task of its own: a caller that gives up does not cancel it for the others); they all get
  its token or its error. An error is not cached: the next `token()` asks again.
- `invalidate(token)`: the upstream refused it (revoked, expired early): the next `token()`
  fetches a new one. A stale token's invalidation never drops a newer one.
- Errors (`OAuthError`) say what failed in one line and never carry the client secret, the
  refresh token or an access token (nor the token command, which may hold secrets, nor its
  output). HTTP 5xx, 408, 429, timeouts, network errors and token-command failures are
  transient; any other refusal (400/401/403: invalid_client, invalid_grant, ...) is the
  operator's to fix.
- A token must be printable ASCII without spaces: it goes into SASL strings framed by %x01.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from relay.config.routes import OAuthConf  # a config value: upstreams.<name>.oauth
from relay.ops import shell

DEFAULT_EXPIRES = 3600.0
_TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space, no %x01
_CODE_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what may be echoed of a server's error code
_TRANSIENT_CODES = frozenset({"temporarily_unavailable", "server_error"})


class OAuthError(Exception):
    """Getting a token failed. `transient`: worth retrying as is; else a configuration fault."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(" ".join(message.split()))  # one line
        self.transient = transient


class TokenSource:
    def __init__(
        self, conf: OAuthConf, clock: Callable[[], float] = time.time, margin: float = 60.0
    ) -> None:
        self.conf = conf
        self.clock = clock
        self.margin = margin
        self.fetches = 0  # grant requests made / token commands run
        self._token: str | None = None
        self._expires = 0.0
        self._inflight: asyncio.Task[str] | None = None
        self._client: httpx.AsyncClient | None = None

    async def token(self) -> str:
        if self._token is not None and self.clock() < self._expires - self.margin:
            return self._token
        task = self._inflight
        if task is None:
            task = asyncio.get_running_loop().create_task(self._refresh())
            task.add_done_callback(_retrieve)
            self._inflight = task
        return await asyncio.shield(task)

    def invalidate(self, token: str) -> None:
        if token == self._token:
            self._token, self._expires = None, 0.0

    async def aclose(self) -> None:
        task, self._inflight = self._inflight, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def _refresh(self) -> str:
        started = self.clock()
        try:
            token, expires_in = await self._fetch()
        except OAuthError as e:
            raise self._scrubbed(e) from None
        except Exception as e:
            raise OAuthError(f"token request failed: {type(e).__name__}", True) from None
        finally:
            self._inflight = None
        if not _TOKEN_RE.fullmatch(token):
            raise OAuthError("the access token has spaces or control characters", False)
        self._token, self._expires = token, started + expires_in
        return token

    async def _fetch(self) -> tuple[str, float]:
        if self.conf.token_command:
            self.fetches += 1
            return await self._command(self.conf.token_command)
        if not self.conf.token_url:
            raise OAuthError("neither token_url nor token_command is configured", False)
        self.fetches += 1
        return await self._post(self.conf.token_url)

    def _scrubbed(self, e: OAuthError) -> OAuthError:
        """The same error, with any configured secret that slipped into it masked."""
        msg = str(e)
        for secret in (self.conf.client_secret, self.conf.refresh_token):
            if secret and secret in msg:
                msg = msg.replace(secret, "***")
        return e if msg == str(e) else OAuthError(msg, e.transient)

    async def _command(self, command: str) -> tuple[str, float]:
        try:
            done = await shell.run(command, self.conf.timeout, stdout=True)
        except TimeoutError:  # (an OSError too: first)
            raise OAuthError(
                f"token_command timed out after {self.conf.timeout:g}s", True
            ) from None
        except OSError as e:
            raise OAuthError(f"token_command did not start: {e.strerror or e}", True) from None
        out = done.stdout
        if done.returncode != 0:
            raise OAuthError(f"token_command exited {done.returncode}", True)
        text = out.decode("utf-8", errors="replace").strip()
        if text.startswith("{"):
            return _from_json(text, "token_command")
        token = text.splitlines()[0].strip() if text else ""
        if not token:
            raise OAuthError("token_command printed no token", True)
        return token, DEFAULT_EXPIRES

    async def _post(self, url: str) -> tuple[str, float]:
        c = self.conf
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
            async with asyncio.timeout(c.timeout):  # the whole request, however it trickles
                r = await self._client.post(
                    url, data=form, timeout=c.timeout, headers={"Accept": "application/json"}
                )
        except (TimeoutError, httpx.TimeoutException):
            raise OAuthError(f"token endpoint timed out after {c.timeout:g}s", True) from None
        except (httpx.InvalidURL, httpx.UnsupportedProtocol):
            raise OAuthError("token_url is not a usable http(s) URL", False) from None
        except httpx.HTTPError as e:
            raise OAuthError(f"token endpoint unreachable: {type(e).__name__}", True) from None
        if r.status_code != 200:
            code = _error_code(r)
            transient = (
                r.status_code >= 500 or r.status_code in (408, 429) or code in _TRANSIENT_CODES
            )
            detail = f" ({code})" if code else ""
            raise OAuthError(f"token endpoint answered HTTP {r.status_code}{detail}", transient)
        return _from_json(r.text, "token endpoint")


def _retrieve(task: asyncio.Task[str]) -> None:
    # an error nobody waited for (every caller gave up) is not "never retrieved"
    if not task.cancelled():
        task.exception()


def _error_code(r: httpx.Response) -> str:
    """The RFC 6749 §5.2 `error` code of a refusal, reduced to safe characters; "" if none."""
    try:
        doc = r.json()
    except ValueError:
        return ""
    code = doc.get("error") if isinstance(doc, dict) else None
    return _CODE_UNSAFE.sub("", code)[:60] if isinstance(code, str) else ""


def _from_json(text: str, what: str) -> tuple[str, float]:
    try:
        doc = json.loads(text)
    except ValueError:
        raise OAuthError(f"{what}: the answer is not JSON", True) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("access_token"), str):
        raise OAuthError(f"{what}: no access_token in the answer", True)
    token: str = doc["access_token"]
    if not token:
        raise OAuthError(f"{what}: an empty access_token in the answer", True)
    try:
        expires = float(doc.get("expires_in", DEFAULT_EXPIRES))
    except (TypeError, ValueError):
        expires = DEFAULT_EXPIRES
    if not math.isfinite(expires):
        expires = DEFAULT_EXPIRES
    return token, max(0.0, expires)


# --- SASL ------------------------------------------------------------------------------------


def xoauth2(user: str, token: str) -> str:
    """The XOAUTH2 initial response (Google, Microsoft), base64."""
    _no_separator(user, token)
    raw = f"user={user}\x01auth=Bearer {token}\x01\x01"
    return base64.b64encode(raw.encode()).decode()


def oauthbearer(user: str, token: str, host: str, port: int) -> str:
    """The OAUTHBEARER initial client response (RFC 7628 §3.1; GS2 header, RFC 5801), base64."""
    _no_separator(user, token, host)
    saslname = user.replace("=", "=3D").replace(",", "=2C")
    raw = f"n,a={saslname},\x01host={host}\x01port={port}\x01auth=Bearer {token}\x01\x01"
    return base64.b64encode(raw.encode()).decode()


def parse_oauthbearer_error(b64_challenge: str) -> dict[str, Any]:
    """The JSON error a server sends in its 334 challenge (RFC 7628 §3.2.2); {} if none."""
    try:
        doc = json.loads(base64.b64decode(b64_challenge.strip(), validate=True))
    except (binascii.Error, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _no_separator(*fields: str) -> None:
    if any("\x01" in f for f in fields):
        raise ValueError("a SASL field holds %x01, the separator")
