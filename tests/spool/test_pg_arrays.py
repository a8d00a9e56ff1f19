"""The arrays of the PostgreSQL hot path sent as the text of an array literal
(relay/spool/pg.py `array_literal`): whatever the values, the server reads back exactly the
values given, as psycopg's own binary dumper would have sent them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.spool import pg
from tests.pgserver import own_schema

# PostgreSQL's text holds no NUL; every other code point a str can encode in UTF-8
TEXTS = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
AWKWARD = ["", " ", "NULL", "null", '"', "\\", '\\"', "{", "}", ",", "a,b", " x ", '{"a"}', "'"]


@pytest.fixture(scope="module")
def conn() -> Iterator[pg.PgConnection]:
    # one schema for the module: hypothesis runs the test body many times in one call
    with own_schema() as dsn:
        c = pg.connect(dsn)
        yield c
        c.close()


def roundtrip(c: pg.PgConnection, values: list[Any], cast_to: str) -> list[Any]:
    row = c.execute(f"SELECT ?::{cast_to}[]", (values,)).fetchone()
    return list(row[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), TEXTS, st.sampled_from(AWKWARD)), max_size=12))
def test_texts_read_back_the_same(conn: pg.PgConnection, values: list[str | None]) -> None:
    assert pg.array_literal(values) is not None
    assert roundtrip(conn, values, "text") == values


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=12),
    st.lists(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)), max_size=12),
)
def test_numbers_read_back_the_same(
    conn: pg.PgConnection, ints: list[int | None], floats: list[float | None]
) -> None:
    assert roundtrip(conn, ints, "bigint") == ints
    got = roundtrip(conn, floats, "double precision")
    assert len(got) == len(floats)
    for a, b in zip(got, floats, strict=True):
        if b is not None and math.isnan(b):
            assert a is not None and math.isnan(a)
        else:
            assert a == b and (b is None or math.copysign(1, a) == math.copysign(1, b))


def test_what_the_literal_cannot_write_goes_to_psycopg(conn: pg.PgConnection) -> None:
    """bytes (bodies), bools and nested lists are not written as text; a float bound for an
    integer array keeps psycopg's dumper, whose cast rounds it as before."""
    assert pg.array_literal([b"x"]) is None
    assert pg.array_literal([True]) is None
    assert pg.array_literal([[1]]) is None
    assert roundtrip(conn, [b"\x00\xff", None], "bytea") == [b"\x00\xff", None]
    assert roundtrip(conn, [1.6, 2.0], "bigint") == [2, 2]
    slots = pg.array_slots("SELECT ?::bigint[], ?, ?::text[] WHERE '%' = '%'")
    assert slots == ((0, True), (2, False))
    sent = pg._texts_for_arrays(slots, [[1, 2], [3], ["a"]])
    assert sent == ["{1,2}", [3], '{"a"}']  # the uncast list is left to psycopg
