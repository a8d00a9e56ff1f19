"""`make run` and `make test` started at the same moment on a fresh clone must not race on
creating `.venv`: the bootstrap rule holds a lock and checks again once it has it. Tested
with a stand-in for `python3 -m venv` and pip that take a second and record their calls
(a real install would take minutes)."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.skipif(
    shutil.which("flock") is None or shutil.which("make") is None, reason="needs flock and make"
)

FAKE_PY = textwrap.dedent("""\
    #!/bin/sh
    # stands in for `python3 -m venv DIR`: a venv whose pip sleeps and logs
    [ "$1" = "-m" ] && [ "$2" = "venv" ] || exit 2
    mkdir -p "$3/bin"
    echo venv >> "$LOG"
    cat > "$3/bin/pip" <<'PIP'
    #!/bin/sh
    sleep 1
    echo "pip $*" >> "$LOG"
    PIP
    chmod +x "$3/bin/pip"
    printf '#!/bin/sh\\nexit 0\\n' > "$3/bin/python"
    chmod +x "$3/bin/python"
    """)


def test_two_makes_at_once_bootstrap_once(tmp_path: Path) -> None:
    work = tmp_path / "clone"
    work.mkdir()
    shutil.copy(ROOT / "Makefile", work / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": "/usr/bin:/bin", "LOG": str(log)}
    procs = [
        subprocess.Popen(
            ["make", "-s", f"PY={fake}", ".venv/.installed"],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    calls = log.read_text().splitlines()
    assert calls.count("venv") == 1, calls
    assert sum(1 for c in calls if c.startswith("pip install -q -e")) == 1, calls
    assert (work / ".venv" / ".installed").exists()
