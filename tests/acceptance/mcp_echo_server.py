"""A tiny stdio MCP server for tests/acceptance/test_automation.py, written the
way a user writes one with the `mcp` SDK (its FastMCP, named `MCPServer` in
mcp 2.x): one tool, `shout`, that upper-cases its text (docs/mcp.md)."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("echo")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def shout(text: str) -> str:
    """The text in capitals."""
    return f"{text.upper()}!"


if __name__ == "__main__":
    server.run()
