"""The registry ops: the only way an agent changes `.corral/config/<registry>`.

`replay_safe` under the key `cfg:<agent>:<call>`. See docs/registries.md
("The ops").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from actors.changesets import confined
from actors.kernel import workspace
from actors.kernel.ops import Done, OpBase, OpContext, OpSpec, Outcome
from actors.pipelines import dsl
from actors.registries import entries, schemas, store
from broker.errors import ConfigError, CorralError

Name = schemas.EntryName


class PipelineInstall(OpBase):
    """Install (or replace) a pipeline from a YAML file of the workspace."""

    op: Literal["pipeline_install"] = "pipeline_install"
    path: str
    name: Name | None = None  # default: the pipeline's own `name`
    path_field: ClassVar[str | None] = "path"
    replay_safe: ClassVar[bool] = True


class PipelineRemove(OpBase):
    """Remove an installed pipeline."""

    op: Literal["pipeline_remove"] = "pipeline_remove"
    name: Name
    replay_safe: ClassVar[bool] = True


class ScheduleAdd(OpBase):
    """Add (or replace) a schedule."""

    op: Literal["schedule_add"] = "schedule_add"
    entry: entries.ScheduleEntry
    replay_safe: ClassVar[bool] = True


class ScheduleRemove(OpBase):
    """Remove a schedule."""

    op: Literal["schedule_remove"] = "schedule_remove"
    name: Name
    replay_safe: ClassVar[bool] = True


class ScheduleEnable(OpBase):
    """Enable or disable a schedule."""

    op: Literal["schedule_enable"] = "schedule_enable"
    name: Name
    enabled: bool = True
    replay_safe: ClassVar[bool] = True


class HookAdd(OpBase):
    """Add (or replace) a hook."""

    op: Literal["hook_add"] = "hook_add"
    entry: entries.HookEntry
    replay_safe: ClassVar[bool] = True


class HookRemove(OpBase):
    """Remove a hook."""

    op: Literal["hook_remove"] = "hook_remove"
    name: Name
    replay_safe: ClassVar[bool] = True


class McpInstall(OpBase):
    """Install (or replace) an MCP server."""

    op: Literal["mcp_install"] = "mcp_install"
    entry: entries.McpServerEntry
    replay_safe: ClassVar[bool] = True


class McpRemove(OpBase):
    """Remove an MCP server."""

    op: Literal["mcp_remove"] = "mcp_remove"
    name: Name
    replay_safe: ClassVar[bool] = True


REGISTRY_OF: dict[str, schemas.RegistryName] = {
    "pipeline_install": "pipelines", "pipeline_remove": "pipelines",
    "schedule_add": "schedules", "schedule_remove": "schedules",
    "schedule_enable": "schedules", "hook_add": "hooks", "hook_remove": "hooks",
    "mcp_install": "mcp", "mcp_remove": "mcp",
}
Entries = list[dict[str, Any]]


def put(item: dict[str, Any]) -> Callable[[Entries], Entries]:
    def change(entries: Entries) -> Entries:
        return [e for e in entries if e["name"] != item["name"]] + [item]
    return change


def drop(registry: str, name: str) -> Callable[[Entries], Entries]:
    def change(entries: Entries) -> Entries:
        if not any(e["name"] == name for e in entries):
            raise store.RegistryError(f"{registry} has no entry {name!r}")
        return [e for e in entries if e["name"] != name]
    return change


def enable(name: str, enabled: bool) -> Callable[[Entries], Entries]:
    def change(entries: Entries) -> Entries:
        if not any(e["name"] == name for e in entries):
            raise store.RegistryError(f"schedules has no entry {name!r}")
        return [{**e, "enabled": enabled} if e["name"] == name else e for e in entries]
    return change


def pipeline_entry(text: str, source: str, name: str | None) -> dict[str, Any]:
    """A pipelines entry for `text` (raises dsl.PipelineError when it is refused)."""
    pipeline = dsl.parse(text, source)
    return {"name": name or pipeline.name, "text": text, "source": source,
            "description": pipeline.description,
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def change_for(op: OpBase, read_pipeline: Callable[[str], tuple[str, str]], actor: str
               ) -> Callable[[Entries], Entries]:
    """The change an op made by `actor` makes; `read_pipeline(path)` gives (text,
    source). A schedule's `owner` is `actor`, whatever the entry said."""
    match op:
        case PipelineInstall():
            text, source = read_pipeline(op.path)
            return put(pipeline_entry(text, source, op.name))
        case ScheduleAdd():
            return put({**op.entry.model_dump(), "owner": actor})
        case HookAdd() | McpInstall():
            return put(op.entry.model_dump())
        case ScheduleEnable():
            return enable(op.name, op.enabled)
        case PipelineRemove() | ScheduleRemove() | HookRemove() | McpRemove():
            return drop(REGISTRY_OF[op.op], op.name)
    raise store.RegistryError(f"{op.op} is not a registry op")


def apply(op: OpBase, state_dir: Any, writer: Any, *, key: str, actor: str,
          read_pipeline: Callable[[str], tuple[str, str]]) -> dict[str, Any]:
    """Run a registry op: one generation; the result a caller reports."""
    registry = REGISTRY_OF[op.op]
    gen, new = store.commit(state_dir, writer, registry, change_for(op, read_pipeline, actor),
                            key=key, op=op.op, actor=actor)
    return {"registry": registry, "generation_seq": gen.seq, "entries": gen.names(),
            "changed": new}


def handle(op: OpBase, ctx: OpContext) -> Outcome:
    if ctx.writer is None:
        return Done({"error": "no writer to record the generation"}, ok=False)

    def read_pipeline(path: str) -> tuple[str, str]:
        where = workspace.place(ctx.workspace, path, workspace.guard_for(ctx.state_dir))
        try:
            data = workspace.read_bytes(where, limit=1 << 20)
        except confined.UnsafeFileError as exc:
            raise store.RegistryError(exc.reason) from exc
        if data is None:
            raise store.RegistryError(f"no such file: {path}")
        return data.decode("utf-8", errors="replace"), f"{ctx.agent}:{path}"

    try:
        result = apply(op, ctx.state_dir, ctx.writer, key=f"cfg:{ctx.agent}:{ctx.call_id}",
                       actor=ctx.agent, read_pipeline=read_pipeline)
    except (ConfigError, store.RegistryError) as exc:
        return Done({"error": str(exc)[:2000]}, ok=False)
    except CorralError:
        raise
    return Done(result)


OPS = tuple(OpSpec(model, handle) for model in (
    PipelineInstall, PipelineRemove, ScheduleAdd, ScheduleRemove, ScheduleEnable,
    HookAdd, HookRemove, McpInstall, McpRemove))
