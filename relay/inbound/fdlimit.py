"""The file-descriptor budget: `limits.max_connections` must fit under RLIMIT_NOFILE.

Rules:
- At start the daemon raises its soft RLIMIT_NOFILE to the hard limit (systemd's
  `LimitNOFILE=` sets both; a shell's `ulimit -n` the soft one), since Python starts with
  whatever soft limit it inherited (often 1,024).
- It needs one descriptor per inbound connection (`limits.max_connections`), one per
  delivery worker (`delivery.workers` upstream connections), one per listener, one per HTTP
  connection each HTTP listener may hold (`admin.max_connections`, and
  `feedback.max_connections` when the feedback endpoints have a listener of their own),
  and HEADROOM more for the spool (database, WAL, shared memory, body files being written
  or read), DNS sockets, logs and the event loop itself.
- If that does not fit, the daemon refuses to start (exit 78, EX_CONFIG), naming
  `limits.max_connections` and both ways out; a SIGHUP with such a config is rejected.
"""

from __future__ import annotations

import resource

from relay.config.tree import Config

HEADROOM = 100


def http_connections(config: Config) -> int:
    """The most connections the HTTP listeners hold at once (relay/ops/http.py)."""
    n = config.admin_http.max_connections if config.admin_listen is not None else 0
    if config.feedback.listen is not None:
        n += config.feedback.http.max_connections
    return n


def needed(config: Config) -> int:
    return (
        config.limits.max_connections
        + config.delivery.workers
        + len(config.listen)
        + http_connections(config)
        + HEADROOM
    )


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def problem(config: Config, limit: int) -> str | None:
    """The startup error when the connections cannot fit under `limit`, else None."""
    need = needed(config)
    if limit == resource.RLIM_INFINITY or need <= limit:
        return None
    fits = max(0, limit - need + config.limits.max_connections)
    return (
        f"limits.max_connections: {config.limits.max_connections} connections need about"
        f" {need} open files (with delivery.workers, the HTTP listeners' max_connections"
        f" and {HEADROOM} for the spool), but the file-descriptor limit (RLIMIT_NOFILE) is"
        f" {limit}: raise"
        f" LimitNOFILE= in the systemd unit (or `ulimit -n`), or lower"
        f" limits.max_connections to at most {fits}"
    )
