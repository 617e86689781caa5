"""The `run:` section of the configuration: what `supervisor run` does.

See docs/agents.md ("Commands").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class AutoAnswer(_Strict):
    """Answer a pending request whose op and pattern match (fnmatch) like this."""

    op: str = "*"
    pattern: str = "*"
    decision: Literal["approve", "deny"] = "approve"
    always: bool = False
    note: str | None = None


class RunSettings(_Strict):
    agents: Annotated[int, Field(ge=1, le=1000)] = 8
    # Task files, relative to the configuration file's directory; agent i plays
    # tasks[i % len(tasks)]. Empty: every *.yaml of config/tasks/.
    tasks: list[str] = Field(default_factory=list)
    backend: Literal["scripted", "replay", "openai"] = "scripted"
    answers: list[AutoAnswer] = Field(default_factory=list)
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    refresh_s: Annotated[float, Field(gt=0)] = 0.25
