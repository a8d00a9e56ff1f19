"""Boundary and edge cases of the pure modules relay/spool/dedup.py, relay/mail/address.py,
relay/mail/regex_guard.py and relay/delivery/replies.py that the main tables did not pin down (each
row
was written against a surviving mutant): Message-ID normalization, content Message-IDs of
header blocks with stray lines, printable/quoted-pair/local-part error texts, the
repetition-count and possessive/lookaround/branch rules of the ReDoS check, reply-code
bounds, lone surrogates in reply text, and classification of enhanced codes at RCPT."""

from __future__ import annotations

import hashlib

import pytest

from relay.delivery.replies import Outcome, Phase, Reply, classify, synthetic
from relay.mail.address import AddressError, check_mailbox, printable
from relay.mail.regex_guard import check_linear
from relay.spool import dedup

# --- relay/spool/dedup.py -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # No leading "<": a ">" inside is kept as is (only "<...>" is unwrapped).
        ("ab>c@Example.COM", "ab>c@example.com"),
        # Unwrapping stops at the first ">".
        ("<a@X.com> <b@y>", "a@x.com"),
        # Only the part after the last "@" is the domain: earlier text keeps its case.
        ("x@Y@Example.COM", "x@Y@example.com"),
    ],
)
def test_normalize_message_id_edge_cases(raw: str, expected: str) -> None:
    assert dedup.normalize_message_id(raw) == expected


def test_content_message_id_hashes_stray_lines_with_a_fixed_label() -> None:
    # The id must stay stable across releases (it is the dedup key of a resubmission), so
    # the exact bytes hashed are pinned here.
    expected = hashlib.sha256(
        b"subject:hi\r\n\r\nbody\x00non-field lines\r\nstray line"
    ).hexdigest()[:32]
    got = dedup.content_message_id(b"Subject: hi\r\nstray line", b"body", "r.example")
    assert got == f"<{expected}.content@r.example>"


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        # An empty line does not end the scan: the line after it is still reported.
        (b"\r\nstray", [b"stray"]),
        (b"A: 1\r\n\r\nstray", [b"stray"]),
        # A continuation line is skipped, and the scan goes on after it.
        (b"A: 1\r\n folded\r\nstray", [b"stray"]),
    ],
)
def test_non_field_lines_scan_the_whole_block(block: bytes, expected: list[bytes]) -> None:
    assert dedup._non_field_lines(block) == expected


# --- relay/mail/address.py ------------------------------------------------------------------------


def test_printable_keeps_first_code_point_after_surrogates() -> None:
    # U+E000 (private use) directly follows the surrogate range: printable, kept raw.
    assert printable("a\ue000b") == "a\ue000b"
    assert printable("\udfff") == "\\udfff"


def test_quoted_pair_as_last_two_characters_is_unterminated_not_bad_pair() -> None:
    with pytest.raises(AddressError, match=r"^unterminated quoted local part$"):
        check_mailbox('"a\\"')


def test_control_character_in_local_part_is_not_told_to_be_quoted() -> None:
    with pytest.raises(AddressError) as info:
        check_mailbox("a\x01b@example.com")
    assert str(info.value) == "character U+0001 not allowed in a local part"


def test_space_in_local_part_is_told_to_be_quoted() -> None:
    with pytest.raises(AddressError) as info:
        check_mailbox("a b@example.com")
    assert str(info.value) == "character space not allowed in a local part (quote it)"


# --- relay/mail/regex_guard.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [
        "(?:a{10})+",  # an inner count of 10 is bounded
        "(?:a+)++",  # a possessive repetition never backtracks: it is not "unbounded"
        "(?:a|b)++",
    ],
)
def test_check_linear_accepts(pattern: str) -> None:
    check_linear(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        "(?:a{11})+",  # an inner count above 10 counts as unbounded
        "(?:(?:a+)+)++",  # nesting inside a possessive repetition is still found
        "(?:(?:b|a+){2})*",  # an unbounded repetition inside a branch inside a '*'
        "(?:(?=a+)b)*",  # an unbounded repetition inside a lookahead inside a '*'
    ],
)
def test_check_linear_refuses(pattern: str) -> None:
    with pytest.raises(ValueError, match="nests repetitions"):
        check_linear(pattern)


# --- relay/delivery/replies.py --------------------------------------------------------------------


def test_lone_surrogate_not_from_a_byte_becomes_replacement_characters() -> None:
    # U+D800 cannot come from surrogateescape (which uses U+DC80-U+DCFF): it is encoded with
    # surrogatepass (3 bytes) and each invalid byte decodes to U+FFFD.
    assert Reply(550, None, "x\ud800 y").text == "x\ufffd\ufffd\ufffd y"


def test_reply_code_bounds() -> None:
    assert Reply(999, None, "odd").code == 999
    with pytest.raises(ValueError, match="three digits"):
        Reply(1000, None, "odd")


def test_from_str_keeps_a_continuation_line_without_code() -> None:
    assert Reply.from_str("550-5.1.1 a\nfoo bar") == Reply(550, "5.1.1", "a / foo bar")


@pytest.mark.parametrize(("code", "enhanced"), [(400, "4.0.0"), (599, "5.0.0")])
def test_synthetic_accepts_bounds(code: int, enhanced: str) -> None:
    assert synthetic(code, enhanced, "t") == Reply(code, enhanced, "t")


@pytest.mark.parametrize("code", [399, 600])
def test_synthetic_refuses_outside_bounds(code: int) -> None:
    with pytest.raises(ValueError, match=rf"^synthetic replies are 4xx or 5xx, got {code}$"):
        synthetic(code, "5.0.0", "t")


@pytest.mark.parametrize(
    ("code", "message", "phase", "outcome"),
    [
        # 5.2.1 mailbox disabled is about the address in every address phase.
        (550, "5.2.1 account disabled", Phase.DOT, Outcome.BOUNCE),
        (554, "5.2.1 account disabled", Phase.RCPT, Outcome.BOUNCE),
        # 5.3.1 mail system full: not the address.
        (550, "5.3.1 mail system full", Phase.RCPT, Outcome.FAIL),
        # Not a mailbox code (550/551/553): not the address, whatever the enh.
        (554, "5.0.0 transaction failed", Phase.RCPT, Outcome.FAIL),
        # 5.2.2 mailbox full: a valid mailbox.
        (550, "5.2.2 mailbox full", Phase.RCPT, Outcome.FAIL),
        # 5.2.3 message too long for the mailbox.
        (550, "5.2.3 message length exceeds limit", Phase.RCPT, Outcome.FAIL),
        # 5.4.4 unable to route: keeps 550's meaning.
        (550, "5.4.4 unable to route", Phase.RCPT, Outcome.BOUNCE),
        # 5.6.1 media not supported: content.
        (550, "5.6.1 media not supported", Phase.RCPT, Outcome.FAIL),
    ],
)
def test_enhanced_codes_at_address_phases(
    code: int, message: str, phase: Phase, outcome: Outcome
) -> None:
    assert classify(Reply.parse(code, message), phase).outcome is outcome


@pytest.mark.parametrize(
    ("code", "message", "throttled"),
    [
        (450, "4.7.1 go away", True),  # 4.7.x policy, not a security detail
        (450, "4.1.7 go away", False),  # subject 1, detail 7: not policy
        (454, "4.7.5 go away", False),  # security detail (cryptographic failure)
    ],
)
def test_throttled_by_enhanced_code_alone(code: int, message: str, throttled: bool) -> None:
    assert classify(Reply.parse(code, message), Phase.RCPT).throttled is throttled
