"""Exceptions of a delivery attempt -> (Verdict, Reply)."""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

import aiosmtplib
import pytest
import trustme
from aiosmtplib import (
    SMTPAuthenticationError,
    SMTPConnectError,
    SMTPConnectResponseError,
    SMTPConnectTimeoutError,
    SMTPDataError,
    SMTPException,
    SMTPHeloError,
    SMTPNotSupported,
    SMTPReadTimeoutError,
    SMTPRecipientRefused,
    SMTPRecipientsRefused,
    SMTPResponseException,
    SMTPSenderRefused,
    SMTPServerDisconnected,
    SMTPTimeoutError,
)

from relay.delivery.errors import (
    DnsPermanentError,
    DnsTransientError,
    classify_exception,
    classify_refused_recipients,
    is_after_dot,
    is_ambiguous,
    is_operator_fault,
)
from relay.delivery.replies import Outcome, Phase, Reply, Scope

_E = TypeVar("_E", bound=BaseException)

D, T, B, F = Outcome.DELIVERED, Outcome.TRANSIENT, Outcome.BOUNCE, Outcome.FAIL


def chained(exc: _E, cause: BaseException) -> _E:
    """``raise exc from cause`` without raising."""
    exc.__cause__ = cause
    return exc


def _pump(client: ssl.SSLObject, server: ssl.SSLObject, bios: list[ssl.MemoryBIO]) -> None:
    c_in, c_out, s_in, s_out = bios
    for _ in range(10):
        for obj, out, peer_in in ((client, c_out, s_in), (server, s_out, c_in)):
            with suppress(ssl.SSLWantReadError):
                obj.do_handshake()
            peer_in.write(out.read())


def real_cert_error() -> ssl.SSLCertVerificationError:
    """A genuine verification failure: in-memory handshake with an untrusted certificate."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("mx.example.org").configure_cert(server_ctx)
    bios = [ssl.MemoryBIO() for _ in range(4)]
    client = ssl.create_default_context().wrap_bio(
        bios[0], bios[1], server_hostname="mx.example.org"
    )
    server = server_ctx.wrap_bio(bios[2], bios[3], server_side=True)
    try:
        _pump(client, server, bios)
    except ssl.SSLCertVerificationError as exc:
        return exc
    raise AssertionError("handshake unexpectedly succeeded")


def real_tls_error() -> ssl.SSLError:
    """A genuine handshake failure: the "server" answers in plain SMTP."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="mx")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    incoming.write(b"220 mx.example.org ESMTP Postfix\r\n")
    try:
        client.do_handshake()
    except ssl.SSLError as exc:
        return exc
    raise AssertionError("handshake unexpectedly succeeded")


CERT_ERROR = real_cert_error()
TLS_ERROR = real_tls_error()


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    exc: BaseException
    phase: Phase
    outcome: Outcome
    reply: str  # expected "code enhanced" prefix of str(reply)
    scope: Scope = Scope.TRANSACTION
    closes: bool = True
    throttled: bool = False
    ambiguous: bool = False
    operator_fault: bool = False


REFUSED = chained(
    SMTPConnectError(
        "Error connecting to 127.0.0.1 on port 25: [Errno 111] Connect call failed "
        "('127.0.0.1', 25)"
    ),
    ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed ('127.0.0.1', 25)"),
)

CASES = [
    # --- transport -------------------------------------------------------------------------
    Case("connect-refused", REFUSED, Phase.CONNECT, T, "421 4.4.1"),
    Case(
        "connect-timeout",
        SMTPConnectTimeoutError("Timed out connecting to mx.example.org on port 25"),
        Phase.CONNECT,
        T,
        "421 4.4.1",
    ),
    Case(
        "greeting-timeout",
        SMTPConnectTimeoutError("Timed out waiting for server ready message"),
        Phase.GREETING,
        T,
        "421 4.4.1",
    ),
    Case(
        "closed-before-greeting",
        chained(
            SMTPConnectError("Error connecting to mx on port 25: Connection lost"),
            SMTPServerDisconnected("Connection lost"),
        ),
        Phase.CONNECT,
        T,
        "451 4.4.2",
    ),
    Case(
        "smarthost-name-unknown",
        chained(
            SMTPConnectError(
                "Error connecting to smtp.typo.example on port 587: [Errno -2] Name or "
                "service not known"
            ),
            socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        ),
        Phase.CONNECT,
        T,
        "451 4.4.3",
    ),
    Case(
        "network-unreachable",
        OSError(errno.ENETUNREACH, "Network is unreachable"),
        Phase.CONNECT,
        T,
        "421 4.4.1",
    ),
    Case("bare-refused", ConnectionRefusedError(), Phase.CONNECT, T, "421 4.4.1"),
    Case("bare-timeout-connect", TimeoutError(), Phase.CONNECT, T, "421 4.4.1"),
    Case("timeout-mail", TimeoutError(), Phase.MAIL, T, "451 4.4.2"),
    Case(
        "read-timeout-rcpt",
        SMTPReadTimeoutError("Timed out waiting for server response"),
        Phase.RCPT,
        T,
        "451 4.4.2",  # scope stays "transaction": the whole session is gone
    ),
    Case(
        "read-timeout-dot",
        SMTPReadTimeoutError("Timed out waiting for server response"),
        Phase.DOT,
        T,
        "451 4.4.2",
        ambiguous=True,
    ),
    Case(
        "disconnect-dot",
        SMTPServerDisconnected("Connection lost"),
        Phase.DOT,
        T,
        "451 4.4.2",
        ambiguous=True,
    ),
    Case("disconnect-data", SMTPServerDisconnected("Connection lost"), Phase.DATA, T, "451 4.4.2"),
    Case(
        "reset-dot",
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        Phase.DOT,
        T,
        "451 4.4.2",
        ambiguous=True,
    ),
    Case("broken-pipe", BrokenPipeError(errno.EPIPE, "Broken pipe"), Phase.DATA, T, "451 4.4.2"),
    Case(
        "starttls-upgrade-timeout",
        SMTPTimeoutError("Timed out while upgrading transport"),
        Phase.STARTTLS,
        T,
        "451 4.4.2",
    ),
    Case("starttls-bad-handshake", TLS_ERROR, Phase.STARTTLS, T, "454 4.7.5"),
    Case("tls-eof-at-dot", ssl.SSLEOFError(8, "EOF"), Phase.DOT, T, "454 4.7.5", ambiguous=True),
    Case(
        "starttls-cert-verify",
        CERT_ERROR,
        Phase.STARTTLS,
        T,
        "454 4.7.5",
        operator_fault=True,
    ),
    Case(
        "implicit-tls-cert-verify",
        chained(
            SMTPConnectError(f"Error connecting to smtp on port 465: {CERT_ERROR}"), CERT_ERROR
        ),
        Phase.CONNECT,
        T,
        "454 4.7.5",
        operator_fault=True,
    ),
    Case(
        "certificate-error-alias",
        ssl.CertificateError("hostname 'mx' doesn't match 'other'"),
        Phase.STARTTLS,
        T,
        "454 4.7.5",
        operator_fault=True,
    ),
    Case("cancelled-at-dot", asyncio.CancelledError(), Phase.DOT, T, "451 4.3.0", ambiguous=True),
    Case("our-bug", RuntimeError("boom"), Phase.RCPT, T, "451 4.3.0"),
    # --- server replies ----------------------------------------------------------------------
    Case(
        "auth-rejected",
        SMTPAuthenticationError(535, "5.7.8 Username and Password not accepted."),
        Phase.AUTH,
        T,
        "535 5.7.8",
        closes=False,
        operator_fault=True,
    ),
    Case(
        "auth-rejected-wrong-phase-given",
        SMTPAuthenticationError(535, "5.7.8 Authentication credentials invalid"),
        Phase.MAIL,
        T,
        "535 5.7.8",
        closes=False,
        operator_fault=True,
    ),
    Case(
        "auth-bad-cram-challenge",
        SMTPAuthenticationError(334, "Invalid CRAM-MD5 challenge from server: 'x'"),
        Phase.AUTH,
        T,
        "454 4.7.0",
        closes=False,
        operator_fault=True,
    ),
    Case(
        "auth-not-offered",
        SMTPException("The SMTP AUTH extension is not supported by this server."),
        Phase.AUTH,
        T,
        "451 4.3.0",
        operator_fault=True,
    ),
    Case(
        "starttls-not-offered",
        SMTPException("SMTP STARTTLS extension not supported by server."),
        Phase.STARTTLS,
        T,
        "451 4.3.0",
    ),
    Case(
        "greeting-blocked",
        SMTPConnectResponseError(554, "5.7.1 Service unavailable; client [203.0.113.5] blocked"),
        Phase.CONNECT,  # the exception type says GREETING
        F,
        "554 5.7.1",
    ),
    Case(
        "helo-rejected",
        SMTPHeloError(501, "5.5.2 Syntax: HELO hostname"),
        Phase.EHLO,
        F,
        "501 5.5.2",
        closes=False,
    ),
    Case(
        "sender-refused",
        SMTPSenderRefused(550, "5.1.0 <s@example.com>: Sender address rejected", "s@example.com"),
        Phase.RCPT,  # the exception type says MAIL: a sender problem bounces no recipient
        F,
        "550 5.1.0",
        closes=False,
    ),
    Case(
        "recipient-refused",
        SMTPRecipientRefused(550, "5.1.1 <r@example.org>: User unknown", "r@example.org"),
        Phase.RCPT,
        B,
        "550 5.1.1",
        scope=Scope.RECIPIENT,
        closes=False,
    ),
    Case(
        "data-spam",
        SMTPDataError(550, "5.7.1 Message rejected as spam"),
        Phase.DOT,
        F,
        "550 5.7.1",
        closes=False,
    ),
    Case(
        "data-recipient-not-found",
        SMTPDataError(550, "5.1.1 RESOLVER.ADR.RecipNotFound; not found"),
        Phase.DOT,
        B,
        "550 5.1.1",
        closes=False,
    ),
    Case(
        "data-size",
        SMTPDataError(552, "5.3.4 Message size exceeds fixed limit"),
        Phase.DOT,
        F,
        "552 5.3.4",
        closes=False,
    ),
    Case(
        "data-250-instead-of-354",
        SMTPDataError(250, "2.0.0 Ok"),
        Phase.DATA,
        T,
        "451 4.5.0",
    ),
    Case(
        "throttled-at-mail",
        SMTPResponseException(421, "4.7.0 [TS01] Messages temporarily deferred"),
        Phase.MAIL,
        T,
        "421 4.7.0",
        throttled=True,
    ),
    Case(
        "malformed-reply",
        SMTPResponseException(-1, "Malformed SMTP response line: HTTP/1.1 400 Bad Request"),
        Phase.GREETING,
        T,
        "451 4.5.0",
    ),
    Case(
        "too-long-reply",
        SMTPResponseException(-1, "Response too long"),
        Phase.DOT,
        T,
        "451 4.5.0",
    ),
    Case(
        "smtputf8-missing",
        SMTPNotSupported("SMTPUTF8 is not supported by this server"),
        Phase.MAIL,
        F,
        "554 5.6.7",
        closes=False,
    ),
    # --- bad input (aiosmtplib raises ValueError before sending) ------------------------------
    Case(
        "control-char-in-recipient",
        ValueError("Command arg contains a prohibited control character"),
        Phase.RCPT,
        B,
        "553 5.1.3",
        scope=Scope.RECIPIENT,
        closes=False,
    ),
    Case(
        "control-char-in-sender",
        ValueError("Command arg contains a prohibited control character"),
        Phase.MAIL,
        F,
        "553 5.1.7",
        closes=False,
    ),
    Case(
        "non-ascii-recipient",
        UnicodeEncodeError("ascii", "j\u00f6rg@example.org", 1, 2, "ordinal not in range(128)"),
        Phase.RCPT,
        F,
        "553 5.6.7",
        scope=Scope.RECIPIENT,
        closes=False,
    ),
    Case("bad-content", ValueError("No From header"), Phase.DOT, F, "554 5.6.0", closes=False),
    Case(
        "bad-settings",
        ValueError("The local_hostname param must not be empty"),
        Phase.EHLO,
        T,
        "451 4.3.5",
    ),
    # --- DNS (raised by the MX resolver) -----------------------------------------------------
    Case(
        "nxdomain",
        DnsPermanentError(Reply(550, "5.1.2", "domain nowhere.test does not exist (NXDOMAIN)")),
        Phase.CONNECT,
        B,
        "550 5.1.2",
    ),
    Case(
        "null-mx",
        DnsPermanentError(
            Reply(556, "5.1.10", "nullmx.test does not accept mail (null MX, RFC 7505)")
        ),
        Phase.CONNECT,
        B,
        "556 5.1.10",
    ),
    Case(
        "no-mx-address",
        DnsPermanentError(Reply(550, "5.4.4", "no MX host of x.test has an address record")),
        Phase.CONNECT,
        B,
        "550 5.4.4",
    ),
    Case(
        "servfail",
        DnsTransientError(Reply(451, "4.4.3", "DNS lookup for broken.test failed: SERVFAIL")),
        Phase.CONNECT,
        T,
        "451 4.4.3",
    ),
]


def test_table_ids_unique() -> None:
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_classify_exception(case: Case) -> None:
    verdict, reply = classify_exception(case.exc, case.phase)
    assert (verdict.outcome, str(reply).startswith(case.reply + " ")) == (case.outcome, True), str(
        reply
    )
    assert verdict.scope is case.scope
    assert verdict.closes_connection is case.closes
    assert verdict.throttled is case.throttled
    assert is_ambiguous(case.exc, case.phase) is case.ambiguous
    assert is_operator_fault(case.exc) is case.operator_fault
    # The reply survives the spool's text form.
    assert Reply.from_str(str(reply)) == reply


def test_synthetic_texts() -> None:
    assert classify_exception(REFUSED, Phase.CONNECT, peer="127.0.0.1:25")[1] == Reply(
        421, "4.4.1", "connection refused by 127.0.0.1:25"
    )
    lost = classify_exception(SMTPServerDisconnected("Connection lost"), Phase.DATA)[1]
    assert str(lost) == "451 4.4.2 connection lost during DATA"
    timeout = classify_exception(SMTPReadTimeoutError("Timed out"), Phase.DOT)[1]
    assert str(timeout) == "451 4.4.2 timeout waiting for reply to final dot"
    cert = classify_exception(CERT_ERROR, Phase.STARTTLS, peer="smtp.example.net:587")[1]
    assert str(cert) == (
        "454 4.7.5 TLS certificate verification failed smtp.example.net:587: "
        "unable to get local issuer certificate"
    )
    tls = classify_exception(TLS_ERROR, Phase.STARTTLS)[1]
    assert tls.text.startswith("TLS handshake failed: [SSL: ")
    long = classify_exception(RuntimeError("x" * 1000), Phase.MAIL)[1]
    assert len(long.text) < 250 and long.text.endswith("...")


def test_server_reply_is_kept_verbatim() -> None:
    exc = SMTPRecipientRefused(
        550,
        "5.1.1 The email account that you tried to reach does not exist. Please try\n"
        "5.1.1 double-checking the recipient's email address",
        "nobody@gmail.com",
    )
    assert classify_exception(exc, Phase.RCPT)[1] == Reply(
        550,
        "5.1.1",
        "The email account that you tried to reach does not exist. Please try"
        " / double-checking the recipient's email address",
    )


def refused(code: int, message: str, recipient: str) -> SMTPRecipientRefused:
    return SMTPRecipientRefused(code, message, recipient)


@pytest.mark.parametrize(
    ("refusals", "outcome", "reply"),
    [
        ([refused(550, "5.1.1 User unknown", "a@x.test")], B, "550 5.1.1 User unknown"),
        (
            [
                refused(550, "5.1.1 User unknown", "a@x.test"),
                refused(452, "4.2.2 Mailbox over quota", "b@x.test"),
                refused(554, "5.7.1 Relay access denied", "c@x.test"),
            ],
            T,  # least final wins: no recipient is bounced for another one's reply
            "452 4.2.2 Mailbox over quota",
        ),
        (
            [
                refused(550, "5.1.1 User unknown", "a@x.test"),
                refused(554, "5.7.1 Relay access denied", "c@x.test"),
            ],
            F,
            "554 5.7.1 Relay access denied",
        ),
        (
            [
                refused(550, "5.1.1 first", "a@x.test"),
                refused(550, "5.1.1 second", "b@x.test"),
            ],
            B,
            "550 5.1.1 first",
        ),
        ([], T, "451 4.3.0 no recipients to deliver to"),  # aiosmtplib, given no recipients
    ],
)
def test_recipients_refused(
    refusals: list[SMTPRecipientRefused], outcome: Outcome, reply: str
) -> None:
    exc = SMTPRecipientsRefused(refusals)
    assert not hasattr(exc, "code")
    verdict, got = classify_exception(exc, Phase.DOT)  # the phase given does not matter
    assert (verdict.outcome, str(got)) == (outcome, reply)
    if refusals:
        assert verdict.scope is Scope.RECIPIENT
    assert not is_ambiguous(exc, Phase.DOT)


def test_classify_refused_recipients_each() -> None:
    exc = SMTPRecipientsRefused(
        [
            refused(550, "5.1.1 User unknown", "a@x.test"),
            refused(450, "4.2.0 Greylisted", "b@x.test"),
        ]
    )
    each = classify_refused_recipients(exc)
    assert {rcpt: (v.outcome, v.scope, str(r)) for rcpt, (v, r) in each.items()} == {
        "a@x.test": (B, Scope.RECIPIENT, "550 5.1.1 User unknown"),
        "b@x.test": (T, Scope.RECIPIENT, "450 4.2.0 Greylisted"),
    }


def test_dns_errors_need_the_right_reply_class() -> None:
    with pytest.raises(ValueError):
        DnsPermanentError(Reply(451, "4.4.3", "DNS lookup failed"))
    with pytest.raises(ValueError):
        DnsTransientError(Reply(550, "5.1.2", "domain does not exist"))
    exc = DnsTransientError(Reply(451, "4.4.3", "DNS lookup failed"))
    assert exc.reply.code == 451
    assert str(exc) == "451 4.4.3 DNS lookup failed"


def test_is_after_dot() -> None:
    assert [phase for phase in Phase if is_after_dot(phase)] == [Phase.DOT]


def test_server_replies_are_never_ambiguous() -> None:
    assert not is_ambiguous(SMTPDataError(451, "4.3.0 queue write error"), Phase.DOT)
    assert not is_ambiguous(DnsTransientError(Reply(451, "4.4.3", "x")), Phase.DOT)
    assert not is_ambiguous(ValueError("bad"), Phase.DOT)
    assert not is_ambiguous(SMTPServerDisconnected("Connection lost"), Phase.DATA)


def test_operator_fault_cert_only_on_verified_smarthost() -> None:
    assert is_operator_fault(CERT_ERROR)
    assert not is_operator_fault(CERT_ERROR, verified_smarthost=False)
    assert is_operator_fault(SMTPAuthenticationError(535, "5.7.8 bad"), verified_smarthost=False)
    assert not is_operator_fault(TLS_ERROR)
    assert not is_operator_fault(REFUSED)


# --- real aiosmtplib failures against tiny in-process servers -------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[int]:
    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(wrapped, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def smtp_until_dot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accept everything, then never answer the final dot."""
    writer.write(b"220 mx.test ESMTP\r\n")
    while line := await reader.readline():
        command = line[:4].upper()
        if command == b"EHLO":
            writer.write(b"250 mx.test\r\n")
        elif command == b"DATA":
            writer.write(b"354 go ahead\r\n")
            await writer.drain()
            while (await reader.readline()) not in (b".\r\n", b""):
                pass
            await asyncio.sleep(5)  # the client times out first
            return
        else:
            writer.write(b"250 2.0.0 ok\r\n")
        await writer.drain()


async def test_real_connection_refused() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=2, start_tls=False)
    with pytest.raises(SMTPException) as info:
        await client.connect()
    verdict, reply = classify_exception(info.value, Phase.CONNECT, peer=f"127.0.0.1:{port}")
    assert verdict.outcome is Outcome.TRANSIENT and verdict.closes_connection
    assert str(reply) == f"421 4.4.1 connection refused by 127.0.0.1:{port}"


async def test_real_close_before_greeting() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return

    async with serve(hang_up) as port:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=2, start_tls=False)
        with pytest.raises(SMTPException) as info:
            await client.connect()
    verdict, reply = classify_exception(info.value, Phase.CONNECT)
    assert (verdict.outcome, str(reply)) == (T, "451 4.4.2 connection lost before greeting")


async def test_real_garbage_greeting() -> None:
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serve(http) as port:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=2, start_tls=False)
        with pytest.raises(SMTPException) as info:
            await client.connect()
        client.close()
    verdict, reply = classify_exception(info.value, Phase.GREETING)
    assert (verdict.outcome, verdict.closes_connection) == (T, True)
    assert (reply.code, reply.enhanced) == (451, "4.5.0")


async def test_real_timeout_after_dot_is_ambiguous() -> None:
    async with serve(smtp_until_dot) as port:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=0.3, start_tls=False)
        await client.connect()
        await client.mail("s@example.com")
        await client.rcpt("r@example.org")
        with pytest.raises(SMTPException) as info:
            await client.data(b"Subject: hi\r\n\r\nbody\r\n")
        client.close()
    assert is_ambiguous(info.value, Phase.DOT)
    verdict, reply = classify_exception(info.value, Phase.DOT)
    assert verdict.outcome is Outcome.TRANSIENT
    assert str(reply) == "451 4.4.2 timeout waiting for reply to final dot"


async def test_real_recipients_refused() -> None:
    async def refuse_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 mx.test ESMTP\r\n")
        while line := await reader.readline():
            command = line[:4].upper()
            if command == b"RCPT":
                writer.write(b"550-5.1.1 no such user\r\n550 5.1.1 try again never\r\n")
            elif command == b"QUIT":
                writer.write(b"221 bye\r\n")
            else:
                writer.write(b"250 ok\r\n")
            await writer.drain()

    async with serve(refuse_all) as port:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=2, start_tls=False)
        await client.connect()
        with pytest.raises(SMTPRecipientsRefused) as info:
            await client.sendmail("s@example.com", ["a@x.test", "b@x.test"], b"x\r\n")
        await client.quit()
    verdict, reply = classify_exception(info.value, Phase.RCPT)
    assert (verdict.outcome, verdict.scope) == (B, Scope.RECIPIENT)
    assert str(reply) == "550 5.1.1 no such user / try again never"
    assert set(classify_refused_recipients(info.value)) == {"a@x.test", "b@x.test"}
