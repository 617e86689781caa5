"""Snapshot generations of an agent's state: the on-disk format and its reader.

A generation is trusted only when the WAL holds its record (seq, key) and a
`generation_saved` fact with its digest. See docs/agents.md
("State and generations").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from actors.kernel.state import AgentState
from broker.durable import write_atomic

FORMAT_VERSION = 1
_PREFIX = "gen-"


def state_dir_of(agent_dir: Path) -> Path:
    return agent_dir / "state"


def generations_dir(agent_dir: Path) -> Path:
    return state_dir_of(agent_dir) / "generations"


SAVED_EVENT = "generation_saved"


@dataclass(frozen=True)
class Generation:
    state: AgentState
    key: str | None  # the idempotency key of the record at state.last_seq
    sha256: str = ""  # of the file's bytes: what a `generation_saved` fact must name


def saved_fact(seq: int, sha256: str) -> tuple[str, dict[str, object], str]:
    """(event, payload, idempotency key) of the fact that vouches for a generation."""
    return SAVED_EVENT, {"seq": seq, "sha256": sha256}, f"g{seq}:saved"


def vouched(gen: Generation, event: str, payload: object) -> bool:
    """Whether a record (`event`, `payload`) is the fact naming `gen`'s content."""
    return (event == SAVED_EVENT and isinstance(payload, dict)
            and payload.get("seq") == gen.state.last_seq and payload.get("sha256") == gen.sha256)


def write(agent_dir: Path, agent: str, state: AgentState, keep: int = 3,
          key: str | None = None) -> str:
    """Write a generation at state.last_seq (whose record has `key`), refresh
    snapshot.json, prune old ones; return the sha256 of its bytes (for the
    `generation_saved` fact the caller appends)."""
    gens = generations_dir(agent_dir)
    gens.mkdir(parents=True, exist_ok=True)
    body = encode(agent, state, key)
    path = gens / f"{_PREFIX}{state.last_seq:020d}.json"
    write_atomic(path, body)
    refresh_snapshot(path, state_dir_of(agent_dir) / "snapshot.json", body)
    for old in list_generations(agent_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return hashlib.sha256(body).hexdigest()


def encode(agent: str, state: AgentState, key: str | None) -> bytes:
    """A generation's bytes: the envelope around the state as pydantic's own
    JSON serializer writes it (in Rust: a sixth of `json.dumps(model_dump())`'s
    cost for an agent's state of 200 exchanges; `parse` reads either). A
    state it cannot write as UTF-8 (a lone surrogate, which no fact the WAL
    took can hold) is written by json, escaped."""
    envelope = {"version": FORMAT_VERSION, "agent": agent, "seq": state.last_seq, "key": key}
    try:
        inner = state.model_dump_json().encode()
    except PydanticSerializationError:
        return json.dumps({**envelope, "state": state.model_dump(mode="json")},
                          separators=(",", ":")).encode()
    head = json.dumps(envelope, separators=(",", ":")).encode()
    return b'%s,"state":%s}' % (head[:-1], inner)


def refresh_snapshot(generation: Path, snapshot: Path, body: bytes | None = None) -> None:
    """Point `snapshot.json` at the generation just written: a second name for
    the same file (a link made under a temporary name, then renamed over the
    old one), not a second copy written and fsynced. Derived like the
    generation (nothing reads it for recovery), so its name is not fsynced;
    where links cannot be made, a copy replaces it as before."""
    tmp = snapshot.with_name(f".{snapshot.name}.link")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.link(generation, tmp)
        os.replace(tmp, snapshot)
    except OSError:
        with contextlib.suppress(OSError):  # (a purge re-points it: actors/sessions/purge.py)
            write_atomic(snapshot, generation.read_bytes() if body is None else body)


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
        raw = path.read_bytes()
    except OSError:
        return None
    return parse(raw)


def parse(raw: bytes) -> Generation | None:
    """A generation from its file's bytes (None: not one); hostile bytes are
    refused, never raised (a generation from another host's upload is read too)."""
    try:
        data = json.loads(raw)
        if data.get("version") != FORMAT_VERSION:
            return None
        state = AgentState.model_validate(data["state"])
        key = data.get("key")
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError, RecursionError):
        return None
    if state.last_seq != data.get("seq") or not (key is None or isinstance(key, str)):
        return None
    return Generation(state, key, hashlib.sha256(raw).hexdigest())


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
