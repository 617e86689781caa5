"""The per-stream index of the WAL (`cache/wal-index/<name>.idx`).

Derived: a full scan rebuilds it. See docs/wal.md ("The stream index").
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from broker import durable

ENTRY = struct.Struct("<QQQL")
MAX_OPEN_FILES = 64
IndexEntry = tuple[int, int, int, int]  # seq, segment first seq, offset, length
READABLE_PREFIX_CHARS = 48
_NOT_FILENAME_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def stream_filename(stream: str) -> str:
    """A bounded file name for any stream name: a readable prefix (at most 48
    characters, `/` and `:` as `_`) and 32 hex digits of its SHA-256, so at
    most 85 bytes whatever the name's length and two names never share one."""
    readable = _NOT_FILENAME_SAFE.sub("_", stream[:READABLE_PREFIX_CHARS])
    digest = hashlib.sha256(stream.encode()).hexdigest()[:32]
    return f"{readable}.{digest}.idx"


@dataclass(frozen=True)
class FlushFailure:
    stream: str
    path: Path
    error: str


@dataclass
class Unsynced:
    """What `write_pending` appended to the files, not yet fsynced, or what
    `take_pending` took for `write_unsynced` to append and fsync: the paths,
    whether a file was created (its directory too), and per stream the count
    before and the entries (for `revert`, or `commit`)."""

    paths: list[Path] = field(default_factory=list)
    created: bool = False
    written: dict[str, tuple[int, list[IndexEntry]]] = field(default_factory=dict)


def sync_files(paths: Iterable[Path], directory: Path, *, missing_ok: bool = False) -> None:
    """fsync each file (by path, through an fd of its own, so it may run in a
    thread while the loop keeps its fds) and then the directory; OSError on
    failure. `missing_ok`: a file deleted meanwhile is skipped (compaction
    deletes a stream's file when it loses every entry)."""
    for path in sorted(paths):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if missing_ok:
                continue
            raise
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    durable.fsync_dir(directory)


class IndexWriteError(OSError):
    """`write_unsynced` could not write or fsync some streams' files."""

    def __init__(self, failures: list[FlushFailure]) -> None:
        first = failures[0]
        super().__init__(f"{len(failures)} index file(s) failed, first {first.path}: "
                         f"{first.error}")
        self.failures = failures


def write_unsynced(directory: Path, unsynced: Unsynced) -> None:
    """Append the entries `take_pending` took to their files and fsync each
    file, then the directory; OSError on failure (IndexWriteError naming the
    streams that failed, after the others were written; the caller `revert`s
    them all).
    Runs in the checkpoint thread, through fds of its own: the loop reads the
    same files meanwhile, never past the counts it has, which change only at
    `commit`. A file longer than its count (a write that failed before) is
    cut back first."""
    failures: list[FlushFailure] = []
    for stream, (count, entries) in unsynced.written.items():
        path = directory / stream_filename(stream)
        try:
            unsynced.created = unsynced.created or not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if os.fstat(fd).st_size != count * ENTRY.size:
                    os.ftruncate(fd, count * ENTRY.size)
                view = memoryview(b"".join(ENTRY.pack(*entry) for entry in entries))
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:  # the other streams are still written (one failure logged)
            failures.append(FlushFailure(stream, path, str(exc)))
            continue
        unsynced.paths.append(path)
    if failures:
        raise IndexWriteError(failures)
    durable.fsync_dir(directory)


class StreamIndex:
    """Flushed entries live in files; the newest ones in memory until flush."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.unusable: str | None = None  # why the directory cannot be used, if so
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.unusable = f"cannot create {directory}: {exc}"
        self._file_counts: dict[str, int] = {}
        self._pending: dict[str, list[IndexEntry]] = {}
        # taken by `take_pending`, being written by the checkpoint thread: still
        # read from memory until `commit` (or back in _pending after `revert`)
        self._writing: dict[str, list[IndexEntry]] = {}
        self._fds: OrderedDict[str, int] = OrderedDict()

    # --- start-up -------------------------------------------------------------
    def restore(self, counts: dict[str, int]) -> bool:
        """Match the files to a checkpoint's counts: cut what is beyond them,
        drop files the checkpoint does not know. False when a file is missing
        or shorter than its count, or cannot be read (the index must then be
        rebuilt)."""
        if self.unusable is not None:
            return not counts
        expected = {stream_filename(stream): stream for stream in counts}
        try:
            for path in self.directory.glob("*.idx"):
                if path.name not in expected:
                    path.unlink(missing_ok=True)  # another name scheme, or a dropped stream
            for name, stream in expected.items():
                path = self.directory / name
                want = counts[stream] * ENTRY.size
                size = path.stat().st_size
                if size < want:
                    return False
                if size > want:
                    os.truncate(path, want)
        except OSError:
            return False
        self._file_counts = dict(counts)
        return True

    def reset(self) -> list[str]:
        """Forget everything and delete the files (before a full rebuild);
        returns the files that could not be deleted (they are overwritten
        from the start when their stream is next flushed)."""
        self.close()
        stuck: list[str] = []
        if self.unusable is None:
            for path in self.directory.glob("*.idx"):
                try:
                    path.unlink()
                except OSError:
                    stuck.append(str(path))
        self._file_counts.clear()
        self._pending.clear()
        self._writing.clear()
        return stuck

    # --- writes ---------------------------------------------------------------
    def add(self, stream: str, seq: int, segment: int, offset: int, length: int) -> None:
        entries = self._pending.get(stream)
        if entries is None:
            entries = self._pending[stream] = []
        entries.append((seq, segment, offset, length))

    def flush(self, fsync: bool = True) -> list[FlushFailure]:
        """Append pending entries to their files (fsync them when asked); a
        stream whose file cannot be written keeps its entries in memory and is
        returned as a failure (its file is cut back to what it held)."""
        return self._flush(fsync, None)

    def write_pending(self) -> tuple[list[FlushFailure], Unsynced]:
        """Append pending entries to their files without fsync, remembering
        what was written: the caller fsyncs `Unsynced.paths` (`sync_files`)
        before a checkpoint names `counts()`, or calls `revert` when that
        fails. No other change to the files may come in between."""
        unsynced = Unsynced()
        return self._flush(False, unsynced), unsynced

    def take_pending(self) -> tuple[list[FlushFailure], Unsynced]:
        """Take every pending entry for the checkpoint thread (`write_unsynced`),
        without writing anything here: the loop's part of a checkpoint is this
        swap. The entries stay readable (`lookup`, `last_seq`) until `commit`
        (written and fsynced: the files' counts grow) or `revert` (back to
        pending). `counts_with` gives the counts the checkpoint may name once
        they are durable. Failures (an unusable directory) take nothing."""
        unsynced = Unsynced()
        if self._writing:
            raise RuntimeError("index entries are already being written")
        if self.unusable is not None:
            return [FlushFailure(stream, self.directory, self.unusable)
                    for stream in self._pending], unsynced
        for stream, entries in self._pending.items():
            unsynced.written[stream] = (self._file_counts.get(stream, 0), entries)
        self._writing, self._pending = self._pending, {}
        return [], unsynced

    def counts_with(self, unsynced: Unsynced) -> dict[str, int]:
        """The counts once `unsynced` is in the files (what a checkpoint names)."""
        counts = dict(self._file_counts)
        for stream, (before, entries) in unsynced.written.items():
            counts[stream] = before + len(entries)
        return counts

    def commit(self, unsynced: Unsynced) -> None:
        """`write_unsynced` made the taken entries durable: they are the files' now."""
        for stream, (before, entries) in unsynced.written.items():
            if self._writing.pop(stream, None) is not None:
                self._file_counts[stream] = before + len(entries)

    def revert(self, unsynced: Unsynced) -> None:
        """The written (or taken) entries could not be made durable: back to
        memory, in front of any added since; the next write cuts the files
        back to the counts before and writes them again."""
        for stream, (before, entries) in unsynced.written.items():
            self._writing.pop(stream, None)
            self._forget_fd(stream)
            if before:
                self._file_counts[stream] = before
            else:
                self._file_counts.pop(stream, None)
            self._pending[stream] = entries + self._pending.get(stream, [])

    def _flush(self, fsync: bool, unsynced: Unsynced | None) -> list[FlushFailure]:
        if self._writing:
            raise RuntimeError("index entries are being written by a checkpoint")
        failures: list[FlushFailure] = []
        created = False
        for stream in list(self._pending):
            entries = self._pending[stream]
            count = self._file_counts.get(stream, 0)
            if self.unusable is not None:
                failures.append(FlushFailure(stream, self.directory, self.unusable))
                continue
            try:
                fd, new = self._open(stream)
                created = created or new
                if os.fstat(fd).st_size != count * ENTRY.size:
                    os.ftruncate(fd, count * ENTRY.size)  # a failed flush left a part
                data = b"".join(ENTRY.pack(*entry) for entry in entries)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if fsync:
                    os.fsync(fd)
            except OSError as exc:
                failures.append(
                    FlushFailure(stream, self.directory / stream_filename(stream), str(exc))
                )
                self._forget_fd(stream)
                continue
            self._file_counts[stream] = count + len(entries)
            del self._pending[stream]
            if unsynced is not None:
                unsynced.paths.append(self.directory / stream_filename(stream))
                unsynced.written[stream] = (count, entries)
        if unsynced is not None:
            unsynced.created = created
        if created and fsync:
            try:
                durable.fsync_dir(self.directory)
            except OSError as exc:
                failures.append(FlushFailure("", self.directory, f"directory fsync: {exc}"))
        return failures

    def counts(self) -> dict[str, int]:
        """Entries per stream in the files (call after flush for the full picture)."""
        return dict(self._file_counts)

    def pending_entries(self) -> int:
        return sum(len(e) for e in (*self._pending.values(), *self._writing.values()))

    def streams(self) -> int:
        return len(set(self._file_counts) | set(self._pending) | set(self._writing))

    # --- reads ----------------------------------------------------------------
    def lookup(self, stream: str, from_seq: int, limit: int) -> list[IndexEntry]:
        """Up to `limit` entries of `stream` with seq >= from_seq, in order."""
        found: list[IndexEntry] = []
        count = self._file_counts.get(stream, 0)
        if count:
            fd = self._fd(stream)
            lo, hi = 0, count
            while lo < hi:  # first entry with seq >= from_seq
                mid = (lo + hi) // 2
                (seq,) = struct.unpack_from("<Q", os.pread(fd, 8, mid * ENTRY.size))
                if seq < from_seq:
                    lo = mid + 1
                else:
                    hi = mid
            take = min(limit, count - lo)
            if take > 0:
                data = os.pread(fd, take * ENTRY.size, lo * ENTRY.size)
                found.extend(ENTRY.iter_unpack(data))
        for memory in (self._writing.get(stream), self._pending.get(stream)):
            if memory and len(found) < limit:  # in flight to the files, then pending
                start = bisect.bisect_left(memory, (from_seq,))
                found.extend(memory[start : start + limit - len(found)])
        return found

    def last_seq(self, stream: str) -> int:
        """The seq of the stream's newest indexed record (0: none)."""
        pending = self._pending.get(stream) or self._writing.get(stream)
        if pending:
            return pending[-1][0]
        count = self._file_counts.get(stream, 0)
        if not count:
            return 0
        (seq,) = struct.unpack_from("<Q", os.pread(self._fd(stream), 8, (count - 1) * ENTRY.size))
        return int(seq)

    # --- storage collection (actors/writer/walgc.py) ---------------------------
    def stream_names(self) -> list[str]:
        return sorted(set(self._file_counts) | set(self._pending) | set(self._writing))

    def entries(self, stream: str) -> list[IndexEntry]:
        """Every entry of `stream`, file and memory, in seq order."""
        return self.lookup(stream, 0, self._file_counts.get(stream, 0) + len(
            self._pending.get(stream, [])) + len(self._writing.get(stream, [])))

    def rewrite(self, stream: str, entries: list[IndexEntry], fsync: bool = True) -> Path:
        """Replace `stream`'s entries (a compaction moved or removed some, a
        truncation dropped those below the floor): written whole, durably,
        nothing left pending. No entries: the file is deleted. Without
        `fsync` the caller makes the returned file durable (and the directory)."""
        if self._writing:
            raise RuntimeError("index entries are being written by a checkpoint")
        self._forget_fd(stream)
        path = self.directory / stream_filename(stream)
        self._pending.pop(stream, None)
        if not entries:
            path.unlink(missing_ok=True)
            self._file_counts.pop(stream, None)
            return path
        data = b"".join(ENTRY.pack(*entry) for entry in entries)
        if fsync:
            durable.write_atomic(path, data)
        else:  # the caller fsyncs the file and the directory before relying on it
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self._file_counts[stream] = len(entries)
        return path

    def splice(self, stream: str, lo_seq: int, hi_seq: int, entries: list[IndexEntry],
               fsync: bool = True) -> Path | None:
        """Replace `stream`'s entries with lo_seq <= seq <= hi_seq (all in the
        file) by `entries` (in seq order, within that range): the rest of the
        file is copied as bytes, never unpacked, and what is pending stays
        pending; a compaction's swap costs its segment's share of the stream,
        not the stream (actors/writer/walgc.py). None when some entry of the
        range is still in memory (the caller rewrites the stream whole)."""
        if self._writing:
            raise RuntimeError("index entries are being written by a checkpoint")
        pending = self._pending.get(stream)
        if pending and pending[0][0] <= hi_seq:
            return None
        count = self._file_counts.get(stream, 0)
        lo, hi = self._position(stream, lo_seq), self._position(stream, hi_seq + 1)
        data = os.pread(self._fd(stream), count * ENTRY.size, 0) if count else b""
        new = b"".join((data[: lo * ENTRY.size], *(ENTRY.pack(*e) for e in entries),
                        data[hi * ENTRY.size:]))
        self._forget_fd(stream)
        path = self.directory / stream_filename(stream)
        if not new:
            path.unlink(missing_ok=True)
            self._file_counts.pop(stream, None)
            return path
        if fsync:
            durable.write_atomic(path, new)
        else:  # the caller fsyncs the file and the directory before relying on it
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(new)
            os.replace(tmp, path)
        self._file_counts[stream] = len(new) // ENTRY.size
        return path

    def move(self, stream: str, moved: list[tuple[int, int, int]], fsync: bool = True) -> bool:
        """Give entries of `stream` new offsets in place: `moved` is (seq, new
        offset, length) of consecutive entries of the stream, in seq order (a
        compacted segment's records of a stream that lost none). Only their
        slice of the file is rewritten (fsynced unless not `fsync`); False when the entries are
        not where `moved` says (the caller rewrites the stream whole)."""
        if not moved:
            return True
        if self._writing:
            raise RuntimeError("index entries are being written by a checkpoint")
        count = self._file_counts.get(stream, 0)
        found = self.lookup(stream, moved[0][0], len(moved))
        if [e[0] for e in found] != [m[0] for m in moved]:
            return False
        lo = self._position(stream, moved[0][0])
        in_file = max(0, min(len(moved), count - lo))
        new = [(seq, e[1], off, length) for (seq, off, length), e in zip(moved, found, strict=True)]
        if in_file:
            path = self.directory / stream_filename(stream)
            fd = os.open(path, os.O_WRONLY)  # not O_APPEND: pwrite must land where it says
            try:
                data = b"".join(ENTRY.pack(*entry) for entry in new[:in_file])
                os.pwrite(fd, data, lo * ENTRY.size)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        pending = self._pending.get(stream, [])
        for entry in new[in_file:]:
            i = bisect.bisect_left(pending, (entry[0],))
            pending[i] = entry
        return True

    def _position(self, stream: str, from_seq: int) -> int:
        """Index in the file of the first entry with seq >= from_seq."""
        lo, hi = 0, self._file_counts.get(stream, 0)
        if not hi:
            return 0
        fd = self._fd(stream)
        while lo < hi:
            mid = (lo + hi) // 2
            (seq,) = struct.unpack_from("<Q", os.pread(fd, 8, mid * ENTRY.size))
            if seq < from_seq:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _fd(self, stream: str) -> int:
        return self._open(stream)[0]

    def _open(self, stream: str) -> tuple[int, bool]:
        """The stream's file descriptor, and whether the file was just created."""
        fd = self._fds.get(stream)
        if fd is not None:
            self._fds.move_to_end(stream)
            return fd, False
        if len(self._fds) >= MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        path = self.directory / stream_filename(stream)
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        self._fds[stream] = fd
        return fd, created

    def _forget_fd(self, stream: str) -> None:
        fd = self._fds.pop(stream, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
