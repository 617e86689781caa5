"""Rebuilding an agent's state: the newest generation plus its stream's tail.

Shared by the agent, the CLI and `supervisor run`. See docs/agents.md
("State and generations").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from actors.kernel import generations
from actors.kernel.fold import fold
from actors.kernel.state import AgentState
from actors.sessions.purged import Purged, purged_of, visible
from actors.trees import branch
from actors.writer.client import WriterClient
from broker.statedir import StateDir


def stream_of(name: str) -> str:
    return f"agent/{name}"


@dataclass(frozen=True)
class Rebuilt:
    state: AgentState
    from_generation: int  # the generation's seq, 0 when folded from the first event
    tail_events: int
    elapsed_ms: float


def tail(writer: WriterClient, name: str, state: AgentState, page: int = 512,
         hidden: Sequence[Purged] = ()) -> AgentState:
    """`state` with every event of the stream after its last_seq folded in
    (the active branch: a rewind in the tail that cuts below the state's
    seq makes it a fold of the whole active branch from the first record;
    never the records of a purged session: `hidden`)."""
    events = [(r.seq, r.event, r.payload())
              for r in writer.read_stream(stream_of(name), state.last_seq + 1, page)
              if visible(r.seq, hidden)]
    if not events:
        return state
    active = branch.active_tail(events, state.last_seq)
    if active is None:
        return replay(writer, name, hidden)
    return fold(state, active)


def replay(writer: WriterClient, name: str, hidden: Sequence[Purged] = ()) -> AgentState:
    """The fold of the stream's active branch from its first record."""
    events = [(r.seq, r.event, r.payload()) for r in writer.read_stream(stream_of(name), 1, 4096)
              if visible(r.seq, hidden)]
    return fold(AgentState(), branch.active(events))


def _from_generation(writer: WriterClient, name: str, gen: generations.Generation,
                     hidden: Sequence[Purged]) -> AgentState | None:
    """gen's state plus the tail, if the WAL still holds gen's last record and a
    `generation_saved` fact with gen's digest; else None."""
    records = writer.read_stream(stream_of(name), gen.state.last_seq)
    first = next(records, None)
    if first is None or first.seq != gen.state.last_seq or (
            gen.key is not None and first.key != gen.key):
        return None  # the WAL does not hold this generation's history
    if gen.state.session is not None and any(p.session_id == gen.state.session
                                             for p in hidden):
        return None  # a purged session's state
    events = [(r.seq, r.event, r.payload()) for r in records if visible(r.seq, hidden)]
    if not any(generations.vouched(gen, event, payload) for _, event, payload in events):
        return None  # the WAL does not vouch for this file's content (forged or unsaved)
    active = branch.active_tail(events, gen.state.last_seq)
    if active is None:
        return None  # a rewind abandoned this generation's history
    return fold(gen.state, active)


def rebuild(
    writer: WriterClient, state_dir: StateDir, name: str, *, use_generations: bool = True
) -> Rebuilt:
    """The agent's state: the newest generation the WAL still holds, plus its tail."""
    started = time.monotonic()
    gens = generations.candidates(state_dir.agent_dir(name)) if use_generations else []
    hidden = purged_of(state_dir.root, stream_of(name))  # never folded (actors/sessions)
    for gen in gens:
        state = _from_generation(writer, name, gen, hidden)
        if state is not None:
            return Rebuilt(state, gen.state.last_seq,
                           state.counts.events - gen.state.counts.events,
                           round((time.monotonic() - started) * 1000, 3))
    state = replay(writer, name, hidden)
    return Rebuilt(state, 0, state.counts.events, round((time.monotonic() - started) * 1000, 3))
