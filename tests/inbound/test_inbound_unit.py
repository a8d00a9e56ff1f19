"""Boundary tests of the inbound adapter's own pieces (no sockets)."""

from __future__ import annotations

import pytest

from relay.inbound.core import with_enhanced


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("250 OK", "250 2.0.0 OK"),
        (
            "552 Error: message size exceeds fixed maximum message size",
            "552 5.3.4 message size exceeds fixed maximum message size",
        ),
        ("503 Error: need MAIL command", "503 5.5.1 need MAIL command"),
        ("550 5.1.1 already enhanced", "550 5.1.1 already enhanced"),
        ("250 HELP", "250 HELP"),  # EHLO's last line carries no status code
        ("250-PIPELINING", "250-PIPELINING"),  # continuation lines are left alone
        ("220 relay.test ESMTP", "220 relay.test ESMTP"),  # greeting: no enhanced code
        ("354 End data with <CR><LF>.<CR><LF>", "354 End data with <CR><LF>.<CR><LF>"),
    ],
)
def test_enhanced_codes_added_to_builtin_replies(raw: str, expected: str) -> None:
    assert with_enhanced(raw) == expected
