"""MCP tools offered to a function-calling model as functions of their own.

A call of `mcp__<server>__<tool>` becomes an `mcp_call` action.
See docs/mcp.md ("Typed tools for the openai backend").
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

TOOLS_FILE = "mcp-tools.json"
PREFIX = "mcp__"
MAX_FUNCTIONS = 64
MAX_SCHEMA_BYTES = 8 * 1024
MAX_DESCRIPTION = 512
MAX_TOOLS_PER_SERVER = 256
MAX_FILE_BYTES = 4 * 1024 * 1024
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class Offer:
    """The functions to add to a request, and what each one calls."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    targets: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (server, tool)


def read_tools(agent_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The noted tool lists by server; {} when there is none or it is malformed."""
    try:
        with open(agent_dir / TOOLS_FILE, "rb") as f:
            data = json.loads(f.read(MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES])
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: [t for t in v if isinstance(t, dict)] for k, v in data.items()
            if isinstance(k, str) and isinstance(v, list)}


def note_tools(agent_dir: Path, server: str, tools: list[dict[str, Any]]) -> None:
    """Record `server`'s tool list (what `offer` reads); unchanged: no write."""
    kept = [{"name": t.get("name"), "description": str(t.get("description") or "")
             [:MAX_DESCRIPTION], "input_schema": t.get("input_schema")}
            for t in tools[:MAX_TOOLS_PER_SERVER]
            if isinstance(t, dict) and isinstance(t.get("name"), str)]
    noted = read_tools(agent_dir)
    if noted.get(server) == kept:
        return
    noted[server] = kept
    text = json.dumps(noted, separators=(",", ":"))
    if len(text) > MAX_FILE_BYTES:  # too much to offer anyway: keep only this server's
        text = json.dumps({server: kept}, separators=(",", ":"))[:MAX_FILE_BYTES]
    agent_dir.mkdir(parents=True, exist_ok=True)
    path = agent_dir / TOOLS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _schema(value: Any) -> dict[str, Any] | None:
    """The tool's input schema when it may be offered, else None."""
    schema = {"type": "object", "properties": {}} if value is None else value
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return None
    try:
        if len(json.dumps(schema, separators=(",", ":"))) > MAX_SCHEMA_BYTES:
            return None
        jsonschema.Draft202012Validator.check_schema(schema)
    except (jsonschema.SchemaError, RecursionError, TypeError, ValueError):
        return None
    return schema


def offer(servers: dict[str, bool], agent_dir: Path) -> Offer:
    """The functions for the enabled servers of `servers` (name -> enabled)
    whose tools the agent has listed."""
    out = Offer()
    noted = read_tools(agent_dir)
    for server in sorted(s for s, enabled in servers.items() if enabled):
        for tool in sorted(noted.get(server, []), key=lambda t: str(t.get("name"))):
            name = f"{PREFIX}{server}__{tool.get('name')}"
            if len(out.functions) >= MAX_FUNCTIONS:
                return out
            schema = _schema(tool.get("input_schema"))
            if (not FUNCTION_NAME.match(name) or name in out.targets or schema is None):
                continue
            description = str(tool.get("description") or "")[:MAX_DESCRIPTION]
            out.functions.append({"type": "function", "function": {
                "name": name,
                "description": f"MCP tool {tool['name']} of server {server}"
                               + (f": {description}" if description else ""),
                "parameters": schema}})
            out.targets[name] = (server, str(tool["name"]))
    return out


def installed(config_dir: Path) -> dict[str, bool]:
    """The installed MCP servers (name -> enabled), from the newest generation of
    the `mcp` registry of the state directory whose `config/` is `config_dir`;
    {} when it cannot be read."""
    from actors.registries import store  # noqa: PLC0415 - the registries import the ops
    from broker.statedir import StateDir  # noqa: PLC0415

    try:
        servers = store.load_mcp(StateDir(config_dir.parent))
    except store.RegistryError:
        return {}
    return {name: e.enabled for name, e in servers.items()}


def to_action(action: Any, targets: dict[str, tuple[str, str]]) -> Any:
    """A call of an offered function as the `mcp_call` action; anything else as is."""
    if not isinstance(action, dict) or action.get("op") not in targets:
        return action
    server, tool = targets[action["op"]]
    if action.get("arguments_not_an_object"):
        return {"op": "mcp_call", "server": server, "tool": tool, "arguments": None}
    return {"op": "mcp_call", "server": server, "tool": tool,
            "arguments": {k: v for k, v in action.items() if k != "op"}}
