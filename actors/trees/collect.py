"""Collection of the trees store by reachability, pack by pack, under a lease.

See docs/trees.md ("Collection") and docs/decisions.md ("Trees are collected
by reachability under a lease").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from actors.kernel import generations
from actors.trees import branch, tree
from actors.trees.store import (
    _HEAD,
    MAGIC,
    MAX_OBJECT_BYTES,
    SUFFIX,
    CorruptObjectError,
    ObjectStore,
    identity,
    lease,
    packs_dir,
)
from actors.writer import retention
from actors.writer.wal import list_segments, parse_record
from actors.writer.walgc import Purged, read_purges
from broker.durable import fsync_dir
from broker.errors import WalError
from broker.statedir import StateDir

FAULT_ENV = "CORRAL_FAULT_TREES_GC_KILL_AT"
TEMP_SUFFIX = ".tmp"
EVENTS = ("workspace_tree", branch.FORK, branch.REWIND)
_MARKERS = tuple(f'"event":"{e}"'.encode() for e in EVENTS)
COPY_CHUNK = 1 << 20
Hook = Callable[[str], None]


def fault_point(step: str) -> None:
    """SIGKILL this process when the fault injection names `step` (tests)."""
    if os.environ.get(FAULT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class TreesReport:
    dry_run: bool
    roots: int = 0
    reachable: int = 0
    missing: int = 0  # named by a root (or a tree), not in the store, damaged or no tree
    packs_before: int = 0
    packs_after: int = 0
    objects_before: int = 0
    objects_removed: int = 0
    objects_appended_during: int = 0  # appended after the roots were read: kept
    bytes_before: int = 0
    bytes_after: int = 0
    packs_rewritten: list[str] = field(default_factory=list)
    packs_removed: list[str] = field(default_factory=list)
    caches_removed: list[str] = field(default_factory=list)
    temp_files_removed: int = 0
    error: str = ""


# --- roots ----------------------------------------------------------------------
def wal_events(state_dir: StateDir, purged: Purged) -> tuple[dict[str, list[branch.Event]],
                                                             set[str]]:
    """Per agent stream, its tree-bearing records (seq, event, payload) the WAL
    holds from the floor up, purged ones left out; and the streams of which
    purged records were seen (to tell a fully purged stream)."""
    floor = retention.load(retention.path_in(state_dir.state_dir)).floor_seq
    out: dict[str, list[branch.Event]] = {}
    purged_seen: set[str] = set()
    for _, path in list_segments(state_dir.wal_dir):
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            continue  # removed by retention since the listing
        with f:
            for line in f:
                if not any(m in line for m in _MARKERS):
                    continue
                record = parse_record(line)
                if record is None or record.seq < floor or record.event not in EVENTS \
                        or not record.stream.startswith("agent/"):
                    continue
                if purged.selects(record):
                    purged_seen.add(record.stream)
                    continue
                try:
                    payload = record.payload()
                except ValueError:
                    continue
                out.setdefault(record.stream, []).append((record.seq, record.event, payload))
    for events in out.values():
        events.sort(key=lambda e: e[0])
    return out, purged_seen


def _tree_of(payload: Any, key: str = "tree") -> str | None:
    value = payload.get(key) if isinstance(payload, dict) else None
    return value if isinstance(value, str) and len(value) == 64 else None


def roots_of(events: list[branch.Event], *, every_branch: bool = False) -> set[str]:
    chosen = events if every_branch else branch.active(events)
    return {t for _, _, payload in chosen if (t := _tree_of(payload)) is not None}


def _agents(state_dir: StateDir) -> list[Path]:
    agents = state_dir.root / "agents"
    try:
        return sorted(p for p in agents.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def file_roots(state_dir: StateDir, streams: dict[str, list[branch.Event]]) -> set[str]:
    """Roots outside the WAL: kept generations, rewind and fork intents."""
    roots: set[str] = set()
    for agent_dir in _agents(state_dir):
        cuts = [(to, seq) for seq, event, payload in streams.get(f"agent/{agent_dir.name}", [])
                if (to := branch.cut_of(event, payload)) is not None]
        paths = [*generations.list_generations(agent_dir),
                 generations.state_dir_of(agent_dir) / "snapshot.json"]
        for path in paths:
            gen = generations.read(path) if path.exists() else None
            if gen is None or not gen.state.tree:
                continue
            if any(to < gen.state.last_seq < seq for to, seq in cuts):
                continue  # a rewind abandoned it: recovery never uses it again
            roots.add(gen.state.tree)
        intent = _json(agent_dir / "rewind.json")
        for key in ("tree", "from_tree"):
            if (t := _tree_of(intent, key)) is not None:
                roots.add(t)
    forks = state_dir.root / "trees" / "forks"
    for path in sorted(forks.glob("*.json")) if forks.is_dir() else []:
        intent = _json(path)
        source = intent.get("source") if isinstance(intent, dict) else None
        if isinstance(source, str):
            roots |= roots_of(streams.get(f"agent/{source}", []), every_branch=True)
    return roots


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def closure(store: ObjectStore, roots: set[str], report: TreesReport) -> set[str]:
    """Every object the roots reach (trees decoded, a split directory's parts
    and nodes among them, blobs named)."""
    reachable: set[str] = set()
    todo = list(roots)
    while todo:
        digest = todo.pop()
        if digest in reachable:
            continue
        reachable.add(digest)
        try:
            entries, parts = tree.links(store.get(digest))
        except (CorruptObjectError, tree.TreeFormatError):  # a record is input like any other
            report.missing += 1
            continue
        todo += parts  # a large directory's parts: tree objects too
        for entry in entries.values():
            if entry.is_dir:
                todo.append(entry.digest)
            else:
                reachable.add(entry.digest)
    return reachable


# --- a pack -------------------------------------------------------------------------
def scan(fd: int) -> Iterator[tuple[str, int, int]]:
    """(digest, data offset, length) of each complete object of the pack at `fd`."""
    size = os.fstat(fd).st_size
    if os.pread(fd, len(MAGIC), 0) != MAGIC:
        return
    at = len(MAGIC)
    while at + _HEAD.size <= size:
        raw, length = _HEAD.unpack(os.pread(fd, _HEAD.size, at))
        if length > MAX_OBJECT_BYTES or at + _HEAD.size + length > size:
            return  # a torn tail
        yield raw.hex(), at + _HEAD.size, length
        at += _HEAD.size + length


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[int | None]:
    """The pack open and `flock`ed as its writers take it (None: gone)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            yield None
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = identity(os.fstat(fd)) == identity(os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def repack(path: Path, keep: set[str], known_end: int, report: TreesReport,
           dry_run: bool) -> None:
    """Rewrite the pack at `path` with the objects in `keep` and everything
    after `known_end` (appended since the roots were read), under its lock."""
    with _locked(path) as fd:
        if fd is None:
            return
        size = os.fstat(fd).st_size
        report.bytes_before += size
        objects = list(scan(fd))
        report.objects_before += len(objects)
        seen: set[str] = set()
        kept: list[tuple[str, int, int]] = []
        for digest, offset, length in objects:
            if digest in seen:
                continue  # a second copy (two writers, or a retried append)
            late = offset - _HEAD.size >= known_end
            report.objects_appended_during += late
            if digest in keep or late:
                seen.add(digest)
                kept.append((digest, offset, length))
        report.objects_removed += len(objects) - len(kept)
        end = len(MAGIC) + sum(_HEAD.size + n for _, _, n in kept)
        if len(kept) == len(objects) and end == size:
            report.bytes_after += size
            report.packs_after += 1
            return  # nothing to collect
        if not kept:
            report.packs_removed.append(path.name)
            if not dry_run:
                path.unlink()
                fault_point("removed")
                fsync_dir(path.parent)
            return
        report.packs_rewritten.append(path.name)
        report.packs_after += 1
        report.bytes_after += end
        if dry_run:
            return
        _write_new(path, fd, kept)


def _write_new(path: Path, fd: int, kept: list[tuple[str, int, int]]) -> None:
    temp = path.with_name(f".{path.name}{TEMP_SUFFIX}")
    out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600)
    try:
        _write_all(out, MAGIC)
        for digest, offset, length in kept:
            _write_all(out, _HEAD.pack(bytes.fromhex(digest), length))
            done = 0
            while done < length:  # copied in chunks: an object may be large
                chunk = os.pread(fd, min(COPY_CHUNK, length - done), offset + done)
                if not chunk:
                    raise CorruptObjectError(f"{path.name} shrank while repacked")  # noqa: TRY301
                _write_all(out, chunk)
                done += len(chunk)
        os.fsync(out)
    except BaseException:
        os.close(out)
        temp.unlink(missing_ok=True)
        raise
    os.close(out)
    fault_point("written")
    os.replace(temp, path)
    fault_point("renamed")
    fsync_dir(path.parent)
    fault_point("synced")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# --- a pass -------------------------------------------------------------------------
def collect(state_dir: StateDir, *, dry_run: bool = False, hook: Hook | None = None
            ) -> TreesReport:
    """One collection pass (see the module docstring). `hook(step)` is called
    at "roots_read" (tests inject interleavings there)."""
    report = TreesReport(dry_run=dry_run)
    directory = packs_dir(state_dir.root)
    if not directory.is_dir():
        return report
    with lease(directory, exclusive=True):
        for leftover in directory.glob(f".*{TEMP_SUFFIX}"):  # a pass that crashed
            report.temp_files_removed += 1
            if not dry_run:
                leftover.unlink(missing_ok=True)
        store = ObjectStore(directory)
        # what the index holds ends there in each pack: anything appended later (a
        # torn tail is overwritten from the last complete object on) is kept unread
        ends = store.ends()
        purged = Purged(read_purges(state_dir.root))
        try:
            streams, purged_seen = wal_events(state_dir, purged)
        except (WalError, OSError) as exc:
            report.error = f"cannot read the WAL's roots: {exc}"[:500]
            return report  # without every root nothing may be collected
        roots: set[str] = set()
        for events in streams.values():
            roots |= roots_of(events)
        roots |= file_roots(state_dir, streams)
        report.roots = len(roots)
        reachable = closure(store, roots, report)
        report.reachable = len(reachable)
        if hook is not None:
            hook("roots_read")
        names = _pack_names(directory)
        report.packs_before = len(names)
        for name in names:
            repack(directory / name, reachable, ends.get(name, 0), report, dry_run)
        for stream in sorted(purged_seen - set(streams)):  # fully purged: its cache goes
            cache = state_dir.cache_dir / "trees" / f"{stream.removeprefix('agent/')}.jsonl"
            if cache.exists() and "/" not in stream.removeprefix("agent/"):
                report.caches_removed.append(cache.name)
                if not dry_run:
                    cache.unlink(missing_ok=True)
    return report


def _pack_names(directory: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return []


def pack_usage(state_dir: StateDir) -> tuple[int, int]:
    """(packs, bytes) of the trees store, for `supervisor du`."""
    directory = packs_dir(state_dir.root)
    count = size = 0
    for name in _pack_names(directory):
        with contextlib.suppress(OSError):
            size += os.stat(directory / name).st_blocks * 512
            count += 1
    return count, size


def as_dict(report: TreesReport) -> dict[str, object]:
    return asdict(report)
