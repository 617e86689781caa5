"""The active branch of an agent's stream: what the fold follows after rewinds.

Pure functions over (seq, event, payload). See docs/trees.md
("The active branch").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REWIND = "rewind"
FORK = "session_fork"
SESSION_STARTED = "session_started"
Event = tuple[int, str, Any]


class SessionNotFoundError(LookupError):
    """The stream has no session of that id on its active branch."""


def session_of(event: str, payload: Any) -> str | None:
    """The session id a record begins (`session_started`, or a fork's first
    record), else None."""
    if event not in (SESSION_STARTED, FORK) or not isinstance(payload, dict):
        return None
    session = payload.get("session")
    return session if isinstance(session, str) else None


def session_events(events: Sequence[Event], session: str | None = None) -> list[Event]:
    """The records of one session of the stream: from the record that began
    it to the next session's start on the active branch (the newest session
    when `session` is None; the whole stream when it has no session records,
    as one written before sessions existed). Turn numbers start again in each
    session, so a turn is looked up in its session's records, never across."""
    starts = [(seq, sid) for seq, event, payload in active(events)
              if (sid := session_of(event, payload)) is not None]
    if not starts:
        if session is not None:
            raise SessionNotFoundError(session)
        return list(events)
    index = len(starts) - 1 if session is None else next(
        (i for i, (_, sid) in enumerate(starts) if sid == session), -1)
    if index < 0:
        raise SessionNotFoundError(session)
    first = starts[index][0]
    end = starts[index + 1][0] if index + 1 < len(starts) else None
    return [ev for ev in events if ev[0] >= first and (end is None or ev[0] < end)]


def cut_of(event: str, payload: Any) -> int | None:
    """The seq a rewind record cuts back to (None for any other record)."""
    if event != REWIND or not isinstance(payload, dict):
        return None
    to_seq = payload.get("to_seq")
    return to_seq if isinstance(to_seq, int) and not isinstance(to_seq, bool) else None


def active(events: Iterable[Event]) -> list[Event]:
    out: list[Event] = []
    for ev in events:
        cut = cut_of(ev[1], ev[2])
        if cut is not None:
            while out and out[-1][0] > cut:
                out.pop()
        out.append(ev)
    return out


def active_tail(events: Sequence[Event], base_seq: int) -> list[Event] | None:
    for seq, event, payload in events:
        cut = cut_of(event, payload)
        if cut is not None and cut < base_seq and seq > base_seq:
            return None
    return active([(s, e, p) for s, e, p in events if s > base_seq]) if events else []


def abandoned(events: Sequence[Event]) -> set[int]:
    """The seqs of records no longer on the active branch."""
    keep = {ev[0] for ev in active(events)}
    return {ev[0] for ev in events if ev[0] not in keep}


def turn_point(events: Sequence[Event], turn: int) -> int | None:
    """The seq to cut at so that turns 1..`turn` stay and the session goes on
    with turn+1: the last active record before the `turn` record of turn+1,
    less the session's end records right before it (so a finished session
    resumes). None when the branch never reached that turn."""
    kept: list[tuple[int, str]] = []
    current = 0
    for seq, event, payload in active(events):
        if event == "turn" and isinstance(payload, dict):
            number = payload.get("turn")
            current = number if isinstance(number, int) else current + 1
            if current > turn:
                break
        if event == FORK and isinstance(payload, dict):
            state = payload.get("state")
            if isinstance(state, dict) and isinstance(state.get("turn"), int):
                current = state["turn"]
        kept.append((seq, event))
    if current < turn:
        return None
    while kept and kept[-1][1] in ("session_exit", "generation_saved"):
        kept.pop()
    return kept[-1][0] if kept else None


def tree_at(events: Sequence[Event], seq: int) -> str | None:
    """The workspace tree of the active branch as of `seq` (the newest
    `workspace_tree` record at or before it; a fork's first record names one)."""
    found: str | None = None
    for s, event, payload in active(events):
        if s > seq:
            break
        if event in ("workspace_tree", FORK) and isinstance(payload, dict):
            tree = payload.get("tree")
            if isinstance(tree, str):
                found = tree
    return found
