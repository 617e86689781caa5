"""The op catalogue: importing this module registers every op the agent knows.

To add ops (background commands, terminals, subagents), write a module that
calls `actors.kernel.ops.register(Model, handler)` for each, and import it
below. Nothing else changes: the union, the gate, the tool schemas for
language models and the loop all read the registry.
"""

from __future__ import annotations

from actors.agent import (
    builtin_ops,  # noqa: F401 - registers the file, memory, ask, finish ops
    mcp_ops,  # noqa: F401 - mcp_tools, mcp_call (MCP servers via procs)
)
from actors.kernel.ops import (
    handler_for,
    model_for,
    op_names,
    parse_action,
    tool_schemas,
    warm,
)
from actors.pipelines import ops as pipeline_ops  # noqa: F401 - pipeline_run
from actors.procs import ops as procs_ops  # noqa: F401 - bash, bash_*, terminal_*
from actors.registries import ops as registry_ops  # noqa: F401 - pipeline_install, ...
from actors.subagents import ops as subagent_ops  # noqa: F401 - spawn/changes/apply

warm()  # build the union once here, so a zygote-forked agent inherits it

__all__ = ["handler_for", "model_for", "op_names", "parse_action", "tool_schemas", "warm"]
