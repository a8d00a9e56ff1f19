"""`make install DESTDIR=...` (issue 26 item 7): a dry run into a temporary folder lays out
the program where the unit's ExecStart points, the units, the config with an absolute spool
path, the credentials folder, and the spool with its maildrop, each with its mode; the
installed unit passes `systemd-analyze verify` (pointed at the staged program); a DKIM key
made by `relay dkim keygen` lands in the credentials folder and the config names it through
`${CREDENTIALS_DIRECTORY}` as the unit's LoadCredential= provides it.

One test, one `make install` (a virtualenv and a pip install: ~20 s), then a second run
over it (an upgrade): under pytest-xdist a module fixture would run once per worker, two
installs building in the same checkout at once."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD_ANALYZE = Path("/usr/bin/systemd-analyze")


def _install(dest: Path) -> None:
    res = subprocess.run(
        ["make", "-C", str(ROOT), "install", f"DESTDIR={dest}", f"PY={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.timeout(900)
def test_make_install(tmp_path: Path) -> None:
    staged = tmp_path / "destdir"
    _install(staged)
    check_the_program_where_the_unit_points(staged)
    check_config_and_modes(staged)
    check_installed_config_loads_with_the_installed_program(staged)
    check_dkim_keygen_into_the_credentials_folder(staged, tmp_path / "keygen")
    # the man pages (relay/cli/docsgen.py), where man finds them: $(PREFIX)/share/man/manN
    for page in ("man1/relay-sendmail.1", "man1/mailq.1", "man5/relay.yaml.5", "man8/relay.8"):
        installed = staged / "usr/local/share/man" / page
        assert installed.read_bytes() == (ROOT / "man" / Path(page).name).read_bytes()
        assert _mode(installed) == 0o644
    # a second run (an upgrade) keeps the operator's config and fixes the modes again
    conf = staged / "etc/relay/relay.yaml"
    conf.write_text(conf.read_text() + "# the operator's edit\n")
    (staged / "var/lib/relay/spool/maildrop").chmod(0o755)
    _install(staged)
    assert conf.read_text().endswith("# the operator's edit\n")
    assert _mode(staged / "var/lib/relay/spool/maildrop") == 0o3730
    check_the_program_where_the_unit_points(staged)
    if not SYSTEMD_ANALYZE.exists():  # last: everything else above is checked regardless
        pytest.skip(f"{SYSTEMD_ANALYZE} is not installed; cannot verify the installed units")
    for name in ("relay.service", "relay@.service"):
        (tmp_path / name).mkdir()
        check_installed_unit_verifies(staged, tmp_path / name, name)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def check_the_program_where_the_unit_points(staged: Path) -> None:
    relay = staged / "opt/relay/bin/relay"
    assert os.access(relay, os.X_OK)
    # the scripts name the installed interpreter, not the staging folder
    assert relay.read_text().splitlines()[0].startswith("#!/opt/relay/bin/python")
    for name in ("relay", "relay-sendmail"):
        link = staged / "usr/local/bin" / name
        assert link.is_symlink() and os.readlink(link) == f"/opt/relay/bin/{name}"
    unit = (staged / "etc/systemd/system/relay.service").read_text()
    assert "ExecStart=/opt/relay/bin/relay serve -c /etc/relay/relay.yaml" in unit
    assert unit == (ROOT / "systemd/relay.service").read_text()  # as shipped
    assert (staged / "etc/systemd/system/relay@.service").is_file()


def check_config_and_modes(staged: Path) -> None:
    conf = staged / "etc/relay/relay.yaml"
    assert _mode(conf) == 0o644  # relay-sendmail (any app) reads it; it holds no secret
    shipped = (ROOT / "conf/relay.yaml").read_text().splitlines()
    installed = conf.read_text().splitlines()
    changed = [(a, b) for a, b in zip(shipped, installed, strict=True) if a != b]
    assert len(changed) == 1 and changed[0][0].startswith("  path: ../var/spool")
    assert yaml.safe_load(conf.read_text())["spool"]["path"] == "/var/lib/relay/spool"
    assert _mode(staged / "etc/relay") == 0o755
    assert _mode(staged / "etc/relay/credentials") == 0o700
    assert _mode(staged / "var/lib/relay") == 0o710
    assert _mode(staged / "var/lib/relay/spool") == 0o710
    # setgid (files get group relay), sticky, owner rwx, group wx, others nothing
    maildrop = staged / "var/lib/relay/spool/maildrop"
    assert _mode(maildrop) == 0o3730
    assert maildrop.stat().st_mode & stat.S_ISGID and maildrop.stat().st_mode & stat.S_ISVTX


def check_installed_config_loads_with_the_installed_program(staged: Path) -> None:
    """The staged program reads the staged config: the spool is the absolute path the unit
    makes writable, not /etc/var/spool (`../var/spool` beside /etc/relay/relay.yaml)."""
    res = subprocess.run(
        [str(staged / "opt/relay/bin/python"), "-m", "relay", "check-config", "--json",
         "-c", str(staged / "etc/relay/relay.yaml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert '"path": "/var/lib/relay/spool"' in res.stdout


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": ""},
    )


def check_installed_unit_verifies(staged: Path, tmp_path: Path, name: str) -> None:
    """`systemd-analyze verify` checks that ExecStart's program exists: the installed unit,
    with /opt/relay pointed at the staged /opt/relay and nothing else changed."""
    text = (staged / "etc/systemd/system" / name).read_text()
    assert text.count("/opt/relay/bin/relay ") == 1
    unit = tmp_path / name
    unit.write_text(text.replace("/opt/relay/", f"{staged}/opt/relay/"))
    if name == "relay@.service":  # verify needs an instance: a link to the template
        (tmp_path / "relay@a.service").symlink_to(unit)
        unit = tmp_path / "relay@a.service"
    proc = _verify(unit)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert [ln for ln in out.splitlines() if "relay" in ln] == []
    # and the same check fails for a program that is not there (the check is real)
    unit.unlink()
    unit.write_text(text.replace("/opt/relay/", f"{tmp_path}/nowhere/"))
    assert _verify(unit).returncode != 0


def check_dkim_keygen_into_the_credentials_folder(staged: Path, tmp_path: Path) -> None:
    """`relay dkim keygen` with the installed config writes the key beside the other
    secrets (0600: root's when run by root; systemd copies it for the service) and prints
    the key_file line that names the service's copy."""
    etc = tmp_path / "etc"
    shutil.copytree(staged / "etc/relay", etc)  # a fresh folder: each test its own key
    res = subprocess.run(
        [sys.executable, "-m", "relay", "dkim", "keygen", "example.com", "--selector", "s1",
         "-c", str(etc / "relay.yaml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    key = etc / "credentials/dkim-example.com.s1.key"
    assert _mode(key) == 0o600
    line = "key_file: ${CREDENTIALS_DIRECTORY}/relay_dkim-example.com.s1.key"
    assert line in res.stdout
    # what the unit's LoadCredential=relay:/etc/relay/credentials gives the service: each
    # file of the folder as relay_<name> in a folder of its own
    run = tmp_path / "run-credentials"
    run.mkdir()
    shutil.copy(key, run / f"relay_{key.name}")
    cfg = yaml.safe_load((etc / "relay.yaml").read_text())
    cfg["hostname"] = "relay.example.net"
    cfg["spool"]["path"] = str(tmp_path / "spool")
    cfg["dkim"] = {
        "example.com": {
            "selector": "s1",
            "key_file": "${CREDENTIALS_DIRECTORY}/relay_dkim-example.com.s1.key",
        }
    }
    (etc / "relay.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RELAY_CONFIG"}
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(etc / "relay.yaml")],
        capture_output=True, text=True, timeout=60, env={**env, "CREDENTIALS_DIRECTORY": str(run)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # the operator's commands, outside the unit: the same name read where the unit loads
    # it from (etc/credentials/<name>), so `sudo relay check-config` checks the real file
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(etc / "relay.yaml")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    key.rename(key.with_name("moved"))
    res = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "-c", str(etc / "relay.yaml")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert res.returncode == 78 and str(key) in res.stderr, res.stderr
    # the daemon has no such fallback: the variable unset is an error naming the key
    key.with_name("moved").rename(key)
    res = subprocess.run(
        [sys.executable, "-m", "relay", "serve", "-c", str(etc / "relay.yaml")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert res.returncode == 78
    assert "dkim.example.com.key_file: '${CREDENTIALS_DIRECTORY}/relay_dkim-" in res.stderr
