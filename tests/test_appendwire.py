"""The append path's C codec (broker/appendwire.py) against protocol.decode,
the definition: over generated frames, valid and damaged, the fast decoder
either declines (None) or returns exactly what protocol.decode returns; it
never accepts a frame protocol.decode refuses. The acks it builds decode to
the same models."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import appendwire as w
from broker import protocol as p
from broker.errors import ProtocolError
from tests.test_protocol import BUILDERS, keys, msg_ids, seqs, streams

FIELDS_OF = {"append": ("msg_id", "origin", "key", "stream", "event", "payload", "ledger"),
             "append_many": ("msg_id", "origin", "stream", "records"),
             "append_ok": ("msg_id", "seq", "duplicate"),
             "append_many_ok": ("msg_id", "seq", "count", "prev_seq", "duplicate")}

# values a damaged frame's field may get instead: wrong types, edge values,
# names one character past their pattern (a trailing newline above all)
odd_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=10), st.binary(max_size=10), st.just([]), st.just({}),
    msg_ids.map(lambda s: s + "\n"), streams.map(lambda s: s + "\n"),
    keys.map(lambda s: "\n" + s), st.just("x" * 129), st.just("budget\n"),
    st.just(1.0), st.just(True), st.just(0), st.just(2**63),
)


def _slow(frame: bytes) -> p.Message | None:
    try:
        return p.decode(frame)
    except ProtocolError:
        return None


def _same(fast: Any, slow: Any) -> None:
    assert slow is not None, "the fast decoder accepted a frame protocol.decode refuses"
    assert fast.__struct_config__.tag == slow.kind
    for name in FIELDS_OF[slow.kind]:
        if name == "records":
            assert [(r.key, r.event, r.payload, r.ledger) for r in fast.records] == [
                (r.key, r.event, r.payload, r.ledger) for r in slow.records]
        else:
            assert getattr(fast, name) == getattr(slow, name), name
            assert type(getattr(fast, name)) is type(getattr(slow, name)), name


def _check(frame: bytes) -> None:
    kind_is_request = True
    fast = w.decode_request(frame)
    if fast is None:
        fast = w.decode_reply(frame)
        kind_is_request = False
    if fast is not None:
        slow = _slow(frame)
        _same(fast, slow)
        assert p.is_reply(slow) is not kind_is_request  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(FIELDS_OF)).flatmap(lambda kind: BUILDERS[kind]))
def test_every_valid_append_frame_decodes_in_c_to_the_same_values(message: p._Message) -> None:
    frame = p.encode(message)
    fast = w.decode_request(frame) or w.decode_reply(frame)
    assert fast is not None
    _same(fast, p.decode(frame))


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(sorted(FIELDS_OF)).flatmap(lambda kind: BUILDERS[kind]),
       st.data())
def test_a_damaged_frame_is_declined_or_decoded_as_protocol_decode_does(
        message: p._Message, data: st.DataObject) -> None:
    body: dict[str, Any] = message.model_dump(mode="python")
    body["v"] = 1
    action = data.draw(st.sampled_from(["replace", "drop", "add", "version", "item"]))
    if action == "replace":
        body[data.draw(st.sampled_from(sorted(body)))] = data.draw(odd_values)
    elif action == "drop":
        del body[data.draw(st.sampled_from(sorted(body)))]
    elif action == "add":
        body[data.draw(st.text(max_size=8))] = data.draw(odd_values)
    elif action == "version":
        body["v"] = data.draw(odd_values)
    elif body.get("records"):
        item = body["records"][0]
        item[data.draw(st.sampled_from([*sorted(item), "extra"]))] = data.draw(odd_values)
    _check(msgpack.packb(body, use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_declined_or_decoded_as_protocol_decode_does(frame: bytes) -> None:
    _check(frame)


def test_a_name_with_a_trailing_newline_is_declined() -> None:
    # Python's `$` matches before a final newline; pydantic's does not: the
    # fast patterns end in \\Z, so such a frame goes to protocol.decode, which refuses it
    body = {"kind": "append", "msg_id": "m1", "origin": "a", "key": "k", "stream": "agent/a\n",
            "event": "turn", "payload": b"{}", "v": 1}
    frame = msgpack.packb(body, use_bin_type=True)
    assert w.decode_request(frame) is None
    with pytest.raises(ProtocolError):
        p.decode(frame)


def test_a_repeated_key_keeps_its_last_value_in_both_decoders() -> None:
    pairs = [("kind", "append"), ("msg_id", "m1"), ("origin", "a"), ("key", "k"),
             ("stream", "agent/x"), ("stream", "agent/a"), ("event", "turn"),
             ("payload", b"{}"), ("v", 1)]
    frame = bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in pairs)
    fast = w.decode_request(frame)
    assert fast is not None
    _same(fast, p.decode(frame))
    assert fast.stream == "agent/a"


def test_tighter_limits_and_oversized_frames_are_left_to_protocol_decode() -> None:
    frame = p.encode(p.Append(msg_id="m1", origin="a", key="k", stream="agent/a",
                              event="turn", payload=b"[" + b"1," * 100 + b"1]"))
    assert w.decode_request(frame) is not None
    assert w.decode_request(frame, p.Limits(max_frame_bytes=len(frame) - 1)) is None
    assert w.decode_request(frame, p.Limits(max_bin_bytes=100)) is None
    assert w.decode_request(frame, p.Limits(max_depth=2)) is None


@given(msg_ids, seqs, st.booleans())
def test_the_writer_s_acks_decode_to_the_same_models(msg_id: str, seq: int,
                                                     duplicate: bool) -> None:
    ok = p.decode(w.encode_append_ok(msg_id, seq, duplicate))
    assert ok == p.AppendOk(msg_id=msg_id, seq=seq, duplicate=duplicate)
    many = p.decode(w.encode_append_many_ok(msg_id, seq, 3, None, duplicate))
    assert many == p.AppendManyOk(msg_id=msg_id, seq=seq, count=3, prev_seq=None,
                                  duplicate=duplicate)


def test_the_client_s_frames_decode_to_the_models_and_invalid_fields_are_not_encoded() -> None:
    frame = w.encode_append(msg_id="m1", origin="a", key="k", stream="agent/a", event="turn",
                            payload=b"{}", ledger="budget")
    assert frame is not None
    assert p.decode(frame) == p.Append(msg_id="m1", origin="a", key="k", stream="agent/a",
                                       event="turn", payload=b"{}", ledger="budget")
    assert w.encode_append(msg_id="m1", origin="a", key="k", stream="agent/a", event="Turn",
                           payload=b"{}", ledger=None) is None
    assert w.encode_append(msg_id="m1", origin="a", key="k", stream="agent/a", event="turn",
                           payload=b"{}", ledger="other") is None
    many = w.encode_append_many(msg_id="m2", origin="a", stream="agent/a",
                                records=[("turn", b"{}", "k1", None), ("tool_call", b"1", "k2",
                                                                        "budget")])
    assert many is not None
    decoded = p.decode(many)
    assert isinstance(decoded, p.AppendMany)
    assert [(r.event, r.key, r.ledger) for r in decoded.records] == [
        ("turn", "k1", None), ("tool_call", "k2", "budget")]
    assert w.encode_append_many(msg_id="m2", origin="a", stream="agent/a", records=[]) is None


def test_the_fast_patterns_are_the_protocol_s() -> None:
    schema = p.Append.model_json_schema()["properties"]
    for field, annotated in (("msg_id", w.MsgId), ("origin", w.StreamName), ("key", w.IdemKey),
                             ("event", w.EventType)):
        fast = annotated.__metadata__[0].pattern
        assert fast == schema[field]["pattern"].removesuffix("$") + "\\Z", field


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_an_append_encoded_with_its_names_remembered_is_checked_as_the_first(
        data: st.DataObject) -> None:
    w.encode_append(msg_id="m1", origin="a", key="k", stream="agent/a", event="turn",
                    payload=b"{}", ledger=None)  # these names are checked and remembered
    msg_id = data.draw(msg_ids | odd_values)
    key = data.draw(keys | odd_values)
    payload = data.draw(st.binary(max_size=8) | odd_values)
    frame = w.encode_append(msg_id=msg_id, origin="a", key=key, stream="agent/a",
                            event="turn", payload=payload, ledger=None)
    try:
        model: p.Append | None = p.Append(msg_id=msg_id, origin="a", key=key, stream="agent/a",
                                          event="turn", payload=payload)
    except ValueError:
        model = None
    if model is None:
        assert frame is None
    else:
        assert frame is not None and p.decode(frame) == model


@pytest.mark.parametrize(("first", "last"), [("append", "ping"), ("ping", "append"),
                                             ("append", "append"), ("append_ok", "append")])
def test_a_repeated_kind_is_declined_or_decoded_as_protocol_decode_does(first: str,
                                                                        last: str) -> None:
    pairs = [("kind", first), ("msg_id", "m1"), ("origin", "a"), ("key", "k"),
             ("stream", "agent/a"), ("event", "turn"), ("payload", b"{}"), ("v", 1),
             ("kind", last)]
    frame = bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in pairs)
    _check(frame)


def _append_frame(**fields: Any) -> bytes:
    body = {"kind": "append", "msg_id": "m1", "origin": "a", "key": "k", "stream": "agent/a",
            "event": "turn", "payload": b"{}", "v": 1, **fields}
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["msg_id", "origin", "key", "stream", "event"]),
       msg_ids | keys | streams | odd_values)
def test_an_append_with_names_already_seen_valid_is_still_checked_field_by_field(
        name: str, value: Any) -> None:
    # the writer remembers (origin, stream, event) once found valid and checks
    # only msg_id and key each time: a frame that changes any of them, after
    # the valid ones were remembered, is declined or decoded as protocol.decode
    assert w.decode_request(_append_frame()) is not None  # remembered now
    frame = _append_frame(**{name: value})
    fast = w.decode_request(frame)
    if fast is not None:
        _same(fast, _slow(frame))
    assert (_slow(frame) is None) <= (fast is None)  # refused there: declined here


def test_the_remembered_names_are_bounded_and_checked_again_after_a_clear() -> None:
    for i in range(w._REQUEST_NAMES_MAX + 10):
        assert w.decode_request(_append_frame(origin=f"o{i}", stream=f"agent/o{i}")) is not None
    assert len(w._REQUEST_NAMES) <= w._REQUEST_NAMES_MAX
    assert w.decode_request(_append_frame(origin="o1\n")) is None
    assert w.decode_request(_append_frame(event="Turn")) is None
    assert w.decode_request(_append_frame(stream="agent/" + "x" * 123)) is None


def _group_frame(records: list[dict[str, Any]] | None = None, **fields: Any) -> bytes:
    items = records if records is not None else [
        {"key": f"k{i}", "event": event, "payload": b"{}"}
        for i, event in enumerate(["turn", "tool_call", "tool_start"])]
    body = {"kind": "append_many", "msg_id": "m1", "origin": "a", "stream": "agent/a",
            "records": items, "v": 1, **fields}
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["msg_id", "origin", "stream", "key", "event"]),
       st.integers(min_value=0, max_value=2), msg_ids | keys | streams | odd_values)
def test_a_group_with_names_already_seen_valid_is_still_checked_name_by_name(
        name: str, index: int, value: Any) -> None:
    # a group's keys are checked in one match over them joined by newlines,
    # its origin, stream and events once found valid: a group that changes
    # any of them (a key holding the newline above all) is declined or
    # decoded as protocol.decode
    assert w.decode_request(_group_frame()) is not None  # remembered now
    if name in ("key", "event"):
        items = [{"key": f"k{i}", "event": "turn", "payload": b"{}"} for i in range(3)]
        items[index][name] = value
        frame = _group_frame(items)
    else:
        frame = _group_frame(**{name: value})
    fast = w.decode_request(frame)
    if fast is not None:
        _same(fast, _slow(frame))
    assert (_slow(frame) is None) <= (fast is None)  # refused there: declined here


@pytest.mark.parametrize("bad", ["a\nb", "", "a\n", "\na", "x" * 129, "a b", "a\n" * 3])
def test_a_group_key_the_joined_match_could_mistake_is_declined(bad: str) -> None:
    items = [{"key": "k0", "event": "turn", "payload": b"{}"},
             {"key": bad, "event": "turn", "payload": b"{}"}]
    assert w.decode_request(_group_frame(items)) is None
    assert _slow(_group_frame(items)) is None
