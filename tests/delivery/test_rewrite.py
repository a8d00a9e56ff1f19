"""relay/delivery/rewrite.py: a route's header rewriting (From, Reply-To with the original), and
nothing else of the header block changed."""

from __future__ import annotations

import pytest

from relay.delivery.rewrite import rewrite_headers


@pytest.mark.parametrize(
    ("head", "from_addr", "rto", "want"),
    [
        (
            b"From: App <a@old.test>\r\nSubject: x\r\n",
            "n@new.test",
            False,
            b"From: App <n@new.test>\r\nX-Original-From: App <a@old.test>\r\nSubject: x\r\n",
        ),
        (
            b"From: a@old.test\r\n",
            "n@new.test",
            True,
            b"From: <n@new.test>\r\nX-Original-From: a@old.test\r\nReply-To: a@old.test\r\n",
        ),
        (
            b"From: a@old.test\r\nReply-To: r@old.test\r\n",
            None,
            True,  # has one: kept
            b"From: a@old.test\r\nReply-To: r@old.test\r\n",
        ),
        (
            b'From: "Doe, J"\r\n <a@old.test>\r\n',
            "n@new.test",
            False,  # folded, quoted
            b'From: "Doe, J" <n@new.test>\r\nX-Original-From: "Doe, J"\r\n <a@old.test>\r\n',
        ),
        (b"Subject: no from\r\n", "n@new.test", True, b"Subject: no from\r\n"),
    ],
)
def test_rewrite_headers(head: bytes, from_addr: str | None, rto: bool, want: bytes) -> None:
    body = b"\r\nbody\r\nFrom: not a header\r\n"
    assert rewrite_headers(head + body, from_addr, rto) == want + body
