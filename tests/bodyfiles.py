"""A body file in a test spool, where the daemon's writer (relay/spool/incoming.py) would have
left it: `bodies/<first two>/<queue id>`. Plain writes, for fixtures; the durable path (fsync
of the file and of every new folder) is tested through IncomingBody itself."""

from __future__ import annotations

from pathlib import Path

from relay.spool import bodies


def write_body(spool_dir: Path, queue_id: str, data: bytes) -> str:
    """Returns the path relative to the spool folder, as the row stores it."""
    path = bodies.body_path(spool_dir, queue_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    path.write_bytes(data)
    return str(path.relative_to(spool_dir))
