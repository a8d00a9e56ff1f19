"""One pydantic model per config section: the keys, their types (relay/config_types.py) and
defaults, the checks between keys of a section, and the frozen dataclass of relay/config.py
each section builds (callers keep reading `config.limits.max_header_size`).

A model's defaults are written as in relay.yaml (`"7d"`, `"1MiB"`): they are what
`relay config schema` shows and what relay/config.py's DEFAULTS holds for the section, and
they are validated like any value (`validate_default`). Sections not listed in SECTIONS are
still read by hand in relay/config.py (`_from_mapping`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from relay import config_types as t

# limits.max_header_size: at most what the spool keeps in memory as a message's header block
# (relay/spool/incoming.py HEAD_MAX); at least a few ordinary headers' worth
MAX_HEADER_SIZE = 1 << 20
MIN_HEADER_SIZE = 1 << 10


class Section(BaseModel):
    """A config section: unknown keys are errors, values frozen, defaults validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The section's keys and defaults as written in relay.yaml (by alias)."""
        out = {f.alias or n: f.default for n, f in cls.model_fields.items()}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


class DedupSection(Section):
    window: t.Duration = Field("7d", description="how long a Message-ID is remembered")


class LimitsSection(Section):
    max_message_size: t.Size = "25MiB"
    max_recipients: t.Int(1) = 1000  # type: ignore[valid-type]
    session_timeout: t.Duration = "300s"
    # accepted; over 998 octets re-encoded (relay/longlines.py)
    max_line_length: t.Int(78) = 65536  # type: ignore[valid-type]
    max_command_length: t.Int(512) = 512  # type: ignore[valid-type]
    max_header_size: t.Size = "1MiB"
    max_connections: t.Int(1) = 500  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 50  # type: ignore[valid-type]
    max_connections_per_ip_allowed: t.Int(1) = 500  # type: ignore[valid-type]
    allowed_reserve: t.Int(0) = 50  # type: ignore[valid-type]
    max_errors: t.Int(0) = 10  # type: ignore[valid-type]
    command_timeout: t.Duration = "60s"
    min_data_rate: t.Size = 500  # bytes/s during DATA (0 = off)
    min_data_rate_window: t.Duration = "30s"

    @model_validator(mode="after")
    def _between_keys(self) -> LimitsSection:
        if self.allowed_reserve >= self.max_connections:
            raise t.problem(
                f"{self.allowed_reserve} must be below limits.max_connections"
                f" ({self.max_connections})",
                "allowed_reserve",
            )
        if not MIN_HEADER_SIZE <= self.max_header_size <= MAX_HEADER_SIZE:
            raise t.problem(
                f"{self.max_header_size} must be between {MIN_HEADER_SIZE} (1KiB) and"
                f" {MAX_HEADER_SIZE} (1MiB)",
                "max_header_size",
            )
        if self.command_timeout <= 0:
            raise t.problem("must be more than 0", "command_timeout")
        if self.min_data_rate and self.min_data_rate_window <= 0:
            raise t.problem("must be more than 0", "min_data_rate_window")
        return self


class AuthSection(Section):
    max_parallel: t.Int(1) = 2  # type: ignore[valid-type]
    max_pending: t.Int(0) = 100  # type: ignore[valid-type]
    failure_delay: t.Duration = "0.5s"
    max_failure_delay: t.Duration = "8s"
    max_failures_per_ip: t.Int(0) = 10  # type: ignore[valid-type]
    failure_window: t.Duration = "10m"
    ban_time: t.Duration = "10m"


def _nonempty_list(value: object) -> object:
    if not isinstance(value, list | tuple) or not value:  # a tuple: the default
        raise t.problem("expected a non-empty list of durations")
    return value


class RetrySection(Section):
    schedule: Annotated[
        tuple[t.Duration, ...],
        # a check before the items': the contract's wording for "not a list"
        BeforeValidator(_nonempty_list),
        Field(json_schema_extra={"minItems": 1}),
    ] = ("1m", "5m", "30m", "2h")
    max_age: t.Duration = "5d"
    min_delay: t.Duration = "1s"
    warn_after: t.Duration = "4h"


class TimeoutsSection(Section):
    connect: t.Duration = "10s"
    command: t.Duration = "30s"
    data: t.Duration = "120s"


class DeliverySection(Section):
    workers: t.Int(1) = 50  # type: ignore[valid-type]
    batch: t.Int(1) = 200  # type: ignore[valid-type]
    poll_interval: t.Duration = "0.25s"


class HealthSection(Section):
    disk_free_warning: t.Percent = "10%"
    disk_free_critical: t.Percent = "5%"
    queue_age_warning: t.Duration = "30m"
    queue_age_critical: t.Duration = "4h"
    stall_after: t.Duration = "10m"
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


def _at_most_64(value: int) -> int:
    if value > 64:
        raise t.problem("at most 64")
    return value


class InboundSection(Section):
    # extra processes that take SMTP on the same ports and spool (relay/inbound_proc.py)
    processes: Annotated[t.Int(0), AfterValidator(_at_most_64)] = 0  # type: ignore[valid-type]


class AdminSection(Section):
    # each HTTP listener's connection bounds (relay/ops/http.py)
    listen: t.OptHostPort = "127.0.0.1:9025"
    max_connections: t.Int(1) = 256  # type: ignore[valid-type]
    max_connections_per_ip: t.Int(1) = 32  # type: ignore[valid-type]


# the sections on the library, by their key (in the order relay.yaml shows them)
SECTIONS: dict[str, type[Section]] = {
    "dedup": DedupSection,
    "limits": LimitsSection,
    "auth": AuthSection,
    "retry": RetrySection,
    "timeouts": TimeoutsSection,
    "delivery": DeliverySection,
    "health": HealthSection,
    "dsn": DsnSection,
    "admin": AdminSection,
    "log": LogSection,
    "inbound": InboundSection,
}


@dataclass(frozen=True, slots=True)
class Sections:
    """The validated sections of one file (a section with errors: its defaults)."""

    dedup: DedupSection
    limits: LimitsSection
    auth: AuthSection
    retry: RetrySection
    timeouts: TimeoutsSection
    delivery: DeliverySection
    health: HealthSection
    dsn: DsnSection
    admin: AdminSection
    log: LogSection
    inbound: InboundSection
