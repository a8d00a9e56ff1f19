"""The spool's disk reserve and a full disk, end to end (issue 27 item 5): a daemon whose
free space falls below `spool.reserve` (simulated by a reserve above the real free space,
set by a reload) answers new mail `452 4.3.1` while what is queued is still delivered; a
spool that cannot commit at all (SQLite's "database or disk is full" at every COMMIT) and a
health file that cannot be written are logged once each, not in a tight loop, and the
claim loop delivers again once the disk has room."""

from __future__ import annotations

import json
import shutil
import signal
import smtplib
import time
from collections.abc import Callable
from pathlib import Path

from tests.harness import RelayProcess, Upstream, deep_merge, make_message, smarthost_config

FULL = (452, b"4.3.1 Insufficient system storage; try again later")


def events(r: RelayProcess, name: str, msg: str | None = None) -> list[dict[str, object]]:
    return [
        e for e in r.events() if e.get("event") == name and (msg is None or e.get("msg") == msg)
    ]


def disk_check(r: RelayProcess) -> dict[str, str]:
    doc = json.loads((r.spool / "health.json").read_text())
    (check,) = [c for c in doc["checks"] if c["name"] == "disk"]
    return dict(check)


def test_below_the_reserve_new_mail_is_452_and_queued_mail_still_goes_out(
    tmp_path: Path, upstream: Callable[..., Upstream]
) -> None:
    up = upstream()
    up.data_reply = lambda e: "451 4.3.0 not now"  # the first message waits in the queue
    fault_file = tmp_path / "faults"
    fault_file.write_text("")
    cfg = deep_merge(
        smarthost_config(up),
        {
            "retry": {"schedule": ["1s"], "max_age": "1h", "min_delay": "0.2s"},
            "destinations": {"*": {"circuit_failures": 100}},
        },
    )
    r = RelayProcess(tmp_path / "relay", cfg, env={"RELAY_FAULTS_FILE": str(fault_file)})
    try:
        r.start()
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            s.sendmail("app@example.com", ["user@example.org"], make_message(1))
        r.wait_until(lambda: up.connections >= 1, what="a first attempt")

        # free space below the reserve: a reserve larger than the filesystem has free
        free = shutil.disk_usage(r.spool).free
        r.write_config(deep_merge(r.config, {"spool": {"reserve": free * 4}}))
        r.signal(signal.SIGHUP)
        r.wait_until(lambda: disk_check(r)["status"] == "critical", what="disk critical")
        assert "below spool.reserve" in disk_check(r)["detail"]
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            s.ehlo("client.test")
            assert s.mail("app@example.com") == FULL

        # and at 100%: every commit fails, the health file cannot be written
        (r.spool / "health.json.tmp").mkdir()
        fault_file.write_text("spool.commit enospc\n")
        time.sleep(3.0)  # the old claim loop failed four times a second meanwhile
        fault_file.write_text("")
        (r.spool / "health.json.tmp").rmdir()
        up.data_reply = lambda e: None
        got = up.wait_for(1, timeout=30)  # the claim loop survived: the queued one goes out
        assert b"message 1" in got[0].data
        r.wait_until(
            lambda: len(events(r, "health_write_ok")) == 1, what="the health file written again"
        )
        assert len(events(r, "engine_error", "claim loop failed")) == 1
        assert len(events(r, "engine_recovered")) == 1
        assert len(events(r, "health_write_failed")) == 1
        assert events(r, "health_error") == []  # the health pass itself never failed
        # still below the reserve: new mail still waits outside
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            s.ehlo("client.test")
            assert s.mail("app@example.com") == FULL
        assert r.proc is not None and r.proc.poll() is None
    finally:
        r.close()
