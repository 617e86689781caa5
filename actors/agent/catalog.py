"""The op catalogue: every module of ops the agent knows (`OP_MODULES`) and
`install`, which registers them where a process that runs or checks ops
starts. Importing a module of ops registers nothing. See docs/agents.md
("Adding an op").
"""

from __future__ import annotations

from types import ModuleType

from actors.agent import builtin_ops, mcp_ops
from actors.kernel import ops
from actors.kernel.ops import (
    handler_for,
    model_for,
    op_names,
    parse_action,
    tool_schemas,
)
from actors.pipelines import ops as pipeline_ops
from actors.procs import ops as procs_ops
from actors.registries import ops as registry_ops
from actors.subagents import ops as subagent_ops

OP_MODULES: tuple[ModuleType, ...] = (
    builtin_ops,  # the file, memory, ask, finish ops
    mcp_ops,  # mcp_tools, mcp_call (MCP servers via procs)
    pipeline_ops,  # pipeline_run
    procs_ops,  # bash, bash_*, terminal_*
    registry_ops,  # pipeline_install, schedule_*, hook_*, mcp_install, ...
    subagent_ops,  # spawn/changes/apply
)


def install() -> None:
    """Register every op of `OP_MODULES` and build the union's validator once
    (cheap to call again), so a zygote-forked agent inherits both."""
    for module in OP_MODULES:
        ops.install(module.OPS)
    ops.warm()


__all__ = ["OP_MODULES", "handler_for", "install", "model_for", "op_names", "parse_action",
           "tool_schemas"]
