"""Storage caps and collection outside the WAL; `supervisor du` and `gc`.

See docs/storage.md.
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import structlog
from pydantic import BaseModel, ConfigDict, Field

from actors.trees import collect as trees_collect
from broker.durable import write_atomic
from broker.statedir import StateDir
from supervisor import storagetranscripts

REQUEST_NAME = "gc.request"  # actors/writer/walgc.py reads these two
RESULT_NAME = "gc.result.json"
JOB_DIRS = (".procs", ".terminals")
JOB_SUFFIXES = (".log", ".exit", ".end")
EXIT_TEMP = ".exit.tmp"  # the wrapper's exit status before its rename (actors/procs/command.py)
MiB = 1024 * 1024


class StorageConfig(BaseModel):
    """`storage:` in the config (config/default.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: Annotated[int, Field(ge=0)] = 0  # all of .corral/; over it a pass runs (0: none)
    wal_max_bytes: Annotated[int, Field(ge=0)] = 0  # the WAL tier (0: no cap)
    procs_max_bytes: Annotated[int, Field(ge=0)] = 1024 * MiB  # job logs, every session
    procs_max_bytes_per_session: Annotated[int, Field(ge=0)] = 64 * MiB
    keep_generations: Annotated[int, Field(ge=1)] = 3  # snapshot generations per session
    keep_records: Annotated[int, Field(ge=0)] = 100_000  # the WAL's rewind horizon
    archive: bool = False  # truncated WAL segments to state/wal-archive/ instead of deleted
    disposable_streams: list[str] = []  # streams (fnmatch) needing nothing below the horizon
    pins: list[str] = []  # sessions (fnmatch) never collected
    interval_s: Annotated[float, Field(gt=0)] = 30.0  # how often caps are checked
    transcript_max_bytes: Annotated[int, Field(ge=0)] = 0  # a session's, then rotated (0: never)

    def writer_args(self) -> list[str]:
        args = ["--gc-interval-s", str(self.interval_s), "--gc-keep-records",
                str(self.keep_records), "--gc-max-wal-bytes", str(self.wal_max_bytes)]
        if self.archive:
            args.append("--gc-archive")
        for pattern in self.disposable_streams:
            args += ["--gc-disposable", pattern]
        return args

    def pinned(self, session: str) -> bool:
        return any(fnmatch.fnmatchcase(session, p) for p in self.pins)


# --- du -------------------------------------------------------------------------
TIERS = {  # top-level entry of .corral/ -> tier (docs/storage.md)
    "state": "recovery-core", "config": "recovery-core", "trees": "recovery-core",
    "agents": "sessions", "memory": "persist", "approvals.jsonl": "persist",
    "logs": "audit", "cache": "cache", "run": "run",
}


def tree_bytes(path: Path) -> int:
    """Bytes allocated on disk under `path` (files and directories, no links followed)."""
    total = 0
    try:
        st = path.lstat()
    except OSError:
        return 0
    total += st.st_blocks * 512
    if path.is_dir() and not path.is_symlink():
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    total += tree_bytes(Path(entry.path))
        except OSError:
            pass
    return total


@dataclass
class SessionUsage:
    total: int = 0
    procs: int = 0  # .procs and .terminals
    generations: int = 0
    workspace: int = 0
    other: int = 0
    pinned: bool = False


@dataclass
class Usage:
    state_dir: str
    total_bytes: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    wal_bytes: int = 0
    sessions: dict[str, SessionUsage] = field(default_factory=dict)
    max_bytes: int = 0
    over_cap: bool = False
    tree_packs: int = 0  # packs of the trees store (trees/packs/*.pack)
    tree_pack_bytes: int = 0


def du(state_dir: StateDir, config: StorageConfig) -> Usage:
    usage = Usage(state_dir=str(state_dir.root), max_bytes=config.max_bytes)
    try:
        entries = sorted(state_dir.root.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        size = tree_bytes(entry)
        tier = TIERS.get(entry.name, "other")
        if entry.name.startswith("sessions.sqlite3"):
            tier = "recovery-core"
        usage.tiers[tier] = usage.tiers.get(tier, 0) + size
        usage.total_bytes += size
    usage.wal_bytes = tree_bytes(state_dir.wal_dir)
    agents = state_dir.root / "agents"
    for session_dir in sorted(agents.iterdir()) if agents.is_dir() else []:
        s = SessionUsage(pinned=config.pinned(session_dir.name))
        s.total = tree_bytes(session_dir)
        s.procs = sum(tree_bytes(session_dir / d) for d in JOB_DIRS)
        s.generations = tree_bytes(session_dir / "state" / "generations")
        s.workspace = tree_bytes(session_dir / "workspace")
        s.other = max(0, s.total - s.procs - s.generations - s.workspace)
        usage.sessions[session_dir.name] = s
    usage.tree_packs, usage.tree_pack_bytes = trees_collect.pack_usage(state_dir)
    usage.over_cap = bool(config.max_bytes) and usage.total_bytes > config.max_bytes
    return usage


# --- gc: job logs and generations ---------------------------------------------------
@dataclass
class Job:
    session: str
    job_id: str
    files: list[Path]
    size: int
    ended_at: float


@dataclass
class GcReport:
    dry_run: bool
    jobs_removed: int = 0
    job_bytes_removed: int = 0
    generations_removed: int = 0
    generation_bytes_removed: int = 0
    running_jobs_kept: int = 0
    transcripts_rotated: int = 0
    transcript_bytes_removed: int = 0
    wal: dict[str, object] | None = None  # the writer's pass (actors/writer/walgc.py)
    wal_note: str = ""
    trees: dict[str, object] | None = None  # actors/trees/collect.py's pass
    bytes_before: int = 0
    bytes_after: int = 0
    over_cap_after: bool = False


def session_jobs(session_dir: Path) -> tuple[list[Job], int]:
    """A session's ended jobs, oldest ended first, and the count of running ones."""
    groups: dict[str, list[Path]] = {}
    for sub in JOB_DIRS:
        directory = session_dir / sub
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.endswith(EXIT_TEMP):  # a wrapper cut between its exit file and the rename
                stem, suffix = name[: -len(EXIT_TEMP)], EXIT_TEMP
            else:
                stem, suffix = os.path.splitext(name)
            if suffix in JOB_SUFFIXES or suffix == EXIT_TEMP:
                groups.setdefault(f"{sub}/{stem}", []).append(directory / name)
    ended, running = [], 0
    for key, files in groups.items():
        end = next((f for f in files if f.suffix == ".end"), None)
        if end is None:
            running += 1  # no end noted: running (or procs has yet to note it): never touched
            continue
        try:
            ended_at = end.stat().st_mtime
            size = sum(f.stat().st_size for f in files)
        except OSError:
            continue
        ended.append(Job(session_dir.name, key, files, size, ended_at))
    ended.sort(key=lambda j: j.ended_at)
    return ended, running


def _remove(job: Job) -> None:
    for path in sorted(job.files, key=lambda p: p.suffix != ".end"):  # .end last
        path.unlink(missing_ok=True)


def collect_jobs(state_dir: StateDir, config: StorageConfig, report: GcReport) -> None:
    agents = state_dir.root / "agents"
    candidates: list[Job] = []
    total = 0
    for session_dir in sorted(agents.iterdir()) if agents.is_dir() else []:
        jobs, running = session_jobs(session_dir)
        report.running_jobs_kept += running
        if config.pinned(session_dir.name):
            continue
        size = sum(j.size for j in jobs)
        while jobs and size > config.procs_max_bytes_per_session:
            job = jobs.pop(0)
            size -= job.size
            _take(job, report)
        candidates += jobs
        total += size
    candidates.sort(key=lambda j: j.ended_at)
    while candidates and total > config.procs_max_bytes:
        job = candidates.pop(0)
        total -= job.size
        _take(job, report)


def _take(job: Job, report: GcReport) -> None:
    report.jobs_removed += 1
    report.job_bytes_removed += job.size
    if not report.dry_run:
        _remove(job)


def collect_generations(state_dir: StateDir, config: StorageConfig, report: GcReport) -> None:
    agents = state_dir.root / "agents"
    for session_dir in sorted(agents.iterdir()) if agents.is_dir() else []:
        if config.pinned(session_dir.name):
            continue
        directory = session_dir / "state" / "generations"
        try:
            names = sorted(n for n in os.listdir(directory)
                           if n.startswith("gen-") and n.endswith(".json"))
        except OSError:
            continue
        for name in names[: -config.keep_generations]:
            path = directory / name
            try:
                size = path.stat().st_size
            except OSError:
                continue
            report.generations_removed += 1
            report.generation_bytes_removed += size
            if not report.dry_run:
                path.unlink(missing_ok=True)


# --- the WAL half, through the writer -------------------------------------------------
def writer_running(state_dir: StateDir) -> bool:
    lock = state_dir.run_dir / "writer.lock"
    try:
        pid = int(lock.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def request_wal_pass(state_dir: StateDir, dry_run: bool, timeout_s: float
                     ) -> tuple[dict[str, object] | None, str]:
    if not writer_running(state_dir):
        return None, "the writer is not running: the WAL pass runs when it is"
    request_id = uuid.uuid4().hex
    write_atomic(state_dir.run_dir / REQUEST_NAME,
                 json.dumps({"id": request_id, "dry_run": dry_run}).encode())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads((state_dir.run_dir / RESULT_NAME).read_bytes())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("id") == request_id:
            return data, ""
        time.sleep(0.05)
    return None, f"the writer did not answer within {timeout_s:g}s (its pass goes on)"


def gc(state_dir: StateDir, config: StorageConfig, *, dry_run: bool,
       wal: bool = True, timeout_s: float = 120.0, trees: bool = True) -> GcReport:
    report = GcReport(dry_run=dry_run, bytes_before=du(state_dir, config).total_bytes)
    collect_jobs(state_dir, config, report)
    collect_generations(state_dir, config, report)
    rotated = storagetranscripts.over_cap(state_dir, config.transcript_max_bytes, config.pinned)
    report.transcripts_rotated = len(rotated)
    report.transcript_bytes_removed = storagetranscripts.rotate(rotated, dry_run)
    if wal:
        report.wal, report.wal_note = request_wal_pass(state_dir, dry_run, timeout_s)
    if trees:
        report.trees = trees_collect.as_dict(trees_collect.collect(state_dir, dry_run=dry_run))
    after = du(state_dir, config)
    report.bytes_after = after.total_bytes
    report.over_cap_after = after.over_cap
    return report


def as_json(value: Usage | GcReport) -> str:
    return json.dumps(asdict(value), indent=2)


class Janitor:
    """The runtime's background pass: every `interval_s` it measures usage (in
    its own thread: the supervisor's loop and the writer's appends never wait
    for it) and runs a collection pass when a cap is exceeded: the total
    `max_bytes`, or the job logs' caps."""

    def __init__(self, state_dir: StateDir, config: StorageConfig) -> None:
        self.state_dir = state_dir
        self.config = config
        self.passes = 0
        self._stop = threading.Event()
        self._log: structlog.stdlib.BoundLogger = structlog.get_logger("supervisor")
        self._thread = threading.Thread(target=self._run, name="storage-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def over_caps(self) -> str | None:
        usage = du(self.state_dir, self.config)
        if usage.over_cap:
            return "max_bytes"
        jobs = [s.procs for name, s in usage.sessions.items() if not s.pinned]
        if any(size > self.config.procs_max_bytes_per_session for size in jobs) or (
                sum(jobs) > self.config.procs_max_bytes):
            return "procs"
        if storagetranscripts.over_cap(self.state_dir, self.config.transcript_max_bytes,
                                       self.config.pinned):
            return "transcripts"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                why = self.over_caps()
                if why is None:
                    continue
                report = gc(self.state_dir, self.config, dry_run=False, wal=why == "max_bytes",
                            timeout_s=self.config.interval_s, trees=why == "max_bytes")
                self.passes += 1
                self._log.info("storage_gc_ran", cap=why, jobs_removed=report.jobs_removed,
                               generations_removed=report.generations_removed,
                               transcripts_rotated=report.transcripts_rotated,
                               bytes_before=report.bytes_before, bytes_after=report.bytes_after,
                               over_cap_after=report.over_cap_after)
            except Exception:  # noqa: BLE001 - a failed pass is logged; the next one retries
                self._log.exception("storage_gc_failed")
