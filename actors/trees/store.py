"""The content-addressed object store of workspace trees: file contents and
tree objects, each named by the sha256 of its bytes, deduplicated.

    .corral/trees/packs/<writer>.pack      one append-only pack per writer (an agent)

Objects are appended to their writer's pack, all of a capture's new objects
(its blobs and trees) in one write followed by one `fdatasync`, before the
WAL fact that names the tree is appended: a fact never names an object that
is not durable, and a capture costs one sync however many files changed (an
fsync costs ~10 ms or far more on a busy disk: one file per blob would
multiply that by the number of changed files, and a new file per capture
would add a directory fsync). Only creating a pack fsyncs the directory.
Pack format (version 1):

    b"CTPK1\\n" then, per object: 32 bytes sha256, 8 bytes big-endian length, data

Writers append under an exclusive `flock` of the pack. A crash mid-append
leaves a torn tail that no fact names (the fact comes after the sync); the
next append truncates it away. Readers index every pack's complete objects
(headers only, seeking over the data), remembering where each pack ended,
so a refresh reads only what was appended since; an object is checked
against its name whenever it is read (`CorruptObjectError`, never returned).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from broker.durable import fsync_dir
from broker.errors import CorralError

MAGIC = b"CTPK1\n"
_HEAD = struct.Struct(">32sQ")
SUFFIX = ".pack"
MAX_OBJECT_BYTES = 1 << 34


class CorruptObjectError(CorralError):
    """An object whose bytes do not hash to its name, or one that is missing."""


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def packs_dir(root: Path) -> Path:
    """The packs directory of a state directory root (`.corral/`)."""
    return root / "trees" / "packs"


class ObjectStore:
    def __init__(self, directory: Path, writer: str = "shared") -> None:
        self.directory = directory
        self.writer = writer
        self._index: dict[str, tuple[Path, int, int]] = {}
        self._ends: dict[str, int] = {}  # pack name -> end of its last complete object
        self.refresh()

    def refresh(self) -> None:
        """Index what was appended since the last look (by this or another process)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in sorted(names):
            if name.endswith(SUFFIX):
                self._scan(self.directory / name)

    def _scan(self, path: Path) -> int:
        """Index `path`'s complete objects after what is known; return its valid end."""
        start = self._ends.get(path.name, 0)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            return start
        with f:
            size = os.fstat(f.fileno()).st_size
            if start == 0:
                if f.read(len(MAGIC)) != MAGIC:
                    return 0
                start = len(MAGIC)
            f.seek(start)
            end = start
            while end + _HEAD.size <= size:
                raw, length = _HEAD.unpack(f.read(_HEAD.size))
                if length > MAX_OBJECT_BYTES or end + _HEAD.size + length > size:
                    break  # a torn tail: not an object yet
                self._index.setdefault(raw.hex(), (path, end + _HEAD.size, length))
                end += _HEAD.size + length
                f.seek(end)
        self._ends[path.name] = end
        return end

    def has(self, digest: str) -> bool:
        return digest in self._index

    def get(self, digest: str) -> bytes:
        """The object's bytes, checked against its name."""
        where = self._index.get(digest)
        if where is None:
            self.refresh()
            where = self._index.get(digest)
        if where is None:
            raise CorruptObjectError(f"object {digest[:16]} is not in {self.directory}")
        path, offset, length = where
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length or digest_of(data) != digest:
            raise CorruptObjectError(f"object {digest[:16]} in {path.name} is damaged")
        return data

    def put_many(self, objects: Iterable[tuple[str, bytes]]) -> int:
        """Append the objects the store lacks to this writer's pack, durably;
        return how many."""
        new: dict[str, bytes] = {}
        for digest, data in objects:
            if digest not in self._index and digest not in new:
                new[digest] = data
        if not new:
            return 0
        created_dir = not self.directory.is_dir()
        if created_dir:
            self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.writer}{SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            end = self._scan(path) if size else 0
            if size and end == 0:
                raise CorruptObjectError(f"{path} is not a pack")
            if end != size:
                os.ftruncate(fd, end)  # a torn append no fact names
            chunks = [] if end else [MAGIC]
            pos = end or len(MAGIC)
            placed = []
            for digest, data in new.items():
                chunks.append(_HEAD.pack(bytes.fromhex(digest), len(data)))
                chunks.append(data)
                placed.append((digest, pos + _HEAD.size, len(data)))
                pos += _HEAD.size + len(data)
            view = memoryview(b"".join(chunks))
            offset = end
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            os.fdatasync(fd)
        finally:
            os.close(fd)  # releases the lock
        if size == 0:
            fsync_dir(self.directory)  # the new pack's name
            if created_dir:
                fsync_dir(self.directory.parent)
                fsync_dir(self.directory.parent.parent)
        for digest, at, length in placed:
            self._index.setdefault(digest, (path, at, length))
        self._ends[path.name] = pos
        return len(new)

    def statistics(self) -> dict[str, int]:
        return {"objects": len(self._index), "packs": len(self._ends)}
