"""One-click unsubscribe (relay/authenticity/unsubscribe.py): tokens, the headers, and the endpoint
over
real HTTP."""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.authenticity.unsubscribe import (
    MAX_TOKEN,
    UnsubscribeConf,
    add_headers,
    mailto_token,
    make_token,
    read_token,
)
from relay.authenticity.unsubscribe_http import UnsubscribeHandler, one_click
from relay.mail.message import header, parse_headers, split_message
from relay.ops.http import HttpServer, Request

SECRET = b"s" * 32
OTHER = b"o" * 32
URL = "https://relay.example.com/u"
MAILTO = "unsubscribe@relay.example.com"
CONF = UnsubscribeConf(URL, MAILTO, SECRET)
MSG = (
    b"Received: from app (app [192.0.2.1])\r\n\tby relay; Mon, 1 Jan 2024 00:00:00 +0000\r\n"
    b"From: News <news@shop.example>\r\nTo: user@example.com\r\nSubject: Sale\r\n"
    b"\r\nBody line\r\n\r\nsecond paragraph\r\n"
)


def _flip(text: str, i: int) -> str:
    c = text[i]
    return text[:i] + ("A" if c != "A" else "B") + text[i + 1 :]


# --- tokens -------------------------------------------------------------------------------


def test_token_round_trip_lowercases() -> None:
    token = make_token(SECRET, "Shop.Example", "User@Example.COM")
    assert token.startswith("1.")
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", token)
    assert len(token) < 100
    assert read_token(SECRET, token) == ("shop.example", "user@example.com")


def test_token_utf8_and_sender_identity() -> None:
    token = make_token(SECRET, "news@shop.example", "jörg@bücher.example")
    assert token.isascii()
    assert read_token(SECRET, token) == ("news@shop.example", "jörg@bücher.example")


def test_token_longest_rfc5321_pair_fits() -> None:
    long = "a" * 64 + "@" + ("b" * 62 + ".") * 3 + "cc"
    assert len(long) > 250
    token = make_token(SECRET, long, long)
    assert len(token) <= MAX_TOKEN
    assert read_token(SECRET, token) == (long, long)


def test_token_refuses_bad_input() -> None:
    with pytest.raises(ValueError):
        make_token(b"short", "shop.example", "user@example.com")
    with pytest.raises(ValueError):
        make_token(SECRET, "shop\x00.example", "user@example.com")
    with pytest.raises(ValueError):
        make_token(SECRET, "shop.example", "")
    with pytest.raises(ValueError):
        make_token(SECRET, "x" * 400, "y" * 400)


def test_tampered_tokens_are_refused() -> None:
    token = make_token(SECRET, "shop.example", "user@example.com")
    _, payload, mac = token.split(".")
    assert read_token(OTHER, token) is None
    assert read_token(b"", token) is None
    assert read_token(b"short", token) is None
    for i in range(len(token)):
        if token[i] != ".":
            assert read_token(SECRET, _flip(token, i)) is None, i
    for n in range(len(token)):
        assert read_token(SECRET, token[:n]) is None
    assert read_token(SECRET, token + "A") is None
    assert read_token(SECRET, token + ".") is None
    assert read_token(SECRET, f"2.{payload}.{mac}") is None
    assert read_token(SECRET, f"1.{payload}.{mac}=") is None
    assert read_token(SECRET, f"1.{payload}=.{mac}") is None
    assert read_token(SECRET, f"1.{payload}.{mac[:-1]}") is None


def test_token_has_one_spelling() -> None:
    # base64 leaves spare bits in the last character: a second spelling of the same bytes
    # must not verify (the MAC covers the text)
    spellings = 0
    for rcpt in ("user@example.com", "user1@example.com", "user12@example.com"):
        token = make_token(SECRET, "shop.example", rcpt)
        _, payload, mac = token.split(".")
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        for c in alphabet:
            alt = payload[:-1] + c
            if alt == payload:
                continue
            try:
                same = base64.urlsafe_b64decode(alt + "=" * (-len(alt) % 4)) == raw
            except ValueError:
                same = False
            if same:
                spellings += 1
                assert read_token(SECRET, f"1.{alt}.{mac}") is None
    assert spellings > 0


def test_garbage_and_huge_tokens() -> None:
    for garbage in ("", ".", "..", "1..", "1.a.b", "1.!!.??", "1.AAAA.AAAA", "héllo", "1.\x00.x"):
        assert read_token(SECRET, garbage) is None
    huge = make_token(SECRET, "shop.example", "user@example.com") + "A" * 10_000
    assert read_token(SECRET, huge) is None
    assert read_token(SECRET, "1." + "A" * 1_000_000 + ".AAAA") is None
    # a well-formed payload without the NUL separator, or with a bad UTF-8 byte
    for raw in (b"no-separator", b"\x00user@example.com", b"shop\x00", b"\xff\x00x"):
        p = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        assert read_token(SECRET, f"1.{p}.AAAAAAAAAAAAAAAAAAAAAA") is None


def test_recipients_tokens_differ_and_do_not_transfer() -> None:
    a = make_token(SECRET, "shop.example", "alice@example.com")
    b = make_token(SECRET, "shop.example", "bob@example.com")
    c = make_token(SECRET, "other.example", "alice@example.com")
    assert len({a, b, c}) == 3
    _, pa, ma = a.split(".")
    _, pb, mb = b.split(".")
    assert ma != mb
    # bob's payload with alice's MAC (or any other's) is not a token
    assert read_token(SECRET, f"1.{pb}.{ma}") is None
    assert read_token(SECRET, f"1.{pa}.{mb}") is None
    # and a hand-made payload naming bob without the secret is not either
    forged = base64.urlsafe_b64encode(b"shop.example\x00bob@example.com").rstrip(b"=").decode()
    assert forged == pb
    assert read_token(SECRET, f"1.{forged}.{ma}") is None
    # the same pair gives the same token (stateless, stable across restarts)
    assert make_token(SECRET, "shop.example", "alice@example.com") == a


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000))
def test_read_token_never_raises(text: str) -> None:
    assert read_token(SECRET, text) is None
    assert read_token(SECRET, "1." + text) is None
    mailto_token(text, text)


@settings(max_examples=200, deadline=None)
@given(
    st.binary(max_size=2000),
    st.sampled_from(
        [
            "",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=XX",
            "multipart/form-data",
            "text/plain",
        ]
    ),
)
def test_one_click_never_raises(body: bytes, ctype: str) -> None:
    one_click(body, ctype)


_PART = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=60)


@settings(max_examples=100, deadline=None)
@given(
    _PART,
    _PART,
)
def test_token_round_trip_any_text(identity: str, recipient: str) -> None:
    token = make_token(SECRET, identity, recipient)
    assert read_token(SECRET, token) == (identity.lower(), recipient.lower())
    assert mailto_token(f"unsubscribe {token}") == token


# --- headers ------------------------------------------------------------------------------


TRACE = b"Received: from app (app [192.0.2.1])\r\n\tby relay; Mon, 1 Jan 2024 00:00:00 +0000\r\n"


def _added(out: bytes, original: bytes) -> bytes:
    """What add_headers inserted: below the trace fields (which stay on top), above the rest;
    everything else byte for byte."""
    at = len(TRACE) if original.startswith(TRACE) else 0
    rest = original[at:]
    assert out.startswith(original[:at]) and out.endswith(rest)
    return out[at : len(out) - len(rest)]


def test_add_headers_shape_and_rest_byte_for_byte() -> None:
    out = add_headers(MSG, CONF, "Shop.Example", "User@Example.com")
    assert out is not None
    added = _added(out, MSG)
    token = make_token(SECRET, "shop.example", "user@example.com")
    text = added.decode("ascii")
    assert text.endswith("\r\n") and "\n" not in text.replace("\r\n", "")
    lines = text.split("\r\n")[:-1]
    assert lines[-1] == "List-Unsubscribe-Post: List-Unsubscribe=One-Click"
    assert lines[0].startswith("List-Unsubscribe: <")
    for line in lines:
        # folded only between URIs; a line is over 78 only when one URI alone is
        assert len(line) <= 78 or line.count("<") == 1
    headers = parse_headers(split_message(out)[0])
    assert headers[0][0] == "Received"  # the trace field stays on top
    assert headers[1] == (
        "List-Unsubscribe",
        f"<{URL}/{token}>, <mailto:{MAILTO}?subject=unsubscribe%20{token}>",
    )
    assert header(headers, "list-unsubscribe-post") == "List-Unsubscribe=One-Click"
    assert header(headers, "from") == "News <news@shop.example>"
    assert split_message(out)[1] == split_message(MSG)[1]
    # no whitespace inside the angle brackets (RFC 2369 §2)
    for uri in re.findall(rb"<[^>]*>", added):
        assert not re.search(rb"\s", uri)


def test_add_headers_folds_and_unfolds() -> None:
    out = add_headers(MSG, CONF, "news@shop.example", "someone.long@example.com")
    assert out is not None
    added = _added(out, MSG).decode()
    assert ",\r\n <mailto:" in added
    value = header(parse_headers(split_message(out)[0]), "List-Unsubscribe")
    assert value is not None
    uris = re.findall(r"<([^>]*)>", value)
    assert len(uris) == 2
    token = uris[0].rsplit("/", 1)[1]
    assert read_token(SECRET, token) == ("news@shop.example", "someone.long@example.com")
    assert uris[1] == f"mailto:{MAILTO}?subject=unsubscribe%20{token}"


def test_add_headers_short_value_is_one_line() -> None:
    conf = UnsubscribeConf("https://r.ex/u", None, SECRET)
    out = add_headers(b"Subject: x\r\n\r\nbody", conf, "a", "b")
    assert out is not None
    first = out.split(b"\r\n")[0]
    assert first.startswith(b"List-Unsubscribe: <https://r.ex/u/1.")
    assert out.split(b"\r\n")[1] == b"List-Unsubscribe-Post: List-Unsubscribe=One-Click"


def test_add_headers_mailto_only() -> None:
    conf = UnsubscribeConf(None, MAILTO, SECRET)
    out = add_headers(MSG, conf, "shop.example", "user@example.com")
    assert out is not None
    added = _added(out, MSG).decode()
    token = make_token(SECRET, "shop.example", "user@example.com")
    assert added == f"List-Unsubscribe: <mailto:{MAILTO}?subject=unsubscribe%20{token}>\r\n"
    assert "List-Unsubscribe-Post" not in added


def test_add_headers_http_url_gets_no_one_click() -> None:
    conf = UnsubscribeConf("http://relay.example.com/u/", None, SECRET)
    out = add_headers(MSG, conf, "shop.example", "user@example.com")
    assert out is not None
    added = _added(out, MSG).decode()
    token = make_token(SECRET, "shop.example", "user@example.com")
    assert added == f"List-Unsubscribe: <http://relay.example.com/u/{token}>\r\n"


def test_add_headers_leaves_the_apps_own_alone() -> None:
    own = b"From: a@b.example\r\nlist-unsubscribe: <mailto:x@b.example>\r\n\r\nbody\r\n"
    assert add_headers(own, CONF, "b.example", "user@example.com") is None
    folded = b"From: a@b.example\r\nList-Unsubscribe:\r\n <https://b.example/u>\r\n\r\nbody\r\n"
    assert add_headers(folded, CONF, "b.example", "user@example.com") is None
    # a List-Unsubscribe in the body is not a header
    body_only = b"From: a@b.example\r\n\r\nList-Unsubscribe: <mailto:x@b.example>\r\n"
    assert add_headers(body_only, CONF, "b.example", "user@example.com") is not None


def test_add_headers_needs_url_or_mailto() -> None:
    assert add_headers(MSG, UnsubscribeConf(None, None, SECRET), "a", "b@c") is None
    assert add_headers(MSG, UnsubscribeConf("", "", SECRET), "a", "b@c") is None


def test_add_headers_keeps_an_existing_one_click_single() -> None:
    msg = b"List-Unsubscribe-Post: List-Unsubscribe=One-Click\r\nFrom: a@b\r\n\r\nx"
    out = add_headers(msg, CONF, "b", "c@d")
    assert out is not None
    assert out.count(b"List-Unsubscribe-Post") == 1


def test_add_headers_message_without_header_block() -> None:
    out = add_headers(b"\r\njust a body\r\n", UnsubscribeConf(None, MAILTO, SECRET), "a", "b@c")
    assert out is not None
    head, body = split_message(out)
    assert body == b"just a body\r\n"
    assert header(parse_headers(head), "List-Unsubscribe") is not None


def test_conf_repr_hides_the_secret() -> None:
    assert "sss" not in repr(CONF)


# --- mailto -------------------------------------------------------------------------------


def test_mailto_token() -> None:
    token = make_token(SECRET, "shop.example", "user@example.com")
    assert mailto_token(f"unsubscribe {token}") == token
    assert mailto_token(f"UNSUBSCRIBE {token}") == token
    assert mailto_token(f"  Unsubscribe   {token}  ") == token
    assert mailto_token(f"Re: unsubscribe {token}") == token
    assert mailto_token(f"[ext] unsubscribe\t{token}") == token
    assert mailto_token(f"unsubscribe%20{token}") == token
    assert mailto_token(f"Unsubscribe {token}.") == token
    assert mailto_token("unsubscribe ...") is None
    assert mailto_token("unsubscribe") is None
    assert mailto_token("please unsubscribe me") == "me"  # shape only: read_token says no
    assert read_token(SECRET, "me") is None
    assert mailto_token("") is None
    assert mailto_token("hello") is None
    assert mailto_token("resubscribe x") is None
    assert mailto_token(f"unsubscribe {'A' * (MAX_TOKEN + 1)}") is None
    assert mailto_token("", token) == token
    assert mailto_token("no token here", token) == token
    assert mailto_token("", "bad token!") is None
    assert mailto_token("", "") is None
    assert mailto_token(f"unsubscribe {token}", "1.other.x") == token


# --- HTTP ---------------------------------------------------------------------------------


@dataclass
class Suppressor:
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    entries: set[tuple[str, str]] = field(default_factory=set)

    async def __call__(self, identity: str, recipient: str, source: str) -> bool:
        self.calls.append((identity, recipient, source))
        new = (identity, recipient) not in self.entries
        self.entries.add((identity, recipient))
        return new


@dataclass
class Env:
    client: httpx.AsyncClient
    suppress: Suppressor
    confs: dict[str, UnsubscribeConf]


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    confs = {"shop.example": CONF, "other.example": UnsubscribeConf(None, MAILTO, OTHER)}
    suppress = Suppressor()
    handler = UnsubscribeHandler(lambda: confs, suppress)
    server = HttpServer("unsubscribe")
    server.route("/", handler.http, prefix=True)
    await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            yield Env(client, suppress, confs)
    finally:
        await server.stop()


ONE_CLICK_FORM = {"List-Unsubscribe": "One-Click"}


async def test_post_unsubscribes_once_and_is_idempotent(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    token = make_token(SECRET, "Shop.example", "User@example.com")
    with caplog.at_level(logging.INFO, logger="relay.authenticity.unsubscribe"):
        r = await env.client.post(f"/u/{token}", data=ONE_CLICK_FORM)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "You are unsubscribed" in r.text
    assert "u***@example.com" in r.text and "user@example.com" not in r.text
    assert env.suppress.calls == [("shop.example", "user@example.com", "unsubscribe")]
    rec = [x for x in caplog.records if getattr(x, "event", None) == "unsubscribed"]
    assert len(rec) == 1 and rec[0].levelno == logging.INFO
    assert rec[0].fields["identity"] == "shop.example"  # type: ignore[attr-defined]
    assert rec[0].fields["rcpt"] == "user@example.com"  # type: ignore[attr-defined]

    r = await env.client.post(f"/u/{token}", data=ONE_CLICK_FORM)
    assert r.status_code == 200
    assert len(env.suppress.calls) == 2
    assert env.suppress.entries == {("shop.example", "user@example.com")}


async def test_post_multipart_and_raw_bodies(env: Env) -> None:
    token = make_token(SECRET, "shop.example", "user@example.com")
    r = await env.client.post(
        f"/u/{token}", data={"List-Unsubscribe": "One-Click"}, files={"f": ("a.txt", b"x")}
    )
    assert r.status_code == 200
    assert r.request.headers["content-type"].startswith("multipart/form-data")
    r = await env.client.post(
        f"/u/{token}",
        content=b"utm=1&List-Unsubscribe=One-Click",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200
    r = await env.client.post(f"/u/{token}", content=b"List-Unsubscribe=One-Click")
    assert r.status_code == 200
    assert len(env.suppress.calls) == 3


async def test_get_and_head_never_unsubscribe(env: Env) -> None:
    token = make_token(SECRET, "shop.example", "user@example.com")
    r = await env.client.get(f"/u/{token}")
    assert r.status_code == 200
    page = r.text
    assert re.search(r'<form method="post">', page)
    assert '<input type="hidden" name="List-Unsubscribe" value="One-Click">' in page
    assert "<button" in page and "<script" not in page
    assert "u***@example.com" in page and "user@example.com" not in page
    assert r.headers["cache-control"] == "no-store"
    r = await env.client.head(f"/u/{token}")
    assert r.status_code == 200 and r.content == b""
    r = await env.client.get(f"/u/{token}?utm_source=x")
    assert r.status_code == 200
    assert env.suppress.calls == []
    # the page's own form, as a browser submits it
    r = await env.client.post(f"/u/{token}", data=ONE_CLICK_FORM)
    assert r.status_code == 200 and len(env.suppress.calls) == 1


async def test_bad_tokens_are_400_and_logged_without_the_token(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    good = make_token(SECRET, "shop.example", "user@example.com")
    forged = make_token(OTHER, "shop.example", "user@example.com")
    unconfigured = make_token(SECRET, "nobody.example", "user@example.com")
    other_secret = make_token(SECRET, "other.example", "user@example.com")  # needs OTHER
    with caplog.at_level(logging.INFO, logger="relay.authenticity.unsubscribe"):
        for token in (forged, unconfigured, other_secret, "garbage", "", _flip(good, 5)):
            for method in ("GET", "POST"):
                r = await env.client.request(method, f"/u/{token}", data=ONE_CLICK_FORM)
                assert r.status_code == 400, (token, method)
                assert "not valid" in r.text
    assert env.suppress.calls == []
    refused = [x for x in caplog.records if getattr(x, "event", None) == "unsubscribe_refused"]
    assert len(refused) == 12
    assert all(x.levelno == logging.WARNING for x in refused)
    for x in refused:
        text = repr(x.__dict__)
        for token in (forged, unconfigured, other_secret):
            assert token not in text
    reasons = {x.getMessage() for x in refused}
    assert reasons == {
        "bad signature",
        "no unsubscribe configured for the identity",
        "malformed token",
    }


async def test_token_of_other_identity_uses_its_secret(env: Env) -> None:
    token = make_token(OTHER, "other.example", "user@example.com")
    r = await env.client.post(f"/u/{token}", data=ONE_CLICK_FORM)
    assert r.status_code == 200
    assert env.suppress.calls == [("other.example", "user@example.com", "unsubscribe")]
    # config changes apply at once (the mapping is read per request)
    del env.confs["other.example"]
    r = await env.client.post(f"/u/{token}", data=ONE_CLICK_FORM)
    assert r.status_code == 400


async def test_post_without_one_click_is_400(env: Env) -> None:
    token = make_token(SECRET, "shop.example", "user@example.com")
    for kwargs in (
        {},
        {"data": {"List-Unsubscribe": "Nope"}},
        {"data": {"other": "One-Click"}},
        {"content": b"x" * 100_000},
    ):
        r = await env.client.post(f"/u/{token}", **kwargs)
        assert r.status_code == 400, kwargs
        assert "did not confirm" in r.text
    assert env.suppress.calls == []


async def test_other_methods_and_paths(env: Env) -> None:
    token = make_token(SECRET, "shop.example", "user@example.com")
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
        r = await env.client.request(method, f"/u/{token}")
        assert r.status_code == 405
        assert r.headers["allow"] == "GET, HEAD, POST"
    r = await env.client.get(f"/x/{token}")
    assert r.status_code == 404
    assert env.suppress.calls == []


async def test_spool_error_is_503(env: Env) -> None:
    async def broken(identity: str, recipient: str, source: str) -> bool:
        raise OSError("disk full")

    handler = UnsubscribeHandler(lambda: env.confs, broken)
    server = HttpServer("unsubscribe")
    server.route("/", handler.http, prefix=True)
    await server.start("127.0.0.1", 0)
    try:
        token = make_token(SECRET, "shop.example", "user@example.com")
        async with httpx.AsyncClient() as client:
            r = await client.post(f"http://127.0.0.1:{server.port}/u/{token}", data=ONE_CLICK_FORM)
        assert r.status_code == 503
    finally:
        await server.stop()


async def test_html_is_escaped() -> None:
    secret = b"k" * 32
    identity = "<script>alert(1)</script>"
    recipient = '"<b>x</b>"@example.com'
    calls: list[tuple[str, str, str]] = []

    async def suppress(i: str, r: str, s: str) -> bool:
        calls.append((i, r, s))
        return True

    handler = UnsubscribeHandler(lambda: {identity: UnsubscribeConf(URL, None, secret)}, suppress)
    token = make_token(secret, identity, recipient)
    for method, body in (("GET", b""), ("POST", b"List-Unsubscribe=One-Click")):
        resp = await handler.http(Request(method, f"/u/{token}", "", {}, body, "192.0.2.9"))
        assert resp.status == 200
        page = resp.body.decode()
        assert "<script>" not in page and "<b>" not in page
        assert "&lt;script&gt;" in page
    assert calls == [(identity, recipient, "unsubscribe")]


def test_handler_prefix_must_be_a_directory() -> None:
    with pytest.raises(ValueError):
        UnsubscribeHandler(lambda: {}, Suppressor(), "/u")


# --- edges found by mutation testing ---------------------------------------------------------

from relay.authenticity import unsubscribe as u  # noqa: E402


def test_secret_length_boundary() -> None:
    ok, short = b"k" * u.MIN_SECRET, b"k" * (u.MIN_SECRET - 1)
    token = u.make_token(ok, "i.example", "r@x.org")
    assert u.read_token(ok, token) == ("i.example", "r@x.org")
    with pytest.raises(ValueError):
        u.make_token(short, "i.example", "r@x.org")
    assert u.read_token(short, token) is None


@pytest.mark.parametrize(("identity", "recipient"), [("i\x00x", "r@x.org"), ("i", "r\x00@x.org")])
def test_nul_is_refused_in_either_part(identity: str, recipient: str) -> None:
    with pytest.raises(ValueError):
        u.make_token(SECRET, identity, recipient)


def test_a_well_signed_payload_with_a_second_nul_or_a_bad_mac_text_is_refused() -> None:
    payload = u._b64(b"i.example\x00r@x.org\x00extra")
    signed = f"{u.VERSION}.{payload}"
    assert u.read_token(SECRET, f"{signed}.{u._mac(SECRET, signed)}") is None
    good = u.make_token(SECRET, "i.example", "r@x.org")
    version, body, mac = good.split(".")
    assert u.read_token(SECRET, f"{version}.{body}.{mac[:-1]}!") is None
    assert u.read_token(SECRET, f"{version}.{body}!.{mac}") is None


def test_mailto_token_length_edges_and_trailing_dot() -> None:
    t = "A" * u.MAX_TOKEN
    assert u.mailto_token(f"unsubscribe {t}") == t
    assert u.mailto_token(f"unsubscribe {t}A") is None
    assert u.mailto_token(f"Re: unsubscribe {t[:20]}.") == t[:20]
    assert u.mailto_token("no token here", t) == t
    assert u.mailto_token("no token here", t + "A") is None


def test_the_header_folds_exactly_at_78_columns() -> None:
    first = "<https://a/" + "x" * 20 + ">"
    head = f"List-Unsubscribe: {first}"
    fits = "<m:" + "y" * (78 - len(head) - 2 - 4) + ">"
    assert len(head) + 2 + len(fits) == 78
    assert u._fold("List-Unsubscribe", [first, fits]) == f"{head}, {fits}\r\n"
    over = fits[:-1] + "y>"
    assert u._fold("List-Unsubscribe", [first, over]) == f"{head},\r\n {over}\r\n"


@pytest.mark.parametrize(
    ("mailto", "expected"),
    [
        ("unsub@x.org", "<mailto:unsub@x.org?subject=unsubscribe%20T>"),
        ("mailto:unsub@x.org", "<mailto:unsub@x.org?subject=unsubscribe%20T>"),
        ("MAILTO:unsub@x.org", "<mailto:unsub@x.org?subject=unsubscribe%20T>"),
        ("unsub@x.org?cc=a@x.org", "<mailto:unsub@x.org?cc=a@x.org&subject=unsubscribe%20T>"),
    ],
)
def test_mailto_uri(mailto: str, expected: str) -> None:
    assert u._mailto_uri(mailto, "T") == expected


def test_a_url_with_a_trailing_slash_gets_one_slash() -> None:
    conf = UnsubscribeConf(URL + "/", None, SECRET)
    out = u.add_headers(b"From: a@b.c\r\n\r\nx\r\n", conf, "i.example", "r@x.org")
    assert out is not None and b"/u/1." in out and b"/u//" not in out


@pytest.mark.parametrize(
    ("message", "at"),
    [
        (b"Return-Path: <a@b.c>\r\nReceived: x\r\n\tcontinued\r\nFrom: a@b.c\r\n\r\nbody", 47),
        (b"From: a@b.c\r\nReceived: late\r\n\r\nbody", 0),
        (b"\r\nbody", 0),
        (b"Received: x", 0),
        (b"Received: x\r\n folded\r\nSubject: y: z\r\n\r\n", 22),
    ],
)
def test_headers_go_below_the_trace_fields(message: bytes, at: int) -> None:
    assert u._after_trace(message) == at


@pytest.mark.parametrize(
    ("body", "ctype", "expected"),
    [
        (b"List-Unsubscribe=One-Click", "application/x-www-form-urlencoded", True),
        (b"List%2DUnsubscribe=One%2DClick", "application/x-www-form-urlencoded", True),
        (b"List%2DUnsubscribe=One%2DClick", "APPLICATION/X-WWW-FORM-URLENCODED; x=y", True),
        (b"a=b&List-Unsubscribe=", "application/x-www-form-urlencoded", False),
        (b"List%2DUnsubscribe=One%2DClick", "text/plain", False),
        (
            b'--B\r\nContent-Disposition: form-data; name="List-Unsubscribe"\r\n\r\n'
            b"One-Click\r\n--B--\r\n",
            'multipart/form-data; boundary="B"',
            True,
        ),
        (
            b'--B\r\nContent-Disposition: form-data; name="other"\r\n\r\nOne-Click\r\n--B--\r\n',
            'multipart/form-data; boundary="B"',
            False,
        ),
        (b"not multipart at all", "multipart/form-data", False),
        (b"List-Unsubscribe=One-Click" + b" " * u.MAX_FORM, "text/plain", False),
    ],
)
def test_one_click_bodies(body: bytes, ctype: str, expected: bool) -> None:
    assert one_click(body, ctype) is expected


def test_path_prefix_must_be_a_folder() -> None:
    for bad in ("u/", "/u", "u"):
        with pytest.raises(ValueError, match="path_prefix"):
            UnsubscribeHandler(lambda: {}, _never, bad)


async def _never(identity: str, recipient: str, source: str) -> bool:
    raise AssertionError("not called")
