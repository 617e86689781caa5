"""Agent-managed registries under `.corral/config/`: pipelines, schedules, hooks, MCP.

Each is a seq-keyed config generation changed only by its ops.
See docs/registries.md.
"""
