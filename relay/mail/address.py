"""SMTP paths (RFC 5321 §4.1.2) parsed once, into the exact form that is stored and sent.

Rules:
- One pass over the characters, no regular expression with nested quantifiers: the time is
  linear in the length of the argument whatever a client sends (a hostile `MAIL FROM` must
  never stall the event loop).
- The address we keep is the client's own text between `<` and `>` (minus an obsolete
  source route, RFC 5321 §4.1.2 / Appendix C), after it has been checked. It is what goes
  into the spool, the logs, the suppression list and, unchanged, the upstream's `MAIL FROM` /
  `RCPT TO`: nothing later re-parses it into another address.
- A control character (C0, DEL, C1), a bare CR or LF, a NUL, a space outside quotes, an
  unbalanced `<` / `>` or a byte that is not UTF-8 is a syntax error, answered 5xx.
- A quoted local part (`"john doe"@example.org`) and SMTPUTF8 addresses (RFC 6531 §3.3:
  UTF-8 in atext, qtext and the domain's U-labels) keep working. Characters that are not
  seen, or that reorder what is seen, are refused anywhere in an address: Unicode format
  characters (category Cf: bidi overrides and isolates such as U+202E, zero-width ones such
  as U+200B, U+FEFF) and line/paragraph separators; an address shown to a person must be
  the address that is used. (This refuses ZWJ/ZWNJ too, which IDNA2008 allows in a few
  scripts' labels in context.) Whether UTF-8 is allowed at all is the session's question
  (SMTPUTF8 on MAIL, RFC 6531 §3.4): relay/inbound/core.py.
- An address literal is RFC 5321 §4.1.3's: `[1.2.3.4]` a dotted quad, `[IPv6:...]` an
  IPv6 address (checked by `ipaddress` after its characters, so in linear time); no other
  tag is registered with IANA, so a general literal (`[tag:...]`) is refused.
- Limits of RFC 5321 §4.5.3.1: a local part of at most 64 octets, a domain of at most 255,
  a path of at most 256.
"""

from __future__ import annotations

import ipaddress
import unicodedata
from dataclasses import dataclass

# RFC 5322 §3.2.3 atext (the ASCII part); UTF-8 beyond ASCII is allowed too (RFC 6531 §3.3).
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_ATEXT = frozenset(_ALNUM + "!#$%&'*+-/=?^_`{|}~")
_LDH = frozenset(_ALNUM + "-")
# The same sets as strings, for the fast paths of the usual ASCII address: `not s.strip(chars)`
# is "every character of s is in chars", decided in one pass in C. Each fast path only ever
# accepts what its loop (the function named `..._loop`) accepts, with the same result, and
# hands everything else to the loop (tests/mail/test_address.py compares them).
_ATEXT_DOT_CHARS = "".join(sorted(_ATEXT)) + "."
_LDH_CHARS = "".join(sorted(_LDH))
_HEX = frozenset("0123456789abcdefABCDEF")

MAX_LOCAL = 64
MAX_DOMAIN = 255
MAX_PATH = 256


class AddressError(ValueError):
    """A path that is not RFC 5321 syntax; the message says what is wrong, for the reply."""


@dataclass(frozen=True, slots=True)
class Path:
    address: str  # "" for the null reverse-path <>
    params: str  # the text after the closing ">", stripped (ESMTP parameters)


# Unicode categories refused in an address: format characters (Cf: bidi controls, zero
# width, BOM, tags) and line/paragraph separators. unicodedata.category is a table lookup.
_UNSEEN = frozenset({"Cf", "Zl", "Zp"})


def _unseen(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSEEN


def _non_ascii_ok(ch: str) -> bool:
    """UTF-8 beyond ASCII, but no C1 control character, no lone surrogate (a byte that
    was not UTF-8, kept by aiosmtpd's surrogateescape decoding) and nothing unseen."""
    o = ord(ch)
    return o >= 0xA0 and not 0xD800 <= o <= 0xDFFF and not _unseen(ch)


def _printable(ch: str) -> bool:
    o = ord(ch)
    return 32 <= o < 127 or (o >= 0xA0 and not 0xD800 <= o <= 0xDFFF)


def check_domain(domain: str) -> None:
    """RFC 5321 §4.1.2 Domain (sub-domains of letters, digits and hyphens, not starting or
    ending with a hyphen, at most 63 octets each) or an address literal; U-labels allowed
    (RFC 6531). Raises AddressError."""
    if not domain:
        raise AddressError("missing domain")
    octets = len if domain.isascii() else _octets  # ASCII: a character is an octet
    if octets(domain) > MAX_DOMAIN:
        raise AddressError("domain too long")
    if domain[0] == "[":
        _check_literal(domain)
        return
    for label in domain.split("."):
        if not label:
            raise AddressError("empty label in domain")
        if octets(label) > 63:
            raise AddressError("domain label too long")
        if label[0] == "-" or label[-1] == "-":
            raise AddressError("domain label starts or ends with '-'")
        if label.strip(_LDH_CHARS):  # not letters, digits and hyphens alone
            _check_label_loop(label)


def _octets(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_label_loop(label: str) -> None:
    for ch in label:
        if ch not in _LDH and not _non_ascii_ok(ch):
            raise AddressError(f"character {_show(ch)} not allowed in a domain")


def _check_literal(text: str) -> None:
    """RFC 5321 §4.1.3 address literal: [1.2.3.4] or [IPv6:...]."""
    if len(text) < 3 or text[-1] != "]":
        raise AddressError("malformed address literal")
    inner = text[1:-1]
    if inner[:5].lower() == "ipv6:":
        body = inner[5:]
        # the characters first (a bounded, linear pass), then the address itself:
        # `[IPv6:::::]` has the right characters and is no address
        if not body or any(c not in _HEX and c not in ":." for c in body):
            raise AddressError("malformed IPv6 address literal")
        try:
            ipaddress.IPv6Address(body)
        except ValueError:
            raise AddressError("malformed IPv6 address literal") from None
        return
    if ":" in inner:  # General-address-literal: Standardized-tag ":" 1*dcontent
        raise AddressError("address literal tag not registered (only IPv6: is, RFC 5321 §4.1.3)")
    parts = inner.split(".")
    if len(parts) != 4 or not all(
        p.isascii() and p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts
    ):
        raise AddressError("malformed IPv4 address literal")


def _local_part_end(text: str) -> int:
    """Index of the "@" that ends the local part at the start of `text`; checks the local
    part on the way (Dot-string or Quoted-string, RFC 5321 §4.1.2)."""
    at = text.find("@")
    if at > 0:  # an ASCII Dot-string (the usual local part): decided in C
        local = text[:at]
        if (
            not local.strip(_ATEXT_DOT_CHARS)
            and local[0] != "."
            and local[-1] != "."
            and ".." not in local
        ):
            return at
    return _local_part_end_loop(text)


def _local_part_end_loop(text: str) -> int:
    if not text:
        raise AddressError("empty address")
    if text[0] == '"':
        i, n = 1, len(text)
        while i < n:
            ch = text[i]
            if ch == "\\":  # quoted-pairSMTP = %d92 %d32-126
                if i + 1 >= n or not 32 <= ord(text[i + 1]) < 127:
                    raise AddressError("bad quoted pair in local part")
                i += 2
                continue
            if ch == '"':
                break
            # qtextSMTP: %d32-33 / %d35-91 / %d93-126, UTF-8 (nothing unseen)
            if not _printable(ch) or (ord(ch) >= 0xA0 and _unseen(ch)):
                raise AddressError(f"character {_show(ch)} not allowed in a local part")
            i += 1
        else:
            raise AddressError("unterminated quoted local part")
        end = i + 1
        if end >= n or text[end] != "@":
            raise AddressError("missing '@' after the quoted local part")
        return end
    i, n, prev_dot = 0, len(text), True
    while i < n:
        ch = text[i]
        if ch == "@":
            break
        if ch == ".":
            if prev_dot:
                raise AddressError("empty atom in local part")
            prev_dot = True
        elif ch in _ATEXT or _non_ascii_ok(ch):
            prev_dot = False
        else:
            raise AddressError(
                f"character {_show(ch)} not allowed in a local part"
                + (" (quote it)" if ch in ' "(),:;<>[\\]' else "")
            )
        i += 1
    if i == 0:
        raise AddressError("empty local part")
    if i >= n:
        raise AddressError("missing '@' and domain")
    if prev_dot:
        raise AddressError("local part ends with '.'")
    return i


def check_mailbox(address: str) -> None:
    """Mailbox = Local-part "@" ( Domain / address-literal ). Raises AddressError."""
    at = _local_part_end(address)
    if len(address[:at].encode("utf-8", "surrogatepass")) > MAX_LOCAL:
        raise AddressError("local part longer than 64 octets")
    check_domain(address[at + 1 :])


def check_local_part(local: str) -> None:
    """A bare local part (`root`, as cron and old apps send): Dot-string or Quoted-string,
    at most 64 octets. Raises AddressError."""
    end = _local_part_end(local + "@")
    if end != len(local):
        raise AddressError("not a bare local part")
    if len(local.encode("utf-8", "surrogatepass")) > MAX_LOCAL:
        raise AddressError("local part longer than 64 octets")


def parse_path(arg: str, *, null_ok: bool, bare_ok: bool = False) -> Path:
    """`<mailbox> [params]`, `<@a,@b:mailbox> [params]`, or (with `null_ok`) `<> [params]`.

    Raises AddressError for anything else; never a super-linear amount of work."""
    if not (arg.isascii() and arg.isprintable()):  # printable ASCII has nothing to refuse
        _check_characters_loop(arg)
    s = arg.lstrip(" ")
    if not s.startswith("<"):
        raise AddressError("the address must be enclosed in <>")
    close = _closing_bracket(s)
    inner, rest = s[1:close], s[close + 1 :]
    if rest and rest[0] != " ":
        raise AddressError("text after '>' must be separated by a space")
    if inner == "":
        if not null_ok:
            raise AddressError("empty address")
        return Path("", rest.strip())
    if inner[0] == "@":  # RFC 5321 §4.1.2 A-d-l: accepted and ignored (Appendix C)
        colon = inner.find(":")
        if colon < 0:
            raise AddressError("malformed source route")
        for hop in inner[:colon].split(","):
            if not hop.startswith("@"):
                raise AddressError("malformed source route")
            check_domain(hop[1:])
        inner = inner[colon + 1 :]
    if len(inner.encode("utf-8", "surrogatepass")) > MAX_PATH - 2:
        raise AddressError("path longer than 256 octets")
    if bare_ok and "@" not in inner.rpartition('"')[2]:
        check_local_part(inner)  # the caller qualifies it (local.domain)
        return Path(inner, rest.strip())
    check_mailbox(inner)
    return Path(inner, rest.strip())


def _check_characters_loop(arg: str) -> None:
    for ch in arg:
        o = ord(ch)
        if o < 32 or o == 127 or 0x80 <= o < 0xA0 or 0xD800 <= o <= 0xDFFF:
            raise AddressError(f"character {_show(ch)} not allowed in a command")
        if o >= 0xA0 and _unseen(ch):
            raise AddressError(
                f"invisible or reordering character {_show(ch)} not allowed in an address"
            )


def _closing_bracket(s: str) -> int:
    """Index of the ">" that closes the path opened at s[0], skipping a quoted local part;
    a second "<" or a missing ">" is an error."""
    if '"' not in s:  # no quoted local part: the first "<" or ">" after s[0] decides
        close, opened = s.find(">", 1), s.find("<", 1)
        if opened >= 0 and (close < 0 or opened < close):
            raise AddressError("unbalanced '<'")
        if close < 0:
            raise AddressError("missing '>'")
        return close
    return _closing_bracket_loop(s)


def _closing_bracket_loop(s: str) -> int:
    i, n, quoted = 1, len(s), False
    while i < n:
        ch = s[i]
        if quoted:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch == "<":
            raise AddressError("unbalanced '<'")
        elif ch == ">":
            return i
        i += 1
    raise AddressError("missing '>'")


def _show(ch: str) -> str:
    o = ord(ch)
    if 32 < o < 127:
        return repr(ch)
    if o == 32:
        return "space"
    if 0xDC80 <= o <= 0xDCFF:
        return f"byte 0x{o - 0xDC00:02X}"
    return f"U+{o:04X}"


# Unicode categories never written raw to a terminal: format characters (bidi overrides
# such as U+202E reorder what follows on screen, zero-width ones hide text, U+FEFF), line
# and paragraph separators, surrogates, unassigned code points.
_HIDDEN = frozenset({"Cf", "Zl", "Zp", "Cs", "Cn"})


def _shown_raw(ch: str, keep: str) -> bool:
    o = ord(ch)
    if o < 0x80:
        return 32 <= o < 127 or ch in keep
    return _printable(ch) and unicodedata.category(ch) not in _HIDDEN


def printable(text: str, keep: str = "") -> str:
    """Text safe for an operator's terminal and for a log: control characters, bytes that
    were not UTF-8, and invisible or reordering characters (bidi, zero-width: Unicode
    category Cf) shown as \\xNN / \\uNNNN, never written raw. `keep` names ASCII controls
    to leave as they are (a TAB in a folded header)."""
    if text.isascii() and text.isprintable() and not keep:
        return text
    out = []
    for ch in text:
        if _shown_raw(ch, keep):
            out.append(ch)
        else:
            o = ord(ch)
            if 0xDC80 <= o <= 0xDCFF:
                out.append(f"\\x{o - 0xDC00:02x}")
            elif o < 0x100:
                out.append(f"\\x{o:02x}")
            elif o > 0xFFFF:
                out.append(f"\\U{o:08x}")
            else:
                out.append(f"\\u{o:04x}")
    return "".join(out)
