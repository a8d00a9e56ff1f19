"""The maildrop (relay/spool/maildrop.py) and its importer (relay/spool/pickup.py): the file
format, the
atomic write, the folder's mode, the scan, the health judgement, the importer against a
real SMTP server (the harness's aiosmtpd stands in for the daemon's listener), and one end
to end run: daemon down -> relay-sendmail exits 0 with the file in the maildrop -> the
daemon starts and delivers it once; a re-import is a duplicate."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relay.ops import health
from relay.ops.alerts import Event
from relay.spool import maildrop, pickup
from tests.harness import RelayProcess, Upstream

MSG = b"From: app@example.com\r\nSubject: hi\r\n\r\nbody with a bare\rCR, a NUL \x00 and \xff\r\n"


def _drop(**kw: Any) -> maildrop.Drop:
    base: dict[str, Any] = {
        "sender": "app@example.com",
        "recipients": ("a@example.org", "b@example.net"),
        "data": MSG,
        "created_at": 1764800000.5,
        "uid": 1000,
        "user": "www-data",
    }
    return maildrop.Drop(**{**base, **kw})


# --- the format ------------------------------------------------------------------------------


def test_encode_decode_keeps_every_byte() -> None:
    d = _drop()
    raw = maildrop.encode(d)
    head, _nl, rest = raw.partition(b"\n")
    assert json.loads(head)["v"] == 1 and rest == MSG
    assert maildrop.decode(raw) == d
    assert maildrop.decode(maildrop.encode(_drop(sender="", uid=None))).sender == ""


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "no header line"),
        (b"garbage without a newline", "no header line"),
        (b"not json\nbody", "not JSON"),
        (b"[1]\nbody", "not a JSON object"),
        (b'{"v": 2}\nbody', "unknown version"),
        (b'{"v": 1, "sender": 5, "recipients": ["a@b.c"], "size": 4}\nbody', "sender"),
        (b'{"v": 1, "sender": "", "recipients": [], "size": 4}\nbody', "recipients"),
        (b'{"v": 1, "sender": "", "recipients": [1], "size": 4}\nbody', "recipients"),
        (
            b'{"v": 1, "sender": "", "recipients": ["a@b.c"], "size": 5, "created_at": 1}\nbody',
            "size 5",
        ),
        (b'{"v": 1, "sender": "", "recipients": ["a@b.c"], "size": 4}\nbody', "created_at"),
        (
            b'{"v": 1, "sender": "", "recipients": ["a@b.c"], "size": 4, "created_at": 1,'
            b' "uid": "x"}\nbody',
            "uid",
        ),
        (
            b'{"v": 1, "sender": "", "recipients": ["a@b.c\\r\\nRCPT TO:<e@f.g>"], "size": 4,'
            b' "created_at": 1}\nbody',
            "CR, LF",
        ),
    ],
)
def test_malformed_files_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(maildrop.MalformedDrop, match=why):
        maildrop.decode(raw)


def test_names() -> None:
    n = maildrop.new_name(1764800000123456789)
    assert maildrop.is_final(n) and n.startswith("1764800000123456789.") and n.endswith(".msg")
    assert maildrop.created_of(n) == pytest.approx(1764800000.123456789)
    assert maildrop.new_name() != maildrop.new_name()
    for bad in (".tmp-" + n, n + ".x", "1.abc.msg", "x.0123456789abcdef.msg", "corrupt"):
        assert not maildrop.is_final(bad) and maildrop.created_of(bad) is None


# --- writing and the folder ----------------------------------------------------------------


def test_write_is_atomic_with_mode_0640_whatever_the_umask(tmp_path: Path) -> None:
    folder = tmp_path / "maildrop"
    assert maildrop.ensure_folder(folder) == []
    assert stat.S_IMODE(folder.stat().st_mode) == 0o3730 == maildrop.FOLDER_MODE
    old = os.umask(0o077)
    try:
        path = maildrop.write(folder, _drop())
    finally:
        os.umask(old)
    assert path.parent == folder and maildrop.is_final(path.name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(folder) == [path.name]  # no temporary left
    assert maildrop.read(path) == _drop()
    # an existing folder keeps its mode; another mode is said
    os.chmod(folder, 0o755)
    (warning,) = maildrop.ensure_folder(folder)
    assert "0o755" in warning and "0o3730" in warning


def test_a_folder_made_where_setgid_is_forbidden_is_sticky_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd's RestrictSUIDSGID= makes chmod with the setgid bit fail with EPERM: the
    daemon still starts, with the folder sticky and a warning, instead of crashing."""
    real = os.chmod

    def chmod(path: Any, mode: int, *a: Any, **kw: Any) -> None:
        if mode & stat.S_ISGID:
            raise PermissionError(1, "Operation not permitted")
        real(path, mode, *a, **kw)

    monkeypatch.setattr(os, "chmod", chmod)
    folder = tmp_path / "maildrop"
    (warning,) = maildrop.ensure_folder(folder)
    assert "setgid" in warning
    assert stat.S_IMODE(folder.stat().st_mode) == 0o1730


def test_write_into_a_missing_folder_raises_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        maildrop.write(tmp_path / "absent", _drop())
    assert list(tmp_path.iterdir()) == []


def test_scan_ignores_temporaries_removes_stale_ones_and_sorts(tmp_path: Path) -> None:
    folder = tmp_path / "md"
    maildrop.ensure_folder(folder)
    now = time.time()
    late = folder / maildrop.new_name(int((now - 5) * 1e9))
    early = folder / maildrop.new_name(int((now - 50) * 1e9))
    for p in (late, early):
        p.write_bytes(maildrop.encode(_drop()))
    fresh = folder / ".tmp-writing"
    stale = folder / ".tmp-dead"
    fresh.write_bytes(b"x")
    stale.write_bytes(b"x")
    os.utime(stale, (now - 2 * 3600, now - 2 * 3600))
    (folder / "README").write_bytes(b"x")
    scan = maildrop.scan(folder, now)
    assert scan.ready == (early.name, late.name)
    assert scan.others == ("README",)
    assert scan.stale == (".tmp-dead",) and not stale.exists() and fresh.exists()
    assert scan.corrupt == 0
    maildrop.move_aside(folder, "README")
    assert maildrop.scan(folder, now).corrupt == 1


def test_resolve() -> None:
    base = Path("/etc/relay")
    assert maildrop.resolve(Path("/var/spool/relay"), None, base) == Path(
        "/var/spool/relay/maildrop"
    )
    assert maildrop.resolve(Path("/s"), "/var/drop", base) == Path("/var/drop")
    assert maildrop.resolve(Path("/s"), "../drop", base) == Path("/etc/drop")


# --- the health judgement --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waiting", "age", "corrupt", "status", "text"),
    [
        (0, None, 0, "ok", "empty"),
        (2, 3.0, 0, "ok", "2 messages being imported"),
        (1, 59.9, 0, "ok", "being imported"),
        (1, 60.0, 0, "warning", "the oldest for 1m0s"),
        (3, 3600.0, 0, "warning", "3 messages in the maildrop"),
        (0, None, 1, "warning", "1 files in the maildrop's corrupt/"),
    ],
)
def test_maildrop_health(
    waiting: int, age: float | None, corrupt: int, status: str, text: str
) -> None:
    got = health.maildrop(waiting, age, corrupt)
    assert got[0] == status and text in got[1]
    assert health.maildrop(waiting, age, corrupt, error="cannot read it") == (
        "warning",
        "cannot read it",
    )


# --- the importer against a real SMTP server --------------------------------------------------


class _Alerts:
    def __init__(self) -> None:
        self.events: list[Event] = []

    async def add(self, ev: Event) -> None:
        self.events.append(ev)


def _pickup(folder: Path, up: Upstream, alerts: _Alerts) -> pickup.Pickup:
    return pickup.Pickup(
        lambda: folder,
        lambda: pickup.target_of("0.0.0.0", up.port, "relay.test"),
        alerts.add,
        time.time,
    )


@pytest.fixture
def md(tmp_path: Path) -> Path:
    folder = tmp_path / "maildrop"
    maildrop.ensure_folder(folder)
    return folder


def test_pickup_submits_exact_bytes_and_unlinks_after_250(md: Path, upstream: Any) -> None:
    up = upstream()
    al = _Alerts()
    first = maildrop.write(md, _drop(data=b"Subject: 1\r\n\r\none\r\n"))
    second = maildrop.write(md, _drop(data=b"Subject: 2\r\n\r\ntwo\r\n", sender=""))
    p = _pickup(md, up, al)
    assert asyncio.run(p.pass_once()) == 2
    got = up.wait_for(2)
    assert [g.data for g in got] == [b"Subject: 1\r\n\r\none\r\n", b"Subject: 2\r\n\r\ntwo\r\n"]
    assert got[0].mail_from == "app@example.com" and got[1].mail_from == "<>"
    assert got[0].rcpt_tos == ["a@example.org", "b@example.net"]
    assert not first.exists() and not second.exists() and al.events == []
    assert (p.waiting, p.corrupt) == (2, 0)  # as the pass found them


def test_pickup_keeps_a_file_the_relay_defers(md: Path, upstream: Any) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "451 4.3.0 try later"
    al = _Alerts()
    path = maildrop.write(md, _drop())
    p = _pickup(md, up, al)
    asyncio.run(p.pass_once())
    assert path.exists() and up.received == [] and al.events == []
    assert not (md / maildrop.CORRUPT).exists()
    # within its backoff the file is not tried again
    up.rcpt_reply = lambda a: None
    asyncio.run(p.pass_once())
    assert path.exists() and up.received == []


def test_pickup_moves_aside_what_the_relay_refuses_for_good(
    md: Path, upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 Recipient is suppressed"
    al = _Alerts()
    path = maildrop.write(md, _drop())
    with caplog.at_level(logging.ERROR, logger="relay.spool.pickup"):
        asyncio.run(_pickup(md, up, al).pass_once())
    assert not path.exists() and (md / maildrop.CORRUPT / path.name).exists()
    assert up.received == []
    assert [e.event for e in al.events] == ["maildrop"]
    assert "550 5.1.1" in al.events[0].summary
    assert "a***@example.org" in al.events[0].summary
    assert "a@example.org" not in al.events[0].summary
    assert any(
        getattr(r, "event", None) == "maildrop_corrupt" or "maildrop" in r.getMessage()
        for r in caplog.records
    )


def test_pickup_partial_refusal_is_sent_and_alerted(md: Path, upstream: Any) -> None:
    up = upstream()
    up.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("b@") else None
    al = _Alerts()
    path = maildrop.write(md, _drop())
    asyncio.run(_pickup(md, up, al).pass_once())
    assert [g.rcpt_tos for g in up.wait_for(1)] == [["a@example.org"]]
    assert not path.exists() and not (md / maildrop.CORRUPT).exists()
    (ev,) = al.events
    assert "b***@example.net" in ev.summary and "b@example.net" not in ev.summary


@pytest.mark.parametrize(
    "content", [b"not a maildrop file", b'{"v": 1}\n', b""], ids=["garbage", "fields", "empty"]
)
def test_pickup_moves_malformed_files_aside_and_alerts(
    md: Path, upstream: Any, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    up = upstream()
    al = _Alerts()
    name = maildrop.new_name()
    (md / name).write_bytes(content)
    (md / "odd-name").write_bytes(maildrop.encode(_drop()))
    p = _pickup(md, up, al)
    with caplog.at_level(logging.ERROR, logger="relay.spool.pickup"):
        assert asyncio.run(p.pass_once()) == 0
    assert sorted(os.listdir(md / maildrop.CORRUPT)) == sorted([name, "odd-name"])
    assert sorted(os.listdir(md)) == [maildrop.CORRUPT]
    assert len(al.events) == 2 and all(e.severity == "critical" for e in al.events)
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2
    assert up.connections == 0
    assert p.corrupt == 1  # this pass found one odd name (the malformed one was "ready")
    asyncio.run(p.pass_once())
    assert p.corrupt == 2 and health.maildrop(p.waiting, p.oldest_age, p.corrupt)[0] == "warning"


def test_pickup_does_not_read_a_file_over_the_size_limit(md: Path, upstream: Any) -> None:
    up = upstream()
    al = _Alerts()
    big = maildrop.write(md, _drop(data=b"x" * (maildrop.MAX_HEADER + 2000)))
    small = maildrop.write(md, _drop(data=b"Subject: s\r\n\nsmall\r\n"))
    p = pickup.Pickup(
        lambda: md,
        lambda: pickup.target_of("127.0.0.1", up.port, "relay.test"),
        al.add,
        time.time,
        lambda: 1000,
    )
    asyncio.run(p.pass_once())
    assert (md / maildrop.CORRUPT / big.name).exists() and not small.exists()
    assert len(up.wait_for(1)) == 1 and "larger than" in al.events[0].summary


def test_pickup_of_a_symlink_moves_it_aside(md: Path, upstream: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(maildrop.encode(_drop()))
    name = maildrop.new_name()
    (md / name).symlink_to(secret)
    up = upstream()
    al = _Alerts()
    asyncio.run(_pickup(md, up, al).pass_once())
    assert up.connections == 0 and (md / maildrop.CORRUPT / name).is_symlink()
    assert secret.exists()


def test_pickup_without_a_folder_says_so_once(tmp_path: Path, upstream: Any, caplog: Any) -> None:
    up = upstream()
    p = _pickup(tmp_path / "absent", up, _Alerts())
    with caplog.at_level(logging.ERROR, logger="relay.spool.pickup"):
        asyncio.run(p.pass_once())
        asyncio.run(p.pass_once())
    assert len([r for r in caplog.records if "cannot read the maildrop" in r.getMessage()]) == 1
    assert p.error is not None and "cannot read the maildrop" in p.error
    maildrop.ensure_folder(tmp_path / "absent")
    asyncio.run(p.pass_once())
    assert p.error is None


# --- end to end --------------------------------------------------------------------------------


def _sendmail(config: Path, *args: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "relay-sendmail"), "-C", str(config), *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=60,
    )


@pytest.mark.slow
def test_daemon_down_then_up_delivers_once_and_reimport_is_a_duplicate(
    upstream: Any, relay: Any
) -> None:
    up = upstream()
    r: RelayProcess = relay(upstream=up, start=False, config={"limits": {"max_recipients": 2}})
    folder = r.spool / "maildrop"
    r.spool.mkdir()
    maildrop.ensure_folder(folder)  # what `make install` (or a first start) leaves
    res = _sendmail(
        r.config_path,
        "-f",
        "app@example.com",
        "user@example.org",
        stdin=b"Subject: while down\n\nhello\n",
    )
    assert res.returncode == 0, res.stderr
    assert b"queued locally in the maildrop" in res.stderr
    (name,) = os.listdir(folder)
    saved = (folder / name).read_bytes()
    assert maildrop.decode(saved).recipients == ("user@example.org",)
    # mailq / queue list show it as waiting for the daemon (no daemon needed)
    listed = r.cli_json("queue", "list")
    assert [(m["id"], m["state"]) for m in listed] == [(name, "maildrop")]
    assert listed[0]["recipients"][0]["address"] == "user@example.org"
    assert {
        "id",
        "state",
        "message_id",
        "sender",
        "size",
        "created_at",
        "attempts",
        "next_attempt_at",
        "recipients",
    } <= set(listed[0])
    mailq = subprocess.run(
        [str(Path(sys.executable).parent / "mailq"), "--config", str(r.config_path)],
        capture_output=True,
        timeout=60,
    )
    assert name.encode() in mailq.stdout and b"maildrop" in mailq.stdout

    r.start()
    (got,) = up.wait_for(1)
    assert got.mail_from == "app@example.com" and got.rcpt_tos == ["user@example.org"]
    assert b"Subject: while down" in got.data
    r.wait_until(lambda: not (folder / name).exists(), timeout=30)

    # a crash between the 250 and the unlink: the same file again is a duplicate
    (folder / name).write_bytes(saved)
    r.wait_until(lambda: not (folder / name).exists(), timeout=30)
    r.wait_until(lambda: any(e.get("event") == "deduplicated" for e in r.events()), timeout=30)
    time.sleep(0.5)
    assert len(up.received) == 1

    # a file the relay keeps deferring (452: too many recipients), over a minute old:
    # `relay status` warns; a malformed one is moved aside, alerted and logged
    old = maildrop.new_name(time.time_ns() - 120 * 10**9)
    stuck = _drop_for(("x@example.org", "y@example.org", "z@example.org"))
    (folder / old).write_bytes(maildrop.encode(stuck))
    bad = maildrop.new_name()
    (folder / bad).write_bytes(b"junk")
    r.wait_until(lambda: (folder / maildrop.CORRUPT / bad).exists(), timeout=30)

    def warned() -> bool:
        st = r.cli("status")
        return (
            st.returncode == 1
            and "1 messages in the maildrop" in st.stdout
            and "corrupt/" in st.stdout
        )

    r.wait_until(warned, timeout=30, what="relay status warning about the maildrop")
    assert (folder / old).exists()
    events = r.events()
    assert any(e.get("event") == "maildrop_corrupt" and e.get("level") == "error" for e in events)
    assert any(e.get("event") == "maildrop_deferred" for e in events)
    assert r.stop() == 0


def _drop_for(rcpts: tuple[str, ...]) -> maildrop.Drop:
    return _drop(recipients=rcpts, data=b"Subject: stuck\r\n\r\nx\r\n")


def test_copy_of_module_constants_matches_the_spec() -> None:
    """The layout other parts (make install, the unit) follow: keep it exact."""
    assert maildrop.FOLDER_MODE == 0o3730 and maildrop.FILE_MODE == 0o640
    assert maildrop.GROUP == "relay" and maildrop.TMP_PREFIX == ".tmp-"
    assert maildrop.STALE_TMP == 3600 and health.MAILDROP_WARN_AFTER == 60


def test_queue_list_shows_maildrop_files_with_filters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from relay.cli import main as cli

    cfg = tmp_path / "relay.yaml"
    cfg.write_text(yaml.safe_dump({"spool": {"path": "spool"}, "hostname": "relay.test"}))
    folder = tmp_path / "spool" / "maildrop"
    (tmp_path / "spool").mkdir()
    maildrop.ensure_folder(folder)
    now = time.time()
    old = folder / maildrop.new_name(int((now - 7200) * 1e9))
    old.write_bytes(maildrop.encode(_drop(recipients=("a@example.org",))))
    new = maildrop.write(folder, _drop(recipients=("b@example.net",)))

    def listed(*args: str) -> list[dict[str, Any]]:
        assert cli.main(["-c", str(cfg), "queue", "list", "--json", *args]) == 0
        return list(json.loads(capsys.readouterr().out))

    rows = listed()
    assert [r["id"] for r in rows] == [old.name, new.name]  # oldest first
    assert all(r["state"] == "maildrop" for r in rows)
    assert rows[0]["sender"] == "app@example.com" and rows[0]["size"] == len(MSG)
    assert rows[0]["created_at"].endswith("Z") or "+00:00" in rows[0]["created_at"]
    assert rows[1]["recipients"][0]["destination"] == "example.net"
    assert [r["id"] for r in listed("--state", "maildrop")] == [old.name, new.name]
    assert listed("--state", "queued") == []
    assert [r["id"] for r in listed("--domain", "example.net")] == [new.name]
    assert [r["id"] for r in listed("--recipient", "A@example.org")] == [old.name]
    assert [r["id"] for r in listed("--older-than", "1h")] == [old.name]
    assert [r["id"] for r in listed("--limit", "1")] == [old.name]
    # a file the CLI cannot parse is still listed, with its error
    (folder / maildrop.new_name()).write_bytes(b"junk")
    assert "error" in listed()[-1]
    assert cli.main(["-c", str(cfg), "queue", "list"]) == 0
    text = capsys.readouterr().out
    assert old.name in text and "[maildrop]" in text and "3 Requests" in text


def test_write_fsyncs_the_file_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "md"
    maildrop.ensure_folder(folder)
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a: Any, b: Any) -> None:
        calls.append(("rename", str(b)))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    path = maildrop.write(folder, _drop())
    assert [c[0] for c in calls] == ["fsync", "rename", "fsync"]
    assert Path(calls[0][1]).name.startswith(".tmp-")  # the data, under its temporary name
    assert calls[1][1] == str(path)
    assert calls[2][1] == str(folder)  # then the folder, so the new name is durable too

    # an app in group `relay` may not open the folder (no read permission): it fsyncs the
    # renamed file again instead
    calls.clear()
    real_open = os.open

    def no_dir_open(p: Any, flags: int, *a: Any) -> int:
        if flags & os.O_DIRECTORY:
            raise PermissionError(13, "Permission denied")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", no_dir_open)
    path = maildrop.write(folder, _drop())
    assert [c[0] for c in calls] == ["fsync", "rename", "fsync"]
    assert calls[2][1] == str(path)
