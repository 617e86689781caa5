"""The JSON policy for append payloads: what the writer accepts before framing.

See docs/wal.md ("The payload").
"""

from __future__ import annotations

import gc
import re

import orjson

from broker.errors import ProtocolError
from broker.protocol import ErrorCode

MAX_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # one JSON string, unrolled
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")


def _refuse(detail: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_PAYLOAD, detail)


def _depth_exceeds(structure: bytes, limit: int) -> bool:
    """Whether the brackets of `structure` (strings removed) nest deeper than
    `limit`: each pass removes every innermost pair, so the number of passes
    is the depth; at most `limit` passes over the bytes, no recursion."""
    brackets = structure.translate(_AS_SQUARE, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def check_payload(payload: bytes) -> None:
    """Return if `payload` obeys the policy, else raise ProtocolError
    (`invalid_payload`) saying which rule it breaks."""
    # The parsed value is dropped at once; with the cyclic GC paused, a payload
    # of a million tiny containers costs tens of milliseconds, not hundreds.
    paused = gc.isenabled()
    gc.disable()
    try:
        value = orjson.loads(payload)
        # compact already when orjson writes the value back byte for byte (it
        # writes no whitespace between tokens): what our clients send, mostly
        # (json.dumps with compact separators); anything else takes the scans
        try:
            compact = orjson.dumps(value) == payload
        except orjson.JSONEncodeError:  # nested past orjson's writer's bound
            compact = False
        del value
    except orjson.JSONDecodeError as exc:
        try:  # orjson calls any bad UTF-8 "surrogates not allowed": name the byte
            payload.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise _refuse(f"payload is not valid UTF-8: byte 0x{payload[bad.start]:02x} at "
                          f"offset {bad.start}: {bad.reason}") from exc
        raise _refuse(f"payload is not one valid JSON value: {exc}") from exc
    finally:
        if paused:
            gc.enable()
    if not compact and (b"\n" in payload or b"\r" in payload or b"\t" in payload):
        # JSON strings cannot hold these raw, so they can only be between tokens
        raise _refuse("payload has whitespace between tokens: send compact JSON on one line")
    structure: bytes | None = None
    if not compact and b" " in payload:
        structure = _STRING.sub(b'""', payload)
        if b" " in structure:
            raise _refuse("payload has whitespace between tokens: send compact JSON on one line")
    if payload.count(b"[") + payload.count(b"{") > MAX_DEPTH:
        if structure is None:
            structure = _STRING.sub(b'""', payload)
        if _depth_exceeds(structure, MAX_DEPTH):
            raise _refuse(f"payload nests arrays/objects deeper than {MAX_DEPTH} levels")
