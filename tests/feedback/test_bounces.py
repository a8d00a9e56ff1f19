"""Bounces and complaints mailed back to the feedback address, and VERP tokens
(relay/feedback/bounces.py). The samples follow the shapes real MTAs send (Postfix and
Exchange DSNs, RFC 5965's ARF example, qmail-send, Exim, Office 365, sendmail), with the
names changed to example domains."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.delivery import dsn
from relay.feedback import bounces
from relay.feedback.bounces import (
    UnreadableNotice,
    events_for_verp,
    is_feedback_address,
    parse_feedback_mail,
    verp_decode,
    verp_encode,
)
from relay.feedback.events import FeedbackError, FeedbackEvent, content_id
from relay.mail.regex_guard import check_linear


def mail(text: str) -> bytes:
    """A sample as it arrives: CRLF line endings, UTF-8."""
    return text.replace("\r\n", "\n").replace("\n", "\r\n").encode("utf-8")


def brief(events: list[FeedbackEvent]) -> list[tuple[str, str, str | None]]:
    return [(e.type, e.recipient, e.status) for e in events]


# --- RFC 3464 DSNs -------------------------------------------------------------------------

POSTFIX_DSN = """\
Date: Tue, 14 May 2024 10:12:01 +0000 (UTC)
From: MAILER-DAEMON@mx.example.net (Mail Delivery System)
Subject: Undelivered Mail Returned to Sender
To: bounces+0000018f7a2b3c4d-42-abcdefghij@relay.example.com
Auto-Submitted: auto-replied
MIME-Version: 1.0
Content-Type: multipart/report; report-type=delivery-status;
\tboundary="4F2A31C0A5.1715681521/mx.example.net"
Content-Transfer-Encoding: 8bit
Message-Id: <20240514101201.7D1C31C0A6@mx.example.net>

This is a MIME-encapsulated message.

--4F2A31C0A5.1715681521/mx.example.net
Content-Description: Notification
Content-Type: text/plain; charset=utf-8
Content-Transfer-Encoding: 8bit

This is the mail system at host mx.example.net.

I'm sorry to have to inform you that your message could not
be delivered to one or more recipients. It's attached below.

                   The mail system

<nobody@example.org>: host mail.example.org[192.0.2.25] said: 550 5.1.1
    <nobody@example.org>: Recipient address rejected: User unknown in virtual
    mailbox table (in reply to RCPT TO command)

--4F2A31C0A5.1715681521/mx.example.net
Content-Description: Delivery report
Content-Type: message/delivery-status

Reporting-MTA: dns; mx.example.net
X-Postfix-Queue-ID: 4F2A31C0A5
X-Postfix-Sender: rfc822; bounces@relay.example.com
Arrival-Date: Tue, 14 May 2024 10:12:00 +0000 (UTC)

Final-Recipient: rfc822; nobody@example.org
Original-Recipient: rfc822;nobody@example.org
Action: failed
Status: 5.1.1
Remote-MTA: dns; mail.example.org
Diagnostic-Code: smtp; 550 5.1.1 <nobody@example.org>: Recipient address
    rejected: User unknown in virtual mailbox table

--4F2A31C0A5.1715681521/mx.example.net
Content-Description: Undelivered Message Headers
Content-Type: text/rfc822-headers
Content-Transfer-Encoding: 8bit

Return-Path: <bounces@relay.example.com>
Received: from relay.example.com (relay.example.com [198.51.100.7])
\tby mx.example.net (Postfix) with ESMTPS id 4F2A31C0A5
\tfor <nobody@example.org>; Tue, 14 May 2024 10:12:00 +0000 (UTC)
From: Shop <shop@example.com>
To: nobody@example.org
Subject: Your order
Message-ID: <order-1234@example.com>
Date: Tue, 14 May 2024 10:11:59 +0000

--4F2A31C0A5.1715681521/mx.example.net--
"""


def test_postfix_dsn_hard_bounce() -> None:
    [ev] = parse_feedback_mail(mail(POSTFIX_DSN))
    assert (ev.provider, ev.type, ev.recipient, ev.status) == (
        "mail",
        "bounce",
        "nobody@example.org",
        "5.1.1",
    )
    assert ev.message_id == "<order-1234@example.com>"
    assert ev.reason == (
        "550 5.1.1 <nobody@example.org>: Recipient address rejected: User unknown in virtual"
        " mailbox table"
    )
    report_mid = "<20240514101201.7D1C31C0A6@mx.example.net>"
    assert ev.event_id == content_id(report_mid, "nobody@example.org", "bounce")
    assert (ev.queue_id, ev.rcpt_id, ev.upstream_id) == (None, None, None)


def test_same_report_twice_gives_the_same_event_ids() -> None:
    assert parse_feedback_mail(mail(POSTFIX_DSN)) == parse_feedback_mail(mail(POSTFIX_DSN))


def test_report_without_message_id_is_identified_by_its_bytes() -> None:
    data = mail(POSTFIX_DSN.replace("Message-Id: <20240514101201.7D1C31C0A6@mx.example.net>\n", ""))
    [ev] = parse_feedback_mail(data)
    assert ev.event_id.startswith("h:")
    assert ev.event_id != parse_feedback_mail(mail(POSTFIX_DSN))[0].event_id
    other = data.replace(b"Your order", b"Your invoice")
    assert parse_feedback_mail(other)[0].event_id != ev.event_id


MIXED_DSN = """\
From: Mail Delivery Subsystem <MAILER-DAEMON@gw.example.net>
To: <bounces@relay.example.com>
Subject: Returned mail: see transcript for details
Message-Id: <202405141012.44EACx1Q012345@gw.example.net>
MIME-Version: 1.0
Content-Type: multipart/report; report-type=delivery-status; boundary="44EACx1Q012345.1715681521/gw"

--44EACx1Q012345.1715681521/gw
Content-Type: text/plain

Some addresses failed.

--44EACx1Q012345.1715681521/gw
Content-Type: message/delivery-status

Reporting-MTA: dns; gw.example.net
Received-From-MTA: DNS; relay.example.com
Arrival-Date: Tue, 14 May 2024 10:12:00 +0000

Final-Recipient: RFC822; gone@example.org
Action: failed
Status: 5.1.1
Diagnostic-Code: SMTP; 550 5.1.1 <gone@example.org>... User unknown

Final-Recipient: RFC822; full@example.org
Action: failed
Status: 4.2.2
Diagnostic-Code: SMTP; 452 4.2.2 Mailbox full (expired after 5 days)

Final-Recipient: RFC822; slow@example.org
Action: delayed
Status: 4.4.1
Will-Retry-Until: Sun, 19 May 2024 10:12:00 +0000

Final-Recipient: RFC822; fine@example.org
Action: delivered
Status: 2.0.0

Final-Recipient: RFC822; onward@example.org
Action: relayed (to a non-DSN-aware mailer)
Status: 2.0.0

Original-Recipient: rfc822;list@example.org
Final-Recipient: RFC822; list@example.org
Action: expanded
Status: 2.0.0

Original-Recipient: rfc822;alias@example.org
Final-Recipient: rfc822;person@elsewhere.example
Action: failed
Status: 5.2.1
Diagnostic-Code: smtp; 550 5.2.1 mailbox disabled

Final-Recipient: rfc822;nostatus@example.org
Action: failed
Diagnostic-Code: smtp; 554 rejected

Final-Recipient: rfc822;mystery@example.org
Action: failed

--44EACx1Q012345.1715681521/gw
Content-Type: message/rfc822

Message-ID: <newsletter-77@example.com>
From: news@example.com
To: undisclosed-recipients:;
Subject: News

Body
--44EACx1Q012345.1715681521/gw--
"""


def test_dsn_with_recipients_of_every_action() -> None:
    events = parse_feedback_mail(mail(MIXED_DSN))
    assert brief(events) == [
        ("bounce", "gone@example.org", "5.1.1"),
        ("soft_bounce", "full@example.org", "4.2.2"),  # failed, but transient: not a bounce
        ("soft_bounce", "slow@example.org", "4.4.1"),
        # the address we sent to, not the one it forwarded to
        ("bounce", "alias@example.org", "5.2.1"),
        ("bounce", "nostatus@example.org", None),  # no Status: the 554 says permanent
        ("soft_bounce", "mystery@example.org", None),  # failed, nothing says permanent
    ]
    assert {e.message_id for e in events} == {"<newsletter-77@example.com>"}
    assert events[0].reason == "550 5.1.1 <gone@example.org>... User unknown"
    assert len({e.event_id for e in events}) == len(events)


def _relay_dsn(action: str, status: str, reply: str) -> bytes:
    _, data = dsn.build_dsn(
        hostname="relay.example.com",
        from_addr="MAILER-DAEMON@relay.example.com",
        to_addr="app@example.com",
        queue_id="0000018F7A2B3C4D",
        recipient="someone@example.org",
        status=status,
        reply=reply,
        action=action,
        original_headers=b"Message-ID: <mine@example.com>\r\nSubject: hi\r\n",
        now=1_715_681_521.0,
        retry_until=1_716_000_000.0 if action == "delayed" else None,
    )
    return data


def test_delayed_dsn_is_a_soft_bounce() -> None:
    # the relay's own DSNs (relay/delivery/dsn.py) read back
    data = _relay_dsn("delayed", "4.2.2", "452 4.2.2 mailbox full")
    assert brief(parse_feedback_mail(data)) == [("soft_bounce", "someone@example.org", "4.2.2")]
    data = _relay_dsn("failed", "5.1.1", "550 5.1.1 no such user")
    [ev] = parse_feedback_mail(data)
    assert (ev.type, ev.status, ev.message_id) == ("bounce", "5.1.1", "<mine@example.com>")
    assert ev.reason == "550 5.1.1 no such user"


def test_delivered_only_dsn_yields_nothing() -> None:
    data = mail(
        POSTFIX_DSN.replace("Action: failed", "Action: delivered")
        .replace("Status: 5.1.1", "Status: 2.0.0")
        .replace("Diagnostic-Code: smtp; 550 5.1.1", "Diagnostic-Code: smtp; 250 2.0.0")
    )
    assert parse_feedback_mail(data) == []


GLOBAL_DSN = """\
From: postmaster@mx.example.net
To: bounces@relay.example.com
Subject: Undelivered Mail Returned to Sender
Message-ID: <g-1@mx.example.net>
MIME-Version: 1.0
Content-Type: multipart/report; report-type=delivery-status; boundary="g"

--g
Content-Type: text/plain; charset=utf-8

Could not deliver.

--g
Content-Type: message/global-delivery-status

Reporting-MTA: dns; mx.example.net

Original-Recipient: utf-8; b\\x{FC}ro@b\\x{FC}cher.example
Final-Recipient: utf-8; büro@bücher.example
Action: failed
Status: 5.1.1
Diagnostic-Code: smtp; 550 5.1.1 Postfach „büro“ unbekannt

Final-Recipient: rfc822; ok@example.org
Action: delivered
Status: 2.0.0

--g
Content-Type: message/global-headers

Message-ID: <g-orig@example.com>
Subject: Grüße

--g--
"""


def test_global_delivery_status() -> None:
    [ev] = parse_feedback_mail(mail(GLOBAL_DSN))
    assert brief([ev]) == [("bounce", "büro@bücher.example", "5.1.1")]
    assert ev.reason == "550 5.1.1 Postfach „büro“ unbekannt"
    assert ev.message_id == "<g-orig@example.com>"


def test_dsn_without_recipients_is_refused() -> None:
    data = mail(MIXED_DSN.split("Final-Recipient: RFC822; gone@example.org")[0] + "\n--44E--\n")
    with pytest.raises(FeedbackError):
        parse_feedback_mail(data)


EXCHANGE_DSN = """\
From: <postmaster@example.edu>
To: <bounces@relay.example.com>
Date: Thu, 29 Apr 2011 23:34:45 +0000
Content-Type: multipart/report; report-type=delivery-status;
\tboundary="fffe0000-0000-0020-ffff-eeeef0002200"
Content-Language: en-US
Message-ID: <0000ff00-2222-0022-fffe-000000000000@example.edu>
Subject: Undeliverable: Hello

--fffe0000-0000-0020-ffff-eeeef0002200
Content-Type: multipart/alternative; differences=Content-Type;
\tboundary="ffbb0020-0000-0000-ffef-000000002222"

--ffbb0020-0000-0000-ffef-000000002222
Content-Type: text/plain; charset="us-ascii"
Content-Transfer-Encoding: quoted-printable

Delivery has failed to these recipients or groups:

student@example.edu<mailto:student@example.edu>
The recipient's mailbox is full and can't accept messages now.

--ffbb0020-0000-0000-ffef-000000002222--

--fffe0000-0000-0020-ffff-eeeef0002200
Content-Type: message/delivery-status

Reporting-MTA: dns;mx.example.edu
Received-From-MTA: dns;relay.example.com
Arrival-Date: Thu, 29 Apr 2011 23:34:45 +0000

Original-Recipient: rfc822;student@example.edu
Final-Recipient: rfc822;student@example.edu
Action: failed
Status: 5.2.2
Diagnostic-Code: smtp;550 5.2.2 STOREDRV.Deliver: mailbox full.
X-Display-Name: Student

--fffe0000-0000-0020-ffff-eeeef0002200
Content-Type: text/rfc822-headers

Message-ID: <exam-results@example.com>
Subject: Results

--fffe0000-0000-0020-ffff-eeeef0002200--
"""


def test_exchange_dsn_reads_the_machine_part() -> None:
    [ev] = parse_feedback_mail(mail(EXCHANGE_DSN))
    assert brief([ev]) == [("bounce", "student@example.edu", "5.2.2")]
    assert ev.message_id == "<exam-results@example.com>"


# --- RFC 5965 complaints -------------------------------------------------------------------

ARF = """\
From: <abusedesk@example.com>
Date: Thu, 8 Mar 2005 17:40:36 EDT
Subject: FW: Earn money
To: <abuse@example.net>
MIME-Version: 1.0
Content-Type: multipart/report; report-type=feedback-report;
     boundary="part1_13d.2e68ed54_boundary"

--part1_13d.2e68ed54_boundary
Content-Type: text/plain; charset="US-ASCII"
Content-Transfer-Encoding: 7bit

This is an email abuse report for an email message received from IP
192.0.2.1 on Thu, 8 Mar 2005 14:00:00 EDT.  For more information
about this format please see http://www.mipassoc.org/arf/.

--part1_13d.2e68ed54_boundary
Content-Type: message/feedback-report

Feedback-Type: abuse
User-Agent: SomeGenerator/1.0
Version: 1
Original-Mail-From: <somespammer@example.net>
Original-Rcpt-To: <user@example.com>
Arrival-Date: Thu, 8 Mar 2005 14:00:00 EDT
Reporting-MTA: dns; mail.example.com
Source-IP: 192.0.2.1
Authentication-Results: mail.example.com;
               spf=fail smtp.mail=somespammer@example.com
Reported-Domain: example.net
Reported-Uri: http://example.net/earn_money.html
Reported-Uri: mailto:user@example.com
Removal-Recipient: user@example.com

--part1_13d.2e68ed54_boundary
Content-Type: message/rfc822
Content-Disposition: inline

From: <somespammer@example.net>
Received: from mailserver.example.net (mailserver.example.net
        [192.0.2.1]) by example.com with ESMTP id M63d4137594e46;
        Thu, 08 Mar 2005 14:00:00 -0400
To: <Undisclosed Recipients>
Subject: Earn money
MIME-Version: 1.0
Content-type: text/plain
Message-ID: 8787KJKJ3K4J3K4J3K4J3.mail@example.net
Date: Thu, 02 Sep 2004 12:31:03 -0500

Spam Spam Spam
Spam Spam Spam
--part1_13d.2e68ed54_boundary--
"""


def test_arf_abuse_complaint() -> None:
    [ev] = parse_feedback_mail(mail(ARF))
    assert (ev.type, ev.recipient, ev.status) == ("complaint", "user@example.com", None)
    assert ev.reason == "complaint: abuse (SomeGenerator/1.0)"
    assert ev.message_id == "8787KJKJ3K4J3K4J3K4J3.mail@example.net"
    assert ev.event_id.startswith("h:")  # the report has no Message-ID: its bytes name it


@pytest.mark.parametrize("ftype", ["fraud", "virus", "other", "opt-out"])
def test_other_feedback_types_are_complaints(ftype: str) -> None:
    [ev] = parse_feedback_mail(mail(ARF.replace("Feedback-Type: abuse", f"Feedback-Type: {ftype}")))
    assert (ev.type, ev.reason) == ("complaint", f"complaint: {ftype} (SomeGenerator/1.0)")


@pytest.mark.parametrize("ftype", ["not-spam", "auth-failure"])
def test_not_spam_and_auth_failure_yield_nothing(ftype: str) -> None:
    assert (
        parse_feedback_mail(mail(ARF.replace("Feedback-Type: abuse", f"Feedback-Type: {ftype}")))
        == []
    )


def test_arf_without_original_rcpt_to_uses_the_single_to() -> None:
    # Yahoo!-style: no Original-Rcpt-To, the original's To names the complainer
    data = ARF.replace("Original-Rcpt-To: <user@example.com>\n", "").replace(
        "To: <Undisclosed Recipients>", "To: Reader <reader@example.org>"
    )
    [ev] = parse_feedback_mail(mail(data.replace("User-Agent: SomeGenerator/1.0\n", "")))
    assert (ev.recipient, ev.reason) == ("reader@example.org", "complaint: abuse")
    several = data.replace("Reader <reader@example.org>", "a@example.org, b@example.org")
    with pytest.raises(FeedbackError, match="no recipient"):
        parse_feedback_mail(mail(several))


def test_arf_without_feedback_type_is_refused() -> None:
    with pytest.raises(FeedbackError, match="Feedback-Type"):
        parse_feedback_mail(mail(ARF.replace("Feedback-Type: abuse\n", "")))


def test_arf_with_several_original_rcpt_to() -> None:
    data = ARF.replace(
        "Original-Rcpt-To: <user@example.com>",
        "Original-Rcpt-To: <user@example.com>\nOriginal-Rcpt-To: other@example.com\n"
        "Original-Rcpt-To: USER@example.com",
    )
    assert [e.recipient for e in parse_feedback_mail(mail(data))] == [
        "user@example.com",
        "other@example.com",
    ]


# --- failure notices without a DSN ---------------------------------------------------------

QMAIL = """\
Date: 1 Jul 2014 08:30:56 -0000
From: MAILER-DAEMON@mx.example.jp
To: bounces@relay.example.com
Subject: failure notice

Hi. This is the qmail-send program at mx.example.jp.
I'm afraid I wasn't able to deliver your message to the following addresses.
This is a permanent error; I've given up. Sorry it didn't work out.

<userunknown@example.jp>:
192.0.2.153 does not like recipient.
Remote host said: 550 5.1.1 <userunknown@example.jp>... User Unknown
Giving up on 192.0.2.153.

<full@example.jp>:
192.0.2.153 does not like recipient.
Remote host said: 452 4.2.2 <full@example.jp>... Mailbox full
Giving up on 192.0.2.153.

<nohost@example.invalid>:
Sorry, I couldn't find any host named example.invalid. (#5.1.2)

--- Below this line is a copy of the message.

Return-Path: <bounces@relay.example.com>
Received: (qmail 18901 invoked by uid 0); 1 Jul 2014 08:30:40 -0000
Message-ID: <qmail-orig@relay.example.com>
From: app@example.com
To: userunknown@example.jp
Subject: TEST

TEST
"""


def test_qmail_bounce() -> None:
    events = parse_feedback_mail(mail(QMAIL))
    assert brief(events) == [
        ("bounce", "userunknown@example.jp", "5.1.1"),
        ("soft_bounce", "full@example.jp", "4.2.2"),
        ("bounce", "nohost@example.invalid", "5.1.2"),
    ]
    assert events[0].reason == (
        "Remote host said: 550 5.1.1 <userunknown@example.jp>... User Unknown"
        " Giving up on 192.0.2.153."
    )
    assert {e.message_id for e in events} == {"<qmail-orig@relay.example.com>"}
    assert {e.provider for e in events} == {"mail"}


EXIM = """\
Return-path: <>
X-Failed-Recipients: kijitora@example.jp, sabatora@example.jp
Auto-Submitted: auto-replied
From: Mail Delivery System <Mailer-Daemon@mx.example.org>
To: bounces@relay.example.com
Subject: Mail delivery failed: returning message to sender
Message-Id: <E1X58pT-0004bZ-Co@mx.example.org>
Date: Thu, 10 Jul 2014 16:31:43 +0900

This message was created automatically by mail delivery software.

A message that you sent could not be delivered to one or more of its
recipients. This is a permanent error. The following address(es) failed:

  kijitora@example.jp
    SMTP error from remote mail server after RCPT TO:<kijitora@example.jp>:
    host mx.example.jp [192.0.2.153]: 550 5.1.1 <kijitora@example.jp>... User Unknown
  sabatora@example.jp
    retry timeout exceeded

------ This is a copy of the message, including all the headers. ------

Return-path: <bounces@relay.example.com>
Received: from localhost ([127.0.0.1])
\tby mx.example.org with esmtp (Exim 4.72)
\tid 1X58pB-0004bW-2s; Thu, 10 Jul 2014 16:31:40 +0900
Date: Thu, 10 Jul 2014 16:31:36 +0900
Message-Id: <exim-orig@relay.example.com>
Subject: test
From: app@example.com

test
"""


def test_exim_bounce() -> None:
    events = parse_feedback_mail(mail(EXIM))
    assert brief(events) == [
        ("bounce", "kijitora@example.jp", "5.1.1"),
        ("soft_bounce", "sabatora@example.jp", None),  # no code tied to it: not a hard bounce
    ]
    assert events[0].reason == (
        "SMTP error from remote mail server after RCPT TO:<kijitora@example.jp>: host"
        " mx.example.jp [192.0.2.153]: 550 5.1.1 <kijitora@example.jp>... User Unknown"
    )
    assert events[1].reason == "retry timeout exceeded"
    assert events[0].message_id == "<exim-orig@relay.example.com>"
    report_mid = "<E1X58pT-0004bZ-Co@mx.example.org>"
    assert events[0].event_id == content_id(report_mid, "kijitora@example.jp", "bounce")


def test_exim_mail_from_rejection_is_tied_to_the_failed_address_not_the_sender() -> None:
    text = EXIM.replace(
        "    SMTP error from remote mail server after RCPT TO:<kijitora@example.jp>:\n"
        "    host mx.example.jp [192.0.2.153]: 550 5.1.1 <kijitora@example.jp>... User Unknown",
        "    SMTP error from remote mail server after MAIL FROM:<app@example.com> SIZE=1543:\n"
        "    host mx.example.jp [192.0.2.20]: 550 5.7.0 <app@example.com>... Use your ISP",
    )
    events = parse_feedback_mail(mail(text))
    assert brief(events)[0] == ("bounce", "kijitora@example.jp", "5.7.0")
    assert "app@example.com" not in {e.recipient for e in events}


EXIM_DELAY = """\
From: Mail Delivery System <Mailer-Daemon@mx.example.org>
To: bounces@relay.example.com
Subject: Warning: message 1X58pT-0004bZ-Co delayed 24 hours
Auto-Submitted: auto-replied
Message-Id: <E1X5XXX-0004bZ-Co@mx.example.org>

This message was created automatically by mail delivery software.
A message that you sent has not yet been delivered to one or more of its
recipients after more than 24 hours on the queue on mx.example.org.

The message identifier is:     1X58pT-0004bZ-Co

The address to which the message has not yet been delivered is:

  late@example.jp
    host mx.example.jp [192.0.2.153]: 550 5.7.1 greylisted, come back later

No action is required on your part. Delivery attempts will continue for
some time, and this warning may be repeated at intervals if the message
remains undelivered.
"""


def test_exim_delay_warning_is_never_a_hard_bounce() -> None:
    assert brief(parse_feedback_mail(mail(EXIM_DELAY))) == [
        ("soft_bounce", "late@example.jp", "5.7.1")
    ]


OFFICE365 = """\
From: postmaster@example.onmicrosoft.com
To: bounces@relay.example.com
Subject: Undeliverable: Hello
Message-ID: <o365-ndr-1@example.prod.outlook.com>
MIME-Version: 1.0
Content-Type: text/plain; charset="us-ascii"
Content-Transfer-Encoding: quoted-printable

Delivery has failed to these recipients or groups:

kijitora@example.onmicrosoft.com
The email address you entered couldn't be found. Please check the recipien=
t's email address and try to resend the message.

Diagnostic information for administrators:

Generating server: NEKOCHAN.example.prod.outlook.com

kijitora@example.onmicrosoft.com
Remote Server returned '550 5.1.10 RESOLVER.ADR.RecipientNotFound; Recipien=
t not found by SMTP address lookup'

Original message headers:

Received: from relay.example.com (198.51.100.7) by
 NEKOCHAN.example.prod.outlook.com (192.0.2.222) with Microsoft SMTP
 Server (TLS) id 15.0.918.8; Thu, 29 Apr 2015 23:34:45 +0900
Message-ID: <o365-orig@relay.example.com>
From: app@example.com
To: <kijitora@example.onmicrosoft.com>
Subject: Hello
"""


def test_exchange_text_ndr() -> None:
    [ev] = parse_feedback_mail(mail(OFFICE365))
    assert brief([ev]) == [("bounce", "kijitora@example.onmicrosoft.com", "5.1.10")]
    assert ev.reason == (
        "Remote Server returned '550 5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not"
        " found by SMTP address lookup'"
    )
    assert ev.message_id == "<o365-orig@relay.example.com>"


EXCHANGE_2003 = """\
Message-ID: <00000000000000000000000000000000000000@gw.example.com>
From: System Administrator <postmaster@example.jp>
To: bounces@relay.example.com
Subject: Undeliverable: Kijitora Cat
Date: Thu, 29 Apr 2010 00:00:00 -0000
X-Mailer: Internet Mail Service (5.5.1960.3)

Your message

  To:      kijitora@example.jp
  Subject: Kijitora Cat
  Sent:    Thu, 29 Apr 2010 00:00:00 -0000

did not reach the following recipient(s):

kijitora@example.jp on Thu, 29 Apr 2010 00:00:00 -0000
    The recipient name is not recognized
    MSEXCH:IMS:NNN:KIJITORACAT:NEKO 0 (000C05A6) Unknown Recipient
"""


def test_exchange_notice_without_a_code_is_only_a_soft_bounce() -> None:
    [ev] = parse_feedback_mail(mail(EXCHANGE_2003))
    assert brief([ev]) == [("soft_bounce", "kijitora@example.jp", None)]
    assert ev.reason == "The recipient name is not recognized"


SENDMAIL_TRANSCRIPT = """\
From: Mail Delivery Subsystem <MAILER-DAEMON@mx.example.jp>
To: <bounces@relay.example.com>
Subject: Returned mail: see transcript for details
Message-Id: <200904290210.n3T2A1xx012345@mx.example.jp>

The original message was received at Thu, 29 Apr 2009 23:45:01 +0900 (JST)
from [192.0.2.31]

   ----- The following addresses had permanent fatal errors -----
<kijitora@example.com>
    (reason: 550 5.1.1 <kijitora@example.com>... User unknown)

   ----- Transcript of session follows -----
... while talking to mx.example.com.:
>>> RCPT To:<kijitora@example.com>
<<< 550 5.1.1 <kijitora@example.com>... User unknown
550 5.1.1 <kijitora@example.com>... User unknown
"""


def test_sendmail_transcript_without_dsn_parts() -> None:
    [ev] = parse_feedback_mail(mail(SENDMAIL_TRANSCRIPT))
    assert brief([ev]) == [("bounce", "kijitora@example.com", "5.1.1")]


def test_notice_that_names_one_address_in_prose() -> None:
    text = """\
From: MAILER-DAEMON <>
To: bounces@relay.example.com
Subject: Mail delivery failed
Message-Id: <e0720@df.example.jp>

This is the DragonFly Mail Agent v0.13 at df.example.jp.

There was an error delivering your mail to <someone@google.example.com>.

gmail-smtp-in.l.google.com [192.0.2.27] did not like our final DATA:
550-5.7.26 Unauthenticated email from example.jp is not accepted due to domain's
550 5.7.26 DMARC policy.

Message headers follow.

Message-Id: <dma-orig@relay.example.com>
To: <someone@google.example.com>
"""
    [ev] = parse_feedback_mail(mail(text))
    assert brief([ev]) == [("bounce", "someone@google.example.com", "5.7.26")]
    assert ev.message_id == "<dma-orig@relay.example.com>"


def test_failure_notice_without_a_readable_recipient() -> None:
    text = """\
From: MAILER-DAEMON@mx.example.net
To: bounces@relay.example.com
Subject: Undelivered Mail Returned to Sender

Your message could not be delivered to some recipients. Sorry.
"""
    with pytest.raises(UnreadableNotice):
        parse_feedback_mail(mail(text))


def test_dsn_whose_recipient_is_a_pipe_falls_back_to_the_text() -> None:
    # only a failed pipe recipient in the machine part; the Exim header names the address
    head, _, rest = MIXED_DSN.partition("Final-Recipient: RFC822; gone@example.org")
    _, _, tail = rest.partition("--44EACx1Q012345.1715681521/gw\nContent-Type: message/rfc822")
    pipe = (
        head.replace("Subject:", "X-Failed-Recipients: owner@example.org\nSubject:")
        + "Final-Recipient: rfc822;|/usr/local/bin/procmail -f-\nAction: failed\nStatus: 5.0.0\n\n"
        + "--44EACx1Q012345.1715681521/gw\nContent-Type: message/rfc822"
        + tail
    )
    assert brief(parse_feedback_mail(mail(pipe))) == [("soft_bounce", "owner@example.org", None)]
    with pytest.raises(UnreadableNotice):
        parse_feedback_mail(mail(pipe.replace("X-Failed-Recipients: owner@example.org\n", "")))


def test_flattened_dsn_in_a_plain_text_notice() -> None:
    # a DSN whose MIME boundaries were lost on the way: the fields are still read
    text = """\
From: MAILER-DAEMON@neko.example.org (Mail Delivery System)
To: bounces@relay.example.com
Subject: Delayed Mail (still being retried)

This is the mail system at host smtp.neko.example.org.

<kijitora@example.com>: connect to nyaan.example.com[192.0.2.2]:25: No route to host

Reporting-MTA: dns; smtp.neko.example.org

Final-Recipient: rfc822; kijitora@example.com
Action: delayed
Status: 4.4.1
Diagnostic-Code: X-Postfix; connect to nyaan.example.com[192.0.2.2]:25: No route to host
"""
    [ev] = parse_feedback_mail(mail(text))
    assert brief([ev]) == [("soft_bounce", "kijitora@example.com", "4.4.1")]
    assert ev.reason == "connect to nyaan.example.com[192.0.2.2]:25: No route to host"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\r\n\r\n",
        b"hello",
        mail("From: alice@example.com\nSubject: Re: your newsletter\n\nPlease stop.\n"),
        mail(
            "From: bob@example.com\nAuto-Submitted: auto-replied\nSubject: Out of office\n\n"
            "I am away until Monday.\n"
        ),
        mail("From: MAILER-DAEMON@x.example\nSubject: Hello\n\nJust saying hi.\n"),
        mail("Content-Type: multipart/mixed; boundary=x\n\n--x\nContent-Type: image/png\n\n..."),
        bytes(range(256)) * 4,
    ],
    ids=["empty", "blank", "junk", "person", "auto-reply", "daemon-chat", "image", "binary"],
)
def test_anything_else_is_a_feedback_error(data: bytes) -> None:
    with pytest.raises(FeedbackError) as info:
        parse_feedback_mail(data)
    assert type(info.value) is FeedbackError  # not UnreadableNotice: not a failure notice
    assert 0 < len(str(info.value)) < 120


def test_reason_is_capped() -> None:
    long = POSTFIX_DSN.replace(
        "mailbox table\n\n--4F2A", "mailbox table " + "x" * 3000 + "\n\n--4F2A"
    )
    [ev] = parse_feedback_mail(mail(long))
    assert len(ev.reason) == bounces.MAX_REASON


# --- bounded work --------------------------------------------------------------------------


def test_recipients_and_parts_are_bounded() -> None:
    blocks = "".join(
        f"Final-Recipient: rfc822; u{i}@example.org\nAction: failed\nStatus: 5.1.1\n\n"
        for i in range(bounces.MAX_RECIPIENTS + 50)
    )
    many = MIXED_DSN.replace("Final-Recipient: RFC822; gone@example.org", blocks + "X-A: b", 1)
    assert len(parse_feedback_mail(mail(many))) == bounces.MAX_RECIPIENTS
    # the report part after the first 100 parts is never looked at
    filler = "".join("--b\nContent-Type: text/plain\n\nx\n" for _ in range(bounces.MAX_PARTS))
    late = mail(
        "Content-Type: multipart/report; report-type=delivery-status; boundary=b\n\n"
        + filler
        + "--b\nContent-Type: message/delivery-status\n\nFinal-Recipient: rfc822; a@example.org\n"
        "Action: failed\nStatus: 5.1.1\n\n--b--\n"
    )
    with pytest.raises(FeedbackError):
        parse_feedback_mail(late)


@pytest.mark.parametrize("name", sorted(bounces.PATTERNS))
def test_patterns_are_linear(name: str) -> None:
    pattern = bounces.PATTERNS[name]
    check_linear(pattern.pattern)  # no nested repetition (relay/mail/regex_guard.py)
    n = 50_000
    hostile = [
        "a" * n,
        "a@" * (n // 2),
        "a" * n + "@",
        "a@" + "a." * (n // 2),
        "a@" + "a-" * (n // 2) + "!",
        "5.5" * (n // 3),
        "550 " * (n // 4),
        "\\x{" * (n // 3),
        "<" * n,
        " " * n + "x",
    ]
    worst = 0.0
    for text in hostile:
        started = time.process_time()
        pattern.sub("", text)
        worst = max(worst, time.process_time() - started)
    assert worst < 0.5, (name, worst)


@pytest.mark.parametrize(
    "body",
    [
        "a" * 1_000_000,
        ("a" * 998 + "\n") * 1000,
        "a@" * 500_000,
        "<a@example.com>: " * 60_000,
        "rcpt to:<" * 100_000,
        "550 5.1.1 " * 100_000,
        "".join(f"u{i}@example.com\n" for i in range(50_000)),
    ],
    ids=["line", "lines", "at", "headings", "rcpt", "codes", "addresses"],
)
def test_hostile_notices_take_bounded_time(body: str) -> None:
    data = mail("From: MAILER-DAEMON@x.example\nSubject: Undelivered Mail\n\n" + body)
    started = time.process_time()
    try:
        events = parse_feedback_mail(data)
    except FeedbackError:
        events = []
    assert time.process_time() - started < 2.0
    assert len(events) <= bounces.MAX_RECIPIENTS


def test_deep_nesting_and_slow_charsets_are_handled() -> None:
    nested = b"".join(
        b"Content-Type: multipart/mixed; boundary=b%d\r\n\r\n--b%d\r\n" % (i, i)
        for i in range(3000)
    )
    with pytest.raises(FeedbackError):
        parse_feedback_mail(nested)
    slow = b"From: MAILER-DAEMON@x\r\nSubject: Undelivered Mail\r\nContent-Type: text/plain;"
    slow += b" charset=punycode\r\n\r\n" + b"a-" * 300_000
    started = time.process_time()
    with pytest.raises(FeedbackError):
        parse_feedback_mail(slow)
    assert time.process_time() - started < 1.0


SAMPLES = [mail(s) for s in (POSTFIX_DSN, MIXED_DSN, GLOBAL_DSN, ARF, QMAIL, EXIM, OFFICE365)]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_raise_only_feedback_error(data: bytes) -> None:
    try:
        events = parse_feedback_mail(data)
    except FeedbackError:
        return
    assert all(isinstance(e, FeedbackEvent) for e in events)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(SAMPLES), st.integers(min_value=0, max_value=5000), st.binary(max_size=40))
def test_damaged_reports_raise_only_feedback_error(sample: bytes, at: int, junk: bytes) -> None:
    at = at % (len(sample) + 1)
    try:
        events = parse_feedback_mail(sample[:at] + junk + sample[at + len(junk) // 2 :])
    except FeedbackError:
        return
    for e in events:
        assert e.provider == "mail" and e.type in ("bounce", "soft_bounce", "complaint")
        assert len(e.reason) <= bounces.MAX_REASON


# --- VERP ----------------------------------------------------------------------------------

KEY = b"k" * 32
QID = "0000018F7A2B3C4D"


def test_verp_round_trip() -> None:
    addr = verp_encode("bounces", "relay.example.com", QID, 42, KEY)
    local, _, domain = addr.partition("@")
    assert domain == "relay.example.com"
    assert local.startswith("bounces+0000018f7a2b3c4d-42-")
    token = local.partition("+")[2]
    assert len(token) <= bounces.VERP_MAX_TOKEN
    assert token == token.lower() and set(token) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert verp_decode(addr, "bounces", "relay.example.com", KEY) == (QID, 42)
    # some MTAs lowercase (or uppercase) the local part; domains are any case
    assert verp_decode(addr.lower(), "bounces", "relay.example.com", KEY) == (QID, 42)
    assert verp_decode(addr.upper(), "Bounces", "Relay.Example.COM", KEY) == (QID, 42)
    assert verp_decode(f"<{addr}>", "bounces", "relay.example.com", KEY) == (QID, 42)
    big = verp_encode("b", "x.example", "FFFFFFFFFFFFFFFF", 2**63 - 1, KEY)
    assert verp_decode(big, "b", "x.example", KEY) == ("FFFFFFFFFFFFFFFF", 2**63 - 1)


def test_verp_tokens_cannot_be_forged_or_altered() -> None:
    addr = verp_encode("bounces", "relay.example.com", QID, 42, KEY)
    local, _, domain = addr.partition("@")
    qid, _, mac = local.partition("+")[2].split("-")
    forged = [
        f"bounces+{qid}-43-{mac}@{domain}",  # another row
        f"bounces+{qid[:-1]}e-42-{mac}@{domain}",  # another message
        f"bounces+{qid}-42-{mac[:-1]}{'a' if mac[-1] != 'a' else 'b'}@{domain}",
        f"bounces+{qid}-042-{mac}@{domain}",
        f"bounces+{qid}-42-{mac}x@{domain}",
        f"bounces+{qid}-42@{domain}",
        f"bounces+{qid}-42-{mac}-1@{domain}",
        f"bounces+{qid}-0-{mac}@{domain}",
        f"bounces+{qid}--42-{mac}@{domain}",
        f"bounces+{qid}-4\uff12-{mac}@{domain}",  # a non-ASCII digit
        f"bounces+-42-{mac}@{domain}",
        f"bounces@{domain}",
        "",
        "@",
        "bounces+" + "a" * 400 + "@relay.example.com",
    ]
    for a in forged:
        assert verp_decode(a, "bounces", "relay.example.com", KEY) is None, a
    assert verp_decode(addr, "bounces", "relay.example.com", b"another key") is None
    assert verp_decode(addr, "bounces", "relay.example.com", b"") is None


def test_verp_wrong_local_or_domain() -> None:
    addr = verp_encode("bounces", "relay.example.com", QID, 42, KEY)
    assert verp_decode(addr, "bounces", "other.example.com", KEY) is None
    assert verp_decode(addr, "bounce", "relay.example.com", KEY) is None
    assert verp_decode(addr, "bouncesx", "relay.example.com", KEY) is None
    assert verp_decode(addr.replace("@", "@mail."), "bounces", "relay.example.com", KEY) is None


def test_verp_encode_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="key"):
        verp_encode("bounces", "relay.example.com", QID, 1, b"")
    for qid in ("0000018F7A2B3C4", "0000018F7A2B3C4DE", "0000018F7A2B3C4G"):
        with pytest.raises(ValueError, match="queue id"):
            verp_encode("bounces", "relay.example.com", qid, 1, KEY)
    for row in (0, -1, 2**63, True):
        with pytest.raises(ValueError, match="recipient id"):
            verp_encode("bounces", "relay.example.com", QID, row, KEY)
    for local in ("", "a+b", "a@b", ".a", "a..b", "a b"):
        with pytest.raises(ValueError, match="local part"):
            verp_encode(local, "relay.example.com", QID, 1, KEY)
    with pytest.raises(ValueError, match="domain"):
        verp_encode("bounces", "", QID, 1, KEY)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("bounces@relay.example.com", True),
        ("<bounces@relay.example.com>", True),
        ("Bounces@Relay.Example.com", True),
        ("bounces+anything@relay.example.com", True),
        ("BOUNCES+X-1-Y@RELAY.EXAMPLE.COM", True),
        ("bounces+@relay.example.com", True),
        ("bouncesx@relay.example.com", False),
        ("bounce@relay.example.com", False),
        ("x+bounces@relay.example.com", False),
        ("bounces@other.example.com", False),
        ("bounces@relay.example.com.evil.example", False),
        ("bounces", False),
        ("", False),
    ],
)
def test_is_feedback_address(address: str, expected: bool) -> None:
    assert is_feedback_address(address, "bounces", "relay.example.com") is expected


def _ev(recipient: str, type_: str = "bounce") -> FeedbackEvent:
    return FeedbackEvent("mail", type_, recipient, content_id(recipient, type_))  # type: ignore[arg-type]


def test_events_for_verp() -> None:
    assert events_for_verp([], QID, 7) == []
    # one address (the forwarded one a DSN names): the token's row is the one it is about
    [fwd] = events_for_verp([_ev("final@elsewhere.example")], QID, 7)
    assert (fwd.queue_id, fwd.rcpt_id, fwd.recipient) == (QID, 7, "final@elsewhere.example")
    # several addresses: only those about the row's address
    evs = [_ev("a@example.org"), _ev("B@example.org", "soft_bounce")]
    out = events_for_verp(evs, QID, 7, address="b@example.org")
    assert [(e.recipient, e.rcpt_id) for e in out] == [
        ("a@example.org", None),
        ("B@example.org", 7),
    ]
    # several other addresses (a list our recipient expanded to): none gets the row
    assert events_for_verp(evs, QID, 7) == evs
    assert events_for_verp(evs, QID, 7, address="list@example.org") == evs
    # the events are copies: the input is left alone
    assert evs[1].rcpt_id is None and dataclasses.replace(evs[1]) == evs[1]


def test_notice_recognised_by_encoded_subject_and_wording() -> None:
    # not from a daemon address, but an Exchange NDR by its (RFC 2047) subject and its text
    text = OFFICE365.replace(
        "From: postmaster@example.onmicrosoft.com", "From: Exchange <ex@example.fr>"
    ).replace("Subject: Undeliverable: Hello", "Subject: =?iso-8859-1?Q?Non_remis_:_Bonjour?=")
    assert brief(parse_feedback_mail(mail(text))) == [
        ("bounce", "kijitora@example.onmicrosoft.com", "5.1.10")
    ]
    with pytest.raises(FeedbackError):
        parse_feedback_mail(mail(text.replace("Non_remis", "Bonjour")))
