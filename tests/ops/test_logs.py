from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import relay.ops.logs as logs
from relay.ops.logs import (
    EVENTS,
    REDACTED,
    JSONFormatter,
    log_event,
    logfmt_quote,
    mask_address,
    reconfigure,
    setup_logging,
)

ADDR = "john.doe@Example.COM"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers = list(root.handlers)
    level = root.level
    aiosmtpd = logging.getLogger("mail.log")
    aiosmtpd_level = aiosmtpd.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    aiosmtpd.setLevel(aiosmtpd_level)


def _setup(fmt: str = "json", *, unmask: bool = False, level: str = "info") -> io.StringIO:
    stream = io.StringIO()
    setup_logging(level=level, fmt=fmt, unmask=unmask, stream=stream)
    return stream


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().split("\n")[:-1]


def _json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in _lines(stream)]


LOGGER = logging.getLogger("relay.test")


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("user@example.com", "u***@example.com"),
        ("<>", "<>"),
        ("", "<>"),
        ("  <>  ", "<>"),
        ("USER@EXAMPLE.COM", "U***@example.com"),
        ("John.Doe@Mail.Example.ORG", "J***@mail.example.org"),
        ("postmaster", "p***"),
        ("MAILER-DAEMON", "M***"),
        ('"john doe"@example.com', "j***@example.com"),
        ('"weird@local"@example.com', "w***@example.com"),
        ('"\\"quoted\\""@example.com', '"***@example.com'),
        ("<user@example.com>", "<u***@example.com>"),
        ("John Doe <john@example.com>", "<j***@example.com>"),
        ("a@example.com", "a***@example.com"),
        ("user+tag@[192.0.2.1]", "u***@[192.0.2.1]"),
        ("@example.com", "***@example.com"),
        ("u***@example.com", "u***@example.com"),
    ],
)
def test_mask_address(addr: str, expected: str) -> None:
    assert mask_address(addr) == expected


def test_mask_address_keeps_domain_only() -> None:
    masked = mask_address("alice.secret@example.net")
    assert "alice" not in masked
    assert masked.endswith("@example.net")


# --------------------------------------------------------------------------- JSON


def test_json_line_has_standard_and_structured_fields() -> None:
    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "accepted", "message spooled", queue_id="abc", size=1234)
    (rec,) = _json_lines(stream)
    assert list(rec)[:5] == ["ts", "level", "logger", "event", "msg"]
    assert rec["level"] == "info"
    assert rec["logger"] == "relay.test"
    assert rec["event"] == "accepted"
    assert rec["msg"] == "message spooled"
    assert rec["queue_id"] == "abc"
    assert rec["size"] == 1234
    assert isinstance(rec["ts"], str)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["ts"])


def test_plain_records_are_rendered_too() -> None:
    stream = _setup("json")
    LOGGER.warning("disk %s is %d%% full", "/var", 93)
    (rec,) = _json_lines(stream)
    assert rec["event"] == "log"
    assert rec["level"] == "warning"
    assert rec["msg"] == "disk /var is 93% full"


def test_each_record_is_exactly_one_line() -> None:
    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "delivered", "multi\nline\u2028msg", reply="250 ok\r\nbye")
    lines = _lines(stream)
    assert len(lines) == 1
    assert len(stream.getvalue().splitlines()) == 1
    assert json.loads(lines[0])["msg"] == "multi\nline\u2028msg"


def test_reserved_field_names_do_not_clobber_standard_keys() -> None:
    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "accepted", "real", msg="fake", level="x", ts="y")
    (rec,) = _json_lines(stream)
    assert rec["msg"] == "real"
    assert rec["level"] == "info"
    assert rec["field_msg"] == "fake"
    assert rec["field_level"] == "x"
    assert rec["field_ts"] == "y"


def test_unserializable_values_are_stringified() -> None:
    class Thing:
        def __str__(self) -> str:
            return "thing!"

    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "accepted", "", obj=Thing(), tags={"b", "a"})
    (rec,) = _json_lines(stream)
    assert rec["obj"] == "thing!"
    assert rec["tags"] == ["a", "b"]


# --------------------------------------------------------------------------- privacy


def _log_pii() -> None:
    log_event(
        LOGGER,
        logging.INFO,
        "accepted",
        f"accepted mail for {ADDR}",
        queue_id="q1",
        rcpt=ADDR,
        recipient=ADDR,
        sender=ADDR,
        address=ADDR,
        rcpts=[ADDR, "other@example.org"],
        reason=f"550 5.1.1 <{ADDR}>: Recipient address rejected",
    )
    try:
        raise ValueError(f"refused {ADDR}")
    except ValueError as exc:
        log_event(LOGGER, logging.ERROR, "failed", "delivery failed", exc=exc, rcpt=ADDR)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_full_address_never_appears_when_masked(fmt: str) -> None:
    stream = _setup(fmt, level="debug")
    _log_pii()
    out = stream.getvalue()
    assert ADDR not in out
    assert ADDR.lower() not in out
    assert "john.doe" not in out
    assert "other@example.org" not in out
    assert "j***@example.com" in out
    assert "o***@example.org" in out


def test_masked_json_values() -> None:
    stream = _setup("json")
    _log_pii()
    rec = _json_lines(stream)[0]
    for key in ("rcpt", "recipient", "sender", "address"):
        assert rec[key] == "j***@example.com"
    assert rec["rcpts"] == ["j***@example.com", "o***@example.org"]
    assert rec["reason"] == "550 5.1.1 <j***@example.com>: Recipient address rejected"


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_unmask_shows_addresses(fmt: str) -> None:
    stream = _setup(fmt, unmask=True)
    _log_pii()
    out = stream.getvalue()
    assert ADDR in out
    assert "other@example.org" in out


def test_null_sender_stays_null() -> None:
    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "accepted", "", sender="")
    log_event(LOGGER, logging.INFO, "accepted", "", sender="<>")
    assert [r["sender"] for r in _json_lines(stream)] == ["<>", "<>"]


def test_message_id_is_not_masked() -> None:
    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "accepted", "", message_id="<abc.123@host.example>")
    (rec,) = _json_lines(stream)
    assert rec["message_id"] == "<abc.123@host.example>"


@pytest.mark.parametrize("fmt", ["json", "text"])
@pytest.mark.parametrize("unmask", [False, True])
def test_secrets_and_bodies_are_redacted(fmt: str, unmask: bool) -> None:
    stream = _setup(fmt, unmask=unmask)
    log_event(
        LOGGER,
        logging.INFO,
        "accepted",
        "auth",
        password="hunter2-pw",
        secret="s3cr3t-value",
        token="tok-value",
        body="Subject: private\r\n\r\nconfidential body",
        content=b"raw content bytes",
        smarthost_password="other-pw",
        nested={"user": "bob", "password": "nested-pw"},
        data=b"binary payload",
    )
    out = stream.getvalue()
    for secret in (
        "hunter2-pw",
        "s3cr3t-value",
        "tok-value",
        "confidential",
        "raw content",
        "other-pw",
        "nested-pw",
        "binary payload",
    ):
        assert secret not in out
    assert REDACTED in out
    if fmt == "json":
        (rec,) = _json_lines(stream)
        for key in ("password", "secret", "token", "body", "content", "smarthost_password"):
            assert rec[key] == REDACTED
        assert rec["nested"] == {"user": "bob", "password": REDACTED}
        assert rec["data"] == "<14 bytes>"


def test_exception_without_traceback_at_info() -> None:
    stream = _setup("json", level="info")
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        LOGGER.exception("lost connection")
    (rec,) = _json_lines(stream)
    assert rec["exc_type"] == "ConnectionResetError"
    assert rec["exc"] == "peer went away"
    assert "traceback" not in rec
    assert "Traceback" not in stream.getvalue()


def test_exception_traceback_only_at_debug() -> None:
    stream = _setup("text", level="debug")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log_event(LOGGER, logging.ERROR, "failed", "oops", exc_info=True)
    (line,) = _lines(stream)
    assert "exc_type=RuntimeError" in line
    assert "exc=boom" in line
    assert 'traceback="Traceback (most recent call last):\\n' in line


def test_log_event_is_lazy() -> None:
    class Exploding:
        def __str__(self) -> str:
            raise AssertionError("must not be rendered")

    stream = _setup("json", level="warning")
    log_event(LOGGER, logging.INFO, "accepted", "skipped", obj=Exploding())
    assert stream.getvalue() == ""


# --------------------------------------------------------------------------- setup


def test_setup_twice_does_not_duplicate_lines() -> None:
    setup_logging("info", "json", stream=io.StringIO())
    stream = _setup("json")
    log_event(LOGGER, logging.INFO, "accepted", "once")
    assert len(_lines(stream)) == 1
    ours = [h for h in logging.getLogger().handlers if isinstance(h.formatter, JSONFormatter)]
    assert len(ours) == 1


def test_reconfigure_keeps_stream_and_applies_new_settings() -> None:
    stream = _setup("json", level="warning")
    LOGGER.info("hidden")
    reconfigure("info", "text", True)
    log_event(LOGGER, logging.INFO, "accepted", "shown", rcpt=ADDR)
    (line,) = _lines(stream)
    assert line.startswith("ts=")
    assert f"rcpt={ADDR}" in line
    assert logging.getLogger().level == logging.INFO


def test_invalid_settings_raise() -> None:
    with pytest.raises(ValueError, match="log level"):
        setup_logging("loud", "json", stream=io.StringIO())
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "xml", stream=io.StringIO())


def test_aiosmtpd_logger_is_clamped_unless_unmasked() -> None:
    _setup("json", level="debug")
    assert logging.getLogger("mail.log").level == logging.WARNING
    _setup("json", level="debug", unmask=True)
    # Never DEBUG: aiosmtpd logs DATA lines (message bodies) at DEBUG.
    assert logging.getLogger("mail.log").level == logging.INFO


# --------------------------------------------------------------------------- logfmt


def test_logfmt_line_layout() -> None:
    stream = _setup("text")
    log_event(LOGGER, logging.INFO, "accepted", "message spooled", queue_id="abc", rcpt=ADDR)
    (line,) = _lines(stream)
    assert re.fullmatch(
        r"ts=\S+Z level=info logger=relay\.test event=accepted queue_id=abc "
        r'rcpt=j\*\*\*@example\.com msg="message spooled"',
        line,
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("abc", "abc"),
        ("", '""'),
        ("two words", '"two words"'),
        ("a=b", '"a=b"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("line1\nline2", '"line1\\nline2"'),
        ("tab\there", '"tab\\there"'),
        ("bell\x07", '"bell\\u0007"'),
        ("sep\u2028x", '"sep\\u2028x"'),
        ("héllo", "héllo"),
    ],
)
def test_logfmt_quote(value: str, expected: str) -> None:
    assert logfmt_quote(value) == expected


def test_logfmt_values_with_spaces_are_quoted_in_lines() -> None:
    stream = _setup("text")
    log_event(
        LOGGER,
        logging.WARNING,
        "deferred",
        'he said "no"',
        reply="451 4.7.1 try later",
        attempts=3,
        tls=True,
        rcpts=["a@x.org", "b@y.org"],
    )
    (line,) = _lines(stream)
    assert 'reply="451 4.7.1 try later"' in line
    assert "attempts=3" in line
    assert "tls=true" in line
    assert "rcpts=a***@x.org,b***@y.org" in line
    assert line.endswith('msg="he said \\"no\\""')


# --------------------------------------------------------------------------- events


def test_standard_event_names_are_constants_and_documented() -> None:
    expected = {
        "accepted",
        "deduplicated",
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
        "message_id_reused",
    }
    assert expected == EVENTS
    doc = logs.__doc__ or ""
    for name in expected:
        assert f"``{name}``" in doc


def test_absent_fields_are_left_out_not_null() -> None:
    import json
    import logging

    from relay.ops.logs import JSONFormatter, log_event

    logger = logging.getLogger("relay.test.nulls")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = Keep()
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        log_event(
            logger,
            logging.INFO,
            "deferred",
            "recipient deferred",
            queue_id="Q",
            next_attempt_at=None,
        )
    finally:
        logger.removeHandler(h)
    doc = json.loads(JSONFormatter().format(records[0]))
    assert doc["queue_id"] == "Q" and "next_attempt_at" not in doc


# --- the formatter's fast paths, held to the general code ------------------------------

_ADDR_TEXT = st.text(alphabet='ab"<>@ \\\t\u00a0.Xé', max_size=14)


@given(_ADDR_TEXT)
def test_mask_address_fast_path_is_the_general_one(addr: str) -> None:
    assert mask_address(addr) == logs._mask_stripped(addr.strip())


def _old_redact_tree(value: object) -> object:
    """`_redact_tree` before its `plain` shortcut: every string through redact_text."""
    if isinstance(value, str):
        return logs.redact_text(value)
    if isinstance(value, list):
        return [_old_redact_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: _old_redact_tree(v) for k, v in value.items()}
    return value


def _reference_payload(fmt: JSONFormatter, record: logging.LogRecord) -> dict[str, object]:
    """What `payload` gave before its fast paths: every field through the general
    `_sanitize`, then every non-scalar through `_redact_tree` without the shortcut."""
    fields = record.fields  # type: ignore[attr-defined]
    record.fields = {}  # type: ignore[attr-defined]
    out = fmt.payload(record)
    record.fields = fields  # type: ignore[attr-defined]
    for raw_key, value in fields.items():
        if value is None:
            continue
        key = str(raw_key)
        out_key = f"field_{key}" if key in logs._RESERVED_KEYS else key
        out[out_key] = logs._sanitize_general(key, value, fmt.unmask)
    for k, v in out.items():
        if isinstance(v, str):
            if k in logs._WHOLE_URL_KEYS:
                out[k] = logs._replace_secrets(v)
            elif logs._secrets or "://" in v:
                out[k] = logs.redact_text(v)
        elif not isinstance(v, int | float | bool) and v is not None:
            out[k] = _old_redact_tree(v)
    return out


_KEYS = st.sampled_from(
    ["rcpts", "sender", "rcpt", "message_id", "password", "queue_id", "error", "size",
     "msg", "subscribe_url", "detail"]
)  # fmt: skip
_TEXT = st.one_of(
    st.text(alphabet='ab@:/.s3cr3tX <>"', max_size=24),
    st.sampled_from(["https://u:pw@h.example/x?token=abc", "see http://h.example/?k=v"]),
)
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    _TEXT,
    st.lists(_TEXT, max_size=3),
    st.lists(st.one_of(_TEXT, st.integers(), st.none()), max_size=3),
    st.dictionaries(_TEXT, _TEXT, max_size=2),
    st.tuples(_TEXT, st.integers()),
)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.dictionaries(_KEYS, _VALUES, max_size=6),
    unmask=st.booleans(),
    secrets=st.booleans(),
)
def test_payload_fast_paths_are_the_general_ones(
    fields: dict[str, object], unmask: bool, secrets: bool
) -> None:
    fmt = JSONFormatter(unmask=unmask)
    record = logging.LogRecord("relay.t", logging.INFO, __file__, 1, "m a@b.example", (), None)
    record.event = "accepted"
    record.fields = fields
    saved = logs._secrets
    try:
        logs.set_secrets({"s3cr3tXs3cr3t": "***"} if secrets else {})
        assert fmt.payload(record) == _reference_payload(fmt, record)
    finally:
        logs._secrets = saved


@settings(max_examples=300, deadline=None)
@given(
    key=_KEYS,
    value=_VALUES,
    unmask=st.booleans(),
    depth=st.integers(min_value=0, max_value=logs._MAX_DEPTH + 1),
)
def test_sanitize_fast_paths_are_the_general_ones(
    key: str, value: object, unmask: bool, depth: int
) -> None:
    assert logs._sanitize(key, value, unmask, depth) == logs._sanitize_general(
        key, value, unmask, depth
    )


_JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and the infinities too: allow_nan, as json.dumps
    st.text(max_size=12),  # non-ASCII, controls and lone surrogates: escaped
    st.builds(object),  # through `default`, as json.dumps
)
_JSON_TREES = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _JSON_TREES, max_size=6))
def test_the_c_encoder_made_once_writes_what_json_dumps_writes(payload: dict[str, object]) -> None:
    assert logs._ENCODE is not logs._JSON.encode  # CPython has its C encoder
    expected = json.dumps(payload, separators=(",", ":"), default=str)
    assert logs._ENCODE(payload) == expected
    # and the formatter writes through it
    record = logging.LogRecord("relay.t", logging.INFO, __file__, 1, "m", (), None)
    record.event = "e"
    record.fields = {"detail": "x"}
    assert JSONFormatter().format(record) == logs._ENCODE(JSONFormatter().payload(record))
