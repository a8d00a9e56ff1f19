"""relay/delivery/smtpclient_adapter.py: the aiosmtplib internals we rely on are there.

(The inbound side no longer relies on aiosmtpd: its strict line discipline, RFC 5321 §2.3.8,
is relay/inbound/core.py's, pinned by tests/inbound/test_core.py.)"""

from __future__ import annotations

import pytest


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
