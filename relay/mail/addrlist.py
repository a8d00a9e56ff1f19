"""RFC 5322 address lists as they were written: a tokenizer that keeps every octet, and the
one change the relay makes in them (a bare local part gets the local domain).

Rules:
- A field is read as it stands, folds included: FWS (RFC 5322 §3.2.2) is a run of WSP or a
  CRLF followed by WSP, so a fold is white space like any other and every token's offsets
  are offsets in the original octets. Nothing is re-generated: a change is an insertion at
  the end of one token, and every other octet stays where it was (so do the line breaks).
- Tokens (§3.2): white space, comment (nested, with quoted-pairs), quoted-string, domain
  literal, atom, and the specials `< > : ; @ , .`. An atom is a run of atext with inner dots
  (`john.doe` is one token), UTF-8 allowed (RFC 6532 §3.2); an RFC 2047 encoded word is an
  atom like any other: only its octets, never its meaning, matter here.
- The structure (§3.4, §4.4): an address-list of mailboxes (name-addr `phrase <addr-spec>`
  or a bare addr-spec) and groups (`phrase: a, b;`), empty list elements allowed
  (obs-addr-list), an obs-route inside the angle brackets tolerated. A *bare local part* is
  a whole addr-spec without "@" (`root`, `root (Cron Daemon)`) or the whole content of an
  angle-addr (`<root>`, `Root <root>`): one ASCII dot-atom that is not an encoded word.
- Anything we are not certain about makes the whole field "unsure" (`bare_local_parts`
  returns None, the caller leaves the field byte for byte as it came): an unterminated
  quoted-string, comment, domain literal, angle-addr or group; a control character or bare
  CR/LF; octets that are not UTF-8; a phrase without an address (`Bob Jones`, a lone
  encoded word); a special where none belongs.
- Linear time: every token is one anchored match of a regex whose alternatives begin with
  different characters, under possessive quantifiers (`*+`, `++`: no backtracking, and no
  backtracking stack, which for a plain `*` over a 2 MiB quoted-string took 185 MB and
  grew faster than the input), or a loop that advances at every step; the structure is
  read in one pass over the tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Token kinds: these names, or the special character itself.
WS = "ws"
COMMENT = "comment"
QUOTED = "quoted"
LITERAL = "literal"
ATOM = "atom"
SPECIALS = frozenset("<>:;@,.")

# Controls (C0 but HTAB, DEL) never appear outside a quoted-pair's escaped WSP; CR only as
# the start of a fold.
_CTL = rb"\x00-\x08\x0a-\x1f\x7f"
_FOLD = rb"\r\n[ \t]"
_WSP = re.compile(rb"(?:[ \t]|" + _FOLD + rb")++")
# atext (§3.2.3) plus octets of UTF-8 (RFC 6532 §3.2; the caller checked the encoding)
_ATEXT = rb"[^\x00-\x20\x7f()<>\[\]:;@\\,.\"]"
_ATOM = re.compile(_ATEXT + rb"++(?:\." + _ATEXT + rb"++)*+")
_QUOTED = re.compile(rb'"(?:[^"\\' + _CTL + rb"]|\\[^" + _CTL + rb"]|" + _FOLD + rb')*+"')
_LITERAL = re.compile(rb"\[(?:[^\[\]\\" + _CTL + rb"]|\\[^" + _CTL + rb"]|" + _FOLD + rb")*+\]")
_CTEXT = re.compile(rb"(?:[^()\\" + _CTL + rb"]|\\[^" + _CTL + rb"]|" + _FOLD + rb")++")

_PHRASE = frozenset({ATOM, QUOTED, "."})  # obs-phrase (§4.1) allows "." in a display name
_ADDR_SPEC = frozenset({ATOM, QUOTED, LITERAL, ".", "@"})
_ROUTE = _ADDR_SPEC | {",", ":"}  # obs-angle-addr: `<@a,@b:user@host>` (§4.4)


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    start: int
    end: int


def tokenize(text: bytes, pos: int = 0) -> list[Token] | None:
    """The tokens of `text[pos:]`, or None when some octet fits no token."""
    out: list[Token] = []
    n = len(text)
    while pos < n:
        ch = text[pos : pos + 1]
        kind: str
        if ch in b"<>:;@,.":
            out.append(Token(ch.decode("ascii"), pos, pos + 1))
            pos += 1
            continue
        if ch == b"(":
            end = _comment_end(text, pos)
            if end < 0:
                return None
            out.append(Token(COMMENT, pos, end))
            pos = end
            continue
        if ch in b" \t\r":
            kind, m = WS, _WSP.match(text, pos)
        elif ch == b'"':
            kind, m = QUOTED, _QUOTED.match(text, pos)
        elif ch == b"[":
            kind, m = LITERAL, _LITERAL.match(text, pos)
        else:
            kind, m = ATOM, _ATOM.match(text, pos)
        if m is None:
            return None
        out.append(Token(kind, pos, m.end()))
        pos = m.end()
    return out


def _comment_end(text: bytes, pos: int) -> int:
    """The offset after the comment opening at `pos` (nested comments, §3.2.2), or -1."""
    depth = 0
    n = len(text)
    while pos < n:
        ch = text[pos : pos + 1]
        if ch == b"(":
            depth += 1
            pos += 1
        elif ch == b")":
            depth -= 1
            pos += 1
            if depth == 0:
                return pos
        else:
            m = _CTEXT.match(text, pos)
            if m is None:
                return -1
            pos = m.end()
    return -1


def bare_local_parts(text: bytes, pos: int = 0) -> list[int] | None:
    """The end offsets of the bare local parts in the address-list `text[pos:]` (the value
    of a From/To/Cc/... field, folds included), in order; None when unsure (see the rules).
    `text` must be valid UTF-8 (the caller decodes it strictly first)."""
    tokens = tokenize(text, pos)
    if tokens is None:
        return None
    sig = [t for t in tokens if t.kind not in (WS, COMMENT)]
    n = len(sig)
    ends: list[int] = []
    in_group = False
    i = 0
    while i < n:
        # one list element: up to a separator, or to the "<" or ":" that gives its shape
        j = i
        while j < n and sig[j].kind not in (",", ";", ":", "<"):
            j += 1
        words = sig[i:j]
        stop = sig[j].kind if j < n else ""
        if stop == "<":  # name-addr: [phrase] "<" addr-spec ">"
            if any(t.kind not in _PHRASE for t in words):
                return None
            k = j + 1
            while k < n and sig[k].kind in _ROUTE:
                k += 1
            if k == n or sig[k].kind != ">":
                return None
            inner = sig[j + 1 : k]
            if len(inner) == 1:
                if not _bare(text, inner[0]):
                    return None
                ends.append(inner[0].end)
            elif inner and not any(t.kind == "@" for t in inner):
                return None
            i = k + 1
        elif stop == ":":  # group: phrase ":" [mailbox-list] ";" (no groups in groups)
            if in_group or not words or any(t.kind not in _PHRASE for t in words):
                return None
            in_group = True
            i = j + 1
            continue
        else:  # an addr-spec, or an empty element
            if len(words) == 1 and words[0].kind == ATOM:
                if not _bare(text, words[0]):
                    return None
                ends.append(words[0].end)
            elif words and not _addr_spec(words):
                return None
            i = j
        # after an element: a separator, or the end
        if i < n:
            sep = sig[i].kind
            if sep == ";" and in_group:
                in_group = False
                i += 1
                if i < n and sig[i].kind != ",":
                    return None
                i += 1
            elif sep == ",":
                i += 1
            else:
                return None
    if in_group:  # a group without its ";"
        return None
    return ends


def _bare(text: bytes, tok: Token) -> bool:
    """An atom that may be a local part to qualify: ASCII, and no encoded word (RFC 2047
    §2) whose `=?...?=` would be a display name, not an address."""
    word = text[tok.start : tok.end]
    return tok.kind == ATOM and word.isascii() and b"=?" not in word


def _addr_spec(words: list[Token]) -> bool:
    """local-part "@" domain, loosely (nothing is changed in it): one "@" with something on
    each side, made only of words, dots and a domain literal."""
    ats = [k for k, t in enumerate(words) if t.kind == "@"]
    return (
        len(ats) == 1 and 0 < ats[0] < len(words) - 1 and all(t.kind in _ADDR_SPEC for t in words)
    )


# RFC 5322 §2.1.1: a line is at most 998 octets without its CRLF.
MAX_LINE = 998


def qualify_field(field: bytes, domain: str) -> bytes | None:
    """`field` (a whole header field, `Name: value` with its folds as CRLF + WSP, without
    the final CRLF) with `@domain` after each bare local part; None when there is none or
    the field is unsure (see the rules). The line breaks stay where they were; a line that
    the insertion takes past 998 octets is folded before a white-space run of that line."""
    colon = field.find(b":")
    if colon < 0:
        return None
    if _all_qualified(field, colon + 1):
        return None
    try:
        field.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ends = bare_local_parts(field, colon + 1)
    if not ends:
        return None
    add = b"@" + domain.encode("utf-8")
    parts: list[bytes] = []
    last = 0
    for e in ends:
        parts += (field[last:e], add)
        last = e
    parts.append(field[last:])
    new = b"".join(parts)
    if all(len(line) <= MAX_LINE for line in new.split(b"\r\n")):
        return new
    return _refold(new, field.split(b"\r\n"))


# what makes the quick check below unsure: a quoted string, a comment, an escape, a
# domain literal (inside them a separator or "@" is only text)
_UNSURE = re.compile(rb'["(\\\[]')
_SEPARATORS = re.compile(rb"[,;:]")


def _all_qualified(field: bytes, pos: int) -> bool:
    """True when the address list `field[pos:]` surely has no bare local part (the common
    field, `a@b.example, Name <c@d.example>`), without tokenizing it: no quoted string,
    comment, escape or domain literal, and an "@" between every two separators. A bare
    local part is a lone atom or `<atom>` of its own element, so never shares its
    element with an "@" (bare_local_parts is unsure of such an element anyway). False
    means: read it whole (bare_local_parts)."""
    value = field[pos:]
    if _UNSURE.search(value) is not None:
        return False
    if _SEPARATORS.search(value) is None:  # one element (the usual): no split
        return b"@" in value or not value.strip()
    return all(b"@" in part or not part.strip() for part in _SEPARATORS.split(value))


def _refold(new: bytes, old_lines: list[bytes]) -> bytes | None:
    """`new` with each line that grew past MAX_LINE folded (CRLF inserted before a run of
    WSP outside quoted-strings and comments, never leaving a line of only WSP); None when a
    line cannot be folded to fit. Lines that were long before are left as they were."""
    tokens = tokenize(new)
    assert tokens is not None  # an insertion after an atom keeps the field tokenizable
    # not right after the field name's colon: a first line of `To:` alone is legal but odd
    after_name = new.find(b":") + 1
    points = [
        t.start
        for t in tokens
        if t.kind == WS
        and after_name < t.start
        and t.end < len(new)
        and b"\r" not in new[t.start : t.end]
    ]
    out: list[bytes] = []
    start = 0
    p = 0
    for old in old_lines:
        end = new.find(b"\r\n", start)
        end = len(new) if end < 0 else end
        line = new[start:end]
        while p < len(points) and points[p] <= start:
            p += 1
        if len(line) <= MAX_LINE or len(old) > MAX_LINE:
            out.append(line)
        else:
            s = start
            while end - s > MAX_LINE:
                best = -1
                while p < len(points) and points[p] < end and points[p] - s <= MAX_LINE:
                    best = points[p]
                    p += 1
                if best <= s:
                    return None
                out.append(new[s:best])
                s = best
            out.append(new[s:end])
        start = end + 2
    return b"\r\n".join(out)
