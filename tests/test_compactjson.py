"""broker/compactjson.py: json's bytes and refusals on orjson, for the WAL's
payloads and the trees' rows."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.trees import tree
from actors.writer.client import encode_payload
from broker import compactjson

pytestmark = pytest.mark.timeout(120)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _outcome(fn: Callable[[Any], bytes], value: Any) -> bytes | type[BaseException]:
    try:
        return fn(value)
    except (ValueError, TypeError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        return type(exc)


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return False


_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text())
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text() | st.integers(-5, 5), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=600, deadline=None)
@given(_values)
def test_bytes_and_refusals_are_jsons(value: Any) -> None:
    """The same bytes as json, or the same exception; a value holding a float
    may differ only in how an exponent is written, never in what it reads as."""
    got, want = _outcome(compactjson.dumps, value), _outcome(_json, value)
    if isinstance(want, bytes) and isinstance(got, bytes) and _has_float(value):
        assert json.loads(got) == json.loads(want)
    else:
        assert got == want


def test_every_code_point_is_written_as_json_writes_it() -> None:
    """orjson's answer is kept only where it is json's: every character outside
    the surrogates, in strings and as dict keys (one string per 4,096 code
    points, so the test is quick)."""
    for start in range(0, 0x110000, 4096):
        text = "".join(chr(c) for c in range(start, min(start + 4096, 0x110000))
                       if not 0xD800 <= c <= 0xDFFF)
        assert compactjson.dumps([text]) == _json([text])
        assert compactjson.dumps({text: 1}) == _json({text: 1})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, {"x": [1, math.nan]}])
def test_a_non_finite_number_is_refused_as_json_refuses_it(value: Any) -> None:
    with pytest.raises(ValueError, match="not JSON compliant"):
        compactjson.dumps(value)


def test_what_orjson_would_write_its_own_way_goes_to_json() -> None:
    class Name(str):
        pass

    class Count(int):
        pass

    class Colour(enum.Enum):
        RED = "red"

    @dataclasses.dataclass
    class Point:
        x: int

    assert compactjson.dumps({"n": Name("a"), "c": Count(3)}) == b'{"n":"a","c":3}'
    keys = {1: "int", None: "none", 2.5: "float"}
    assert compactjson.dumps(keys) == _json(keys) == b'{"1":"int","null":"none","2.5":"float"}'
    assert compactjson.dumps(2**64) == b"18446744073709551616"
    for refused in (datetime.datetime(2026, 1, 1), Point(1), object()):
        with pytest.raises(TypeError):
            compactjson.dumps(refused)
    with pytest.raises(UnicodeEncodeError):
        compactjson.dumps({"x": "\ud800"})
    deep: Any = 0
    for _ in range(300):  # past orjson's nesting limit, within json's
        deep = [deep]
    assert compactjson.dumps(deep) == _json(deep)
    # the differences left: orjson writes a plain Enum and a UUID, which json
    # refuses (no payload holds one: json would have refused it)
    assert compactjson.dumps(Colour.RED) == b'"red"'
    assert compactjson.dumps(uuid.UUID(int=1)) == b'"00000000-0000-0000-0000-000000000001"'


def test_a_none_and_a_null_inside_a_string_give_jsons_bytes() -> None:
    for value in ({"a": None}, ["null"], {"nullable": "not null"}):
        assert compactjson.dumps(value) == _json(value)


def test_the_payloads_and_rows_on_it() -> None:
    """encode_payload and tree.encode_row give what they gave on json (a row's
    bytes name its tree: they must not change), a name that is not UTF-8 on
    disk included."""
    assert encode_payload({"turn": 3, "ok": None, "text": "é\n"}) == _json(
        {"turn": 3, "ok": None, "text": "é\n"})
    digest = "ab" * 32
    for name in ("a.txt", "é ünïcode", 'quote"back\\slash', "tab\there", "null"):
        want = json.dumps([name, 0o100644, digest, 7], separators=(",", ":"), ensure_ascii=False)
        assert tree.encode_row(name, 0o100644, digest, 7) == want
    surrogate = b"caf\xe9".decode("utf-8", "surrogateescape")
    row = tree.encode_row(surrogate, 0o100644, digest, 7)
    assert row == json.dumps([surrogate, 0o100644, digest, 7], separators=(",", ":"))
    assert json.loads(row)[0] == surrogate
