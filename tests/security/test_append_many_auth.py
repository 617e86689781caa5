"""append_many on the authenticated stack (tests/security/stack.py): the writer
checks `auth.append_refusal` for every record of a group and refuses the whole
group when one record is refused, so a group is no way around the per-record
check; a group beyond the protocol's bounds gets a typed refusal, not a crash."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from actors.writer.client import WriterClient
from broker import auth, protocol
from broker.errors import RemoteError
from tests.security.stack import Runtime

pytestmark = pytest.mark.process

TURN = b'{"n":1}'


def _records(*events: str) -> list[tuple[str, bytes, str, protocol.LedgerName | None]]:
    ledgers: dict[str, protocol.LedgerName] = {"approval_answer": "approvals",
                                               "budget_resumed": "budget"}
    return [(event, TURN, f"g-{i}-{event}", ledgers.get(event)) for i, event in enumerate(events)]


def _raw_ask(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, frame: bytes,
             credential: auth.Credential) -> protocol.Message:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.apply_client(sock, credential)
    sock.connect(endpoint)
    try:
        sock.send(frame)
        assert sock.poll(10_000), "the writer did not answer"
        return protocol.decode(sock.recv())
    finally:
        sock.close(linger=0)


def _group_frame(msg_id: str, stream: str, origin: str, count: int) -> bytes:
    """An append_many frame built by hand (the client's model refuses to build
    one beyond the bounds)."""
    return msgpack.packb({
        "v": protocol.PROTOCOL_VERSION, "kind": "append_many", "msg_id": msg_id,
        "origin": origin, "stream": stream,
        "records": [{"key": f"k{i}", "event": "turn", "payload": TURN} for i in range(count)],
    })


def test_a_group_with_one_refused_record_is_refused_whole(runtime: Runtime) -> None:
    keyring = auth.ensure_keys(runtime.state)
    agent = WriterClient(runtime.ctx, runtime.state, "agent-1",
                         credential=keyring.credential("agent-1"), timeout_s=5, retries=0)
    try:
        refused = [
            ("agent/agent-2", "agent-2", ("turn", "tool_call")),  # another session's stream
            ("agent/agent-2", "agent-1", ("turn",)),  # ... under its own origin
            ("agent/agent-1", "agent-1", ("turn", "approval_answer")),  # an operator fact
            ("agent/agent-1", "agent-1", ("turn", "tool_call", "budget_resumed")),
            ("agent/agent-1", "supervisor", ("turn",)),  # a role's origin
            ("procs/agent-1", "procs/agent-1", ("proc_start",)),  # procs' stream
        ]
        for stream, origin, events in refused:
            with pytest.raises(RemoteError) as caught:
                agent.append_many(stream, _records(*events), origin=origin)
            assert caught.value.code == "forbidden", (stream, origin, events)
        # nothing of any refused group was written, not even its allowed records
        assert list(runtime.writer.read_stream("agent/agent-1")) == []
        assert list(runtime.writer.read_stream("agent/agent-2")) == []
        # the agent's own group still goes through, whole
        ok = agent.append_many("agent/agent-1", _records("turn", "tool_call", "permission"))
        assert (ok.count, ok.duplicate) == (3, False)
        assert [r.event for r in runtime.writer.read_stream("agent/agent-1")] == \
            ["turn", "tool_call", "permission"]
    finally:
        agent.close()


def test_a_group_beyond_the_bounds_gets_a_typed_refusal(runtime: Runtime) -> None:
    credential = auth.ensure_keys(runtime.state).credential("agent-1")
    endpoint = runtime.state.endpoint("writer")
    stream = "agent/agent-1"
    # one record more than a group may hold: invalid_message, with the request's msg_id
    over = _raw_ask(runtime.ctx, endpoint,
                    _group_frame("over-1", stream, "agent-1", protocol.MAX_GROUP_RECORDS + 1),
                    credential)
    assert isinstance(over, protocol.Error)
    assert (over.code, over.msg_id) == ("invalid_message", "over-1")
    # more msgpack objects than a frame may hold: refused while unpacking
    per_record = 1 + 2 * 3  # a map of three entries
    count = protocol.DEFAULT_LIMITS.max_elements // per_record + 10
    assert count <= protocol.DEFAULT_LIMITS.max_array_len
    frame = _group_frame("elements-1", stream, "agent-1", count)
    assert len(frame) <= protocol.DEFAULT_LIMITS.max_frame_bytes
    many = _raw_ask(runtime.ctx, endpoint, frame, credential)
    assert isinstance(many, protocol.Error)
    assert many.code == "malformed_frame" and "elements" in many.detail
    # an empty group is no group
    empty = _raw_ask(runtime.ctx, endpoint, _group_frame("empty-1", stream, "agent-1", 0),
                     credential)
    assert isinstance(empty, protocol.Error)
    assert (empty.code, empty.msg_id) == ("invalid_message", "empty-1")
    # nothing was written, and the writer still serves a group within the bounds
    assert list(runtime.writer.read_stream(stream)) == []
    fits = _raw_ask(runtime.ctx, endpoint,
                    _group_frame("fits-1", stream, "agent-1", protocol.MAX_GROUP_RECORDS),
                    credential)
    assert isinstance(fits, protocol.AppendManyOk)
    assert (fits.seq, fits.count) == (1, protocol.MAX_GROUP_RECORDS)
