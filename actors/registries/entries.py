"""The entries of the schedules, hooks and MCP servers registries.

What an op accepts is exactly what the runtime runs. See docs/registries.md,
docs/automation.md and docs/mcp.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from croniter import croniter
from pydantic import Field, field_validator, model_validator

from actors.registries.base import Entry

# names appear in agent names (`<schedule>-<slot>`), stream keys and rule patterns
EntryName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,39}$")]
HOOK_EVENTS = ("approval_requested", "agent_finished", "child_gave_up", "budget_paused",
               "changeset_ready")
HookEvent = Literal["approval_requested", "agent_finished", "child_gave_up", "budget_paused",
                    "changeset_ready"]


_Entry = Entry  # actors/registries/base.py


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
    # who added it: `operator`, or the agent whose op did (set by the op from its
    # caller, never taken from the caller's entry); its runs get at most that
    # agent's grants and spend its budget. None: unknown, and nothing is spawned
    owner: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")] | None = None

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
