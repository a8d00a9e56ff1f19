"""contrib/: the Prometheus alerting rules pass `promtool check rules` and their own unit
tests (`promtool test rules`), and the Grafana dashboard queries only metrics relay exports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from relay.ops.console.app import Console
from relay.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "contrib" / "prometheus" / "relay-alerts.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "relay-dashboard.json"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = (
            "promtool not found: Debian's prometheus package has it (`make test` installs it"
            " as root; here it could not be)"
        )
        print(f"\n{reason}")
        pytest.skip(reason)
    return path


def test_promtool_check_rules() -> None:
    res = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_rule_unit_tests() -> None:
    res = subprocess.run(
        [_promtool(), "test", "rules", "relay-alerts.test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def _exported(tmp_path: Path) -> set[str]:
    """Every sample name relay's /metrics can show (the console's counters included)."""
    m = Metrics()
    m.latency.observe(1)
    m.commit_latency.observe(0.01)

    class _W:  # the console only needs its writer for requests; none are made here
        pass

    Console(_W(), m, dict, tmp_path)  # type: ignore[arg-type]
    names = set()
    for fam in m.registry.collect():
        names.add(fam.name)
        for s in fam.samples:
            names.add(s.name)
    text = generate_latest(m.registry).decode()
    names |= set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))
    return names


def test_dashboard_and_rules_use_only_exported_metrics(tmp_path: Path) -> None:
    exported = _exported(tmp_path) | {"up"}
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs.append(doc["templating"]["list"][0]["query"])
    exprs += re.findall(r"expr: (.+)", RULES.read_text())
    used = {n for e in exprs for n in re.findall(r"\b(relay_[a-z_]+|up)\b", e)}
    assert used, exprs
    unknown = used - exported
    assert not unknown, f"not exported by relay: {sorted(unknown)}"
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
