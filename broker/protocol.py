"""The wire protocol: every message, its version, its limits, `encode`/`decode`.

The only place that imports msgpack; `decode` returns a model or raises
`ProtocolError`. docs/protocol.md is the normative text.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.errors import ProtocolError

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Limits:
    """Bounds every decoder enforces before and while it parses a frame."""

    max_frame_bytes: int = 1024 * 1024
    max_depth: int = 16
    max_str_bytes: int = 256 * 1024
    max_bin_bytes: int = 1024 * 1024
    max_array_len: int = 10_000
    max_map_len: int = 1_000
    # elements in one frame: every map or array counts 1 plus its entries (an
    # array item 1, a map entry 2: key and value), the top map included. Counted
    # as each container is completed by the unpacker, so an empty container
    # costs 1 too: this bounds the work per frame, not only its size.
    max_elements: int = 65_536


DEFAULT_LIMITS = Limits()


class ErrorCode(StrEnum):
    """Codes carried by an `error` reply (and by ProtocolError.code)."""

    MALFORMED_FRAME = "malformed_frame"  # not msgpack, not a map, extension types
    FRAME_TOO_LARGE = "frame_too_large"
    TOO_DEEP = "too_deep"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_KIND = "unknown_kind"
    INVALID_MESSAGE = "invalid_message"  # a field missing, extra, or of the wrong type
    INVALID_PAYLOAD = "invalid_payload"  # append payload is not one JSON value
    UNEXPECTED_MESSAGE = "unexpected_message"  # valid, but not served by this receiver
    UNKNOWN_RECIPIENT = "unknown_recipient"
    RECIPIENT_BUSY = "recipient_busy"  # broker: the recipient's queue is full; retry later
    NOT_FOUND = "not_found"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"  # procs: commands cannot be confined (fail closed)
    FORBIDDEN = "forbidden"  # authenticated, but this actor may not do that (broker/auth.py)
    STORAGE_FULL = "storage_full"  # writer: the disk is full; nothing was written, retry later
    HOST_UNREACHABLE = "host_unreachable"  # fleet bridge: that host is dead, silent or unknown


# --- field types ------------------------------------------------------------
MsgId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")]
ActorName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
StreamName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,127}$")]
EventType = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
IdemKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:/\-]{1,128}$")]
Seq = Annotated[int, Field(ge=1, le=2**63 - 1)]
Pid = Annotated[int, Field(ge=0, le=2**31 - 1)]
Offset = Annotated[int, Field(ge=0, le=2**53)]  # a byte position in a log (lseek-safe)
LedgerName = Literal["budget", "approvals"]


class _Message(BaseModel):
    # defer_build: a model's validator is built on first use, so a short-lived
    # CLI that decodes one kind does not pay for building all of them.
    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, defer_build=True, allow_inf_nan=False
    )


# --- common -------------------------------------------------------------------
class Ping(_Message):
    kind: Literal["ping"] = "ping"
    msg_id: MsgId


class Pong(_Message):
    kind: Literal["pong"] = "pong"
    msg_id: MsgId
    actor: ActorName
    pid: Pid


class Error(_Message):
    kind: Literal["error"] = "error"
    msg_id: MsgId | None = None  # nil when the refused frame's msg_id could not be read
    code: Annotated[ErrorCode, Field(strict=False)]  # msgpack carries the value as a str
    detail: Annotated[str, Field(max_length=2000)]


# --- writer: appends and reads ------------------------------------------------
class Append(_Message):
    """Append one event. `payload` is one UTF-8 JSON value, already encoded.

    (`origin`, `key`) is the idempotency key: a retried append is written once
    and answered with its original seq."""

    kind: Literal["append"] = "append"
    msg_id: MsgId
    origin: StreamName
    key: IdemKey
    stream: StreamName
    event: EventType
    payload: bytes
    ledger: LedgerName | None = None


class AppendOk(_Message):
    kind: Literal["append_ok"] = "append_ok"
    msg_id: MsgId
    seq: Seq
    duplicate: bool


class AppendItem(_Message):
    """One record of an `append_many` (its stream and origin are the group's)."""

    key: IdemKey
    event: EventType
    payload: bytes
    ledger: LedgerName | None = None


MAX_GROUP_RECORDS = 256


class AppendMany(_Message):
    """Append records of one stream atomically: one round trip, one fdatasync,
    consecutive seqs, all or none of them after a crash; idempotent as a whole
    (a retry whose keys were all written is answered with the first seq)."""

    kind: Literal["append_many"] = "append_many"
    msg_id: MsgId
    origin: StreamName
    stream: StreamName
    records: Annotated[list[AppendItem], Field(min_length=1, max_length=MAX_GROUP_RECORDS)]


class AppendManyOk(_Message):
    """`seq` is the first record's, the others follow it without a gap.
    `prev_seq` is the stream's record just before the group (0: none), so a
    client that folded the stream up to it knows nothing of the stream came
    between; None on a duplicate (not known)."""

    kind: Literal["append_many_ok"] = "append_many_ok"
    msg_id: MsgId
    seq: Seq
    count: Annotated[int, Field(ge=1, le=MAX_GROUP_RECORDS)]
    prev_seq: Annotated[int, Field(ge=0)] | None
    duplicate: bool


class ReadStream(_Message):
    """Read records of one stream with seq >= from_seq, at most one page."""

    kind: Literal["read_stream"] = "read_stream"
    msg_id: MsgId
    stream: StreamName
    from_seq: Seq = 1
    max_records: Annotated[int, Field(ge=1, le=4096)] = 512
    max_bytes: Annotated[int, Field(ge=1, le=768 * 1024)] = 512 * 1024


class Records(_Message):
    """A page of raw WAL lines (without newline). Ask again from `next_seq`
    while `more` is true."""

    kind: Literal["records"] = "records"
    msg_id: MsgId
    stream: StreamName
    records: list[bytes]
    next_seq: Seq
    more: bool
    head_seq: int


class StatsRequest(_Message):
    kind: Literal["stats_request"] = "stats_request"
    msg_id: MsgId


class Stats(_Message):
    """An actor's counters (its `statistics()`), by name; values are numbers."""

    kind: Literal["stats"] = "stats"
    msg_id: MsgId
    actor: ActorName
    values: dict[str, int | float]


# --- supervision: children report, the CLI asks ---------------------------------
class Ready(_Message):
    """A child tells the supervisor it is serving."""

    kind: Literal["ready"] = "ready"
    actor: ActorName
    pid: Pid
    msg_id: MsgId | None = None  # a notice, never answered; a msg_id is allowed, not needed


class Busy(_Message):
    """What a child is busy with while it beats: one call (a tool call, a model
    call, an append) and how long it has been in it (docs/supervisor.md)."""

    op: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
    since_s: Annotated[float, Field(ge=0)]


class Heartbeat(_Message):
    """Liveness, both ways (child <-> supervisor, peer <-> broker); a child may
    attach its counters."""

    kind: Literal["heartbeat"] = "heartbeat"
    actor: ActorName
    pid: Pid
    values: dict[str, int | float] = Field(default_factory=dict)
    busy: Busy | None = None  # the call the child's main thread is in, if any
    msg_id: MsgId | None = None  # a notice, never answered; a msg_id is allowed, not needed


class ChildStatus(_Message):
    name: ActorName
    kind: Literal["writer", "broker", "procs", "subagents", "agent"]
    pid: int | None
    # stopped: by the operator (`supervisor stop NAME`); started again only by `start`
    state: Literal["starting", "running", "backoff", "exited", "fatal", "stopping", "stopped"]
    uptime_s: float | None
    restarts: int
    last_exit: str | None  # "exit 3" or "signal SIGKILL"
    cpu_percent: float | None
    rss_bytes: int | None
    uss_bytes: int | None
    heartbeat_age_s: float | None
    values: dict[str, int | float] = Field(default_factory=dict)
    busy: Busy | None = None  # as of now: since_s counts up to the status' time


class StatusRequest(_Message):
    kind: Literal["status_request"] = "status_request"
    msg_id: MsgId


class StatusReply(_Message):
    kind: Literal["status_reply"] = "status_reply"
    msg_id: MsgId
    supervisor_pid: Pid
    state_dir: str
    started_at: float
    children: list[ChildStatus]


class SignalRequest(_Message):
    """Signal one child's process group, or every child with target "all"."""

    kind: Literal["signal_request"] = "signal_request"
    msg_id: MsgId
    target: ActorName
    signal: Annotated[int, Field(ge=1, le=64)]


class RestartRequest(_Message):
    kind: Literal["restart_request"] = "restart_request"
    msg_id: MsgId
    target: ActorName


class StopRequest(_Message):
    """Stop the whole tree, or (with `target`) one child, which stays stopped."""

    kind: Literal["stop_request"] = "stop_request"
    msg_id: MsgId
    target: ActorName | None = None


class StartRequest(_Message):
    """Start a stopped, exited or fatal child again (a running one: nothing to do)."""

    kind: Literal["start_request"] = "start_request"
    msg_id: MsgId
    target: ActorName


class RemoveRequest(_Message):
    """Stop an agent and drop it and its spec (its WAL history stays)."""

    kind: Literal["remove_request"] = "remove_request"
    msg_id: MsgId
    target: ActorName


class ReloadRequest(_Message):
    """Re-read the configuration file the supervisor was started with."""

    kind: Literal["reload_request"] = "reload_request"
    msg_id: MsgId


class ReloadReply(_Message):
    """What a reload changed: children started, stopped (dropped) and restarted."""

    kind: Literal["reload_reply"] = "reload_reply"
    msg_id: MsgId
    config: Annotated[str, Field(max_length=4096)]
    started: list[ActorName]
    stopped: list[ActorName]
    restarted: list[ActorName]
    unchanged: Annotated[int, Field(ge=0)]


class SpawnRequest(_Message):
    """Add an agent to a running runtime; the supervisor writes its spec (with the
    running configuration's agent settings) only when it accepts the request."""

    kind: Literal["spawn_request"] = "spawn_request"
    msg_id: MsgId
    name: ActorName
    task: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    backend: Literal["scripted", "replay", "openai", "pipeline"] = "scripted"
    model: Annotated[str, Field(max_length=256)] | None = None
    replay_stream: StreamName | None = None
    # the session to go on with (a fleet adoption, docs/fleet.md); None: a new one
    session: Annotated[str, Field(max_length=64)] | None = None


class Ack(_Message):
    """A control request was carried out for the named children."""

    kind: Literal["ack"] = "ack"
    msg_id: MsgId
    affected: list[ActorName]


# --- procs: background commands and terminals (served by the `procs` actor) -----
SessionName = ActorName  # a session is named after its agent (docs/procs.md)
ProcId = Annotated[str, Field(pattern=r"^[pt]-[0-9a-f]{16}$")]
ProcState = Literal["running", "exited", "killed", "capped", "expired", "lost",
                    "quota_exceeded"]
OutputBytes = Annotated[int, Field(ge=1, le=1024 * 1024 * 1024)]
ReadBytes = Annotated[int, Field(ge=1, le=512 * 1024)]
Lifetime = Annotated[float, Field(gt=0, le=7 * 24 * 3600)]


class Bash(_Message):
    """Run a command in the foreground: the reply (`proc_output`) comes when it
    ends or after `timeout_s` (then its whole group is killed)."""

    kind: Literal["bash"] = "bash"
    msg_id: MsgId
    session: SessionName
    command: Annotated[str, Field(min_length=1, max_length=64 * 1024)]
    cwd: Annotated[str, Field(min_length=1, max_length=4096)]
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 120.0
    max_bytes: ReadBytes = 64 * 1024  # output returned in the reply; the rest by bash_poll
    max_output_bytes: OutputBytes | None = None  # cap of the log; None: the host's default


class BashStart(_Message):
    """Start a background command; the reply is `proc_status`."""

    kind: Literal["bash_start"] = "bash_start"
    msg_id: MsgId
    session: SessionName
    command: Annotated[str, Field(min_length=1, max_length=64 * 1024)]
    cwd: Annotated[str, Field(min_length=1, max_length=4096)]
    max_output_bytes: OutputBytes | None = None
    lifetime_s: Lifetime | None = None


class BashPoll(_Message):
    """Bytes of a command's log after `cursor` (at most `max_bytes`) and its state."""

    kind: Literal["bash_poll"] = "bash_poll"
    msg_id: MsgId
    session: SessionName
    proc_id: ProcId
    cursor: Offset = 0
    max_bytes: ReadBytes = 64 * 1024


class BashKill(_Message):
    """End a command's whole process group (SIGTERM, grace, SIGKILL)."""

    kind: Literal["bash_kill"] = "bash_kill"
    msg_id: MsgId
    session: SessionName
    proc_id: ProcId


class TerminalStart(_Message):
    """Start `argv` on a new PTY; the reply is `proc_status` (its proc_id names it)."""

    kind: Literal["terminal_start"] = "terminal_start"
    msg_id: MsgId
    session: SessionName
    argv: Annotated[
        list[Annotated[str, Field(max_length=8192)]], Field(min_length=1, max_length=256)
    ]
    cwd: Annotated[str, Field(min_length=1, max_length=4096)]
    rows: Annotated[int, Field(ge=1, le=1000)] = 24
    cols: Annotated[int, Field(ge=1, le=1000)] = 80
    max_output_bytes: OutputBytes | None = None
    lifetime_s: Lifetime | None = None


class TerminalInput(_Message):
    """Bytes typed into a terminal (the WAL keeps only their hash and size)."""

    kind: Literal["terminal_input"] = "terminal_input"
    msg_id: MsgId
    session: SessionName
    proc_id: ProcId
    data: Annotated[bytes, Field(max_length=64 * 1024)]


class TerminalRead(_Message):
    kind: Literal["terminal_read"] = "terminal_read"
    msg_id: MsgId
    session: SessionName
    proc_id: ProcId
    cursor: Offset = 0
    max_bytes: ReadBytes = 64 * 1024


class TerminalEnd(_Message):
    kind: Literal["terminal_end"] = "terminal_end"
    msg_id: MsgId
    session: SessionName
    proc_id: ProcId


class SessionEnd(_Message):
    """The session is over: every command and terminal it started is ended."""

    kind: Literal["session_end"] = "session_end"
    msg_id: MsgId
    session: SessionName


class ProcStatus(_Message):
    """A command's or terminal's state (reply to starts, kills, input, session_end)."""

    kind: Literal["proc_status"] = "proc_status"
    msg_id: MsgId
    proc_id: ProcId | None  # None for session_end
    state: ProcState
    pid: int | None = None
    exit_code: int | None = None
    log_bytes: Annotated[int, Field(ge=0)] = 0
    ended: Annotated[int, Field(ge=0)] = 0  # session_end: how many were ended


class ProcOutput(_Message):
    """Output after a cursor: `data` is log[cursor:next_cursor]; `state` and
    `exit_code` as known when the bytes were read (read again until `eof`)."""

    kind: Literal["proc_output"] = "proc_output"
    msg_id: MsgId
    proc_id: ProcId
    cursor: Offset
    next_cursor: Offset
    data: bytes
    state: ProcState
    exit_code: int | None = None
    eof: bool = False  # ended and every byte of the log has been returned


class McpRequest(_Message):
    """Ask procs for the tools of an installed MCP server (`list`) or call one
    (`call`, `arguments` a JSON object). procs runs one instance of each server
    per sender, in the sender's sandbox (actors/procs/mcpbridge.py)."""

    kind: Literal["mcp_request"] = "mcp_request"
    msg_id: MsgId
    action: Literal["list", "call"]
    server: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,31}$")]
    tool: Annotated[str, Field(min_length=1, max_length=128)] | None
    arguments: Annotated[bytes, Field(max_length=256 * 1024)]


class McpReply(_Message):
    """`body`: JSON, `{"tools": [...]}` for a list, the tool's result for a call;
    refused: `ok` false, `error` a code (docs/mcp.md) and `detail`."""

    kind: Literal["mcp_reply"] = "mcp_reply"
    msg_id: MsgId
    ok: bool
    error: Annotated[str, Field(max_length=64)] | None
    detail: Annotated[str, Field(max_length=2000)]
    body: Annotated[bytes, Field(max_length=512 * 1024)]


# --- subagents: isolated children and their change sets (the `subagents` actor) -
SubagentId = Annotated[str, Field(pattern=r"^s-[0-9a-f]{12}$")]
SubagentRef = Annotated[str, Field(pattern=r"^(s-[0-9a-f]{12}|latest)$")]  # latest: the newest


class SpawnSubagent(_Message):
    """Snapshot `workspace` and run a child agent on `task` there. The reply
    (`subagent_reply`) comes when the child ends or after `wait_s`."""

    kind: Literal["spawn_subagent"] = "spawn_subagent"
    msg_id: MsgId
    parent: ActorName
    workspace: Annotated[str, Field(min_length=1, max_length=4096)]
    task: Annotated[str, Field(min_length=1, max_length=4096)]  # a task file's path
    descriptor: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,31}$")] = "child"
    wait_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 600.0
    # The parent's idempotency key for this spawn: every request carrying the
    # same key (a retry, or the same call redone after the parent crashed)
    # names the same child. None: the msg_id is the key.
    key: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")] | None = None
    # fleet mode: the host the child runs on (docs/fleet.md); None: this host
    host: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")] | None = None


class SubagentChanges(_Message):
    """The child's state and, once it ended, its change set."""

    kind: Literal["subagent_changes"] = "subagent_changes"
    msg_id: MsgId
    parent: ActorName
    subagent_id: SubagentRef
    wait_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 0.0


class ApplySubagent(_Message):
    """Apply the child's ready change set to the parent's workspace, once."""

    kind: Literal["apply_subagent"] = "apply_subagent"
    msg_id: MsgId
    parent: ActorName
    subagent_id: SubagentRef


class SubagentReply(_Message):
    """`manifest` is changeset.json, `patch` changes.patch, `receipt`
    application.json (each once it exists); `refusal` names a refused apply."""

    kind: Literal["subagent_reply"] = "subagent_reply"
    msg_id: MsgId
    subagent_id: SubagentId
    state: Literal["running", "ended", "failed", "applied"]
    exit_code: int | None = None
    manifest: bytes | None = None
    patch: bytes | None = None
    receipt: bytes | None = None
    refusal: Annotated[str, Field(max_length=2000)] | None = None
    tokens_used: Annotated[int, Field(ge=0)] = 0  # the child's model usage (the parent's budget)
    cost_used: Annotated[float, Field(ge=0)] = 0.0


Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
CHUNK_BYTES = 512 * 1024  # one `subagent_chunk`'s data (under the frame limit)


class SubagentRemote(_Message):
    """From one host's subagents actor to another's (docs/fleet.md, "Subagents
    on another host"): `offer` a child on the snapshot whose pack went ahead
    in `subagent_chunk`s, or `poll` it (the reply re-sends its change set)."""

    kind: Literal["subagent_remote"] = "subagent_remote"
    msg_id: MsgId
    op: Literal["offer", "poll"]
    subagent_id: SubagentId  # as the parent's host named it
    parent: ActorName
    pack_bytes: Annotated[int, Field(ge=0, le=2**40)] = 0
    pack_sha256: Sha256Hex | None = None
    base_sha256: Sha256Hex | None = None
    task: Annotated[bytes, Field(max_length=64 * 1024)] | None = None  # the task file's text
    settings: Annotated[bytes, Field(max_length=64 * 1024)] | None = None  # AgentSettings JSON
    backend: Literal["scripted", "replay", "openai", "pipeline"] = "scripted"


class SubagentChunk(_Message):
    """One piece of a pack crossing hosts (a notice: never answered)."""

    kind: Literal["subagent_chunk"] = "subagent_chunk"
    pack_sha256: Sha256Hex
    pack_bytes: Annotated[int, Field(ge=0, le=2**40)]
    index: Annotated[int, Field(ge=0, lt=65_536)]
    total: Annotated[int, Field(ge=1, le=65_536)]
    data: Annotated[bytes, Field(max_length=CHUNK_BYTES)]


class SubagentRemoteReply(_Message):
    """A remote child's state; `ended` names the pack of its change set
    (sent ahead in `subagent_chunk`s); `refusal` says why it cannot run."""

    kind: Literal["subagent_remote_reply"] = "subagent_remote_reply"
    msg_id: MsgId
    subagent_id: SubagentId
    state: Literal["running", "ended", "failed", "incomplete", "refused"]
    exit_code: int | None = None
    pack_sha256: Sha256Hex | None = None
    pack_bytes: Annotated[int, Field(ge=0, le=2**40)] = 0
    tokens_used: Annotated[int, Field(ge=0)] = 0
    cost_used: Annotated[float, Field(ge=0)] = 0.0
    refusal: Annotated[str, Field(max_length=2000)] | None = None


Message = Annotated[
    Ping
    | Pong
    | Error
    | Append
    | AppendOk
    | AppendMany
    | AppendManyOk
    | ReadStream
    | Records
    | StatsRequest
    | Stats
    | Ready
    | Heartbeat
    | StatusRequest
    | StatusReply
    | SignalRequest
    | RestartRequest
    | StopRequest
    | SpawnRequest
    | StartRequest
    | RemoveRequest
    | ReloadRequest
    | ReloadReply
    | Ack
    | Bash
    | BashStart
    | BashPoll
    | BashKill
    | TerminalStart
    | TerminalInput
    | TerminalRead
    | TerminalEnd
    | SessionEnd
    | ProcStatus
    | ProcOutput
    | McpRequest
    | McpReply
    | SpawnSubagent
    | SubagentChanges
    | ApplySubagent
    | SubagentReply
    | SubagentRemote
    | SubagentChunk
    | SubagentRemoteReply,
    Field(discriminator="kind"),
]

# Every kind, derived from the `Message` union: adding a message there is enough.
_BY_KIND: dict[str, type[_Message]] = {
    str(m.model_fields["kind"].default): m for m in get_args(get_args(Message)[0])
}
_KINDS = frozenset(_BY_KIND)


# Kinds that answer or announce something: a receiver never answers them
# (an unsolicited one is dropped), so no two receivers can trade errors forever.
# Every kind is listed in exactly one of the two sets (tests/test_protocol.py
# checks it): a new kind must be classified on purpose.
REPLY_KINDS = frozenset(
    {
        "error", "pong", "append_ok", "records", "stats", "ready", "heartbeat",
        "status_reply", "ack", "proc_status", "proc_output", "subagent_reply",
        "reload_reply", "append_many_ok", "mcp_reply", "subagent_chunk",
        "subagent_remote_reply",
    }
)
REQUEST_KINDS = frozenset(
    {
        "ping", "append", "append_many", "read_stream", "stats_request", "status_request",
        "signal_request", "restart_request", "stop_request", "start_request",
        "remove_request", "reload_request", "spawn_request", "bash", "bash_start",
        "bash_poll", "bash_kill", "terminal_start", "terminal_input", "terminal_read",
        "terminal_end", "session_end", "spawn_subagent", "subagent_changes",
        "apply_subagent", "mcp_request", "subagent_remote",
    }
)


def is_reply(message: _Message) -> bool:
    """True for replies and notices: never answer these, not even with an error."""
    return str(getattr(message, "kind", "")) in REPLY_KINDS


# Fields where nil means "absent, use the default" (their default is not nil).
_NIL_MEANS_DEFAULT: dict[str, frozenset[str]] = {
    kind: frozenset(
        name
        for name, info in model.model_fields.items()
        if name != "kind" and not info.is_required() and info.get_default(call_default_factory=True)
        is not None
    )
    for kind, model in _BY_KIND.items()
}


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"msgpack extension type {code} refused")


class _Counter:
    """Counts elements (Limits.max_elements) as the C unpacker completes each
    container (its list and map hooks), refusing the frame once `limit` is
    passed: the work per frame stops there, whatever the frame holds."""

    __slots__ = ("count", "limit")

    def __init__(self, limit: int) -> None:
        self.count = 0
        self.limit = limit

    def refusal(self) -> str:
        return f"more than {self.limit} elements (msgpack objects) in the frame"

    def on_list(self, items: list[Any]) -> list[Any]:
        self.count += 1 + len(items)
        if self.count > self.limit:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, self.refusal())
        return items

    def on_map(self, items: dict[Any, Any]) -> dict[str, Any]:
        # a repeated key is not seen here (the last value stands), so the
        # entries it hid are not counted: each still cost the unpacker
        # at least one byte of the frame, which the size limit bounds
        self.count += 1 + 2 * len(items)
        if self.count > self.limit:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, self.refusal())
        for key in items:  # a plain loop: cheapest for the small maps that dominate
            if type(key) is not str:
                raise ProtocolError(ErrorCode.MALFORMED_FRAME, "map keys must be str")
        return items


_LIST_IS = functools.partial(operator.is_, list)
_CONTAINERS = frozenset({list, dict})


def _unpack(frame: bytes, limits: Limits) -> Any:
    """msgpack -> Python objects within every limit (ProtocolError otherwise)."""
    counter = _Counter(limits.max_elements)
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            list_hook=counter.on_list,
            object_hook=counter.on_map,
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_bin_bytes,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except RecursionError as exc:
        raise ProtocolError(ErrorCode.TOO_DEEP, "nested too deep for the unpacker") from exc
    except Exception as exc:  # any unpacker failure is a malformed frame
        # StackError (too deep for the C unpacker) subclasses ValueError.
        code = ErrorCode.TOO_DEEP if "stack" in type(exc).__name__.lower() else (
            ErrorCode.MALFORMED_FRAME
        )
        raise ProtocolError(code, f"not a valid msgpack frame: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from exc


def _depth(root: object, max_depth: int) -> None:
    """Raise TOO_DEEP when containers nest deeper than max_depth. The top map
    is depth 1; each map or array inside a container adds one. Level by level,
    with the scanning done by C iterators (no Python code per element)."""
    if isinstance(root, dict) and _CONTAINERS.isdisjoint(map(type, root.values())):
        return  # the common frame: a flat map
    lists: list[list[Any]] = [root] if isinstance(root, list) else []
    dicts: list[dict[Any, Any]] = [root] if isinstance(root, dict) else []
    depth = 1
    while lists or dicts:
        if depth > max_depth:
            raise ProtocolError(ErrorCode.TOO_DEEP, f"nesting deeper than {max_depth}")
        children = list(
            itertools.chain(
                itertools.chain.from_iterable(lists),
                itertools.chain.from_iterable(map(dict.values, dicts)),
            )
        )
        is_container = map(_CONTAINERS.__contains__, map(type, children))
        found = list(itertools.compress(children, is_container))
        is_list = list(map(_LIST_IS, map(type, found)))
        lists = list(itertools.compress(found, is_list))
        dicts = list(itertools.compress(found, map(operator.not_, is_list)))
        depth += 1


_FLAT_FIELDS: dict[type[BaseModel], tuple[str, ...] | None] = {}


def _flat_fields(cls: type[BaseModel]) -> tuple[str, ...] | None:
    """Field names when no field can hold a model (so a plain copy encodes it)."""
    if cls not in _FLAT_FIELDS:
        nested = any(_holds_model(info.annotation) for info in cls.model_fields.values())
        _FLAT_FIELDS[cls] = None if nested else tuple(cls.model_fields)
    return _FLAT_FIELDS[cls]


def _holds_model(annotation: object) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in get_args(annotation))


def encode(message: _Message) -> bytes:
    """Serialise a message to one frame."""
    fields = _flat_fields(type(message))
    if fields is None:
        body = message.model_dump(mode="python")
    else:  # the hot path: appends and their acks hold only scalars
        body = {name: getattr(message, name) for name in fields}
    body["v"] = PROTOCOL_VERSION
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def decode(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate one frame; raise ProtocolError, never return a dict.

    Whatever the bytes, only ProtocolError can come out. Its `msg_id` is the
    frame's msg_id when one could be read (a str field `msg_id` of the top map
    within the limits), so the error reply can carry it."""
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"{len(frame)} bytes > limit {limits.max_frame_bytes}",
            peek(frame, limits).msg_id,
        )
    obj = _unpack(frame, limits)
    if type(obj) is not dict:
        raise ProtocolError(
            ErrorCode.MALFORMED_FRAME, f"frame is a {type(obj).__name__}, not a map"
        )
    try:
        return _validate(obj, limits)
    except ProtocolError as exc:
        exc.msg_id = _echo(obj)
        raise
    except Exception as exc:  # the last line: nothing but ProtocolError leaves
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"refused: {type(exc).__name__}", _echo(obj)
        ) from exc


def _echo(obj: dict[str, Any]) -> str | None:
    msg_id = obj.get("msg_id")
    return msg_id if type(msg_id) is str and _valid_msg_id(msg_id) else None


def _validate(obj: dict[str, Any], limits: Limits) -> Message:
    _depth(obj, limits.max_depth)
    version = obj.pop("v", None)
    # strict: True == 1 and 1.0 == 1 in Python, but neither is the int 1
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"version {_show(version)}, expected the int {PROTOCOL_VERSION}",
        )
    kind = obj.get("kind")
    if type(kind) is not str or kind not in _KINDS:
        raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown kind {_show(kind)}")
    for name in _NIL_MEANS_DEFAULT[kind]:
        if name in obj and obj[name] is None:
            del obj[name]  # nil for an optional field means "use the default"
    try:
        message: Message = _BY_KIND[kind].model_validate(obj)  # type: ignore[assignment]
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(frame)"
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"{kind}: {where}: {first['msg']}"[:500]
        ) from exc
    return message


def _show(value: object) -> str:
    """A short, safe rendering of a refused value for an error's detail."""
    if isinstance(value, str | int | float | bool | None):
        return repr(value)[:80]
    return f"of type {type(value).__name__}"


PEEK_ELEMENTS = 1024  # how far peek() reads into a frame it has not decoded


@dataclass(frozen=True)
class Peeked:
    """What could be read from a frame without decoding it: its `kind` and
    `msg_id` (each None when absent, invalid, or not within reach)."""

    kind: str | None
    msg_id: str | None

    @property
    def is_reply(self) -> bool:
        """A reply or notice (never to be answered, not even with an error)."""
        return self.kind in REPLY_KINDS


def peek(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Peeked:
    """Read `kind` and `msg_id` from the top map of a frame that was not (or
    could not be) decoded, entry by entry, within its first PEEK_ELEMENTS
    msgpack objects (our encoder writes both first). Never raises; cheap on
    any frame up to twice the size limit."""
    counter = _Counter(PEEK_ELEMENTS)
    kind: str | None = None
    msg_id: str | None = None
    try:
        unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            list_hook=counter.on_list,
            object_hook=counter.on_map,
            max_buffer_size=max(1, 2 * limits.max_frame_bytes),
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_bin_bytes,
            max_array_len=min(limits.max_array_len, PEEK_ELEMENTS),
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
        unpacker.feed(frame[: 2 * limits.max_frame_bytes])
        entries = unpacker.read_map_header()
        for _ in range(min(entries, PEEK_ELEMENTS // 2)):
            counter.count += 2
            key = unpacker.unpack()
            value = unpacker.unpack()
            if key == "kind" and type(value) is str and value in _KINDS:
                kind = value
            elif key == "msg_id" and type(value) is str and _valid_msg_id(value):
                msg_id = value
            if kind is not None and msg_id is not None:
                break
    except Exception:  # noqa: BLE001 - any failure just ends the peek
        return Peeked(kind, msg_id)
    return Peeked(kind, msg_id)


def peek_msg_id(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Best-effort msg_id of a refused frame, so the error reply can carry it."""
    return peek(frame, limits).msg_id


def error_frame(exc: ProtocolError, msg_id: str | None = None) -> bytes:
    """The `error` reply for a refused frame (its msg_id: `msg_id`, else the one
    decode read into the exception, else nil)."""
    if msg_id is None:
        msg_id = getattr(exc, "msg_id", None)
    safe_id = msg_id if msg_id is not None and _valid_msg_id(msg_id) else None
    try:
        code = ErrorCode(exc.code)
    except ValueError:
        code = ErrorCode.INTERNAL_ERROR
    return encode(Error(msg_id=safe_id, code=code, detail=exc.detail[:2000]))


_MSG_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


def _valid_msg_id(msg_id: str) -> bool:
    return _MSG_ID.fullmatch(msg_id) is not None
