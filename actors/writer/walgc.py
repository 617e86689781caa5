"""Storage collection of the WAL, run by the writer: retention and compaction.

A pass yields to the writer: while appends flow, its steps in the writer's
loop take at most GC_DUTY of the loop's time.
See docs/storage.md ("WAL retention", "Compaction", "Triggers").
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from actors.writer import compaction, retention
from actors.writer.dedupe import DedupeWindows
from actors.writer.ledgers import Ledgers
from actors.writer.procsfloor import ProcsFloor, is_procs_stream
from actors.writer.streamindex import StreamIndex, stream_filename, sync_files
from actors.writer.streamreader import StreamReader
from actors.writer.wal import WalRecord, list_segments
from broker.durable import fsync_dir, write_atomic
from broker.statedir import StateDir

REQUEST_NAME = "gc.request"
RESULT_NAME = "gc.result.json"
ARCHIVE_DIRNAME = "wal-archive"
PURGE_DB = "sessions.sqlite3"
PURGED_STATES = ("files_removed", "done")
REQUEST_POLL_S = 0.5
# the writer's own records: a pass that seals the active segment puts one in
# the next, so the sealed one no longer holds the head and can be compacted
MARKER_STREAM = "writer/gc"
MARKER_WAIT_S = 10.0  # a marker not durable by then (a full disk): the next pass
# the share of the writer loop's time a pass's steps may take while appends flow
GC_DUTY = 0.15
# streams whose index entries below a new floor are dropped per step
TRIM_STREAMS_PER_STEP = 8
# ledgers trimmed to the WAL's floor: the budget ledger (recovery-core, a
# projection of the WAL nothing reads below it); never approvals.jsonl (persist)
TRIMMED_LEDGERS = ("budget",)


@dataclass(frozen=True)
class GcOptions:
    interval_s: float = 30.0  # how often the writer considers a pass on its own
    max_wal_bytes: int = 0  # a pass runs when the WAL is larger (0: no cap)
    keep_records: int = 100_000  # the rewind horizon: the newest seqs never truncated
    archive: bool = False  # move truncated segments to state/wal-archive/ instead of deleting
    disposable: tuple[str, ...] = ()  # stream patterns (fnmatch) needing nothing below the horizon


class WriterView(Protocol):
    """What a pass needs of the writer (actors/writer/process.py)."""

    state_dir: StateDir
    head: int
    index: StreamIndex
    reader: StreamReader
    dedupe: DedupeWindows
    ledgers: Ledgers

    def storage_changed(self) -> None: ...

    @property
    def head_segment(self) -> int: ...

    def seal_active(self) -> int | None:
        """Seal the active segment and stage a marker record into the next
        one; the next segment's first seq, or None (nothing sealed, or no
        marker staged: a full disk)."""
        ...


class Purged:
    """Seq ranges of purged sessions, by stream."""

    def __init__(self, rows: list[tuple[str, int, int]]) -> None:
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for stream, first, last in rows:
            self.ranges.setdefault(stream, []).append((first, last))
        for stream, ranges in self.ranges.items():
            self.ranges[stream] = retention.merge(ranges)

    def selects(self, record: WalRecord) -> bool:
        return any(a <= record.seq <= b for a, b in self.ranges.get(record.stream, ()))

    def covers_stream(self, stream: str, first: int) -> bool:
        return any(a <= first <= b for a, b in self.ranges.get(stream, ()))


def read_purges(state_root: Path) -> list[tuple[str, int, int]]:
    """Rows of the purge journal whose records are to be removed; [] when the
    database or the table is absent or unreadable (it is sessions' file)."""
    db = state_root / PURGE_DB
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = con.execute(
                "SELECT stream, first_seq, last_seq FROM purge_journal WHERE state IN (?, ?)",
                PURGED_STATES,
            ).fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []
    out = []
    for stream, first, last in rows:
        if isinstance(stream, str) and isinstance(first, int) and isinstance(last, int):
            out.append((stream, first, last))
    return out


def oldest_generation_seq(state_dir: StateDir, agent: str) -> int | None:
    """The seq of the oldest kept snapshot generation of `agent` (None: none)."""
    try:
        directory = state_dir.agent_dir(agent) / "state" / "generations"
        names = os.listdir(directory)
    except (OSError, ValueError):
        return None
    seqs = []
    for name in names:
        stem = name.removeprefix("gen-").removesuffix(".json")
        if name.startswith("gen-") and name.endswith(".json") and stem.isdigit():
            seqs.append(int(stem))
    return min(seqs) if seqs else None


@dataclass
class PassResult:
    id: str = ""
    dry_run: bool = False
    reason: str = ""
    floor_seq: int = 1
    segments_removed: list[str] = field(default_factory=list)
    segments_compacted: list[str] = field(default_factory=list)
    records_removed: int = 0
    compacted_bytes_before: int = 0  # of the compacted segments
    compacted_bytes_after: int = 0
    compaction_s: float = 0.0  # time spent rewriting them (in the background thread)
    wal_bytes_before: int = 0
    wal_bytes_after: int = 0
    elapsed_ms: float = 0.0
    error: str = ""


class Collector:
    """Runs passes, one step per call of `tick()` from the writer's loop while
    no batch is in flight."""

    def __init__(self, state_dir: StateDir, options: GcOptions) -> None:
        self.state_dir = state_dir
        self.options = options
        self.path = retention.path_in(state_dir.state_dir)
        self.state = retention.load(self.path)
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")
        self._next_auto = time.monotonic() + options.interval_s
        self._next_request_poll = 0.0
        self._pass: PassResult | None = None
        self._procs = ProcsFloor()  # unsettled starts of procs' streams
        self._started = 0.0
        self._todo: list[tuple[int, Path]] = []
        self._sealed_at: int | None = None  # a sealed segment's marker awaited (its segment)
        self._seal_deadline = 0.0
        self._trims: list[str] = []  # streams whose index still has entries below the floor
        self._resume_at = 0.0  # monotonic: the next loop step while appends flow (GC_DUTY)
        self._head_at_step = -1  # the writer's head after the last step
        self._purged = Purged([])
        self._thread: threading.Thread | None = None
        self._ready: list[compaction.Rewrite] = []  # rewritten, to swap in
        self._error: BaseException | None = None
        self._rewrite_s = 0.0
        self._dirty: set[Path] = set()  # index files changed, not yet fsynced
        self._syncing: tuple[set[Path], int] | None = None  # being fsynced, for that epoch
        self.synced_epoch = self.state.epoch  # the newest epoch whose index changes are durable
        self.passes_total = 0
        self.segments_removed_total = 0
        self.segments_compacted_total = 0
        self.bytes_reclaimed_total = 0

    @property
    def epoch(self) -> int:
        """The epoch a checkpoint may name: while index files changed by a
        compaction are not yet fsynced, the one before (a checkpoint of it is
        not used at the next start, so the index is rebuilt)."""
        return self.synced_epoch

    @property
    def running(self) -> bool:
        return self._pass is not None

    def values(self) -> dict[str, int | float]:
        return {
            "gc_running": int(self.running),
            "gc_passes_total": self.passes_total,
            "gc_segments_removed_total": self.segments_removed_total,
            "gc_segments_compacted_total": self.segments_compacted_total,
            "gc_bytes_reclaimed_total": self.bytes_reclaimed_total,
            "wal_floor_seq": self.state.floor_seq,
        }

    # --- triggers -------------------------------------------------------------
    def tick(self, w: WriterView) -> None:
        """Called between batches (no batch in flight): start, advance or
        finish a pass; a step of a pass waits its turn while appends flow
        (GC_DUTY)."""
        if self._pass is None:
            self._maybe_start(w)
            return
        now = time.monotonic()
        if now < self._resume_at and w.head != self._head_at_step:
            return  # the writer is serving appends: its share of the time first
        try:
            self._tick_pass(w)
        finally:
            done = time.monotonic()
            self._resume_at = done + (done - now) * (1 - GC_DUTY) / GC_DUTY
            self._head_at_step = w.head

    def _tick_pass(self, w: WriterView) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                return
            self._thread = None
            if self._error is not None:
                error, self._error = self._error, None
                self._fail(error)
                return
            if self._syncing is not None:  # the thread made these index changes durable
                self.synced_epoch = self._syncing[1]
                self._syncing = None
                w.storage_changed()  # checkpoint twice: neither one names the old files
        self._next_step(w)

    def _maybe_start(self, w: WriterView) -> None:
        now = time.monotonic()
        if now >= self._next_request_poll:
            self._next_request_poll = now + REQUEST_POLL_S
            request = self._read_request()
            if request is not None:
                self.start(w, str(request.get("id", "")), bool(request.get("dry_run")), "request")
                return
        if now >= self._next_auto:
            self._next_auto = now + self.options.interval_s
            over = self.options.max_wal_bytes and wal_bytes(
                self.state_dir) > self.options.max_wal_bytes
            if over or self._purge_work(w, Purged(read_purges(self.state_dir.root))):
                self.start(w, "", False, "over_cap" if over else "purges")

    def _read_request(self) -> dict[str, object] | None:
        path = self.state_dir.run_dir / REQUEST_NAME
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        with contextlib.suppress(OSError):
            path.unlink()
        return data if isinstance(data, dict) else {}

    # --- a pass ---------------------------------------------------------------
    def start(self, w: WriterView, request_id: str, dry_run: bool, reason: str) -> None:
        self._started = time.monotonic()
        self._pass = PassResult(id=request_id, dry_run=dry_run, reason=reason,
                                wal_bytes_before=wal_bytes(self.state_dir))
        self._purged = Purged(read_purges(self.state_dir.root))
        try:
            floor = self.floor(w)
            self._pass.floor_seq = max(floor, self.state.floor_seq)
            self._truncate(w, floor, dry_run)
            if not dry_run:
                self._seal_if_purged(w)
            self._todo = self._compaction_targets(w)
        except OSError as exc:
            self._fail(exc)
            return
        if dry_run:
            self._pass.segments_compacted = [p.name for _, p in self._todo]
            self._todo = []
        self._next_step(w)

    def floor(self, w: WriterView) -> int:
        """The lowest seq still needed (see the module docstring)."""
        floor = max(1, w.head + 1 - self.options.keep_records)
        self._procs.forget(set(w.index.stream_names()))
        for stream in w.index.stream_names():
            if stream == MARKER_STREAM or any(
                    fnmatch.fnmatchcase(stream, p) for p in self.options.disposable):
                continue
            entries = w.index.lookup(stream, self.state.floor_seq, 1)
            if not entries:
                continue
            first = entries[0][0]
            if self._purged.covers_stream(stream, first) and not any(
                    w.index.lookup(stream, b + 1, 1) for _, b in self._purged.ranges[stream]):
                continue  # purged, and nothing of it after its purged range
            need = first
            if is_procs_stream(stream):  # its unsettled starts, nothing older (procsfloor.py)
                held = self._procs.need(stream, w.index, w.reader.read_line,
                                        self.state.floor_seq, time.time())
                if held is None:
                    continue
                need = max(held, first)
            elif stream.startswith("agent/"):
                gen = oldest_generation_seq(self.state_dir, stream.removeprefix("agent/"))
                if gen is not None and gen >= first:
                    need = gen
            floor = min(floor, need)
        held = w.reader.held_floor()
        if held is not None:
            floor = min(floor, held)
        return floor

    def _eligible(self) -> list[tuple[int, Path, int]]:
        """Segments retention may remove: sealed and followed by a non-empty
        one, so the head record's segment always stays: (first, path, next
        first)."""
        segments = list_segments(self.state_dir.wal_dir)
        out = []
        last_nonempty = max(
            (i for i, (_, p) in enumerate(segments) if p.stat().st_size > 0), default=-1
        )
        for i in range(last_nonempty):
            first, path = segments[i]
            out.append((first, path, segments[i + 1][0]))
        return out

    def _truncate(self, w: WriterView, floor: int, dry_run: bool) -> None:
        assert self._pass is not None
        victims = [(first, path) for first, path, nxt in self._eligible() if nxt <= floor]
        if not victims:
            return
        new_floor = max(nxt for _, _, nxt in self._eligible() if nxt <= floor)
        self._pass.floor_seq = new_floor
        self._pass.segments_removed = [p.name for _, p in victims]
        if dry_run:
            return
        self.state = retention.RetentionState(
            floor_seq=new_floor,
            epoch=self.state.epoch + 1,
            compacted=[(a, b) for a, b in self.state.compacted if b >= new_floor],
        )
        retention.save(self.path, self.state)
        compaction.fault_point("floor_recorded")
        archive = self.state_dir.state_dir / ARCHIVE_DIRNAME
        if self.options.archive:
            archive.mkdir(exist_ok=True)
        for first, path in victims:
            w.reader.forget(first)
            if self.options.archive:
                os.replace(path, archive / path.name)
            else:
                path.unlink(missing_ok=True)
        fsync_dir(self.state_dir.wal_dir)
        if self.options.archive:
            fsync_dir(archive)
        compaction.fault_point("removed")
        for name in TRIMMED_LEDGERS:  # the epoch is new: no checkpoint names their old sizes
            trim_ledger(w.ledgers, name, new_floor)
        w.reader.floor_seq = new_floor  # reads below it are refused from now on
        # entries below the floor point nowhere: dropped a few streams a step
        self._trims = w.index.stream_names()
        self.segments_removed_total += len(victims)
        self.log.info("wal_truncated", floor_seq=new_floor, segments=len(victims),
                      archived=self.options.archive)

    def _seal_if_purged(self, w: WriterView) -> None:
        """When the active segment holds a record of a purged session, seal it
        now and let the writer put a marker in the next segment: once that
        marker is durable the sealed segment is compacted in this same pass."""
        if self._active_holds(w, self._purged):
            self._sealed_at = w.seal_active()
            self._seal_deadline = time.monotonic() + MARKER_WAIT_S
            if self._sealed_at is not None:
                self.log.info("wal_segment_sealed_for_purge", next_segment=self._sealed_at)

    def _marker_waits(self, w: WriterView) -> bool:
        """True while the marker of a sealed segment is not durable yet; once
        it is (or the wait timed out), the targets are read again."""
        if self._sealed_at is None:
            return False
        if w.head_segment < self._sealed_at and time.monotonic() < self._seal_deadline:
            return True
        if w.head_segment < self._sealed_at:
            self.log.warning("wal_gc_marker_late", next_segment=self._sealed_at)
        self._sealed_at = None
        self._todo = self._compaction_targets(w)
        return False

    def _active_holds(self, w: WriterView, purged: Purged) -> bool:
        segment = getattr(w, "segment", None)
        if segment is None or not segment.size:
            return False
        for stream, ranges in purged.ranges.items():
            for a, b in ranges:
                hit = w.index.lookup(stream, max(a, segment.first_seq), 1)
                if hit and hit[0][0] <= b:
                    return True
        return False

    def _purge_work(self, w: WriterView, purged: Purged) -> bool:
        return bool(self._targets(w, purged)) or self._active_holds(w, purged)

    def _targets(self, w: WriterView, purged: Purged) -> list[tuple[int, Path]]:
        out = []
        for first, path, nxt in self._eligible():
            for stream, ranges in purged.ranges.items():
                if any(w.index.lookup(stream, max(a, first), 1) and
                       w.index.lookup(stream, max(a, first), 1)[0][0] <= min(b, nxt - 1)
                       for a, b in ranges):
                    out.append((first, path))
                    break
        return out

    def _compaction_targets(self, w: WriterView) -> list[tuple[int, Path]]:
        return self._targets(w, self._purged)

    def _trim_some(self, w: WriterView) -> None:
        """Drop the index entries below the floor of a few streams."""
        floor = self.state.floor_seq
        chunk, self._trims = (self._trims[:TRIM_STREAMS_PER_STEP],
                              self._trims[TRIM_STREAMS_PER_STEP:])
        for stream in chunk:
            first = w.index.lookup(stream, 1, 1)
            if first and first[0][0] < floor:
                path = w.index.splice(stream, 0, floor - 1, [], fsync=False)
                if path is None:  # below the floor, still in memory: the whole stream
                    path = w.index.rewrite(stream, [e for e in w.index.entries(stream)
                                                    if e[0] >= floor], fsync=False)
                self._dirty.add(path)

    def _next_step(self, w: WriterView) -> None:
        """One step: drop a few streams' index entries below a new floor, or
        swap one rewritten segment in (loop thread, cheap), or start the
        thread that rewrites every target (in one child process), or the one
        that fsyncs the index files the swaps changed, or finish."""
        if self._marker_waits(w):
            if self._trims:
                self._trim_some(w)
            return
        if self._trims:
            if self._todo:  # the rewriting runs meanwhile, in its child
                todo, self._todo = self._todo, []
                self._start_thread(self._rewrite_all, todo)
            self._trim_some(w)
            return
        if self._ready:
            self._apply_rewrite(w, self._ready.pop(0))
            return
        if self._todo:
            todo, self._todo = self._todo, []
            self._start_thread(self._rewrite_all, todo)
            return
        if self._dirty:
            self._syncing = (self._dirty, self.state.epoch)
            self._dirty = set()
            self._start_thread(self._sync_index, self._syncing[0])
            return
        self._finish(w)

    def _start_thread(self, target: Callable[[Any], None], arg: object) -> None:
        self._thread = threading.Thread(target=target, args=(arg,), name="wal-gc", daemon=True)
        self._thread.start()

    def _rewrite_all(self, todo: list[tuple[int, Path]]) -> None:
        """In the thread: rewrite the targets in a child process."""
        started = time.monotonic()
        try:
            self._ready = compaction.rewrite_in_child(todo, self._purged.ranges)
        except Exception as exc:  # noqa: BLE001 - reported by the loop, which logs it
            self._error = exc
        self._rewrite_s = time.monotonic() - started

    def _sync_index(self, paths: set[Path]) -> None:
        """In the thread: fsync the index files (and their directory) changed."""
        try:
            sync_files(paths, self.state_dir.stream_index_dir, missing_ok=True)
        except OSError as exc:
            self._error = exc

    def _apply_rewrite(self, w: WriterView, done: compaction.Rewrite) -> None:
        assert self._pass is not None
        dropped = done.dropped_seqs()
        self.state = retention.RetentionState(
            floor_seq=self.state.floor_seq,
            epoch=self.state.epoch + 1,
            compacted=retention.merge([*self.state.compacted, *done.ranges()]),
        )
        retention.save(self.path, self.state)
        compaction.fault_point("recorded")
        compaction.swap(done)
        w.reader.forget(done.first_seq)
        for stream in sorted(set(done.kept) | set(done.dropped)):
            kept = done.kept.get(stream, [])
            path = self.state_dir.stream_index_dir / stream_filename(stream)
            self._dirty.add(path)
            if stream not in done.dropped and w.index.move(stream, kept, fsync=False):
                continue  # a stream that lost nothing: only its slice of the index moves
            span = [seq for seq, _, _ in kept] + done.dropped.get(stream, [])
            if span and w.index.splice(stream, min(span), max(span), fsync=False, entries=[
                    (seq, done.first_seq, off, length) for seq, off, length in kept]) is not None:
                continue  # the segment's slice of the stream replaced, the rest copied
            moved = {seq: (off, length) for seq, off, length in kept}
            w.index.rewrite(stream, fsync=False, entries=[
                (seq, seg, *moved[seq]) if seg == done.first_seq and seq in moved else
                (seq, seg, off, length)
                for seq, seg, off, length in w.index.entries(stream) if seq not in dropped
            ])
        w.dedupe.forget_seqs(dropped)
        for ledger, seqs in done.dropped_ledger.items():
            drop_ledger_lines(w.ledgers, ledger, seqs)
        compaction.fault_point("indexed")
        self._pass.segments_compacted.append(done.path.name)
        self._pass.records_removed += len(dropped)
        self._pass.compacted_bytes_before += done.bytes_before
        self._pass.compacted_bytes_after += done.bytes_after
        self._pass.compaction_s = round(self._rewrite_s, 4)
        self.segments_compacted_total += 1
        self.bytes_reclaimed_total += done.bytes_before - done.bytes_after
        self.log.info("wal_segment_compacted", segment=done.path.name, records_removed=len(dropped),
                      bytes_before=done.bytes_before, bytes_after=done.bytes_after)

    def _fail(self, error: BaseException | None) -> None:
        assert self._pass is not None
        self._pass.error = f"{type(error).__name__}: {error}"[:500]
        self.log.error("storage_gc_failed", error=self._pass.error)
        self._todo = []
        self._trims = []
        for ready in self._ready:  # rewritten but never swapped in: the old ones stay
            ready.tmp.unlink(missing_ok=True)
        self._ready = []
        self._finish_result()

    def _finish(self, w: WriterView) -> None:
        self._finish_result()

    def _finish_result(self) -> None:
        result = self._pass
        assert result is not None
        self._pass = None
        result.wal_bytes_after = wal_bytes(self.state_dir)
        result.elapsed_ms = round((time.monotonic() - self._started) * 1000, 2)
        if not result.dry_run:
            self.passes_total += 1
        self.log.info("storage_gc_pass", **{k: v for k, v in asdict(result).items()
                                            if k not in ("segments_removed",
                                                         "segments_compacted")},
                      segments_removed=len(result.segments_removed),
                      segments_compacted=len(result.segments_compacted))
        with contextlib.suppress(OSError):
            write_atomic(self.state_dir.run_dir / RESULT_NAME, json.dumps(asdict(result)).encode())


def trim_ledger(ledgers: Ledgers, name: str, floor_seq: int) -> int:
    """Rewrite ledger `name` without its lines below `floor_seq` (the WAL no
    longer holds them), atomically and durably, and let the writer reopen it;
    returns how many lines went. Read only up to its first line when nothing
    is below the floor. A line that does not parse is kept (start-up checks
    and cuts a torn tail, docs/wal.md)."""
    path = ledgers.paths.get(name)
    if path is None:
        return 0
    from actors.writer.wal import parse_record  # noqa: PLC0415 - only on this rare path

    try:
        with open(path, "rb") as f:
            first = parse_record(f.readline())
            if first is None or first.seq >= floor_seq:
                return 0
            f.seek(0)
            data = f.read()
    except FileNotFoundError:
        return 0
    kept, dropped = [], 0
    for line in data.splitlines(keepends=True):
        record = parse_record(line)
        if record is not None and record.seq < floor_seq:
            dropped += 1
        else:
            kept.append(line)
    ledgers.close()  # its descriptors name the old file
    write_atomic(path, b"".join(kept))
    return dropped


def drop_ledger_lines(ledgers: Ledgers, name: str, seqs: set[int]) -> None:
    """Rewrite ledger `name` without the lines of `seqs` (durably), and let
    the writer reopen it."""
    path = ledgers.paths.get(name)
    if path is None or not path.exists():
        return
    from actors.writer.wal import parse_record  # noqa: PLC0415 - only on this rare path

    kept = []
    for line in path.read_bytes().splitlines(keepends=True):
        record = parse_record(line)
        if record is None or record.seq not in seqs:
            kept.append(line)
    ledgers.close()  # its descriptors name the old file
    write_atomic(path, b"".join(kept))


def wal_bytes(state_dir: StateDir) -> int:
    total = 0
    for _, path in list_segments(state_dir.wal_dir):
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total
