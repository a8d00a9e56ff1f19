"""relay/smtpd_adapter.py: the aiosmtpd internals we rely on are there, and the strict line
discipline (RFC 5321 §2.3.8) behaves as the inbound side expects."""

from __future__ import annotations

import asyncio

import aiosmtpd.smtp
import pytest

from relay import smtpd_adapter


def test_installed_aiosmtpd_has_what_we_rely_on() -> None:
    smtpd_adapter.check()


def test_check_names_a_missing_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(aiosmtpd.smtp.SMTP, "_cb_client_connected")
    with pytest.raises(smtpd_adapter.AdapterError, match="_cb_client_connected"):
        smtpd_adapter.check()


async def _reader(data: bytes, limit: int = 100) -> tuple[asyncio.StreamReader, list[int]]:
    calls: list[int] = []
    r = asyncio.StreamReader(limit=limit)
    smtpd_adapter.make_strict(r, lambda: calls.append(1))
    r.feed_data(data)
    return r, calls


async def test_crlf_lines_pass() -> None:
    r, calls = await _reader(b"NOOP\r\nQUIT\r\n")
    assert await r.readuntil() == b"NOOP\r\n"
    assert await r.readuntil() == b"QUIT\r\n"
    assert calls == []


@pytest.mark.parametrize("data", [b"RCPT TO:<a@b.c\n>\r\n", b"MAIL FROM:<a\rb@c.d>\r\n", b"NOOP\n"])
async def test_bare_cr_or_lf_calls_back_and_never_returns_the_line(data: bytes) -> None:
    r, calls = await _reader(data)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(r.readuntil(), 0.2)
    assert calls == [1]


async def test_tail_of_an_over_long_line_is_returned_for_aiosmtpd_to_refuse() -> None:
    r, calls = await _reader(b"NOOP " + b"x" * 300 + b"\r\nQUIT\r\n")
    with pytest.raises(asyncio.LimitOverrunError) as e:
        await r.readuntil()
    await r.read(e.value.consumed)  # what aiosmtpd's command loop does
    assert await r.readuntil() == b"\n"
    assert await r.readuntil() == b"QUIT\r\n"
    assert calls == []


async def test_other_separators_are_untouched() -> None:
    r, calls = await _reader(b"a\nb\r\n")
    assert await r.readuntil(b"\r\n") == b"a\nb\r\n"
    assert calls == []


def test_installed_aiosmtplib_has_what_we_rely_on() -> None:
    from relay.delivery import smtpclient_adapter

    smtpclient_adapter.check()


def test_aiosmtplib_check_names_a_missing_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosmtplib.protocol import SMTPProtocol

    from relay.delivery import smtpclient_adapter

    for klass in SMTPProtocol.__mro__:
        if "_drain_helper" in vars(klass):
            monkeypatch.delattr(klass, "_drain_helper")
    with pytest.raises(smtpclient_adapter.AdapterError, match="_drain_helper"):
        smtpclient_adapter.check()
