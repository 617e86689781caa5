"""MCP tools as typed functions of the openai backend (actors/agent/
mcp_functions.py), against the fake OpenAI server of tests/test_openai_sdk.py:
each listed tool of an installed, enabled server is offered as
`mcp__<server>__<tool>` with its input schema; a disabled or uninstalled
server's tools, an invalid or oversized schema, a name that does not fit, and
anything past the bound are not; a call of one comes back as the `mcp_call`
action, which the catalog parses and the gate judges as `mcp:<server>/<tool>`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.agent import catalog, mcp_functions
from actors.agent.mcp_ops import McpCall
from actors.agent.openai_backend import OpenAIModel
from actors.kernel import gate
from actors.kernel.ops import Rejected
from actors.kernel.settings import AgentSettings, OpenAISettings, Task
from actors.kernel.state import AgentState
from actors.registries import ops
from broker.statedir import StateDir
from tests.agentkit import FakeWriter
from tests.test_openai_backend import Server, call, completion

catalog.install()  # the ops these tests parse and run (a process does it at start)

READ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    srv.thread.start()
    yield srv
    srv.release.set()
    srv.httpd.shutdown()
    srv.httpd.server_close()


@pytest.fixture
def agent_dir(tmp_path: Path) -> Path:
    root = tmp_path / ".corral"
    state = StateDir(root).ensure()
    writer = FakeWriter().as_origin("operator")
    for key, entry in enumerate([{"name": "files", "command": ["/bin/true"]},
                                 {"name": "off", "command": ["/bin/true"], "enabled": False}]):
        ops.apply(ops.McpInstall.model_validate({"entry": entry}), state, writer,
                  key=f"k{key}", actor="operator", read_pipeline=lambda _p: ("", ""))
    path = root / "agents" / "a1"
    path.mkdir(parents=True)
    return path


def _offered(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in request["tools"]
            if t["function"]["name"].startswith("mcp__")}


def test_listed_tools_of_enabled_servers_are_functions_and_calls_map_to_mcp_call(
        server: Server, agent_dir: Path) -> None:
    mcp_functions.note_tools(agent_dir, "files", [
        {"name": "read", "description": "Read a file", "input_schema": READ,
         "read_only": True},
        {"name": "huge", "input_schema": {"type": "object", "description": "x" * 9000}},
        {"name": "broken", "input_schema": {"type": "object", "properties": {"a": 5}}},
        {"name": "array", "input_schema": {"type": "array"}},
        {"name": "dotted.name", "input_schema": READ},
        {"name": "bare"}])
    mcp_functions.note_tools(agent_dir, "off", [{"name": "read", "input_schema": READ}])
    mcp_functions.note_tools(agent_dir, "gone", [{"name": "read", "input_schema": READ}])
    server.script.append((200, completion([
        call("mcp__files__read", json.dumps({"path": "a.md"})),
        call("mcp__off__read", json.dumps({"path": "a.md"})),
        call("write_file", json.dumps({"path": "b.md", "content": "x"}))])))
    model = OpenAIModel(OpenAISettings(base_url=server.base_url), Task(prompt="p"),
                        agent_dir=agent_dir)
    reply = model.next_reply(AgentState())

    offered = _offered(server.requests[0])
    assert sorted(offered) == ["mcp__files__bare", "mcp__files__read"]
    assert offered["mcp__files__read"]["parameters"] == READ
    assert offered["mcp__files__read"]["description"].endswith("Read a file")
    assert offered["mcp__files__bare"]["parameters"] == {"type": "object", "properties": {}}
    names = [t["function"]["name"] for t in server.requests[0]["tools"]]
    assert "mcp_call" in names and "mcp_tools" in names  # the generic ops stay

    called, not_offered, plain = reply.actions
    assert called == {"op": "mcp_call", "server": "files", "tool": "read",
                      "arguments": {"path": "a.md"}}
    assert not_offered["op"] == "mcp__off__read"  # a disabled server's: not an op at all
    assert isinstance(catalog.parse_action(not_offered), Rejected)
    assert plain == {"op": "write_file", "path": "b.md", "content": "x"}
    op = catalog.parse_action(called)
    assert isinstance(op, McpCall) and op.gate_op() == "mcp:files/read"
    denied = AgentSettings.model_validate({"permissions": {"default": "allow", "rules": [
        {"op": "mcp:files/read", "decision": "deny"}]}})
    assert gate.permission(op, denied)[0] == "deny"
    asked = AgentSettings.model_validate({"permissions": {"default": "allow", "rules": [
        {"op": "mcp:files/*", "decision": "ask"}]}})
    assert gate.permission(op, asked)[0] == "ask"


def test_the_offer_is_bounded_and_survives_a_hostile_tool_file(agent_dir: Path) -> None:
    many = [{"name": f"t{i:03d}", "input_schema": READ} for i in range(200)]
    mcp_functions.note_tools(agent_dir, "files", many)
    offer = mcp_functions.offer({"files": True}, agent_dir)
    assert len(offer.functions) == mcp_functions.MAX_FUNCTIONS
    assert offer.targets["mcp__files__t000"] == ("files", "t000")
    for junk in (b"\xff\x00", b"[1, 2]", b'{"files": "nope"}', b"[" * 100_000):
        (agent_dir / mcp_functions.TOOLS_FILE).write_bytes(junk)
        assert mcp_functions.offer({"files": True}, agent_dir).functions == []
    config_dir = agent_dir.parent.parent / "config"
    assert mcp_functions.installed(config_dir) == {"files": True, "off": False}
    newest = sorted((config_dir / "generations" / "mcp").glob("0*.json"))[-1]
    newest.write_text('{"version": 1, "registry": "mcp", "entries": [{"name": 5}]}')
    assert mcp_functions.installed(config_dir) == {}  # a generation it cannot read
