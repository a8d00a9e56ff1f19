"""`${CREDENTIALS_DIRECTORY}` in the config's file keys (systemd's LoadCredential=).

systemd copies each credential the unit loads (`LoadCredential=relay:/etc/relay/credentials`)
into a private, read-only folder that only the service's user can read, and names that folder
in `$CREDENTIALS_DIRECTORY` (systemd.exec(5) "Credentials"); its path changes from one start
to the next, so a config names files in it as `${CREDENTIALS_DIRECTORY}/relay_smarthost.pass`.
Only this one variable is expanded (no general `$VAR` expansion: a stray `$` in a path stays
literal), in every key that names a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["VARIABLE", "expand"]

VARIABLE = "CREDENTIALS_DIRECTORY"
_TOKEN = "${" + VARIABLE + "}"


def expand(value: str, key: str, environ: Mapping[str, str] | None = None) -> str:
    """`value` with `${CREDENTIALS_DIRECTORY}` replaced by the variable's value; ValueError
    naming `key` when the value uses it and the variable is unset or empty (a config meant for
    the service, run outside it)."""
    if _TOKEN not in value:
        return value
    env = os.environ if environ is None else environ
    folder = env.get(VARIABLE, "")
    if not folder:
        raise ValueError(
            f"{key}: {value!r} names ${{{VARIABLE}}}, which is not set: it is set by systemd"
            ' for a unit with LoadCredential= (README "Running as a service"); outside'
            f" the service, set {VARIABLE} to the folder that holds the files"
        )
    return value.replace(_TOKEN, folder.rstrip("/") or "/")
