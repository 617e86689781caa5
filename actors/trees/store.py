"""The content-addressed object store of workspace trees: append-only packs.

A fact never names an object that is not durable. See docs/trees.md
("Trees") and docs/decisions.md ("Workspace trees: per-directory objects in
append-only packs").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from broker.durable import fsync_dir
from broker.errors import CorralError

MAGIC = b"CTPK1\n"
_HEAD = struct.Struct(">32sQ")
SUFFIX = ".pack"
LEASE_NAME = "collect.lock"  # in trees/: captures hold it shared, a collection exclusively
MAX_OBJECT_BYTES = 1 << 34


class CorruptObjectError(CorralError):
    """An object whose bytes do not hash to its name, or one that is missing."""


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def packs_dir(root: Path) -> Path:
    """The packs directory of a state directory root (`.corral/`)."""
    return root / "trees" / "packs"


def take_lease(packs: Path, exclusive: bool = False) -> int:
    """The collection lease (see `lease`) taken; closing the fd it returns
    releases it (so does the process's death)."""
    path = packs.parent / LEASE_NAME
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:  # no trees directory yet
        packs.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def lease(packs: Path, exclusive: bool = False) -> Iterator[None]:
    """The collection lease of the store at `packs`: shared while a capture
    goes from its walk to the durable fact naming its tree, exclusive for a
    collection pass. Released when the block ends (or the process dies)."""
    fd = take_lease(packs, exclusive)
    try:
        yield
    finally:
        os.close(fd)


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class ObjectStore:
    def __init__(self, directory: Path, writer: str = "shared") -> None:
        self.directory = directory
        self.writer = writer
        self._index: dict[str, tuple[Path, int, int]] = {}
        self._ends: dict[str, int] = {}  # pack name -> end of its last complete object
        self._ids: dict[str, tuple[int, int]] = {}  # pack name -> (device, inode) indexed
        self._unsynced: list[int] = []  # fds of packs appended with durable=False
        self.generation = 0  # counts the index's resets (a collection ran)
        # the packs directory's (inode, mtime_ns, ctime_ns) when every pack was last
        # checked one by one, and the filesystem clock read before that (validate)
        self._checked: tuple[tuple[int, int, int], int] | None = None
        self.refresh()

    def take_unsynced(self) -> list[int]:
        """The fds `put_many(durable=False)` left to sync (now the caller's)."""
        fds, self._unsynced = self._unsynced, []
        return fds

    def lease(self) -> contextlib.AbstractContextManager[None]:
        """The collection lease, shared (see `lease`)."""
        return lease(self.directory)

    def validate(self, now_ns: int | None = None) -> bool:
        """Index again from scratch when a pack indexed was replaced or removed
        (a collection ran); True when it did. A stat per pack, or one stat in
        all with `now_ns`, the filesystem's clock read just before the call
        (statcache.fs_now_ns): a pack replaced, removed or created changes the
        directory's mtime, so a directory whose identity and timestamps are
        those seen at the last check, older than the clock read before it,
        has had nothing renamed, removed or created since (the racy rule of
        the stat cache: a change in the same tick as that check is not ruled
        out by equal timestamps, so then every pack is checked). Without a
        check per pack, the cost of a capture grew with the number of agents
        that ever stored a tree."""
        if now_ns is not None:
            try:
                st = os.stat(self.directory)
            except FileNotFoundError:
                st = None
            seen = None if st is None else (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            last = self._checked
            if (seen is not None and last is not None and last[0] == seen
                    and max(seen[1], seen[2]) < last[1]):
                return False
            self._checked = None if seen is None else (seen, now_ns)
        else:
            self._checked = None  # a check without a clock vouches for nothing later
        return self._validate_each()

    def _validate_each(self) -> bool:
        for name, known in list(self._ids.items()):
            try:
                same = identity(os.stat(self.directory / name)) == known
            except FileNotFoundError:
                same = False
            if not same:
                self._reset()
                return True
        return False

    def _reset(self) -> None:
        self.generation += 1  # what was indexed may be gone: callers check again
        self._index.clear()
        self._ends.clear()
        self._ids.clear()
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
            st = os.fstat(f.fileno())
            size = st.st_size
            known = self._ids.get(path.name)
            if known is not None and known != identity(st):
                f.close()
                self._reset()  # replaced by a collection: every offset may be wrong
                return self._ends.get(path.name, 0)
            self._ids[path.name] = identity(st)
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
        if where is None and self.validate():
            where = self._index.get(digest)
        if where is None:
            raise CorruptObjectError(f"object {digest[:16]} is not in {self.directory}")
        data = _read_at(*where)
        if (data is None or digest_of(data) != digest) and self.validate():
            where = self._index.get(digest)  # the pack was repacked: its offsets moved
            if where is None:
                raise CorruptObjectError(f"object {digest[:16]} is not in {self.directory}")
            data = _read_at(*where)
        if data is None or digest_of(data) != digest:
            raise CorruptObjectError(f"object {digest[:16]} in {where[0].name} is damaged")
        return data

    def put_many(self, objects: Iterable[tuple[str, bytes]], *, durable: bool = True,
                 now_ns: int | None = None) -> int:
        """Append the objects the store lacks to this writer's pack, durably;
        return how many. Deduplicated against the index as validated now:
        under the lease (`lease()`) no collection removes what it names
        before the lease ends. `durable=False`: the pack's fdatasync is left
        to `sync_pending()`, which the caller runs (on another thread) before
        anything names the objects (a new pack's directory is synced here).
        `now_ns`: the filesystem's clock read before the call (`validate`)."""
        self.validate(now_ns)
        given = list(objects)
        new: dict[str, bytes] = {}
        for digest, data in given:
            if digest not in self._index and digest not in new:
                new[digest] = data
        if not new:
            return 0
        path = self.directory / f"{self.writer}{SUFFIX}"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        created_dir = False
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:  # no packs directory yet
            created_dir = not self.directory.is_dir()
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            mine = identity(st)
            try:
                renamed = mine != identity(os.stat(path))
            except FileNotFoundError:
                renamed = True
            known = self._ids.get(path.name)
            if renamed or (known is not None and known != mine):
                # a collection replaced or removed the pack since we looked: the
                # index may name objects it removed; index again, decide again
                os.close(fd)
                fd = -1
                self._reset()
                return self.put_many(given)
            size = st.st_size
            if size and known == mine and size == self._ends.get(path.name):
                end = size  # as this store left it: nothing appended since to index
            else:
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
            if durable:
                os.fdatasync(fd)
            else:
                self._unsynced.append(os.dup(fd))
            self._ids[path.name] = mine
        finally:
            if fd >= 0:
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

    def ends(self) -> dict[str, int]:
        """Per pack, the end of the last complete object indexed."""
        return dict(self._ends)

    def statistics(self) -> dict[str, int]:
        return {"objects": len(self._index), "packs": len(self._ends)}


def sync_fds(fds: list[int]) -> None:
    """fdatasync each fd (a pack appended with durable=False), then close it."""
    try:
        for fd in fds:
            os.fdatasync(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _read_at(path: Path, offset: int, length: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError:
        return None
    return data if len(data) == length else None


def pack_digests(f: BinaryIO, start: int, limit: int) -> tuple[list[str], int]:
    """The names of the complete objects of the pack open as `f` from offset
    `start` (0: its beginning, after the magic) up to offset `limit`, and the
    offset after the last of them (where the next look starts). Headers only:
    the data is sought over, never read or checked. ([], 0) for a file that is
    not a pack."""
    if start == 0:
        f.seek(0)
        if f.read(len(MAGIC)) != MAGIC:
            return [], 0
        start = len(MAGIC)
    names: list[str] = []
    end = start
    f.seek(end)
    while end + _HEAD.size <= limit:
        raw, length = _HEAD.unpack(f.read(_HEAD.size))
        if length > MAX_OBJECT_BYTES or end + _HEAD.size + length > limit:
            break  # not complete within `limit` (yet)
        names.append(raw.hex())
        end += _HEAD.size + length
        f.seek(end)
    return names, end


def encode_objects(objects: Iterable[tuple[str, bytes]]) -> bytes:
    """Objects in the pack format (each a header and its data; no magic)."""
    return b"".join(_HEAD.pack(bytes.fromhex(digest), len(data)) + data
                    for digest, data in objects)
