from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "relay.service"
SYSTEMD_ANALYZE = Path("/usr/bin/systemd-analyze")

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Minimal systemd unit parser: sections -> key -> list of values (keys may repeat)."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


def _one(unit: Unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= missing"
    return values[-1]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("Type", "notify"),
        ("ExecStart", "/opt/relay/bin/relay serve -c /etc/relay/relay.yaml"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("Restart", "on-failure"),
        ("RestartSec", "2s"),
        ("WatchdogSec", "30s"),
        ("User", "relay"),
        ("Group", "relay"),
        ("StateDirectory", "relay"),
        ("StateDirectoryMode", "0710"),
        ("LoadCredential", "relay:/etc/relay/credentials"),
        ("ConfigurationDirectory", "relay"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("SystemCallFilter", "@system-service"),
        ("SystemCallArchitectures", "native"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictNamespaces", "yes"),
        ("LockPersonality", "yes"),
        ("MemoryDenyWriteExecute", "yes"),
        ("RestrictRealtime", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("UMask", "0077"),
        ("LimitNOFILE", "65536"),
    ],
)
def test_service_settings(unit: Unit, key: str, expected: str) -> None:
    assert _one(unit, "Service", key) == expected


def test_stop_timeout_exceeds_default_shutdown_timeout(unit: Unit) -> None:
    value = _one(unit, "Service", "TimeoutStopSec")
    m = re.fullmatch(r"(\d+)s?", value)
    assert m, value
    assert int(m.group(1)) > 30  # relay's default shutdown_timeout


def test_nofile_limit_fits_the_default_connections(unit: Unit) -> None:
    from relay.config.tree import load_config
    from relay.inbound import fdlimit

    default = load_config(Path(__file__).resolve().parent.parent / "conf" / "relay.yaml")
    assert int(_one(unit, "Service", "LimitNOFILE")) >= fdlimit.needed(default)
    assert fdlimit.problem(default, int(_one(unit, "Service", "LimitNOFILE"))) is None


def test_static_user_and_the_maildrop(unit: Unit) -> None:
    """Not DynamicUser=: its state would live under /var/lib/private (0700), where apps in
    group relay could not reach the maildrop. The maildrop and the spool are made before each
    start as root ("+": RestrictSUIDSGID= forbids the daemon the setgid bit)."""
    assert "DynamicUser" not in unit["Service"]
    assert unit["Service"]["ExecStartPre"] == [
        "+/usr/bin/install -d -m 0710 -o relay -g relay /var/lib/relay/spool",
        "+/usr/bin/install -d -m 3730 -o relay -g relay /var/lib/relay/spool/maildrop",
    ]


def test_install_section(unit: Unit) -> None:
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"


def test_documented_caveats() -> None:
    text = UNIT.read_text()
    assert "spool.path: /var/lib/relay/spool" in text
    assert "AmbientCapabilities=CAP_NET_BIND_SERVICE" in text
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE" in text


def _verifiable_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an existing binary (verify checks it exists)."""
    relay_script = Path(sys.executable).parent / "relay"
    exe = str(relay_script) if os.access(relay_script, os.X_OK) else "/bin/true"
    text = UNIT.read_text()
    new_text, count = re.subn(
        r"^ExecStart=\S+", f"ExecStart={exe}", text, count=1, flags=re.MULTILINE
    )
    assert count == 1
    copy = tmp_path / "relay.service"
    copy.write_text(new_text)
    return copy


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if not SYSTEMD_ANALYZE.exists():
        pytest.skip(f"{SYSTEMD_ANALYZE} is not installed; cannot verify the unit file")
    copy = _verifiable_copy(tmp_path)
    proc = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": ""},
    )
    output = proc.stdout + proc.stderr
    # The host may have unrelated broken units; only complaints about ours count.
    ours = [line for line in output.splitlines() if "relay.service" in line]
    assert proc.returncode == 0, output
    assert ours == [], "\n".join(ours)


TEMPLATE = UNIT.parent / "relay@.service"


def test_the_fleet_template_is_the_unit_with_the_instance_name() -> None:
    """relay@.service (several daemons on one machine, one PostgreSQL spool) is relay.service
    but for its instance name in the config file, the state directory, the journal tag and
    the description: a hardening or lifecycle change to one cannot miss the other."""
    unit, template = parse_unit(UNIT.read_text()), parse_unit(TEMPLATE.read_text())
    differs = {
        (sec, key)
        for sec in unit.keys() | template.keys()
        for key in unit.get(sec, {}).keys() | template.get(sec, {}).keys()
        if unit.get(sec, {}).get(key) != template.get(sec, {}).get(key)
    }
    assert differs == {
        ("Unit", "Description"),
        ("Service", "ExecStart"),
        ("Service", "ExecStartPre"),
        ("Service", "StateDirectory"),
        ("Service", "SyslogIdentifier"),
    }
    assert template["Service"]["ExecStartPre"] == [
        v.replace("/var/lib/relay/spool", "/var/lib/relay/%i")
        for v in unit["Service"]["ExecStartPre"]
    ]
    assert _one(template, "Service", "ExecStart").endswith("-c /etc/relay/%i.yaml")
    assert _one(template, "Service", "StateDirectory") == "relay/%i"
    assert _one(template, "Service", "SyslogIdentifier") == "relay@%i"
    assert "spool.path: /var/lib/relay/%i" in TEMPLATE.read_text()


def test_systemd_analyze_verify_template(tmp_path: Path) -> None:
    if not SYSTEMD_ANALYZE.exists():
        pytest.skip(f"{SYSTEMD_ANALYZE} is not installed; cannot verify the unit file")
    relay_script = Path(sys.executable).parent / "relay"
    exe = str(relay_script) if os.access(relay_script, os.X_OK) else "/bin/true"
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", TEMPLATE.read_text(), flags=re.M)
    copy = tmp_path / "relay@.service"
    copy.write_text(text)
    inst = tmp_path / "relay@a.service"  # verify needs an instance: a link to the template
    inst.symlink_to(copy)
    proc = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", str(inst)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": ""},
    )
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if "relay@" in line]
    assert proc.returncode == 0, output
    assert ours == [], "\n".join(ours)
