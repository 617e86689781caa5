"""Agent-managed registries under `.corral/config/`: pipelines, schedules, hooks,
MCP servers, each a full-state, seq-keyed config generation changed only by
its dedicated ops and read through store.py (docs/pipelines.md, "Registries";
docs/automation.md)."""
