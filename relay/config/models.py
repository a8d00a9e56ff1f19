"""Every key of the config file on a pydantic model: the registry of the section models
(relay/config/sections/), the model of the file as a whole, and its JSON Schema.

A model's defaults are written as in relay.yaml (`"7d"`, `"1MiB"`): they are what
`relay config schema` shows and what relay/config/tree.py's DEFAULTS holds, and they are
validated like any value (`validate_default`).

Rules:
- A section (a mapping under one key) is validated once, every error at once (SECTIONS);
  the keys at the top that are no section (hostname, shutdown_timeout) are `TopLevel`.
- The collections (listen, destinations, identities, dkim, upstreams, routes) are validated
  entry by entry (relay/config/build.py, relay/config/routes.py), since an entry's key path
  or its neighbours matter (a destination inherits from "*", a route names upstreams).
- `file_model()` puts all of them in one model, whose JSON Schema is `relay config schema`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from relay.config import values as t
from relay.config.routes import NamedUpstreamSection, RouteSection
from relay.config.sections.base import MAX_HEADER_SIZE, Section
from relay.config.sections.delivery import (
    DeliverySection,
    DestinationSection,
    LanesSection,
    MxSection,
    RetrySection,
    ShapingSection,
    SmarthostSection,
    TimeoutsSection,
    UpstreamSection,
)
from relay.config.sections.feedback import (
    FEEDBACK_PROVIDERS,
    FeedbackSection,
    MailgunProvider,
    ProviderSection,
    SendgridProvider,
    SesProvider,
)
from relay.config.sections.identities import DkimEntrySection, IdentitySection
from relay.config.sections.inbound import (
    AuthSection,
    InboundSection,
    LimitsSection,
    ListenerSection,
    LocalSection,
)
from relay.config.sections.ops import (
    AdminSection,
    AlertsSection,
    DsnSection,
    HealthSection,
    LogSection,
    WebhookSection,
)
from relay.config.sections.store import DedupSection, FleetSection, OutboxSection, SpoolSection

__all__ = [
    "FEEDBACK_PROVIDERS",
    "MAX_HEADER_SIZE",
    "SECTIONS",
    "AdminSection",
    "AlertsSection",
    "AuthSection",
    "DedupSection",
    "DeliverySection",
    "DestinationSection",
    "DkimEntrySection",
    "DsnSection",
    "FeedbackSection",
    "FleetSection",
    "HealthSection",
    "IdentitySection",
    "InboundSection",
    "LanesSection",
    "LimitsSection",
    "ListenerSection",
    "LocalSection",
    "LogSection",
    "MailgunProvider",
    "MxSection",
    "NamedUpstreamSection",
    "OutboxSection",
    "ProviderSection",
    "RetrySection",
    "RouteSection",
    "Section",
    "Sections",
    "SendgridProvider",
    "SesProvider",
    "ShapingSection",
    "SmarthostSection",
    "SpoolSection",
    "TimeoutsSection",
    "TopLevel",
    "UpstreamSection",
    "WebhookSection",
    "file_model",
]


class TopLevel(Section):
    """The keys at the top of the file that are no section."""

    # the relay's name (EHLO, Received, Message-ID); None: the system's (getfqdn)
    hostname: t.OptStr = None
    shutdown_timeout: t.Duration = "30s"  # SIGTERM: how long running deliveries may finish


# the sections, by their key (in the order relay.yaml shows them)
SECTIONS: dict[str, type[Section]] = {
    "fleet": FleetSection,
    "outbox": OutboxSection,
    "spool": SpoolSection,
    "dedup": DedupSection,
    "limits": LimitsSection,
    "auth": AuthSection,
    "upstream": UpstreamSection,
    "retry": RetrySection,
    "timeouts": TimeoutsSection,
    "shaping": ShapingSection,
    "lanes": LanesSection,
    "delivery": DeliverySection,
    "alerts": AlertsSection,
    "health": HealthSection,
    "dsn": DsnSection,
    "local": LocalSection,
    "admin": AdminSection,
    "feedback": FeedbackSection,
    "log": LogSection,
    "inbound": InboundSection,
}

# the collections: a mapping or list of entries, each an entry model (relay/config/build.py)
COLLECTIONS: dict[str, tuple[Any, dict[str, Any]]] = {
    "listen": (list[ListenerSection], {"min_length": 1}),
    "destinations": (dict[str, DestinationSection | None], {}),
    "identities": (dict[str, IdentitySection], {}),
    "dkim": (dict[str, DkimEntrySection | list[DkimEntrySection]], {}),
    "upstreams": (dict[str, NamedUpstreamSection] | None, {}),
    "routes": (list[RouteSection] | None, {"min_length": 1}),
}


@dataclass(frozen=True, slots=True)
class Sections:
    """The validated sections of one file (a section with errors: its defaults)."""

    top: TopLevel
    spool: SpoolSection
    fleet: FleetSection
    outbox: OutboxSection
    dedup: DedupSection
    limits: LimitsSection
    auth: AuthSection
    upstream: UpstreamSection
    retry: RetrySection
    timeouts: TimeoutsSection
    shaping: ShapingSection
    lanes: LanesSection
    delivery: DeliverySection
    alerts: AlertsSection
    health: HealthSection
    dsn: DsnSection
    local: LocalSection
    admin: AdminSection
    feedback: FeedbackSection
    log: LogSection
    inbound: InboundSection


def file_model(defaults: dict[str, Any]) -> type[BaseModel]:
    """The whole file as one model (for its JSON Schema): every key, with `defaults`
    (relay/config/tree.py DEFAULTS) as the defaults shown."""
    fields: dict[str, Any] = {}
    for name in dict.fromkeys([*defaults, *SECTIONS, *COLLECTIONS]):
        default = defaults.get(name)
        if name in SECTIONS:
            fields[name] = (SECTIONS[name] | None, Field(default))
        elif name in TopLevel.model_fields:
            fields[name] = (TopLevel.model_fields[name].annotation, TopLevel.model_fields[name])
        else:
            kind, extra = COLLECTIONS[name]
            fields[name] = (kind, Field(default, **extra))
    return create_model(
        "RelayConfig",
        __config__=ConfigDict(extra="forbid", title="relay.yaml"),
        __doc__="relay's config file (README: Configuration; CONTRACT.md: Config)",
        **fields,
    )
