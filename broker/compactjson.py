"""Compact JSON on the hot paths: orjson's speed with `json.dumps`' verdicts.

Whatever orjson would write differently (a `null`, subclasses, big integers)
is encoded by json. Digests that must not change across versions keep json.
See docs/decisions.md ("Payloads are compact JSON, stored byte for byte").
"""

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
