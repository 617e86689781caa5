"""Rebuilding an agent's state: the newest snapshot generation plus the tail of
its stream read from the writer (`read_stream` from the generation's seq + 1,
served from the writer's per-stream index), folded. The cost is one small file
and at most `snapshot_every` events, whatever the length of the history.

Used by the agent at start-up, by the CLI (approve/deny/resume check what they
answer) and by `supervisor run` (progress, summary), so all of them see the
same state."""

from __future__ import annotations

import time
from dataclasses import dataclass

from actors.agent import generations
from actors.agent.state import AgentState, fold
from actors.writer_client import WriterClient
from broker.statedir import StateDir


def stream_of(name: str) -> str:
    return f"agent/{name}"


@dataclass(frozen=True)
class Rebuilt:
    state: AgentState
    from_generation: int  # the generation's seq, 0 when folded from the first event
    tail_events: int
    elapsed_ms: float


def tail(writer: WriterClient, name: str, state: AgentState, page: int = 512) -> AgentState:
    """`state` with every event of the stream after its last_seq folded in."""
    events = [(r.seq, r.event, r.payload())
              for r in writer.read_stream(stream_of(name), state.last_seq + 1, page)]
    return fold(state, events) if events else state


def rebuild(
    writer: WriterClient, state_dir: StateDir, name: str, *, use_generations: bool = True
) -> Rebuilt:
    started = time.monotonic()
    base = (generations.newest(state_dir.agent_dir(name)) if use_generations else None) \
        or AgentState()
    state = tail(writer, name, base, page=4096 if base.last_seq == 0 else 512)
    return Rebuilt(state, base.last_seq, state.counts.events - base.counts.events,
                   round((time.monotonic() - started) * 1000, 3))
