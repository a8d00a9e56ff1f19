"""relay/feedback/providers.py: each provider's documented webhook payloads become the right
FeedbackEvents (bounce, soft bounce, complaint, ignored, several recipients), malformed
bodies are FeedbackError and nothing else, and the Mailgun and SendGrid signatures are
checked as the providers sign them. Payloads are the providers' documented examples
(cited at each), trimmed only of fields the parsers never read."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.feedback import providers
from relay.feedback.events import EVENT_TYPES, FeedbackError, FeedbackEvent, content_id
from relay.feedback.providers import (
    SignatureError,
    SubscriptionConfirmation,
    parse_generic,
    parse_mailgun,
    parse_postmark,
    parse_sendgrid,
    parse_ses,
    verify_mailgun,
    verify_sendgrid,
)

Parser = Callable[[bytes], list[FeedbackEvent]]


def dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# --- Amazon SES through SNS -------------------------------------------------------------------

# docs.aws.amazon.com/ses/latest/dg/notification-examples.html, "Bounce notification with a
# DSN" (headers included)
SES_BOUNCE_DSN: dict[str, Any] = {
    "notificationType": "Bounce",
    "bounce": {
        "bounceType": "Permanent",
        "reportingMTA": "dns; email.example.com",
        "bouncedRecipients": [
            {
                "emailAddress": "jane@example.com",
                "status": "5.1.1",
                "action": "failed",
                "diagnosticCode": "smtp; 550 5.1.1 <jane@example.com>... User",
            }
        ],
        "bounceSubType": "General",
        "timestamp": "2016-01-27T14:59:38.237Z",
        "feedbackId": "00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa068a-000000",
        "remoteMtaIp": "127.0.2.0",
    },
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "source": "john@example.com",
        "sourceArn": "arn:aws:ses:us-east-1:888888888888:identity/example.com",
        "sourceIp": "127.0.3.0",
        "sendingAccountId": "123456789012",
        "callerIdentity": "IAM_user_or_role_name",
        "messageId": "00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa0680-000000",
        "destination": ["jane@example.com", "mary@example.com", "richard@example.com"],
        "headersTruncated": False,
        "headers": [
            {"name": "From", "value": '"John Doe" <john@example.com>'},
            {"name": "Message-ID", "value": "custom-message-ID"},
            {"name": "Subject", "value": "Hello"},
        ],
        "commonHeaders": {
            "from": ["John Doe <john@example.com>"],
            "date": "Wed, 27 Jan 2016 14:05:45 +0000",
            "to": ["Jane Doe <jane@example.com>, Mary Doe <mary@example.com>"],
            "messageId": "custom-message-ID",
            "subject": "Hello",
        },
    },
}

# the same page, "Bounce notification without a DSN" (two recipients, no headers)
SES_BOUNCE_NO_DSN: dict[str, Any] = {
    "notificationType": "Bounce",
    "bounce": {
        "bounceType": "Permanent",
        "bounceSubType": "General",
        "bouncedRecipients": [
            {"emailAddress": "jane@example.com"},
            {"emailAddress": "richard@example.com"},
        ],
        "timestamp": "2016-01-27T14:59:38.237Z",
        "feedbackId": "00000137860315fd-869464a4-8680-4114-98d3-716fe35851f9-000000",
        "remoteMtaIp": "127.0.2.0",
    },
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "messageId": "00000137860315fd-34208509-5b74-41f3-95c5-22c1edc3c924-000000",
        "source": "john@example.com",
        "destination": ["jane@example.com", "mary@example.com", "richard@example.com"],
    },
}

# the same page, "Complaint notification with a feedback report"
SES_COMPLAINT: dict[str, Any] = {
    "notificationType": "Complaint",
    "complaint": {
        "userAgent": "AnyCompany Feedback Loop (V0.01)",
        "complainedRecipients": [{"emailAddress": "richard@example.com"}],
        "complaintFeedbackType": "abuse",
        "arrivalDate": "2016-01-27T14:59:38.237Z",
        "timestamp": "2016-01-27T14:59:38.237Z",
        "feedbackId": "000001378603177f-18c07c78-fa81-4a58-9dd1-fedc3cb8f49a-000000",
    },
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "messageId": "000001378603177f-7a5433e7-8edb-42ae-af10-f0181f34d6ee-000000",
        "source": "john@example.com",
        "destination": ["jane@example.com", "mary@example.com", "richard@example.com"],
    },
}

# the same page, "Delivery notification"
SES_DELIVERY: dict[str, Any] = {
    "notificationType": "Delivery",
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "messageId": "0000014644fe5ef6-9a483358-9170-4cb4-a269-f5dcdf415321-000000",
        "source": "john@example.com",
        "destination": ["jane@example.com"],
    },
    "delivery": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "recipients": ["jane@example.com"],
        "processingTimeMillis": 546,
        "reportingMTA": "a8-70.smtp-out.amazonses.com",
        "smtpResponse": "250 ok:  Message 64111812 accepted",
        "remoteMtaIp": "127.0.2.0",
    },
}

# docs.aws.amazon.com/ses/latest/dg/event-publishing-retrieving-sns-contents.html:
# configuration-set event publishing names the type `eventType`; DeliveryDelay's object
SES_DELAY: dict[str, Any] = {
    "eventType": "DeliveryDelay",
    "mail": {
        "timestamp": "2020-06-16T00:15:40.641Z",
        "messageId": "01000172c2e9c2ec-1ac42d01-da0e-4f5e-b2c3-9e8d7f4a0b1c-000000",
        "commonHeaders": {"messageId": "<delayed@app.example>"},
    },
    "deliveryDelay": {
        "timestamp": "2020-06-16T00:25:40.095Z",
        "delayType": "MailboxFull",
        "expirationTime": "2020-06-16T00:25:40.914Z",
        "delayedRecipients": [
            {
                "emailAddress": "recipient@example.com",
                "status": "4.2.2",
                "diagnosticCode": "smtp; 452 4.2.2 The email account that you tried to reach"
                " is over quota.",
            }
        ],
    },
}

SNS_ID = "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324"


def sns(message: Any, message_id: str = SNS_ID) -> bytes:
    """docs.aws.amazon.com/sns/latest/dg/http-notification-json.html: the envelope SNS POSTs,
    with the SES notification as a JSON string in `Message`."""
    return dumps(
        {
            "Type": "Notification",
            "MessageId": message_id,
            "TopicArn": "arn:aws:sns:us-west-2:123456789012:MyTopic",
            "Subject": "Amazon SES Email Event Notification",
            "Message": message if isinstance(message, str) else json.dumps(message),
            "Timestamp": "2012-05-02T00:54:06.655Z",
            "SignatureVersion": "1",
            "Signature": "EXAMPLEw6JRN...",
            "SigningCertURL": "https://sns.us-west-2.amazonaws.com/SimpleNotificationService"
            "-f3ecfb7224c7233fe7bb5f59f96de52f.pem",
            "UnsubscribeURL": "https://sns.us-west-2.amazonaws.com/?Action=Unsubscribe"
            "&SubscriptionArn=arn:aws:sns:us-west-2:123456789012:MyTopic:c9135db0",
        }
    )


# docs.aws.amazon.com/sns/latest/dg/http-subscription-confirmation-json.html
SNS_SUBSCRIPTION_CONFIRMATION: dict[str, Any] = {
    "Type": "SubscriptionConfirmation",
    "MessageId": "165545c9-2a5c-472c-8df2-7ff2be2b3b1b",
    "Token": "2336412f37",
    "TopicArn": "arn:aws:sns:us-west-2:123456789012:MyTopic",
    "Message": "You have chosen to subscribe to the topic"
    " arn:aws:sns:us-west-2:123456789012:MyTopic.\nTo confirm the subscription, visit the"
    " SubscribeURL included in this message.",
    "SubscribeURL": "https://sns.us-west-2.amazonaws.com/?Action=ConfirmSubscription"
    "&TopicArn=arn:aws:sns:us-west-2:123456789012:MyTopic&Token=2336412f37",
    "Timestamp": "2012-04-26T20:45:04.751Z",
    "SignatureVersion": "1",
    "Signature": "EXAMPLEpH+",
    "SigningCertURL": "https://sns.us-west-2.amazonaws.com/SimpleNotificationService"
    "-f3ecfb7224c7233fe7bb5f59f96de52f.pem",
}


def test_ses_permanent_bounce_with_dsn() -> None:
    (ev,) = parse_ses(sns(SES_BOUNCE_DSN))
    assert ev == FeedbackEvent(
        provider="ses",
        type="bounce",
        recipient="jane@example.com",
        event_id=SNS_ID,
        message_id="custom-message-ID",
        upstream_id="00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa0680-000000",
        reason="smtp; 550 5.1.1 <jane@example.com>... User",
        status="5.1.1",
    )


def test_ses_one_notification_many_recipients_share_its_event_id() -> None:
    events = parse_ses(sns(SES_BOUNCE_NO_DSN, message_id="sns-1"))
    assert [e.recipient for e in events] == ["jane@example.com", "richard@example.com"]
    assert {e.event_id for e in events} == {"sns-1"}
    assert all(e.type == "bounce" for e in events)
    assert all(e.reason == "Permanent bounce: General" and e.status is None for e in events)
    assert all(e.message_id is None for e in events)  # headers not included


@pytest.mark.parametrize("bounce_type", ["Transient", "Undetermined", None, "SomethingNew"])
def test_ses_non_permanent_bounces_are_soft(bounce_type: str | None) -> None:
    doc = copy.deepcopy(SES_BOUNCE_NO_DSN)
    doc["bounce"]["bounceType"] = bounce_type
    doc["bounce"]["bounceSubType"] = "MailboxFull"
    events = parse_ses(sns(doc))
    assert [e.type for e in events] == ["soft_bounce", "soft_bounce"]


def test_ses_complaint() -> None:
    (ev,) = parse_ses(sns(SES_COMPLAINT))
    assert (ev.type, ev.recipient, ev.reason) == ("complaint", "richard@example.com", "abuse")
    assert ev.upstream_id == "000001378603177f-7a5433e7-8edb-42ae-af10-f0181f34d6ee-000000"
    assert ev.event_id == SNS_ID


def test_ses_complaint_without_feedback_type_says_complaint() -> None:
    doc = copy.deepcopy(SES_COMPLAINT)
    del doc["complaint"]["complaintFeedbackType"]
    assert parse_ses(sns(doc))[0].reason == "complaint"


def test_ses_delivery_and_other_events_are_nothing() -> None:
    assert parse_ses(sns(SES_DELIVERY)) == []
    for kind in ("Send", "Open", "Click", "Reject", "Rendering Failure", "Subscription"):
        assert parse_ses(sns({"eventType": kind, "mail": SES_DELIVERY["mail"]})) == []
    # SES's notice when a topic is set for identity notifications
    notice = {"notificationType": "AmazonSnsSubscriptionSucceeded", "message": "You have..."}
    assert parse_ses(sns(notice)) == []


def test_ses_text_notice_in_a_notification_is_nothing() -> None:
    # what SNS delivers once event publishing to the topic is validated
    msg = "Successfully validated SNS topic for Amazon SES event publishing."
    assert parse_ses(sns(msg)) == []


def test_ses_event_publishing_uses_event_type() -> None:
    doc = copy.deepcopy(SES_BOUNCE_DSN)
    doc["eventType"] = doc.pop("notificationType")
    assert [e.type for e in parse_ses(sns(doc))] == ["bounce"]


def test_ses_delivery_delay_is_a_soft_bounce() -> None:
    (ev,) = parse_ses(sns(SES_DELAY))
    assert (ev.type, ev.recipient, ev.status) == ("soft_bounce", "recipient@example.com", "4.2.2")
    assert ev.message_id == "<delayed@app.example>"
    assert ev.reason.startswith("smtp; 452 4.2.2")


def test_ses_raw_notification_without_envelope_uses_feedback_id() -> None:
    (ev,) = parse_ses(dumps(SES_BOUNCE_DSN))
    assert ev.event_id == SES_BOUNCE_DSN["bounce"]["feedbackId"]
    assert ev.type == "bounce"


def test_ses_raw_notification_without_any_id_gets_a_stable_content_id() -> None:
    doc = copy.deepcopy(SES_DELAY)
    first = parse_ses(dumps(doc))
    assert first == parse_ses(dumps(doc))
    assert first[0].event_id.startswith("h:")
    doc["deliveryDelay"]["timestamp"] = "2020-06-16T01:25:40.095Z"  # a later delay
    assert parse_ses(dumps(doc))[0].event_id != first[0].event_id


def test_ses_message_id_from_headers_when_no_common_headers() -> None:
    doc = copy.deepcopy(SES_BOUNCE_DSN)
    del doc["mail"]["commonHeaders"]
    doc["mail"]["headers"] = [{"name": "message-id", "value": "<lower@case.example>"}]
    assert parse_ses(sns(doc))[0].message_id == "<lower@case.example>"


def test_ses_recipient_entries_without_address_are_skipped() -> None:
    doc = copy.deepcopy(SES_BOUNCE_NO_DSN)
    doc["bounce"]["bouncedRecipients"] = [
        {"emailAddress": ""},
        {"status": "5.1.1"},
        "jane@example.com",
        {"emailAddress": 42},
        {"emailAddress": "richard@example.com"},
    ]
    assert [e.recipient for e in parse_ses(sns(doc))] == ["richard@example.com"]


def test_ses_subscription_confirmation_is_reported_distinctly() -> None:
    with pytest.raises(SubscriptionConfirmation) as info:
        parse_ses(dumps(SNS_SUBSCRIPTION_CONFIRMATION))
    sc = info.value
    assert sc.topic_arn == "arn:aws:sns:us-west-2:123456789012:MyTopic"
    assert sc.subscribe_url == SNS_SUBSCRIPTION_CONFIRMATION["SubscribeURL"]
    assert sc.subscribe_url in str(sc) and "confirm" in str(sc)
    assert not isinstance(sc, FeedbackError)


def test_ses_unsubscribe_confirmation_is_nothing() -> None:
    doc = dict(SNS_SUBSCRIPTION_CONFIRMATION, Type="UnsubscribeConfirmation")
    assert parse_ses(dumps(doc)) == []


def test_ses_long_diagnostic_is_one_line_of_500() -> None:
    doc = copy.deepcopy(SES_BOUNCE_DSN)
    doc["bounce"]["bouncedRecipients"][0]["diagnosticCode"] = "smtp; 550\r\n\t5.1.1 " + "x" * 900
    reason = parse_ses(sns(doc))[0].reason
    assert len(reason) == 500 and reason.startswith("smtp; 550 5.1.1 xx")


SES_BAD = [
    b"",
    b"not json",
    b"\xff\xfe{}",
    b"[]",
    b'"Notification"',
    b"{}",
    b'{"Type": "Whatever"}',
    b'{"Type": 7}',
    b'{"Type": "Notification"}',
    b'{"Type": "Notification", "Message": {"notificationType": "Bounce"}}',
    b'{"Type": "Notification", "Message": "{not json"}',
    b'{"Type": "Notification", "Message": "{\\"mail\\": {}}"}',
    b'{"Type": "SubscriptionConfirmation", "TopicArn": "arn:x"}',
    b'{"notificationType": "Bounce"}',
    b'{"notificationType": "Bounce", "bounce": []}',
    b'{"notificationType": "Bounce", "bounce": {"bouncedRecipients": {}}}',
    b'{"notificationType": "Complaint", "complaint": "abuse"}',
    b'{"notificationType": "Bounce", "mail": [], "bounce": {}}',
    b'{"notificationType": "Bounce", "bounce": {"bouncedRecipients":'
    b' [{"emailAddress": "\\ud800@example.com"}]}}',
    b"[" * 100_000,
]


@pytest.mark.parametrize("body", SES_BAD)
def test_ses_malformed_is_feedback_error(body: bytes) -> None:
    with pytest.raises(FeedbackError):
        parse_ses(body)


# --- Postmark ---------------------------------------------------------------------------------

# postmarkapp.com/developer/webhooks/bounce-webhook, "Example JSON webhook data"
POSTMARK_BOUNCE: dict[str, Any] = {
    "RecordType": "Bounce",
    "MessageStream": "outbound",
    "ID": 4323372036854775807,
    "Type": "HardBounce",
    "TypeCode": 1,
    "Name": "Hard bounce",
    "Tag": "Test",
    "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483",
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "ServerID": 23,
    "Description": "The server was unable to deliver your message (ex: unknown user, mailbox"
    " not found).",
    "Details": "Test bounce details",
    "Email": "john@example.com",
    "From": "sender@example.com",
    "BouncedAt": "2019-11-05T16:33:54.9070259Z",
    "DumpAvailable": True,
    "Inactive": True,
    "CanActivate": True,
    "Subject": "Test subject",
    "Content": "<Full dump of bounce>",
}

# postmarkapp.com/developer/webhooks/spam-complaint-webhook, "Example JSON webhook data"
# (its TypeCode 512 is SpamNotification's: Type and RecordType decide)
POSTMARK_COMPLAINT: dict[str, Any] = {
    "RecordType": "SpamComplaint",
    "MessageStream": "outbound",
    "ID": 42,
    "Type": "SpamComplaint",
    "TypeCode": 512,
    "Name": "Spam complaint",
    "Tag": "Test",
    "MessageID": "00000000-0000-0000-0000-000000000000",
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "ServerID": 1234,
    "Description": "",
    "Details": "Test spam complaint details",
    "Email": "john@example.com",
    "From": "sender@example.com",
    "BouncedAt": "2019-11-05T16:33:54.9070259Z",
    "DumpAvailable": True,
    "Inactive": True,
    "CanActivate": False,
    "Subject": "Test subject",
    "Content": "<Abuse report dump>",
}


def test_postmark_hard_bounce() -> None:
    (ev,) = parse_postmark(dumps(POSTMARK_BOUNCE))
    assert ev == FeedbackEvent(
        provider="postmark",
        type="bounce",
        recipient="john@example.com",
        event_id="4323372036854775807",
        message_id=None,
        upstream_id="883953f4-6105-42a2-a16a-77a8eac79483",
        reason="Test bounce details",
        status=None,
    )


def test_postmark_status_from_details_and_description_fallback() -> None:
    doc = dict(POSTMARK_BOUNCE, Details="smtp;550 5.1.1 The email account does not exist.")
    assert parse_postmark(dumps(doc))[0].status == "5.1.1"
    doc = dict(POSTMARK_BOUNCE, Details="")
    assert parse_postmark(dumps(doc))[0].reason == POSTMARK_BOUNCE["Description"]


# postmarkapp.com/developer/api/bounce-api#bounce-types
@pytest.mark.parametrize(
    ("type_", "code", "expected"),
    [
        ("HardBounce", 1, "bounce"),
        ("BadEmailAddress", 100000, "bounce"),
        ("ManuallyDeactivated", 100002, "bounce"),
        ("Transient", 2, "soft_bounce"),
        ("SoftBounce", 4096, "soft_bounce"),
        ("DnsError", 256, "soft_bounce"),
        ("SpamNotification", 512, "soft_bounce"),
        ("Unknown", 2048, "soft_bounce"),
        ("VirusNotification", 8192, "soft_bounce"),
        ("Blocked", 100006, "soft_bounce"),
        ("DMARCPolicy", 100009, "soft_bounce"),
        ("SpamComplaint", 100001, "complaint"),
        ("AutoResponder", 64, None),
        ("Unsubscribe", 16, None),
        ("Subscribe", 32, None),
        ("AddressChange", 128, None),
        ("OpenRelayTest", 1024, None),
        ("ChallengeVerification", 16384, None),
        ("Unconfirmed", 100003, None),
        ("SMTPApiError", 100007, None),
        ("TemplateRenderingFailed", 100010, None),
    ],
)
def test_postmark_bounce_types(type_: str, code: int, expected: str | None) -> None:
    by_name = parse_postmark(dumps(dict(POSTMARK_BOUNCE, Type=type_, TypeCode=code)))
    assert [e.type for e in by_name] == ([expected] if expected else [])
    # the code decides only when the name is missing or new
    for name in (None, "NotYetInvented"):
        by_code = parse_postmark(dumps(dict(POSTMARK_BOUNCE, Type=name, TypeCode=code)))
        assert [e.type for e in by_code] == ([expected] if expected else [])


def test_postmark_unknown_type_and_code_is_soft() -> None:
    doc = dict(POSTMARK_BOUNCE, Type="NotYetInvented", TypeCode=99)
    assert [e.type for e in parse_postmark(dumps(doc))] == ["soft_bounce"]


def test_postmark_spam_complaint() -> None:
    (ev,) = parse_postmark(dumps(POSTMARK_COMPLAINT))
    assert (ev.type, ev.recipient, ev.event_id) == ("complaint", "john@example.com", "42")
    assert ev.reason == "Test spam complaint details"
    assert ev.upstream_id == "00000000-0000-0000-0000-000000000000"


def test_postmark_record_without_record_type_is_read_by_type() -> None:
    # the same page's curl example posts the record without RecordType
    doc = {k: v for k, v in POSTMARK_COMPLAINT.items() if k != "RecordType"}
    assert [e.type for e in parse_postmark(dumps(doc))] == ["complaint"]
    doc = {k: v for k, v in POSTMARK_BOUNCE.items() if k != "RecordType"}
    assert [e.type for e in parse_postmark(dumps(doc))] == ["bounce"]


@pytest.mark.parametrize(
    "doc",
    [
        # postmarkapp.com/developer/webhooks/delivery-webhook
        {
            "RecordType": "Delivery",
            "ServerID": 23,
            "MessageStream": "outbound",
            "MessageID": "00000000-0000-0000-0000-000000000000",
            "Recipient": "john@example.com",
            "Tag": "welcome-email",
            "DeliveredAt": "2021-02-21T16:34:52Z",
            "Details": "Test delivery webhook details",
        },
        {"RecordType": "Open", "Recipient": "john@example.com", "MessageID": "x"},
        {"RecordType": "Click", "Recipient": "john@example.com", "MessageID": "x"},
        # postmarkapp.com/developer/webhooks/subscription-change-webhook
        {
            "RecordType": "SubscriptionChange",
            "MessageID": "00000000-0000-0000-0000-000000000000",
            "ServerID": 123456,
            "MessageStream": "outbound",
            "ChangedAt": "2020-02-01T10:53:34.416071Z",
            "Recipient": "bounced-address@wildbit.com",
            "Origin": "Recipient",
            "SuppressSending": True,
            "SuppressionReason": "HardBounce",
            "Tag": "my-tag",
        },
        dict(POSTMARK_BOUNCE, Email=None),
        {k: v for k, v in POSTMARK_BOUNCE.items() if k != "Email"},
    ],
)
def test_postmark_other_records_are_nothing(doc: dict[str, Any]) -> None:
    assert parse_postmark(dumps(doc)) == []


def test_postmark_without_id_gets_a_content_id() -> None:
    doc = {k: v for k, v in POSTMARK_BOUNCE.items() if k != "ID"}
    (a,) = parse_postmark(dumps(doc))
    (b,) = parse_postmark(dumps(doc))
    assert a.event_id == b.event_id and a.event_id.startswith("h:")


POSTMARK_BAD = [
    b"",
    b"<xml/>",
    b"[]",
    b"[{}]",
    b"null",
    b"{}",
    b'{"FromFull": {"Email": "x@example.com"}, "TextBody": "inbound"}',
    b'{"RecordType": 1, "Type": "HardBounce", "Email": "a@b.c"}',
    b'{"RecordType": ["Bounce"], "Email": "a@b.c"}',
    b'{"RecordType": "Bounce", "Type": "HardBounce", "Email": "\\udfff@b.c"}',
    b"\xc3\x28",
]


@pytest.mark.parametrize("body", POSTMARK_BAD)
def test_postmark_malformed_is_feedback_error(body: bytes) -> None:
    with pytest.raises(FeedbackError):
        parse_postmark(body)


# --- SendGrid ---------------------------------------------------------------------------------

# github.com/sendgrid/docs, content/docs/for-developers/tracking-events/event.md: the
# "example of each type of event" batch, with the ids of the per-event examples below it
SENDGRID_BATCH: list[dict[str, Any]] = [
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "processed",
        "category": "cat facts",
        "sg_event_id": "rbtnWrG1DVDGGGFHFyun0A==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.000000000000000000000",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "deferred",
        "category": "cat facts",
        "sg_event_id": "t7LEShmowp86DTdUW8M-GQ==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "response": "400 try again later",
        "attempt": "5",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "delivered",
        "category": "cat facts",
        "sg_event_id": "rWVYmVk90MjZJ9iohOBa3w==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "response": "250 OK",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "open",
        "category": "cat facts",
        "sg_event_id": "FOTFFO0ecsBE-zxFXfs6WA==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "useragent": "Mozilla/4.0 (compatible; MSIE 6.1; Windows XP)",
        "ip": "255.255.255.255",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "click",
        "category": "cat facts",
        "sg_event_id": "kCAi1KttyQdEKHhdC-nuEA==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "url": "http://www.sendgrid.com/",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "bounce",
        "category": "cat facts",
        "sg_event_id": "6g4ZI7SA-xmRDv57GoPIPw==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "reason": "500 unknown recipient",
        "status": "5.0.0",
        "type": "bounce",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "dropped",
        "category": "cat facts",
        "sg_event_id": "zmzJhfJgAfUSOW80yEbPyw==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "reason": "Bounced Address",
        "status": "5.0.0",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "spamreport",
        "category": "cat facts",
        "sg_event_id": "37nvH5QBz858KGVYCM4uOA==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "unsubscribe",
        "category": "cat facts",
        "sg_event_id": "zz_BjPgU_5pS-J8vlfB1sg==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
    },
    {
        "email": "example@test.com",
        "timestamp": 1513299569,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": "group_unsubscribe",
        "category": "cat facts",
        "sg_event_id": "ahSCB7xYcXFb-hEaawsPRw==",
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "asm_group_id": 10,
    },
]


def test_sendgrid_batch_keeps_only_feedback() -> None:
    events = parse_sendgrid(dumps(SENDGRID_BATCH))
    assert [(e.type, e.event_id) for e in events] == [
        ("soft_bounce", "t7LEShmowp86DTdUW8M-GQ=="),
        ("bounce", "6g4ZI7SA-xmRDv57GoPIPw=="),
        ("bounce", "zmzJhfJgAfUSOW80yEbPyw=="),
        ("complaint", "37nvH5QBz858KGVYCM4uOA=="),
    ]
    deferred, bounce, dropped, spam = events
    assert deferred.reason == "400 try again later" and deferred.status is None
    assert (bounce.reason, bounce.status) == ("500 unknown recipient", "5.0.0")
    assert bounce.message_id == "<14c5d75ce93.dfd.64b469@ismtpd-555>"
    assert bounce.upstream_id == "14c5d75ce93.dfd.64b469"
    assert dropped.reason == "Bounced Address"
    assert spam.reason == "spamreport"
    assert all(e.provider == "sendgrid" and e.recipient == "example@test.com" for e in events)


def test_sendgrid_blocked_bounce_is_soft() -> None:
    # the same page's "Blocked" example: event bounce, type blocked
    blocked = dict(SENDGRID_BATCH[5], type="blocked")
    expired = dict(SENDGRID_BATCH[5], type="expired")
    legacy = {k: v for k, v in SENDGRID_BATCH[5].items() if k != "type"}
    assert [e.type for e in parse_sendgrid(dumps([blocked, expired, legacy]))] == [
        "soft_bounce",
        "soft_bounce",
        "bounce",
    ]


# the same page: "Invalid SMTPAPI header, Spam Content (if Spam Checker app is enabled),
# Unsubscribed Address, Bounced Address, Spam Reporting Address, Invalid, Recipient List over
# Package Quota"
@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("Bounced Address", "bounce"),
        ("Invalid", "bounce"),
        ("Spam Reporting Address", "complaint"),
        ("spam reporting address ", "complaint"),
        ("Unsubscribed Address", None),
        ("Invalid SMTPAPI header", "soft_bounce"),
        ("Spam Content", "soft_bounce"),
        ("Recipient List over Package Quota", "soft_bounce"),
        (None, "soft_bounce"),
    ],
)
def test_sendgrid_dropped_reasons(reason: str | None, expected: str | None) -> None:
    ev = dict(SENDGRID_BATCH[6], reason=reason)
    assert [e.type for e in parse_sendgrid(dumps([ev]))] == ([expected] if expected else [])


@pytest.mark.parametrize(
    ("sg_message_id", "upstream"),
    [
        ("14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0", "14c5d75ce93.dfd.64b469"),
        # twilio.com/docs/glossary/message-id
        ("XBg2anf2TqCy6WXKQFhieQ.filter0905p1mdw1-4434-59E0C6FF-3.0", "XBg2anf2TqCy6WXKQFhieQ"),
        # the event reference's A/B test example
        ("5lFl7Fr1Rjme_EyzNNB_5A.stfilter-015.5185.55F883172.0", "5lFl7Fr1Rjme_EyzNNB_5A"),
        ("LRzXl66oQzy4aMGxvAbfTg.recvd-7d6f6b5c7-4xkrw-1-62F5B2D3-9.0", "LRzXl66oQzy4aMGxvAbfTg"),
        ("abc.def", "abc"),
        ("no-dots-at-all", "no-dots-at-all"),
        (None, None),  # asynchronous bounces carry none
        (17, None),
    ],
)
def test_sendgrid_upstream_id(sg_message_id: object, upstream: str | None) -> None:
    ev = dict(SENDGRID_BATCH[5], sg_message_id=sg_message_id)
    assert parse_sendgrid(dumps([ev]))[0].upstream_id == upstream


def test_sendgrid_legacy_event_without_id_gets_a_stable_content_id() -> None:
    # gist.github.com/martyndavies/8332929: a 2014 batch; its dropped event has no
    # sg_event_id (and an address SendGrid found invalid)
    ev = {
        "email": "not an email address",
        "smtp-id": "<4FB29F5D.5080404@sendgrid.com>",
        "timestamp": 1386636115,
        "reason": "Invalid",
        "event": "dropped",
        "category": ["category1", "category2", "category3"],
        "id": "001",
        "purchase": "PO1452297845",
        "uid": "123456",
    }
    (a,) = parse_sendgrid(dumps([ev]))
    (b,) = parse_sendgrid(dumps([ev]))
    assert a.type == "bounce" and a.recipient == "not an email address"
    assert a.event_id == b.event_id and a.event_id.startswith("h:")
    assert parse_sendgrid(dumps([dict(ev, timestamp=1386636999)]))[0].event_id != a.event_id


def test_sendgrid_events_without_email_are_skipped() -> None:
    events = [dict(SENDGRID_BATCH[5], email=None), dict(SENDGRID_BATCH[5], email=["x@y.z"])]
    events.append({k: v for k, v in SENDGRID_BATCH[5].items() if k != "email"})
    assert parse_sendgrid(dumps(events)) == []
    assert parse_sendgrid(b"[]") == []


SENDGRID_BAD = [
    b"",
    b"{}",
    dumps(SENDGRID_BATCH[5]),  # one event, not an array
    b"[1]",
    b'[{"event": "bounce", "email": "a@b.c"}, null]',
    b'[["bounce"]]',
    b'[{"event": "bounce", "email": "\\ud83d@b.c"}]',
    b"[" * 5000 + b"]" * 5000,
    b'[{"event": "bounce", "email": "a@b.c", "timestamp": 1' + b"0" * 5000 + b"}]",
]


@pytest.mark.parametrize("body", SENDGRID_BAD)
def test_sendgrid_malformed_is_feedback_error(body: bytes) -> None:
    with pytest.raises(FeedbackError):
        parse_sendgrid(body)


# --- Mailgun ----------------------------------------------------------------------------------

MAILGUN_KEY = b"key-0123456789abcdef0123456789abcdef"
MAILGUN_TOKEN = "a8ce0edb2dd8301dee6c2405235584e45aa91d1e9f979f3de0"

# github.com/mailgun/documentation, source/api-events.rst, "Failed (Permanent, Delayed
# Bounce)"
MAILGUN_PERMANENT: dict[str, Any] = {
    "severity": "permanent",
    "timestamp": 1666214138.4046676,
    "delivery-status": {
        "bounce-code": "5.1.1",
        "message": "smtp; 550-5.1.1 The email account that you tried to reach does not exist.",
        "code": 550,
        "description": "I'm sorry to have to inform you that your message could not be"
        " delivered to one or more recipients.",
        "enhanced-code": "5.1.1",
    },
    "log-level": "error",
    "id": "ZDMqRgjLTDi6rQcy7K60aA",
    "reason": "generic",
    "user-variables": {},
    "flags": {"is-delayed-bounce": True},
    "envelope": {},
    "message": {
        "headers": {
            "to": "test@test.com",
            "message-id": "20221019211537.93011d31ea99c5a8@test.com",
            "from": "Test Message <test@test.com>",
            "subject": "Testing delayed bounce",
        },
        "size": 275,
    },
    "recipient": "christest123@test.com",
    "event": "failed",
}

# the same file, "Failed (Temporary)"
MAILGUN_TEMPORARY: dict[str, Any] = {
    "severity": "temporary",
    "tags": [],
    "timestamp": 1665066523.871657,
    "delivery-status": {
        "tls": True,
        "mx-host": "hotmail-com.olc.protection.outlook.com",
        "code": 451,
        "description": "",
        "session-seconds": 0.7517080307006836,
        "utf8": True,
        "retry-seconds": 600,
        "enhanced-code": "4.7.652",
        "attempt-no": 1,
        "message": "4.7.652 The mail server [xxx.xxx.xxx.xxx] has exceeded the maximum number"
        " of connections.",
        "certificate-verified": True,
    },
    "recipient-domain": "test.com",
    "id": "xYrATi63Rke8EC_s7EoJeA",
    "reason": "generic",
    "log-level": "warn",
    "message": {
        "headers": {
            "to": "test@test.net",
            "message-id": "20221006142837.1618e01bf42da9fa@test.com",
            "from": "test@test.com",
            "subject": "Test send",
        },
        "attachments": [],
        "size": 3499,
    },
    "recipient": "test@test.com",
    "event": "failed",
}

# the same file, "Failed (Permanent)": dropped, the address bounced before
MAILGUN_SUPPRESSED: dict[str, Any] = {
    "event": "failed",
    "id": "pl271FzxTTmGRW8Uj3dUWw",
    "timestamp": 1529701969.818328,
    "log-level": "error",
    "severity": "permanent",
    "reason": "suppress-bounce",
    "envelope": {"sender": "john@example.org", "transport": "smtp", "targets": "joan@example.com"},
    "delivery-status": {
        "attempt-no": 1,
        "message": "",
        "code": 605,
        "description": "Not delivering to previously bounced address",
        "session-seconds": 0.0,
    },
    "message": {
        "headers": {
            "to": "joan@example.com",
            "message-id": "20180622211249.1.2A6098970A380E12@example.org",
            "from": "john@example.org",
            "subject": "Test Subject",
        },
        "attachments": [],
        "size": 867,
    },
    "recipient": "slava@mailgun.com",
    "recipient-domain": "mailgun.com",
}

# the same file, "Complained"
MAILGUN_COMPLAINED: dict[str, Any] = {
    "event": "complained",
    "id": "ncV2XwymRUKbPek_MIM-Gw",
    "timestamp": 1377214260.049634,
    "log-level": "warn",
    "recipient": "foo@example.com",
    "tags": [],
    "campaigns": [],
    "user-variables": {},
    "flags": {"is-test-mode": False},
    "message": {
        "headers": {
            "to": "foo@example.com",
            "message-id": "20130718032413.263EE2E0926@example.com",
            "from": "John Doe <sender@example.com>",
            "subject": "This is the subject.",
        },
        "attachments": [],
        "size": 18937,
    },
}


def mailgun_body(
    event_data: Any,
    *,
    key: bytes = MAILGUN_KEY,
    timestamp: str | int = "1529006854",
    token: str = MAILGUN_TOKEN,
    signature: str | None = None,
) -> bytes:
    """source/user_manual.rst, "Payload" and "Securing Webhooks": the signature object next
    to event-data, its signature the hex HMAC-SHA256 of timestamp + token."""
    sig = hmac.new(key, f"{timestamp}{token}".encode(), hashlib.sha256).hexdigest()
    block = {"timestamp": timestamp, "token": token, "signature": signature or sig}
    return dumps({"signature": block, "event-data": event_data})


def test_mailgun_permanent_failure_is_a_bounce() -> None:
    (ev,) = parse_mailgun(mailgun_body(MAILGUN_PERMANENT))
    assert ev == FeedbackEvent(
        provider="mailgun",
        type="bounce",
        recipient="christest123@test.com",
        event_id="ZDMqRgjLTDi6rQcy7K60aA",
        message_id="20221019211537.93011d31ea99c5a8@test.com",
        upstream_id="20221019211537.93011d31ea99c5a8@test.com",
        reason="smtp; 550-5.1.1 The email account that you tried to reach does not exist.",
        status="5.1.1",
    )


def test_mailgun_temporary_failure_is_a_soft_bounce() -> None:
    (ev,) = parse_mailgun(mailgun_body(MAILGUN_TEMPORARY))
    assert (ev.type, ev.recipient, ev.status) == ("soft_bounce", "test@test.com", "4.7.652")
    assert ev.reason.startswith("4.7.652 The mail server")


def test_mailgun_failure_without_severity_is_soft() -> None:
    doc = {k: v for k, v in MAILGUN_PERMANENT.items() if k != "severity"}
    assert [e.type for e in parse_mailgun(mailgun_body(doc))] == ["soft_bounce"]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("suppress-bounce", "bounce"),
        ("suppress-complaint", "complaint"),
        ("suppress-unsubscribe", None),
        ("bounce", "bounce"),
        (None, "bounce"),
    ],
)
def test_mailgun_suppressed_addresses(reason: str | None, expected: str | None) -> None:
    events = parse_mailgun(mailgun_body(dict(MAILGUN_SUPPRESSED, reason=reason)))
    assert [e.type for e in events] == ([expected] if expected else [])
    if expected:  # the empty message gives way to the description
        assert events[0].reason == "Not delivering to previously bounced address"
        assert events[0].status is None  # 605 is Mailgun's own code


def test_mailgun_complaint() -> None:
    (ev,) = parse_mailgun(mailgun_body(MAILGUN_COMPLAINED))
    assert (ev.type, ev.recipient, ev.reason) == ("complaint", "foo@example.com", "complained")
    assert ev.event_id == "ncV2XwymRUKbPek_MIM-Gw"
    assert ev.message_id == "20130718032413.263EE2E0926@example.com"


@pytest.mark.parametrize("event", ["accepted", "delivered", "opened", "clicked", "unsubscribed"])
def test_mailgun_other_events_are_nothing(event: str) -> None:
    assert parse_mailgun(mailgun_body(dict(MAILGUN_COMPLAINED, event=event))) == []


def test_mailgun_without_recipient_or_id() -> None:
    assert parse_mailgun(mailgun_body(dict(MAILGUN_PERMANENT, recipient=None))) == []
    doc = {k: v for k, v in MAILGUN_PERMANENT.items() if k != "id"}
    (a,) = parse_mailgun(mailgun_body(doc))
    assert a.event_id == parse_mailgun(mailgun_body(doc))[0].event_id
    assert a.event_id.startswith("h:")


def test_mailgun_summary_when_delivery_status_says_nothing() -> None:
    doc = dict(MAILGUN_TEMPORARY, **{"delivery-status": None})
    (ev,) = parse_mailgun(mailgun_body(doc))
    assert (ev.reason, ev.status) == ("failed (temporary, generic)", None)


MAILGUN_BAD = [
    b"",
    b"timestamp=1&token=x&signature=y&event=failed",  # the legacy form-encoded webhook
    b"[]",
    b'{"event": "failed", "recipient": "a@b.c"}',
    b'{"event-data": []}',
    b'{"event-data": "failed"}',
    mailgun_body(dict(MAILGUN_PERMANENT, message=["headers"])),
    mailgun_body(dict(MAILGUN_PERMANENT, message={"headers": "message-id: x"})),
    mailgun_body(dict(MAILGUN_PERMANENT, **{"delivery-status": "550"})),
    mailgun_body(dict(MAILGUN_PERMANENT, recipient="\udc80@example.com")),
]


@pytest.mark.parametrize("body", MAILGUN_BAD)
def test_mailgun_malformed_is_feedback_error(body: bytes) -> None:
    with pytest.raises(FeedbackError):
        parse_mailgun(body)


# Mailgun's signature: the body's own signature block, HMAC-SHA256 of timestamp + token

NOW = 1529006854.0


def test_mailgun_signature_good() -> None:
    verify_mailgun(mailgun_body(MAILGUN_PERMANENT), MAILGUN_KEY, now=NOW + 10)
    verify_mailgun(mailgun_body(MAILGUN_PERMANENT, timestamp=1529006854), MAILGUN_KEY, now=NOW)


def test_mailgun_signature_parent_signature_is_accepted() -> None:
    parent = b"key-of-the-primary-account"
    doc = json.loads(mailgun_body(MAILGUN_PERMANENT))
    doc["signature"]["parent-signature"] = hmac.new(
        parent, f"1529006854{MAILGUN_TOKEN}".encode(), hashlib.sha256
    ).hexdigest()
    verify_mailgun(dumps(doc), parent, now=NOW)
    verify_mailgun(dumps(doc), MAILGUN_KEY, now=NOW)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (mailgun_body(MAILGUN_PERMANENT), b"key-wrong"),
        (mailgun_body(MAILGUN_PERMANENT), b""),
        (mailgun_body(MAILGUN_PERMANENT, signature="0" * 64), MAILGUN_KEY),
        (mailgun_body(MAILGUN_PERMANENT, signature="\u00e9" * 64), MAILGUN_KEY),
        (mailgun_body(MAILGUN_PERMANENT, key=b"key-other"), MAILGUN_KEY),
        (mailgun_body(MAILGUN_PERMANENT, token=""), MAILGUN_KEY),
        (mailgun_body(MAILGUN_PERMANENT, timestamp="1529006854.5"), MAILGUN_KEY),
        (mailgun_body(MAILGUN_PERMANENT, timestamp="-1529006854"), MAILGUN_KEY),
        (mailgun_body(MAILGUN_PERMANENT, timestamp=10**400), MAILGUN_KEY),
        (dumps({"event-data": MAILGUN_PERMANENT}), MAILGUN_KEY),
        (dumps({"signature": "abc", "event-data": MAILGUN_PERMANENT}), MAILGUN_KEY),
        (dumps({"signature": {"timestamp": "1529006854", "token": MAILGUN_TOKEN}}), MAILGUN_KEY),
        (b"not json", MAILGUN_KEY),
        (b"[]", MAILGUN_KEY),
    ],
)
def test_mailgun_signature_bad(body: bytes, key: bytes) -> None:
    with pytest.raises(SignatureError):
        verify_mailgun(body, key, now=NOW)


def test_mailgun_signature_tampered_timestamp() -> None:
    doc = json.loads(mailgun_body(MAILGUN_PERMANENT))
    doc["signature"]["timestamp"] = "1529006855"
    with pytest.raises(SignatureError, match="does not match"):
        verify_mailgun(dumps(doc), MAILGUN_KEY, now=NOW)


@pytest.mark.parametrize(("offset", "ok"), [(0, True), (299, True), (-299, True), (301, False)])
def test_mailgun_signature_age(offset: float, ok: bool) -> None:
    body = mailgun_body(MAILGUN_PERMANENT)
    for now in (NOW + offset, NOW - offset):
        if ok:
            verify_mailgun(body, MAILGUN_KEY, now=now)
        else:
            with pytest.raises(SignatureError, match="from now"):
                verify_mailgun(body, MAILGUN_KEY, now=now)
    verify_mailgun(body, MAILGUN_KEY, now=NOW + 3000, max_age=3600)


# --- SendGrid's Signed Event Webhook ------------------------------------------------------------


@pytest.fixture(scope="module")
def sg_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def sg_public(key: ec.EllipticCurvePrivateKey, encoding: str) -> bytes:
    """As SendGrid's settings page shows it (base64 of the DER SubjectPublicKeyInfo), or PEM."""
    pub = key.public_key()
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    if encoding == "pem":
        return pub.public_bytes(serialization.Encoding.PEM, fmt)
    return base64.b64encode(pub.public_bytes(serialization.Encoding.DER, fmt))


def sg_sign(key: ec.EllipticCurvePrivateKey, timestamp: str, body: bytes) -> str:
    """As SendGrid signs (and its libraries verify, sendgrid-python's
    helpers/eventwebhook): ECDSA with SHA-256 over timestamp + body, DER, base64."""
    return base64.b64encode(key.sign(timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))).decode()


SG_BODY = dumps(SENDGRID_BATCH)
SG_TS = "1600112502"


@pytest.mark.parametrize("encoding", ["b64", "pem"])
def test_sendgrid_signature_good(sg_key: ec.EllipticCurvePrivateKey, encoding: str) -> None:
    verify_sendgrid(SG_BODY, sg_sign(sg_key, SG_TS, SG_BODY), SG_TS, sg_public(sg_key, encoding))
    # the key as pasted, with its line breaks and surrounding blanks
    wrapped = b"\n  " + b"\n".join(re.findall(rb".{1,40}", sg_public(sg_key, "b64"))) + b"\n"
    verify_sendgrid(SG_BODY, sg_sign(sg_key, SG_TS, SG_BODY), SG_TS, wrapped)


def test_sendgrid_signature_tampered(sg_key: ec.EllipticCurvePrivateKey) -> None:
    sig, pub = sg_sign(sg_key, SG_TS, SG_BODY), sg_public(sg_key, "b64")
    with pytest.raises(SignatureError, match="does not match"):
        verify_sendgrid(SG_BODY.replace(b"bounce", b"bounced"), sig, SG_TS, pub)
    with pytest.raises(SignatureError, match="does not match"):
        verify_sendgrid(SG_BODY, sig, "1600112503", pub)
    other = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(SignatureError, match="does not match"):
        verify_sendgrid(SG_BODY, sig, SG_TS, sg_public(other, "b64"))
    raw = bytearray(base64.b64decode(sig))
    raw[-1] ^= 1
    with pytest.raises(SignatureError):
        verify_sendgrid(SG_BODY, base64.b64encode(bytes(raw)).decode(), SG_TS, pub)


@pytest.mark.parametrize("signature", ["", "not base64!", "AAAA", "\u00e9t\u00e9", "////"])
def test_sendgrid_signature_malformed(sg_key: ec.EllipticCurvePrivateKey, signature: str) -> None:
    with pytest.raises(SignatureError):
        verify_sendgrid(SG_BODY, signature, SG_TS, sg_public(sg_key, "b64"))


def test_sendgrid_timestamp_not_text(sg_key: ec.EllipticCurvePrivateKey) -> None:
    sig = sg_sign(sg_key, SG_TS, SG_BODY)
    with pytest.raises(SignatureError):
        verify_sendgrid(SG_BODY, sig, "\udc80", sg_public(sg_key, "b64"))


def _other_keys() -> list[bytes]:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    ed = ed25519.Ed25519PrivateKey.generate().public_key()
    return [
        b"",
        b"not a key",
        base64.b64encode(b"\x30\x03\x02\x01\x00"),
        b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
        base64.b64encode(p384.public_bytes(serialization.Encoding.DER, spki)),
        ed.public_bytes(serialization.Encoding.PEM, spki),
    ]


@pytest.mark.parametrize("public_key", _other_keys())
def test_sendgrid_bad_public_key(sg_key: ec.EllipticCurvePrivateKey, public_key: bytes) -> None:
    with pytest.raises(SignatureError, match="public key"):
        verify_sendgrid(SG_BODY, sg_sign(sg_key, SG_TS, SG_BODY), SG_TS, public_key)
    with pytest.raises(SignatureError):
        providers.load_sendgrid_public_key(public_key)


# --- generic ----------------------------------------------------------------------------------


def test_generic_single_object_with_everything() -> None:
    body = {
        "type": "bounce",
        "recipient": "Jane@Example.com",
        "message_id": "<m1@app.example>",
        "upstream_id": "Q123",
        "reason": "550 5.1.1 no such user",
        "id": "evt-1",
    }
    (ev,) = parse_generic(dumps(body))
    assert ev == FeedbackEvent(
        provider="generic",
        type="bounce",
        recipient="Jane@Example.com",
        event_id="evt-1",
        message_id="<m1@app.example>",
        upstream_id="Q123",
        reason="550 5.1.1 no such user",
        status="5.1.1",
    )


def test_generic_array_and_content_id() -> None:
    items = [
        {"type": "complaint", "recipient": "a@example.com", "id": 7},
        {"type": "soft_bounce", "recipient": "b@example.com", "reason": "mailbox full"},
        {"type": "bounce", "recipient": "c@example.com", "message_id": None, "status": "5.2.1"},
    ]
    a, b, c = parse_generic(dumps(items))
    assert (a.type, a.event_id) == ("complaint", "7")
    assert b.event_id == content_id("soft_bounce", "b@example.com", None, None, "mailbox full")
    assert c.status == "5.2.1" and c.reason == ""
    assert parse_generic(b"[]") == []


GENERIC_BAD = [
    b"",
    b"bounce a@example.com",
    b'"bounce"',
    b"7",
    b"null",
    b"{}",
    b'{"recipient": "a@example.com"}',
    b'{"type": "hard_bounce", "recipient": "a@example.com"}',
    b'{"type": ["bounce"], "recipient": "a@example.com"}',
    b'{"type": "BOUNCE", "recipient": "a@example.com"}',
    b'{"type": "bounce"}',
    b'{"type": "bounce", "recipient": ""}',
    b'{"type": "bounce", "recipient": "   "}',
    b'{"type": "bounce", "recipient": ["a@example.com"]}',
    b'{"type": "bounce", "recipient": "a@example.com", "message_id": 5}',
    b'{"type": "bounce", "recipient": "a@example.com", "reason": {"text": "x"}}',
    b'{"type": "bounce", "recipient": "a@example.com", "id": true}',
    b'{"type": "bounce", "recipient": "a@example.com", "id": 1.5}',
    b'{"type": "bounce", "recipient": "a@example.com", "status": "550"}',
    b'{"type": "bounce", "recipient": "\\ud800@example.com"}',
    b'[{"type": "bounce", "recipient": "a@example.com"}, "b@example.com"]',
    b'[{"type": "bounce", "recipient": "a@example.com"}, {"type": "bounce"}]',
    b"\x80",
]


@pytest.mark.parametrize("body", GENERIC_BAD)
def test_generic_malformed_is_feedback_error(body: bytes) -> None:
    with pytest.raises(FeedbackError) as info:
        parse_generic(body)
    assert str(info.value).startswith("generic")
    assert len(str(info.value)) < 200


def test_errors_are_short_and_name_the_provider() -> None:
    for parser, name in PARSERS:
        with pytest.raises(FeedbackError, match=f"^{name}: the body is not JSON"):
            parser(b"{" + b"x" * 10_000)
        with pytest.raises(FeedbackError, match="not UTF-8"):
            parser(b'{"a": "\xff"}')


def test_utf8_bom_is_tolerated() -> None:
    assert parse_generic(b"\xef\xbb\xbf[]") == []


# --- whatever JSON arrives, only FeedbackError escapes -----------------------------------------

PARSERS: list[tuple[Parser, str]] = [
    (parse_ses, "ses"),
    (parse_postmark, "postmark"),
    (parse_sendgrid, "sendgrid"),
    (parse_mailgun, "mailgun"),
    (parse_generic, "generic"),
]
KEYS = [
    # SNS and SES
    "Type", "Message", "MessageId", "TopicArn", "SubscribeURL", "notificationType",
    "eventType", "mail", "messageId", "commonHeaders", "headers", "name", "value", "bounce",
    "bounceType", "bounceSubType", "bouncedRecipients", "emailAddress", "status",
    "diagnosticCode", "complaint", "complainedRecipients", "complaintFeedbackType",
    "feedbackId", "deliveryDelay", "delayedRecipients", "timestamp",
    # Postmark
    "RecordType", "TypeCode", "ID", "MessageID", "Email", "Details", "Description",
    # SendGrid
    "event", "email", "sg_event_id", "sg_message_id", "smtp-id", "reason", "response",
    "type",
    # Mailgun
    "event-data", "signature", "severity", "recipient", "id", "message", "message-id",
    "delivery-status", "enhanced-code", "bounce-code",
    # generic
    "upstream_id", "message_id",
]  # fmt: skip
WORDS = [
    "Notification", "SubscriptionConfirmation", "UnsubscribeConfirmation", "Bounce",
    "Complaint", "DeliveryDelay", "Delivery", "Permanent", "Transient", "SpamComplaint",
    "HardBounce", "SoftBounce", "bounce", "dropped", "deferred", "spamreport", "blocked",
    "Bounced Address", "failed", "complained", "permanent", "temporary", "suppress-complaint",
    "soft_bounce", "complaint", "a@example.com", "5.1.1", "{}", "[]", '{"mail": {}}',
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(WORDS)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=8)
    ),
    max_leaves=40,
)


def check(parser: Parser, provider: str, body: bytes) -> None:
    try:
        events = parser(body)
    except FeedbackError as e:
        assert str(e).startswith(provider) and len(str(e)) < 300
        return
    except SubscriptionConfirmation:
        assert provider == "ses"
        return
    for ev in events:
        assert isinstance(ev, FeedbackEvent) and ev.provider == provider
        assert ev.type in EVENT_TYPES
        assert isinstance(ev.recipient, str) and ev.recipient.strip()
        assert isinstance(ev.event_id, str) and ev.event_id
        assert isinstance(ev.reason, str) and len(ev.reason) <= 500 and "\n" not in ev.reason
        assert ev.status is None or re.fullmatch(r"[245]\.\d{1,3}\.\d{1,3}", ev.status)
        for v in (ev.message_id, ev.upstream_id):
            assert v is None or (isinstance(v, str) and v)
        content_id(ev.recipient, ev.event_id, ev.reason, ev.message_id, ev.upstream_id)


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(("parser", "provider"), PARSERS, ids=[n for _, n in PARSERS])
@SETTINGS
@given(value=json_values)
def test_any_json_gives_events_or_feedback_error(parser: Parser, provider: str, value: Any) -> None:
    check(parser, provider, json.dumps(value).encode())


@SETTINGS
@given(value=json_values, message_id=scalars)
def test_any_json_in_an_sns_envelope(value: Any, message_id: Any) -> None:
    envelope = {"Type": "Notification", "MessageId": message_id, "Message": json.dumps(value)}
    check(parse_ses, "ses", dumps(envelope))


@SETTINGS
@given(event_data=json_values)
def test_any_json_as_mailgun_event_data(event_data: Any) -> None:
    check(parse_mailgun, "mailgun", dumps({"event-data": event_data}))
    try:
        verify_mailgun(mailgun_body(event_data), MAILGUN_KEY, now=NOW)
    except SignatureError:
        pytest.fail("a well-signed body was refused")


@SETTINGS
@given(events=st.lists(st.dictionaries(st.sampled_from(KEYS), scalars, max_size=8), max_size=5))
def test_any_sendgrid_event_fields(events: list[dict[str, Any]]) -> None:
    check(parse_sendgrid, "sendgrid", dumps(events))


@pytest.mark.parametrize(("parser", "provider"), PARSERS, ids=[n for _, n in PARSERS])
@SETTINGS
@given(body=st.binary(max_size=64))
def test_any_bytes_give_events_or_feedback_error(
    parser: Parser, provider: str, body: bytes
) -> None:
    check(parser, provider, body)
    try:
        verify_mailgun(body, MAILGUN_KEY, now=NOW)
    except SignatureError:
        pass
