"""Changing the header block of a large stored message without loading it: DKIM
(relay/authenticity/dkim.py `RelaxedBodyHash`, relay/delivery/outbound.py), the one-click headers,
a route's From rewrite (relay/delivery/rewrite.py). The streamed body hash is dkimpy's for
any body and any split into blocks, the signature over a header block plus a streamed body
is the one over the whole message, and a message stored in a file goes out as the same
bytes as the same message in memory."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import time
import types
from pathlib import Path

import dkim
import dkim.canonicalization
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.authenticity import dkim as dkim_sign
from relay.authenticity.dkim import DkimSignError, RelaxedBodyHash
from relay.config.routes import Rewrite
from relay.config.tree import Config, from_mapping
from relay.delivery import outbound, rewrite
from relay.delivery.jobs import Job
from relay.spool import ops
from relay.spool.bodies import StoredBody

_PIECES = [b"a", b"xyz", b" ", b"\t", b"  \t ", b"\r\n", b"\r\n\r\n", b" \r\n", b"\xc3\xa9", b"."]


def dkimpy_hash(body: bytes) -> bytes:
    relaxed = dkim.canonicalization.Relaxed.canonicalize_body(body)
    return hashlib.sha256(relaxed).digest()


def streamed(body: bytes, cuts: list[int]) -> bytes:
    h = RelaxedBodyHash()
    edges = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    for a, b in itertools.pairwise(edges):
        h.update(body[a:b])
    return h.digest()


@settings(max_examples=500, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=40),
    cuts=st.lists(st.integers(0, 400), max_size=10),
)
def test_streamed_hash_is_dkimpys_for_any_body_and_split(
    pieces: list[bytes], cuts: list[int]
) -> None:
    body = b"".join(pieces)
    assert streamed(body, cuts) == dkimpy_hash(body)


@pytest.mark.parametrize(
    "body",
    [
        b"",  # an empty body hashes as empty
        b"\r\n\r\n\r\n",  # only empty lines: empty too
        b"a\r\n\r\n\r\n",  # empty lines at the end dropped
        b"\r\n\r\na\r\n",  # ... not at the start
        b"a \t b \t\r\n",  # runs to one space, none at the end of a line
        b"last line without CRLF  ",  # dkimpy ends it with CRLF, its run becomes one space
        b"x" * 300_000 + b"\r\n" + b"\r\n" * 5000,
    ],
)
def test_edge_bodies(body: bytes) -> None:
    for cuts in ([], [1], [len(body) // 2], list(range(0, len(body), 65536))):
        assert streamed(body, cuts) == dkimpy_hash(body)


@pytest.mark.parametrize("body", [b"a\nb\r\n", b"a\rb\r\n", b"a\r\n\n", b"end\r", b"end\n"])
def test_a_bare_cr_or_lf_is_refused(body: bytes) -> None:
    h = RelaxedBodyHash()
    with pytest.raises(DkimSignError, match="bare CR or LF"):
        h.update(body)
        h.digest()


# --- the signature -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> list[dkim_sign.DkimKey]:
    d = tmp_path_factory.mktemp("dkim")
    dkim_sign.keygen("example.com", "rsa1", d / "rsa.pem")
    dkim_sign.keygen("example.com", "ed1", d / "ed.pem", algorithm="ed25519-sha256")
    return [
        dkim_sign.load_key("example.com", "rsa1", d / "rsa.pem"),
        dkim_sign.load_key("example.com", "ed1", d / "ed.pem", "ed25519-sha256"),
    ]


HEAD = (
    b"From: App <app@example.com>\r\nTo: someone@example.org\r\nSubject: a large one\r\n"
    b"Message-ID: <big-1@example.com>\r\nMIME-Version: 1.0\r\n\r\n"
)


def test_header_block_plus_streamed_hash_signs_as_the_whole_message(
    keys: list[dkim_sign.DkimKey],
) -> None:
    rng = random.Random(7)
    body = b"".join(rng.choice(_PIECES) for _ in range(20_000)) + b"\r\n"
    h = RelaxedBodyHash()
    h.update(body)
    apart = dkim_sign.sign(HEAD, keys, now=1_800_000_000, body_hash=h.digest())
    whole = dkim_sign.sign(HEAD + body, keys, now=1_800_000_000)
    assert apart == whole
    with pytest.raises(DkimSignError, match="ends in an empty line"):
        dkim_sign.sign(HEAD[:-2], keys, body_hash=h.digest())


# --- prepare, stored versus in memory ---------------------------------------------------------


@pytest.fixture(autouse=True)
def fixed_t(monkeypatch: pytest.MonkeyPatch) -> None:
    # both ways sign in the same second (t=), so their bytes can be compared
    now = float(int(time.time()))
    monkeypatch.setattr(dkim_sign, "time", types.SimpleNamespace(time=lambda: now))


def config(tmp_path: Path, unsubscribe: bool) -> Config:
    d = tmp_path / "keys"
    d.mkdir(exist_ok=True)
    dkim_sign.keygen("example.com", "s1", d / "s1.pem")
    (tmp_path / "unsub.key").write_text("0123456789abcdef0123456789abcdef\n")
    data: dict[str, object] = {
        "spool": {"path": str(tmp_path / "spool")},
        "dkim": {"example.com": [{"selector": "s1", "key_file": str(d / "s1.pem")}]},
    }
    if unsubscribe:
        data["identities"] = {
            "example.com": {
                "unsubscribe": {
                    "url": "https://relay.example.com/u",
                    "secret_file": str(tmp_path / "unsub.key"),
                }
            }
        }
    return from_mapping(data, tmp_path)


def job(identity: str, lane: str) -> Job:
    claim = ops.Claim(1, "Q1", "someone@example.org", "smarthost", 0, 0.0, lane, identity)
    env = ops.Envelope("Q1", "<big-1@example.com>", "app@example.com", 0, None, "x")
    return Job("Q1", "smarthost", lane, identity, "app@example.com", [claim], env)


def stored(tmp_path: Path, prefix: bytes, rest: bytes) -> StoredBody:
    path = tmp_path / "body"
    path.write_bytes(rest)
    return StoredBody(prefix, path, len(prefix) + len(rest))


def joined(body: bytes | StoredBody) -> bytes:
    return body if isinstance(body, bytes) else b"".join(body.blocks(size=4096))


@pytest.mark.parametrize("unsubscribe", [False, True])
@pytest.mark.parametrize("prefix_len", [0, 40, len(HEAD) - 4, len(HEAD)])
def test_stored_and_inline_messages_go_out_the_same(
    tmp_path: Path, unsubscribe: bool, prefix_len: int
) -> None:
    cfg = config(tmp_path, unsubscribe)
    body = b"".join(b"line %d of a large message  \r\n" % i for i in range(20_000))
    message = HEAD + body
    j = job("example.com", "bulk")
    inline = asyncio.run(outbound.prepare(cfg, j, message))
    big = stored(tmp_path, message[:prefix_len], message[prefix_len:])
    out = asyncio.run(outbound.prepare(cfg, j, big))
    assert joined(out) == joined(inline)
    assert isinstance(out, StoredBody) and out.size == len(joined(out))
    assert joined(out).startswith(b"DKIM-Signature: ")
    assert (b"List-Unsubscribe: <https://relay.example.com/u/" in joined(out)) is unsubscribe
    # the body was streamed from the file, not loaded: what goes out skips the header block
    # the file holds (the header block is in memory, with the fields added)
    assert out.skip == max(0, len(HEAD) - prefix_len)


def test_a_header_block_past_the_first_mib_is_loaded_whole(tmp_path: Path) -> None:
    cfg = config(tmp_path, False)
    long_head = HEAD[:-2] + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 900) for i in range(1200))
    message = long_head + b"\r\n" + b"body\r\n" * 1000
    j = job("example.com", "transactional")
    inline = asyncio.run(outbound.prepare(cfg, j, message))
    out = asyncio.run(outbound.prepare(cfg, j, stored(tmp_path, b"", message)))
    assert isinstance(out, bytes) and out == inline


def test_a_bare_lf_in_a_stored_body_is_an_outbound_error(tmp_path: Path) -> None:
    cfg = config(tmp_path, False)
    message = HEAD + b"fine\r\n" * 1000 + b"bare\nline\r\n"
    with pytest.raises(outbound.OutboundError, match="bare CR or LF"):
        asyncio.run(
            outbound.prepare(cfg, job("example.com", "bulk"), stored(tmp_path, b"", message))
        )


@pytest.mark.parametrize(
    "rw",
    [
        Rewrite(from_addr="noreply@example.com"),
        Rewrite(from_addr="noreply@example.com", reply_to_original=True),
        Rewrite(reply_to_original=True, envelope_sender="bounces@example.com"),
    ],
)
@pytest.mark.parametrize("prefix_len", [0, 40, len(HEAD)])
def test_a_route_rewrite_of_a_stored_message_is_that_of_the_message_in_memory(
    tmp_path: Path, rw: Rewrite, prefix_len: int
) -> None:
    message = HEAD + b"".join(b"line %d\r\n" % i for i in range(30_000))
    in_memory = asyncio.run(rewrite.apply(rw, "app@example.com", message))
    big = stored(tmp_path, message[:prefix_len], message[prefix_len:])
    sender, out = asyncio.run(rewrite.apply(rw, "app@example.com", big))
    assert sender == in_memory[0]
    assert isinstance(out, StoredBody) and joined(out) == in_memory[1]
    assert out.size == len(in_memory[1]) and out.skip == max(0, len(HEAD) - prefix_len)
    assert b"X-Original-From: " in joined(out) or not rw.from_addr


def test_rewrite_then_sign_a_stored_message_as_in_memory(tmp_path: Path) -> None:
    # the attempt's order: the route rewrites the From, then prepare adds the one-click
    # headers and signs: the second step starts from the first one's header block in memory
    cfg = config(tmp_path, True)
    rw = Rewrite(from_addr="noreply@example.com", reply_to_original=True)
    message = HEAD + b"".join(b"line %d \t\r\n" % i for i in range(30_000))
    j = job("example.com", "bulk")

    async def both(body: bytes | StoredBody) -> bytes:
        _sender, rewritten = await rewrite.apply(rw, "app@example.com", body)
        return joined(await outbound.prepare(cfg, j, rewritten))

    expected = asyncio.run(both(message))
    got = asyncio.run(both(stored(tmp_path, message[:40], message[40:])))
    assert got == expected
    assert b"X-Original-From: " in got and got.startswith(b"DKIM-Signature: ")


# What a mutation run of the then new code found unpinned (tests/MUTANTS.md, "New code, spot
# check"; until issue 28 in tests/test_mutants_new_code.py).
# --- relay/authenticity/dkim.py: RelaxedBodyHash --------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"abc\x0c\r\n", b"abc\x0b\r\n", b"endsX\r\n", b"X\r\n\r\n", b"a\r\n\x0c\r\n"],
)
def test_only_space_and_tab_are_white_space(body: bytes) -> None:
    h = RelaxedBodyHash()
    h.update(body)
    relaxed = dkim.canonicalization.Relaxed.canonicalize_body(body)
    assert h.digest() == hashlib.sha256(relaxed).digest()


def test_digest_twice_gives_the_same() -> None:
    h = RelaxedBodyHash()
    h.update(b"line\r\nno end")
    assert h.digest() == h.digest()
