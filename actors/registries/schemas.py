"""The entry of each registry: one pydantic model per registry, strict and
closed. Every entry has a unique `name` within its registry.

`PipelineEntry` is complete (actors/pipelines). The other three are the minimal
shape the registry layer needs; the schedules, hooks and MCP work extends them
here (their fields are theirs to define), and the registry ops, the CLI and
the generations pick the changes up from `ENTRY_MODELS` without other edits.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EntryName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
RegistryName = Literal["pipelines", "schedules", "hooks", "mcp"]
REGISTRIES: tuple[RegistryName, ...] = ("pipelines", "schedules", "hooks", "mcp")


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: EntryName


class PipelineEntry(Entry):
    """An installed pipeline: its text (checked by actors/pipelines/dsl.py at
    install) and where it was installed from."""

    text: Annotated[str, Field(max_length=1 << 20)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    source: Annotated[str, Field(max_length=4096)] = ""
    description: Annotated[str, Field(max_length=4000)] = ""


class ScheduleEntry(Entry):
    """When to run what (minimal: the schedules work defines the rest)."""

    cron: Annotated[str, Field(min_length=1, max_length=256)]
    enabled: bool = True
    pipeline: EntryName | None = None
    task: Annotated[str, Field(max_length=4096)] | None = None
    inputs: dict[str, Annotated[str, Field(max_length=65536)]] = Field(default_factory=dict)
    missed: Literal["skip", "run_once"] = "skip"


class HookEntry(Entry):
    """What to do on a runtime event (minimal: the hooks work defines the rest)."""

    event: Annotated[str, Field(min_length=1, max_length=64)]
    command: Annotated[str, Field(max_length=4096)] | None = None
    url: Annotated[str, Field(max_length=4096)] | None = None


class McpEntry(Entry):
    """An MCP server (minimal: the MCP work defines the rest)."""

    transport: Literal["stdio"] = "stdio"
    command: Annotated[list[Annotated[str, Field(max_length=4096)]], Field(min_length=1,
                                                                          max_length=256)]
    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict)


ENTRY_MODELS: dict[RegistryName, type[Entry]] = {
    "pipelines": PipelineEntry, "schedules": ScheduleEntry, "hooks": HookEntry,
    "mcp": McpEntry,
}


def entry(registry: RegistryName, data: Any) -> Entry:
    """`data` as an entry of `registry` (raises pydantic's ValidationError)."""
    return ENTRY_MODELS[registry].model_validate(data)
