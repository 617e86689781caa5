"""The entries of the agent-managed registries that run at runtime: schedules,
hooks and MCP servers (`.corral/config/schedules.yaml`, `hooks.yaml`,
`mcp.yaml`), as strict pydantic models, and a bounded loader for each file.

The files are materialised from seq-keyed config generations by the registry
layer (actors/registries/store.py) and changed only by their ops; the
registry ops validate entries with these models (schemas.ENTRY_MODELS); this module only reads
what is there. A file that is missing is an empty registry; a file that does
not parse, or an entry that does not validate, is refused as a whole
(`RegistryError`, naming the file and the entry): the runtime keeps the last
good registry it read and logs why (the readers in supervisor/automation.py
and actors/procs/mcpbridge.py).

Accepted file shapes (the generation layer writes the first): a mapping with
the registry's key holding a list of entries (`schedules: [...]`), a bare
list, or a mapping of name -> entry (the name filled in).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from croniter import croniter
from pydantic import Field, ValidationError, field_validator, model_validator

from actors.registries.base import Entry

MAX_FILE_BYTES = 1024 * 1024
MAX_ENTRIES = 256
# names appear in agent names (`<schedule>-<slot>`), stream keys and rule patterns
EntryName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,39}$")]
HOOK_EVENTS = ("approval_requested", "agent_finished", "child_gave_up", "budget_paused",
               "changeset_ready")
HookEvent = Literal["approval_requested", "agent_finished", "child_gave_up", "budget_paused",
                    "changeset_ready"]


class RegistryError(ValueError):
    """A registry file that cannot be used; the message names file and entry."""


_Entry = Entry  # actors/registries/base.py


E = TypeVar("E", bound=_Entry)


class ScheduleEntry(_Entry):
    """Spawn an agent on a task, or run a pipeline, at cron-style times (UTC).

    `cron`: 5 fields (minute hour day month weekday) or 6 (a seconds field
    last, croniter's convention). `missed`: what happens to slots that passed
    while nothing ran them (the supervisor was down): `skip` records them as
    skipped; `run_once` runs one catch-up for all of them."""

    name: EntryName
    cron: Annotated[str, Field(min_length=9, max_length=200)]
    action: Literal["spawn", "pipeline"] = "spawn"
    task: Annotated[str, Field(min_length=2, max_length=4096)] | None = None
    backend: Literal["scripted", "openai"] = "scripted"
    model: Annotated[str, Field(max_length=256)] | None = None
    pipeline: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    inputs: dict[Annotated[str, Field(max_length=64)],
                 Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict,
                                                                 max_length=64)
    missed: Literal["skip", "run_once"] = "skip"
    enabled: bool = True

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        if len(value.split()) not in (5, 6) or not croniter.is_valid(value):
            raise ValueError(f"not a 5- or 6-field cron expression: {value!r}")
        return value

    @model_validator(mode="after")
    def _target(self) -> ScheduleEntry:
        if self.action == "spawn" and (self.task is None or not self.task.startswith("/")):
            raise ValueError("a spawn schedule needs `task`, the task file's absolute path")
        if self.action == "pipeline" and self.pipeline is None:
            raise ValueError("a pipeline schedule needs `pipeline`")
        return self


class HookEntry(_Entry):
    """On runtime events, run `command` in the sandbox or POST to `url`.

    `url` must be http(s) to a loopback host or to a host the operator's
    configuration allows (`automation.hook_allow_hosts`; checked at delivery,
    since this file is agent-managed)."""

    name: EntryName
    on: Annotated[list[HookEvent], Field(min_length=1, max_length=len(HOOK_EVENTS))]
    command: Annotated[str, Field(min_length=1, max_length=8192)] | None = None
    url: Annotated[str, Field(pattern=r"^https?://[^\s]{1,2000}$")] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 10.0  # one attempt
    retries: Annotated[int, Field(ge=0, le=10)] = 3
    backoff_s: Annotated[float, Field(ge=0, le=30)] = 0.5  # doubled per retry, capped at 30 s
    enabled: bool = True

    @model_validator(mode="after")
    def _one_target(self) -> HookEntry:
        if (self.command is None) == (self.url is None):
            raise ValueError("a hook has exactly one of `command` and `url`")
        return self


class McpServerEntry(_Entry):
    """A stdio MCP server: `command` (argv) run by procs in the calling agent's
    sandbox, one instance per agent session."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,31}$")]
    command: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]],
                       Field(min_length=1, max_length=64)]
    env: dict[Annotated[str, Field(pattern=r"^[A-Z_][A-Z0-9_]{0,63}$")],
              Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict,
                                                              max_length=32)
    call_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    enabled: bool = True


def _entries(path: Path, key: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RegistryError(f"{path.name}: cannot read: {exc.strerror}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise RegistryError(f"{path.name}: larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path.name}: not YAML: {str(exc)[:200]}") from exc
    if doc is None:
        return []
    if isinstance(doc, dict) and set(doc) == {key}:
        doc = doc[key] or []
    if isinstance(doc, dict):
        items: list[Any] = []
        for name, body in doc.items():
            if not isinstance(body, dict):
                raise RegistryError(f"{path.name}: {str(name)[:64]}: not a mapping")
            items.append({"name": name, **body})
        doc = items
    if not isinstance(doc, list):
        raise RegistryError(f"{path.name}: expected a list of entries under {key!r}")
    if len(doc) > MAX_ENTRIES:
        raise RegistryError(f"{path.name}: more than {MAX_ENTRIES} entries")
    for i, item in enumerate(doc):
        if not isinstance(item, dict):
            raise RegistryError(f"{path.name}: {key}[{i}]: not a mapping")
        if True in item and "on" not in item:  # YAML 1.1 reads a bare `on:` key as true
            item["on"] = item.pop(True)
    return doc


def _load(path: Path, key: str, model: type[E]) -> dict[str, E]:
    out: dict[str, E] = {}
    for i, item in enumerate(_entries(path, key)):
        label = re.sub(r"[^\w.\-]", "?", str(item.get("name", i)))[:64]
        try:
            entry = model.model_validate(item)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "entry"
            raise RegistryError(f"{path.name}: {key}[{label}]: {where}: {first['msg']}"[:500]
                                ) from None
        if entry.name in out:
            raise RegistryError(f"{path.name}: {key}[{label}]: name used twice")
        out[entry.name] = entry
    return out


def load_schedules(config_dir: Path) -> dict[str, ScheduleEntry]:
    return _load(config_dir / "schedules.yaml", "schedules", ScheduleEntry)


def load_hooks(config_dir: Path) -> dict[str, HookEntry]:
    return _load(config_dir / "hooks.yaml", "hooks", HookEntry)


def load_mcp(config_dir: Path) -> dict[str, McpServerEntry]:
    return _load(config_dir / "mcp.yaml", "mcp", McpServerEntry)
