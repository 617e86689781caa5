"""The wire protocol: every message round-trips; every malformed, oversized,
deeply nested, wrongly versioned or wrongly typed frame is refused with a
typed ProtocolError, never a crash and never a dict."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol as p
from broker.errors import ProtocolError

msg_ids = st.from_regex(r"\A[A-Za-z0-9_.:\-]{1,64}\Z")
actors = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}\Z")
streams = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,127}\Z")
events = st.from_regex(r"\A[a-z][a-z0-9_]{0,63}\Z")
keys = st.from_regex(r"\A[A-Za-z0-9_.:/\-]{1,128}\Z")
seqs = st.integers(min_value=1, max_value=2**63 - 1)
values = st.dictionaries(
    st.text(max_size=20),
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False, allow_infinity=False)),
    max_size=5,
)
proc_ids = st.from_regex(r"\A[pt]-[0-9a-f]{16}\Z")
subagent_ids = st.from_regex(r"\As-[0-9a-f]{12}\Z")
subagent_refs = subagent_ids | st.just("latest")
proc_states = st.sampled_from(["running", "exited", "killed", "capped", "expired", "lost",
                               "quota_exceeded"])
child = st.builds(
    p.ChildStatus,
    name=actors,
    kind=st.sampled_from(["writer", "broker", "procs", "subagents", "agent"]),
    pid=st.none() | st.integers(1, 2**22),
    state=st.sampled_from(["starting", "running", "backoff", "exited", "fatal", "stopping"]),
    uptime_s=st.none() | st.floats(0, 1e9),
    restarts=st.integers(0, 10**6),
    last_exit=st.none() | st.text(max_size=30),
    cpu_percent=st.none() | st.floats(0, 800),
    rss_bytes=st.none() | st.integers(0, 2**40),
    uss_bytes=st.none() | st.integers(0, 2**40),
    heartbeat_age_s=st.none() | st.floats(0, 1e6),
    values=values,
)

BUILDERS: dict[str, st.SearchStrategy[p._Message]] = {
    "ping": st.builds(p.Ping, msg_id=msg_ids),
    "pong": st.builds(p.Pong, msg_id=msg_ids, actor=actors, pid=st.integers(1, 2**22)),
    "error": st.builds(
        p.Error,
        msg_id=st.none() | msg_ids,
        code=st.sampled_from(list(p.ErrorCode)),
        detail=st.text(max_size=200),
    ),
    "append": st.builds(
        p.Append,
        msg_id=msg_ids,
        origin=streams,
        key=keys,
        stream=streams,
        event=events,
        payload=st.binary(max_size=512),
        ledger=st.sampled_from([None, "budget", "approvals"]),
    ),
    "append_ok": st.builds(p.AppendOk, msg_id=msg_ids, seq=seqs, duplicate=st.booleans()),
    "append_many": st.builds(
        p.AppendMany,
        msg_id=msg_ids,
        origin=streams,
        stream=streams,
        records=st.lists(st.builds(
            p.AppendItem, key=keys, event=events, payload=st.binary(max_size=128),
            ledger=st.sampled_from([None, "budget", "approvals"])), min_size=1, max_size=5),
    ),
    "append_many_ok": st.builds(
        p.AppendManyOk, msg_id=msg_ids, seq=seqs, count=st.integers(1, p.MAX_GROUP_RECORDS),
        prev_seq=st.none() | st.integers(0, 2**40), duplicate=st.booleans()),
    "read_stream": st.builds(
        p.ReadStream,
        msg_id=msg_ids,
        stream=streams,
        from_seq=seqs,
        max_records=st.integers(1, 4096),
        max_bytes=st.integers(1, 768 * 1024),
    ),
    "records": st.builds(
        p.Records,
        msg_id=msg_ids,
        stream=streams,
        records=st.lists(st.binary(max_size=64), max_size=5),
        next_seq=seqs,
        more=st.booleans(),
        head_seq=st.integers(0, 2**40),
    ),
    "stats_request": st.builds(p.StatsRequest, msg_id=msg_ids),
    "stats": st.builds(p.Stats, msg_id=msg_ids, actor=actors, values=values),
    "ready": st.builds(p.Ready, actor=actors, pid=st.integers(1, 2**22)),
    "heartbeat": st.builds(p.Heartbeat, actor=actors, pid=st.integers(1, 2**22), values=values),
    "status_request": st.builds(p.StatusRequest, msg_id=msg_ids),
    "status_reply": st.builds(
        p.StatusReply,
        msg_id=msg_ids,
        supervisor_pid=st.integers(1, 2**22),
        state_dir=st.text(max_size=50),
        started_at=st.floats(0, 2e9),
        children=st.lists(child, max_size=4),
    ),
    "signal_request": st.builds(
        p.SignalRequest, msg_id=msg_ids, target=actors, signal=st.integers(1, 64)
    ),
    "restart_request": st.builds(p.RestartRequest, msg_id=msg_ids, target=actors),
    "stop_request": st.builds(p.StopRequest, msg_id=msg_ids, target=st.none() | actors),
    "spawn_request": st.builds(
        p.SpawnRequest, msg_id=msg_ids, name=actors, task=st.none() | st.text(min_size=1),
        backend=st.sampled_from(["scripted", "replay", "openai"]),
        model=st.none() | st.text(max_size=20), replay_stream=st.none() | actors,
    ),
    "start_request": st.builds(p.StartRequest, msg_id=msg_ids, target=actors),
    "remove_request": st.builds(p.RemoveRequest, msg_id=msg_ids, target=actors),
    "reload_request": st.builds(p.ReloadRequest, msg_id=msg_ids),
    "reload_reply": st.builds(
        p.ReloadReply, msg_id=msg_ids, config=st.text(max_size=40),
        started=st.lists(actors, max_size=3), stopped=st.lists(actors, max_size=3),
        restarted=st.lists(actors, max_size=3), unchanged=st.integers(0, 1000),
    ),
    "ack": st.builds(p.Ack, msg_id=msg_ids, affected=st.lists(actors, max_size=5)),
    **{  # procs: background commands and terminals
        "bash": st.builds(
            p.Bash,
            msg_id=msg_ids,
            session=actors,
            command=st.text(min_size=1, max_size=50),
            cwd=st.text(min_size=1, max_size=20),
            timeout_s=st.floats(0.1, 100),
            max_bytes=st.integers(1, 512 * 1024),
            max_output_bytes=st.none() | st.integers(1, 2**30),
        ),
        "bash_start": st.builds(
            p.BashStart,
            msg_id=msg_ids,
            session=actors,
            command=st.text(min_size=1, max_size=50),
            cwd=st.text(min_size=1, max_size=20),
            max_output_bytes=st.none() | st.integers(1, 2**30),
            lifetime_s=st.none() | st.floats(1, 1000),
        ),
        "bash_poll": st.builds(
            p.BashPoll,
            msg_id=msg_ids,
            session=actors,
            proc_id=proc_ids,
            cursor=st.integers(0, 2**40),
            max_bytes=st.integers(1, 512 * 1024),
        ),
        "bash_kill": st.builds(p.BashKill, msg_id=msg_ids, session=actors, proc_id=proc_ids),
        "terminal_start": st.builds(
            p.TerminalStart,
            msg_id=msg_ids,
            session=actors,
            argv=st.lists(st.text(max_size=10), min_size=1, max_size=3),
            cwd=st.text(min_size=1, max_size=20),
            rows=st.integers(1, 1000),
            cols=st.integers(1, 1000),
            max_output_bytes=st.none() | st.integers(1, 2**30),
            lifetime_s=st.none() | st.floats(1, 1000),
        ),
        "terminal_input": st.builds(
            p.TerminalInput,
            msg_id=msg_ids,
            session=actors,
            proc_id=proc_ids,
            data=st.binary(max_size=64),
        ),
        "terminal_read": st.builds(
            p.TerminalRead,
            msg_id=msg_ids,
            session=actors,
            proc_id=proc_ids,
            cursor=st.integers(0, 2**40),
            max_bytes=st.integers(1, 512 * 1024),
        ),
        "terminal_end": st.builds(p.TerminalEnd, msg_id=msg_ids, session=actors, proc_id=proc_ids),
        "session_end": st.builds(p.SessionEnd, msg_id=msg_ids, session=actors),
        "proc_status": st.builds(
            p.ProcStatus,
            msg_id=msg_ids,
            proc_id=st.none() | proc_ids,
            state=proc_states,
            pid=st.none() | st.integers(1, 2**22),
            exit_code=st.none() | st.integers(-64, 255),
            log_bytes=st.integers(0, 2**40),
            ended=st.integers(0, 1000),
        ),
        "proc_output": st.builds(
            p.ProcOutput,
            msg_id=msg_ids,
            proc_id=proc_ids,
            cursor=st.integers(0, 2**40),
            next_cursor=st.integers(0, 2**40),
            data=st.binary(max_size=256),
            state=proc_states,
            exit_code=st.none() | st.integers(-64, 255),
            eof=st.booleans(),
        ),
    },
    **{  # subagents: isolated children and their change sets
        "spawn_subagent": st.builds(
            p.SpawnSubagent, msg_id=msg_ids, parent=actors,
            workspace=st.text(min_size=1, max_size=20), task=st.text(min_size=1, max_size=20),
            descriptor=st.from_regex(r"\A[a-z0-9][a-z0-9_\-]{0,31}\Z"),
            wait_s=st.floats(0, 1000),
        ),
        "subagent_changes": st.builds(
            p.SubagentChanges, msg_id=msg_ids, parent=actors, subagent_id=subagent_refs,
            wait_s=st.floats(0, 1000),
        ),
        "apply_subagent": st.builds(
            p.ApplySubagent, msg_id=msg_ids, parent=actors, subagent_id=subagent_refs,
        ),
        "subagent_reply": st.builds(
            p.SubagentReply, msg_id=msg_ids, subagent_id=subagent_ids,
            state=st.sampled_from(["running", "ended", "failed", "applied"]),
            exit_code=st.none() | st.integers(-64, 255),
            manifest=st.none() | st.binary(max_size=64), patch=st.none() | st.binary(max_size=64),
            receipt=st.none() | st.binary(max_size=64), refusal=st.none() | st.text(max_size=50),
            tokens_used=st.integers(0, 2**40), cost_used=st.floats(0, 1e9),
        ),
        "subagent_remote": st.builds(  # between hosts (docs/fleet.md)
            p.SubagentRemote, msg_id=msg_ids, op=st.sampled_from(["offer", "poll"]),
            subagent_id=subagent_ids, parent=actors,
            pack_sha256=st.none() | st.from_regex(r"\A[0-9a-f]{64}\Z"),
            pack_bytes=st.integers(0, 2**40), task=st.none() | st.binary(max_size=64),
            settings=st.none() | st.binary(max_size=64),
        ),
        "subagent_chunk": st.builds(
            p.SubagentChunk, pack_sha256=st.from_regex(r"\A[0-9a-f]{64}\Z"),
            pack_bytes=st.integers(0, 2**40), index=st.integers(0, 65_535),
            total=st.integers(1, 65_536), data=st.binary(max_size=64),
        ),
        "subagent_remote_reply": st.builds(
            p.SubagentRemoteReply, msg_id=msg_ids, subagent_id=subagent_ids,
            state=st.sampled_from(["running", "ended", "failed", "incomplete", "refused"]),
            exit_code=st.none() | st.integers(-64, 255), pack_bytes=st.integers(0, 2**40),
            refusal=st.none() | st.text(max_size=50),
        ),
    },
    **{  # MCP servers through procs (docs/mcp.md)
        "mcp_request": st.builds(
            p.McpRequest, msg_id=msg_ids, action=st.sampled_from(["list", "call"]),
            server=st.from_regex(r"\A[a-z0-9][a-z0-9_\-]{0,31}\Z"),
            tool=st.none() | st.text(min_size=1, max_size=20),
            arguments=st.binary(max_size=64),
        ),
        "mcp_reply": st.builds(
            p.McpReply, msg_id=msg_ids, ok=st.booleans(),
            error=st.none() | st.text(max_size=20), detail=st.text(max_size=50),
            body=st.binary(max_size=64),
        ),
    },
}
MESSAGES = st.one_of(*BUILDERS.values())


@given(MESSAGES)
@settings(max_examples=400, deadline=None)
def test_every_message_round_trips(message: p._Message) -> None:
    assert p.decode(p.encode(message)) == message


def test_every_message_kind_is_covered_by_the_round_trip_strategy() -> None:
    assert set(BUILDERS) == set(p._KINDS)


def _refused(frame: bytes, limits: p.Limits = p.DEFAULT_LIMITS) -> str:
    with pytest.raises(ProtocolError) as info:
        p.decode(frame, limits)
    return info.value.code


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"", "malformed_frame"),
        (b"\xc1", "malformed_frame"),  # never-used msgpack byte
        (b"\x93\x01\x02\x03", "malformed_frame"),  # an array, not a map
        (msgpack.packb({"v": 1, "kind": "ping"})[:-2], "malformed_frame"),  # truncated
        (msgpack.packb({"kind": "ping", "msg_id": "a"}), "unsupported_version"),
        (msgpack.packb({"v": 2, "kind": "ping", "msg_id": "a"}), "unsupported_version"),
        (msgpack.packb({"v": 1, "kind": "launch", "msg_id": "a"}), "unknown_kind"),
        (msgpack.packb({"v": 1, "kind": "ping"}), "invalid_message"),  # missing msg_id
        (msgpack.packb({"v": 1, "kind": "ping", "msg_id": "a", "x": 1}), "invalid_message"),
        (msgpack.packb({"v": 1, "kind": "ping", "msg_id": 7}), "invalid_message"),
        (msgpack.packb({"v": 1, "kind": "ping", "msg_id": "bad id!"}), "invalid_message"),
        (
            msgpack.packb(
                {"v": 1, "kind": "append_ok", "msg_id": "a", "seq": "5", "duplicate": False}
            ),
            "invalid_message",  # a number held as a string is refused (strict)
        ),
        (
            msgpack.packb(
                {"v": 1, "kind": "append_ok", "msg_id": "a", "seq": 0, "duplicate": False}
            ),
            "invalid_message",
        ),
        (msgpack.packb({1: 2}), "malformed_frame"),  # non-string map key
        (msgpack.packb(msgpack.ExtType(5, b"xx")), "malformed_frame"),
        (
            msgpack.packb({"v": 1, "kind": "ping", "msg_id": msgpack.ExtType(1, b"")}),
            "malformed_frame",
        ),
    ],
)
def test_malformed_frames_are_refused_with_a_code(frame: bytes, code: str) -> None:
    assert _refused(frame) == code


def test_oversized_frame_is_refused_before_parsing() -> None:
    limits = p.Limits(max_frame_bytes=1024)
    frame = p.encode(
        p.Append(msg_id="a", origin="o", key="k", stream="s", event="e", payload=b"1" * 2000)
    )
    assert _refused(frame, limits) == "frame_too_large"


def test_deep_nesting_is_refused() -> None:
    nested: dict[str, object] = {}
    inner = nested
    for _ in range(40):
        inner["n"] = {}
        inner = inner["n"]  # type: ignore[assignment]
    frame = msgpack.packb({"v": 1, "kind": "stats", "msg_id": "a", "actor": "w", "values": nested})
    assert _refused(frame) == "too_deep"


def test_very_deep_nesting_beyond_the_c_unpacker_stack_is_refused() -> None:
    frame = b"\x91" * 5000 + b"\x01"  # 5000 nested one-element arrays
    assert _refused(frame) in {"too_deep", "malformed_frame"}


def test_long_arrays_are_refused_by_the_unpacker_limits() -> None:
    limits = p.Limits(max_array_len=10)
    frame = msgpack.packb({"v": 1, "kind": "ack", "msg_id": "a", "affected": ["w"] * 11})
    assert _refused(frame, limits) == "malformed_frame"


@given(st.binary(max_size=256))
@settings(max_examples=500, deadline=None)
def test_random_bytes_never_escape_as_anything_but_protocol_error(frame: bytes) -> None:
    try:
        message = p.decode(frame)
    except ProtocolError:
        return
    assert isinstance(message, p._Message)


def test_error_frame_carries_the_msg_id_of_the_refused_frame() -> None:
    bad = msgpack.packb({"v": 1, "kind": "ping", "msg_id": "req-7", "extra": True})
    with pytest.raises(ProtocolError) as info:
        p.decode(bad)
    reply = p.decode(p.error_frame(info.value, p.peek_msg_id(bad)))
    assert isinstance(reply, p.Error)
    assert reply.msg_id == "req-7"
    assert reply.code is p.ErrorCode.INVALID_MESSAGE


# --- total decoding (issue 11) --------------------------------------------------------
# Any msgpack value, in any field, of any type: only ProtocolError may come out.
msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4) | st.integers(-9, 9), inner,
                      max_size=5),
    max_leaves=20,
)
ODD_FIELD_VALUES = [[], {}, [1], {"a": 1}, True, False, 1.0, 2**64 - 1, -(2**63), None, b"x",
                    "", float("nan"), float("inf"), "\ud800"[:0] + "x" * 300]


def _decodes_or_refuses(frame: bytes) -> p._Message | None:
    refused: ProtocolError | None = None
    try:
        message = p.decode(frame)
    except ProtocolError as exc:
        refused = exc
    if refused is not None:
        assert refused.code in {c.value for c in p.ErrorCode}
        msg_id = getattr(refused, "msg_id", None)
        assert msg_id is None or p._valid_msg_id(msg_id)
        return None
    assert isinstance(message, p._Message)
    return message


def test_the_22_byte_frame_with_a_list_for_kind_is_refused_not_a_crash() -> None:
    frame = msgpack.packb({"v": 1, "kind": [], "msg_id": "x"})
    with pytest.raises(ProtocolError) as info:
        p.decode(frame)
    assert info.value.code == "unknown_kind"
    assert info.value.msg_id == "x"  # the error reply can still name the request


@pytest.mark.parametrize("field", ["kind", "msg_id", "v", "actor", "pid", "values"])
@pytest.mark.parametrize("value", ODD_FIELD_VALUES, ids=repr)
def test_any_type_in_any_field_is_refused_with_a_code(field: str, value: object) -> None:
    body = {"v": 1, "kind": "heartbeat", "msg_id": "m-1", "actor": "a", "pid": 7, "values": {}}
    body[field] = value
    _decodes_or_refuses(msgpack.packb(body))


@given(msgpack_values)
@settings(max_examples=120, deadline=None)
def test_arbitrary_msgpack_values_decode_or_are_refused(value: object) -> None:
    _decodes_or_refuses(msgpack.packb(value))


@given(st.sampled_from(sorted(p._KINDS)), st.dictionaries(st.text(max_size=12), msgpack_values,
                                                          max_size=6), msgpack_values)
@settings(max_examples=80, deadline=None)
def test_arbitrary_fields_of_every_kind_decode_or_are_refused(
    kind: str, fields: dict[str, object], msg_id: object
) -> None:
    _decodes_or_refuses(msgpack.packb({"v": 1, "kind": kind, "msg_id": msg_id, **fields}))


_PID = "p-0123456789abcdef"
TEMPLATES: list[p._Message] = [
    p.Ping(msg_id="m"), p.Pong(msg_id="m", actor="a", pid=1),
    p.Error(msg_id="m", code=p.ErrorCode.NOT_FOUND, detail="d"),
    p.Append(msg_id="m", origin="o", key="k", stream="s", event="e", payload=b"1"),
    p.AppendOk(msg_id="m", seq=1, duplicate=False), p.ReadStream(msg_id="m", stream="s"),
    p.AppendMany(msg_id="m", origin="o", stream="s", records=[
        p.AppendItem(key="k", event="e", payload=b"1"),
        p.AppendItem(key="k2", event="e", payload=b"2", ledger="budget")]),
    p.AppendManyOk(msg_id="m", seq=1, count=2, prev_seq=0, duplicate=False),
    p.Records(msg_id="m", stream="s", records=[b"{}"], next_seq=2, more=False, head_seq=1),
    p.StatsRequest(msg_id="m"), p.Stats(msg_id="m", actor="a", values={"x": 1}),
    p.Ready(actor="a", pid=1), p.Heartbeat(actor="a", pid=1, values={"x": 1.5}),
    p.StatusRequest(msg_id="m"),
    p.StatusReply(msg_id="m", supervisor_pid=1, state_dir="/s", started_at=1.0, children=[
        p.ChildStatus(name="w", kind="writer", pid=2, state="running", uptime_s=1.0, restarts=0,
                      last_exit=None, cpu_percent=None, rss_bytes=1, uss_bytes=None,
                      heartbeat_age_s=0.5, values={"x": 1})]),
    p.SignalRequest(msg_id="m", target="a", signal=15), p.RestartRequest(msg_id="m", target="a"),
    p.StopRequest(msg_id="m"), p.SpawnRequest(msg_id="m", name="a"),
    p.StartRequest(msg_id="m", target="a"), p.RemoveRequest(msg_id="m", target="a"),
    p.ReloadRequest(msg_id="m"),
    p.ReloadReply(msg_id="m", config="c.yaml", started=["a"], stopped=[], restarted=[],
                  unchanged=1),
    p.Ack(msg_id="m", affected=["a"]),
    p.Bash(msg_id="m", session="s", command="true", cwd="/"),
    p.BashStart(msg_id="m", session="s", command="true", cwd="/"),
    p.BashPoll(msg_id="m", session="s", proc_id=_PID),
    p.BashKill(msg_id="m", session="s", proc_id=_PID),
    p.TerminalStart(msg_id="m", session="s", argv=["sh"], cwd="/"),
    p.TerminalInput(msg_id="m", session="s", proc_id=_PID, data=b"x"),
    p.TerminalRead(msg_id="m", session="s", proc_id=_PID),
    p.TerminalEnd(msg_id="m", session="s", proc_id=_PID), p.SessionEnd(msg_id="m", session="s"),
    p.ProcStatus(msg_id="m", proc_id=_PID, state="running"),
    p.ProcOutput(msg_id="m", proc_id=_PID, cursor=0, next_cursor=1, data=b"x", state="exited"),
    p.SpawnSubagent(msg_id="m", parent="a", workspace="/w", task="t.yaml"),
    p.SubagentChanges(msg_id="m", parent="a", subagent_id="latest"),
    p.ApplySubagent(msg_id="m", parent="a", subagent_id="latest"),
    p.SubagentReply(msg_id="m", subagent_id="s-0123456789ab", state="running"),
    p.SubagentRemote(msg_id="m", op="poll", subagent_id="s-0123456789ab", parent="a"),
    p.SubagentChunk(pack_sha256="0" * 64, pack_bytes=1, index=0, total=1, data=b"x"),
    p.SubagentRemoteReply(msg_id="m", subagent_id="s-0123456789ab", state="running"),
    p.McpRequest(msg_id="m", action="call", server="s", tool="t", arguments=b"{}"),
    p.McpReply(msg_id="m", ok=True, error=None, detail="", body=b"{}"),
]


def test_the_templates_cover_every_kind() -> None:
    assert {t.kind for t in TEMPLATES} == p._KINDS


@given(st.sampled_from(TEMPLATES), st.data())
@settings(max_examples=100, deadline=None)
def test_a_valid_message_with_one_field_replaced_decodes_or_is_refused(
    template: p._Message, data: st.DataObject
) -> None:
    body = msgpack.unpackb(p.encode(template))
    field = data.draw(st.sampled_from(sorted(body)))
    body[field] = data.draw(msgpack_values)
    _decodes_or_refuses(msgpack.packb(body))


@pytest.mark.parametrize("version", [True, 1.0, "1", [1], None])
def test_version_must_be_the_int_1_not_true_nor_1_0(version: object) -> None:
    frame = msgpack.packb({"v": version, "kind": "ping", "msg_id": "a"})
    assert _refused(frame) == "unsupported_version"


@pytest.mark.parametrize(
    "body",
    [
        {"v": 1, "kind": "heartbeat", "actor": "a", "pid": True},  # bool for int
        {"v": 1, "kind": "heartbeat", "actor": "a", "pid": 7.0},  # float for int
        {"v": 1, "kind": "heartbeat", "actor": "a", "pid": 2**64 - 1},  # huge int
        {"v": 1, "kind": "append_ok", "msg_id": "a", "seq": 5, "duplicate": 1},  # int for bool
        {"v": 1, "kind": "bash_poll", "msg_id": "a", "session": "s",
         "proc_id": "p-0123456789abcdef", "cursor": 2**64 - 1},  # a cursor no lseek takes
        {"v": 1, "kind": "stats", "msg_id": "a", "actor": "w", "values": {"x": float("inf")}},
        {"v": 1, "kind": "stats", "msg_id": "a", "actor": "w", "values": {"x": float("nan")}},
    ],
)
def test_strict_scalars_refuse_look_alikes(body: dict[str, object]) -> None:
    assert _refused(msgpack.packb(body)) == "invalid_message"


def test_map_keys_must_be_str_at_every_depth() -> None:
    for frame in (
        msgpack.packb({b"v": 1, "kind": "ping", "msg_id": "a"}),
        msgpack.packb({"v": 1, "kind": "stats", "msg_id": "a", "actor": "w",
                       "values": {b"k": 1}}),
        msgpack.packb({"v": 1, "kind": "stats", "msg_id": "a", "actor": "w", "values": {3: 1}}),
    ):
        assert _refused(frame) == "malformed_frame"


def test_nil_for_an_optional_field_means_its_default() -> None:
    frame = msgpack.packb({"v": 1, "kind": "read_stream", "msg_id": "a", "stream": "s",
                           "from_seq": None, "max_records": None, "max_bytes": None})
    message = p.decode(frame)
    assert message == p.ReadStream(msg_id="a", stream="s")
    beat = p.decode(msgpack.packb({"v": 1, "kind": "heartbeat", "actor": "a", "pid": 3,
                                   "values": None}))
    assert beat == p.Heartbeat(actor="a", pid=3)


def test_nil_for_a_required_field_is_refused() -> None:
    frame = msgpack.packb({"v": 1, "kind": "read_stream", "msg_id": "a", "stream": None})
    assert _refused(frame) == "invalid_message"


def test_one_heartbeat_schema_with_an_optional_msg_id() -> None:
    with_id = p.decode(msgpack.packb({"v": 1, "kind": "heartbeat", "actor": "a", "pid": 3,
                                      "msg_id": "hb-1"}))
    assert isinstance(with_id, p.Heartbeat) and with_id.msg_id == "hb-1"
    bare = p.decode(msgpack.packb({"v": 1, "kind": "heartbeat", "actor": "a", "pid": 3}))
    assert bare == p.Heartbeat(actor="a", pid=3, values={})
    assert p.is_reply(bare)  # a notice: never answered


def test_every_kind_is_either_a_request_or_a_reply() -> None:
    assert not p.REPLY_KINDS & p.REQUEST_KINDS
    assert p.REQUEST_KINDS | p.REPLY_KINDS == p._KINDS  # a new kind is classified on purpose
    assert "error" in p.REPLY_KINDS and "ping" in p.REQUEST_KINDS


# --- bounded work per frame -----------------------------------------------------------
def _worst_frame() -> bytes:
    """The frame of the issue: 990 keys, each holding 1,040 empty arrays (about 1 MB)."""
    body: dict[str, object] = {"v": 1, "kind": "ping", "msg_id": "w-1"}
    body.update({f"k{i}": [[] for _ in range(1040)] for i in range(990)})
    frame: bytes = msgpack.packb(body)
    return frame


def test_the_worst_frame_within_the_size_limit_is_refused_by_the_element_limit() -> None:
    frame = _worst_frame()
    assert len(frame) <= p.DEFAULT_LIMITS.max_frame_bytes
    with pytest.raises(ProtocolError) as info:
        p.decode(frame)
    assert info.value.code == "malformed_frame"
    assert "msgpack objects" in info.value.detail


def test_the_element_limit_counts_every_msgpack_object() -> None:
    # each map or array counts 1 plus its entries (a map entry: key and value, 2):
    # the top map 1 + 4 * 2 = 9, the array 1 + 3 = 4: 13 elements
    frame = msgpack.packb({"v": 1, "kind": "ack", "msg_id": "a", "affected": ["x", "y", "z"]})
    assert isinstance(p.decode(frame, p.Limits(max_elements=13)), p.Ack)
    assert _refused(frame, p.Limits(max_elements=12)) == "malformed_frame"


def test_empty_containers_count_too() -> None:
    frame = msgpack.packb({"v": 1, "kind": "stats", "msg_id": "a", "actor": "w",
                           "values": {}, "x": [[]] * 100})
    assert _refused(frame, p.Limits(max_elements=150)) == "malformed_frame"


def test_depth_counts_the_top_map_as_one() -> None:
    inner: dict[str, object] = {}
    values = inner
    for _ in range(14):  # values at depth 2, then 14 more maps: depth 16
        nested: dict[str, object] = {}
        inner["n"] = nested
        inner = nested
    ok = {"v": 1, "kind": "stats", "msg_id": "a", "actor": "w", "values": values}
    assert _refused(msgpack.packb(ok)) == "invalid_message"  # within depth: a type error
    inner["n"] = {}
    assert _refused(msgpack.packb(ok)) == "too_deep"


# --- msg_id echo ----------------------------------------------------------------------
def test_frame_too_large_echoes_the_msg_id() -> None:
    limits = p.Limits(max_frame_bytes=1024)
    frame = p.encode(
        p.Append(msg_id="big-1", origin="o", key="k", stream="s", event="e", payload=b"1" * 2000)
    )
    with pytest.raises(ProtocolError) as info:
        p.decode(frame, limits)
    assert (info.value.code, info.value.msg_id) == ("frame_too_large", "big-1")
    reply = p.decode(p.error_frame(info.value))
    assert isinstance(reply, p.Error) and reply.msg_id == "big-1"


def test_every_refusal_echoes_a_readable_msg_id() -> None:
    for body in (
        {"v": 2, "kind": "ping", "msg_id": "e-1"},
        {"v": 1, "kind": "nope", "msg_id": "e-1"},
        {"v": 1, "kind": "ping", "msg_id": "e-1", "extra": []},
        {"v": 1, "kind": [], "msg_id": "e-1"},
    ):
        with pytest.raises(ProtocolError) as info:
            p.decode(msgpack.packb(body))
        assert info.value.msg_id == "e-1", body


def test_peek_reads_kind_and_msg_id_cheaply_and_never_raises() -> None:
    assert p.peek(p.encode(p.Error(msg_id="q", code=p.ErrorCode.NOT_FOUND, detail="x"))) == (
        p.Peeked("error", "q")
    )
    assert p.peek(p.encode(p.Error(code=p.ErrorCode.NOT_FOUND, detail="x"))).is_reply
    assert p.peek(_worst_frame()) == p.Peeked("ping", "w-1")
    for junk in (b"", b"\xc1", b"\x91\x01", msgpack.packb({"kind": [], "msg_id": 5})):
        assert p.peek(junk) == p.Peeked(None, None)


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_peek_never_raises_on_random_bytes(frame: bytes) -> None:
    peeked = p.peek(frame)
    assert peeked.kind is None or peeked.kind in p._KINDS


def test_protocol_md_lists_every_optional_field_with_its_default() -> None:
    import json
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    documented = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `([a-z_]+)` \| (`[a-z_]+` = .+) \|$", text, re.MULTILINE)
    }
    expected = {}
    for kind, model in p._BY_KIND.items():
        optional = [
            f"`{name}` = " + ("nil" if (d := info.get_default(call_default_factory=True)) is None
                              else json.dumps(d))
            for name, info in model.model_fields.items()
            if name != "kind" and not info.is_required()
        ]
        if optional:
            expected[kind] = ", ".join(optional)
    assert documented == expected
