"""Handing a message to our own SMTP listener: relay-sendmail (relay/cli/sendmail.py) and
the maildrop importer (relay/spool/pickup.py) submit through here.

Rules:
- One SMTP transaction per message: EHLO (HELO when refused), MAIL with SIZE, BODY=8BITMIME
  and SMTPUTF8 when the message needs them and the relay offers them, RCPT, DATA.
- A 4xx to any recipient sends nothing (RSET): a retry is then complete. Recipients refused
  with 5xx are returned, the message goes to the others; all refused raises Failure.
- Every failure is a Failure with the sysexits.h code relay-sendmail exits with and one
  line naming the relay address and its reply.
"""

from __future__ import annotations

import contextlib
import smtplib
from dataclasses import dataclass
from pathlib import Path

EX_DATAERR = 65
EX_NOUSER = 67
EX_UNAVAILABLE = 69
EX_TEMPFAIL = 75

TIMEOUT = 120.0  # seconds: connect, and each reply (the relay fsyncs before its 250)


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    hostname: str
    local_domain: str = ""  # local.domain (else hostname): qualifies `root` in headers
    maildrop: Path | None = None  # spool.maildrop: where the message goes when we cannot

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Failure(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


def _reply(code: int, msg: bytes | str) -> str:
    text = msg.decode("utf-8", errors="replace") if isinstance(msg, bytes) else msg
    return f"{code} {' '.join(text.split())}".strip()


def submit(
    target: Target, sender: str, rcpts: list[str], data: bytes, timeout: float = TIMEOUT
) -> list[str]:
    """One SMTP transaction. Returns the recipients the relay refused with 5xx (the message
    went to the others); raises Failure when nothing was accepted."""
    try:
        s = smtplib.SMTP(target.host, target.port, local_hostname=target.hostname, timeout=timeout)
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
            EX_TEMPFAIL, f"the relay at {target} did not answer within {timeout:g}s"
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
