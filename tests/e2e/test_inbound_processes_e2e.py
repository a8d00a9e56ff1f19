"""`inbound.processes`: SMTP processes on the configured ports and spool
(relay/inbound/processes.py) while the main process delivers, against a real daemon: the kernel
spreads connections over them, mail taken by any of them is delivered, a resubmission is
queued once whichever process takes it, a killed inbound process is started again, and none
outlives the main one."""

from __future__ import annotations

import http.client
import os
import signal
import smtplib
import time
from pathlib import Path

from tests.harness import make_message, send, smtp_session


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _socket_owners(port: int, pids: list[int]) -> dict[int, int]:
    """How many established TCP sockets on local `port` each pid holds."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":  # ESTABLISHED
                inodes.add(f[9])
    owners: dict[int, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                owners[pid] = owners.get(pid, 0) + 1
    return owners


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _ready(r) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for e in r.events() if e.get("msg") == "inbound process ready")


def _wait(pred, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_inbound_processes_share_ports_spool_and_dedup(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up, config={"inbound": {"processes": 2}})
    assert r.proc is not None
    main = r.proc.pid
    # "relay is ready" comes only once both listen
    assert _ready(r) == 2 and len(_children(main)) == 2
    kids = _children(main)

    # 24 sessions open at once: the kernel (SO_REUSEPORT) gives both inbound processes
    # some, and the main process (delivery, admin) none
    sessions = []
    for _ in range(24):
        s = smtplib.SMTP("127.0.0.1", r.port, timeout=30)
        s.ehlo("client.test")
        sessions.append(s)
    owners = _socket_owners(r.port, [main, *kids])
    assert owners.get(main, 0) == 0 and all(owners.get(k, 0) > 0 for k in kids), owners
    # each session sends the same message: queued once, whoever took it
    data = make_message(1, message_id="<same@app.example.com>")
    for s in sessions:
        assert s.sendmail("app@example.com", ["user@example.org"], data) == {}
        s.quit()
    for i in range(2, 12):
        assert send(r.port, "app@example.com", ["user@example.org"], make_message(i)) == {}
    got = up.wait_for(11)
    time.sleep(0.5)  # nothing more arrives: one copy of the resubmitted message
    ids = sorted(m.data.split(b"Message-ID: ", 1)[1].split(b"\r\n", 1)[0] for m in up.received)
    assert len(got) == len(up.received) == 11 and len(set(ids)) == 11
    health = r.cli_json("status")
    assert "2 inbound processes listening" in str(health), health

    # an inbound process that dies is started again, and the ports keep working
    os.kill(kids[0], signal.SIGKILL)
    _wait(lambda: _ready(r) == 3, "a new inbound process listening")
    assert any(e.get("event") == "inbound_process_exited" for e in r.events())
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(99)) == {}
    up.wait_for(12)

    # SIGTERM: the main process stops its inbound processes and exits cleanly
    now = _children(main)
    assert len(now) == 2 and kids[0] not in now
    assert r.stop() == 0
    for k in now:
        _wait(lambda k=k: _gone(k), "the inbound processes gone")


def test_inbound_process_dies_with_a_killed_main_process(upstream, relay) -> None:
    up = upstream()
    r = relay(upstream=up, config={"inbound": {"processes": 1}})
    assert r.proc is not None
    (child,) = _children(r.proc.pid)
    r.kill()  # SIGKILL: no shutdown code runs in the main process
    _wait(lambda: _gone(child), "the orphan gone (PR_SET_PDEATHSIG)")
    # the port is free again for the next start
    r.start_again()
    with smtp_session(r.port) as s:
        assert s.noop()[0] == 250


def test_inbound_processes_counters_reach_metrics_and_status(upstream, relay) -> None:
    """The mail an inbound process takes is counted where the operator looks: /metrics,
    `relay stats`; a process that is killed and started again takes nothing back."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        c = http.client.HTTPConnection("127.0.0.1", r.admin_port, timeout=10)
        try:
            c.request("GET", "/metrics")
            body = c.getresponse().read().decode()
        finally:
            c.close()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    up = upstream()
    r = relay(upstream=up, config={"inbound": {"processes": 1}})
    assert r.proc is not None
    (child,) = _children(r.proc.pid)
    for i in range(3):
        assert send(r.port, "app@example.com", ["user@example.org"], make_message(i)) == {}
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(1)) == {}  # dup
    with smtp_session(r.port) as s:
        s.mail("app@example.com")
        assert s.docmd("RCPT", "TO:<@example.org>")[0] == 501  # rejected: bad_address
    up.wait_for(3)
    _wait(
        lambda: (
            scrape().get("relay_accepted_messages_total") == 3
            and scrape().get("relay_deduplicated_messages_total") == 1
            and scrape().get("relay_rejected_total", 0) >= 1
        ),
        "the inbound process's counts in /metrics",
    )
    m = scrape()
    assert m.get("relay_delivered_recipients_total") == 3  # the main process's own
    _wait(
        lambda: (r.cli_json("stats")["daemon"] or {}).get("inbound", {}).get("accepted") == 3,
        "the inbound process's counts in relay stats",
    )
    st = r.cli_json("stats")["daemon"]["inbound"]
    assert st["deduplicated"] == 1 and st["rejected"] >= 1 and st["sessions"] >= 5, st

    # killed and started again: the counts it had stay; the new one adds to them
    os.kill(child, signal.SIGKILL)
    _wait(lambda: _ready(r) == 2, "a new inbound process listening")
    assert scrape().get("relay_accepted_messages_total") == 3
    assert send(r.port, "app@example.com", ["user@example.org"], make_message(7)) == {}
    _wait(lambda: scrape().get("relay_accepted_messages_total") == 4, "the new process's count")
