"""The entry model of each registry (`ENTRY_MODELS`), strict and closed.

See docs/registries.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from actors.registries.base import Entry
from actors.registries.entries import HookEntry, McpServerEntry, ScheduleEntry

EntryName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
RegistryName = Literal["pipelines", "schedules", "hooks", "mcp"]
REGISTRIES: tuple[RegistryName, ...] = ("pipelines", "schedules", "hooks", "mcp")


class PipelineEntry(Entry):
    """An installed pipeline: its text (checked by actors/pipelines/dsl.py at
    install) and where it was installed from."""

    name: EntryName
    text: Annotated[str, Field(max_length=1 << 20)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    source: Annotated[str, Field(max_length=4096)] = ""
    description: Annotated[str, Field(max_length=4000)] = ""


ENTRY_MODELS: dict[RegistryName, type[Entry]] = {
    "pipelines": PipelineEntry, "schedules": ScheduleEntry, "hooks": HookEntry,
    "mcp": McpServerEntry,
}


def entry(registry: RegistryName, data: Any) -> Entry:
    """`data` as an entry of `registry` (raises pydantic's ValidationError)."""
    return ENTRY_MODELS[registry].model_validate(data)
