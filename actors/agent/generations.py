"""Snapshot generations of an agent's state: the on-disk format and its reader.

    .corral/agents/<name>/state/generations/gen-<seq, 20 digits>.json
    .corral/agents/<name>/state/snapshot.json        (a copy of the newest)

A generation is `{"version": 1, "agent": ..., "seq": N, "key": K, "state":
{...}}`: the fold of every event of the stream up to seq N, whose record has
the idempotency key K. Recovery uses a generation only if the WAL still holds
that record (seq N, key K) in the stream: a generation ahead of the WAL (a
head that went back) or from another history is skipped. Each is written to a temp file,
fsynced, renamed, and the directory fsynced. Both are derived: deleting them
loses nothing (recovery then folds from the first event, only slower). A
generation that does not parse is skipped for the next older one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from actors.agent.state import AgentState
from broker.durable import write_atomic

FORMAT_VERSION = 1
_PREFIX = "gen-"


def state_dir_of(agent_dir: Path) -> Path:
    return agent_dir / "state"


def generations_dir(agent_dir: Path) -> Path:
    return state_dir_of(agent_dir) / "generations"


@dataclass(frozen=True)
class Generation:
    state: AgentState
    key: str | None  # the idempotency key of the record at state.last_seq


def write(agent_dir: Path, agent: str, state: AgentState, keep: int = 3,
          key: str | None = None) -> Path:
    """Write a generation at state.last_seq (whose record has `key`), refresh
    snapshot.json, prune old ones."""
    gens = generations_dir(agent_dir)
    gens.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"version": FORMAT_VERSION, "agent": agent, "seq": state.last_seq,
                       "key": key, "state": state.model_dump(mode="json")},
                      separators=(",", ":")).encode()
    path = gens / f"{_PREFIX}{state.last_seq:020d}.json"
    write_atomic(path, body)
    write_atomic(state_dir_of(agent_dir) / "snapshot.json", body)
    for old in list_generations(agent_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_generations(agent_dir: Path) -> list[Path]:
    """Generation files, oldest first."""
    try:
        names = os.listdir(generations_dir(agent_dir))
    except FileNotFoundError:
        return []
    found = sorted(n for n in names if n.startswith(_PREFIX) and n.endswith(".json"))
    return [generations_dir(agent_dir) / n for n in found]


def read(path: Path) -> Generation | None:
    try:
        data = json.loads(path.read_bytes())
        if data.get("version") != FORMAT_VERSION:
            return None
        state = AgentState.model_validate(data["state"])
        key = data.get("key")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError):
        return None
    if state.last_seq != data.get("seq") or not (key is None or isinstance(key, str)):
        return None
    return Generation(state, key)


def candidates(agent_dir: Path) -> list[Generation]:
    """Readable generations, newest first."""
    out = []
    for path in reversed(list_generations(agent_dir)):
        gen = read(path)
        if gen is not None:
            out.append(gen)
    return out


def newest(agent_dir: Path, max_seq: int | None = None) -> AgentState | None:
    """The newest readable generation's state (at or below `max_seq` when given)."""
    for gen in candidates(agent_dir):
        if max_seq is None or gen.state.last_seq <= max_seq:
            return gen.state
    return None
