"""At start, `relay check-dns` for every DKIM signing domain, logged.

Rules:
- Never blocks the start and never stops it: a background task of the daemon.
- A key not yet published, a broken SPF or a missing DMARC shows in the journal the
  moment the relay starts signing: each problem one `dns_check` line (error or warning),
  then one summary line per domain.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from relay.authenticity import checkdns
from relay.authenticity.dkim import DkimKey, public_record
from relay.ops.logs import log_event

log = logging.getLogger(__name__)


async def log_dns_checks(
    dkim: Mapping[str, Sequence[DkimKey]], nameservers: Sequence[str] | None
) -> None:
    """Check each domain of `dkim` (domain -> its signing keys) and log what was found."""
    for domain, keys in dkim.items():
        try:
            checks = await checkdns.check_domain(
                domain,
                nameservers=list(nameservers) if nameservers else None,
                dkim=[(k.selector, public_record(k)) for k in keys],
            )
        except Exception as e:
            log_event(log, logging.WARNING, "dns_check", "check failed", domain=domain, exc=e)
            continue
        for c in checks:
            if c.status != "ok":
                log_event(
                    log,
                    logging.ERROR if c.status == "error" else logging.WARNING,
                    "dns_check",
                    c.detail,
                    domain=domain,
                    check=c.name,
                    status=c.status,
                    record=c.record,
                )
        log_event(
            log,
            logging.INFO,
            "dns_check",
            f"{domain}: {sum(c.status == 'ok' for c in checks)}/{len(checks)} ok",
            domain=domain,
            exit_code=checkdns.exit_code(checks),
        )
