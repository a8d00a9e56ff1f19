"""Fixtures are factories that clean up after themselves (see tests/harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.harness import (
    LogWrites,
    RelayProcess,
    Upstream,
    deep_merge,
    logging_into,
    root_logger_kept,
    smarthost_config,
)
from tests.pgcluster import pg_cluster, private_pg  # noqa: F401  (fixtures)
from tests.pgserver import pg_dsn  # noqa: F401  (a fixture)


@pytest.fixture(autouse=True)
def _root_logger_as_it_was() -> Iterator[None]:
    """Every test leaves the root logger's level and handlers as it found them: a test that
    calls setup_logging (the CLI run in-process, the logging tests) must not change which
    records the next test of the same pytest-xdist worker captures (caplog.records holds
    every record that passes the levels, from the test's start)."""
    with root_logger_kept():
        yield


@pytest.fixture
def upstream() -> Iterator[Callable[..., Upstream]]:
    made: list[Upstream] = []

    def factory(**kwargs: Any) -> Upstream:
        up = Upstream(**kwargs).start()
        made.append(up)
        return up

    yield factory
    for up in made:
        up.stop()


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Callable[..., RelayProcess]]:
    made: list[RelayProcess] = []

    def factory(
        config: dict[str, Any] | None = None,
        upstream: Upstream | None = None,
        name: str = "relay",
        env: dict[str, str] | None = None,
        start: bool = True,
    ) -> RelayProcess:
        cfg = smarthost_config(upstream) if upstream is not None else {}
        cfg = deep_merge(cfg, config or {})
        r = RelayProcess(tmp_path / name, cfg, env)
        made.append(r)
        if start:
            r.start()
        return r

    yield factory
    for r in made:
        r.close()


@pytest.fixture
def ca() -> trustme.CA:
    """A throwaway certificate authority (trustme) for TLS tests."""
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
def log_writes() -> Iterator[LogWrites]:
    """The relay's log lines (JSON) in memory, with each write they took."""
    s = LogWrites()
    with logging_into(s):
        yield s
