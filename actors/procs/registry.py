"""The procs registry (`procs/registry.json`): every job started, not forgotten.

Written durably before a job's start gate opens. See docs/procs.md
("Crashes").
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

from broker.durable import write_atomic
from broker.statedir import StateDir

VERSION = 1
JobKind = Literal["command", "terminal"]
JobState = Literal["running", "exited", "killed", "capped", "expired", "lost",
                   "quota_exceeded"]


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
END_STATES: frozenset[str] = frozenset(get_args(JobState)) - {"running"}


def end_path(log_path: str) -> str:
    """`<id>.end` beside `<id>.log`: a job's final state, for after the
    registry let it go."""
    return os.path.splitext(log_path)[0] + ".end"


def write_end_file(entry: Entry) -> None:
    """Note the job's final state beside its log (not fsynced: like the log,
    it describes what the registry, the durable record, already said)."""
    body = json.dumps({"state": entry.state, "exit_code": entry.exit_code,
                       "reason": entry.kill_reason}).encode()
    with contextlib.suppress(OSError):
        fd = os.open(end_path(entry.log_path),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)


def read_end_file(log_path: str) -> tuple[JobState, int | None, str | None] | None:
    """(state, exit code, kill reason) from a job's end file; None if absent or bad."""
    try:
        with open(end_path(log_path), "rb") as f:
            raw = json.loads(f.read())
        state, code, reason = raw["state"], raw["exit_code"], raw["reason"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if state not in END_STATES or not isinstance(code, int | None) \
            or not isinstance(reason, str | None):
        return None
    return state, code, reason


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

    def ended(self, proc_id: str) -> None:
        """`proc_id` reached an end state: it is now the newest ended entry."""
        entry = self.entries.pop(proc_id, None)
        if entry is not None:
            self.entries[proc_id] = entry
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
        # older ended command's log stays on disk; procs no longer lists it (and
        # forgets it in memory too), but answers for it from its files.
        entries = list(self.entries.values())
        ended = [e for e in entries if e.state != "running"][-KEEP_ENDED:]
        kept = [e for e in entries if e.state == "running"] + ended
        keep_ids = {e.proc_id for e in kept}
        self.entries = {k: e for k, e in self.entries.items() if k in keep_ids}
        body = json.dumps(
            {"version": VERSION, "entries": [asdict(e) for e in kept]},
            separators=(",", ":"),
        ).encode()
        write_atomic(self.path, body)
        self.dirty = False
        self.saves += 1
