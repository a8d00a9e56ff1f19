"""PostgreSQL for the tests: the server this machine provides (127.0.0.1:5432, trust auth,
database `test`; RELAY_TEST_PG overrides the URL), one schema per test, dropped after it.

Without a server the PostgreSQL tests skip and say why; with RELAY_REQUIRE_PG=1 (.ci/run
sets it) they fail instead, so CI never passes by skipping them."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import pytest

BASE = os.environ.get("RELAY_TEST_PG", "postgresql://root@127.0.0.1:5432/test")
_state: dict[str, str | None] = {}


def server_error() -> str | None:
    """None when the server answers, else why not (checked once per test process)."""
    if "error" not in _state:
        try:
            import psycopg

            with psycopg.connect(BASE, connect_timeout=3) as c:
                c.execute("SELECT 1")
            _state["error"] = None
        except Exception as e:  # no driver, no server, no database: all mean "none here"
            _state["error"] = f"{type(e).__name__}: {e}".strip()
    return _state["error"]


def require_server() -> None:
    err = server_error()
    if err is None:
        return
    msg = f"no PostgreSQL server at {BASE} ({err})"
    if os.environ.get("RELAY_REQUIRE_PG") == "1":
        pytest.fail(msg + "; RELAY_REQUIRE_PG=1 forbids skipping", pytrace=False)
    pytest.skip(msg + ": the PostgreSQL tests are skipped")


def with_search_path(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-c search_path={schema}')}"


@contextmanager
def own_schema() -> Iterator[str]:
    """A DSN whose search_path is a fresh, empty schema, dropped at the end."""
    require_server()
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    try:
        yield with_search_path(BASE, schema)
    finally:
        # this teardown may run before a test's daemons are stopped (fixtures end in the
        # reverse order of their set-up): DROP ... CASCADE can then lose a deadlock to a
        # daemon's transaction; it is run again (the daemon's side commits or is gone)
        for attempt in range(10):
            try:
                with psycopg.connect(BASE, autocommit=True) as c:
                    c.execute(f"DROP SCHEMA {schema} CASCADE")
                break
            except (psycopg.errors.DeadlockDetected, psycopg.errors.LockNotAvailable):
                if attempt == 9:
                    raise
                time.sleep(0.2)


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    """A DSN whose search_path is a fresh, empty schema of this test's own."""
    with own_schema() as dsn:
        yield dsn


BACKENDS = ["sqlite", "postgresql"]


def open_backend(request: pytest.FixtureRequest, spool_dir: object) -> object:
    """A spool connection of the backend `request.param` names: the spool contract tests
    take their `conn` from here, so each runs on SQLite and on PostgreSQL."""
    from pathlib import Path

    from relay.spool import db, pg

    if request.param == "sqlite":
        return db.connect(Path(str(spool_dir)))
    return pg.connect(request.getfixturevalue("pg_dsn"))


def backend_writer(request: pytest.FixtureRequest, spool_dir: object) -> object:
    """A SpoolWriter (not started) on the backend `request.param` names."""
    from pathlib import Path

    from relay.config.tree import PgSpool
    from relay.spool.writer import SpoolWriter

    if request.param == "sqlite":
        return SpoolWriter(Path(str(spool_dir)))
    Path(str(spool_dir)).mkdir(parents=True, exist_ok=True)
    return SpoolWriter(Path(str(spool_dir)), PgSpool(request.getfixturevalue("pg_dsn")))
