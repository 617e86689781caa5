"""Rewind: a stopped session goes back to turn N, its workspace restored.

Nothing is deleted: a `rewind` record is appended after the workspace is
restored, under an intent `recover()` finishes or undoes. See docs/trees.md
("Rewind").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.kernel.fold import fold
from actors.kernel.settings import read_spec, workspace_for
from actors.kernel.state import AgentState
from actors.registries.store import restore_registries
from actors.sessions.purged import purged_of, visible
from actors.trees import branch, restore
from actors.trees.layout import capturer_for, fault, store_for
from actors.writer.client import WriterClient
from broker.durable import write_atomic
from broker.errors import CorralError
from broker.statedir import StateDir

INTENT_VERSION = 1


class RewindError(CorralError):
    """A rewind that cannot be done: no such turn or seq, a running session, ..."""


@dataclass(frozen=True)
class Rewound:
    to_seq: int
    to_turn: int | None
    tree: str | None
    removed: int
    written: int
    noop: bool = False


def intent_path(state_dir: StateDir, name: str) -> Path:
    return state_dir.agent_dir(name) / "rewind.json"


def read_events(writer: WriterClient, name: str, state_dir: StateDir | None = None
                ) -> list[branch.Event]:
    """The stream's records; with `state_dir`, without those of a purged
    session (docs/sessions.md, "Purge"): a rewind or fork by the agent's name
    never reaches one."""
    events = [(r.seq, r.event, r.payload()) for r in writer.read_stream(f"agent/{name}", 1, 4096)]
    if state_dir is None:
        return events
    hidden = purged_of(state_dir.root, f"agent/{name}")
    return [e for e in events if visible(e[0], hidden)] if hidden else events


def _newest_session_purged(writer: WriterClient, state_dir: StateDir, name: str) -> bool:
    """Whether the stream's newest session (its last start on the active
    branch of the whole stream) is purged, or being purged."""
    hidden = purged_of(state_dir.root, f"agent/{name}")
    if not hidden:
        return False
    starts = [seq for seq, event, payload in branch.active(read_events(writer, name))
              if branch.session_of(event, payload) is not None]
    return bool(starts) and not visible(starts[-1], hidden)


def state_at(events: list[branch.Event], seq: int) -> AgentState:
    """The fold of the active branch up to `seq`."""
    return fold(AgentState(), [e for e in branch.active(events) if e[0] <= seq])


def restore_config_generations(writer: WriterClient, state_dir: StateDir, name: str,
                               to_seq: int) -> None:
    """The registries under `.corral/config/` that the session's agent changed
    after `to_seq`, back to their generation at `to_seq`, each as a new
    generation (actors/registries/store.py; old ones stay). Idempotent: a
    registry already equal to its content at the cut is left alone, so a
    rewind retried after a crash writes nothing twice."""
    restore_registries(state_dir, writer, to_seq, changed_by=name, key_prefix=f"rewind:{name}")


def _workspace(state_dir: StateDir, name: str) -> Path:
    spec = read_spec(state_dir, name)
    if spec is None:
        raise RewindError(f"agent {name} has no spec in {state_dir.config_dir}")
    return workspace_for(state_dir, name, spec)


def rewind(writer: WriterClient, state_dir: StateDir, name: str, *,
           to_turn: int | None = None, to_seq: int | None = None) -> Rewound:
    if intent_path(state_dir, name).exists():
        recover(writer, state_dir, name)
    if _newest_session_purged(writer, state_dir, name):
        raise RewindError(f"agent {name}'s newest session is purged: nothing of it is "
                          f"rewound; `supervisor fork SESSION --name NEW` starts from an "
                          f"earlier one")
    events = read_events(writer, name, state_dir)
    active = branch.active(events)
    if not active:
        raise RewindError(f"agent {name} has no session")
    # a rewind moves within the current session (turns count from 1 in each);
    # an earlier session is reached by forking it (docs/trees.md)
    session_records = branch.session_events(events)
    if to_turn is not None:
        cut = branch.turn_point(session_records, to_turn)
        if cut is None:
            raise RewindError(f"agent {name} never reached turn {to_turn} on its current "
                              f"session's active branch")
    elif to_seq is not None:
        if to_seq not in {e[0] for e in branch.active(session_records)}:
            if to_seq in {e[0] for e in active}:
                raise RewindError(f"seq {to_seq} is in an earlier session of agent {name}: "
                                  f"a rewind stays in the current session; fork the "
                                  f"earlier one (`supervisor fork SESSION --name NEW`)")
            raise RewindError(f"seq {to_seq} is not a record of agent {name}'s active branch")
        cut = to_seq
    else:
        raise RewindError("give --to-turn N or --to-seq S")
    head_seq, head_event, head_payload = active[-1]
    target = branch.tree_at(events, cut)
    if cut == head_seq or branch.cut_of(head_event, head_payload) == cut:
        return Rewound(cut, to_turn, target, 0, 0, noop=True)
    grants = [list(g) for g in fold(AgentState(), active).grants]
    ws = _workspace(state_dir, name)
    store = store_for(state_dir, name)
    with store.lease():  # until the intent names what the capture stored
        current = capturer_for(state_dir, name, ws, store).capture().digest
        intent = {"version": INTENT_VERSION, "agent": name, "from_seq": head_seq, "to_seq": cut,
                  "to_turn": to_turn, "tree": target, "from_tree": current, "grants": grants}
        write_atomic(intent_path(state_dir, name), json.dumps(intent).encode())
    fault("rewind:after_intent")
    return _finish(writer, state_dir, name, intent, current)


def _finish(writer: WriterClient, state_dir: StateDir, name: str, intent: dict[str, Any],
            current: str) -> Rewound:
    ws = _workspace(state_dir, name)
    store = store_for(state_dir, name)
    done = restore.Restored(0, 0)
    if isinstance(intent["tree"], str):
        done = restore.restore(ws, store, current, intent["tree"],
                               capturer_for(state_dir, name, ws, store).guard)
    fault("rewind:after_restore")
    restore_config_generations(writer, state_dir, name, int(intent["to_seq"]))
    writer.append(f"agent/{name}", "rewind", {
        "to_seq": intent["to_seq"], "to_turn": intent["to_turn"], "from_seq": intent["from_seq"],
        "tree": intent["tree"], "from_tree": intent["from_tree"], "grants": intent["grants"],
    }, key=f"rewind:{name}:{intent['from_seq']}", origin="operator")
    fault("rewind:after_fact")
    intent_path(state_dir, name).unlink(missing_ok=True)
    return Rewound(int(intent["to_seq"]), intent["to_turn"], intent["tree"], done.removed,
                   done.written)


def recover(writer: WriterClient, state_dir: StateDir, name: str) -> str:
    """Finish or abandon the rewind an intent names; returns which ("done",
    "finished", "abandoned", "dropped": an unreadable intent, nothing switched)."""
    path = intent_path(state_dir, name)
    try:
        intent = json.loads(path.read_bytes())
        if intent.get("version") != INTENT_VERSION or intent.get("agent") != name:
            raise ValueError("foreign intent")  # noqa: TRY301
        from_seq, to_seq = int(intent["from_seq"]), int(intent["to_seq"])
        from_tree = intent["from_tree"]
    except (OSError, ValueError, TypeError, KeyError):
        path.unlink(missing_ok=True)  # written atomically: only a forged one is unreadable
        return "dropped"
    events = read_events(writer, name)
    if any(e[1] == "rewind" and isinstance(e[2], dict) and e[2].get("from_seq") == from_seq
           and e[2].get("to_seq") == to_seq for e in events):
        path.unlink(missing_ok=True)
        return "done"
    ws = _workspace(state_dir, name)
    store = store_for(state_dir, name)
    capturer = capturer_for(state_dir, name, ws, store)
    current = capturer.capture().digest
    active = branch.active(events)
    if active and active[-1][0] == from_seq:
        _finish(writer, state_dir, name, intent, current)
        return "finished"
    if isinstance(from_tree, str):
        restore.restore(ws, store, current, from_tree, capturer.guard)
    path.unlink(missing_ok=True)
    return "abandoned"
