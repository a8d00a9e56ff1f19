"""Our SMTP server's protocol, sans I/O (in the manner of h11): bytes in, events out; our
decisions in, reply bytes out. No sockets, no asyncio, no clock.

    core = ServerCore(settings)
    out = core.greeting()                 # b"220 ..."
    core.receive_data(bytes_from_socket)  # b"" at EOF
    ev = core.next_event()                # an Event, NEED_DATA or PAUSED
    core.reply("250 2.1.0 OK")            # the answer to an event that asks for one
    sock.write(core.data_to_send())       # every reply made so far, in order, in one write

Rules (RFC 5321 unless said otherwise):
- One state, one table (`TRANSITIONS` below). COMMAND reads command lines; DATA feeds the
  message to relay/inbound/dataflow.py's DataParser; AUTH reads one answer to a `334` challenge;
  DECIDE waits for `reply()` (or `reply_lines()`, `auth_challenge()`), the answer to an event
  whose `needs_reply` is true: nothing more is read meanwhile, so the replies to a pipelined
  group (RFC 2920 §3.1) come out in command order and the transport sends them in one write.
  TLS waits for `tls_started()` after our `220` to STARTTLS; CLOSED reads nothing ever again.
- Lines end in CRLF (§2.3.8). A command or AUTH line with a bare CR or LF is never acted on:
  `500 5.5.2` and CLOSED, so nothing pipelined after it is acted on either (the answer to
  SMTP smuggling, as Postfix's smtpd_forbid_bare_newline). In DATA only <CRLF>.<CRLF> ends
  the data (the parser's rule).
- A command line longer than `max_command` octets (without its CRLF; MAIL gets 26 more for
  SIZE=, RFC 1870 §3, and 10 more for SMTPUTF8, RFC 6531 §3.4, once EHLO offered them) is
  answered `500 5.5.2 Command line too long` and the session goes on. A line longer than
  `max_line` is not even kept: its octets are dropped up to its LF, so memory stays bounded.
- Every reply line we make goes through `with_enhanced` (RFC 2034 codes on texts that lack
  one) and through the error count (relay/inbound/session_limits.py): the `max_errors`-th error
  reply
  is followed by `421 4.7.0 ... too many errors` and CLOSED. Any `421` closes (§3.8), and so
  does `221` (QUIT). The fifth unknown command gets `502 5.5.1` and CLOSED (aiosmtpd's
  budget, kept).
- STARTTLS (RFC 3207): octets the client sent after the STARTTLS line, before the handshake,
  are dropped (§5, the command injection of CVE-2011-0411); after it the session starts
  over (§4.2): EHLO again, no transaction, not authenticated.
- `require_tls` (RFC 3207 §4): before TLS only NOOP, EHLO, STARTTLS and QUIT; the rest get
  `530 5.7.0`.
- Paths are parsed by relay/mail/address.py (§4.1.2, linear time): a bad one is `501 5.1.7` (MAIL)
  or `501 5.1.3` (RCPT). A bare local part is qualified with `local_domain` when the client
  may relay (`bare_ok`, or authenticated).
- The replies copy aiosmtpd 1.4's wording, which the tests and clients know; the deliberate
  differences are listed in tests/inbound/test_differential.py.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from relay.inbound.dataflow import DataParser, DataState
from relay.inbound.session_limits import counts_as_error, resets_errors
from relay.mail import address as address_

# --- enhanced status codes -----------------------------------------------------------------

# RFC 3463 codes (advertised per RFC 2034) for replies whose text carries none.
_ENHANCED_BY_CODE = {
    "221": "2.0.0",
    "250": "2.0.0",
    "251": "2.1.5",
    "252": "2.0.0",
    "421": "4.3.2",
    "450": "4.2.0",
    "451": "4.3.0",
    "452": "4.3.1",
    "454": "4.7.0",
    "500": "5.5.2",
    "501": "5.5.4",
    "502": "5.5.1",
    "503": "5.5.1",
    "504": "5.5.4",
    "530": "5.7.0",
    "550": "5.0.0",
    "552": "5.3.4",
    "553": "5.1.3",
    "554": "5.0.0",
    "555": "5.5.4",
}
_HAS_ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3}\b")


def with_enhanced(status: str) -> str:
    """`503 Error: need MAIL command` -> `503 5.5.1 need MAIL command`."""
    if status == "250 HELP":  # last line of the EHLO reply: no status code (RFC 2034 §3)
        return status
    if len(status) < 4 or status[3] != " " or _HAS_ENHANCED.match(status):
        return status
    code = status[:3]
    enh = _ENHANCED_BY_CODE.get(code)
    if enh is None:
        return status
    text = status[4:]
    if text.startswith("Error: "):
        text = text[7:]
    return f"{code} {enh} {text}"


# what _say makes of a reply line: the line as sent, its bytes, and what it does to the
# session (closes it, resets the error count, counts as an error, nothing), cached: most
# replies are the same few lines (EHLO's, 250 OK, 354, 221) in every session
_PLAIN, _CLOSES, _RESETS, _ERROR = "plain", "closes", "resets", "error"
_SAID: dict[str, tuple[str, bytes, str]] = {}
_SAID_MAX = 512  # lines; a client's own words in a reply (500 "FOO" not recognized) vary


def _said(status: str) -> tuple[str, bytes, str]:
    line = with_enhanced(status)
    if line.startswith("552 5.3.4 Too much mail data"):
        line = "552 5.3.4 Message size exceeds fixed maximum message size"
    if line.startswith("421"):
        kind = _CLOSES
    elif resets_errors(line):
        kind = _RESETS
    elif counts_as_error(line):
        kind = _ERROR
    else:
        kind = _PLAIN
    said = (line, line.encode("utf-8", "surrogateescape") + b"\r\n", kind)
    if kind is not _RESETS:  # "250 2.0.0 Ok: queued as <queue id>": never the same twice
        if len(_SAID) >= _SAID_MAX:
            _SAID.clear()
        _SAID[status] = said
    return said


# (id(settings), TLS on) -> (those settings, the EHLO reply's lines): `_ehlo_lines`
_EHLO_LINES: dict[tuple[int, bool], tuple[Settings, tuple[str, ...]]] = {}

BARE_NEWLINE_REPLY = b"500 5.5.2 Syntax error: bare CR or LF in command line (RFC 5321 2.3.8)\r\n"
TOO_MANY_ERRORS = "421 4.7.0 {host} too many errors, closing connection"
BOGUS_LIMIT = 5  # unknown commands in a session; the fifth closes (aiosmtpd's BOGUS_LIMIT)
ALLOWED_BEFORE_STARTTLS = frozenset({"NOOP", "EHLO", "STARTTLS", "QUIT"})
AUTH_MECHANISMS = (
    "LOGIN",
    "PLAIN",
)  # RFC 4954 with RFC 4616 PLAIN (relay/inbound/auth_mechanisms.py)
# the commands HELP lists (aiosmtpd's: those with a syntax line), with their syntax
_SYNTAX = {
    "AUTH": ("AUTH <mechanism>", ""),
    "DATA": ("DATA", ""),
    "EHLO": ("EHLO hostname", ""),
    "HELO": ("HELO hostname", ""),
    "HELP": ("HELP [command]", ""),
    "MAIL": ("MAIL FROM: <address>", " [SP <mail-parameters>]"),
    "NOOP": ("NOOP [ignored]", ""),
    "QUIT": ("QUIT", ""),
    "RCPT": ("RCPT TO: <address>", " [SP <mail-parameters>]"),
    "RSET": ("RSET", ""),
    "STARTTLS": ("STARTTLS", ""),
    "VRFY": ("VRFY <address>", ""),
}
_KNOWN = frozenset(_SYNTAX) | {"EXPN"}


# The reply to a DATA the parser found over a limit (relay/inbound/dataflow.py's DataState): one row
# per state; a state without a row is a size limit (552).
DATA_REFUSALS: dict[DataState, str] = {
    DataState.TOO_MUCH: "552 5.3.4 Message size exceeds fixed maximum message size",  # §4.5.3.1.7
    DataState.TOO_LONG: "500 5.5.2 Line too long (see RFC 5321 4.5.3.1.6)",  # §4.5.3.1.6
    # limits.max_header_size: every later step (feedback, unsubscribe, dedup, DKIM) parses
    # the header block; §4.5.3.1.7's 552 and RFC 3463's X.3.4
    DataState.HEADER_TOO_BIG: "552 5.3.4 Message header too large",
}
# The stats/metrics label of a refusal counted as a rejection (relay_rejected_total); the
# size and line limits were never counted there (aiosmtpd's RelaySMTP did not either).
DATA_REFUSAL_REASONS: dict[DataState, str] = {
    DataState.HEADER_TOO_BIG: "header_too_large",
}
# RFC 6531 §3.4: a non-ASCII address in a transaction whose MAIL had no SMTPUTF8 (X.6.7 of
# the enhanced status code registry, "Non-ASCII addresses not permitted")
NON_ASCII = "553 5.6.7 Non-ASCII {role} address needs the SMTPUTF8 parameter on MAIL"


# --- settings and events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """One listener's protocol settings, fixed for a connection."""

    hostname: str
    ident: str = "relay ESMTP"
    max_size: int = 0  # SIZE (RFC 1870); 0: no limit
    max_command: int = 512  # octets of a command line without its CRLF
    max_line: int = 65537  # octets of a DATA line with its CRLF and a transparency dot
    max_header: int = 0  # octets of a message's header block (limits.max_header_size); 0: none
    max_errors: int = 10  # 0: no limit
    starttls: bool = False  # STARTTLS offered (a plaintext listener with `tls`)
    require_tls: bool = False  # RFC 3207 §4: 530 before STARTTLS
    implicit_tls: bool = False  # RFC 8314 §3: TLS from the first byte
    auth_offered: bool = False  # the listener has `auth`
    auth_plaintext: bool = False  # AUTH before TLS (`auth` with `allow_plaintext`)
    bare_ok: bool = False  # the client may relay: a bare local part is qualified
    local_domain: str = "localhost"


class State(Enum):
    COMMAND = "command"  # reading a command line
    DECIDE = "decide"  # an event waits for our reply
    DATA = "data"  # reading message data after our 354
    AUTH = "auth"  # reading the answer to a 334 challenge
    TLS = "tls"  # our 220 to STARTTLS is out; the handshake is the transport's
    CLOSED = "closed"  # a 221 or 421 is out: nothing is read any more

    # Enum's own __hash__ is a Python function (hash of the name), run for every lookup in
    # TRANSITIONS; a member is its only instance and compares by identity, so object's
    # identity hash (a C slot) says the same
    __hash__ = object.__hash__


# The one transition table: (state, what happens) -> next state. `_go` refuses the rest.
TRANSITIONS: dict[tuple[State, str], State] = {
    (State.COMMAND, "decision_needed"): State.DECIDE,
    (State.COMMAND, "data"): State.DATA,  # DATA accepted: 354 sent
    (State.COMMAND, "starttls"): State.TLS,  # 220 sent
    (State.COMMAND, "close"): State.CLOSED,
    (State.DECIDE, "reply"): State.COMMAND,
    (State.DECIDE, "challenge"): State.AUTH,  # 334 sent
    (State.DECIDE, "close"): State.CLOSED,
    (State.AUTH, "answer"): State.DECIDE,  # the AUTH mechanism decides what follows
    (State.AUTH, "close"): State.CLOSED,
    (State.DATA, "end"): State.DECIDE,  # <CRLF>.<CRLF>: the accept step decides
    (State.DATA, "end_refused"): State.COMMAND,  # over a limit: we answered
    (State.DATA, "close"): State.CLOSED,
    (State.TLS, "tls_started"): State.COMMAND,
    (State.TLS, "close"): State.CLOSED,
    (State.CLOSED, "close"): State.CLOSED,
}


class ProtocolStateError(RuntimeError):
    """The caller did something the state table does not allow (our bug, not the client's)."""


class Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA = Sentinel("NEED_DATA")  # nothing complete in the buffer
PAUSED = Sentinel("PAUSED")  # waiting for a reply, for TLS, or closed


@dataclass(frozen=True, slots=True)
class Event:
    needs_reply = False


@dataclass(frozen=True, slots=True)
class Ehlo(Event):
    """Answer with `reply_lines(lines)`: `responses` are the lines as aiosmtpd offered them
    (InboundHandler.handle_EHLO appends PIPELINING and ENHANCEDSTATUSCODES)."""

    hostname: str
    responses: tuple[str, ...]
    needs_reply = True


@dataclass(frozen=True, slots=True)
class Helo(Event):
    hostname: str  # answered `250`; a new session state (no transaction)


@dataclass(frozen=True, slots=True)
class Mail(Event):
    address: str  # "" for <>; as checked by relay/mail/address.py, bare local parts qualified
    options: tuple[str, ...]  # the parameter words, upper-cased (aiosmtpd's mail_options)
    smtputf8: bool
    needs_reply = True


@dataclass(frozen=True, slots=True)
class Rcpt(Event):
    address: str
    options: tuple[str, ...]
    needs_reply = True


@dataclass(frozen=True, slots=True)
class DataStart(Event):
    """Our 354 is out; DataChunk events follow, then DataEnd."""


@dataclass(frozen=True, slots=True)
class DataChunk(Event):
    data: bytes  # normalised message octets (relay/inbound/dataflow.py)


@dataclass(frozen=True, slots=True)
class DataEnd(Event):
    """<CRLF>.<CRLF>. With `refusal` set the core has answered it (552 / 500) and the
    transaction is over; otherwise the accept step answers with `reply()`."""

    refusal: str | None
    nuls: int
    longest: int  # the longest line of the normalised message, without its CRLF

    @property
    def needs_reply(self) -> bool:  # type: ignore[override]
        return self.refusal is None


@dataclass(frozen=True, slots=True)
class Rset(Event):
    pass


@dataclass(frozen=True, slots=True)
class Noop(Event):
    pass


@dataclass(frozen=True, slots=True)
class Vrfy(Event):
    arg: str


@dataclass(frozen=True, slots=True)
class Help(Event):
    arg: str


@dataclass(frozen=True, slots=True)
class Quit(Event):
    """Our 221 is out; the core is CLOSED."""


@dataclass(frozen=True, slots=True)
class StartTls(Event):
    """Our 220 is out: start TLS, then call `tls_started()` (or close on failure)."""


@dataclass(frozen=True, slots=True)
class Auth(Event):
    """AUTH <mechanism> [initial-response] (RFC 4954 §4). The mechanism asks with
    `auth_challenge()`, reads AuthAnswer events, and ends with `auth_done()`."""

    mechanism: str
    initial: str | None
    needs_reply = True


@dataclass(frozen=True, slots=True)
class AuthAnswer(Event):
    """The client's answer to a 334, base64-decoded; None when it cancelled (`*`), sent
    bad base64 or a line too long: the core has answered it, the exchange is over."""

    blob: bytes | None
    needs_reply = True


@dataclass(frozen=True, slots=True)
class Refused(Event):
    """The core refused something itself; `reason` is the stats/metrics label."""

    reason: str


@dataclass(frozen=True, slots=True)
class BareNewline(Event):
    """A command line with a bare CR or LF: answered `500 5.5.2` and CLOSED."""


@dataclass(frozen=True, slots=True)
class Closed(Event):
    """The core closed the session with its last reply (221, 421); `reason` for the logs:
    quit, max_errors, bogus, 421 (a 421 we were told to send, `reply`)."""

    reason: str
    reply: str = ""


# --- the core -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Txn:
    mail: bool = False
    rcpt: bool = False
    smtputf8: bool = False  # MAIL carried SMTPUTF8 (RFC 6531 §3.4)


@dataclass(slots=True)
class _Pending:
    """What the event waiting in DECIDE was (its reply updates the session)."""

    kind: str = ""
    smtputf8: bool = False  # of a MAIL waiting for its reply


class ServerCore:
    """One SMTP session, server side."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = State.COMMAND
        self.helo: str | None = None  # the EHLO/HELO name once given
        self.extended = False  # EHLO (not HELO)
        self.tls = settings.implicit_tls
        self.authenticated = False
        self.errors = 0
        self._bogus = BOGUS_LIMIT
        self._txn = _Txn()
        self._pending = _Pending()
        self._in = bytearray()
        self._out: list[bytes] = []
        self._skipping = False  # dropping the rest of an over-long line, up to its LF
        self._parser: DataParser | None = None
        self._events: list[Event] = []  # made by one step, handed out one at a time
        self._eof = False

    # --- the state table -----------------------------------------------------------------

    def _go(self, what: str) -> None:
        nxt = TRANSITIONS.get((self.state, what))
        if nxt is None:
            raise ProtocolStateError(f"{what} in state {self.state.name}")
        self.state = nxt

    # --- output --------------------------------------------------------------------------

    def greeting(self) -> bytes:
        s = self.settings
        return f"220 {s.hostname} {s.ident}\r\n".encode()

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def _say(self, status: str) -> None:
        """One reply line, with its enhanced code; counted (relay/inbound/session_limits.py)."""
        if self.state is State.CLOSED:
            return
        said = _SAID.get(status)
        if said is None:
            said = _said(status)
        status, line, kind = said
        self._out.append(line)
        if kind is _CLOSES:  # §3.8: a 421 closes the channel
            self._close("421", status)
            return
        if kind is _RESETS:
            self.errors = 0
        elif kind is _ERROR:
            self.errors += 1
            if self.settings.max_errors and self.errors >= self.settings.max_errors:
                self._out.append(TOO_MANY_ERRORS.format(host=self.settings.hostname).encode())
                self._out.append(b"\r\n")
                self._close("max_errors")

    def _close(self, reason: str, reply: str = "") -> None:
        if self.state is not State.CLOSED:
            self.state = State.CLOSED
            self._events.append(Closed(reason, reply))
        self._in.clear()

    def close(self) -> None:
        """The transport closed the session (a timeout, the connection lost)."""
        self.state = State.CLOSED
        self._in.clear()

    def send_final(self, status: str) -> None:
        """A reply the transport decided on its own (a timeout's 421): sent, then CLOSED."""
        if self.state is State.CLOSED:
            return
        self._out.append(status.encode() + b"\r\n")
        self.state = State.CLOSED
        self._in.clear()

    # --- our decisions in ------------------------------------------------------------------

    def reply(self, status: str) -> None:
        """The answer to the event waiting in DECIDE (one line, or several joined by CRLF
        for a multi-line reply)."""
        if self.state is not State.DECIDE:
            raise ProtocolStateError(f"reply in state {self.state.name}")
        kind = self._pending.kind
        ok = status[:1] == "2"
        if kind == "mail" and ok:
            self._txn.mail = True
            self._txn.smtputf8 = self._pending.smtputf8
        elif kind == "rcpt" and ok:
            self._txn.rcpt = True
        elif kind == "data":
            self._txn = _Txn()  # the transaction is over, whatever the answer (§4.1.1.4)
        elif kind == "auth" and ok:
            self.authenticated = True
        self._go("reply")
        for line in status.split("\r\n"):
            self._say(line)

    def reply_lines(self, lines: Sequence[str]) -> None:
        """A multi-line reply (EHLO's), sent as given, each line counted."""
        self.reply("\r\n".join(lines))

    def auth_challenge(self, challenge: bytes) -> None:
        """`334 <base64>` (RFC 4954 §4); the next line is the client's answer."""
        if self.state is not State.DECIDE or self._pending.kind != "auth":
            raise ProtocolStateError(f"auth_challenge in state {self.state.name}")
        self._out.append(b"334 " + base64.b64encode(challenge) + b"\r\n")
        self._go("challenge")

    def auth_done(self, success: bool, status: str | None) -> None:
        """The end of an AUTH exchange: `status` is sent unless None (already answered)."""
        if self.state is not State.DECIDE:
            raise ProtocolStateError(f"auth_done in state {self.state.name}")
        if success:
            self.authenticated = True
        self._go("reply")
        if status is not None:
            self._say(status)

    def tls_started(self) -> None:
        """The handshake is done: a new session over TLS (RFC 3207 §4.2)."""
        self._go("tls_started")
        self.tls = True
        self.helo = None
        self.extended = False
        self.authenticated = False
        self._txn = _Txn()
        self._in.clear()

    # --- bytes in, events out --------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        if self.state is State.CLOSED:
            return
        if self.state is State.TLS:
            return  # RFC 3207 §5: nothing sent before the handshake is acted on
        if self._skipping:
            i = data.find(b"\n")
            if i < 0:
                return
            self._skipping = False
            data = data[i + 1 :]
            self._too_long()
        self._in += data

    @property
    def eof(self) -> bool:
        return self._eof

    @property
    def buffered(self) -> bool:
        """Received octets not yet read into an event (a pipelined command behind the one
        waiting for its decision, say)."""
        return bool(self._in)

    def next_event(self) -> Event | Sentinel:
        """The next event; NEED_DATA when the buffer holds nothing complete, PAUSED while a
        reply, the TLS handshake or nothing (CLOSED) is awaited."""
        while True:
            if self._events:
                return self._events.pop(0)
            state = self.state
            if state is State.COMMAND or state is State.AUTH:
                line = self._line()
                if line is None:
                    if self._events:
                        continue
                    return NEED_DATA
                if state is State.COMMAND:
                    self._command(line)
                else:
                    self._auth_line(line)
            elif state is State.DATA:
                if not self._in:
                    return NEED_DATA
                self._data()
            else:
                return PAUSED

    def _line(self) -> bytes | None:
        """The next complete line (without its CRLF), or None: nothing complete, or a line
        refused here (too long: answered; bare CR or LF: answered and CLOSED)."""
        buf = self._in
        while not self._skipping:
            i = buf.find(b"\n")
            if i < 0:
                if len(buf) > self.settings.max_line:
                    # too long to keep: drop it up to its LF, then answer (receive_data)
                    buf.clear()
                    self._skipping = True
                return None
            if i > self.settings.max_line:
                del buf[: i + 1]
                self._too_long()
                if self.state is not State.COMMAND:
                    return None
                continue
            if not i or buf[i - 1] != 0x0D or b"\r" in buf[: i - 1]:
                self._bare_newline()
                return None
            line = bytes(buf[: i - 1])
            del buf[: i + 1]
            return line
        return None

    def _too_long(self) -> None:
        if self.state is State.AUTH:  # the answer to a 334: the exchange is over
            self._go("answer")
            self._say("500 5.5.6 Authentication exchange line is too long")
            self._answered()
        else:  # RFC 5321 §4.5.3.1.4
            self._say("500 Command line too long")

    def _bare_newline(self) -> None:
        # §2.3.8: never a line ending; not this line, nor any pipelined after it, is acted on
        self._out.append(BARE_NEWLINE_REPLY)
        self.state = State.CLOSED
        self._in.clear()
        self._events.append(BareNewline())

    # --- commands ------------------------------------------------------------------------

    def _command(self, line: bytes) -> None:
        if not line:
            self._say("500 Error: bad syntax")
            return
        verb_b, _, arg_b = line.partition(b" ")
        try:
            verb = verb_b.upper().decode("ascii")
        except UnicodeDecodeError:
            self._say("500 Error: bad syntax")
            return
        arg = arg_b.strip().decode("utf-8", "surrogateescape") if arg_b else ""
        s = self.settings
        limit = s.max_command + (36 if verb == "MAIL" and self.extended else 0)
        if len(line) > limit:
            self._say("500 Command line too long")
            return
        if s.require_tls and not self.tls and verb not in ALLOWED_BEFORE_STARTTLS:
            self._say("530 Must issue a STARTTLS command first")
            return
        if verb not in _KNOWN:
            self._bogus -= 1
            if self._bogus < 1:
                self._say("502 5.5.1 Too many unrecognized commands, goodbye.")
                self._close("bogus")
                return
            self._say(f'500 Error: command "{verb}" not recognized')
            return
        getattr(self, "_cmd_" + verb)(arg)

    def _need(self, kind: str, event: Event) -> None:
        self._pending.kind = kind
        self._go("decision_needed")
        self._events.append(event)

    def _new_session_state(self) -> None:
        self._txn = _Txn()

    def _cmd_HELO(self, arg: str) -> None:
        if not arg:
            self._say("501 Syntax: HELO hostname")
            return
        self._new_session_state()
        self.extended = False
        self.helo = arg
        self._events.append(Helo(arg))
        self._say(f"250 {self.settings.hostname}")

    def _cmd_EHLO(self, arg: str) -> None:
        if not arg:
            self._say("501 Syntax: EHLO hostname")
            return
        self._new_session_state()
        self.extended = True
        self.helo = arg
        self._need("ehlo", Ehlo(arg, self._ehlo_lines()))

    def _ehlo_lines(self) -> tuple[str, ...]:
        """Our EHLO reply's lines: the same for every session of a listener's settings
        with TLS on or off, so made once for each."""
        s = self.settings
        key = (id(s), self.tls)
        hit = _EHLO_LINES.get(key)
        if hit is not None and hit[0] is s:
            return hit[1]
        lines = [f"250-{s.hostname}"]
        if s.max_size:
            lines.append(f"250-SIZE {s.max_size}")
        lines.append("250-8BITMIME")
        lines.append("250-SMTPUTF8")
        if s.starttls and not self.tls:
            lines.append("250-STARTTLS")
        if self._auth_allowed_here():
            lines.append("250-AUTH " + " ".join(AUTH_MECHANISMS))
        lines.append("250 HELP")
        if len(_EHLO_LINES) >= 64:  # settings of old configs (a SIGHUP makes new ones)
            _EHLO_LINES.clear()
        _EHLO_LINES[key] = (s, tuple(lines))
        return _EHLO_LINES[key][1]

    def _auth_allowed_here(self) -> bool:
        """AUTH is listed (and taken) over TLS, or before it with `allow_plaintext`
        (RFC 4954 §4 leaves it to us; PLAIN in the clear is the risk). On a listener without
        `auth` the handler strips it from EHLO, and AUTH is answered 502 or 538."""
        s = self.settings
        return self.tls or s.auth_plaintext

    def _helo_needed(self, which: str = "HELO") -> bool:
        if self.helo is None:
            self._say(f"503 Error: send {which} first")
            return True
        return False

    def _cmd_NOOP(self, arg: str) -> None:
        self._events.append(Noop())
        self._say("250 OK")

    def _cmd_QUIT(self, arg: str) -> None:
        if arg:
            self._say("501 Syntax: QUIT")
            return
        self._events.append(Quit())
        self._say("221 Bye")
        self._close("quit")

    def _cmd_RSET(self, arg: str) -> None:
        if arg:
            self._say("501 Syntax: RSET")
            return
        self._txn = _Txn()
        self._events.append(Rset())
        self._say("250 OK")

    def _cmd_EXPN(self, arg: str) -> None:
        self._say("502 EXPN not implemented")

    def _cmd_HELP(self, arg: str) -> None:
        self._events.append(Help(arg))
        code = 250
        if arg:
            syntax = _SYNTAX.get(arg.upper())
            if syntax is not None and (arg.upper() != "STARTTLS" or self.settings.starttls):
                self._say("250 Syntax: " + syntax[0] + (syntax[1] if self.extended else ""))
                return
            code = 501
        names = sorted(n for n in _SYNTAX if n != "STARTTLS" or self.settings.starttls)
        self._say(f"{code} Supported commands: {' '.join(names)}")

    def _cmd_VRFY(self, arg: str) -> None:
        if not arg:
            self._say("501 Syntax: VRFY <address>")
            return
        self._events.append(Vrfy(arg))
        text = arg if arg.lstrip().startswith("<") else f"<{arg}>"
        try:
            address_.parse_path(text, null_ok=False, bare_ok=True)
        except address_.AddressError:
            self._say("502 Could not VRFY " + arg)
            return
        self._say("252 Cannot VRFY user, but will accept message and attempt delivery")

    def _cmd_STARTTLS(self, arg: str) -> None:
        if arg:
            self._say("501 Syntax: STARTTLS")
            return
        if not self.settings.starttls or self.tls:
            self._say("454 TLS not available")
            return
        self._out.append(b"220 Ready to start TLS\r\n")
        self._go("starttls")
        self._in.clear()  # RFC 3207 §5: what was pipelined after STARTTLS is dropped
        self._events.append(StartTls())

    def _cmd_AUTH(self, arg: str) -> None:
        s = self.settings
        if not s.auth_offered and (s.starttls or s.implicit_tls):
            # TLS without AUTH on this listener: not offered, even after STARTTLS
            self._say("502 5.5.1 AUTH not available on this listener")
            return
        if self._helo_needed("EHLO"):
            return
        if not self.extended:
            self._say("500 Error: command 'AUTH' not recognized")
            return
        if not self._auth_allowed_here():
            self._say("538 5.7.11 Encryption required for requested authentication mechanism")
            return
        if self.authenticated:
            self._say("503 Already authenticated")
            return
        if not arg:
            self._say("501 Not enough value")
            return
        args = arg.split()
        if len(args) > 2:
            self._say("501 Too many values")
            return
        if args[0] not in AUTH_MECHANISMS:
            self._say("504 5.5.4 Unrecognized authentication type")
            return
        self._need("auth", Auth(args[0], args[1] if len(args) == 2 else None))

    def _auth_line(self, line: bytes) -> None:
        blob = line.strip()
        self._go("answer")
        if blob == b"*":  # RFC 4954 §4: the client cancels the exchange
            self._say("501 5.7.0 Auth aborted")
            self._answered()
            return
        try:
            decoded = base64.b64decode(blob, validate=True)
        except binascii.Error:
            self._say("501 5.5.2 Can't decode base64")
            self._answered()
            return
        self._events.append(AuthAnswer(decoded))

    def _answered(self) -> None:
        """An exchange the core ended itself (already answered): AuthAnswer(None), unless
        that answer was the error that closed the session (max_errors): then Closed was the
        last event, and nothing is left to decide (auth_done is for an open session)."""
        if self.state is not State.CLOSED:
            self._events.append(AuthAnswer(None))

    # --- MAIL, RCPT, DATA ------------------------------------------------------------------

    def _path(
        self, arg: str, keyword: str, *, null_ok: bool, bad: str
    ) -> tuple[address_.Path, list[str], dict[str, str | bool]] | None:
        """`FROM:<path> params` / `TO:<path> params` (RFC 5321 §4.1.1.2, §4.1.2); None once
        the error reply is out."""
        syntaxerr = f"501 5.5.4 Syntax: {'MAIL FROM' if null_ok else 'RCPT TO'}:<address>" + (
            " [SP <mail-parameters>]" if self.extended else ""
        )
        if arg[: len(keyword)].upper() != keyword:
            self._say(syntaxerr)
            return None
        rest = arg[len(keyword) :]
        bare_ok = self.settings.bare_ok or self.authenticated
        try:
            path = address_.parse_path(rest, null_ok=null_ok, bare_ok=bare_ok)
        except address_.AddressError as e:
            self._events.append(Refused("bad_address"))
            self._say(f"{bad}: {e}")
            return None
        if path.address and "@" not in path.address.rpartition('"')[2]:
            # a bare local part (cron's `<root>`) from a client that may relay: qualified,
            # as Postfix's myorigin
            path = address_.Path(f"{path.address}@{self.settings.local_domain}", path.params)
        if null_ok and self._txn.mail:
            self._say("503 5.5.1 Error: nested MAIL command")
            return None
        options = path.params.upper().split()
        params = _getparams(options)
        if (path.params and not self.extended) or params is None:
            self._say(syntaxerr)
            return None
        return path, options, params

    def _cmd_MAIL(self, arg: str) -> None:
        if self._helo_needed():
            return
        got = self._path(arg, "FROM:", null_ok=True, bad="501 5.1.7 Bad sender address syntax")
        if got is None:
            return
        path, options, params = got
        body = params.pop("BODY", "7BIT")
        if body not in ("7BIT", "8BITMIME"):  # RFC 6152 §2
            self._say("501 5.5.4 BODY can only be one of 7BIT, 8BITMIME")
            return
        smtputf8 = params.pop("SMTPUTF8", False)
        if smtputf8 is not False and smtputf8 is not True:  # RFC 6531 §3.4: no value
            self._say("501 5.5.4 SMTPUTF8 takes no arguments")
            return
        if not smtputf8 and not path.address.isascii():  # RFC 6531 §3.4
            self._events.append(Refused("bad_address"))
            self._say(NON_ASCII.format(role="sender"))
            return
        size = params.pop("SIZE", None)
        if size is not None:  # RFC 1870 §6
            if isinstance(size, bool) or not size.isascii() or not size.isdigit():
                self._say("501 5.5.4 Syntax: MAIL FROM:<address> [SP <mail-parameters>]")
                return
            if self.settings.max_size and int(size) > self.settings.max_size:
                self._say("552 5.3.4 Message size exceeds fixed maximum message size")
                return
        if params:
            self._say("555 5.5.4 MAIL FROM parameters not recognized or not implemented")
            return
        self._pending.smtputf8 = bool(smtputf8)
        self._need("mail", Mail(path.address, tuple(options), bool(smtputf8)))

    def _cmd_RCPT(self, arg: str) -> None:
        if self._helo_needed():
            return
        if not self._txn.mail:
            self._say("503 5.5.1 Error: need MAIL command")
            return
        got = self._path(arg, "TO:", null_ok=False, bad="501 5.1.3 Bad recipient address syntax")
        if got is None:
            return
        path, options, params = got
        if params:
            self._say("555 5.5.4 RCPT TO parameters not recognized or not implemented")
            return
        if not self._txn.smtputf8 and not path.address.isascii():  # RFC 6531 §3.4
            self._events.append(Refused("bad_address"))
            self._say(NON_ASCII.format(role="recipient"))
            return
        self._need("rcpt", Rcpt(path.address, tuple(options)))

    def _cmd_DATA(self, arg: str) -> None:
        if self._helo_needed():
            return
        if not self._txn.rcpt:
            self._say("503 5.5.1 Error: need RCPT command")
            return
        if arg:
            self._say("501 Syntax: DATA")
            return
        self._say("354 End data with <CR><LF>.<CR><LF>")
        s = self.settings
        self._parser = DataParser(s.max_size, s.max_line, s.max_header)
        self._go("data")
        self._events.append(DataStart())

    def _data(self) -> None:
        parser = self._parser
        assert parser is not None
        if not self._in:
            return
        block = self._in  # handed over, not copied (the parser copies what it keeps)
        self._in = bytearray()
        out = parser.feed(block)
        if out.data:
            self._events.append(DataChunk(out.data))
        if not out.done:
            return
        self._in += out.rest  # pipelined commands after the final dot (RFC 2920)
        self._parser = None
        if parser.state is DataState.NOMINAL:
            self._pending.kind = "data"
            self._go("end")
            self._events.append(DataEnd(None, parser.nul_count, parser.longest))
            return
        self._txn = _Txn()
        self._go("end_refused")
        refusal = DATA_REFUSALS.get(parser.state, DATA_REFUSALS[DataState.TOO_MUCH])
        reason = DATA_REFUSAL_REASONS.get(parser.state)
        if reason is not None:
            self._events.append(Refused(reason))
        self._events.append(DataEnd(refusal, parser.nul_count, parser.longest))
        self._say(refusal)


def _getparams(params: Sequence[str]) -> dict[str, str | bool] | None:
    """ESMTP parameters (RFC 5321 §4.1.2 esmtp-param): KEYWORD[=value]; None when one is
    not that syntax."""
    result: dict[str, str | bool] = {}
    for param in params:
        key, eq, value = param.partition("=")
        if not key.isalnum() or (eq and not value):
            return None
        result[key] = value if eq else True
    return result


__all__ = [
    "NEED_DATA",
    "PAUSED",
    "TRANSITIONS",
    "Auth",
    "AuthAnswer",
    "BareNewline",
    "Closed",
    "DataChunk",
    "DataEnd",
    "DataStart",
    "Ehlo",
    "Event",
    "Helo",
    "Help",
    "Mail",
    "Noop",
    "ProtocolStateError",
    "Quit",
    "Rcpt",
    "Refused",
    "Rset",
    "Sentinel",
    "ServerCore",
    "Settings",
    "StartTls",
    "State",
    "Vrfy",
    "with_enhanced",
]
