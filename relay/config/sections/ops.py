"""health, dsn, log, admin, alerts: the operator's side (relay/ops/)."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, model_validator

from relay.config import values as t
from relay.config.sections.base import Section


class HealthSection(Section):
    disk_free_warning: t.Percent = "10%"
    disk_free_critical: t.Percent = "5%"
    queue_age_warning: t.Duration = "30m"
    queue_age_critical: t.Duration = "4h"
    stall_after: t.Duration = "10m"
    # an upstream whose every attempt failed this long, no answer since: a warning
    failing_after: t.Duration = "5m"
    dead_letters_warning: t.Int(1) = 50  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _between_keys(self) -> HealthSection:
        if self.disk_free_critical > self.disk_free_warning:
            raise t.problem("must not be above health.disk_free_warning", "disk_free_critical")
        if self.queue_age_critical < self.queue_age_warning:
            raise t.problem("must not be below health.queue_age_warning", "queue_age_critical")
        return self


class DsnSection(Section):
    enabled: t.Bool = False
    sender: t.OptStr = Field(None, alias="from")


class LogSection(Section):
    level: t.Choice("debug", "info", "warning", "error") = "info"  # type: ignore[valid-type]
    format: t.Choice("json", "text") = "json"  # type: ignore[valid-type]
    unmask: t.Bool = False


class AdminSection(Section):
    # each HTTP listener's connection bounds (relay/ops/http.py)
    listen: t.OptHostPort = "127.0.0.1:9025"
    max_connections: t.Int(1) = 256  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 32  # type: ignore[valid-type]
    console: t.Bool = True  # relay/ops/console: on a non-loopback listen it needs users_file
    users_file: Annotated[t.OptPath, BeforeValidator(lambda v: v or None)] = None

    @model_validator(mode="after")
    def _console_access(self) -> AdminSection:
        """The console is open (read-only, no login) only on a loopback listener; elsewhere
        it needs users (relay/ops/console/auth.py)."""
        from relay.config.users import UsersFileError
        from relay.config.users import load_console_users as load_users

        if self.users_file is not None:
            try:
                load_users(self.users_file)
            except UsersFileError as e:
                raise t.problem(str(e), "users_file") from None
        if self.console and self.listen is not None and self.users_file is None:
            host = self.listen[0]
            try:
                loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback:
                raise t.problem(
                    f"admin.listen {host} is not loopback: the console there needs"
                    " admin.users_file (`relay admin passwd NAME --role operator`), or set"
                    " admin.console: false",
                    full=True,
                )
        return self


def _http_url(url: str) -> str:
    from relay.config.redact import (
        redact_webhook_url,  # the URL is the secret: never print it whole
    )

    if not url.startswith(("http://", "https://")):
        raise t.problem(f"{redact_webhook_url(url)!r} is not an http:// or https:// URL")
    t.require_url_host(url, redact_webhook_url(url))
    return url


class WebhookSection(Section):
    """alerts.webhook: Slack, Teams, Google Chat or any JSON endpoint (relay/ops/alerts.py)."""

    # required: no default but None, so that a missing url is worded like any bad value
    url: Annotated[t.Str, AfterValidator(_http_url)] = Field(None, repr=False)
    secret_file: t.OptPath = None  # signs X-Relay-Signature; read when the config loads
    timeout: t.OptDuration = None  # None: 10s
    _secret: bytes | None = PrivateAttr(None)  # the file's contents (never in repr)

    @model_validator(mode="after")
    def _read_secret(self) -> WebhookSection:
        if self.secret_file is not None:
            try:
                self._secret = self.secret_file.read_bytes().strip()
            except OSError as e:
                msg = f"cannot read {self.secret_file}: {e.strerror or e}"
                raise t.problem(msg, "secret_file") from None
            if not self._secret:
                raise t.problem(f"{self.secret_file} is empty", "secret_file")
        return self

    @property
    def secret(self) -> bytes | None:
        return self._secret


class AlertsSection(Section):
    command: t.OptStr = None
    timeout: t.Duration = "10s"
    coalesce: t.Duration = "5m"
    webhook: WebhookSection | None = None
