"""Agent-managed registries under `.corral/config/`: pipelines, schedules, hooks,
MCP servers, each a full-state, seq-keyed config generation changed only by
its dedicated ops (docs/registries.md)."""
