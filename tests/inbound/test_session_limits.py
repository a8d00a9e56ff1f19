"""relay/inbound/session_limits.py: which replies count as client errors (and which reset the
count), and the DATA rate meter."""

from __future__ import annotations

import pytest

from relay.inbound.session_limits import DataRate, counts_as_error, resets_errors

# --- session limits -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error"),
    [
        ("250 2.1.0 OK", False),
        ("354 End data with <CR><LF>.<CR><LF>", False),
        ("221 2.0.0 Bye", False),
        ("503 5.5.1 Error: need MAIL command", True),
        ("500 5.5.2 Error: bad syntax", True),
        ("535 5.7.8 Authentication credentials invalid", True),
        ("554 5.7.1 Relay access denied", True),
        ("452 4.5.3 Too many recipients", False),  # flow control, RFC 5321 §4.5.3.1.10
        ("501 5.5.4 Syntax error in parameters", True),
        ("552 5.3.4 Message size exceeds fixed maximum message size", False),  # X.3.Y
        ("451 4.3.0 Spool unavailable; message not accepted", False),  # ours, not the client's
        ("452 4.3.1 Insufficient system storage", False),
        ("421 4.7.0 too many authentication failures", False),  # closes anyway
        ("550 5.1.1 Recipient is suppressed since 2026-01-01T00:00:00Z: bounced", False),
        ("550 5.1.1 no such user", True),
        ("250-SIZE 1000", False),
        ("501 Syntax: HELO hostname", True),  # no enhanced code
        ("", False),
        ("junk", False),
    ],
)
def test_counts_as_error(status: str, error: bool) -> None:
    assert counts_as_error(status) is error


def test_resets_errors() -> None:
    assert resets_errors("250 2.0.0 Ok: queued as 0123")
    assert resets_errors("250 2.0.0 Ok: already queued (duplicate suppressed)")
    assert not resets_errors("250 2.1.5 OK")


def test_data_rate_needs_a_full_window_first() -> None:
    m = DataRate(min_rate=100, window=10.0, start=0.0)
    assert not m.feed(0, 9.9)  # nothing yet, but the window has not passed
    assert m.feed(0, 10.0)  # a whole window and not a byte


def test_data_rate_steady_enough_and_too_slow() -> None:
    m = DataRate(min_rate=100, window=10.0, start=0.0)
    for t in range(0, 60):  # 150 B/s
        assert not m.feed(150, float(t))
    # then it stalls: fine while the last window still holds enough bytes
    assert not m.feed(0, 62.0)
    assert m.feed(0, 70.5)
    assert m.total == 150 * 60


def test_data_rate_fast_then_stalled_is_caught() -> None:
    m = DataRate(min_rate=100, window=10.0, start=0.0)
    assert not m.feed(10_000_000, 0.5)  # a fast start earns no credit for later
    assert not m.feed(0, 9.5)
    assert m.feed(0, 11.0)


def test_data_rate_off() -> None:
    m = DataRate(min_rate=0, window=10.0, start=0.0)
    assert not m.feed(0, 1000.0)
