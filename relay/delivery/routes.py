"""Named upstreams and routes: the values live with the config that reads them
(relay/config/routes.py); the delivery side imports them from here too."""

from relay.config.routes import (
    AUTH_MECHS,
    CONDITIONS,
    NAME,
    TLS_MODES,
    OAuthConf,
    Rewrite,
    Route,
    RouteConfigError,
    Routing,
    UpstreamHost,
    default,
    parse,
)

__all__ = [
    "AUTH_MECHS",
    "CONDITIONS",
    "NAME",
    "TLS_MODES",
    "OAuthConf",
    "Rewrite",
    "Route",
    "RouteConfigError",
    "Routing",
    "UpstreamHost",
    "default",
    "parse",
]
