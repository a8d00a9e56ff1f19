"""Structured, PII-safe logging for the relay.

Every log record is rendered as exactly one physical line, either as a JSON
object (``log.format: json``, the default) or as logfmt (``log.format: text``)::

    {"ts":"2024-05-01T12:34:56.789Z","level":"info","logger":"relay.smtp","event":"accepted",
     "msg":"message spooled","queue_id":"abc","rcpt":"u***@example.com"}

    ts=2024-05-01T12:34:56.789Z level=info logger=relay.smtp event=accepted queue_id=abc
     rcpt=u***@example.com msg="message spooled"

(each shown wrapped here; on the wire it is a single line).

Structured events are emitted with :func:`log_event`; the fields travel on the
record as ``extra={"event": ..., "fields": {...}}`` and are rendered by the
formatter, which is also where privacy rules are enforced, so a call site cannot
forget them:

- fields named ``rcpt``, ``rcpts``, ``recipient``, ``recipients``, ``sender``,
  ``senders``, ``address``, ``addresses``, ``mail_from`` and ``rcpt_to`` (a
  string or a list of strings) are masked with :func:`mask_address` unless
  logging was configured with ``unmask=True``;
- fields named ``password``, ``passwd``, ``secret``, ``token``, ``api_key``,
  ``body`` or ``content`` (or ending in ``_password``, ``_secret``, ``_token``)
  are always replaced by ``"[redacted]"``, even with ``unmask=True``; ``bytes``
  values are never printed, only their length;
- in masked mode, anything that looks like an e-mail address inside free text
  (``msg``, exception text, other string fields such as an SMTP reply) is masked
  too; ``message_id`` is left alone;
- exceptions are rendered as ``exc_type`` and ``exc`` (their ``str()``); the full
  ``traceback`` is only included when the configured level is DEBUG.

A field whose name collides with a reserved key (``ts``, ``level``, ``logger``,
``event``, ``msg``, ``exc_type``, ``exc``, ``traceback``, ``stack``) is emitted as
``field_<name>``. Plain ``logger.info(...)`` records get ``event="log"``.

Standard event names (use the constants, not string literals):

=================== ===========================================================
``accepted``        a message was received over SMTP and durably spooled
``deduplicated``    a resubmitted message was recognised and not spooled twice
``rejected``        an SMTP command / message was refused at submission time
``attempt``         a delivery attempt is starting
``delivered``       a recipient was accepted by the next hop
``deferred``        a temporary failure; the recipient will be retried
``bounced``         a permanent failure; a bounce (DSN) was generated
``failed``          a permanent failure without a bounce (e.g. null sender)
``expired``         the retry lifetime ran out
``suppressed``      delivery skipped because the address is on a suppression list
``dead_letter``     a message was moved to the dead-letter queue
``operator_action`` an operator ran a command (retry, purge, hold, release, ...)
``config_reloaded`` configuration re-read (SIGHUP)
``startup``         the daemon is starting / ready
``shutdown``        the daemon is stopping
``ambiguous``       outcome unknown (e.g. connection lost after DATA was sent)
=================== ===========================================================

``message_id_reused``: a Message-ID seen within ``dedup.window`` came with other content; the
message was queued as a new one (WARNING, with ``queue_id`` and ``first_queue_id``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import enum
import json
import json.encoder
import logging
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Final, TextIO, TypeAlias

from relay.config.redact import (
    URL_RE,
    redact_url,
    redact_urls,
    redact_webhook_url,
    replace_secrets,
    secret_pairs,
)

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "EVENTS",
    "REDACTED",
    "JSONFormatter",
    "LogfmtFormatter",
    "log_event",
    "logfmt_quote",
    "mask_address",
    "parse_level",
    "reconfigure",
    "redact_text",
    "redact_url",
    "redact_webhook_url",
    "set_secrets",
    "setup_logging",
]


# every row of the outcome table (relay/delivery/outcomes.py) logs one of these
# (tests/delivery/test_outcomes.py checks it)
EVENTS: Final[frozenset[str]] = frozenset(
    {
        "accepted",
        "deduplicated",
        "message_id_reused",
        "rejected",
        "attempt",
        "delivered",
        "deferred",
        "bounced",
        "failed",
        "expired",
        "suppressed",
        "dead_letter",
        "operator_action",
        "config_reloaded",
        "startup",
        "shutdown",
        "ambiguous",
    }
)

REDACTED: Final = "[redacted]"

_ADDRESS_KEYS: Final = frozenset(
    {
        "rcpt",
        "rcpts",
        "recipient",
        "recipients",
        "sender",
        "senders",
        "address",
        "addresses",
        "mail_from",
        "rcpt_to",
    }
)
_SECRET_KEYS: Final = frozenset(
    {"password", "passwd", "secret", "token", "api_key", "body", "content"}
)
_SECRET_SUFFIXES: Final = ("_password", "_secret", "_token")
_NO_SCRUB_KEYS: Final = frozenset({"message_id", "msgid"})
_RESERVED_KEYS: Final = frozenset(
    {"ts", "level", "logger", "event", "msg", "exc_type", "exc", "traceback", "stack"}
)
_MAX_DEPTH: Final = 6
_MAX_EXC_LEN: Final = 2000

# Something that looks like an addr-spec inside free text (SMTP replies, exception text).
# '*' is part of the local-part class, so already-masked text is left unchanged.
# The lookbehind starts a match only at the beginning of a run of local-part characters, so a
# long run without "@" is scanned once, not once per position (quadratic: 6.6 s for 20 kB).
_ADDRESS_RE: Final = re.compile(
    r"(?<![\w.!#$%&'*+/=?^`{|}~-])[\w.!#$%&'*+/=?^`{|}~-]+@"
    r"(?:\[[0-9A-Fa-f.:]+\]|[\w-]+(?:\.[\w-]+)*)"
)

_LEVELS: Final[Mapping[str, int]] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_FORMATS: Final = frozenset({"json", "text", "logfmt"})

# aiosmtpd logs every SMTP command line (addresses) at INFO and DATA lines (bodies) at DEBUG.
_AIOSMTPD_LOGGER: Final = "mail.log"
# Libraries that log each request with its full URL at INFO (httpx: "HTTP Request: POST
# https://hooks.example/x?token=..."), or connection details at DEBUG: held at WARNING so a
# webhook URL (itself a secret for Slack, Teams, Google Chat) never reaches the log.
_CHATTY_LOGGERS: Final = ("httpx", "httpcore", "hpack", "urllib3", "psycopg")

_setup_lock: Final = threading.Lock()

_ExcInfo: TypeAlias = tuple[type[BaseException], BaseException, TracebackType | None]


# --------------------------------------------------------------------------- secrets

# MASK, URL_RE, redact_url, redact_webhook_url and the secret pairs' rules:
# relay/config/redact.py (the config's secrets print by the same rules)
_URL_RE: Final = URL_RE

# Literal secrets read from the config (passwords, tokens, webhook URLs and their paths), with
# what replaces each one; longest first so a secret that contains another goes whole.
_secrets: tuple[tuple[str, str], ...] = ()
# Fields whose URL is printed whole, for the operator to open: Amazon SNS's SubscribeURL
# (relay/feedback/service.py), whose token confirms that one subscription and nothing else.
_WHOLE_URL_KEYS: Final = frozenset({"subscribe_url"})


def set_secrets(secrets: Mapping[str, str]) -> None:
    """Register the config's secret values (value -> what prints instead); every log line
    the formatter renders has them replaced, even with ``unmask``. Called at start and at
    each reload; replaces the previous set."""
    global _secrets
    _secrets = secret_pairs(secrets)


def _replace_secrets(text: str) -> str:
    return replace_secrets(text, _secrets)


def redact_text(text: str) -> str:
    """Free text fit to print: registered secrets replaced, then every URL in it through
    :func:`redact_url`. For log lines, error messages and alert texts."""
    return redact_urls(_replace_secrets(text))


def _redact_tree(value: object, plain: bool = False) -> object:
    """`value` with `redact_text` applied to every string in it. `plain`: no secret is
    registered, so a string without "://" is left as it is (what `redact_text` gives it)."""
    kind = type(value)
    if kind is int or kind is float or kind is bool or value is None:  # the usual fields
        return value
    if kind is str or isinstance(value, str):
        if plain and "://" not in value:  # type: ignore[operator]
            return value
        return redact_text(value)  # type: ignore[arg-type]
    if isinstance(value, list):
        return [_redact_tree(v, plain) for v in value]
    if isinstance(value, dict):
        return {k: _redact_tree(v, plain) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- masking


def _first_char(local: str) -> str:
    """First meaningful character of a local part (inside quotes, skipping escapes)."""
    if local.startswith('"'):
        inner = local[1:-1] if local.endswith('"') and len(local) > 1 else local[1:]
        if inner.startswith("\\"):
            inner = inner[1:]
        return inner[:1]
    return local[:1]


def mask_address(addr: str) -> str:
    """Mask the local part of an e-mail address, keeping its first character and the domain.

    ``user@example.com`` -> ``u***@example.com``; the null sender (``<>`` or ``""``)
    stays ``<>``; a string without ``@`` becomes its first character + ``***``. Angle
    brackets are preserved (a display name in front of them is dropped), quoted local
    parts are handled (``"john doe"@example.com`` -> ``j***@example.com``) and the
    domain is lower-cased.
    """
    s = addr.strip()
    # the usual `local@domain` (no quotes, no angle brackets) as _mask_stripped would mask
    # it, sooner (tests/ops/test_logs.py holds the two equal)
    if s and s[0] != '"' and s[-1] != ">":
        head, at, tail = s.rpartition("@")
        return f"{head[:1]}***@{tail.lower()}" if at else s[:1] + "***"
    return _mask_stripped(s)


def _mask_stripped(s: str) -> str:
    """`mask_address` of a stripped string, every case."""
    if s in ("", "<>"):
        return "<>"
    if s.endswith(">") and "<" in s:
        inner = s[s.rindex("<") + 1 : -1].strip()
        return "<" + mask_address(inner) + ">" if inner else "<>"
    local: str
    domain: str | None
    if s.startswith('"'):
        # Quoted local part: it may itself contain '@'; find the closing quote.
        i, end = 1, -1
        while i < len(s):
            if s[i] == "\\":
                i += 2
                continue
            if s[i] == '"':
                end = i
                break
            i += 1
        if end == -1:
            local, domain = s, None
        else:
            local, rest = s[: end + 1], s[end + 1 :]
            domain = rest[1:] if rest.startswith("@") else None
    else:
        head, at, tail = s.rpartition("@")
        local, domain = (head, tail) if at else (s, None)
    masked = _first_char(local) + "***"
    if domain is None:
        return masked
    return f"{masked}@{domain.lower()}"


def _scrub(text: str) -> str:
    """Mask anything that looks like an e-mail address inside free text."""
    if "@" not in text:
        return text
    return _ADDRESS_RE.sub(lambda m: mask_address(m.group(0)), text)


def _mask_value(value: object) -> object:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return mask_address(bytes(value).decode("utf-8", "replace"))
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [_mask_value(v) for v in items]
    return mask_address(str(value))


def _is_secret_key(key: str) -> bool:
    k = key.lower()
    return k in _SECRET_KEYS or k.endswith(_SECRET_SUFFIXES)


# what a field's name says about its value, from its lower-cased name: a secret, an
# address, text left unscrubbed, or other (worked out once per name: the names are the call
# sites' keywords, a few dozen)
_SECRET, _ADDRESS, _NO_SCRUB, _OTHER = range(4)
_KEY_KINDS: dict[str, int] = {}


def _key_kind(key: str) -> int:
    kind = _KEY_KINDS.get(key)
    if kind is None:
        k = key.lower()
        kind = (
            _SECRET
            if _is_secret_key(k)
            else _ADDRESS
            if k in _ADDRESS_KEYS
            else _NO_SCRUB
            if k in _NO_SCRUB_KEYS
            else _OTHER
        )
        if len(_KEY_KINDS) < 4096:  # names built from data would not grow it without end
            _KEY_KINDS[key] = kind
    return kind


def _sanitize(key: str, value: object, unmask: bool, depth: int = 0) -> object:
    """Return a JSON-compatible, privacy-safe rendering of one field value. The usual
    values (a string, a number, a list of addresses) are decided here as
    `_sanitize_general` decides them, sooner (tests/ops/test_logs.py holds the two equal);
    the rest there."""
    kind = _key_kind(key)
    if type(value) is str:
        if kind == _ADDRESS and not unmask:
            return mask_address(value)
        if kind != _SECRET and depth < _MAX_DEPTH:
            return value if unmask or kind == _NO_SCRUB or "@" not in value else _scrub(value)
    elif type(value) in (int, float) and kind == _OTHER and depth < _MAX_DEPTH:
        return value
    elif type(value) is list and kind == _ADDRESS and not unmask:
        return [mask_address(v) if type(v) is str else _mask_value(v) for v in value]
    return _sanitize_general(key, value, unmask, depth)


def _sanitize_general(key: str, value: object, unmask: bool, depth: int = 0) -> object:
    """`_sanitize`, every case."""
    kind = _key_kind(key)
    if kind == _SECRET:
        return REDACTED
    if kind == _ADDRESS and not unmask:
        return _mask_value(value)
    if depth >= _MAX_DEPTH:
        return "[...]"
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if unmask or kind == _NO_SCRUB else _scrub(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    if isinstance(value, enum.Enum):
        return _sanitize(key, value.value, unmask, depth + 1)
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, BaseException):
        text = f"{type(value).__name__}: {value}"
        return text if unmask else _scrub(text)
    if isinstance(value, Mapping):
        return {str(k2): _sanitize(str(k2), v2, unmask, depth + 1) for k2, v2 in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [_sanitize(key, v, unmask, depth + 1) for v in items]
    text = str(value)
    return text if unmask else _scrub(text)


# --------------------------------------------------------------------------- formatters


_ts_cache: tuple[int, str] = (-1, "")  # (second, its text): formatted once a second


def _iso_ts(record: logging.LogRecord) -> str:
    global _ts_cache
    second = int(record.created)
    cached = _ts_cache
    if cached[0] == second:
        base = cached[1]
    else:
        base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        _ts_cache = (second, base)
    return f"{base}.{int(record.msecs):03d}Z"


def _exc_type_name(exc_type: type[BaseException]) -> str:
    mod = exc_type.__module__
    if mod in ("builtins", "__main__", None):
        return exc_type.__qualname__
    return f"{mod}.{exc_type.__qualname__}"


class _StructuredFormatter(logging.Formatter):
    """Builds the ordered, sanitized payload of a record; subclasses serialize it."""

    def __init__(self, *, unmask: bool = False, include_traceback: bool = False) -> None:
        super().__init__()
        self.unmask = unmask
        self.include_traceback = include_traceback

    def _text(self, text: str) -> str:
        return text if self.unmask else _scrub(text)

    def payload(self, record: logging.LogRecord) -> dict[str, object]:
        event = getattr(record, "event", None)
        out: dict[str, object] = {
            "ts": _iso_ts(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event if isinstance(event, str) and event else "log",
            "msg": self._text(record.getMessage()),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            unmask = self.unmask
            for raw_key, value in fields.items():
                if value is None:  # an absent value is left out, never printed as null
                    continue
                key = raw_key if type(raw_key) is str else str(raw_key)
                out_key = f"field_{key}" if key in _RESERVED_KEYS else key
                out[out_key] = _sanitize(key, value, unmask)
        exc_info = record.exc_info
        if exc_info and exc_info[0] is not None and exc_info[1] is not None:
            out["exc_type"] = _exc_type_name(exc_info[0])
            exc_text = str(exc_info[1])
            if len(exc_text) > _MAX_EXC_LEN:
                exc_text = exc_text[:_MAX_EXC_LEN] + "...[truncated]"
            out["exc"] = self._text(exc_text)
            if self.include_traceback:
                tb = "".join(traceback.format_exception(exc_info[1])).rstrip("\n")
                out["traceback"] = self._text(tb)
        if record.stack_info and self.include_traceback:
            out["stack"] = self._text(record.stack_info)
        # secrets and URLs' passwords and query values, in every field, even unmasked
        # (a plain string with no secret to replace and no URL stays as it is: the usual)
        plain = not _secrets
        for k, v in out.items():
            kind = type(v)
            if kind is str:
                if k in _WHOLE_URL_KEYS:
                    out[k] = _replace_secrets(v)  # type: ignore[arg-type]
                elif not plain or "://" in v:  # type: ignore[operator]
                    out[k] = redact_text(v)  # type: ignore[arg-type]
            elif kind is not int and kind is not float and kind is not bool and v is not None:
                out[k] = _redact_tree(v, plain)
        return out


def _json_default(value: object) -> object:
    return str(value)


# json.dumps with these arguments, made once (json.dumps builds an encoder per call)
_JSON: Final = json.JSONEncoder(separators=(",", ":"), default=_json_default)


def _c_encoder() -> Callable[[object], str] | None:
    """`_JSON.encode` for a payload, on the C encoder made once: `JSONEncoder.encode` makes
    one per call, and checks for cycles, which a payload cannot hold (`_sanitize` copies
    every value into new lists and dicts, at most _MAX_DEPTH deep): 4.2 -> 3.0 us for the
    `accepted` line. The arguments are those `JSONEncoder.iterencode` passes
    (json/encoder.py); None where there is no C encoder or it does not answer as `_JSON`
    does (tests/ops/test_logs.py holds the two equal)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        encode = make(
            None, _json_default, json.encoder.encode_basestring_ascii, None, ":", ",",
            False, False, True,
        )  # fmt: skip
        sample = {"a": "é\n", "b": [1, 2.5, None, True], "c": {"d": b"x"}}
        if "".join(encode(sample, 0)) != _JSON.encode(sample):
            return None
    except Exception:  # another signature: the public path
        return None
    return lambda payload: "".join(encode(payload, 0))


_ENCODE: Final = _c_encoder() or _JSON.encode


class JSONFormatter(_StructuredFormatter):
    """One JSON object per line (non-ASCII escaped, so it is always a single line)."""

    def format(self, record: logging.LogRecord) -> str:
        return _ENCODE(self.payload(record))


_LOGFMT_KEY_RE: Final = re.compile(r"[^A-Za-z0-9_.\-]")
_LOGFMT_SPECIAL: Final = frozenset(' ="\\')
_LOGFMT_ESCAPES: Final[Mapping[str, str]] = {
    '"': '\\"',
    "\\": "\\\\",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def logfmt_quote(value: str) -> str:
    """Render a string as a logfmt value: bare if safe, else double-quoted and escaped."""
    if value.isprintable():
        if value and not any(c in _LOGFMT_SPECIAL for c in value):
            return value
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    parts: list[str] = []
    for c in value:
        esc = _LOGFMT_ESCAPES.get(c)
        if esc is not None:
            parts.append(esc)
        elif c == " " or c.isprintable():
            parts.append(c)
        elif ord(c) <= 0xFFFF:
            parts.append(f"\\u{ord(c):04x}")
        else:
            parts.append(f"\\U{ord(c):08x}")
    return '"' + "".join(parts) + '"'


def _logfmt_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return logfmt_quote(value)
    if isinstance(value, list) and all(
        v is None or isinstance(v, str | int | float | bool) for v in value
    ):
        return logfmt_quote(",".join("" if v is None else str(v) for v in value))
    return logfmt_quote(json.dumps(value, separators=(",", ":"), default=_json_default))


def _logfmt_key(key: str) -> str:
    return _LOGFMT_KEY_RE.sub("_", key) or "_"


class LogfmtFormatter(_StructuredFormatter):
    """logfmt: ``ts=... level=... logger=... event=... <fields> msg="..."`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        payload = self.payload(record)
        msg = payload.pop("msg")
        parts = [f"{_logfmt_key(k)}={_logfmt_value(v)}" for k, v in payload.items()]
        if msg:
            parts.append(f"msg={_logfmt_value(msg)}")
        return " ".join(parts)


# --------------------------------------------------------------------------- setup


class _RelayHandler(logging.StreamHandler[TextIO]):
    """Our handler (setup_logging() finds and replaces it by its class). While an event
    loop is registered with `lines_per_turn`, the lines logged on that loop's thread are
    written once per turn of the loop (one write for all of them, scheduled with
    call_soon) instead of one write each; a line from any other thread, `flush()`
    (logging.shutdown at exit, a replaced handler) and the end of `lines_per_turn` write
    the pending lines first, so no line is lost or out of order. Inside `held_lines` a
    thread's lines are kept and written at its end, in one write."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        turn = _turn
        me = threading.get_ident()
        held = _held.get(me)
        if held is None and (turn is None or me != turn[1]):
            if self._pending:
                self._write_pending()
            super().emit(record)
            return
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        if held is not None:  # written at the end of held_lines, in this thread
            held.append((self, line))
            return
        assert turn is not None
        if not self._pending:
            try:
                turn[0].call_soon(self.flush)
            except RuntimeError:  # the loop is closed: write it now
                self._pending.append(line)
                self._write_pending()
                return
        self._pending.append(line)

    def write_lines(self, lines: list[str]) -> None:
        """`lines` after the pending ones (held_lines)."""
        self.acquire()
        try:
            self._pending.extend(lines)
            self._write_pending()
        finally:
            self.release()

    def _write_pending(self) -> None:
        """The pending lines, in writes of at most PIPE_BUF octets (or one longer line): on
        a pipe another process shares (journald, a supervisor), each write stays atomic, so
        lines never interleave, as when they were written one by one."""
        lines, self._pending = self._pending, []
        group: list[str] = []
        size = 0
        with contextlib.suppress(OSError, ValueError):  # as StreamHandler: never raise
            for line in lines:
                n = (len(line) if line.isascii() else len(line.encode())) + 1
                if group and size + n > _PIPE_BUF:
                    self.stream.write("\n".join(group) + "\n")
                    super().flush()
                    group, size = [], 0
                group.append(line)
                size += n
            self.stream.write("\n".join(group) + "\n")
            super().flush()

    def flush(self) -> None:
        self.acquire()
        try:
            if self._pending:
                self._write_pending()
        finally:
            self.release()
        super().flush()


# the loop (and its thread) whose log lines are written once per turn: lines_per_turn
_turn: tuple[asyncio.AbstractEventLoop, int] | None = None
_PIPE_BUF: Final = 4096  # POSIX: a write of at most this many octets to a pipe is atomic


# the threads inside held_lines, and the lines each has logged there (by thread ident),
# with the handler that formatted each
_held: dict[int, list[tuple[_RelayHandler, str]]] = {}


@contextlib.contextmanager
def held_lines() -> Iterator[None]:
    """Within (in this thread, not across an await): the lines logged are kept, and written
    at the end in one write (writes of at most PIPE_BUF, as `lines_per_turn`), after any
    lines pending before. For a burst of lines one synchronous step makes (the outcome of
    each recipient of one delivery): one system call, not one each, and no line is written
    later than the step that made it. Nested: the outermost writes."""
    me = threading.get_ident()
    if me in _held:
        yield
        return
    held: list[tuple[_RelayHandler, str]] = []
    _held[me] = held
    try:
        yield
    finally:
        del _held[me]
        while held:  # one write per handler (there is one; a replaced one keeps its lines)
            handler = held[0][0]
            handler.write_lines([line for h, line in held if h is handler])
            held = [item for item in held if item[0] is not handler]


@contextlib.contextmanager
def lines_per_turn(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Within: the lines logged on `loop`'s thread are written once per turn of the loop
    (_RelayHandler); at the end, every pending line is written."""
    global _turn
    _turn = (loop, threading.get_ident())
    try:
        yield
    finally:
        _turn = None
        handler = _find_handler(logging.getLogger())
        if handler is not None:
            with contextlib.suppress(OSError, ValueError):
                handler.flush()


def parse_level(level: str | int) -> int:
    """Translate ``debug|info|warning|error|critical`` (any case) or an int to a level."""
    if isinstance(level, int):
        return level
    try:
        return _LEVELS[level.strip().lower()]
    except KeyError:
        choices = ", ".join(sorted(_LEVELS))
        raise ValueError(f"unknown log level {level!r}; expected one of: {choices}") from None


def _make_formatter(fmt: str, unmask: bool, include_traceback: bool) -> _StructuredFormatter:
    f = fmt.strip().lower()
    if f not in _FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected 'json' or 'text'")
    cls = JSONFormatter if f == "json" else LogfmtFormatter
    return cls(unmask=unmask, include_traceback=include_traceback)


def _find_handler(root: logging.Logger) -> _RelayHandler | None:
    for h in root.handlers:
        if isinstance(h, _RelayHandler):
            return h
    return None


def setup_logging(
    level: str | int = "info",
    fmt: str = "json",
    unmask: bool = False,
    stream: TextIO | None = None,
) -> None:
    """Configure the root logger with a single relay handler writing to ``stream``.

    ``stream`` defaults to ``sys.stderr`` (looked up at call time). Idempotent: a
    previously installed relay handler is replaced, never duplicated; handlers that
    were installed by someone else are left alone. Raises ``ValueError`` for an
    unknown level or format (before changing anything).
    """
    lvl = parse_level(level)
    formatter = _make_formatter(fmt, unmask, include_traceback=lvl <= logging.DEBUG)
    handler = _RelayHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    with _setup_lock:
        # Add the new handler before dropping the old one so no record is lost in between.
        root.addHandler(handler)
        for h in list(root.handlers):
            if isinstance(h, _RelayHandler) and h is not handler:
                root.removeHandler(h)
                with contextlib.suppress(ValueError, OSError):
                    h.flush()  # its stream may be closed already (a CLI run under a test)
                h.close()  # does not close the underlying stream
        root.setLevel(lvl)
        # what our formatters never print is not gathered per record either (the logging
        # HOWTO's "Optimization"): the caller's file and line (a walk up the stack), the
        # process id (a getpid system call per record) and the multiprocessing name
        logging._srcfile = None
        logging.logProcesses = False
        logging.logMultiprocessing = False
        # aiosmtpd logs SMTP command lines (addresses) at INFO and DATA (bodies) at DEBUG.
        aiosmtpd_level = max(lvl, logging.INFO) if unmask else max(lvl, logging.WARNING)
        logging.getLogger(_AIOSMTPD_LOGGER).setLevel(aiosmtpd_level)
        for name in _CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(max(lvl, logging.WARNING))


def reconfigure(level: str | int = "info", fmt: str = "json", unmask: bool = False) -> None:
    """Re-apply logging settings (SIGHUP reload), keeping the current output stream."""
    current = _find_handler(logging.getLogger())
    setup_logging(level, fmt, unmask, stream=current.stream if current is not None else None)


def _exc_info_of(value: object) -> _ExcInfo | None:
    if isinstance(value, BaseException):
        return (type(value), value, value.__traceback__)
    if value is True:
        t, v, tb = sys.exc_info()
        return (t, v, tb) if t is not None and v is not None else None
    if (
        isinstance(value, tuple)
        and len(value) == 3
        and isinstance(value[0], type)
        and issubclass(value[0], BaseException)
        and isinstance(value[1], BaseException)
    ):
        return (value[0], value[1], value[2])
    return None


def log_event(
    logger: logging.Logger, level: int, event: str, msg: str = "", /, **fields: object
) -> None:
    """Emit a structured event; ``fields`` are rendered (and masked) by the formatter.

    ``exc_info=True|exception|tuple`` or ``exc=<exception>`` attach an exception
    (rendered as ``exc_type``/``exc``, plus ``traceback`` at DEBUG only).
    """
    if not logger.isEnabledFor(level):
        return
    exc_info: _ExcInfo | None = None
    if "exc_info" in fields:
        exc_info = _exc_info_of(fields.pop("exc_info"))
    if exc_info is None and isinstance(fields.get("exc"), BaseException):
        exc_info = _exc_info_of(fields.pop("exc"))
    logger.log(
        level,
        msg,
        exc_info=exc_info,
        extra={"event": event, "fields": fields},
        stacklevel=2,
    )
