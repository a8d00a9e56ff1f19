"""The CLI in an operator's hands: `relay --version`, global options before or after the
verb, and a missing config that says how to point at one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relay import __version__
from tests.harness import ROOT


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**base, **(env or {})},
    )


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "relay.yaml"
    cfg.write_text("spool: {path: spool}\nadmin: {listen: null}\n")
    return cfg


def test_version() -> None:
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"relay {__version__}"


def test_global_options_before_or_after_the_verb(tmp_path: Path) -> None:
    cfg = str(_config(tmp_path))
    for args in (
        ("-c", cfg, "queue", "list", "--json"),
        ("queue", "list", "-c", cfg, "--json"),
        ("--json", "-c", cfg, "queue", "list"),
        ("-c", cfg, "--json", "stats"),
    ):
        res = run(*args)
        assert res.returncode == 0, (args, res.stderr)
        json.loads(res.stdout)


def test_missing_config_says_how_to_point_at_one() -> None:
    res = run("queue", "list", env={})
    assert res.returncode == 78
    assert "-c FILE" in res.stderr and "RELAY_CONFIG" in res.stderr
    res = run("queue", "list", env={"RELAY_CONFIG": "/nonexistent/relay.yaml"})
    assert res.returncode == 78 and "/nonexistent/relay.yaml" in res.stderr
