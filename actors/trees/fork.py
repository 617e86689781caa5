"""Fork: a new agent whose session starts as another's after turn N.

    supervisor fork SOURCE --name NEW [--at-turn N]

See docs/trees.md ("Fork").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from actors.kernel import compaction
from actors.kernel.settings import read_spec, spec_path, write_spec
from actors.sessions.ids import new_session_id
from actors.trees import branch, restore, tree
from actors.trees.layout import fault, store_for
from actors.trees.rewind import RewindError, read_events, state_at
from actors.writer.client import WriterClient
from broker.durable import fsync_dir, write_atomic
from broker.statedir import StateDir, check_actor_name

INTENT_VERSION = 1


class ForkError(RewindError):
    """A fork that cannot be done (the name is taken, no such turn, the source changed)."""


@dataclass(frozen=True)
class Forked:
    name: str
    point_seq: int
    point_turn: int
    tree: str | None
    files: int


def intent_path(state_dir: StateDir, new: str) -> Path:
    return state_dir.root / "trees" / "forks" / f"{new}.json"


def _staging(state_dir: StateDir, new: str) -> Path:
    return state_dir.root / "agents" / f".fork-{new}.tmp"


def _digest(state: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def _cleanup(state_dir: StateDir, new: str) -> None:
    shutil.rmtree(state_dir.memory_dir / new, ignore_errors=True)
    shutil.rmtree(_staging(state_dir, new), ignore_errors=True)
    shutil.rmtree(state_dir.agent_dir(new), ignore_errors=True)
    spec_path(state_dir, new).unlink(missing_ok=True)


def _published(writer: WriterClient, new: str) -> bool:
    first = next(iter(writer.read_stream(f"agent/{new}", 1, 1)), None)
    return first is not None and first.event == branch.FORK


def recover(writer: WriterClient, state_dir: StateDir, new: str) -> str:
    """"done" (published: intent removed) or "cleaned" (leftovers removed)."""
    if _published(writer, new):
        intent_path(state_dir, new).unlink(missing_ok=True)
        return "done"
    _cleanup(state_dir, new)
    intent_path(state_dir, new).unlink(missing_ok=True)
    return "cleaned"


def _point(source_events: list[branch.Event], at_turn: int | None, session: str | None
           ) -> tuple[int, int]:
    """The cut in the source's session `session` (its newest when None): after
    turn `at_turn`, or at the session's last record."""
    if not branch.active(source_events):
        raise ForkError("the source has no session")
    try:
        own = branch.session_events(source_events, session)
    except branch.SessionNotFoundError:
        raise ForkError(f"the source has no session {session} on its active branch") from None
    active = branch.active(own)
    if not active:
        raise ForkError("the source's session has no record")
    turn = at_turn if at_turn is not None else state_at(source_events, active[-1][0]).turn
    cut = branch.turn_point(own, turn)
    if cut is None:
        raise ForkError(f"the source's session never reached turn {turn} on its active branch")
    return cut, turn


def fork(writer: WriterClient, state_dir: StateDir, source: str, new: str, *,
         at_turn: int | None = None, session: str | None = None) -> Forked:
    """Fork `source`'s session `session` (its newest when None) after turn
    `at_turn` (its last turn when None) as the new agent `new`."""
    check_actor_name(new)
    if intent_path(state_dir, new).exists():
        recover(writer, state_dir, new)
    if next(iter(writer.read_stream(f"agent/{new}", 1, 1)), None) is not None:
        raise ForkError(f"agent {new} already has a session")
    if state_dir.agent_dir(new).exists() or spec_path(state_dir, new).exists():
        raise ForkError(f"agent {new} already exists in {state_dir.root}")
    spec = read_spec(state_dir, source)
    if spec is None:
        raise ForkError(f"agent {source} has no spec")
    events = read_events(writer, source, state_dir)
    cut, turn = _point(events, at_turn, session)
    state = state_at(events, cut)
    if state.phase in ("finished", "closed"):
        state.phase, state.exit_reason = "running", None
    dumped = state.model_dump(mode="json")
    source_digest = _digest(dumped)
    target = branch.tree_at(events, cut)
    intent_path(state_dir, new).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(intent_path(state_dir, new), json.dumps({
        "version": INTENT_VERSION, "source": source, "new": new, "point_seq": cut}).encode())
    fault("fork:after_intent")
    try:
        store = store_for(state_dir)
        staging = _staging(state_dir, new)
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "workspace").mkdir(parents=True)
        files = 0
        if target is not None:
            files = restore.restore(staging / "workspace", store, None, target).written
        # the context's summaries live in the agent's compaction file: the fork's
        # state names its parent's, so their lines go with it
        compaction.copy_for(state, state_dir.agent_dir(source), staging)
        fault("fork:after_workspace")
        # verify the source again: its state at the cut and the tree's objects
        again = read_events(writer, source, state_dir)
        if _digest(state_at(again, cut).model_dump(mode="json") | {
                k: dumped[k] for k in ("phase", "exit_reason")}) != source_digest:
            raise ForkError(f"agent {source} changed at seq {cut} while forking")  # noqa: TRY301
        if target is not None:
            for entry in tree.flatten(store.get, target).values():
                store.get(entry.digest)
        staging.rename(state_dir.agent_dir(new))
        fsync_dir(state_dir.root / "agents")
        memory = state_dir.memory_dir / source
        if memory.is_dir():  # persist tier: the parent's memory as it is now (never reverted)
            shutil.copytree(memory, state_dir.memory_dir / new, symlinks=True)
        write_spec(state_dir, new, spec.model_copy(update={"workspace": None, "session": None}))
        fault("fork:before_fact")
        writer.append(f"agent/{new}", branch.FORK, {
            "parent_agent": source, "parent_session": state.session,
            "session": new_session_id(), "point_seq": cut,
            "point_turn": turn, "source_digest": source_digest, "tree": target,
            "state": dumped,
        }, key=f"fork:{new}", origin="operator")
    except BaseException:
        with contextlib.suppress(Exception):
            if not _published(writer, new):
                _cleanup(state_dir, new)
                intent_path(state_dir, new).unlink(missing_ok=True)
        raise
    fault("fork:after_fact")
    intent_path(state_dir, new).unlink(missing_ok=True)
    return Forked(new, cut, turn, target, files)
