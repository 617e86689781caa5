"""What a model backend gives the loop: a `Reply` (raw actions, optional text,
token `Usage`), behind the one `Backend` interface. The backends themselves
are actors/agent/backends.py, actors/agent/openai_backend.py and the pipeline
runner's actors/pipelines/backend.py (docs/agents.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.kernel.operator_input import Delivered
from actors.kernel.state import AgentState


@dataclass(frozen=True)
class Usage:
    tokens_in: int = 0
    tokens_out: int = 0
    cost_units: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "cost_units": round(self.cost_units, 6)}


@dataclass(frozen=True)
class Reply:
    actions: list[Any] = field(default_factory=list)
    text: str | None = None
    usage: Usage = Usage()
    meta: list[Any] | None = None  # a pipeline runner's step of each action (recorded)


class Backend(Protocol):
    name: str

    def next_reply(self, state: AgentState, inputs: Sequence[Delivered] = ()) -> Reply: ...
