"""The config's value types (relay/config/values.py): each parser's table, and the same
values through pydantic, whose errors carry the parser's own text (the contract's wording)
and whose JSON Schema accepts what the parser accepts."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError

from relay.config import values as t


class _M(BaseModel):
    d: t.Duration = 0
    s: t.Size = 0
    r: t.Rate = None
    p: t.Percent = 0
    hp: t.HostPort = ("h", 1)
    n: t.Int(3) = 3  # type: ignore[valid-type]
    c: t.Choice("a", "b") = "a"  # type: ignore[valid-type]


SCHEMA = _M.model_json_schema()

DURATIONS: list[tuple[object, float]] = [
    ("30s", 30),
    ("5m", 300),
    ("2h", 7200),
    ("7d", 604800),
    ("250ms", 0.25),
    ("1w", 604800),
    ("90", 90),
    (" 2m ", 120),
    (45, 45),
    (1.5, 1.5),
    (0, 0),
]
BAD_DURATIONS: list[tuple[object, str]] = [
    ("5x", "'5x' is not a duration (use 30s, 5m, 2h, 7d or seconds)"),
    ("", "'' is not a duration (use 30s, 5m, 2h, 7d or seconds)"),
    ("5 minutes", "'5 minutes' is not a duration (use 30s, 5m, 2h, 7d or seconds)"),
    (-1, "-1 must not be negative"),
    (True, "True is not a duration"),
    (None, "None is not a duration (use 30s, 5m, 2h, 7d or seconds)"),
]
SIZES: list[tuple[object, int]] = [
    ("64KiB", 64 << 10),
    ("1MiB", 1 << 20),
    ("25MiB", 25 << 20),
    ("1KB", 1000),
    ("2G", 2 << 30),
    ("10B", 10),
    (123, 123),
]
BAD_SIZES = ["1.5MiB", "lots", -1, True, "64 kib"]
RATES: list[tuple[object, float | None]] = [
    ("50/s", 50),
    ("120/m", 2),
    ("3600/h", 1),
    ("86400/d", 1),
    ("10 / min", 10 / 60),
    (7, 7),
    ("unlimited", None),
    (None, None),
]
BAD_RATES = ["0/s", "lots", 0, -3, "5/week", True]


@pytest.mark.parametrize(("value", "seconds"), DURATIONS)
def test_duration(value: object, seconds: float) -> None:
    assert t.duration(value) == pytest.approx(seconds)
    assert _M(d=value).d == pytest.approx(seconds)


@pytest.mark.parametrize(("value", "text"), BAD_DURATIONS)
def test_duration_errors_keep_the_contract_text(value: object, text: str) -> None:
    with pytest.raises(ValueError) as ei:
        t.duration(value)
    assert str(ei.value) == text
    assert _error(d=value) == (("d",), text)


@pytest.mark.parametrize(("value", "octets"), SIZES)
def test_size(value: object, octets: int) -> None:
    assert t.size(value) == octets
    assert _M(s=value).s == octets


@pytest.mark.parametrize("value", BAD_SIZES)
def test_size_rejects(value: object) -> None:
    assert _error(s=value) == (("s",), f"{value!r} is not a size (use 25MiB, 64KiB or bytes)")


@pytest.mark.parametrize(("value", "per_second"), RATES)
def test_rate(value: object, per_second: float | None) -> None:
    want = None if per_second is None else pytest.approx(per_second)
    assert t.rate(value) == want
    assert _M(r=value).r == want


@pytest.mark.parametrize("value", BAD_RATES)
def test_rate_rejects(value: object) -> None:
    assert _error(r=value)[1] == f"{value!r} is not a rate (use 50/s, 100/m, 3600/h or unlimited)"


@pytest.mark.parametrize(
    ("value", "want"), [("10%", 10.0), (5, 5.0), ("0%", 0.0), (100, 100.0), ("2.5%", 2.5)]
)
def test_percent(value: object, want: float) -> None:
    assert _M(p=value).p == want


@pytest.mark.parametrize("value", ["101%", -1, "ten%", True, "10"])
def test_percent_rejects(value: object) -> None:
    assert _error(p=value)[1] == f"{value!r} is not a percentage (use 10% or 10)"


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("127.0.0.1:25", ("127.0.0.1", 25)),
        ("[::1]:2525", ("::1", 2525)),
        ("mx.example:0", ("mx.example", 0)),
    ],
)
def test_hostport(value: str, want: tuple[str, int]) -> None:
    assert _M(hp=value).hp == want


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("example.com", "'example.com' has no port (use host:port)"),
        ("h:x", "'x' is not a port number"),
        ("h:70000", "port 70000 is out of range"),
        (":25", "':25' has no host"),
        (25, "25 is not a host:port address"),
    ],
)
def test_hostport_rejects(value: object, text: str) -> None:
    assert _error(hp=value) == (("hp",), text)


@pytest.mark.parametrize(
    ("field", "value", "text"),
    [
        ("n", "many", "expected a whole number, got str 'many'"),
        ("n", True, "expected a whole number, got bool True"),
        ("n", 2, "2 is below the minimum 3"),
        ("n", 2.0, "expected a whole number, got float 2.0"),
        ("c", "z", "'z' is not one of a, b"),
        ("c", None, "expected a string, got nothing"),
    ],
)
def test_strict_scalars(field: str, value: object, text: str) -> None:
    assert _error(**{field: value}) == ((field,), text)


def test_every_error_of_a_model_at_once() -> None:
    with pytest.raises(ValidationError) as ei:
        _M(d="5x", s="big", n=0)
    assert [e["loc"] for e in ei.value.errors()] == [("d",), ("s",), ("n",)]


@pytest.mark.parametrize(
    ("field", "value"),
    [("d", v) for v, _ in DURATIONS]
    + [("s", v) for v, _ in SIZES]
    + [("r", v) for v, _ in RATES]
    + [("p", "10%"), ("hp", "a:1"), ("n", 3), ("c", "b")],
)
def test_the_json_schema_accepts_what_the_parser_accepts(field: str, value: object) -> None:
    jsonschema.validate({field: value}, SCHEMA)


@pytest.mark.parametrize(
    ("field", "value"),
    [("d", "5x"), ("d", -1), ("s", "1.5MiB"), ("r", "5/week"), ("n", 2), ("c", "z")],
)
def test_the_json_schema_rejects_what_the_parser_rejects(field: str, value: object) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({field: value}, SCHEMA)


def _error(**values: Any) -> tuple[tuple[int | str, ...], str]:
    with pytest.raises(ValidationError) as ei:
        _M(**values)
    (err,) = ei.value.errors()
    assert err["type"] == t.ERROR_TYPE
    return err["loc"], err["msg"]
