"""Inbound SMTP (our SMTP server): the accept step's decisions in `handler`, the sans-I/O
protocol core in `core`, the asyncio transport in `transport`.

The names the rest of the code (and the tests) import from `relay.inbound` are re-exported
here, so `relay.inbound` reads as it did when it was one module.
"""

from relay.inbound.core import _HAS_ENHANCED, NON_ASCII, with_enhanced
from relay.inbound.handler import (
    IDEMPOTENCY_KEY,
    InboundHandler,
    InboundStats,
    RelaySMTP,
    Suppressions,
    _head_of,
    _printable,
    _storable,
    _strip_keyword,
    _utf8,
    _valid_domain,
    _with_protocol,
)

__all__ = [
    "IDEMPOTENCY_KEY",
    "NON_ASCII",
    "_HAS_ENHANCED",
    "InboundHandler",
    "InboundStats",
    "RelaySMTP",
    "Suppressions",
    "_head_of",
    "_printable",
    "_storable",
    "_strip_keyword",
    "_utf8",
    "_valid_domain",
    "_with_protocol",
    "with_enhanced",
]
