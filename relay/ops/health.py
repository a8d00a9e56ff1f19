"""The health model: named checks, each `ok` | `warning` | `critical` with `since` and a
`detail` a person can act on, and the transitions between them.

Rules:
- Pure: the monitor (relay/ops/monitor.py) measures, these functions judge. Every
  judgement is a table-tested function of numbers and thresholds.
- `since` is when the check entered its current status; a check whose status does not
  change keeps its `since` even when its detail changes.
- A transition to warning or critical, and back to ok, is returned by `Model.update` so the
  daemon can log it and raise one alert (`health`, or `resolved` when back to ok).
- Readiness (`/healthz`): only the checks that decide whether mail can be taken
  (listeners, spool, disk) count; the rest are for people (`/health`, `relay status`).
- `relay status` follows the monitoring-plugin convention: exit 0 OK, 1 WARNING,
  2 CRITICAL, 3 UNKNOWN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from relay.spool.reserve import low as reserve_low

Status = Literal["ok", "warning", "critical"]
RANK: dict[str, int] = {"ok": 0, "warning": 1, "critical": 2}
EXIT = {"ok": 0, "warning": 1, "critical": 2}
UNKNOWN_EXIT = 3
READINESS = ("listeners", "spool", "disk")
# the health document the monitor writes each pass, in the spool folder; `relay status`
# reads it (and nothing else: it works when the database is the problem)
HEALTH_FILE = "health.json"


@dataclass(slots=True)
class Check:
    name: str
    status: Status
    since: float
    detail: str

    def as_dict(self, iso: Any) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "since": iso(self.since),
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class Transition:
    name: str
    old: Status
    new: Status
    detail: str


@dataclass(slots=True)
class Model:
    checks: dict[str, Check] = field(default_factory=dict)

    def update(self, name: str, status: Status, detail: str, now: float) -> Transition | None:
        cur = self.checks.get(name)
        if cur is None:
            self.checks[name] = Check(name, status, now, detail)
            # a check that starts unhealthy is news; one that starts ok is not
            return None if status == "ok" else Transition(name, "ok", status, detail)
        cur.detail = detail
        if cur.status == status:
            return None
        old = cur.status
        cur.status, cur.since = status, now
        return Transition(name, old, status, detail)

    def drop(self, name: str) -> None:
        self.checks.pop(name, None)

    def status(self) -> Status:
        return worst(c.status for c in self.checks.values())

    def ready(self) -> bool:
        return all(c.status != "critical" for c in self.checks.values() if c.name in READINESS)

    def as_dict(self, iso: Any) -> dict[str, Any]:
        return {
            "status": self.status(),
            "checks": [c.as_dict(iso) for c in sorted(self.checks.values(), key=lambda c: c.name)],
        }


def worst(statuses: Any) -> Status:
    out: Status = "ok"
    for s in statuses:
        if RANK[s] > RANK[out]:
            out = s
    return out


# --- judgements ------------------------------------------------------------------------------


def disk(
    free_pct: float,
    warning: float,
    critical: float,
    free_bytes: int | None = None,
    reserve: int = 0,
) -> tuple[Status, str]:
    detail = f"{free_pct:.1f}% free where the spool lives"
    if free_bytes is not None and reserve_low(free_bytes, reserve):
        # relay/spool/reserve.py: the last `spool.reserve` octets are for what is queued
        return "critical", (
            f"{detail}, {human_bytes(free_bytes)}, below spool.reserve"
            f" ({human_bytes(reserve)}): new mail is refused with 452 4.3.1 until space"
            " is freed; queued mail is still delivered"
        )
    if free_pct <= critical:
        return "critical", (
            f"{detail} (critical at {critical:g}%): new mail is refused with"
            " 452 4.3.1 until space is freed"
        )
    if free_pct <= warning:
        return "warning", f"{detail} (warning at {warning:g}%)"
    return "ok", detail


def human_bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def queue_age(age: float | None, warning: float, critical: float) -> tuple[Status, str]:
    if age is None:
        return "ok", "nothing waiting"
    detail = f"oldest waiting recipient queued {human(age)} ago"
    if age >= critical:
        return "critical", f"{detail} (critical at {human(critical)})"
    if age >= warning:
        return "warning", f"{detail} (warning at {human(warning)})"
    return "ok", detail


def stall(overdue: int, since_delivery: float | None, stall_after: float) -> tuple[Status, str]:
    """`overdue`: recipients due (or being sent) for longer than `stall_after`;
    `since_delivery`: seconds since the last delivery (None: none since start)."""
    if overdue == 0:
        return "ok", "the queue is moving"
    if since_delivery is not None and since_delivery < stall_after:
        return "ok", f"{overdue} recipients overdue, but deliveries continue"
    last = "none since start" if since_delivery is None else f"last {human(since_delivery)} ago"
    return "warning", (
        f"queue stalled: {overdue} recipients due for over {human(stall_after)}"
        f" and no delivery ({last})"
    )


def dead_letters(count: int, warning: int) -> tuple[Status, str]:
    detail = f"{count} dead letters in the last hour"
    if count >= warning:
        return "warning", f"{detail} (warning at {warning})"
    return "ok", detail


def judged(mx_mode: bool, upstream: bool, config_error: str | None, shown: bool) -> bool:
    """Does a destination get a `destination:NAME` check? In MX mode a recipient domain
    whose MX is down is that domain's problem (its circuit_* lines are logged), not the
    relay's: only a configuration error there is the operator's (and a check once shown
    stays, so it can turn ok). An upstream (the smarthost, a route's, in MX mode too) is
    always ours."""
    return upstream or not mx_mode or config_error is not None or shown


def destination(
    name: str,
    circuit: str,
    failures: int,
    config_error: str | None,
    reopen_at: str | None,
    *,
    failing_for: float | None = None,
    answered: bool = True,
    failing_after: float = 300.0,
) -> tuple[Status, str]:
    """One destination (an upstream; in MX mode a recipient domain).

    `failing_for`: seconds since the first failure after its last success (None: its last
    attempt worked, or none yet); `answered`: it answered at least once since the daemon
    started. Measured by the breaker (relay/delivery/shaping.py `Breaker.failing_since`), so it
    stays true while nothing is due: a dead upstream is a warning `failing_after` after
    its first failure whether or not mail is waiting, and at once while it never answered
    since start (a wrong host or port after a deploy is news now, not at the 30m retry).
    The escalation to critical stays with `queue_age` (health.queue_age_critical)."""
    if config_error:
        return "critical", (
            f"{name}: upstream refused our configuration: {config_error};"
            " mail is kept; fix the config and reload"
        )
    if failing_for is not None and failing_for >= failing_after:
        return "warning", (
            f"{name}: every attempt has failed for {human(failing_for)}, no answer since"
            f" (warning at {human(failing_after)}; circuit {circuit},"
            f" {failures} consecutive failures); mail is kept and retried"
        )
    if failing_for is not None and not answered:
        return "warning", (
            f"{name}: has not answered since start ({failures} consecutive failures,"
            f" circuit {circuit}); mail is kept and retried"
        )
    if circuit == "open":
        return "warning", (
            f"{name}: circuit open after {failures} consecutive failures; next try at {reopen_at}"
        )
    if circuit == "half-open":
        return "warning", f"{name}: circuit half-open, a trial connection is allowed"
    if failures:
        return "ok", f"{name}: {failures} consecutive connection failures"
    return "ok", f"{name}: ok"


MAILDROP_WARN_AFTER = 60.0  # seconds: the daemon imports the maildrop every second


def maildrop(
    waiting: int,
    oldest_age: float | None,
    corrupt: int,
    warn_after: float = MAILDROP_WARN_AFTER,
    error: str | None = None,
) -> tuple[Status, str]:
    """The maildrop (relay/spool/maildrop.py) while the daemon runs: a file older than
    `warn_after` is one the daemon cannot import (the relay refuses it for now, see the
    `maildrop_*` log lines); a file in corrupt/ is mail that will not go out by itself; a
    folder the daemon cannot read is mail relay-sendmail may leave where nobody takes it."""
    if error is not None:
        return "warning", error
    parts = []
    status: Status = "ok"
    if waiting and oldest_age is not None and oldest_age >= warn_after:
        status = "warning"
        parts.append(
            f"{waiting} messages in the maildrop, the oldest for {human(oldest_age)}"
            f" (warning at {human(warn_after)}): the relay does not take them"
        )
    elif waiting:
        parts.append(f"{waiting} messages being imported")
    if corrupt:
        status = "warning"
        parts.append(f"{corrupt} files in the maildrop's corrupt/ folder: inspect and remove")
    return status, "; ".join(parts) or "empty"


def human(seconds: float) -> str:
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{(s % 86400) // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    if s >= 60:
        return f"{s // 60}m{s % 60}s"
    return f"{seconds:.0f}s"


def plugin_output(doc: dict[str, Any]) -> tuple[int, str]:
    """`relay status`: (exit code, text) from a /health document."""
    status = str(doc.get("status", "unknown"))
    if status not in EXIT:
        return UNKNOWN_EXIT, f"UNKNOWN: {doc.get('detail', 'no health data')}"
    bad = [c for c in doc.get("checks", []) if c.get("status") != "ok"]
    head = f"{status.upper()}: " + (
        "; ".join(f"{c['name']}: {c['detail']}" for c in bad) if bad else "all checks ok"
    )
    lines = [head] + [
        f"{c['status']:<8} {c['name']:<24} since {c['since']}  {c['detail']}"
        for c in doc.get("checks", [])
    ]
    return EXIT[status], "\n".join(lines)
