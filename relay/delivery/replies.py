"""SMTP replies and what they mean for a delivery attempt (pure, sans-I/O).

Rules (``classify(reply, phase)``; "enh" is the RFC 3463 enhanced status code):

reply (first matching row wins)                           outcome    why
--------------------------------------------------------  ---------  -------------------------
2xx where expected (3xx at DATA, 2xx/3xx at AUTH)         DELIVERED  RFC 5321 §4.2.1 1st digit
  RCPT 250/251/252 (any 2xx): recipient accepted; DOT 2xx: message delivered
1xx, a positive code where not expected, >= 600           TRANSIENT  desync, see below
any 4xx                                                   TRANSIENT  RFC 5321 §4.2.1 4yz
any 5xx at AUTH                                           TRANSIENT  operator's credentials
RCPT 552 without enh or with 5.5.3 "too many recipients"  TRANSIENT  RFC 5321 §4.5.3.1.10
5xx at MAIL, GREETING, EHLO, STARTTLS                     FAIL       no recipient seen yet
enh 5.1.7 / 5.1.8, "Sender address rejected" texts        FAIL       the sender is refused
enh 5.1.x (5.1.1, 5.1.2, 5.1.3, 5.1.6, 5.1.10 ...)        BOUNCE     bad destination address
enh 5.2.1 (mailbox disabled)                              BOUNCE     address no longer usable
RCPT 550/551/553 with enh 5.2.2-4, 5.3.x, 5.4.5, 5.6.x    FAIL       not the address's fault
RCPT 550/551/553 with enh 5.7.x (policy, spam, DMARC)     FAIL       message/client refused
RCPT 550/551/553 without enh, policy words in the text    FAIL       e.g. "blocked by RBL"
RCPT 550/551/553 otherwise (no enh, 5.0.0, 5.4.1, 5.5.0)  BOUNCE     RFC 5321 §4.2.2 mailbox
other 5xx (5.2.2 full, 5.7.x, 552 5.3.4 size, 554, 5.6.x  FAIL       permanent, not about
  content, 500-504 syntax, 550 at DATA/DOT without 5.1.x)              the address

- ``scope`` is ``recipient`` for RCPT replies and ``transaction`` for every other phase:
  MAIL/DATA/DOT and connection-level replies apply to every recipient of the transaction.
- ``closes_connection``: 421 in any phase (RFC 5321 §3.8), 221 (the server is closing,
  §4.2.2), any non-positive reply at CONNECT/GREETING (§3.1, §4.3.2), and any unexpected
  code (§4.2: the client "SHOULD ... terminate the mail transaction").
- ``throttled`` (4xx only; a 5xx is never retried, so there is nothing to slow down):
  421 (unless enh is a 4.4.x network status), enh 4.4.5 (congestion), enh 4.7.x except the
  TLS/authentication details 4.7.3-4.7.27, or text such as "rate limit", "too many"
  (but not "too many recipients": that asks for a smaller transaction, RFC 5321
  §4.5.3.1.10, not a slower sender), "try again later", "throttl", "deferred due to",
  Yahoo "[TS01]", Microsoft "(S3150)".

Decisions beyond the letter of RFC 3463, chosen so that a BOUNCE (which suppresses the
address) only ever means "this recipient address is bad":

- 5.1.x at MAIL is FAIL: MAIL FROM carries only the sender (RFC 5321 §3.3).  Replies
  before RCPT (GREETING, EHLO, STARTTLS) have seen no recipient either; CONNECT is kept
  because our resolver reports DNS facts about the recipient domain there.
  5.1.7/5.1.8 ("bad sender's mailbox/system address", RFC 3463 §3.2) are FAIL everywhere,
  and so is a reply whose text says the sender was rejected: Postfix checks the sender at
  RCPT time ("550 5.1.0 <s>: Sender address rejected: User unknown"), Exim too ("550
  Sender verify failed").
- 5.2.2 mailbox full is FAIL: RFC 3463 §3.3 calls it a "persistent transient" condition of a
  valid mailbox; the server chose 5xx so we stop retrying, but we must not suppress it.
  5.2.1 mailbox disabled is BOUNCE (Gmail: "The email account ... is disabled").
- At RCPT a 550/551/553 whose enh says the problem is not the address (5.2.2-5.2.4 mailbox
  limits, 5.3.x system, 5.4.5 congestion, 5.6.x content, 5.7.x policy) is FAIL; other enh
  codes (5.0.0, 5.4.1 Microsoft "Recipient address rejected: Access denied", 5.5.0
  Microsoft "mailbox unavailable") keep the code's meaning: BOUNCE.
- Unexpected codes are TRANSIENT: retrying risks at worst a duplicate or a delay, while
  treating an unknown positive code as success could silently lose mail and treating it as
  a failure could bounce deliverable mail.  At DOT only a 2xx proves delivery.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, TypedDict

__all__ = [
    "Outcome",
    "Phase",
    "Reply",
    "ReplyJSON",
    "Scope",
    "Verdict",
    "classify",
    "synthetic",
]


class Phase(StrEnum):
    """The SMTP command (or connection step) a reply answers."""

    CONNECT = "connect"  # TCP/TLS connect (and our own MX lookup before it)
    GREETING = "greeting"  # the 220 banner (RFC 5321 §4.3.1)
    EHLO = "ehlo"
    STARTTLS = "starttls"  # RFC 3207
    AUTH = "auth"  # RFC 4954
    MAIL = "mail"
    RCPT = "rcpt"
    DATA = "data"  # reply to the DATA command itself (354 expected)
    DOT = "dot"  # reply to the final "." that ends the content


class Outcome(StrEnum):
    DELIVERED = "delivered"  # accepted (at RCPT/MAIL/...: "go on"; at DOT: delivered)
    TRANSIENT = "transient"  # retry later
    BOUNCE = "bounce"  # the recipient address is permanently bad
    FAIL = "fail"  # permanent failure, but not the address's fault


class Scope(StrEnum):
    TRANSACTION = "transaction"
    RECIPIENT = "recipient"


class ReplyJSON(TypedDict):
    code: int
    enhanced: str | None
    text: str


# RFC 3463 §2: status-code = class "." subject "." detail, class in {2, 4, 5}, subject and
# detail 1*3digit.  RFC 2034 §4 puts it at the start of the reply text, on every line.
# [0-9], not \d: \d also matches non-ASCII digits, which int() would happily accept.
_ENHANCED_RE: Final = re.compile(r"([245])\.([0-9]{1,3})\.([0-9]{1,3})")
_LEADING_ENHANCED_RE: Final = re.compile(r"([245]\.[0-9]{1,3}\.[0-9]{1,3})(?:\s+|$)")
_FROM_STR_RE: Final = re.compile(r"([0-9]{3})(?:[ -](.*))?", re.DOTALL)
_SEPARATOR: Final = " / "


def _normalize_text(text: str) -> str:
    """One line: stripped non-empty lines joined by " / ".

    Replies end up in the spool, in logs and in DSN Diagnostic-Code header fields (RFC 3464
    §2.3.6), where a bare line break would corrupt the record or inject a header.
    aiosmtplib decodes with ``surrogateescape``; lone surrogates cannot be stored as UTF-8,
    so they become U+FFFD.
    """
    if not text.isascii():
        try:
            # Back to the bytes the server sent, then one U+FFFD per undecodable sequence.
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate that did not come from a byte
            raw = text.encode("utf-8", "surrogatepass")
        text = raw.decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines()]
    return _SEPARATOR.join(line for line in lines if line)


@dataclass(frozen=True, slots=True)
class Reply:
    """One SMTP reply: ``code``, optional RFC 3463 ``enhanced`` code and the human ``text``.

    ``text`` never contains the enhanced code prefix nor line breaks: lines of a multi-line
    reply are joined by ``" / "`` (normalized on construction).
    """

    code: int
    enhanced: str | None
    text: str

    def __post_init__(self) -> None:
        # Any three-digit code is representable so odd server replies can still be
        # classified (defensively); RFC 5321 §4.2 itself only allows 2xx-5xx.
        if not 100 <= self.code <= 999:
            raise ValueError(f"SMTP reply code must have three digits, got {self.code!r}")
        if self.enhanced is not None:
            if _ENHANCED_RE.fullmatch(self.enhanced) is None:
                raise ValueError(f"malformed enhanced status code {self.enhanced!r}")
            if self.enhanced[0] != str(self.code)[0]:
                # RFC 3463 §2: the class digit repeats the reply code's first digit.
                raise ValueError(f"enhanced code {self.enhanced} does not match {self.code}")
        normalized = _normalize_text(self.text)
        if normalized != self.text:
            object.__setattr__(self, "text", normalized)

    @classmethod
    def parse(cls, code: int, message: str) -> Reply:
        """Build a reply from a code and its raw (possibly multi-line) text.

        A leading ``X.Y.Z`` is taken as the enhanced code only when X matches the reply
        code's class digit (RFC 3463 §2, RFC 2034 §4); otherwise it stays in the text.  The
        same code repeated at the start of continuation lines (Gmail does) is stripped too.
        """
        lines = [line.strip() for line in message.splitlines()]
        lines = [line for line in lines if line]
        enhanced: str | None = None
        if lines:
            match = _LEADING_ENHANCED_RE.match(lines[0])
            if match is not None and match.group(1)[0] == str(code)[0]:
                enhanced = match.group(1)
                lines = [_strip_enhanced(line, enhanced) for line in lines]
        return cls(code, enhanced, _SEPARATOR.join(line for line in lines if line))

    @classmethod
    def from_str(cls, value: str) -> Reply:
        """Parse ``"550 5.1.1 text"`` (as produced by ``str()``) or a raw wire reply.

        A raw multi-line reply (``"550-5.1.1 a\\r\\n550 5.1.1 b"``) is accepted too: the
        code prefix of continuation lines is removed.
        """
        lines = [line for line in value.strip().splitlines() if line.strip()]
        match = _FROM_STR_RE.fullmatch(lines[0]) if lines else None
        if match is None:
            raise ValueError(f"not an SMTP reply: {value!r}")
        code = match.group(1)
        body = [match.group(2) or ""]
        for line in lines[1:]:
            more = _FROM_STR_RE.fullmatch(line.strip())
            if more is not None and more.group(1) == code:
                body.append(more.group(2) or "")
            else:
                body.append(line)
        return cls.parse(int(code), "\n".join(body))

    def to_json(self) -> ReplyJSON:
        return {"code": self.code, "enhanced": self.enhanced, "text": self.text}

    @classmethod
    def from_json(cls, data: ReplyJSON) -> Reply:
        return cls(data["code"], data["enhanced"], data["text"])

    @property
    def is_success(self) -> bool:
        """Positive completion (2yz) or positive intermediate (3yz), RFC 5321 §4.2.1."""
        return 200 <= self.code < 400

    @property
    def is_transient(self) -> bool:
        """Transient negative completion (4yz), RFC 5321 §4.2.1."""
        return 400 <= self.code < 500

    @property
    def is_permanent(self) -> bool:
        """Permanent negative completion (5yz), RFC 5321 §4.2.1."""
        return 500 <= self.code < 600

    def __str__(self) -> str:
        return " ".join(str(part) for part in (self.code, self.enhanced, self.text) if part)


def _strip_enhanced(line: str, enhanced: str) -> str:
    match = _LEADING_ENHANCED_RE.match(line)
    if match is not None and match.group(1) == enhanced:
        return line[match.end() :]
    return line


def synthetic(code: int, enhanced: str, text: str) -> Reply:
    """A reply we make up for a failure that produced none (timeout, refused, DNS ...).

    Only 4xx/5xx: a made-up reply never reports success.
    """
    if not 400 <= code < 600:
        raise ValueError(f"synthetic replies are 4xx or 5xx, got {code}")
    return Reply(code, enhanced, text)


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    closes_connection: bool
    throttled: bool
    scope: Scope


# What a positive reply's first digit must be in each phase (RFC 5321 §4.3.2; STARTTLS 220
# RFC 3207 §4; AUTH 235 final / 334 continue RFC 4954 §4; DATA 354).
_POSITIVE_CLASSES: Final[dict[Phase, frozenset[int]]] = {
    phase: frozenset({2}) for phase in Phase
} | {Phase.DATA: frozenset({3}), Phase.AUTH: frozenset({2, 3})}

# Phases whose replies can be about a recipient address: RCPT, DATA/DOT (servers that check
# recipients after the content, e.g. Exchange "550 5.1.1 RESOLVER.ADR.RecipNotFound"), and
# CONNECT, where our resolver reports DNS facts about the recipient domain (NXDOMAIN
# 5.1.2, RFC 7505 null MX 5.1.10).  Nothing before RCPT has seen a recipient.
_ADDRESS_PHASES: Final = frozenset({Phase.CONNECT, Phase.RCPT, Phase.DATA, Phase.DOT})

# RFC 3463 §3.2: X.1.7 bad sender's mailbox address syntax, X.1.8 bad sender's system address.
_SENDER_DETAILS: Final = frozenset({7, 8})

# Mailbox codes 550/551/553 (RFC 5321 §4.2.2) that mean "this address" at RCPT.
_ADDRESS_CODES: Final = frozenset({550, 551, 553})

# 4.7.x details describing TLS or authentication rather than the sending rate: RFC 3463 §3.8
# (X.7.3-X.7.7), RFC 4954 (X.7.8, X.7.9, X.7.11), RFC 5248 registry (X.7.10, X.7.12-X.7.19),
# RFC 7372 (X.7.20-X.7.25), RFC 7505 (X.7.27).
_SECURITY_DETAILS: Final = frozenset(range(3, 28))

# Texts of replies without an enhanced code that refuse the message or the client, not the
# mailbox (RBL listings, relay denial, authentication checks).
_POLICY_TEXT_RE: Final = re.compile(
    r"spam|block|blacklist|denylist|\brbl\b|dnsbl|reputation|\bpolicy\b|relay|rcpthosts"
    r"|denied|not permitted|authenticat|\bspf\b|\bdkim\b|\bdmarc\b|abuse|reverse dns",
    re.IGNORECASE,
)

# Texts saying the *sender* was refused.  Postfix checks the sender at RCPT time by default
# (smtpd_delay_reject) and answers e.g. "550 5.1.0 <s>: Sender address rejected: User unknown";
# Exim answers "550 Sender verify failed" at RCPT.  The recipient is innocent.
_SENDER_TEXT_RE: Final = re.compile(
    r"sender address rejected|sender verify failed|sender rejected|(?:invalid|unknown) sender",
    re.IGNORECASE,
)

# Texts of 4xx replies asking us to slow down.
_THROTTLE_TEXT_RE: Final = re.compile(
    r"rate[ -]?limit|throttl|too many (?!recipients\b)|try (?:again )?later"
    r"|deferred due to|temporarily deferred|server (?:is )?busy|too busy|slow down"
    r"|unusual rate|at a rate|unexpected volume"
    r"|\[TSS?\d+\]"  # Yahoo "[TS01]" .. "[TSS04]"
    r"|\(S\d{3,6}\)",  # Microsoft diagnostic tags such as "(S3150)", "(S775)"
    re.IGNORECASE,
)


def _enhanced_parts(reply: Reply) -> tuple[int, int] | None:
    """(subject, detail) of the enhanced code, e.g. (1, 1) for 5.1.1."""
    if reply.enhanced is None:
        return None
    _, subject, detail = reply.enhanced.split(".")
    return int(subject), int(detail)


def _is_expected_positive(reply: Reply, phase: Phase) -> bool:
    return reply.code // 100 in _POSITIVE_CLASSES[phase]


def _is_address_failure(reply: Reply, phase: Phase) -> bool:
    """Does this 5xx say the recipient address itself is bad?"""
    if phase not in _ADDRESS_PHASES or _SENDER_TEXT_RE.search(reply.text) is not None:
        return False
    parts = _enhanced_parts(reply)
    if parts is None:
        return (
            phase is Phase.RCPT
            and reply.code in _ADDRESS_CODES
            and _POLICY_TEXT_RE.search(reply.text) is None
        )
    subject, detail = parts
    if subject == 1:  # X.1.x addressing status, RFC 3463 §3.2
        return detail not in _SENDER_DETAILS
    if (subject, detail) == (2, 1):  # X.2.1 mailbox disabled, RFC 3463 §3.3
        return True
    if phase is not Phase.RCPT or reply.code not in _ADDRESS_CODES:
        return False
    not_about_address = (
        (subject == 2 and detail >= 2)  # X.2.2 full, X.2.3 too long, X.2.4 list expansion
        or subject in (3, 6, 7)  # system, content, policy
        or (subject, detail) == (4, 5)  # X.4.5 congestion
    )
    return not not_about_address


def _outcome(reply: Reply, phase: Phase) -> Outcome:
    if _is_expected_positive(reply, phase):
        return Outcome.DELIVERED
    if not reply.is_permanent:
        # 4xx, and defensively 1xx / unexpected positive / out-of-range codes.
        return Outcome.TRANSIENT
    if phase is Phase.AUTH:
        # We only AUTH to the operator's smarthost with the operator's credentials
        # (RFC 4954 §6: 535 5.7.8, 534 5.7.9, 538 5.7.11): a configuration fault that must
        # never turn customers' mail into bounces.
        return Outcome.TRANSIENT
    parts = _enhanced_parts(reply)
    if phase is Phase.RCPT and reply.code == 552 and parts in (None, (5, 3)):
        # RFC 5321 §4.5.3.1.10: 552 for "too many recipients" is an RFC 821 mistake for 452;
        # clients SHOULD treat it as temporary.
        return Outcome.TRANSIENT
    if _is_address_failure(reply, phase):
        return Outcome.BOUNCE
    return Outcome.FAIL


def _is_throttled(reply: Reply, phase: Phase) -> bool:
    if not reply.is_transient:
        return False
    parts = _enhanced_parts(reply)
    if parts == (4, 5):  # X.4.5 mail system congestion, RFC 3463 §3.5
        return True
    if (
        parts is not None
        and parts[0] == 7
        and parts[1] not in _SECURITY_DETAILS
        # "454 4.7.0 TLS not available" (RFC 3207 §4) and "454 4.7.0 Temporary
        # authentication failure" (RFC 4954 §6) are about the session, not our rate.
        and phase not in (Phase.STARTTLS, Phase.AUTH)
    ):
        return True  # 4.7.0 / 4.7.1 / Gmail 4.7.28 / Microsoft 4.7.500-4.7.699
    if reply.code == 421 and (parts is None or parts[0] != 4):
        # 421 with a 4.4.x network status (ours for refused connections, Postfix's
        # "421 4.4.2 ... timeout exceeded") reports the path, not a request to slow down.
        return True
    return _THROTTLE_TEXT_RE.search(reply.text) is not None


def classify(reply: Reply, phase: Phase) -> Verdict:
    """What ``reply``, received in ``phase``, means for the delivery (see module rules)."""
    outcome = _outcome(reply, phase)
    unexpected = outcome is Outcome.TRANSIENT and not (reply.is_transient or reply.is_permanent)
    closes = (
        reply.code in (421, 221)
        or unexpected
        or (outcome is not Outcome.DELIVERED and phase in (Phase.CONNECT, Phase.GREETING))
    )
    return Verdict(
        outcome=outcome,
        closes_connection=closes,
        throttled=_is_throttled(reply, phase),
        scope=Scope.RECIPIENT if phase is Phase.RCPT else Scope.TRANSACTION,
    )
