"""Hostname sanity (issue 26 item 8): a hostname that is `localhost` or has no dot, from the
config or from the system (socket.getfqdn, injected here), is a warning at start and in
`relay check-config`, saying to set `hostname` and what it affects."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relay.config.tree import from_mapping, hostname_problem


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("localhost", "is localhost"),
        ("LOCALHOST.", "is localhost"),
        ("localhost.localdomain", "is localhost"),
        ("mail.localhost", "is localhost"),
        ("vm", "has no dot"),
        ("relayhost.", "has no dot"),
        ("mail.example.net", None),
        ("relay.test", None),
        ("localhostx.example.net", None),
        ("a.b", None),
    ],
)
def test_hostname_problem(name: str, problem: str | None) -> None:
    assert hostname_problem(name) == problem


def _warnings(tmp_path: Path, **data: object) -> list[str]:
    cfg = from_mapping({"spool": {"path": str(tmp_path)}, **data}, tmp_path)
    return [w for w in cfg.warnings() if w.startswith("hostname")]


def test_configured_hostname(tmp_path: Path) -> None:
    (w,) = _warnings(tmp_path, hostname="mailhost")
    assert w.startswith("hostname: 'mailhost' has no dot")
    assert "set `hostname`" in w
    for affected in ("Received", "Message-ID", "EHLO", "root -> root@"):
        assert affected in w
    assert _warnings(tmp_path, hostname="mail.example.net") == []


@pytest.mark.parametrize("system", ["localhost", "vm"])
def test_system_hostname(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system: str) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda name="": system)
    (w,) = _warnings(tmp_path)
    assert w.startswith(f"hostname (unset: the system's name): {system!r}")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "vm.example.net")
    assert _warnings(tmp_path) == []


def test_check_config_says_to_set_hostname(tmp_path: Path) -> None:
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump({"hostname": "localhost", "spool": {"path": "spool"}}))
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert "relay: warning: hostname: 'localhost' is localhost" in res.stderr
    assert "set `hostname` in the config" in res.stderr
    path.write_text(yaml.safe_dump({"hostname": "relay.example.net", "spool": {"path": "spool"}}))
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0 and "hostname" not in res.stderr, res.stderr
