"""`relay-sendmail`: a /usr/sbin/sendmail-compatible submission program.

Apps that pipe mail to sendmail (PHP `mail()`, cron, logwatch, ...) run this instead. It
reads the message on stdin and submits it over SMTP to the relay's first `listen` address,
found through the same config file as every other command (`-C FILE`, `-c FILE` or
`--config FILE`, else `$RELAY_CONFIG`, else `/etc/relay/relay.yaml`). When the daemon does
not answer (or answers 4xx), the message goes into the maildrop (relay/spool/maildrop.py), which
the daemon imports when it runs again: cron and PHP do not retry, so a 75 would lose it.

Only `listen`, `hostname`, `local.domain`, `spool.path` and `spool.maildrop` are read from
the config, with a plain YAML load: sendmail runs as whichever user the app runs as, and
must not need the secrets (password files) that the daemon reads, nor fail on a key it has
no use for.

Arguments are checked before anything else: a CR, LF or NUL in any of them (`-f`, `-F`, a
recipient) is refused with 64, so nothing an app passes on can become an SMTP command or a
header line. A recipient argument is one address or a comma-separated list of them
(Postfix's sendmail); `root` (no domain) gets `@<local.domain>`; anything else is refused
with 64 naming the argument, and nothing is sent.

Options (sendmail/Postfix compatible):
  -t          recipients from To/Cc/Bcc (Resent-To/Cc/Bcc when the message has Resent-*
              headers), added to those on the command line; Bcc/Resent-Bcc lines are removed
  -i, -oi     a line with a single "." does not end the input (without it, it does)
  -f ADDR     envelope sender (also -fADDR, -r ADDR; "<>" is the null sender; `root`
              becomes root@<local.domain>); default: the login user @ local.domain (else
              the configured hostname), the same name the headers get
  -F NAME     full name for the From: header added when the message has none (quoted or
              RFC 2047-encoded as a display name needs)
  -C FILE, -c FILE, --config FILE   the config file
  -bm         read the message on stdin and send it (the default)
  -bs         speak SMTP on stdin/stdout, relayed byte for byte to the relay
  -o*, -v, -m, -n, -U, -G, -Ax, -Bx, -dx, -ex, -hN, -Lx, -Nx, -Ox, -Rx, -Vx, -X FILE
              accepted and ignored (legacy and delivery-status options)
  --          end of options; everything after it is a recipient

Headers added when missing: From (the envelope sender, with -F's name) and Date. No
Message-ID is added: the relay derives one from the content, so a byte-identical
resubmission is recognised as a duplicate. A line ends at LF (or CRLF); every line ending
becomes CRLF before sending, and a leading mbox "From " line is dropped. A bare CR is not
a line end: in the header block it is refused (65: `Subject: x\rBcc: y` must never become
two header fields), in the body it is kept.

Exit status (sysexits.h):
  0   the relay answered 250 after DATA: the message is durably spooled
      (a relay that recognised a duplicate also answers 250); or the relay could not
      take it now (not running, 4xx) and the message is durably in the maildrop, for the
      daemon to import (said on stderr)
  64  EX_USAGE     bad options, a CR/LF/NUL in an argument, a recipient argument that is
                   not an address list, or no recipients at all
  65  EX_DATAERR   a 5xx reply to MAIL FROM or to the message itself (e.g. too big), a
                   bare CR in the header block, or (-t) an address field that cannot be
                   read with certainty
  67  EX_NOUSER    a 5xx reply to a recipient (unknown, malformed or suppressed). If some
                   recipients were accepted, the message is still sent to them, and the
                   refused ones are named on stderr
  69  EX_UNAVAILABLE  a 5xx greeting or EHLO/HELO reply: the relay will not talk to us
  75  EX_TEMPFAIL  the relay could not be reached, answered 4xx (to anything, including a
                   single recipient: then nothing is sent, so that a retry is complete),
                   dropped the connection or timed out, AND the maildrop could not take
                   the message either (missing, not writable by us, disk full). Try
                   again later.
  78  EX_CONFIG    the config file is missing or unreadable, or its listen address is bad
Every failure prints one line on stderr naming the relay address and its reply.
"""

from __future__ import annotations

import base64
import email.policy
import email.utils
import os
import pwd
import re
import select
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NoReturn

import yaml

from relay.config.tree import DEFAULT_PATH, DEFAULTS, ConfigError, parse_hostport
from relay.mail.address import AddressError, check_local_part, check_mailbox, printable
from relay.mail.message import qualify_headers
from relay.spool import maildrop
from relay.spool.submit import (  # the SMTP transaction, shared with the maildrop importer
    EX_DATAERR,
    EX_NOUSER,
    EX_TEMPFAIL,
    TIMEOUT,
    Failure,
    Target,
    submit,
)

EX_OK = 0
EX_USAGE = 64
EX_CONFIG = 78

PROG = "relay-sendmail"
BS_LINGER = 30.0  # -bs: seconds of silence from the relay, after stdin ended, before exiting

# Options that take a value (attached, `-Nnever`, or as the next argument, `-N never`);
# all ignored except the ones handled below.
_WITH_VALUE = frozenset("fFrABCcNRVLOXhde")
# Flags (no value) accepted and ignored.
_IGNORED_FLAGS = frozenset("vmnUG")

_HEADER_LINE = re.compile(rb"^[\x21-\x39\x3b-\x7e]+[ \t]*:")


class UsageError(Exception):
    pass


class DataError(Exception):
    """The message itself cannot be sent as it is (EX_DATAERR)."""


@dataclass
class Options:
    extract: bool = False  # -t
    ignore_dots: bool = False  # -i / -oi
    sender: str | None = None  # -f / -r
    full_name: str | None = None  # -F
    mode: str = "m"  # -b<mode>
    config: str | None = None
    recipients: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str]) -> Options:
    opts = Options()
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if a == "--":
            opts.recipients.extend(args[i:])
            break
        if a.startswith("--config"):
            if a.startswith("--config="):
                opts.config = a.split("=", 1)[1]
            elif a == "--config":
                if i >= len(args):
                    raise UsageError("--config needs a file")
                opts.config = args[i]
                i += 1
            else:
                raise UsageError(f"unknown option {a}")
            continue
        if a.startswith("--"):
            raise UsageError(f"unknown option {a}")
        if not a.startswith("-") or a == "-":
            opts.recipients.append(a)
            continue
        # one option letter (flags may be bundled: -ti, -it)
        j = 1
        while j < len(a):
            c = a[j]
            j += 1
            if c == "o":  # -oi; every other -o option is legacy and ignored
                if a[j:] == "i":
                    opts.ignore_dots = True
                break
            if c == "b":
                mode = a[j:]
                if mode not in ("m", "s", "p"):
                    raise UsageError(f"unsupported mode -b{mode} (only -bm, -bs and -bp)")
                opts.mode = mode
                break
            if c == "q":  # -q, -q30m...: process the queue now (`relay queue flush`)
                opts.mode = "q"
                break
            if c in _WITH_VALUE:
                value = a[j:]
                if not value:
                    if i >= len(args):
                        raise UsageError(f"option -{c} needs a value")
                    value = args[i]
                    i += 1
                if c in "fr":
                    opts.sender = value
                elif c == "F":
                    opts.full_name = value
                elif c in "Cc":  # the config file, as the relay's -c (Postfix: -C)
                    opts.config = value
                break
            if c == "t":
                opts.extract = True
            elif c == "i":
                opts.ignore_dots = True
            elif c not in _IGNORED_FLAGS:
                raise UsageError(f"unknown option -{c}")
    return opts


# --- config -----------------------------------------------------------------------------


def find_relay(config_path: str | None) -> Target:
    """The first `listen` address and our hostname, from the same file `relay` reads."""
    p = Path(config_path or os.environ.get("RELAY_CONFIG") or DEFAULT_PATH)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"config: cannot read {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {p} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {p}: expected a mapping at the top")
    listen = data.get("listen", DEFAULTS["listen"])
    if not isinstance(listen, list) or not listen or not isinstance(listen[0], dict):
        raise ConfigError("listen: expected a non-empty list of listeners")
    host, port = parse_hostport(listen[0].get("address"), "listen[0].address")
    if host in ("0.0.0.0", "*", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    name = data.get("hostname")
    if name is not None and not isinstance(name, str):
        raise ConfigError("hostname: expected a string")
    hostname = name or socket.getfqdn()
    local = data.get("local") or {}
    domain = local.get("domain") if isinstance(local, dict) else None
    return Target(
        host=host,
        port=port,
        hostname=hostname,
        local_domain=domain if isinstance(domain, str) and domain else hostname,
        maildrop=_maildrop_path(data, p),
    )


def _maildrop_path(data: dict[str, object], config: Path) -> Path | None:
    """spool.maildrop, else <spool.path>/maildrop; relative to the config file's folder, as
    every path of the config (relay/config/tree.py)."""
    spool = data.get("spool")
    spool = spool if isinstance(spool, dict) else {}
    base = config.absolute().parent
    path = spool.get("path", DEFAULTS["spool"]["path"])
    drop = spool.get("maildrop")
    if not isinstance(path, str) or not (drop is None or isinstance(drop, str)):
        return None
    spool_path = Path(path) if os.path.isabs(path) else (base / path).resolve()
    return maildrop.resolve(spool_path, drop, base)


def login_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return os.environ.get("LOGNAME") or os.environ.get("USER") or f"uid{os.getuid()}"


def default_sender(local_domain: str) -> str:
    """`<login user>@<local.domain>`: the name the headers give the user too (RFC 5321
    §4.1.2 wants a fully qualified mailbox; a smarthost refuses `root@localhost`)."""
    return f"{login_user()}@{local_domain}"


def check_arguments(argv: Sequence[str]) -> None:
    """A CR, LF or NUL in any argument is refused before anything parses it: passed on, it
    could end an SMTP command (`a@x\r\nRCPT TO:<evil@y>`) or a header line (`-F`)."""
    for a in argv:
        if "\r" in a or "\n" in a or "\x00" in a:
            raise UsageError(f"argument '{printable(a)}' holds a CR, LF or NUL character")


def one_address(text: str, local_domain: str) -> str:
    """`text` as one envelope address: a mailbox as it is, or a bare local part (`root`)
    with `@<local_domain>`. Raises AddressError."""
    try:
        check_mailbox(text)
        return text
    except AddressError as e:
        if "@" in text:
            raise
        first = e
    try:
        check_local_part(text)
    except AddressError:
        raise first from None
    return f"{text}@{local_domain}"


def _split_list(arg: str) -> list[str]:
    """`arg` split at the commas outside a quoted string (a quoted local part may hold one)."""
    parts: list[str] = []
    cur: list[str] = []
    quoted = escaped = False
    for ch in arg:
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_recipients(args: list[str], local_domain: str = "localhost") -> list[str]:
    """Command-line recipients, strictly: each argument is one address (`<...>` allowed) or
    a comma-separated list of them, as Postfix's sendmail reads it. Anything else raises
    UsageError naming the argument: `user@exa mple.org` is not `user@example.org`, and
    `root admin` is not `root` (email.utils.getaddresses would make them so)."""
    out: list[str] = []
    for arg in args:
        found = 0
        for piece in _split_list(arg):
            text = piece.strip(" \t")
            if text.startswith("<") and text.endswith(">"):
                text = text[1:-1].strip(" \t")
            if not text:
                continue
            try:
                out.append(one_address(text, local_domain))
            except AddressError as e:
                raise UsageError(
                    f"bad recipient argument '{printable(arg)}': '{printable(text)}': {e}"
                ) from None
            found += 1
        if not found:
            raise UsageError(f"bad recipient argument '{printable(arg)}': no address in it")
    return out


def envelope_sender(option: str | None, local_domain: str) -> str:
    """MAIL FROM: `-f`/`-r` (`<>` or empty is the null sender; `root` is qualified with
    local.domain, as the daemon qualifies `root` in headers), else the login user at
    local.domain. Raises UsageError."""
    if option is None:
        return default_sender(local_domain)
    sender = option.strip().strip("<>").strip()
    if not sender:
        return ""
    try:
        return one_address(sender, local_domain)
    except AddressError as e:
        raise UsageError(f"bad sender address '{printable(sender)}': {e}") from None


# --- the message --------------------------------------------------------------------------


def read_message(stream: BinaryIO, ignore_dots: bool) -> list[bytes]:
    """Lines without their endings (LF, or CRLF). Without -i a line holding only "." ends
    the input (the rest of stdin is left unread, as sendmail does). A bare CR is not a line
    end (RFC 5322 §2.3: CR and LF only occur together as CRLF): it stays inside its line,
    and build_message refuses it in a header."""
    lines: list[bytes] = []
    for raw in stream:
        line = raw[:-1] if raw.endswith(b"\n") else raw
        if line.endswith(b"\r"):
            line = line[:-1]
        if not ignore_dots and line == b".":
            return lines
        lines.append(line)
    return lines


def split_headers(lines: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(header lines, body lines). The header block ends at the first empty line (dropped)
    or at the first line that is neither a header field nor a continuation of one (kept, as
    the body's first line). A header line with a bare CR raises DataError: a reader that
    takes CR for a line end would see a second field (`Subject: hi\rBcc: evil@...`)."""
    start = 1 if lines and lines[0].startswith(b"From ") else 0  # mbox separator
    headers: list[bytes] = []
    i = start
    while i < len(lines):
        line = lines[i]
        if line == b"":
            return headers, lines[i + 1 :]
        if _HEADER_LINE.match(line) or (headers and line[:1] in (b" ", b"\t")):
            if b"\r" in line:
                name = line.split(b":", 1)[0].decode("ascii", "replace")
                raise DataError(
                    f"header line {i + 1 - start} ({printable(name)[:40]}) holds a bare CR,"
                    " which is not a line end: refused (end lines with LF or CRLF)"
                )
            headers.append(line)
            i += 1
            continue
        break
    return headers, lines[i:]


def fields(headers: list[bytes]) -> list[tuple[str, str, int, int]]:
    """(name, unfolded value, first line index, end index) for each header field."""
    # Linear time: each field's parts are collected and joined once (growing a string by
    # `value + " " + line` per folded line is quadratic in a long folded field).
    parts: list[tuple[str, list[str], int, int]] = []
    for idx, line in enumerate(headers):
        text = line.decode("utf-8", errors="surrogateescape")
        if line[:1] in (b" ", b"\t") and parts:
            name, values, first, _end = parts[-1]
            values.append(text.strip())
            parts[-1] = (name, values, first, idx + 1)
        else:
            name, _sep, value = text.partition(":")
            parts.append((name.strip(), [value.strip()], idx, idx + 1))
    return [(name, " ".join(values), first, end) for name, values, first, end in parts]


def header_recipients(flds: list[tuple[str, str, int, int]], local_domain: str = "") -> list[str]:
    """-t: the addresses of To/Cc/Bcc, or only of Resent-To/Cc/Bcc when the message has
    any of those (RFC 5322 §3.6.6: a resent message goes to the resent recipients, not
    again to the original ones). A bare `root` gets `@<local_domain>`, as in the headers.

    A field is read by two parsers, the lenient email.utils.getaddresses and the strict
    RFC 5322 one of email.headerregistry; where they do not read the same addresses the
    field is not an address list we can be sure of, and DataError refuses the message:
    `To: user@exa mple.org` is not a message for user@example.org, nor `To: root admin`
    one for root."""
    names = {n.lower() for n, _v, _a, _b in flds}
    resent = bool(names & {"resent-to", "resent-cc", "resent-bcc"})
    wanted = {"resent-to", "resent-cc", "resent-bcc"} if resent else {"to", "cc", "bcc"}
    found: list[str] = []
    for name, value, _a, _b in flds:
        if name.lower() not in wanted:
            continue
        lenient = [a for _n, a in email.utils.getaddresses([value]) if a]
        try:
            strict = [a.addr_spec for a in _STRICT.header_factory(name, value).addresses]
        except Exception:  # the stdlib parser has crashes of its own on odd input: not sure
            strict = None
        if strict != lenient:
            raise DataError(
                f"-t: the {printable(name)} field '{printable(value)[:200]}' is not an address"
                " list that can be read with certainty"
            )
        found.extend(lenient)
    if local_domain:
        found = [a if "@" in a else f"{a}@{local_domain}" for a in found]
    return found


_STRICT = email.policy.default  # RFC 5322 address lists (email.headerregistry)

# RFC 5322 §3.2.3 atext: a display name of atoms and single spaces needs no quotes
_ATOMS = re.compile(r"[A-Za-z0-9!#$%&'*+\-/=?^_`{|}~]+(?: [A-Za-z0-9!#$%&'*+\-/=?^_`{|}~]+)*")
_WORD_BYTES = 45  # raw octets per RFC 2047 B-word: 60 base64 characters, word <= 75


def display_name(name: str) -> str:
    """`-F NAME` as an RFC 5322 display name: atoms as they are, other ASCII as a quoted
    string, anything longer or not ASCII as RFC 2047 encoded words, folded (one word a
    line). Never a CR or LF of its own (check_arguments refused those), so it can never
    start another header line."""
    # "=?" encoded too: readers decode an encoded word even inside quotes (RFC 2047 §5 says
    # they should not), which would change the name
    if name.isascii() and len(name) <= 200 and "=?" not in name:
        if _ATOMS.fullmatch(name):
            return name
        return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    words: list[str] = []
    chunk = b""
    for ch in name:
        b = ch.encode("utf-8", "surrogateescape")
        if len(chunk) + len(b) > _WORD_BYTES:
            words.append(chunk.decode("utf-8", "surrogateescape"))
            chunk = b""
        chunk += b
    if chunk:
        words.append(chunk.decode("utf-8", "surrogateescape"))
    return "\r\n ".join(
        "=?utf-8?b?" + base64.b64encode(w.encode("utf-8", "surrogateescape")).decode("ascii") + "?="
        for w in words
    )


def from_header(full_name: str | None, address: str) -> bytes:
    value = f"{display_name(full_name)} <{address}>" if full_name else address
    return b"From: " + value.encode("utf-8", errors="surrogateescape")


def build_message(
    lines: list[bytes], opts: Options, sender: str, default_from: str, local_domain: str = ""
) -> tuple[bytes, list[str]]:
    """The message to submit (CRLF line endings) and the recipients found by -t."""
    headers, body = split_headers(lines)
    flds = fields(headers)
    found = header_recipients(flds, local_domain) if opts.extract else []
    drop: set[int] = set()
    if opts.extract:
        for name, _v, first, end in flds:
            if name.lower() in ("bcc", "resent-bcc"):
                drop.update(range(first, end))
    kept = [h for idx, h in enumerate(headers) if idx not in drop]
    if local_domain:
        kept = qualify_headers(kept, local_domain)
    names = {n.lower() for n, _v, _a, _b in flds}
    added: list[bytes] = []
    if "from" not in names:
        added.append(from_header(opts.full_name, sender or default_from))
    if "date" not in names:
        added.append(b"Date: " + email.utils.formatdate(time.time(), localtime=True).encode())
    data = b"\r\n".join([*added, *kept, b"", *body]) + b"\r\n"
    return data, found


def _dedupe(addrs: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for a in addrs:
        if a.lower() not in seen:
            seen.add(a.lower())
            out.append(a)
    return out


# --- submission ---------------------------------------------------------------------------


# --- -bs: SMTP on stdin/stdout --------------------------------------------------------------


def smtp_proxy(target: Target) -> int:
    """Relay bytes between stdin/stdout and the relay until either side is done."""
    try:
        sock = socket.create_connection((target.host, target.port), timeout=TIMEOUT)
    except OSError as e:
        os.write(1, f"421 4.3.0 {PROG}: cannot reach the relay at {target}\r\n".encode())
        print(f"{PROG}: cannot connect to the relay at {target}: {e}", file=sys.stderr)
        return EX_TEMPFAIL
    sock.settimeout(None)
    stdin_open = True
    try:
        while True:
            watch: list[int | socket.socket] = [sock]
            if stdin_open:
                watch.append(0)
            # Once stdin is done, the relay still answers what it got (the reply to "."
            # comes after an fsync) and closes after QUIT. The socket is not half-closed:
            # the SMTP server would take EOF as the client going away.
            wait = TIMEOUT * 5 if stdin_open else BS_LINGER
            ready, _w, _x = select.select(watch, [], [], wait)
            if not ready:
                if stdin_open:
                    print(f"{PROG}: the SMTP session with {target} timed out", file=sys.stderr)
                    return EX_TEMPFAIL
                return EX_OK  # input ended without QUIT; the relay has said all it had
            if sock in ready:
                chunk = sock.recv(65536)
                if not chunk:
                    return EX_OK
                _write_all(1, chunk)
            if 0 in ready:
                chunk = os.read(0, 65536)
                if chunk:
                    sock.sendall(chunk)
                else:
                    stdin_open = False
    except OSError as e:
        print(f"{PROG}: the SMTP session with the relay at {target} failed: {e}", file=sys.stderr)
        return EX_TEMPFAIL
    finally:
        sock.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# --- main -----------------------------------------------------------------------------------


def _die(code: int, text: str) -> NoReturn:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def run(argv: Sequence[str]) -> int:
    try:
        check_arguments(argv)
        opts = parse_args(argv)
    except UsageError as e:
        _die(
            EX_USAGE,
            f"{e}\nusage: {PROG} [-t] [-i] [-f sender] [-F name]"
            f" [-C FILE] [recipient ...] < message",
        )
    try:
        target = find_relay(opts.config)
    except ConfigError as e:
        _die(EX_CONFIG, str(e))
    if opts.mode in ("p", "q"):
        return _queue_verb(opts)
    if opts.mode == "s":
        return smtp_proxy(target)
    default_from = default_sender(target.local_domain)
    if opts.full_name is not None and any(ord(c) < 32 or ord(c) == 127 for c in opts.full_name):
        _die(EX_USAGE, f"-F '{printable(opts.full_name)}': a control character in the name")
    try:
        sender = envelope_sender(opts.sender, target.local_domain)
        rcpts = parse_recipients(opts.recipients, target.local_domain)
    except UsageError as e:
        _die(EX_USAGE, f"{e}; nothing sent")
    if not rcpts and not opts.extract:
        _die(EX_USAGE, "no recipients given (name them as arguments, or use -t)")
    lines = read_message(sys.stdin.buffer, opts.ignore_dots)
    try:
        data, found = build_message(lines, opts, sender, default_from, target.local_domain)
    except DataError as e:
        _die(EX_DATAERR, f"{e}; nothing sent")
    rcpts = _dedupe(rcpts + found)
    for r in rcpts:
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in r):
            _die(EX_USAGE, f"bad recipient address '{printable(r)}': control character")
    if not rcpts:
        _die(EX_USAGE, "no recipients found (none as arguments, none in To/Cc/Bcc)")
    try:
        refused = submit(target, sender, rcpts, data)
    except Failure as f:
        if f.code != EX_TEMPFAIL:
            _die(f.code, str(f))
        return _to_maildrop(target, sender, rcpts, data, str(f))
    if refused:
        _die(
            EX_NOUSER,
            f"the relay at {target} accepted the message for"
            f" {len(rcpts) - len(refused)} of {len(rcpts)} recipients; refused: "
            + "; ".join(refused),
        )
    return EX_OK


def _to_maildrop(target: Target, sender: str, rcpts: list[str], data: bytes, why: str) -> int:
    """The relay could not take the message now: write it into the maildrop for the daemon
    to import (exit 0), or fail with 75 when that is not possible either."""
    if target.maildrop is None:
        _die(EX_TEMPFAIL, f"{why}; no maildrop (spool.path/spool.maildrop unreadable)")
    drop = maildrop.Drop(
        sender=sender,
        recipients=tuple(rcpts),
        data=data,
        created_at=time.time(),
        uid=os.getuid(),
        user=login_user(),
    )
    try:
        path = maildrop.write(target.maildrop, drop)
    except OSError as e:
        _die(
            EX_TEMPFAIL,
            f"{why}; and the maildrop {target.maildrop} cannot take it either:"
            f" {e.strerror or e} (is this user in group '{maildrop.GROUP}'?)",
        )
    print(
        f"{PROG}: {why}; queued locally in the maildrop as {path.name}:"
        " the relay daemon will send it when it runs",
        file=sys.stderr,
        flush=True,
    )
    return EX_OK


def _queue_verb(opts: Options) -> int:
    """`sendmail -bp` (= mailq) lists the queue, `sendmail -q` flushes it: the `relay` CLI
    with the same config, so the usual /usr/bin/mailq symlink works. These read the spool:
    run them as a user who may (the daemon's)."""
    from relay.cli import main as cli

    config = ["-c", opts.config] if opts.config else []
    verb = ["queue", "list"] if opts.mode == "p" else ["queue", "flush"]
    return cli.main([*config, *verb])


def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


def mailq(argv: Sequence[str] | None = None) -> int:
    """The `mailq` console script: `sendmail -bp`."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run(["-bp", *args])


if __name__ == "__main__":
    raise SystemExit(main())
