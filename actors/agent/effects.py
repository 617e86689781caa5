"""The effect journal: an agent's local note of each write it is about to
apply, so that a write is applied at most once even when the WAL loses the
records that said it was (a disk that lost an acknowledged tail; the soak test
cuts one on purpose).

    .corral/agents/<name>/effects/<call_id>@<session>.json
        {"call_id", "action_sha", "label", "before_sha", "after_sha", "result"}

Call ids (`turn.index`) start again in each session, so an entry is named by
its call id and its session (`<call_id>.json` for a stream written before
sessions existed): an entry is only ever matched in its own session, the
other sessions' entries go at the next prune (their calls are all settled),
and a purge of a session removes its entries (actors/sessions/purge.py).

Written (temp, rename; not fsynced) before the write is applied. When the loop is
about to apply a write for a call id whose entry names the same action and
target, and the target already has the entry's after-digest, the effect is
there: the loop records it and does not apply it again. Only the last
`KEEP_TURNS` turns' entries are kept (a lost tail is short; pruned every
`PRUNE_EVERY` turns), so the journal
does not grow with history. Derived and local: deleting it only removes this
protection.

Why no fsync (docs/performance.md, "The effect journal's fsync"): a crash
of processes keeps the page cache, so the entry is there for every WAL cut
that is not a power loss; after a power loss on a disk that honours fsync,
the WAL still holds `tool_start` (durable before the effect, with the
path and both digests) and recovery settles the call by the abort rule; on
a disk that lost an acknowledged WAL tail at a power loss, the entry's own
fsync went to the same lying disk after it, so it promised nothing more."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEEP_TURNS = 64


@dataclass(frozen=True)
class Entry:
    call_id: str
    action_sha: str
    label: str
    before_sha: str | None
    after_sha: str | None
    result: dict[str, Any]


def action_digest(action: Any) -> str:
    text = json.dumps(action, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_name(call_id: str, session: str | None) -> str:
    return f"{call_id}.json" if session is None else f"{call_id}@{session}.json"


def session_of_file(name: str) -> str | None:
    """The session an entry's file name carries (None: written before sessions)."""
    stem = name.removesuffix(".json").removesuffix(".tmp").removesuffix(".json")
    return stem.partition("@")[2] or None


PRUNE_EVERY = 8  # turns between two prunes in one session (a listing each)


class EffectJournal:
    def __init__(self, agent_dir: Path) -> None:
        self.dir = agent_dir / "effects"
        self._made = False  # the directory exists (made by this process)
        self._pruned: tuple[int, str | None] | None = None  # (turn, session) of the last prune

    def _path(self, call_id: str, session: str | None) -> Path:
        return self.dir / file_name(call_id, session)

    def get(self, call_id: str, session: str | None) -> Entry | None:
        try:
            data = json.loads(self._path(call_id, session).read_bytes())
            return Entry(**data)
        except (OSError, ValueError, TypeError):
            return None

    def record(self, entry: Entry, session: str | None) -> None:
        if not self._made:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._made = True
        name = file_name(entry.call_id, session)
        data = json.dumps(entry.__dict__, separators=(",", ":")).encode()
        try:
            self._write(name, data)
        except FileNotFoundError:  # the directory went away under us: make it again
            self.dir.mkdir(parents=True, exist_ok=True)
            self._write(name, data)

    def _write(self, name: str, data: bytes) -> None:
        tmp = os.path.join(self.dir, name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        # whole or absent for a reader; durable as the page cache is
        os.replace(tmp, os.path.join(self.dir, name))

    def prune(self, turn: int, session: str | None) -> None:
        """Drop entries of turns older than `turn - KEEP_TURNS`, and those of
        other sessions (never matched again: a session begins after the
        previous one is over). Within a session the directory is listed every
        `PRUNE_EVERY` turns (a few more entries may stay meanwhile)."""
        last = self._pruned
        if last is not None and last[1] == session and 0 <= turn - last[0] < PRUNE_EVERY:
            return
        self._pruned = (turn, session)
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return
        for name in names:
            head = name.split(".", 1)[0]
            old = head.isdigit() and int(head) < turn - KEEP_TURNS
            if old or session_of_file(name) != session:
                (self.dir / name).unlink(missing_ok=True)
