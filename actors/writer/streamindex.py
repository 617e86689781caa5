"""Per-stream index of the WAL (`cache/wal-index/<hex of stream>.idx`): fixed
28-byte entries (seq, segment first seq, offset, length), so that one stream can
be read from any seq without scanning the WAL. New entries are kept in memory
and appended to the files at each checkpoint (fsynced before the checkpoint
names their counts). The index is derived: a full scan rebuilds it."""

from __future__ import annotations

import bisect
import os
import struct
from collections import OrderedDict
from pathlib import Path

ENTRY = struct.Struct("<QQQL")
MAX_OPEN_FILES = 64
IndexEntry = tuple[int, int, int, int]  # seq, segment first seq, offset, length


def stream_filename(stream: str) -> str:
    return stream.encode().hex() + ".idx"


class StreamIndex:
    """Flushed entries live in files; the newest ones in memory until flush."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._file_counts: dict[str, int] = {}
        self._pending: dict[str, list[IndexEntry]] = {}
        self._fds: OrderedDict[str, int] = OrderedDict()

    # --- start-up -------------------------------------------------------------
    def restore(self, counts: dict[str, int]) -> bool:
        """Match the files to a checkpoint's counts: cut what is beyond them,
        drop files the checkpoint does not know. False when a file is shorter
        than its count (the index must then be rebuilt)."""
        on_disk: set[str] = set()
        for path in self.directory.glob("*.idx"):
            try:
                stream = bytes.fromhex(path.stem).decode()
            except ValueError:
                path.unlink(missing_ok=True)
                continue
            expected = counts.get(stream)
            if expected is None:
                path.unlink(missing_ok=True)
                continue
            size = path.stat().st_size
            if size < expected * ENTRY.size:
                return False
            if size > expected * ENTRY.size:
                os.truncate(path, expected * ENTRY.size)
            on_disk.add(stream)
        if set(counts) - on_disk:
            return False
        self._file_counts = dict(counts)
        return True

    def reset(self) -> None:
        """Forget everything and delete the files (before a full rebuild)."""
        self.close()
        for path in self.directory.glob("*.idx"):
            path.unlink()
        self._file_counts.clear()
        self._pending.clear()

    # --- writes ---------------------------------------------------------------
    def add(self, stream: str, seq: int, segment: int, offset: int, length: int) -> None:
        entries = self._pending.get(stream)
        if entries is None:
            entries = self._pending[stream] = []
        entries.append((seq, segment, offset, length))

    def flush(self, fsync: bool = True) -> None:
        """Append pending entries to their files (fsync them when asked)."""
        for stream, entries in self._pending.items():
            fd = self._fd(stream)
            data = b"".join(ENTRY.pack(*entry) for entry in entries)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
            self._file_counts[stream] = self._file_counts.get(stream, 0) + len(entries)
        self._pending.clear()

    def counts(self) -> dict[str, int]:
        """Entries per stream in the files (call after flush for the full picture)."""
        return dict(self._file_counts)

    def pending_entries(self) -> int:
        return sum(len(e) for e in self._pending.values())

    def streams(self) -> int:
        return len(set(self._file_counts) | set(self._pending))

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
        if len(found) < limit:
            pending = self._pending.get(stream, [])
            start = bisect.bisect_left(pending, (from_seq,))
            found.extend(pending[start : start + limit - len(found)])
        return found

    def _fd(self, stream: str) -> int:
        fd = self._fds.get(stream)
        if fd is not None:
            self._fds.move_to_end(stream)
            return fd
        if len(self._fds) >= MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        path = self.directory / stream_filename(stream)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        self._fds[stream] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
