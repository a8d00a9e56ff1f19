"""`relay-sendmail`: a /usr/sbin/sendmail-compatible submission program.

Apps that pipe mail to sendmail (PHP `mail()`, cron, logwatch, ...) run this instead. It
reads the message on stdin and submits it over SMTP to the relay's first `listen` address,
found through the same config file as every other command (`--config FILE`, else
`$RELAY_CONFIG`, else `/etc/relay/relay.yaml`).

Only `listen` and `hostname` are read from the config, with a plain YAML load: sendmail runs
as whichever user the app runs as, and must not need the secrets (password files) that the
daemon reads, nor fail on a key it has no use for.

Options (sendmail/Postfix compatible):
  -t          recipients from To/Cc/Bcc (Resent-To/Cc/Bcc when the message has Resent-*
              headers), added to those on the command line; Bcc/Resent-Bcc lines are removed
  -i, -oi     a line with a single "." does not end the input (without it, it does)
  -f ADDR     envelope sender (also -fADDR, -r ADDR; "<>" is the null sender); default:
              the current user @ the configured hostname
  -F NAME     full name for the From: header added when the message has none
  -bm         read the message on stdin and send it (the default)
  -bs         speak SMTP on stdin/stdout, relayed byte for byte to the relay
  -o*, -v, -m, -n, -U, -G, -Ax, -Bx, -dx, -ex, -hN, -Lx, -Nx, -Ox, -Rx, -Vx, -X FILE
              accepted and ignored (legacy and delivery-status options)
  --          end of options; everything after it is a recipient

Headers added when missing: From (the envelope sender, with -F's name) and Date. No
Message-ID is added: the relay derives one from the content, so a byte-identical
resubmission is recognised as a duplicate. Every line ending becomes CRLF before sending,
and a leading mbox "From " line is dropped.

Exit status (sysexits.h):
  0   the relay answered 250 after DATA: the message is durably spooled
      (a relay that recognised a duplicate also answers 250)
  64  EX_USAGE     bad options, or no recipients at all
  65  EX_DATAERR   a 5xx reply to MAIL FROM or to the message itself (e.g. too big)
  67  EX_NOUSER    a 5xx reply to a recipient (unknown, malformed or suppressed). If some
                   recipients were accepted, the message is still sent to them, and the
                   refused ones are named on stderr
  69  EX_UNAVAILABLE  a 5xx greeting or EHLO/HELO reply: the relay will not talk to us
  75  EX_TEMPFAIL  the relay could not be reached, answered 4xx (to anything, including a
                   single recipient: then nothing is sent, so that a retry is complete),
                   dropped the connection or timed out. Try again later.
  78  EX_CONFIG    the config file is missing or unreadable, or its listen address is bad
Every failure prints one line on stderr naming the relay address and its reply.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import pwd
import re
import select
import smtplib
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NoReturn

import yaml

from relay.address import AddressError, check_local_part, check_mailbox, printable
from relay.config import DEFAULT_PATH, DEFAULTS, ConfigError, parse_hostport
from relay.message import qualify_headers

EX_OK = 0
EX_USAGE = 64
EX_DATAERR = 65
EX_NOUSER = 67
EX_UNAVAILABLE = 69
EX_TEMPFAIL = 75
EX_CONFIG = 78

PROG = "relay-sendmail"
TIMEOUT = 120.0  # seconds: connect, and each reply (the relay fsyncs before its 250)
BS_LINGER = 30.0  # -bs: seconds of silence from the relay, after stdin ended, before exiting

# Options that take a value (attached, `-Nnever`, or as the next argument, `-N never`);
# all ignored except the ones handled below.
_WITH_VALUE = frozenset("fFrABCNRVLOXhde")
# Flags (no value) accepted and ignored.
_IGNORED_FLAGS = frozenset("vmnUG")

_HEADER_LINE = re.compile(rb"^[\x21-\x39\x3b-\x7e]+[ \t]*:")


class UsageError(Exception):
    pass


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
                elif c == "C":
                    raise UsageError("-C is not supported: use --config FILE or $RELAY_CONFIG")
                break
            if c == "t":
                opts.extract = True
            elif c == "i":
                opts.ignore_dots = True
            elif c not in _IGNORED_FLAGS:
                raise UsageError(f"unknown option -{c}")
    return opts


# --- config -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    hostname: str
    local_domain: str = ""  # local.domain (else hostname): qualifies `root` in headers

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


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
    )


def default_sender(hostname: str) -> str:
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = os.environ.get("LOGNAME") or os.environ.get("USER") or f"uid{os.getuid()}"
    return f"{user}@{hostname}"


# --- the message --------------------------------------------------------------------------


def read_message(stream: BinaryIO, ignore_dots: bool) -> list[bytes]:
    """Lines without their endings. Without -i a line holding only "." ends the input
    (the rest of stdin is left unread, as sendmail does)."""
    lines: list[bytes] = []
    for raw in stream:
        # a bare CR inside a line is a line ending too
        parts = raw.rstrip(b"\n").rstrip(b"\r").split(b"\r")
        for part in parts:
            if not ignore_dots and part == b".":
                return lines
            lines.append(part)
    return lines


def split_headers(lines: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(header lines, body lines). The header block ends at the first empty line (dropped)
    or at the first line that is neither a header field nor a continuation of one (kept, as
    the body's first line)."""
    start = 1 if lines and lines[0].startswith(b"From ") else 0  # mbox separator
    headers: list[bytes] = []
    i = start
    while i < len(lines):
        line = lines[i]
        if line == b"":
            return headers, lines[i + 1 :]
        if _HEADER_LINE.match(line) or (headers and line[:1] in (b" ", b"\t")):
            headers.append(line)
            i += 1
            continue
        break
    return headers, lines[i:]


def fields(headers: list[bytes]) -> list[tuple[str, str, int, int]]:
    """(name, unfolded value, first line index, end index) for each header field."""
    out: list[tuple[str, str, int, int]] = []
    for idx, line in enumerate(headers):
        text = line.decode("utf-8", errors="surrogateescape")
        if line[:1] in (b" ", b"\t") and out:
            name, value, first, _end = out[-1]
            out[-1] = (name, value + " " + text.strip(), first, idx + 1)
        else:
            name, _sep, value = text.partition(":")
            out.append((name.strip(), value.strip(), idx, idx + 1))
    return out


def header_recipients(flds: list[tuple[str, str, int, int]]) -> list[str]:
    names = {n.lower() for n, _v, _a, _b in flds}
    resent = bool(names & {"resent-to", "resent-cc", "resent-bcc"})
    wanted = {"resent-to", "resent-cc", "resent-bcc"} if resent else {"to", "cc", "bcc"}
    values = [v for n, v, _a, _b in flds if n.lower() in wanted]
    return [a for _n, a in email.utils.getaddresses(values) if a]


def parse_recipients(args: list[str]) -> list[str]:
    """Command-line recipients; an argument may hold several, comma-separated."""
    return [a for _n, a in email.utils.getaddresses(args) if a]


def build_message(
    lines: list[bytes], opts: Options, sender: str, default_from: str, local_domain: str = ""
) -> tuple[bytes, list[str]]:
    """The message to submit (CRLF line endings) and the recipients found by -t."""
    headers, body = split_headers(lines)
    flds = fields(headers)
    found = header_recipients(flds) if opts.extract else []
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
        addr = sender or default_from
        value = email.utils.formataddr((opts.full_name or "", addr), charset="utf-8")
        added.append(b"From: " + value.encode("utf-8", errors="surrogateescape"))
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


class Failure(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


def _reply(code: int, msg: bytes | str) -> str:
    text = msg.decode("utf-8", errors="replace") if isinstance(msg, bytes) else msg
    return f"{code} {' '.join(text.split())}".strip()


def submit(target: Target, sender: str, rcpts: list[str], data: bytes) -> list[str]:
    """One SMTP transaction. Returns the recipients the relay refused with 5xx (the message
    went to the others); raises Failure when nothing was accepted."""
    try:
        s = smtplib.SMTP(target.host, target.port, local_hostname=target.hostname, timeout=TIMEOUT)
    except smtplib.SMTPConnectError as e:  # greeting was not 220
        code = EX_TEMPFAIL if e.smtp_code < 500 else EX_UNAVAILABLE
        raise Failure(
            code,
            f"the relay at {target} refused the connection: {_reply(e.smtp_code, e.smtp_error)}",
        ) from None
    except (OSError, smtplib.SMTPException) as e:
        raise Failure(EX_TEMPFAIL, f"cannot connect to the relay at {target}: {e}") from None
    try:
        return _transaction(s, target, sender, rcpts, data)
    except smtplib.SMTPServerDisconnected as e:
        raise Failure(EX_TEMPFAIL, f"the relay at {target} closed the connection: {e}") from None
    except TimeoutError:
        raise Failure(
            EX_TEMPFAIL, f"the relay at {target} did not answer within {TIMEOUT:g}s"
        ) from None
    except OSError as e:
        raise Failure(EX_TEMPFAIL, f"connection to the relay at {target} failed: {e}") from None
    finally:
        with contextlib.suppress(Exception):
            s.quit()
        with contextlib.suppress(Exception):
            s.close()


def _transaction(
    s: smtplib.SMTP, target: Target, sender: str, rcpts: list[str], data: bytes
) -> list[str]:
    code, msg = s.ehlo()
    if code != 250:
        code, msg = s.helo()
        if code != 250:
            raise Failure(
                EX_TEMPFAIL if code < 500 else EX_UNAVAILABLE,
                f"the relay at {target} refused HELO: {_reply(code, msg)}",
            )
    options: list[str] = []
    if s.has_extn("size"):
        options.append(f"SIZE={len(data)}")
    if not data.isascii() and s.has_extn("8bitmime"):
        options.append("BODY=8BITMIME")
    if (not sender.isascii() or not all(r.isascii() for r in rcpts)) and s.has_extn("smtputf8"):
        options.append("SMTPUTF8")
    code, msg = s.mail(sender, options)
    if code != 250:
        _abort(s)
        raise Failure(
            EX_TEMPFAIL if code < 500 else EX_DATAERR,
            f"the relay at {target} refused sender <{sender}>: {_reply(code, msg)}",
        )
    refused: list[tuple[str, int, str]] = []
    for r in rcpts:
        code, msg = s.rcpt(r)
        if code not in (250, 251):
            refused.append((r, code, _reply(code, msg)))
    temp = [x for x in refused if x[1] < 500]
    if temp:
        _abort(s)
        r, _c, reply = temp[0]
        raise Failure(
            EX_TEMPFAIL,
            f"the relay at {target} refused recipient <{r}>: {reply};"
            f" nothing sent, try again later",
        )
    if len(refused) == len(rcpts):
        _abort(s)
        r, _c, reply = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise Failure(EX_NOUSER, f"the relay at {target} refused recipient <{r}>{more}: {reply}")
    answer: bytes | str
    try:
        # smtplib.data raises when DATA itself is refused, and returns the reply to "."
        code, answer = s.data(data)
    except smtplib.SMTPDataError as e:
        code, answer = e.smtp_code, e.smtp_error
    if code != 250:
        raise Failure(
            EX_TEMPFAIL if code < 500 else EX_DATAERR,
            f"the relay at {target} refused the message: {_reply(code, answer)}",
        )
    return [f"<{r}>: {reply}" for r, _c, reply in refused]


def _abort(s: smtplib.SMTP) -> None:
    with contextlib.suppress(Exception):
        s.rset()


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
        opts = parse_args(argv)
    except UsageError as e:
        _die(
            EX_USAGE,
            f"{e}\nusage: {PROG} [-t] [-i] [-f sender] [-F name]"
            f" [--config FILE] [recipient ...] < message",
        )
    try:
        target = find_relay(opts.config)
    except ConfigError as e:
        _die(EX_CONFIG, str(e))
    if opts.mode in ("p", "q"):
        return _queue_verb(opts)
    if opts.mode == "s":
        return smtp_proxy(target)
    default_from = default_sender(target.hostname)
    sender = default_from if opts.sender is None else opts.sender.strip().strip("<>").strip()
    if sender:
        try:
            if "@" in sender:
                check_mailbox(sender)
            else:  # `-f root`: qualified with local.domain, as the daemon does for `root`
                check_local_part(sender)
                sender = f"{sender}@{target.local_domain}"
        except AddressError as e:
            _die(EX_USAGE, f"bad sender address '{printable(sender)}': {e}")
    rcpts = parse_recipients(opts.recipients)
    if not rcpts and not opts.extract:
        _die(EX_USAGE, "no recipients given (name them as arguments, or use -t)")
    lines = read_message(sys.stdin.buffer, opts.ignore_dots)
    data, found = build_message(lines, opts, sender, default_from, target.local_domain)
    rcpts = _dedupe(rcpts + found)
    for r in rcpts:
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in r):
            _die(EX_USAGE, f"bad recipient address '{printable(r)}': control character")
    if not rcpts:
        _die(EX_USAGE, "no recipients found (none as arguments, none in To/Cc/Bcc)")
    try:
        refused = submit(target, sender, rcpts, data)
    except Failure as f:
        _die(f.code, str(f))
    if refused:
        _die(
            EX_NOUSER,
            f"the relay at {target} accepted the message for"
            f" {len(rcpts) - len(refused)} of {len(rcpts)} recipients; refused: "
            + "; ".join(refused),
        )
    return EX_OK


def _queue_verb(opts: Options) -> int:
    """`sendmail -bp` (= mailq) lists the queue, `sendmail -q` flushes it: the `relay` CLI
    with the same config, so the usual /usr/bin/mailq symlink works. These read the spool:
    run them as a user who may (the daemon's)."""
    from relay import cli

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
