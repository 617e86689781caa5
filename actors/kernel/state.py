"""An agent's state: the bounded model the fold (actors/kernel/fold.py)
builds from its stream. See docs/agents.md ("State and generations").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.kernel import pipeline_track

Phase = Literal["new", "running", "paused", "finished", "closed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Call(_Model):
    call_id: str
    index: int
    op: str | None = None
    verdict: str | None = None
    rule: str | None = None
    request: str | None = None
    started: bool = False
    effect: dict[str, Any] | None = None
    settled: bool = False
    status: str | None = None


class Approval(_Model):
    request: str
    call_id: str
    op: str
    pattern: str
    kind: str  # "permission" | "clarification"
    question: str | None = None
    status: Literal["pending", "approved", "denied", "answered"] = "pending"
    always: bool = False
    note: str | None = None


class PendingInput(_Model):
    """An operator input (clarification answer, correction) not yet in the
    model's history: pending, or consumed for model turn `consumed_turn` (the
    consumption fact is on disk; the turn is not yet). Text: its file only."""

    kind: Literal["answer", "correction"]
    ident: str  # the request ("req-3.0") or the correction ("k1")
    sha256: str
    chars: int
    file: str
    consumed_turn: int | None = None


class Compaction(_Model):
    """A compaction's reference: its summary lives in the agent's compaction file
    (actors/kernel/compaction.py), identified by `compaction` and `sha256`."""

    compaction: str  # "m<n>"
    items: int  # how many of the oldest exchanges of `recent` it replaces
    through_turn: int
    sha256: str
    chars: int
    tokens: int


class BudgetUse(_Model):
    tokens_used: int = 0
    cost_used: float = 0.0
    extra_tokens: int = 0
    extra_cost: float = 0.0


class Counts(_Model):
    events: int = 0
    tool_calls: int = 0
    tool_results: int = 0
    rejects: int = 0
    aborted: int = 0


class AgentState(_Model):
    session: str | None = None  # the session id (`session_started`); None before one
    session_no: int = 0  # 1 for the stream's first session, 2 for its second, ...
    session_seq: int = 0  # the seq of the session's `session_started`
    # the newest spec session id a run segment of this session went on under
    # (a spawn or start while it was open): never begun after it (lifecycle.py)
    spec_session: str | None = None
    parent_agent: str | None = None
    phase: Phase = "new"
    segment: int = 0
    turn: int = 0
    open_turn: int | None = None
    actions: list[Any] = Field(default_factory=list)  # the open turn's raw actions
    calls: dict[str, Call] = Field(default_factory=dict)  # the open turn's calls
    cursor: int = 0  # settled decisions: a scripted model's position
    model_calls: int = 0
    todos: list[dict[str, Any]] = Field(default_factory=list)
    budget: BudgetUse = Field(default_factory=BudgetUse)
    approvals: dict[str, Approval] = Field(default_factory=dict)
    grants: list[tuple[str, str]] = Field(default_factory=list)
    counts: Counts = Field(default_factory=Counts)
    last_op: str | None = None
    exit_reason: str | None = None
    recent: list[dict[str, Any]] = Field(default_factory=list)
    inputs: list[PendingInput] = Field(default_factory=list)  # actors/kernel/operator_input.py
    corrections: int = 0  # corrections recorded: the next one is k<corrections + 1>
    summary: Compaction | None = None  # the newest compaction in effect (its boundary folded)
    compaction_pending: Compaction | None = None  # recorded, boundary not yet: no effect
    compactions: int = 0  # compactions recorded: the next one is m<compactions + 1>
    last_seq: int = 0
    # workspace trees, rewind and fork (actors/trees, docs/trees.md)
    tree: str | None = None  # the newest workspace tree of the active branch
    branch: str = ""  # "" or "r<seq>:" after a rewind: prefixes idempotency keys
    last_rewind: dict[str, Any] | None = None
    forked_from: dict[str, Any] | None = None
    pipeline: pipeline_track.PipelineTrack | None = None  # a pipeline runner's progress

    # --- views ---------------------------------------------------------------
    def pending_approvals(self) -> list[Approval]:
        return [a for a in self.approvals.values() if a.status == "pending"]

    def grant_set(self) -> frozenset[tuple[str, str]]:
        return frozenset((op, pattern) for op, pattern in self.grants)

    def started_unsettled(self) -> list[Call]:
        return [c for c in self.calls.values() if c.started and not c.settled]


Event = tuple[int, str, Any]  # (seq, event type, payload)
