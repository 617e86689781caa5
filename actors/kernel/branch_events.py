"""How the fold takes the records of workspace trees, rewind and fork.

A rewind that cuts below what a state has folded raises
`BranchSwitchedError`. See docs/trees.md ("Rewind", "Fork").
"""

from __future__ import annotations

from typing import Any

from actors.kernel.state import AgentState
from broker.errors import CorralError

EVENTS = frozenset({"workspace_tree", "rewind", "session_fork"})


class BranchSwitchedError(CorralError):
    """A rewind abandons records this state has folded: rebuild from the WAL."""


def apply(state: AgentState, seq: int, event: str, p: dict[str, Any]) -> None:
    match event:
        case "workspace_tree":
            tree = p.get("tree")
            if isinstance(tree, str):
                state.tree = tree
        case "rewind":
            to_seq = p.get("to_seq")
            if not isinstance(to_seq, int) or to_seq < state.last_seq:
                raise BranchSwitchedError(
                    f"rewind at seq {seq} cuts to {to_seq!r}, below folded seq {state.last_seq}")
            state.branch = f"r{seq}:"
            tree = p.get("tree")
            if isinstance(tree, str):
                state.tree = tree
            for grant in p.get("grants") or []:
                if (isinstance(grant, list | tuple) and len(grant) == 2
                        and all(isinstance(x, str) for x in grant)):
                    pair = (grant[0], grant[1])
                    if pair not in state.grants:
                        state.grants.append(pair)
            state.grants.sort()
            if state.phase in ("finished", "closed"):
                state.phase = "running"
            state.exit_reason = None
            state.last_rewind = {"seq": seq, "to_seq": to_seq, "to_turn": p.get("to_turn"),
                                 "from_seq": p.get("from_seq")}
        case "session_fork":
            raw = p.get("state")
            if not isinstance(raw, dict) or state.counts.events:
                return  # only the first record of a stream can make it a fork
            parent = AgentState.model_validate(raw)
            for name in AgentState.model_fields:
                if name not in ("last_seq", "counts"):
                    setattr(state, name, getattr(parent, name))
            state.counts = parent.counts.model_copy()
            state.counts.events = 0
            state.forked_from = {k: p.get(k) for k in (
                "parent_agent", "parent_session", "point_seq", "point_turn", "source_digest")}
            session = p.get("session")  # the fork is a session of its own (docs/sessions.md)
            if isinstance(session, str) and len(session) == 26 and session.isalnum():
                state.session, state.session_no, state.session_seq = session, 1, seq
                source = p.get("parent_agent")
                state.parent_agent = source if isinstance(source, str) else None
        case _:
            return
