"""MCP tools as typed ops: `mcp_tools` and `mcp_call`, run by procs.

See docs/mcp.md ("The agent's side (actors/agent/mcp_ops.py)").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import jsonschema
from pydantic import Field

from actors.agent import mcp_functions
from actors.kernel.ops import Done, OpBase, OpContext, OpSpec
from broker import protocol
from broker.errors import CorralError
from broker.statedir import StateDir

ServerName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,31}$")]
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]
LIST_DEADLINE_S = 90.0  # procs may first import the SDK (seconds) and start the server
CALL_DEADLINE_S = 660.0  # the longest `call_timeout_s` (600) + start + margins
MAX_ERRORS = 20


class McpTools(OpBase):
    op: Literal["mcp_tools"] = "mcp_tools"
    server: ServerName
    replay_safe: ClassVar[bool] = True  # a listing changes nothing
    call_deadline_s: ClassVar[float] = LIST_DEADLINE_S


class McpCall(OpBase):
    op: Literal["mcp_call"] = "mcp_call"
    server: ServerName
    tool: ToolName
    arguments: dict[str, Any] = Field(default_factory=dict)
    call_deadline_s: ClassVar[float] = CALL_DEADLINE_S

    def gate_op(self) -> str:
        return f"mcp:{self.server}/{self.tool}"

    @classmethod
    def replay_safe_for(cls, action: Any, state_dir: StateDir, agent: str) -> bool:
        if not isinstance(action, dict):
            return False
        hints = _read_hints(state_dir, agent)
        return hints.get(f"{action.get('server')}/{action.get('tool')}") is True


def _hints_path(state_dir: StateDir, agent: str) -> Path:
    return state_dir.agent_dir(agent) / "mcp-hints.json"


def _read_hints(state_dir: StateDir, agent: str) -> dict[str, bool]:
    try:
        data = json.loads(_hints_path(state_dir, agent).read_bytes()[:1024 * 1024])
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, bool)} if isinstance(data, dict) \
        else {}


def _note_hints(state_dir: StateDir, agent: str, server: str,
                tools: list[dict[str, Any]]) -> None:
    hints = _read_hints(state_dir, agent)
    fresh = {f"{server}/{t['name']}": bool(t.get("read_only") or t.get("idempotent"))
             for t in tools}
    if all(hints.get(k) == v for k, v in fresh.items()):
        return
    hints.update(fresh)
    path = _hints_path(state_dir, agent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(hints, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _request(ctx: OpContext, message: protocol.McpRequest,
             timeout_s: float) -> protocol.McpReply | Done:
    if ctx.peer is None:
        return Done({"error": "no broker connection for MCP servers"}, ok=False)
    try:
        reply = ctx.peer.request("procs", message, timeout_s=timeout_s, retries=1)
    except CorralError as exc:
        return Done({"error": "procs_unavailable", "detail": str(exc)[:300]}, ok=False)
    if not isinstance(reply, protocol.McpReply):
        return Done({"error": "procs answered with " + reply.kind}, ok=False)
    if not reply.ok:
        return Done({"error": reply.error, "detail": reply.detail}, ok=False)
    return reply


def _tools(ctx: OpContext, server: str) -> list[dict[str, Any]] | Done:
    msg_id = f"ml.{ctx.call_id or 'x'}"
    got = _request(ctx, protocol.McpRequest(msg_id=msg_id, action="list", server=server,
                                            tool=None, arguments=b"{}"), LIST_DEADLINE_S)
    if isinstance(got, Done):
        return got
    body = json.loads(got.body)
    tools = body.get("tools") if isinstance(body, dict) else None
    if not isinstance(tools, list):
        return Done({"error": "bad_reply", "detail": "procs sent no tool list"}, ok=False)
    _note_hints(ctx.state_dir, ctx.agent, server, tools)
    mcp_functions.note_tools(ctx.state_dir.agent_dir(ctx.agent), server, tools)
    return tools


def _clip(value: Any, limit: int) -> Any:
    text = json.dumps(value, separators=(",", ":"))
    return value if len(text) <= limit else {"clipped": text[:limit], "bytes": len(text)}


def tools_handler(op: McpTools, ctx: OpContext) -> Done:
    tools = _tools(ctx, op.server)
    if isinstance(tools, Done):
        return tools
    return Done({"server": op.server, "tools": _clip(tools, ctx.max_result_chars)})


def call_handler(op: McpCall, ctx: OpContext) -> Done:
    tools = _tools(ctx, op.server)
    if isinstance(tools, Done):
        return tools
    tool = next((t for t in tools if t.get("name") == op.tool), None)
    if tool is None:
        return Done({"error": "unknown_tool", "detail": f"{op.server} has no tool {op.tool}"},
                    ok=False)
    try:
        validator = jsonschema.Draft202012Validator(tool.get("input_schema") or {})
        errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '(arguments)'}: {e.validator}"
                  for _, e in zip(range(MAX_ERRORS), validator.iter_errors(op.arguments),
                                  strict=False)]
    except (jsonschema.SchemaError, RecursionError, TypeError, ValueError) as exc:
        return Done({"error": "bad_schema",
                     "detail": f"the tool's input schema is unusable: {type(exc).__name__}"},
                    ok=False)
    if errors:  # value-free, like an op's schema_reject
        return Done({"error": "schema_reject", "errors": errors}, ok=False)
    arguments = json.dumps(op.arguments, separators=(",", ":")).encode()
    got = _request(ctx, protocol.McpRequest(
        msg_id=f"mc.{ctx.call_id or 'x'}", action="call", server=op.server, tool=op.tool,
        arguments=arguments), CALL_DEADLINE_S)
    if isinstance(got, Done):
        return got
    body = json.loads(got.body)
    failed = isinstance(body, dict) and body.get("isError") is True
    content = body.get("content") if isinstance(body, dict) else body
    result = {"server": op.server, "tool": op.tool, "is_error": failed,
              "content": _clip(content, ctx.max_result_chars)}
    if isinstance(body, dict) and body.get("structuredContent") is not None:
        result["structured"] = _clip(body["structuredContent"], ctx.max_result_chars)
    return Done(result, ok=not failed)


OPS = (OpSpec(McpTools, tools_handler), OpSpec(McpCall, call_handler))
