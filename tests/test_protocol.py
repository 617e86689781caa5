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
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False)),
    max_size=5,
)
proc_ids = st.from_regex(r"\A[pt]-[0-9a-f]{16}\Z")
subagent_ids = st.from_regex(r"\As-[0-9a-f]{12}\Z")
subagent_refs = subagent_ids | st.just("latest")
proc_states = st.sampled_from(["running", "exited", "killed", "capped", "expired", "lost"])
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
