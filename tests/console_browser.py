"""Headless Chromium for the console's browser tests and `make screenshots`: Debian's
`chromium` (apt) driven by Playwright for Python, never Playwright's own downloaded browsers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/lib/chromium/chromium")


def chromium_path() -> str | None:
    env = os.environ.get("RELAY_CHROMIUM")
    if env and Path(env).exists():
        return env
    for c in CANDIDATES:
        if Path(c).exists():
            return c
    return shutil.which("chromium")


def why_unavailable() -> str | None:
    """None when a browser test can run, else why not (printed as the skip's reason)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        return f"Playwright for Python is not installed ({e}): pip install -e '.[test]'"
    if chromium_path() is None:
        return (
            "no chromium at /usr/bin/chromium: `apt-get install -y chromium` failed or is not"
            " allowed here (make test tries it as root)"
        )
    return None


LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
