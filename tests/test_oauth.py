"""relay/delivery/oauth.py against a real HTTP token endpoint on loopback: the grants'
form fields, caching, expiry, single flight, invalidation, errors that never carry a secret,
token commands, and the SASL strings' exact bytes."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import pytest

from relay.delivery.oauth import (
    OAuthConf,
    OAuthError,
    TokenSource,
    oauthbearer,
    parse_oauthbearer_error,
    xoauth2,
)
from tests.harness import free_port
from tests.webhook import Post, Receiver


@pytest.fixture
def endpoint():
    rec = Receiver().start()
    state: dict[str, Any] = {"n": 0, "status": 200, "expires_in": 3600, "delay": 0.0}

    def answer(post: Post) -> tuple[int, dict[str, Any]]:
        if state["delay"]:
            time.sleep(state["delay"])
        if state["status"] != 200:
            return state["status"], {"error": "invalid_client", "error_description": "bad secret"}
        state["n"] += 1
        return 200, {
            "access_token": f"tok-{state['n']}",
            "token_type": "Bearer",
            "expires_in": state["expires_in"],
        }

    rec.answer = answer
    yield rec, state
    rec.stop()


def conf(rec: Receiver, **kw: Any) -> OAuthConf:
    base: dict[str, Any] = {
        "token_url": rec.url,
        "client_id": "cid",
        "client_secret": "S3CR3T",
        "scope": "https://outlook.office365.com/.default",
        "timeout": 2.0,
    }
    return OAuthConf(**{**base, **kw})


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_client_credentials_grant_and_cache(endpoint) -> None:
    rec, _state = endpoint

    async def main() -> list[str]:
        ts = TokenSource(conf(rec))
        try:
            return [await ts.token(), await ts.token()]
        finally:
            await ts.aclose()

    assert run(main()) == ["tok-1", "tok-1"]
    assert len(rec.posts) == 1
    assert rec.posts[0].form == {
        "grant_type": "client_credentials",
        "client_id": "cid",
        "client_secret": "S3CR3T",
        "scope": "https://outlook.office365.com/.default",
    }


def test_refresh_token_grant(endpoint) -> None:
    rec, _state = endpoint

    async def main() -> str:
        ts = TokenSource(conf(rec, refresh_token="R-TOKEN", scope=None))
        try:
            return await ts.token()
        finally:
            await ts.aclose()

    assert run(main()) == "tok-1"
    assert rec.posts[0].form == {
        "grant_type": "refresh_token",
        "refresh_token": "R-TOKEN",
        "client_id": "cid",
        "client_secret": "S3CR3T",
    }


def test_expiry_with_a_margin(endpoint) -> None:
    rec, state = endpoint
    state["expires_in"] = 100
    now = {"t": 1000.0}

    async def main() -> list[str]:
        ts = TokenSource(conf(rec), clock=lambda: now["t"], margin=60.0)
        got = [await ts.token()]
        now["t"] = 1039.0  # 61 s left: still good
        got.append(await ts.token())
        now["t"] = 1040.0  # 60 s left: refreshed
        got.append(await ts.token())
        await ts.aclose()
        return got

    assert run(main()) == ["tok-1", "tok-1", "tok-2"]
    assert len(rec.posts) == 2


def test_many_callers_one_request(endpoint) -> None:
    rec, state = endpoint
    state["delay"] = 0.2

    async def main() -> set[str]:
        ts = TokenSource(conf(rec))
        got = await asyncio.gather(*(ts.token() for _ in range(50)))
        await ts.aclose()
        return set(got)

    assert run(main()) == {"tok-1"}
    assert len(rec.posts) == 1


def test_invalidate_refetches_but_a_stale_invalidation_keeps_the_new_token(endpoint) -> None:
    rec, _state = endpoint

    async def main() -> list[str]:
        ts = TokenSource(conf(rec))
        t1 = await ts.token()
        ts.invalidate(t1)
        t2 = await ts.token()
        ts.invalidate(t1)  # a late refusal of the old token
        t3 = await ts.token()
        await ts.aclose()
        return [t1, t2, t3]

    assert run(main()) == ["tok-1", "tok-2", "tok-2"]
    assert len(rec.posts) == 2


@pytest.mark.parametrize(
    ("status", "transient"), [(400, False), (401, False), (403, False), (429, True), (503, True)]
)
def test_refusals_say_what_without_secrets(endpoint, status: int, transient: bool) -> None:
    rec, state = endpoint
    state["status"] = status

    async def main() -> OAuthError:
        ts = TokenSource(conf(rec, refresh_token="R-TOKEN"))
        try:
            await ts.token()
        except OAuthError as e:
            return e
        finally:
            await ts.aclose()
        raise AssertionError("no error")

    e = run(main())
    assert e.transient is transient
    assert f"HTTP {status}" in str(e) and "invalid_client" in str(e)
    assert "S3CR3T" not in str(e) and "R-TOKEN" not in str(e)


def test_unreachable_and_slow_endpoints_are_transient(endpoint) -> None:
    rec, state = endpoint

    async def one(c: OAuthConf) -> OAuthError:
        ts = TokenSource(c)
        try:
            await ts.token()
        except OAuthError as e:
            return e
        finally:
            await ts.aclose()
        raise AssertionError("no error")

    closed = run(
        one(
            OAuthConf(
                token_url=f"http://127.0.0.1:{free_port()}/t", client_id="c", client_secret="S3CR3T"
            )
        )
    )
    assert closed.transient and "unreachable" in str(closed)
    state["delay"] = 1.0
    slow = run(one(conf(rec, timeout=0.3)))
    assert slow.transient and "timed out" in str(slow)


@pytest.mark.parametrize(
    ("command", "token"),
    [
        ("echo plain-token", "plain-token"),
        ('echo \'{"access_token": "json-token", "expires_in": 120}\'', "json-token"),
    ],
)
def test_token_command(command: str, token: str) -> None:
    async def main() -> tuple[str, int]:
        ts = TokenSource(OAuthConf(token_command=command))
        got = await ts.token()
        await ts.token()  # cached
        return got, ts.fetches

    assert run(main()) == (token, 1)


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        ("exit 1", "exited 1"),
        ("sleep 5", "timed out"),
        ("true", "printed no token"),
        ("echo '{\"nope\": 1}'", "no access_token"),
    ],
)
def test_token_command_failures(command: str, fragment: str) -> None:
    async def main() -> OAuthError:
        ts = TokenSource(OAuthConf(token_command=command, timeout=0.3))
        try:
            await ts.token()
        except OAuthError as e:
            return e
        raise AssertionError("no error")

    e = run(main())
    assert fragment in str(e) and e.transient


def test_sasl_strings() -> None:
    assert base64.b64decode(xoauth2("u@x.test", "T0K")) == (
        b"user=u@x.test\x01auth=Bearer T0K\x01\x01"
    )
    assert base64.b64decode(oauthbearer("a,b=c@x.test", "T0K", "smtp.x.test", 587)) == (
        b"n,a=a=2Cb=3Dc@x.test,\x01host=smtp.x.test\x01port=587\x01auth=Bearer T0K\x01\x01"
    )
    err = base64.b64encode(b'{"status":"invalid_token","scope":"s"}').decode()
    assert parse_oauthbearer_error(err) == {"status": "invalid_token", "scope": "s"}
    assert parse_oauthbearer_error("%%%") == {}
