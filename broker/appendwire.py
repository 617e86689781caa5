"""The append path's frames in C: `append`, `append_many` and their acks (msgspec).

Takes only frames it can prove valid and answers None for the rest (the
caller falls back to `protocol.decode`). It takes a frame only when `kind` is
its first key (no decode here goes deeper than 3); its patterns match to the
end of the string (Python's `$` would pass a trailing newline).
See docs/protocol.md ("The append path's codec") and docs/decisions.md
("The append path's frames in msgspec").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from broker import protocol

MSG_ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,64}\Z"
KEY_PATTERN = r"^[A-Za-z0-9_.:/\-]{1,128}\Z"
STREAM_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,127}\Z"
EVENT_PATTERN = r"^[a-z][a-z0-9_]{0,63}\Z"
MsgId = Annotated[str, Meta(pattern=MSG_ID_PATTERN)]
StreamName = Annotated[str, Meta(pattern=STREAM_PATTERN)]
EventType = Annotated[str, Meta(pattern=EVENT_PATTERN)]
IdemKey = Annotated[str, Meta(pattern=KEY_PATTERN)]
Seq = Annotated[int, Meta(ge=1, le=2**63 - 1)]
LedgerName = Literal["budget", "approvals"]
Version = Literal[1]


class AppendFrame(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind",
                  tag="append"):
    """An `append` (protocol.Append's fields). Its names are decoded as plain
    str and checked against their patterns by `decode_request` (the names an
    appender repeats once, then remembered: five pattern checks in the decode
    were most of its cost)."""

    msg_id: str
    origin: str
    key: str
    stream: str
    event: str
    payload: bytes
    v: Version
    ledger: LedgerName | None = None


class _CheckedAppendFrame(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind",
                          tag="append"):
    """AppendFrame with every pattern in the decode (encode_append's first check)."""

    msg_id: MsgId
    origin: StreamName
    key: IdemKey
    stream: StreamName
    event: EventType
    payload: bytes
    v: Version
    ledger: LedgerName | None = None


class AppendItemFrame(Struct, frozen=True, forbid_unknown_fields=True):
    """One record of an `append_many` (protocol.AppendItem's fields), its
    names decoded as plain str and checked by `decode_request`."""

    key: str
    event: str
    payload: bytes
    ledger: LedgerName | None = None


class AppendManyFrame(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind",
                      tag="append_many"):
    """An `append_many` (protocol.AppendMany's fields). As for AppendFrame,
    the names are checked against their patterns by `decode_request`: the
    keys of a group in one pattern match, the names an appender repeats once,
    then remembered (the patterned decode ran Python's `re` once a name:
    three quarters of a six-record group's decode)."""

    msg_id: str
    origin: str
    stream: str
    records: Annotated[list[AppendItemFrame],
                       Meta(min_length=1, max_length=protocol.MAX_GROUP_RECORDS)]
    v: Version


class AppendOkFrame(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind",
                    tag="append_ok"):
    msg_id: MsgId
    seq: Seq
    duplicate: bool
    v: Version


class AppendManyOkFrame(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind",
                        tag="append_many_ok"):
    msg_id: MsgId
    seq: Seq
    count: Annotated[int, Meta(ge=1, le=protocol.MAX_GROUP_RECORDS)]
    prev_seq: Annotated[int, Meta(ge=0)] | None
    duplicate: bool
    v: Version


_REQUESTS = msgspec.msgpack.Decoder(AppendFrame | AppendManyFrame)
_REPLIES = msgspec.msgpack.Decoder(AppendOkFrame | AppendManyOkFrame)
_APPEND = msgspec.msgpack.Decoder(_CheckedAppendFrame)
_encode = msgspec.msgpack.Encoder().encode


def _limits_cover(limits: protocol.Limits) -> bool:
    """Whether every valid append frame is within `limits` apart from its size
    and its payload's length (checked per frame): the nesting is 3 at most,
    names 128 characters, a group 256 records of 4 fields."""
    return (limits.max_depth >= 3 and limits.max_str_bytes >= 128
            and limits.max_array_len >= protocol.MAX_GROUP_RECORDS
            and limits.max_map_len >= 16 and limits.max_elements >= 4096)


_DEFAULT_COVERED = _limits_cover(protocol.DEFAULT_LIMITS)


_LAST_COVERED: tuple[protocol.Limits, bool] = (protocol.DEFAULT_LIMITS, _DEFAULT_COVERED)


def _covered(limits: protocol.Limits) -> bool:
    """`_limits_cover`, remembered for the last Limits asked about (the writer
    asks about its own, every frame)."""
    global _LAST_COVERED  # noqa: PLW0603
    last, covered = _LAST_COVERED
    if limits is last:
        return covered
    covered = _limits_cover(limits)
    _LAST_COVERED = (limits, covered)
    return covered


def _kind_first(frame: bytes) -> bool:
    """Whether `frame` is a map of at most 15 entries whose first key is `kind`."""
    return frame[:1] >= b"\x80" and frame[:1] <= b"\x8f" and frame[1:6] == b"\xa4kind"


def decode_request(frame: bytes,
                   limits: protocol.Limits = protocol.DEFAULT_LIMITS,
                   ) -> AppendFrame | AppendManyFrame | None:
    """The append or append_many in `frame`, or None: decode it with
    `protocol.decode` (anything else, or anything this cannot vouch for)."""
    if len(frame) > limits.max_frame_bytes or not _kind_first(frame) or not _covered(limits):
        return None
    try:
        msg = _REQUESTS.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if isinstance(msg, AppendFrame):
        if len(msg.payload) > limits.max_bin_bytes or not _valid_names(msg):
            return None
    elif (any(len(item.payload) > limits.max_bin_bytes for item in msg.records)
          or not _valid_group_names(msg)):
        return None
    return msg


_STREAM = re.compile(STREAM_PATTERN)
_EVENT = re.compile(EVENT_PATTERN)
# (origin, stream, event) found valid: an appender sends the same few again and
# again. Bounded: a sender making up new names only makes its own checks run.
_REQUEST_NAMES: set[tuple[str, str, str]] = set()
_REQUEST_NAMES_MAX = 4096


def _valid_names(msg: AppendFrame) -> bool:
    """Whether an append's names match their patterns (what the patterned
    decode checked): msg_id and key each time, the others once."""
    if _MSG_ID.search(msg.msg_id) is None or _KEY.search(msg.key) is None:
        return False
    names = (msg.origin, msg.stream, msg.event)
    if names in _REQUEST_NAMES:
        return True
    if (_STREAM.search(msg.origin) is None or _STREAM.search(msg.stream) is None
            or _EVENT.search(msg.event) is None):
        return False
    if len(_REQUEST_NAMES) >= _REQUEST_NAMES_MAX:
        _REQUEST_NAMES.clear()
    _REQUEST_NAMES.add(names)
    return True


_KEY_CHARS = KEY_PATTERN[1:KEY_PATTERN.index("]") + 1]  # the class a key is made of
# the keys of a group joined by newlines (a character no key may hold): one match
_KEYS = re.compile(rf"{_KEY_CHARS}{{1,128}}(?:\n{_KEY_CHARS}{{1,128}})*")
_GROUP_NAMES: set[tuple[str, str]] = set()  # (origin, stream) found valid
_EVENT_NAMES: set[str] = set()  # event names found valid


def _valid_group_names(msg: AppendManyFrame) -> bool:
    """Whether an append_many's names match their patterns (what the
    patterned decode checked): msg_id and the keys each time (the keys in one
    match over them joined by newlines, as many lines as keys), origin,
    stream and events once."""
    if _MSG_ID.search(msg.msg_id) is None:
        return False
    records = msg.records
    keys = "\n".join([item.key for item in records])
    if _KEYS.fullmatch(keys) is None or keys.count("\n") != len(records) - 1:
        return False
    names = (msg.origin, msg.stream)
    if names not in _GROUP_NAMES:
        if _STREAM.search(msg.origin) is None or _STREAM.search(msg.stream) is None:
            return False
        if len(_GROUP_NAMES) >= _REQUEST_NAMES_MAX:
            _GROUP_NAMES.clear()
        _GROUP_NAMES.add(names)
    for item in records:
        event = item.event
        if event not in _EVENT_NAMES:
            if _EVENT.search(event) is None:
                return False
            if len(_EVENT_NAMES) >= _REQUEST_NAMES_MAX:
                _EVENT_NAMES.clear()
            _EVENT_NAMES.add(event)
    return True


def decode_reply(frame: bytes, limits: protocol.Limits = protocol.DEFAULT_LIMITS,
                 ) -> AppendOkFrame | AppendManyOkFrame | None:
    """The append_ok or append_many_ok in `frame`, or None (use protocol.decode)."""
    if len(frame) > limits.max_frame_bytes or not _kind_first(frame) or not _covered(limits):
        return None
    try:
        return _REPLIES.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# what varies per append is checked per append (msg_id, key: one C regex call
# each); the names an appender uses again and again (origin, stream, event,
# ledger) are checked once, by decoding the first frame back, then remembered
_MSG_ID = re.compile(MSG_ID_PATTERN)
_KEY = re.compile(KEY_PATTERN)
_NAMES_CHECKED: set[tuple[str, str, str, str | None]] = set()
_NAMES_CHECKED_MAX = 4096


def encode_append(*, msg_id: str, origin: str, key: str, stream: str, event: str,
                  payload: bytes, ledger: str | None) -> bytes | None:
    """An `append` frame, or None when a field is not valid (the caller builds
    protocol.Append, which says what is wrong)."""
    names = (origin, stream, event, ledger)
    try:
        known = (names in _NAMES_CHECKED and type(payload) is bytes
                 and _KEY.search(key) is not None and _MSG_ID.search(msg_id) is not None)
    except TypeError:  # not a str (or not hashable): the model says what is wrong
        return None
    frame = _encode(AppendFrame(msg_id=msg_id, origin=origin, key=key, stream=stream,
                                event=event, payload=payload, v=1,
                                ledger=ledger))  # type: ignore[arg-type]
    if known:
        return frame
    try:
        _APPEND.decode(frame)  # every field checked, in C
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if len(_NAMES_CHECKED) >= _NAMES_CHECKED_MAX:
        _NAMES_CHECKED.clear()
    _NAMES_CHECKED.add(names)
    return frame


def encode_append_ok(msg_id: str, seq: int, duplicate: bool) -> bytes:
    """The writer's ack of one append (its values are the writer's own)."""
    return _encode(AppendOkFrame(msg_id=msg_id, seq=seq, duplicate=duplicate, v=1))


def encode_append_many_ok(msg_id: str, seq: int, count: int, prev_seq: int | None,
                          duplicate: bool) -> bytes:
    """The writer's ack of one append_many."""
    return _encode(AppendManyOkFrame(msg_id=msg_id, seq=seq, count=count, prev_seq=prev_seq,
                                     duplicate=duplicate, v=1))


_APPEND_MANY = msgspec.msgpack.Decoder(AppendManyFrame)


def encode_append_many(*, msg_id: str, origin: str, stream: str,
                       records: Sequence[tuple[str, bytes, str, str | None]]) -> bytes | None:
    """An `append_many` frame of (event, payload, key, ledger) records, or None
    when a field is not valid (the caller builds protocol.AppendMany)."""
    items = [AppendItemFrame(key=key, event=event, payload=payload,
                             ledger=ledger)  # type: ignore[arg-type]
             for event, payload, key, ledger in records]
    frame = _encode(AppendManyFrame(msg_id=msg_id, origin=origin, stream=stream,
                                    records=items, v=1))
    try:  # every type and bound checked in C, then the names as the writer checks them
        decoded = _APPEND_MANY.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return frame if _valid_group_names(decoded) else None
