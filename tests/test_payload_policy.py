"""The payload JSON policy (docs/wal.md, "The payload"): the writer refuses,
with a typed `invalid_payload` error and before anything is framed, every
payload that is not compact, finite, surrogate-free UTF-8 JSON nested at most
MAX_DEPTH deep; it never dies of one; and the WAL stays readable with jq line
by line whatever a client sends. An accepted payload is stored byte for byte."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.writer.client import WriterClient, decode_payload, encode_payload
from actors.writer.payload import MAX_DEPTH, check_payload
from actors.writer.wal import list_segments, parse_record
from broker import auth, protocol
from broker.errors import ProtocolError
from broker.statedir import StateDir
from tests.processes import ProcessTracker
from tests.test_writer import start_writer

REFUSED = {
    "lone high surrogate": b'{"a":"\\ud800"}',
    "lone low surrogate": b'["\\udc00"]',
    "raw surrogate bytes": b'"\xed\xa0\x80"',
    "invalid utf-8": b'"\xff"',
    "overflowing number": b"1e999",
    "negative overflow": b'{"x":-1E400}',
    "NaN": b"NaN",
    "Infinity": b'{"a":Infinity}',
    "raw CR between tokens": b'{"a":1,\r"b":2}',
    "tab between tokens": b'[1,\t2]',
    "newline between tokens": b'{"a":1}\n',
    "space between tokens": b'{"a": 1}',
    "leading space": b" 1",
    "too deep": b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    "a thousand levels": b"[" * 1000 + b"]" * 1000,
    "ten thousand levels": b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    "two values": b'{"a":1}{"b":2}',
    "empty": b"",
    "raw control char in a string": b'"a\x01b"',
}

ACCEPTED = [
    b'{"a":"x y [ { \\" ]"}',  # spaces and brackets inside strings are data
    b'"\\ud83d\\ude00"',  # a surrogate pair is a character
    "\"é 😀\"".encode(),
    b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
    b'{"n":18446744073709551616,"f":1.5e300,"z":-0.0}',
    b"null",
]


def _verdict(payload: bytes) -> str | None:
    try:
        check_payload(payload)
    except ProtocolError as exc:
        return exc.detail.split(":")[0]
    return None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from([{}, {"separators": (",", ":")},
                                     {"separators": (",", ":"), "ensure_ascii": False},
                                     {"indent": 1}]),
       st.integers(min_value=0, max_value=MAX_DEPTH + 2))
def test_the_write_back_shortcut_gives_the_scans_verdict(value: object, how: dict[str, object],
                                                        wrap: int) -> None:
    """A payload orjson writes back byte for byte skips the whitespace scans
    (compact by construction): its verdict is the one the scans give, for
    payloads written compact or not, nested up to past MAX_DEPTH."""
    payload = ("[" * wrap + json.dumps(value, **how) + "]" * wrap).encode()  # type: ignore[arg-type]
    fast = _verdict(payload)
    import orjson

    from actors.writer import payload as policy

    def declined(_: object) -> bytes:
        raise orjson.JSONEncodeError("forced: the scans' path")

    real, policy.orjson.dumps = policy.orjson.dumps, declined  # type: ignore[assignment]
    try:
        slow = _verdict(payload)
    finally:
        policy.orjson.dumps = real  # type: ignore[assignment]
    assert fast == slow


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_policy_breach_is_refused_with_a_typed_error(name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        check_payload(REFUSED[name])
    assert info.value.code == protocol.ErrorCode.INVALID_PAYLOAD


@pytest.mark.parametrize("payload", ACCEPTED)
def test_compact_valid_json_is_accepted(payload: bytes) -> None:
    check_payload(payload)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20)


@given(_VALUES)
@settings(max_examples=300, deadline=None)
def test_the_agents_fold_reads_back_what_json_reads(value: object) -> None:
    """The loop folds a fact from its own encoded bytes (decode_payload,
    orjson) as json did before: the same values and types, integers past 64
    bits included (orjson reads them as floats; a body with 19 digits in a
    row goes to json)."""
    body = encode_payload(value)
    got, want = decode_payload(body), json.loads(body)
    assert got == want and repr(got) == repr(want)


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_any_bytes_are_accepted_only_as_a_line_jq_reads(payload: bytes) -> None:
    """Whatever the bytes, the check returns or raises the typed error; what
    it accepts is strict JSON on one line."""
    try:
        check_payload(payload)
    except ProtocolError as exc:
        code = exc.code
    else:
        assert b"\n" not in payload and b"\r" not in payload
        json.loads(payload.decode("utf-8"), parse_constant=pytest.fail)
        return
    assert code == protocol.ErrorCode.INVALID_PAYLOAD


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.process
def test_the_writer_refuses_every_breach_lives_on_and_its_wal_reads_with_jq(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    auth.authenticate(raw, state_dir)
    raw.connect(state_dir.endpoint("writer"))

    def send(key: str, payload: bytes) -> protocol.Message:
        msg = protocol.Append(msg_id=f"m-{key}", origin="fuzz", key=key, stream="agent/x",
                              event="turn", payload=payload)
        raw.send(protocol.encode(msg))
        assert raw.poll(5000), f"no answer to {key}"
        return protocol.decode(raw.recv())

    for i, name in enumerate(sorted(REFUSED)):
        reply = send(f"bad{i}", REFUSED[name])
        assert isinstance(reply, protocol.Error), name
        assert (reply.code, reply.msg_id) == (protocol.ErrorCode.INVALID_PAYLOAD, f"m-bad{i}")
        assert writer.poll() is None, f"the writer died of {name}"
    seqs = []
    for i, payload in enumerate(ACCEPTED):
        reply = send(f"ok{i}", payload)
        assert isinstance(reply, protocol.AppendOk), payload
        seqs.append(reply.seq)
    assert seqs == list(range(1, len(ACCEPTED) + 1))  # nothing refused took a seq
    raw.close(linger=0)

    (segment,) = (p for _, p in list_segments(state_dir.wal_dir))
    stored = [parse_record(line) for line in segment.read_bytes().splitlines(keepends=True)]
    assert [r.payload_bytes() for r in stored if r is not None] == ACCEPTED  # byte for byte
    jq = subprocess.run(["jq", "-c", ".payload", str(segment)], capture_output=True,
                        check=False, timeout=30)
    assert jq.returncode == 0, jq.stderr
    assert len(jq.stdout.splitlines()) == len(ACCEPTED)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        assert client.append("agent/a", "turn", {"still": "alive"}, key="last").seq == 7
