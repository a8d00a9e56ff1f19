"""Boundary tests of the inbound adapter's own pieces (no sockets)."""

from __future__ import annotations

import pytest
from aiosmtpd.smtp import SMTP
from hypothesis import given
from hypothesis import strategies as st

from relay.inbound import _SIMPLE_PATH, RelaySMTP, with_enhanced


class _Bare(RelaySMTP):
    def __init__(self) -> None:  # only what _getaddr reads
        self.local_part_limit = 0


def _ours(arg: str) -> tuple[str | None, str | None]:
    return _Bare()._getaddr(arg)


def _theirs(arg: str) -> tuple[str | None, str | None]:
    return SMTP._getaddr(_Bare(), arg)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "arg",
    [
        "<a@b.c>",
        "<a.b+c@ex-ample.com> SIZE=12 BODY=8BITMIME",
        "<a@b.c>  SIZE=1 ",
        "<>",
        '<"x y"@b.c>',
        "<@route:a@b.c>",
        "a@b.c",
        "<a@b.c",
        "<a@[127.0.0.1]>",
        "<user@bücher.example>",
        "<o'brien@example.com>",
        "<a@b.c>x",
    ],
)
def test_fast_path_parses_like_aiosmtpd(arg: str) -> None:
    assert _ours(arg) == _theirs(arg)


_atom = st.text(alphabet="abcXYZ019!#$%&'*+/=?^_`{|}~-", min_size=1, max_size=8)
_label = st.text(alphabet="abcxyz019-", min_size=1, max_size=8)


@given(
    local=st.lists(_atom, min_size=1, max_size=3),
    dom=st.lists(_label, min_size=1, max_size=3),
    rest=st.sampled_from(["", " SIZE=100", " BODY=8BITMIME SIZE=5"]),
)
def test_fast_path_property(local: list[str], dom: list[str], rest: str) -> None:
    arg = f"<{'.'.join(local)}@{'.'.join(dom)}>{rest}"
    assert _SIMPLE_PATH.match(arg) is not None
    assert _ours(arg) == _theirs(arg)


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
