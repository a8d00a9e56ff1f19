"""AUTH costs the same for an unknown user, a known user with a wrong password, a malformed
stored hash and the right password: one scrypt of the same parameters and output length
each time, so the reply time says nothing about which usernames exist. Counted, not timed
(a timing test on a loaded 2-core machine would be noise)."""

from __future__ import annotations

from typing import Any

import pytest

from relay.inbound import auth


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    real = auth._scrypt

    def counting(password: bytes, salt: bytes, dklen: int) -> bytes:
        seen.append((len(salt), dklen))
        return real(password, salt, dklen)

    monkeypatch.setattr(auth, "_scrypt", counting)
    return seen


USERS: dict[str, Any] = {}


@pytest.mark.parametrize(
    ("login", "password", "expected"),
    [
        (b"alice", b"right-pw", "alice"),  # known user, right password
        (b"alice", b"wrong", None),  # known user, wrong password
        (b"mallory", b"anything", None),  # unknown user
        (b"\xff\xfe", b"anything", None),  # a login that is not UTF-8
        (b"broken", b"anything", None),  # a stored hash that does not parse
    ],
)
def test_every_check_costs_one_scrypt_of_the_same_shape(
    calls: list[tuple[int, int]],
    login: bytes,
    password: bytes,
    expected: str | None,
) -> None:
    if not USERS:
        USERS["alice"] = auth.hash_password("right-pw")
        USERS["broken"] = "scrypt$!!$!!"
    calls.clear()
    assert auth.check(USERS, login, password) == expected
    assert calls == [(auth.SALT_BYTES, auth.HASH_BYTES)]
