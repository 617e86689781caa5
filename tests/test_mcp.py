"""MCP servers through procs and the gate (actors/procs/mcpbridge.py,
actors/agent/mcp_ops.py), with real processes: a stdio server written here
with the SDK's server side runs in the agent's sandbox; its tools are listed,
called through the gate (allowed, denied by an `mcp:` rule, asked and approved
by the operator), their arguments checked against the tool's input schema,
every call recorded; a hostile server (a huge schema, huge results, a crash)
gets typed refusals and the runtime goes on."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from actors.kernel.settings import Permissions, Rule
from actors.registries import ops
from tests.processes import wait_for
from tests.security.stack import Runtime, shared  # noqa: F401 - the fixture

SERVER = """
    import os
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    server = MCPServer("t")

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def echo(text: str) -> str:
        with open("/proc/self/status") as f:
            mode = next(line.split()[1] for line in f if line.startswith("Seccomp:"))
        return (f"echo:{text} cwd={os.getcwd()} key={os.environ.get('OPENAI_API_KEY')}"
                f" seccomp={mode}")

    @server.tool()
    def write_note(name: str, body: str) -> str:
        with open(name, "w") as f:
            f.write(body)
        with open("calls.txt", "a") as f:
            f.write("wrote\\n")
        return "wrote " + name

    @server.tool(annotations=ToolAnnotations(idempotentHint=True))
    def count() -> str:
        with open("calls.txt", "a") as f:
            f.write("called\\n")
        return "counted"

    @server.tool()
    def danger() -> str:
        return "should never run"

    @server.tool()
    def big(n: int) -> str:
        return "x" * n

    @server.tool()
    def crash() -> str:
        os._exit(3)

    server.run()
"""

# hostile and hand-written (no SDK: it starts in milliseconds): a valid
# handshake, then a 200 KB input schema
WIDE = """
    import json, sys

    for line in sys.stdin:
        request = json.loads(line)
        if "id" not in request:
            continue
        if request["method"] == "initialize":
            result = {"protocolVersion": request["params"]["protocolVersion"],
                      "capabilities": {"tools": {}},
                      "serverInfo": {"name": "wide", "version": "1"}}
        elif request["method"] == "tools/list":
            props = {f"f{i}": {"type": "string", "description": "x" * 100}
                     for i in range(2000)}
            result = {"tools": [{"name": "wide", "inputSchema": {
                "type": "object", "properties": props}}]}
        else:
            result = {"content": [{"type": "text", "text": "no"}]}
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request["id"],
                                     "result": result}) + "\\n")
        sys.stdout.flush()
"""


def _install(rt: Runtime, agent: str) -> Path:
    """The servers' scripts in the agent's workspace (what its sandbox shows),
    installed by the operator's `mcp_install` (the `mcp` registry)."""
    workspace = rt.state.agent_dir(agent) / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "server.py").write_text(textwrap.dedent(SERVER))
    (workspace / "wide.py").write_text(textwrap.dedent(WIDE))
    for entry in [{"name": "t", "command": [sys.executable, str(workspace / "server.py")],
                   "call_timeout_s": 20},
                  {"name": "wide", "command": [sys.executable, str(workspace / "wide.py")]}]:
        ops.apply(ops.McpInstall.model_validate({"entry": entry}), rt.state, rt.writer,
                  key=f"cfg:operator:{agent}:{entry['name']}", actor="operator",
                  read_pipeline=lambda _p: ("", ""))
    return workspace


def _outcomes(rt: Runtime, agent: str) -> dict[str, dict[str, Any]]:
    """call_id -> {status, result, decision, rule} from the agent's stream."""
    out: dict[str, dict[str, Any]] = {}
    for record in rt.writer.read_stream(f"agent/{agent}"):
        p = record.payload()
        if not isinstance(p, dict) or "call_id" not in p:
            continue
        entry = out.setdefault(str(p["call_id"]), {})
        if record.event == "permission":
            entry.update(decision=p["decision"], rule=p["rule"])
        elif record.event == "tool_result":
            entry.update(status=p["status"], result=p["result"])
    return out


@pytest.mark.timeout(180)  # three SDK server starts: seconds each on a loaded host
def test_an_mcp_tool_through_the_gate_and_a_hostile_server_refused(
        shared: Runtime) -> None:  # noqa: F811 - the fixture
    """One agent (each server instance costs a few seconds of SDK start): the
    gate (allow, `mcp:` deny rule, `mcp:` ask rule approved by the operator),
    the schema check, then the hostile cases."""
    rt = shared
    workspace = _install(rt, "mcp-a")
    steps = [
        {"op": "mcp_tools", "server": "t"},
        {"op": "mcp_call", "server": "t", "tool": "echo", "arguments": {"text": "hi"}},
        {"op": "mcp_call", "server": "t", "tool": "write_note",
         "arguments": {"name": "note.txt", "body": "approved"}},
        {"op": "mcp_call", "server": "t", "tool": "danger", "arguments": {}},
        {"op": "mcp_call", "server": "t", "tool": "echo", "arguments": {"text": 5}},
        {"op": "mcp_call", "server": "nope", "tool": "echo", "arguments": {}},
        # hostile: a result past the bound, a crash in a call, a line past the
        # transport's bound, a schema past the bound
        {"op": "mcp_call", "server": "t", "tool": "big", "arguments": {"n": 1_000_000}},
        {"op": "mcp_call", "server": "t", "tool": "crash", "arguments": {}},
        {"op": "mcp_call", "server": "t", "tool": "echo", "arguments": {"text": "again"}},
        {"op": "mcp_call", "server": "t", "tool": "big", "arguments": {"n": 6_000_000}},
        {"op": "mcp_tools", "server": "wide"},
        {"op": "mcp_call", "server": "wide", "tool": "wide", "arguments": {}},
        {"op": "finish", "summary": "done"},
    ]
    agent = rt.start_agent("mcp-a", steps, approval_poll_ms=20, permissions=Permissions(
        rules=[Rule(op="mcp:t/danger", decision="deny"),
               Rule(op="mcp:t/write_*", decision="ask")]))
    wait_for(lambda: _outcomes(rt, "mcp-a").get("3.0", {}).get("decision") == "ask", 90,
             "the write_note call to ask the operator")
    assert not (workspace / "note.txt").exists()  # nothing runs before the answer
    rt.writer.append("agent/mcp-a", "approval_answer", {
        "request": "req-3.0", "decision": "approve", "always": False, "note": None,
        "op": "mcp_call", "pattern": "mcp:t/write_note"},
        key="answer:mcp-a:req-3.0", ledger="approvals", origin="operator")
    assert agent.wait(120) == 0, rt.processes.output("mcp-a")
    calls = _outcomes(rt, "mcp-a")

    listed = calls["1.0"]["result"]["tools"]
    hints = {t["name"]: (t["read_only"], t["idempotent"]) for t in listed}
    assert hints["echo"] == (True, False) and hints["write_note"] == (False, False)
    # the listing was noted for the openai backend's typed functions (mcp_functions)
    from actors.agent import mcp_functions

    noted = mcp_functions.read_tools(rt.state.agent_dir("mcp-a"))["t"]
    assert {"echo", "write_note"} <= {t["name"] for t in noted}
    offered = mcp_functions.offer({"t": True}, rt.state.agent_dir("mcp-a")).targets
    assert offered["mcp__t__echo"] == ("t", "echo")
    echo = calls["2.0"]
    assert (echo["status"], echo["decision"]) == ("ok", "allow")
    text = echo["result"]["content"][0]["text"]
    # it ran in the agent's sandbox: its workspace, no model key, the seccomp
    # filter every command gets (mode 2: a filter)
    assert text == f"echo:hi cwd={workspace} key=None seccomp=2"
    assert (calls["3.0"]["status"], calls["3.0"]["rule"]) == ("ok", "rules[1]")
    assert (workspace / "note.txt").read_text() == "approved"
    assert (calls["4.0"]["decision"], calls["4.0"]["status"]) == ("deny", "denied")
    rejected = calls["5.0"]
    assert rejected["status"] == "error" and rejected["result"]["error"] == "schema_reject"
    assert rejected["result"]["errors"] == ["text: type"]  # value-free
    assert calls["6.0"]["result"]["error"] == "unknown_server"

    errors = {cid: (c["status"], c["result"].get("error")) for cid, c in calls.items()}
    assert errors["7.0"] == ("error", "result_too_large")  # bounded by size
    assert errors["8.0"] == ("error", "server_failed")  # it died in the call
    assert calls["9.0"]["status"] == "ok"  # started again for the next call
    assert calls["9.0"]["result"]["content"][0]["text"].startswith("echo:again")
    assert errors["10.0"] == ("error", "result_too_large")  # a line past the transport's bound
    assert errors["11.0"] == ("error", "schema_too_large")
    assert errors["12.0"] == ("error", "schema_too_large")


@pytest.mark.timeout(180)
def test_an_agent_killed_in_mcp_calls_never_calls_a_tool_twice(
        shared: Runtime) -> None:  # noqa: F811 - the fixture
    """SIGKILLed in each call after the tool answered and before the result was
    durable (the loop appends `tool_start` and `tool_result` together for an op
    served by another actor): the restarted agent runs the call again under the
    same msg_id and procs answers from memory, so the server is called once per
    call, idempotent or not."""
    from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
    from tests.agentkit import write_task

    rt = shared
    workspace = _install(rt, "mcp-r")
    task = write_task(rt.tmp / "mcp-r.yaml", [
        {"op": "mcp_call", "server": "t", "tool": "count", "arguments": {}},
        {"op": "mcp_call", "server": "t", "tool": "write_note",
         "arguments": {"name": "n.txt", "body": "x"}},
        {"op": "finish", "summary": "done"},
    ])
    write_spec(rt.state, "mcp-r", AgentSpec(task=str(task), settings=AgentSettings()))
    env = {"CORRAL_AGENT_FAULT": "after_tool_start@1.0,after_tool_start@2.0"}
    codes = []
    for run in range(3):
        agent = rt.processes.spawn(["-m", "actors.agent", "--name", "mcp-r", "--state-dir",
                                    rt.root], name=f"mcp-r{run}", env=env)
        codes.append(agent.wait(90))
        if codes[-1] == 0:
            break
    assert codes == [-9, -9, 0], rt.processes.output("mcp-r2")
    results = {p["call_id"]: p for e, p in  # type: ignore[index]
               ((r.event, r.payload()) for r in rt.writer.read_stream("agent/mcp-r"))
               if e == "tool_result"}
    assert results["1.0"]["result"]["content"][0]["text"] == "counted"
    assert results["2.0"]["result"]["content"][0]["text"] == "wrote n.txt"
    assert (workspace / "calls.txt").read_text() == "called\nwrote\n"  # once each


def test_mcp_rules_hints_and_replay_safety_units(tmp_path: Path) -> None:
    """The gate's names for MCP calls, and replay safety from the noted hints."""
    from actors.agent.mcp_ops import McpCall, _note_hints
    from actors.kernel import gate
    from actors.kernel.settings import AgentSettings
    from broker.statedir import StateDir

    settings = AgentSettings(permissions=Permissions(default="ask", rules=[
        Rule(op="mcp:files/delete", decision="deny"),
        Rule(op="mcp:files/*", decision="allow"),
        Rule(op="mcp_call", decision="deny"),
    ]))
    call = McpCall(server="files", tool="read", arguments={})
    assert call.gate_op() == "mcp:files/read" and gate.pattern_of(call) == "mcp:files/read"
    assert gate.permission(call, settings) == ("allow", "rules[1]")
    assert gate.permission(McpCall(server="files", tool="delete"), settings) == (
        "deny", "rules[0]")
    assert gate.permission(McpCall(server="web", tool="get"), settings) == ("deny", "rules[2]")
    state = StateDir(tmp_path / ".corral").ensure()
    state.agent_dir("a").mkdir(parents=True)
    _note_hints(state, "a", "files", [{"name": "read", "read_only": True},
                                      {"name": "sum", "idempotent": True},
                                      {"name": "delete"}])
    safe = {tool: McpCall.replay_safe_for({"op": "mcp_call", "server": "files", "tool": tool},
                                          state, "a")
            for tool in ("read", "sum", "delete", "unknown")}
    assert safe == {"read": True, "sum": True, "delete": False, "unknown": False}
    assert McpCall.replay_safe_for("not an action", state, "a") is False
