"""The id an upstream server gives a message in its reply to the final dot (pure).

Rules (``upstream_id(reply)``; patterns in this order, the first that yields a usable id wins):

pattern       reply to the final dot (servers seen giving it)                 id returned
------------  --------------------------------------------------------------  ----------------
microsoft     "250 2.6.0 <a@b.prod.outlook.com> [InternalId=..] .. Queued      a@b.prod.outl...
              mail for delivery", "250 2.0.0 OK <a@b> [Hostname=..]"
              (Microsoft 365, Exchange, Outlook.com): "<id>" first on a line
ses           "250 Ok 0100018c..-..-000000" (Amazon SES)                       0100018c..-000000
gmail         "250 2.0.0 OK  1700000000 d9443c01a7336-1dc..  - gsmtp"          d9443c01a7336-1dc..
queued-on     "250 2.0.0 Ok: queued on HOST [as] 1430081058-6ltg.." (Yandex)   1430081058-6ltg..
queued-as     "250 2.0.0 Ok: queued as 4Q1x2Y3zZ8z9" (Postfix, SendGrid,       4Q1x2Y3zZ8z9
              Brevo, MailerSend, NetEase, Emailit, MailHog, this relay)
haraka        "250 Message Queued (51DE505A-...-45ED43F49E96.1)" (Haraka)      51DE505A-...96.1
exim          "250 OK id=1rXyZ-000abc-12" (Exim, also SMTP2Go, Mail.ru)        1rXyZ-000abc-12
accepted      "250 2.0.0 x8ABC123456789 Message accepted for delivery"         x8ABC123456789
              (Sendmail; OpenSMTPD "250 2.0.0 3f4a5b6c Message ...")
qmail         "250 ok 1700000000 qp 12345" (qmail)                             1700000000.12345
queued        "250 2.0.0 OK: queued 2K6C7TNVWUIRJYGYXJ6K4TYT" (go-smtp)        2K6C7TNVWUIRJYGY..
ok            "250 2.0.0 OK 00/00-28443-3AF54065" (Momentum): "OK <id>" is     00/00-28443-3AF5..
              the whole line

- Input: the reply as the delivery log has it (``str(Reply)``: "250 2.0.0 text", lines joined
  by " / "), a raw reply (lines joined by "\\n", the code repeated on each), or only the text
  after the code. Each line loses its leading code and enhanced status code before matching.
  A reply whose code is not 2xx has no id (None).
- Bounded: only the first ``MAX_SCAN`` characters are looked at; a token cut by that limit is
  dropped rather than returned truncated.
- The id: 1 to ``MAX_ID`` characters of printable ASCII without spaces. Surrounding "<>" and
  trailing punctuation (. , ; : ! ? quotes, a closing bracket that opens nowhere in the id)
  are removed; an id delimited by "<>" keeps everything between them.
- A word ("Ok", "queued": a letter, then lower-case letters) is never an id. Otherwise
  explicit markers ("queued as", "id=", "<...>", Haraka's parentheses) take any token; the
  loose patterns (gmail, accepted, queued, ok) need a token of at least 6 characters with a
  digit that is neither an enhanced status code ("2.0.0:") nor a bare Unix time (9-13
  digits, seconds or milliseconds).
- None, never a guess: "250 OK", "250 2.0.0 Ok", "250 Great success" (Mailgun), "250
  Accepted", "250 ok dirdel" (Yahoo), "250 2.0.0 Message queued for delivery." (Stalwart),
  "250 OK: queued as." (QQ Mail), "250 Queued mail for delivery", "250 2.0.0 OK 1700000000"
  (a time alone).

Decisions:

- Microsoft puts the message's Message-ID in angle brackets (the one the message carried,
  else the one Exchange gave it), not a queue id. It is what Microsoft's message trace
  searches by, so it is returned, without the brackets. "InternalId" is only unique within
  one Exchange server and is not returned.
- Gmail: the token after the time is Google's id for the transaction (what Google's support
  asks for); the time alone is not an id.
- qmail names no message: it gives the time and the qmail-queue process id ("qp", which
  qmail-send logs as "qp 12345"). Either alone repeats; the pair is returned as "TIME.QP".
- A list ("queued as em_1,em_2", Emailit with several recipients) is kept whole: splitting
  would hand every recipient the first one's id, and feedback matched by upstream id
  (relay/feedback/apply.py) would then land on the wrong recipient. NetEase's single id
  contains a comma too ("smtp13,EcCowAAH6pONaCdiDzW+Gg--.24616S3").
- amavisd-new passes on the next hop's reply ("250 2.6.0 Ok, id=04497-01, from MTA(..): 250
  Ok: queued as EFD4020904"): "queued as" ranks above "id=", so the id of the server that
  now holds the message wins.
- Linear time: no pattern nests quantifiers (the tests run relay/mail/regex_guard.py's check on
  each), and a token is followed by text that cannot continue it, so a failed attempt costs
  at most the token's length.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Final

__all__ = ["MAX_ID", "MAX_SCAN", "PATTERNS", "upstream_id"]

MAX_SCAN: Final = 1000  # characters of the reply looked at
MAX_ID: Final = 200  # longest id returned

_FLAGS: Final = re.IGNORECASE | re.MULTILINE | re.ASCII
# Printable ASCII except space, "<" and ">": the characters an id may have.
_TOK: Final = r"[\x21-\x3b\x3d\x3f-\x7e]+"
# The token ends here: at whitespace, "<", ">" or the end, not inside other characters.
_END: Final = r"(?![^\s<>])"

# (name, pattern, loose): group 1 is the id (qmail: groups 1 and 2). Order: specific first.
PATTERNS: Final[tuple[tuple[str, re.Pattern[str], bool], ...]] = (
    ("microsoft", re.compile(rf"^(?:OK:?\s+)?<({_TOK})>", _FLAGS), False),
    (
        "ses",
        re.compile(
            r"\bOK\s+(0[0-9a-f]{15}-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}"
            rf"-[0-9a-f]{{12}}-[0-9]{{6}}){_END}",
            _FLAGS,
        ),
        False,
    ),
    ("gmail", re.compile(rf"\bOK\s+(?:[0-9]{{9,11}}\s+)?({_TOK})\s+-\s+gsmtp\b", _FLAGS), True),
    ("queued-on", re.compile(rf"\bqueued\s+on\s+{_TOK}\s+(?:as\s+)?({_TOK}){_END}", _FLAGS), False),
    ("queued-as", re.compile(rf"\bqueued\s+as\s+<?({_TOK}){_END}", _FLAGS), False),
    ("haraka", re.compile(rf"\bqueued\s+\(({_TOK}){_END}", _FLAGS), False),
    ("exim", re.compile(rf"\bid=<?({_TOK}){_END}", _FLAGS), False),
    (
        "accepted",
        re.compile(rf"(?<!\S)({_TOK})\s+Message\s+accepted\s+for\s+delivery\b", _FLAGS),
        True,
    ),
    ("qmail", re.compile(r"\bok\s+([0-9]{9,11})\s+qp\s+([0-9]{1,10})\b", _FLAGS), False),
    ("queued", re.compile(rf"\bqueued\s+({_TOK})\s*$", _FLAGS), True),
    ("ok", re.compile(rf"^OK(?::\s*|\s+)({_TOK})\s*$", _FLAGS), True),
)

_LINES: Final = re.compile(r"\r\n|[\r\n]| / ")
# A line's reply code (RFC 5321 §4.2) and enhanced status code (RFC 3463; OpenSMTPD writes
# "2.0.0:"). [0-9], not \d: only ASCII digits.
_PREFIX: Final = re.compile(
    r"[ \t]*(?:[0-9]{3}(?:[ -]|$))?[ \t]*(?:[245]\.[0-9]{1,3}\.[0-9]{1,3}:?(?:[ \t]+|$))?",
    re.ASCII,
)
_CODE: Final = re.compile(r"[ \t]*([0-9])[0-9]{2}(?:[ -]|$)", re.ASCII)
_ENHANCED: Final = re.compile(r"[245]\.[0-9]{1,3}\.[0-9]{1,3}:?", re.ASCII)
_UNIX_TIME: Final = re.compile(r"[0-9]{9,13}", re.ASCII)
_DIGIT: Final = re.compile(r"[0-9]", re.ASCII)
_WORD: Final = re.compile(r"[A-Za-z][a-z]*", re.ASCII)  # "Ok", "queued": words, not ids
_TRAILING: Final = ".,;:!?'\""
_OPENERS: Final = {")": "(", "]": "[", "}": "{"}
_SPACE: Final = " \t\r\n\f\v"
_LOOSE_MIN: Final = 6


@lru_cache(maxsize=64)  # a transaction's recipients share the one reply to its dot
def upstream_id(reply: str) -> str | None:
    """The id in ``reply`` (the upstream's reply to the final dot), or None (module rules).
    A pure function of the text, ~5 us a call: one parse per transaction, not per recipient."""
    text = reply[:MAX_SCAN]
    if len(reply) > MAX_SCAN and reply[MAX_SCAN] not in _SPACE:
        # The last token runs past the limit: drop it rather than return part of an id.
        cut = len(text)
        while cut > 0 and text[cut - 1] not in _SPACE:
            cut -= 1
        text = text[:cut]
    code = _CODE.match(text)
    if code is not None and code.group(1) != "2":
        return None
    lines: list[str] = []
    for line in _LINES.split(text):
        prefix = _PREFIX.match(line)
        lines.append(line[prefix.end() :] if prefix is not None else line)
    body = "\n".join(lines)
    for name, pattern, loose in PATTERNS:
        for match in pattern.finditer(body):
            found = _candidate(name, match, loose)
            if found is not None:
                return found
    return None


def _candidate(name: str, match: re.Match[str], loose: bool) -> str | None:
    if name == "qmail":
        return f"{match.group(1)}.{match.group(2)}"
    token = match.group(1)
    if name != "microsoft":  # "<...>" delimits the id: nothing inside is punctuation
        token = _strip(token)
    if not 1 <= len(token) <= MAX_ID or _WORD.fullmatch(token) is not None:
        return None
    if loose and (
        len(token) < _LOOSE_MIN
        or _DIGIT.search(token) is None
        or _ENHANCED.fullmatch(token) is not None
        or _UNIX_TIME.fullmatch(token) is not None
    ):
        return None
    return token


def _strip(token: str) -> str:
    token = token.lstrip("'\"")
    while token:
        last = token[-1]
        if last in _TRAILING or (last in _OPENERS and _OPENERS[last] not in token):
            token = token[:-1]
        else:
            break
    return token
