"""feedback: bounces and complaints by mail and by provider webhooks (relay/feedback/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainValidator,
    PrivateAttr,
    WithJsonSchema,
    model_validator,
)

from relay.config import values as t
from relay.config.sections.base import Section, mailbox, secret_of

FEEDBACK_PROVIDERS = ("ses", "postmark", "sendgrid", "mailgun", "generic")


class ProviderSection(Section):
    """feedback.providers.<name>: HTTP basic auth whose password is the token file's."""

    token_file: t.OptPath = None
    _token: str = PrivateAttr("")

    @model_validator(mode="after")
    def _read(self) -> ProviderSection:
        if self.token_file is None:
            raise t.problem("required (the webhook's basic-auth password)", "token_file")
        self._token = secret_of(self.token_file, "token_file").strip()
        return self

    @property
    def token(self) -> str:
        return self._token


class MailgunProvider(ProviderSection):
    signing_key_file: t.OptPath = None
    _signing: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_key(self) -> MailgunProvider:
        if self.signing_key_file is None:
            raise t.problem("required (Mailgun signs every call)", "signing_key_file")
        self._signing = secret_of(self.signing_key_file, "signing_key_file").strip().encode()
        return self

    @property
    def signing_key(self) -> bytes | None:
        return self._signing


class SendgridProvider(ProviderSection):
    public_key_file: t.OptPath = None  # the signed event webhook's ECDSA key
    _public: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_key(self) -> SendgridProvider:
        if self.public_key_file is not None:
            self._public = secret_of(self.public_key_file, "public_key_file").strip().encode()
        return self

    @property
    def public_key(self) -> bytes | None:
        return self._public


def _hosts(value: object) -> object:
    hosts = value or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise t.problem("expected a list of host or host:port")
    return tuple(h.lower() for h in hosts)


class SesProvider(ProviderSection):
    """Amazon SNS's signature checked (relay/feedback/sns.py): the certificate hosts allowed
    besides sns.<region>.amazonaws.com, and the CA bundle to fetch it with."""

    verify_signatures: t.OptBool = None  # None: false
    signing_cert_hosts: Annotated[
        tuple[str, ...],
        PlainValidator(_hosts),
        WithJsonSchema({"type": ["array", "null"], "items": {"type": "string"}}),
    ] = ()
    signing_cert_ca_file: t.OptPath = None

    @model_validator(mode="after")
    def _signatures(self) -> SesProvider:
        ca = self.signing_cert_ca_file
        if ca is not None and not ca.is_file():
            raise t.problem(f"{ca} is not a file", "signing_cert_ca_file")
        if (self.signing_cert_hosts or ca is not None) and not self.verify_signatures:
            raise t.problem(
                "signing_cert_hosts and signing_cert_ca_file need verify_signatures: true"
            )
        return self


def _provider() -> Any:
    # absent: None (not validated); null: an empty mapping, whose token_file is missing
    return Field(None, validate_default=False)


class ProvidersSection(Section):
    ses: Annotated[SesProvider | None, BeforeValidator(lambda v: v or {})] = _provider()
    postmark: Annotated[ProviderSection | None, BeforeValidator(lambda v: v or {})] = _provider()
    sendgrid: Annotated[SendgridProvider | None, BeforeValidator(lambda v: v or {})] = _provider()
    mailgun: Annotated[MailgunProvider | None, BeforeValidator(lambda v: v or {})] = _provider()
    generic: Annotated[ProviderSection | None, BeforeValidator(lambda v: v or {})] = _provider()

    @staticmethod
    def unknown_key(name: str) -> str:
        import difflib

        close = difflib.get_close_matches(name, FEEDBACK_PROVIDERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown provider{hint}; known: {', '.join(FEEDBACK_PROVIDERS)}"


def _address(value: str | None) -> str | None:
    if value is not None and "+" in value.rpartition("@")[0]:
        raise t.problem("no '+' in the local part (VERP adds one)")
    return value


def _providers(value: object) -> object:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise t.problem("expected a mapping of provider names")
    return value


class FeedbackSection(Section):
    listen: t.OptHostPort = None  # its own HTTP listener; null: admin.listen
    address: Annotated[t.OptStr, AfterValidator(mailbox), AfterValidator(_address)] = None
    verp: t.Bool = False
    verp_secret_file: t.OptPath = None
    max_body: t.Size = "1MiB"
    mail_max_stored: t.Size = "256KiB"
    mail_budget: t.Size = "64MiB"
    rate_per_ip: t.Int(0) = 20  # type: ignore[valid-type]
    rate_window: t.Duration = "1m"
    max_connections: t.Int(1) = 256  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 32  # type: ignore[valid-type]
    providers: Annotated[ProvidersSection, BeforeValidator(_providers)] = {}  # type: ignore[assignment]
    _verp_secret: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _between_keys(self) -> FeedbackSection:
        if self.verp and self.address is None:
            raise t.problem("needs feedback.address (the bounce address)", "verp")
        if self.verp_secret_file is not None:
            self._verp_secret = secret_of(self.verp_secret_file, "verp_secret_file").encode()
        if self.mail_max_stored < 1024:
            raise t.problem("at least 1KiB (the headers of a report)", "mail_max_stored")
        if self.mail_budget < self.mail_max_stored:
            raise t.problem(
                f"{self.mail_budget} bytes is below feedback.mail_max_stored"
                f" ({self.mail_max_stored}): one stored mail must fit",
                "mail_budget",
            )
        if self.rate_window <= 0:
            raise t.problem("must be more than 0s", "rate_window")
        return self

    @property
    def verp_secret(self) -> bytes | None:
        return self._verp_secret
