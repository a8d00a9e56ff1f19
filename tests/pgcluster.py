"""A PostgreSQL cluster of the tests' own, which a test may stop, restart, kill and break.

The shared server (tests/pgserver.py, 127.0.0.1:5432) is not ours to restart; this one is
(docs/fleet.md, "Faults the tests own"): `initdb` and `pg_ctl` from Debian's server binaries
(PGBIN, default /usr/lib/postgresql/15/bin), run as the `postgres` user when we are root,
its data folder in a temporary folder of its own, on a free loopback port, with `fsync`
and `synchronous_commit` on (a `250` must mean the server's disk, as in production).

One cluster per test process (`pg_cluster`, session-scoped: initdb costs seconds), one
database per test (`private_pg`, dropped after it); `private_pg` starts the cluster again
if a test left it stopped. Without the server binaries the tests skip and say why; with
RELAY_REQUIRE_PG=1 (.ci/run) they fail instead, as tests/pgserver.py does."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness import free_port

PGBIN = Path(os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "postgres"  # the server refuses to run as root
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "on",
    "synchronous_commit": "on",
    "wal_sync_method": "fdatasync",
    "full_page_writes": "on",
    "shared_buffers": "32MB",
    "max_connections": "60",
    "autovacuum": "off",  # nothing here needs it; it would only compete for the 2 cores
    "log_min_messages": "warning",
}


def binaries_error() -> str | None:
    """None when initdb, pg_ctl and postgres are here, else what is missing."""
    missing = [b for b in ("initdb", "pg_ctl", "postgres") if not (PGBIN / b).is_file()]
    if missing:
        return f"no PostgreSQL server binaries ({', '.join(missing)}) in {PGBIN}"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root and no runuser to run the server as postgres"
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            return f"running as root and no user {PG_USER} to run the server as"
    return None


def require_binaries() -> None:
    err = binaries_error()
    if err is None:
        return
    if os.environ.get("RELAY_REQUIRE_PG") == "1":
        pytest.fail(err + "; RELAY_REQUIRE_PG=1 forbids skipping", pytrace=False)
    pytest.skip(err + ": the tests on a private PostgreSQL cluster are skipped")


def _as_pg(argv: list[str]) -> list[str]:
    return ["runuser", "-u", PG_USER, "--", *argv] if os.geteuid() == 0 else argv


@dataclass
class PgCluster:
    """One cluster: `start()`, `stop(mode)`, `restart(mode)`, `kill()` and `sql()`."""

    root: Path
    port: int = field(default_factory=free_port)
    events: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, what)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres", user: str = PG_USER) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            _as_pg([str(PGBIN / argv[0]), *argv[1:]]),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
        )
        if res.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(argv)} -> {res.returncode}\n{res.stdout}{res.stderr}\n{tail}"
            )
        return res

    def init(self) -> None:
        os.chmod(self.root, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.root, PG_USER)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", PG_USER, "-N")
        with open(self.data / "postgresql.conf", "a") as f:  # owned by postgres, 0600
            f.write("".join(f"{k} = '{v}'\n" for k, v in SETTINGS.items()))

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.root}",
            "start",
        )
        self.events.append((time.monotonic(), "start"))

    def stop(self, mode: str = "fast") -> None:
        self.events.append((time.monotonic(), f"stop -m {mode}"))
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "fast") -> None:
        """`pg_ctl restart -m MODE`: the server goes down (`immediate`: as in a crash, no
        checkpoint; the next start replays the WAL) and comes back on the same port."""
        self.events.append((time.monotonic(), f"restart -m {mode}"))
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-m",
            mode,
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.root}",
            "restart",
        )
        self.events.append((time.monotonic(), "start"))

    def running(self) -> bool:
        return (
            subprocess.run(
                _as_pg([str(PGBIN / "pg_ctl"), "-D", str(self.data), "status"]),
                capture_output=True,
            ).returncode
            == 0
        )

    def sql(self, statement: str, database: str = "postgres", params: Any = ()) -> list[Any]:
        """Run one statement as the superuser, autocommit; the rows it returned."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=10) as c:
            cur = c.execute(statement, params or None)
            return cur.fetchall() if cur.description is not None else []

    def destroy(self) -> None:
        if self.data.exists() and self.running():
            try:
                self.stop("immediate")
            except RuntimeError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """The test process's own cluster (initdb once), running."""
    require_binaries()
    cluster = PgCluster(Path(tempfile.mkdtemp(prefix="relay-pg-")))
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@dataclass
class PrivatePg:
    """A test's database on the private cluster: `dsn` for the relay, `cluster` for faults."""

    cluster: PgCluster
    database: str

    @property
    def dsn(self) -> str:
        return self.cluster.url(self.database)

    def sql(self, statement: str, params: Any = ()) -> list[Any]:
        return self.cluster.sql(statement, self.database, params)


@pytest.fixture
def private_pg(pg_cluster: PgCluster) -> Iterator[PrivatePg]:
    if not pg_cluster.running():  # an earlier test left it stopped
        pg_cluster.start()
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg_cluster.sql(f"CREATE DATABASE {name}")
    try:
        yield PrivatePg(pg_cluster, name)
    finally:
        if not pg_cluster.running():
            pg_cluster.start()
        pg_cluster.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
