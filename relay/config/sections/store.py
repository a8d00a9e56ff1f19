"""spool, fleet, outbox, dedup: where mail is kept (relay/spool/)."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from relay.config import values as t
from relay.config.sections.base import Section


class DedupSection(Section):
    window: t.Duration = Field("7d", description="how long a Message-ID is remembered")


class FleetSection(Section):
    """fleet: several relays on one PostgreSQL spool (README "Running a fleet")."""

    node: t.OptStr = None
    lease: t.OptDuration = None  # None: 30s

    @model_validator(mode="after")
    def _renewable(self) -> FleetSection:
        if (self.lease or 30.0) < 3:
            raise t.problem("at least 3s (it is renewed every lease/3)", "lease")
        return self


class OutboxSection(Section):
    """outbox: the transactional outbox table on a PostgreSQL spool (relay/spool/outbox.py)."""

    enabled: t.OptBool = None
    poll_interval: t.OptDuration = None  # None (or 0): 1s
    batch: t.OptInt(1) = None  # type: ignore[valid-type]


class SpoolSection(Section):
    _hidden = ("dsn", "password_file")  # not shown in relay.yaml (README: PostgreSQL)

    path: t.OptPath = "../var/spool"  # type: ignore[assignment]
    inline_max: t.Size = "128KiB"
    retention: t.Duration = "7d"
    backend: t.Choice("sqlite", "postgresql") = "sqlite"  # type: ignore[valid-type]
    maildrop: t.OptPath = None  # None: <spool.path>/maildrop (relay/spool/maildrop.py)
    reserve: t.Size = "64MiB"
    gather: t.Duration = "3ms"  # the writer's wait for more accepts after a shared batch
    dsn: t.OptStr = Field(None, repr=False)  # may hold a password
    password_file: t.OptPath = None

    @model_validator(mode="after")
    def _backend(self) -> SpoolSection:
        if self.path is None:
            raise t.problem("required", "path")
        if self.backend == "sqlite":
            if self.dsn is not None or self.password_file is not None:
                raise t.problem("only with spool.backend: postgresql", "dsn")
            return self
        if not self.dsn:
            raise t.problem("required with spool.backend: postgresql", "dsn")
        if not self.dsn.startswith(("postgresql://", "postgres://")) and "=" not in self.dsn:
            raise t.problem("expected a libpq URL (postgresql://...) or key=value list", "dsn")
        try:
            _check_dsn_port(self.dsn)
        except ValueError as e:
            raise t.problem(str(e), "dsn") from None
        if self.password_file is not None and not self.password_file.is_file():
            raise t.problem(f"{self.password_file} is not a readable file", "password_file")
        return self


def _check_dsn_port(dsn: str) -> None:
    """A DSN whose URL or port libpq could never use is a config error now, not a crash
    of whatever reads it first (the message never shows the DSN: it may hold a password)."""
    from urllib.parse import urlsplit

    ports: list[str] = []
    if dsn.startswith(("postgresql://", "postgres://")):
        try:
            netloc = urlsplit(dsn).netloc
        except ValueError as e:
            raise ValueError(f"not a valid URL ({e})") from None
        # libpq's multi-host form: host1:5432,[::1]:5433
        for hostport in netloc.rpartition("@")[2].split(","):
            tail = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
            ports.append(tail.partition(":")[2])
    else:
        m = re.search(r"(?:^|\s)port\s*=\s*'?([^'\s]*)", dsn)
        ports = m.group(1).split(",") if m else []
    for p in ports:
        if p and not (p.isascii() and p.isdigit() and 0 < int(p) < 65536):
            raise ValueError(f"port {p!r} is not a number from 1 to 65535")
