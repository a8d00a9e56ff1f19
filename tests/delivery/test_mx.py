"""MX resolution (RFC 5321 §5.1, RFC 7505) against a real DNS server on loopback."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable

import pytest

from relay.delivery.errors import DnsPermanentError, DnsTransientError
from relay.delivery.mx import (
    MxHost,
    Resolver,
    is_null_mx,
    order_mx,
    parse_domain_literal,
    parse_nameserver,
)
from relay.delivery.replies import Reply
from tests.dnsserver import DnsServer, dns_server  # noqa: F401  (pytest fixture)

MakeResolver = Callable[..., Resolver]


@pytest.fixture
def make_resolver(dns_server: DnsServer) -> MakeResolver:  # noqa: F811
    def make(seed: int = 0, timeout: float = 2.0) -> Resolver:
        return Resolver(
            nameservers=[dns_server.nameserver], timeout=timeout, rng=random.Random(seed)
        )

    return make


# -- against the DNS server ---------------------------------------------------------


async def test_preference_order_and_aaaa(make_resolver: MakeResolver) -> None:
    hosts = await make_resolver().resolve("example.test")
    assert hosts == [
        MxHost("mx1.example.test", 10, ("127.0.0.2",)),
        MxHost("mx2.example.test", 20, ("127.0.0.1", "::1")),
    ]


async def test_name_is_case_and_trailing_dot_insensitive(make_resolver: MakeResolver) -> None:
    hosts = await make_resolver().resolve("EXAMPLE.Test.")
    assert [h.name for h in hosts] == ["mx1.example.test", "mx2.example.test"]


async def test_equal_preference_shuffled_per_seed(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone(
        "equal.test",
        {"MX": [(20, "c.equal.test"), (10, "a.equal.test"), (10, "b.equal.test")]},
    )
    for name, address in [("a", "127.0.0.1"), ("b", "127.0.0.2"), ("c", "127.0.0.3")]:
        dns_server.set_zone(f"{name}.equal.test", {"A": [address]})

    orders = set()
    for seed in range(16):
        first = [h.name for h in await make_resolver(seed).resolve("equal.test")]
        again = [h.name for h in await make_resolver(seed).resolve("equal.test")]
        assert first == again, f"seed {seed} is not deterministic"
        assert first[2] == "c.equal.test"  # the less preferred host always comes last
        orders.add(tuple(first[:2]))
    assert orders == {("a.equal.test", "b.equal.test"), ("b.equal.test", "a.equal.test")}


async def test_implicit_mx(make_resolver: MakeResolver) -> None:
    hosts = await make_resolver().resolve("implicit.test")
    assert hosts == [MxHost("implicit.test", 0, ("127.0.0.1",))]


async def test_implicit_mx_without_addresses_is_permanent(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone("txtonly.test", {"TXT": ['"hello"']})
    with pytest.raises(DnsPermanentError) as info:
        await make_resolver().resolve("txtonly.test")
    assert (info.value.reply.code, info.value.reply.enhanced) == (550, "5.1.2")
    assert "no MX and no address records" in info.value.reply.text


async def test_implicit_mx_address_lookup_failure_is_transient(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    # NODATA for MX, then the A/AAAA lookups of the implicit MX fail.
    dns_server.set_zone("flaky.test", {"MX": [], "A": "SERVFAIL", "AAAA": "SERVFAIL"})
    resolver = make_resolver()
    with pytest.raises(DnsTransientError) as info:
        await resolver.resolve("flaky.test")
    assert (info.value.reply.code, info.value.reply.enhanced) == (451, "4.4.3")


async def test_nxdomain_is_permanent(make_resolver: MakeResolver) -> None:
    with pytest.raises(DnsPermanentError) as info:
        await make_resolver().resolve("nowhere.test")
    assert info.value.reply == Reply(550, "5.1.2", "domain nowhere.test does not exist (NXDOMAIN)")


async def test_null_mx_is_permanent(make_resolver: MakeResolver, dns_server: DnsServer) -> None:  # noqa: F811
    # RFC 7505: even with an A record, a null MX means no mail (no implicit MX fallback).
    dns_server.set_zone("nullmx.test", {"MX": [(0, ".")], "A": ["127.0.0.1"]})
    with pytest.raises(DnsPermanentError) as info:
        await make_resolver().resolve("nullmx.test")
    assert info.value.reply == Reply(
        556, "5.1.10", "nullmx.test does not accept mail (null MX, RFC 7505)"
    )
    assert dns_server.count("nullmx.test", "A") == 0


async def test_servfail_is_transient(make_resolver: MakeResolver) -> None:
    with pytest.raises(DnsTransientError) as info:
        await make_resolver().resolve("broken.test")
    assert (info.value.reply.code, info.value.reply.enhanced) == (451, "4.4.3")
    assert info.value.reply.text.startswith("DNS lookup for broken.test failed: ")


async def test_timeout_is_transient(make_resolver: MakeResolver, dns_server: DnsServer) -> None:  # noqa: F811
    started = time.monotonic()
    with pytest.raises(DnsTransientError) as info:
        await make_resolver(timeout=0.5).resolve("slow.test")
    assert time.monotonic() - started < 3.0
    assert (info.value.reply.code, info.value.reply.enhanced) == (451, "4.4.3")
    assert "timed out" in info.value.reply.text
    assert dns_server.count("slow.test", "MX") >= 1


async def test_host_without_addresses_is_skipped(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone(
        "skip.test",
        {"MX": [(5, "gone.skip.test"), (7, "noaddr.skip.test"), (10, "mx2.example.test")]},
    )
    dns_server.set_zone("noaddr.skip.test", {"TXT": ['"no addresses here"']})
    hosts = await make_resolver().resolve("skip.test")
    assert hosts == [MxHost("mx2.example.test", 10, ("127.0.0.1", "::1"))]


async def test_ipv6_only_host(dns_server: DnsServer, make_resolver: MakeResolver) -> None:  # noqa: F811
    dns_server.set_zone("v6.test", {"MX": [(10, "mx.v6.test")]})
    dns_server.set_zone("mx.v6.test", {"AAAA": ["::1"]})
    assert await make_resolver().resolve("v6.test") == [MxHost("mx.v6.test", 10, ("::1",))]


async def test_aaaa_timeout_keeps_a_addresses(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone("half.test", {"MX": [(10, "mx.half.test")]})
    dns_server.set_zone("mx.half.test", {"A": ["127.0.0.5"], "AAAA": "TIMEOUT"})
    hosts = await make_resolver(timeout=0.5).resolve("half.test")
    assert hosts == [MxHost("mx.half.test", 10, ("127.0.0.5",))]


async def test_no_host_has_addresses_is_permanent(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone("dangling.test", {"MX": [(10, "gone.dangling.test")]})
    with pytest.raises(DnsPermanentError) as info:
        await make_resolver().resolve("dangling.test")
    assert (info.value.reply.code, info.value.reply.enhanced) == (550, "5.4.4")


async def test_no_addresses_with_a_failed_lookup_is_transient(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone("partial.test", {"MX": [(10, "gone.partial.test"), (20, "mx.broken.test")]})
    dns_server.set_zone("mx.broken.test", "SERVFAIL")
    with pytest.raises(DnsTransientError) as info:
        await make_resolver().resolve("partial.test")
    assert (info.value.reply.code, info.value.reply.enhanced) == (451, "4.4.3")
    assert "mx.broken.test" in info.value.reply.text


async def test_failed_host_lookup_does_not_hide_working_hosts(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    dns_server.set_zone("mixed.test", {"MX": [(10, "mx.broken.test"), (20, "mx1.example.test")]})
    dns_server.set_zone("mx.broken.test", "SERVFAIL")
    hosts = await make_resolver().resolve("mixed.test")
    assert hosts == [MxHost("mx1.example.test", 20, ("127.0.0.2",))]


async def test_large_answer_falls_back_to_tcp(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    addresses = [f"127.0.{i // 200}.{i % 200 + 1}" for i in range(120)]
    dns_server.set_zone("big.test", {"A": addresses})
    hosts = await make_resolver().resolve("big.test")
    assert len(hosts) == 1
    assert sorted(hosts[0].addresses) == sorted(addresses)


async def test_cname_to_mx_domain(dns_server: DnsServer, make_resolver: MakeResolver) -> None:  # noqa: F811
    dns_server.set_zone("alias.test", {"CNAME": ["example.test"]})
    hosts = await make_resolver().resolve("alias.test")
    assert [h.name for h in hosts] == ["mx1.example.test", "mx2.example.test"]


async def test_runtime_zone_change(dns_server: DnsServer, make_resolver: MakeResolver) -> None:  # noqa: F811
    resolver = make_resolver()
    assert (await resolver.resolve("implicit.test"))[0].addresses == ("127.0.0.1",)
    dns_server.set_zone("implicit.test", {"A": ["127.0.0.9"]})
    assert (await resolver.resolve("implicit.test"))[0].addresses == ("127.0.0.9",)


async def test_second_nameserver_used_when_first_is_dead(dns_server: DnsServer) -> None:  # noqa: F811
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    resolver = Resolver(nameservers=[dead, dns_server.nameserver], timeout=1.0)
    assert (await resolver.resolve("implicit.test"))[0].name == "implicit.test"


async def test_domain_literal_needs_no_dns(
    dns_server: DnsServer,  # noqa: F811
    make_resolver: MakeResolver,
) -> None:
    resolver = make_resolver()
    before = dns_server.query_count
    assert await resolver.resolve("[127.0.0.1]") == [MxHost("[127.0.0.1]", 0, ("127.0.0.1",))]
    assert await resolver.resolve("[IPv6:::1]") == [MxHost("[IPv6:::1]", 0, ("::1",))]
    assert dns_server.query_count == before


@pytest.mark.parametrize("domain", ["[127.0.0.256]", "[IPv6:nope]", "[127.0.0.1", "[::1]"])
async def test_bad_domain_literal_is_permanent(domain: str) -> None:
    resolver = Resolver(nameservers=["127.0.0.1:9"], timeout=0.1)  # never contacted
    with pytest.raises(DnsPermanentError) as info:
        await resolver.resolve(domain)
    assert info.value.reply.code == 550


@pytest.mark.parametrize("domain", ["a..b", "", ".", "x" * 64 + ".test"])
async def test_invalid_domain_name_is_permanent(domain: str) -> None:
    resolver = Resolver(nameservers=["127.0.0.1:9"], timeout=0.1)  # never contacted
    with pytest.raises(DnsPermanentError) as info:
        await resolver.resolve(domain)
    assert (info.value.reply.code, info.value.reply.enhanced) == (550, "5.1.2")


# -- pure decisions -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([], []),
        ([(10, "a.test.")], [(10, "a.test.")]),
        ([(20, "b.test."), (10, "a.test.")], [(10, "a.test."), (20, "b.test.")]),
        ([(0, "z.test."), (65535, "a.test.")], [(0, "z.test."), (65535, "a.test.")]),
        # a host listed twice keeps its lowest preference
        ([(20, "a.test."), (10, "A.test")], [(10, "A.test")]),
        # root exchanges name no host
        ([(0, "."), (10, "a.test.")], [(10, "a.test.")]),
    ],
)
def test_order_mx_table(records: list[tuple[int, str]], expected: list[tuple[int, str]]) -> None:
    assert order_mx(records, random.Random(1)) == expected


def test_order_mx_shuffles_only_within_a_preference() -> None:
    records = [(10, f"h{i}.test.") for i in range(5)] + [(5, "first.test."), (50, "last.test.")]
    seen = set()
    for seed in range(20):
        result = order_mx(records, random.Random(seed))
        assert result[0] == (5, "first.test.")
        assert result[-1] == (50, "last.test.")
        assert sorted(result[1:-1]) == sorted(records[:5])
        assert result == order_mx(records, random.Random(seed))
        # independent of the order the DNS answer listed the records in
        assert result == order_mx(list(reversed(records)), random.Random(seed))
        seen.add(tuple(result))
    assert len(seen) > 1


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([(0, ".")], True),
        ([(0, "")], True),
        ([], False),
        ([(10, ".")], False),
        ([(0, "mx.test.")], False),
        ([(0, "."), (10, "mx.test.")], False),  # not a valid null MX (RFC 7505 §3)
        ([(0, "."), (0, ".")], False),
    ],
)
def test_is_null_mx_table(records: list[tuple[int, str]], expected: bool) -> None:
    assert is_null_mx(records) is expected


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("[::1]:53", ("::1", 53)),
        ("[::1]", ("::1", 53)),
        ("::1", ("::1", 53)),
        (" 127.0.0.2:1 ", ("127.0.0.2", 1)),
    ],
)
def test_parse_nameserver(spec: str, expected: tuple[str, int]) -> None:
    assert parse_nameserver(spec) == expected


@pytest.mark.parametrize(
    "spec", ["", "localhost", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", "[::1", "[::1]x"]
)
def test_parse_nameserver_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_nameserver(spec)


def test_resolver_rejects_bad_nameservers() -> None:
    with pytest.raises(ValueError):
        Resolver(nameservers=[])
    with pytest.raises(TypeError):
        Resolver(nameservers="127.0.0.1")


@pytest.mark.parametrize(
    ("domain", "expected"),
    [
        ("example.test", None),
        ("[127.0.0.1]", "127.0.0.1"),
        ("[IPv6:::1]", "::1"),
        ("[ipv6:0:0:0:0:0:0:0:1]", "::1"),
    ],
)
def test_parse_domain_literal(domain: str, expected: str | None) -> None:
    assert parse_domain_literal(domain) == expected
