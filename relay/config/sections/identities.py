"""identities and dkim: what a sending identity may send (daily ceilings, warm-up), its
one-click unsubscribe, and the DKIM keys of the sending domains."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import AfterValidator, PlainValidator, PrivateAttr, WithJsonSchema, model_validator

from relay.config import values as t
from relay.config.sections.base import Section, mailbox, required, secret_of


def _date(value: object) -> dt.date:
    try:
        if value is None:
            raise ValueError
        return dt.date.fromisoformat(str(value))
    except ValueError:
        raise t.problem(f"{value!r} is not a date (YYYY-MM-DD)") from None


def _counts(value: object) -> object:
    if value is not None and (
        not isinstance(value, list)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    ):
        raise t.problem("expected a list of whole numbers")
    return None if value is None else tuple(value)


class WarmupSection(Section):
    """identities.<name>.warmup: a ceiling that grows from `start` (README "Warm-up")."""

    start: Annotated[
        dt.date, PlainValidator(_date), WithJsonSchema({"type": "string", "format": "date"})
    ] = None  # type: ignore[assignment]
    schedule: Annotated[
        tuple[int, ...] | None,
        PlainValidator(_counts),
        WithJsonSchema({"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}}),
    ] = None
    initial: t.Int(1) = 500  # type: ignore[valid-type]
    factor: t.Number(1.0, 100.0) = 2.0  # type: ignore[valid-type]
    ceiling: t.OptInt(1) = None  # type: ignore[valid-type]


def _unsubscribe_url(url: str | None) -> str | None:
    from relay.config.redact import redact_url

    if url is not None:
        if not url.lower().startswith(("https://", "http://")):
            raise t.problem(f"{redact_url(url)!r} is not an https:// URL")
        t.require_url_host(url, redact_url(url))
        if not url.rstrip("/").endswith("/u"):
            raise t.problem(
                f"{redact_url(url)!r} must end in /u (the relay serves POST/GET /u/<token>)"
            )
    return url


class UnsubscribeSection(Section):
    """identities.<name>.unsubscribe: RFC 8058 one-click (relay/authenticity/unsubscribe.py)."""

    url: Annotated[t.OptStr, AfterValidator(_unsubscribe_url)] = None
    mailto: Annotated[t.OptStr, AfterValidator(mailbox)] = None
    secret_file: t.OptPath = None  # the key that signs unsubscribe links
    _secret: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _read(self) -> UnsubscribeSection:
        from relay.config.records import UNSUBSCRIBE_MIN_SECRET as MIN_SECRET

        if self.url is None and self.mailto is None:
            raise t.problem("give url, mailto or both")
        sp = self.secret_file
        if sp is None:
            raise t.problem("required (the key that signs unsubscribe links)", "secret_file")
        self._secret = secret_of(sp, "secret_file").strip().encode()
        if len(self._secret) < MIN_SECRET:
            raise t.problem(
                f"{sp} holds {len(self._secret)} bytes; at least {MIN_SECRET}"
                " (e.g. `head -c 32 /dev/urandom | base64`)",
                "secret_file",
            )
        return self

    @property
    def secret(self) -> bytes:
        return self._secret


class IdentitySection(Section):
    """identities.<name>: daily ceilings, warm-up and unsubscribe per sending identity."""

    daily_limit: t.OptInt(0) = None  # type: ignore[valid-type]
    warmup: WarmupSection | None = None
    unsubscribe: UnsubscribeSection | None = None


def _header_names(value: object) -> tuple[str, ...] | None:
    if value is not None and (
        not isinstance(value, list) or not all(isinstance(h, str) for h in value)
    ):
        raise t.problem("expected a list of header names")
    return None if value is None else tuple(value)


class DkimEntrySection(Section):
    """One key of `dkim.<domain>` (a domain may list several: RSA and Ed25519 side by side,
    RFC 8463); the key itself is loaded and checked when the tree is built."""

    selector: t.Str = None
    key_file: Annotated[t.OptPath, AfterValidator(required)] = None
    algorithm: t.OptStr = None  # None: rsa-sha256
    headers: Annotated[
        tuple[str, ...] | None,
        PlainValidator(_header_names),
        WithJsonSchema({"type": ["array", "null"], "items": {"type": "string"}}),
    ] = None
