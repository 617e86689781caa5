"""The procs registry: one small JSON file naming every job procs started and
has not yet forgotten (`<state>/procs/registry.json`, version 1).

It is written (temp file, fsync, rename, fsync of the directory) after a
job's fork and *before* its start gate opens, and again when a job changes
state; so after a crash of procs every process it may have started is named
here with its pid and start time (pid reuse is told apart), its log and its
exit file. The restarted procs re-attaches live commands, finishes the ended
ones from their exit files, and reports the rest (and every terminal: a PTY
master does not survive its holder) lost. Entries leave with `session_end`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from broker.durable import write_atomic
from broker.statedir import StateDir

VERSION = 1
JobKind = Literal["command", "terminal"]
JobState = Literal["running", "exited", "killed", "capped", "expired", "lost"]


def registry_path(state: StateDir) -> Path:
    return state.root / "procs" / "registry.json"


@dataclass
class Entry:
    """What must survive a crash of procs to re-attach or account for a job."""

    proc_id: str
    kind: JobKind
    session: str
    pid: int
    start_ticks: int
    log_path: str
    exit_path: str | None  # commands: the wrapper writes the exit status here
    cap_bytes: int
    deadline_wall: float  # time.time() when the lifetime expires
    state: JobState = "running"
    exit_code: int | None = None
    kill_reason: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


KEEP_ENDED = 256  # ended jobs the registry file keeps (the newest)


class Registry:
    """The entries in memory; `save()` makes them durable when dirty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Entry] = {}
        self.dirty = False
        self.saves = 0

    @classmethod
    def load(cls, path: Path) -> Registry:
        registry = cls(path)
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            return registry
        if raw.get("version") != VERSION:
            raise ValueError(f"{path}: registry version {raw.get('version')!r}, expected {VERSION}")
        for item in raw["entries"]:
            entry = Entry(**item)
            registry.entries[entry.proc_id] = entry
        return registry

    def put(self, entry: Entry) -> None:
        self.entries[entry.proc_id] = entry
        self.dirty = True

    def drop(self, proc_id: str) -> None:
        if self.entries.pop(proc_id, None) is not None:
            self.dirty = True

    def save(self) -> None:
        """Write the registry atomically and durably (only when dirty)."""
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Running jobs must survive a crash of procs (to be re-attached); of the
        # ended ones only the newest are kept, so the file (rewritten and fsynced
        # on every change) stays small however many commands a session ran. An
        # older ended command's log stays on disk; procs no longer lists it.
        entries = list(self.entries.values())
        ended = [e for e in entries if e.state != "running"][-KEEP_ENDED:]
        kept = [e for e in entries if e.state == "running"] + ended
        body = json.dumps(
            {"version": VERSION, "entries": [asdict(e) for e in kept]},
            separators=(",", ":"),
        ).encode()
        write_atomic(self.path, body)
        self.dirty = False
        self.saves += 1
