"""The one-click unsubscribe endpoint (RFC 8058): what the links of the List-Unsubscribe
headers (relay/authenticity/unsubscribe.py: tokens, headers, their rules) reach.

Rules:
- Under `path_prefix` (`/u/` by default; the path of `url`): `POST /u/<TOKEN>` with
  `List-Unsubscribe=One-Click` in the body (form-urlencoded or multipart/form-data; a body
  holding the literal text is enough) writes the suppression entry scoped to the identity
  and answers 200; again and again (idempotent). `GET`/`HEAD` answer 200 with a confirmation
  page whose form POSTs that body: a GET never unsubscribes (mail scanners follow links).
  A bad token is 400 with a short page and an `unsubscribe_refused` WARNING that logs only
  the token's first characters; a POST without the one-click field is 400; another method
  405; a path outside the prefix 404; a spool error 503 (try again later).
- Pages show the recipient masked (the link works for whoever holds it), escape everything
  they show, carry no script, and ask not to be cached, indexed or framed.
"""

from __future__ import annotations

import email.parser
import email.policy
import html
import logging
import sqlite3
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping

from relay.authenticity.unsubscribe import (
    MAX_FORM,
    ONE_CLICK,
    SOURCE,
    UnsubscribeConf,
    verify,
)
from relay.ops.http import Request, Response
from relay.ops.logs import log_event, mask_address
from relay.spool.writer import SpoolError

# the unsubscribe feature's one logger, as before the endpoint had a module of its own
log = logging.getLogger("relay.authenticity.unsubscribe")


# --- HTTP ---------------------------------------------------------------------------------

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex, nofollow">
<title>{title}</title>
<style>body{{font-family:sans-serif;max-width:32em;margin:3em auto;padding:0 1em;}}
button{{font-size:1.1em;padding:.4em 1.2em;}}</style>
</head><body>
<h1>{title}</h1>
{body}
</body></html>
"""
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Robots-Tag": "noindex, nofollow",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'"
    ),
}
_ALLOW = "GET, HEAD, POST"


def _page(status: int, title: str, body: str) -> Response:
    text = _PAGE.format(title=html.escape(title), body=body)
    return Response(status, text.encode("utf-8"), "text/html; charset=utf-8", dict(_HEADERS))


def _who(identity: str, recipient: str) -> str:
    return (
        f"<strong>{html.escape(mask_address(recipient))}</strong> will no longer receive mail"
        f" from <strong>{html.escape(identity)}</strong>"
    )


def one_click(body: bytes, ctype: str) -> bool:
    """Whether a POST body holds `List-Unsubscribe=One-Click` (RFC 8058 §3.1): as a form
    field (application/x-www-form-urlencoded or multipart/form-data), or as plain text."""
    if len(body) > MAX_FORM:
        return False
    if ONE_CLICK.lower().encode() in body.lower():
        return True
    kind = ctype.split(";", 1)[0].strip().lower()
    if kind == "application/x-www-form-urlencoded":
        pairs = urllib.parse.parse_qsl(body.decode("latin-1"), keep_blank_values=True)
        return any(_is_one_click(k, v) for k, v in pairs)
    if kind == "multipart/form-data":
        raw = b"Content-Type: " + ctype.encode("latin-1", "replace") + b"\r\n\r\n" + body
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(raw)
        if not msg.is_multipart():
            return False
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            if (
                isinstance(name, str)
                and isinstance(payload, bytes)
                and _is_one_click(name, payload.decode("latin-1"))
            ):
                return True
    return False


def _is_one_click(name: str, value: str) -> bool:
    return name.strip().lower() == "list-unsubscribe" and value.strip().lower() == "one-click"


class UnsubscribeHandler:
    def __init__(
        self,
        conf: Callable[[], Mapping[str, UnsubscribeConf]],
        suppress: Callable[[str, str, str], Awaitable[bool]],
        path_prefix: str = "/u/",
    ) -> None:
        if not path_prefix.startswith("/") or not path_prefix.endswith("/"):
            raise ValueError(f"path_prefix {path_prefix!r} must start and end with '/'")
        self.conf = conf  # identity (lowercased) -> its unsubscribe conf, as config is now
        self.suppress = suppress  # (identity, recipient, source) -> True when the entry is new
        self.path_prefix = path_prefix

    def verify(self, token: str) -> tuple[str, str] | str:
        """(identity, recipient) of a valid token, else why it is refused."""
        return verify(self.conf(), token)

    async def http(self, req: Request) -> Response:
        if not req.path.startswith(self.path_prefix):
            return Response.text(404, "not found")
        if req.method not in ("GET", "HEAD", "POST"):
            return Response(405, b"method not allowed\n", headers={"Allow": _ALLOW})
        token = req.path[len(self.path_prefix) :]
        found = self.verify(token)
        if isinstance(found, str):
            self._refused(req, token, found)
            return _page(
                400,
                "Invalid unsubscribe link",
                "<p>This unsubscribe link is not valid. Please use the link in a recent"
                " message, or reply to the sender.</p>",
            )
        identity, recipient = found
        if req.method != "POST":
            return _page(
                200,
                "Unsubscribe",
                f"<p>{_who(identity, recipient)} once you confirm.</p>\n"
                '<form method="post">\n'
                '<input type="hidden" name="List-Unsubscribe" value="One-Click">\n'
                '<button type="submit">Unsubscribe</button>\n</form>',
            )
        await req.read()  # only for a valid token's POST
        if not one_click(req.body, req.headers.get("content-type", "")):
            self._refused(req, token, "POST without List-Unsubscribe=One-Click")
            return _page(
                400,
                "Not unsubscribed",
                "<p>The request did not confirm the unsubscribe. Open the link in a browser"
                " and press the button.</p>",
            )
        try:
            new = await self.suppress(identity, recipient, SOURCE)
        except (SpoolError, sqlite3.Error, OSError) as e:
            log_event(
                log,
                logging.ERROR,
                "unsubscribe_failed",
                "spool error",
                identity=identity,
                rcpt=recipient,
                exc=e,
            )
            return _page(
                503, "Try again later", "<p>Your request could not be saved. Try again later.</p>"
            )
        log_event(
            log,
            logging.INFO,
            "unsubscribed",
            "recipient unsubscribed; suppressed for this identity",
            identity=identity,
            rcpt=recipient,
            new=new,
            peer=req.peer,
        )
        return _page(200, "You are unsubscribed", f"<p>{_who(identity, recipient)}.</p>")

    def _refused(self, req: Request, token: str, reason: str) -> None:
        log_event(
            log,
            logging.WARNING,
            "unsubscribe_refused",
            reason,
            method=req.method,
            peer=req.peer,
            token_prefix=token[:12],
            token_length=len(token),
        )
