"""Compact JSON on the hot paths: orjson's speed with json's verdicts.

`dumps(value)` gives the bytes of
`json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)`
encoded as UTF-8, and raises what that raises, at a tenth of its cost for a
small dict without a null (0.3 against 3.7 us; a benchmark step's six
payloads, a sixth of which hold a null, 5.7 against 17.7). orjson writes what json
writes for every string, integer, list, dict, bool and null; the only
difference left is the form of a float's exponent (`1e-07` from json, `1e-7`
from orjson: the same number, which every reader reads back alike), and a
plain Enum or a UUID, which orjson writes (the value, the canonical text)
where json refuses them (no payload holds one: json would have refused it
before). So:

- orjson is asked to decline what json treats differently or refuses: a
  subclass of str, int, dict or list, a dataclass, a datetime
  (`OPT_PASSTHROUGH_*`: it raises for them instead of writing its own form),
  an integer past 64 bits, a key that is not a str, a lone surrogate, nesting
  past its limit; whatever it declines is encoded by json, which writes it
  or raises as before (TypeError, UnicodeEncodeError, RecursionError);
- orjson writes NaN and Infinity as `null`, so output that holds `null`
  anywhere (a None, or those bytes inside a string) is encoded by json as
  well: the same bytes for a None, ValueError for a non-finite number.

Digests that must not change across versions (an action's digest in the
effect journal) keep json: a float's exponent would change them."""

from __future__ import annotations

import json
from typing import Any

import orjson

# orjson declines (raises for) what json writes its own way: callers that use
# orjson with their own fallback (the effect journal, the context's clip) too
PASSTHROUGH = (orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
               | orjson.OPT_PASSTHROUGH_DATETIME)


def dumps(value: Any) -> bytes:
    """Compact JSON of `value`, as json writes it (see the module's text)."""
    try:
        out = orjson.dumps(value, option=PASSTHROUGH)
    except (orjson.JSONEncodeError, TypeError):
        return _json(value)
    if b"null" in out:
        return _json(value)  # a None, or NaN/Infinity written as null
    return out


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
