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


# what starting the CLI must not load for a command that only reads or changes the spool
# (issue 31: importing them cost ~0.1 s of CPU per command, and `relay queue flush` starts
# the fleet drain's clock): the HTTP clients and server, DKIM and DNS and what they pull in,
# PostgreSQL's driver (an SQLite spool here)
HEAVY = ("aiohttp", "httpx", "dkim", "dns", "cryptography", "nacl", "psycopg")
SPOOL_COMMANDS = (
    ("queue", "list"),
    ("queue", "show", "0000000000000000"),
    ("queue", "flush"),
    ("queue", "hold", "--all", "--dry-run"),
    ("queue", "release", "--all", "--dry-run"),
    ("queue", "delete", "--all", "--dry-run"),
    ("stats",),
    ("suppression", "list"),
    ("destination", "list"),
    ("fleet",),
    ("status",),  # 3: no daemon, UNKNOWN
    ("alerts",),
)


def _imported(cmd: list[str]) -> tuple[int, set[str]]:
    """The exit code of `cmd` (a python -m ... command line) and the top-level packages it
    imported, from `python -X importtime` (what the process really loaded)."""
    base = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    res = subprocess.run(
        [sys.executable, "-X", "importtime", *cmd],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=base,
    )
    lines = [x for x in res.stderr.splitlines() if x.startswith("import time:")]
    assert lines, res.stderr  # -X importtime said nothing: the check would pass blindly
    return res.returncode, {x.rpartition("|")[2].strip().split(".")[0] for x in lines[1:]}


def test_a_spool_command_loads_no_http_dkim_or_dns_library(tmp_path: Path) -> None:
    cfg = str(_config(tmp_path))
    for args in SPOOL_COMMANDS:
        code, mods = _imported(["-m", "relay", "-c", cfg, *args])
        assert code in (0, 1, 3), args  # 1: `queue show` of an id that is not there
        assert "relay" in mods and "pydantic" in mods, args  # the config was validated
        assert not mods & set(HEAVY), (args, sorted(mods & set(HEAVY)))
    code, mods = _imported(["-m", "relay.cli.sendmail", "-C", cfg, "-bp"])  # mailq
    assert code == 0 and not mods & set(HEAVY), sorted(mods & set(HEAVY))


def test_a_config_with_a_dkim_key_still_loads_it_in_a_spool_command(tmp_path: Path) -> None:
    """The DKIM library is left out only when there is no key: a key named by the config is
    still read and checked by every command, and a bad one refused (78)."""
    cfg = _config(tmp_path)
    key = tmp_path / "dkim.pem"
    key.write_text("not a key\n")
    cfg.write_text(cfg.read_text() + f"dkim: {{example.com: {{selector: s1, key_file: {key}}}}}\n")
    code, mods = _imported(["-m", "relay", "-c", str(cfg), "queue", "list"])
    assert code == 78 and "dkim" in mods
