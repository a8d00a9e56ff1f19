"""A dead letter's traces: the outcome line (bounced / failed / expired), the ERROR line
`event=dead_letter`, and its alert (recorded with the outcome by relay/delivery/recorder.py).
The outcome line's event and level and the alert's event are the dead kind's row of the
outcome table (relay/delivery/outcomes.py).
"""

from __future__ import annotations

import logging

from relay.delivery import outcomes
from relay.delivery.jobs import DeadLetter
from relay.ops import alerts
from relay.ops.logs import log_event

log = logging.getLogger("relay.delivery.engine")


def alert(d: DeadLetter) -> alerts.Event:
    row = outcomes.row(d.state)
    assert row.alert is not None, f"a dead letter's kind raises an alert: {d.state}"
    return alerts.Event(
        row.alert,
        "warning",
        d.destination,
        f"{d.state}: {d.reply}",
        alerts.sample(d.queue_id, d.recipient, d.reply),
    )


def log_lines(d: DeadLetter, host: str | None) -> None:
    # the outcome itself (standard events bounced / failed / expired, see relay.ops.logs), then
    # the dead letter it makes
    row = outcomes.row(d.state)
    log_event(
        log,
        row.level,
        row.event,
        row.message,
        queue_id=d.queue_id,
        rcpt=d.recipient,
        destination=d.destination,
        host=host,
        reply=d.reply,
        attempts=d.attempts,
    )
    log_event(
        log,
        logging.ERROR,
        "dead_letter",
        d.reason,
        queue_id=d.queue_id,
        rcpt=d.recipient,
        destination=d.destination,
        reply=d.reply,
        state=d.state,
        dedup_key=d.dedup_key,
    )
