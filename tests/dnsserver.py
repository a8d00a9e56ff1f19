"""A small, real, authoritative DNS server for tests (loopback only).

The server answers over UDP and TCP on ``127.0.0.1`` at one ephemeral port (the
same port number for both transports, so a truncated UDP answer can be retried
over TCP as RFC 1035 §4.2.2 / RFC 7766 describe). It runs in a background
thread, so both in-process asyncio tests and a separately spawned daemon
subprocess can query it.

Zone data is a plain dict keyed by owner name (case-insensitive, with or without
the trailing dot)::

    zones = {
        "example.test": {"MX": [(10, "mx1.example.test"), (20, "mx2.example.test")]},
        "mx1.example.test": {"A": ["127.0.0.2"]},
        "mx2.example.test": {"A": ["127.0.0.1"], "AAAA": ["::1"]},
        "implicit.test": {"A": ["127.0.0.1"]},   # no MX -> implicit MX (RFC 5321 §5.1)
        "nullmx.test": {"MX": [(0, ".")]},       # RFC 7505
        "broken.test": "SERVFAIL",               # rcode to answer with
        "slow.test": "TIMEOUT",                  # never answers
    }

* A name that is not present gets NXDOMAIN.
* A present name without the asked type gets NOERROR with an empty answer (NODATA).
* A string value is either an rcode name (``"SERVFAIL"``, ``"REFUSED"``,
  ``"NXDOMAIN"``, ...) used for every query of that name, or ``"TIMEOUT"``: the
  query is dropped and never answered.
* A string in place of one type's record list applies to that type only:
  ``{"MX": [(10, "mx.a.test")], "AAAA": "TIMEOUT"}`` or ``{"A": "SERVFAIL"}``.
  An empty list means no records of that type (NODATA).
* Record values are presentation-format strings (``"127.0.0.1"``,
  ``"10 mx1.example.test"``) or tuples whose items are joined by spaces
  (``(10, "mx1.example.test")``). Names inside rdata are absolute (the trailing
  dot is optional). A ``CNAME`` is followed within the served data.

Usage::

    with DnsServer(zones) as server:
        resolver = Resolver(nameservers=[f"{server.address}:{server.port}"])

or, in pytest, import the fixture (it starts with :data:`EXAMPLE_ZONES` loaded)::

    from tests.dnsserver import dns_server  # noqa: F401

    async def test_x(dns_server: DnsServer) -> None:
        dns_server.set_zone("other.test", {"MX": [(5, "mx.other.test")]})

A daemon subprocess is pointed at it with the config key
``upstream.mx.nameservers: ["127.0.0.1:<port>"]`` (see :attr:`DnsServer.nameserver`).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Self, TypeAlias

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest

RecordValue: TypeAlias = str | int | tuple[str | int, ...]
NameData: TypeAlias = Mapping[str, Sequence[RecordValue] | str] | str
Zones: TypeAlias = Mapping[str, NameData]

TIMEOUT = "TIMEOUT"
"""Zone value meaning: drop every query for this name (the client times out)."""

DEFAULT_TTL = 300
_MAX_CNAME_CHAIN = 8
_UDP_MAX_NO_EDNS = 512  # RFC 1035 §4.2.1
_TCP_MAX = 65535

EXAMPLE_ZONES: dict[str, NameData] = {
    "example.test": {"MX": [(10, "mx1.example.test"), (20, "mx2.example.test")]},
    "mx1.example.test": {"A": ["127.0.0.2"]},
    "mx2.example.test": {"A": ["127.0.0.1"], "AAAA": ["::1"]},
    "implicit.test": {"A": ["127.0.0.1"]},
    "nullmx.test": {"MX": [(0, ".")]},
    "broken.test": "SERVFAIL",
    "slow.test": TIMEOUT,
}
"""The zone data the :func:`dns_server` fixture starts with."""


def _key(name: str | dns.name.Name) -> str:
    text = name.to_text() if isinstance(name, dns.name.Name) else name
    return text.rstrip(".").lower()


def _rdata_text(value: RecordValue) -> str:
    if isinstance(value, tuple):
        return " ".join(str(item) for item in value)
    return str(value)


def _check_action(action: str) -> str:
    action = action.upper()
    if action != TIMEOUT:
        dns.rcode.from_text(action)  # validate early: raises on a typo
    return action


class _CompiledName:
    """One owner name's data, converted to dnspython objects once."""

    __slots__ = ("action", "cname", "rrsets", "type_actions")

    def __init__(self, owner: str, data: NameData) -> None:
        self.action: str | None = None  # rcode name or TIMEOUT
        self.rrsets: dict[dns.rdatatype.RdataType, dns.rrset.RRset] = {}
        self.cname: dns.rrset.RRset | None = None
        self.type_actions: dict[dns.rdatatype.RdataType, str] = {}
        if isinstance(data, str):
            self.action = _check_action(data)
            return
        name = dns.name.from_text(owner)
        for rdtype_text, values in data.items():
            rdtype = dns.rdatatype.RdataType.make(rdtype_text.upper())
            if isinstance(values, str):  # per-type rcode or TIMEOUT
                self.type_actions[rdtype] = _check_action(values)
                continue
            if not values:
                continue  # an empty list is the same as no records: NODATA
            rrset = dns.rrset.from_text_list(
                name,
                DEFAULT_TTL,
                dns.rdataclass.IN,
                rdtype,
                [_rdata_text(v) for v in values],
                origin=dns.name.root,
                relativize=False,
            )
            if rdtype == dns.rdatatype.CNAME:
                self.cname = rrset
            self.rrsets[rdtype] = rrset


class DnsServer:
    """Authoritative test DNS server on 127.0.0.1 (UDP + TCP), in a background thread."""

    address = "127.0.0.1"

    def __init__(self, zones: Zones | None = None) -> None:
        self._lock = threading.Lock()
        self._zones: dict[str, _CompiledName] = {}
        self._queries: list[tuple[str, str]] = []
        self._thread: threading.Thread | None = None
        self._udp: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stopping = threading.Event()
        self._port = 0
        self.errors: list[BaseException] = []
        """Exceptions raised while serving (a test may assert this stays empty)."""
        self.set_zones(zones or {})

    # -- zone data -------------------------------------------------------------

    def set_zone(self, name: str, data: NameData | None) -> None:
        """Replace (or, with ``None``, remove) the data of one owner name. Thread-safe."""
        key = _key(name)
        compiled = None if data is None else _CompiledName(key, data)
        with self._lock:
            if compiled is None:
                self._zones.pop(key, None)
            else:
                self._zones[key] = compiled

    def set_zones(self, zones: Zones) -> None:
        """Replace all zone data at once. Thread-safe."""
        compiled = {_key(name): _CompiledName(_key(name), data) for name, data in zones.items()}
        with self._lock:
            self._zones = compiled

    # -- statistics ------------------------------------------------------------

    @property
    def query_count(self) -> int:
        """Number of queries received (over UDP and TCP, answered or dropped)."""
        with self._lock:
            return len(self._queries)

    @property
    def queries(self) -> list[tuple[str, str]]:
        """Every query received so far as ``(name, type)``, e.g. ``("example.test", "MX")``."""
        with self._lock:
            return list(self._queries)

    def count(self, name: str, rdtype: str | None = None) -> int:
        """How many queries were received for *name* (and, if given, *rdtype*)."""
        key = _key(name)
        with self._lock:
            tally = Counter(self._queries)
        if rdtype is not None:
            return tally[(key, rdtype.upper())]
        return sum(n for (qname, _), n in tally.items() if qname == key)

    def reset_counters(self) -> None:
        with self._lock:
            self._queries.clear()

    # -- lifecycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("DnsServer is not started")
        return self._port

    @property
    def nameserver(self) -> str:
        """``"127.0.0.1:PORT"``, the form ``upstream.mx.nameservers`` and ``Resolver`` take."""
        return f"{self.address}:{self.port}"

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("DnsServer already started")
        self._udp, self._tcp = self._bind_pair()
        self._port = self._udp.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._serve, name=f"DnsServer:{self._port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        assert self._wake_w is not None
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        thread.join(timeout=10)
        if thread.is_alive():  # pragma: no cover - would be a bug in _serve
            raise RuntimeError("DnsServer thread did not stop")
        self._thread = None
        for sock in (self._udp, self._tcp, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._udp = self._tcp = self._wake_r = self._wake_w = None
        self._port = 0

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _bind_pair(self) -> tuple[socket.socket, socket.socket]:
        """Bind UDP and TCP sockets on the same ephemeral loopback port."""
        last_error: OSError | None = None
        for _ in range(50):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.bind((self.address, 0))
                port = udp.getsockname()[1]
                tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    tcp.bind((self.address, port))
                    tcp.listen(16)
                except OSError as exc:
                    tcp.close()
                    raise exc
            except OSError as exc:
                udp.close()
                last_error = exc
                continue
            udp.setblocking(False)
            tcp.setblocking(False)
            return udp, tcp
        raise RuntimeError("could not bind UDP and TCP on one port") from last_error

    # -- serving ---------------------------------------------------------------

    def _serve(self) -> None:
        assert self._udp is not None and self._tcp is not None and self._wake_r is not None
        buffers: dict[socket.socket, bytearray] = {}
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            sel.register(self._udp, selectors.EVENT_READ, "udp")
            sel.register(self._tcp, selectors.EVENT_READ, "listen")
            try:
                while not self._stopping.is_set():
                    for key, _ in sel.select(timeout=1.0):
                        try:
                            if key.data == "udp":
                                self._on_udp()
                            elif key.data == "listen":
                                self._on_accept(sel, buffers)
                            elif key.data == "tcp":
                                self._on_tcp(sel, buffers, key.fileobj)  # type: ignore[arg-type]
                        except Exception as exc:  # keep serving; let tests inspect it
                            self.errors.append(exc)
            finally:
                for conn in buffers:
                    conn.close()

    def _on_udp(self) -> None:
        assert self._udp is not None
        try:
            wire, peer = self._udp.recvfrom(_TCP_MAX)
        except (BlockingIOError, InterruptedError):
            return
        reply = self._handle(wire, tcp=False)
        if reply is not None:
            self._udp.sendto(reply, peer)

    def _on_accept(
        self, sel: selectors.BaseSelector, buffers: dict[socket.socket, bytearray]
    ) -> None:
        assert self._tcp is not None
        try:
            conn, _ = self._tcp.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        buffers[conn] = bytearray()
        sel.register(conn, selectors.EVENT_READ, "tcp")

    def _on_tcp(
        self,
        sel: selectors.BaseSelector,
        buffers: dict[socket.socket, bytearray],
        conn: socket.socket,
    ) -> None:
        try:
            chunk = conn.recv(_TCP_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            sel.unregister(conn)
            buffers.pop(conn, None)
            conn.close()
            return
        buf = buffers[conn]
        buf += chunk
        # RFC 1035 §4.2.2: each message is prefixed with a two byte length.
        while len(buf) >= 2:
            (length,) = struct.unpack("!H", buf[:2])
            if len(buf) < 2 + length:
                break
            wire = bytes(buf[2 : 2 + length])
            del buf[: 2 + length]
            reply = self._handle(wire, tcp=True)
            if reply is not None:
                conn.setblocking(True)
                conn.settimeout(5.0)
                try:
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
                finally:
                    conn.setblocking(False)

    def _handle(self, wire: bytes, *, tcp: bool) -> bytes | None:
        """Build the wire response to one query, or ``None`` to drop it."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None  # not worth a FORMERR for a test server
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        response.flags &= ~dns.flags.RA
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response.to_wire()
        question = query.question[0]
        qtype = dns.rdatatype.RdataType.make(question.rdtype)
        with self._lock:
            self._queries.append((_key(question.name), dns.rdatatype.to_text(qtype)))
            zones = self._zones
        drop = self._answer(zones, question.name, qtype, response)
        if drop:
            return None
        udp_max = query.payload if query.edns >= 0 else _UDP_MAX_NO_EDNS
        max_size = _TCP_MAX if tcp else udp_max
        # Sets TC when the answer does not fit, so the client retries over TCP.
        return response.to_wire(max_size=max_size, prefer_truncation=True)

    @staticmethod
    def _answer(
        zones: Mapping[str, _CompiledName],
        qname: dns.name.Name,
        qtype: dns.rdatatype.RdataType,
        response: dns.message.Message,
    ) -> bool:
        """Fill *response*; return True if the query must be dropped (TIMEOUT)."""
        name = qname
        for _ in range(_MAX_CNAME_CHAIN):
            entry = zones.get(_key(name))
            if entry is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
                return False
            action = entry.action or entry.type_actions.get(qtype)
            if action is not None:
                if action == TIMEOUT:
                    return True
                response.set_rcode(dns.rcode.from_text(action))
                return False
            rrset = entry.rrsets.get(qtype)
            if rrset is not None:
                response.answer.append(_copy_rrset(rrset, name))
                return False
            if entry.cname is None or qtype == dns.rdatatype.ANY:
                return False  # NODATA: NOERROR with an empty answer section
            response.answer.append(_copy_rrset(entry.cname, name))
            target = entry.cname[0].target
            assert isinstance(target, dns.name.Name)
            name = target
        response.set_rcode(dns.rcode.SERVFAIL)  # CNAME loop
        return False


def _copy_rrset(rrset: dns.rrset.RRset, name: dns.name.Name) -> dns.rrset.RRset:
    copy = dns.rrset.RRset(name, rrset.rdclass, rrset.rdtype)
    copy.update_ttl(rrset.ttl)
    for rdata in rrset:
        copy.add(rdata)
    return copy


def iter_started(zones: Zones | None = None) -> Iterator[DnsServer]:
    """Generator behind :func:`dns_server`; reusable for fixtures with other data/scopes."""
    server = DnsServer(EXAMPLE_ZONES if zones is None else zones)
    server.start()
    try:
        yield server
    finally:
        server.stop()
    if server.errors:
        raise AssertionError(f"DnsServer errors while serving: {server.errors!r}")


def dns_server_fixture(zones: Zones | None = None, **fixture_kwargs: object) -> object:
    """Make a pytest fixture yielding a started :class:`DnsServer` loaded with *zones*.

    ``my_dns = dns_server_fixture({"a.test": {"A": ["127.0.0.1"]}}, scope="module")``
    """

    def _fixture() -> Iterator[DnsServer]:
        yield from iter_started(zones)

    return pytest.fixture(**fixture_kwargs)(_fixture)  # type: ignore[call-overload]


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    """A started :class:`DnsServer` preloaded with :data:`EXAMPLE_ZONES`; stopped afterwards."""
    yield from iter_started()


__all__ = [
    "EXAMPLE_ZONES",
    "TIMEOUT",
    "DnsServer",
    "NameData",
    "Zones",
    "dns_server",
    "dns_server_fixture",
    "iter_started",
]
