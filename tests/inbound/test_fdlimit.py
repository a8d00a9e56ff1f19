"""relay/inbound/fdlimit.py: the file descriptors a config needs, and the problem it reports when
the process limit is below that."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relay.config.tree import from_mapping
from relay.inbound import fdlimit


def conf(tmp_path: Path, **top: Any) -> Any:
    return from_mapping({"spool": {"path": "spool"}, **top}, tmp_path)


def test_fd_budget(tmp_path: Path) -> None:
    c = conf(tmp_path, limits={"max_connections": 500})
    need = 500 + 50 + 1 + 256 + fdlimit.HEADROOM  # 256: admin.max_connections
    assert fdlimit.needed(c) == need
    assert fdlimit.problem(c, need) is None
    msg = fdlimit.problem(c, 600)
    assert msg is not None and msg.startswith("limits.max_connections: 500 connections")
    assert "at most 193" in msg  # 600 - (50 + 1 + 256 + 100)
    assert fdlimit.problem(c, 65536) is None  # the systemd unit's LimitNOFILE
    # each HTTP listener's connection bound counts: the feedback one only when it has its own
    c = conf(
        tmp_path,
        limits={"max_connections": 500},
        admin={"max_connections": 10},
        feedback={"listen": "127.0.0.1:9026", "max_connections": 20},
    )
    assert fdlimit.needed(c) == 500 + 50 + 1 + 10 + 20 + fdlimit.HEADROOM
    c = conf(tmp_path, admin={"listen": None}, feedback={"max_connections": 20})
    assert fdlimit.needed(c) == 500 + 50 + 1 + fdlimit.HEADROOM
