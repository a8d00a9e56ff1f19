"""relay/ops/admin.py on relay/ops/http.py: /healthz answers 503 with a reason when the spool
folder takes no new file (created, fsynced, removed, in a worker thread), and the admin
routes keep their answers (issue 27, item 8: `/healthz` stayed ok while the spool folder
was unwritable)."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from relay.ops import admin as admin_mod
from relay.ops.admin import AdminServer
from relay.ops.metrics import Metrics


async def no_problems() -> list[str]:
    return []


def no_doc() -> dict[str, Any]:
    return {"status": "ok"}


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Path], Any]]:
    servers: list[AdminServer] = []

    async def start(spool: Path) -> httpx.AsyncClient:
        srv = AdminServer(Metrics(), cast(Any, None), no_problems, no_doc, spool)
        await srv.start("127.0.0.1", 0)
        servers.append(srv)
        return httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}")

    yield start
    for srv in servers:
        await srv.stop()


async def test_healthz_is_ok_when_the_spool_folder_takes_a_file(
    serve: Callable[[Path], Any], tmp_path: Path
) -> None:
    async with await serve(tmp_path) as c:
        r = await c.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert os.listdir(tmp_path) == []  # the probe leaves nothing behind


async def test_healthz_is_503_when_the_spool_folder_is_gone(
    serve: Callable[[Path], Any], tmp_path: Path
) -> None:
    async with await serve(tmp_path / "gone") as c:
        r = await c.get("/healthz")
    assert r.status_code == 503
    doc = json.loads(r.content)
    assert doc["status"] == "unhealthy"
    assert any(p.startswith("spool folder not writable") for p in doc["problems"])


async def test_healthz_is_503_when_fsync_fails_and_cleans_up(
    serve: Callable[[Path], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []

    def eio(fd: int) -> None:
        threads.append(threading.current_thread().name)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(admin_mod.os, "fsync", eio)
    async with await serve(tmp_path) as c:
        r = await c.get("/healthz")
    assert r.status_code == 503
    assert "spool folder not writable: Input/output error" in r.json()["problems"]
    assert os.listdir(tmp_path) == []
    assert threads and threads[0] != threading.main_thread().name  # off the event loop


async def test_healthz_is_503_when_the_probe_hangs(
    serve: Callable[[Path], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def hang(folder: Path) -> str | None:
        release.wait(10)
        return None

    monkeypatch.setattr(admin_mod, "probe_writable", hang)
    monkeypatch.setattr(admin_mod, "PROBE_TIMEOUT", 0.2)
    try:
        async with await serve(tmp_path) as c:
            r = await c.get("/healthz")
        assert r.status_code == 503
        assert "spool folder not writable: no new file within 0.2 s" in r.json()["problems"]
    finally:
        release.set()


async def test_admin_routes_keep_their_answers(
    serve: Callable[[Path], Any], tmp_path: Path
) -> None:
    async with await serve(tmp_path) as c:
        r = await c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert r.headers["content-type"] == "application/json"
        r = await c.post("/healthz")
        assert r.status_code == 405 and r.text == "method not allowed\n"
        r = await c.get("/nothing/here")
        assert r.status_code == 404 and r.text == "not found\n"
        r = await c.head("/health")
        assert r.status_code == 200 and r.content == b""
        assert r.headers["connection"] == "close"
