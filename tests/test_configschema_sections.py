"""Config sections on the library (relay/config_models.py): every error of a section in one
validation, in the contract's words (`key.path: problem`), unknown keys named with a
suggestion, and the frozen dataclasses the rest of the code reads, unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relay.config import DEFAULTS, ConfigError, Limits, from_mapping
from relay.config_models import SECTIONS

BASE = Path("/nonexistent-base")


def _error(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        from_mapping(data, BASE)
    return str(ei.value).splitlines()


def test_every_bad_item_of_a_list_is_reported() -> None:
    # read by hand, the first bad item set the whole list aside and hid the others
    assert _error({"retry": {"schedule": ["1m", "5x", "2h", "soon"]}}) == [
        "retry.schedule[1]: '5x' is not a duration (use 30s, 5m, 2h, 7d or seconds)",
        "retry.schedule[3]: 'soon' is not a duration (use 30s, 5m, 2h, 7d or seconds)",
    ]


def test_every_error_of_a_section_in_file_order() -> None:
    assert _error(
        {
            "log": {"level": "loud"},
            "limits": {"max_recipients": "many", "max_errors": -1, "max_conections": 5},
            "delivery": {"workers": 0},
        }
    ) == [
        "limits.max_recipients: expected a whole number, got str 'many'",
        "limits.max_errors: -1 is below the minimum 0",
        "limits.max_conections: unknown key 'max_conections' (did you mean 'max_connections'?)",
        "delivery.workers: 0 is below the minimum 1",
        "log.level: 'loud' is not one of debug, info, warning, error",
    ]


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"limits": 5}, "limits: expected a mapping, got int 5"),
        ({"dsn": {"enabled": "yes"}}, "dsn.enabled: expected true or false, got str 'yes'"),
        ({"dsn": {"sender": "a@b.c"}}, "dsn.sender: unknown key 'sender'"),
        ({"inbound": {"processes": 65}}, "inbound.processes: at most 64"),
        ({"admin": {"listen": "nohost"}}, "admin.listen: 'nohost' has no port (use host:port)"),
        (
            {"admin": {"password": "x"}},
            "admin.password: unknown key: secrets are never inline;"
            " put it in a file and name the file with 'password_file'",
        ),
        (
            {"limits": {"max_connections": 10, "allowed_reserve": 10}},
            "limits.allowed_reserve: 10 must be below limits.max_connections (10)",
        ),
        (
            {"health": {"queue_age_warning": "5h"}},
            "health.queue_age_critical: must not be below health.queue_age_warning",
        ),
    ],
)
def test_section_errors(data: dict[str, Any], line: str) -> None:
    assert _error(data) == [line]


def test_the_dataclasses_are_built_from_the_sections() -> None:
    c = from_mapping(
        {"limits": {"max_header_size": "64KiB", "session_timeout": "2m"}, "admin": {"listen": ""}},
        BASE,
    )
    assert isinstance(c.limits, Limits)
    assert c.limits.max_header_size == 64 * 1024 and c.limits.session_timeout == 120.0
    assert c.admin_listen is None
    assert c.retry.schedule == (60.0, 300.0, 1800.0, 7200.0)
    assert c.dsn.sender is None and c.log.level == "info"


def test_the_defaults_come_from_the_models() -> None:
    for name, model in SECTIONS.items():
        assert DEFAULTS[name] == model.defaults(), name
