"""relay/spool/db.py: how a SQLite spool directory is created (parents, mode) or refused, and the
PostgreSQL spool's password file."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import cast

import pytest

from relay.config.tree import PgSpool
from relay.spool import db
from relay.spool.pg import PgConnection

# Survivors of the spool mutation run (tests/MUTANTS.md; until issue 28 in
# tests/test_spool_mutants_db.py). Spool tests run on SQLite and PostgreSQL.
# --- db.connect (SQLite) ---------------------------------------------------------------------


def test_connect_creates_missing_parents_with_mode_0750(tmp_path: Path) -> None:
    spool = tmp_path / "var" / "lib" / "relay"
    old = os.umask(0o022)  # the usual umask; under it mkdir's default mode gives 0755
    try:
        conn = db.connect(spool)
    finally:
        os.umask(old)
    conn.close()
    assert db.db_path(spool).exists()
    assert stat.S_IMODE(spool.stat().st_mode) == 0o750


def test_connect_without_create_names_the_missing_spool(tmp_path: Path) -> None:
    spool = tmp_path / "nothing-here"
    with pytest.raises(FileNotFoundError) as e:
        db.connect(spool, create=False)
    assert str(e.value) == f"no spool at {db.db_path(spool)}"
    assert not spool.exists()


def test_open_spool_without_create_refuses_a_missing_sqlite_spool(tmp_path: Path) -> None:
    spool = tmp_path / "gone"
    with pytest.raises(FileNotFoundError, match=r"^no spool at "):
        db.open_spool(spool, create=False)
    assert not spool.exists()


def test_open_spool_on_postgresql_logs_in_with_the_password_file(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The password comes from spool.password_file (the server here trusts loopback, so the
    password the connection was opened with is read back from libpq)."""
    secret = tmp_path / "pg.secret"
    secret.write_text("s3cret-from-file\n")
    conn = db.open_spool(tmp_path / "local", PgSpool(dsn=pg_dsn, password_file=secret))
    try:
        assert cast(PgConnection, conn)._conn.info.password == "s3cret-from-file"
        assert conn.execute("SELECT 1").fetchone()[0] == 1
    finally:
        conn.close()
