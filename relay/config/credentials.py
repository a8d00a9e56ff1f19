"""`${CREDENTIALS_DIRECTORY}` in the config's file keys (systemd's LoadCredential=).

systemd copies each credential the unit loads (`LoadCredential=relay:/etc/relay/credentials`)
into a private, read-only folder that only the service's user can read, and names that folder
in `$CREDENTIALS_DIRECTORY` (systemd.exec(5) "Credentials"); its path changes from one start
to the next, so a config names files in it as `${CREDENTIALS_DIRECTORY}/relay_smarthost.pass`.
Only this one variable is expanded (no general `$VAR` expansion: a stray `$` in a path stays
literal), in every key that names a file.

The operator's commands (`relay check-config`, `relay queue ...`) run outside the unit, where
the variable is unset: for them (`use_source_folder`, called by the CLI, never by `serve`)
`${CREDENTIALS_DIRECTORY}/relay_<name>` reads `<name>` in the folder the unit loads from,
`<config folder>/credentials` (systemd/relay.service: `LoadCredential=relay:/etc/relay/
credentials` gives each file of it as `relay_<name>`), so `sudo relay check-config` checks
the real files. The daemon has no such fallback: unset there is an error naming the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PREFIX", "VARIABLE", "expand", "use_source_folder"]

VARIABLE = "CREDENTIALS_DIRECTORY"
PREFIX = "relay_"  # the credential ID of the unit's LoadCredential= line, and systemd's "_"
_TOKEN = "${" + VARIABLE + "}"
_source: list[Path] = []  # the CLI's fallback folder (empty: none)


def use_source_folder(folder: Path | None) -> None:
    """Outside the service (the CLI): read `${CREDENTIALS_DIRECTORY}/relay_<name>` as
    `folder/<name>` when the variable is unset; None turns it off."""
    _source[:] = [] if folder is None else [folder]


def expand(value: str, key: str, environ: Mapping[str, str] | None = None) -> str:
    """`value` with `${CREDENTIALS_DIRECTORY}` replaced by the variable's value; ValueError
    naming `key` when the value uses it and the variable is unset or empty (a config meant for
    the service, run outside it)."""
    if _TOKEN not in value:
        return value
    env = os.environ if environ is None else environ
    folder = env.get(VARIABLE, "")
    rest = value.split(_TOKEN + "/" + PREFIX, 1)
    if not folder and _source and len(rest) == 2 and not rest[0] and rest[1]:
        return str(_source[0] / rest[1])
    if not folder:
        raise ValueError(
            f"{key}: {value!r} names ${{{VARIABLE}}}, which is not set: it is set by systemd"
            ' for a unit with LoadCredential= (README "Running as a service"); outside'
            f" the service, set {VARIABLE} to the folder that holds the files"
        )
    return value.replace(_TOKEN, folder.rstrip("/") or "/")
