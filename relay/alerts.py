"""Dead-letter alerts: run the operator's `alerts.command` with a JSON document on stdin.

Rules: the command runs through `/bin/sh -c` (so operators can write pipelines), gets one
JSON object on stdin, and is killed after `alerts.timeout`. A failing or hanging command is
logged at ERROR and never blocks delivery or takes the daemon down.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from relay.logs import log_event

log = logging.getLogger(__name__)


async def run_alert(command: str, doc: dict[str, Any], timeout: float) -> bool:
    payload = json.dumps(doc, sort_keys=True).encode() + b"\n"
    try:
        proc = await asyncio.create_subprocess_shell(
            command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as e:
        log_event(log, logging.ERROR, "alert_failed", "alert command did not start", exc=e)
        return False
    try:
        _out, err = await asyncio.wait_for(proc.communicate(payload), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log_event(log, logging.ERROR, "alert_failed", "alert command timed out",
                  timeout=timeout, queue_id=doc.get("queue_id"))
        return False
    if proc.returncode != 0:
        log_event(log, logging.ERROR, "alert_failed", "alert command failed",
                  status=proc.returncode, stderr=(err or b"")[:500].decode(errors="replace"),
                  queue_id=doc.get("queue_id"))
        return False
    return True
