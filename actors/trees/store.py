"""The content-addressed object store of workspace trees: file contents and
tree objects, each named by the sha256 of its bytes, deduplicated.

    .corral/trees/packs/<sha256 of the pack's bytes>.pack

Objects are written in packs, one pack per capture (every new object of the
capture and its tree), so a capture costs one file fsync and one directory
fsync however many files changed (an fsync is ~10 ms on the disks we run on;
one per blob would make capture cost follow the number of changed files
times that). A pack is written to a temp name, fsynced, renamed, and the
directory fsynced, before the WAL fact that names its tree is appended: a
pack no fact names is garbage, never a hole. Pack format (version 1):

    b"CTPK1\\n" then, per object: 32 bytes sha256, 8 bytes big-endian length, data

The reader indexes every pack at open (headers only, seeking over data) and
checks an object's digest whenever it reads it: a damaged or forged object is
`CorruptObjectError`, never returned. A truncated pack (a crash while it was
a temp file cannot leave one under its final name, but a hostile disk can)
indexes the objects before the damage.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
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
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._index: dict[str, tuple[Path, int, int]] = {}
        self._seen: set[str] = set()
        self.refresh()

    def refresh(self) -> None:
        """Index packs written since the last look (by this or another process)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in sorted(names):
            if name.endswith(SUFFIX) and name not in self._seen:
                self._seen.add(name)
                self._index_pack(self.directory / name)

    def _index_pack(self, path: Path) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            return
        with f:
            if f.read(len(MAGIC)) != MAGIC:
                return
            while True:
                head = f.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return
                raw, length = _HEAD.unpack(head)
                offset = f.tell()
                if length > MAX_OBJECT_BYTES:
                    return
                f.seek(length, os.SEEK_CUR)
                if f.tell() != offset + length or os.fstat(f.fileno()).st_size < offset + length:
                    return
                self._index.setdefault(raw.hex(), (path, offset, length))

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
        """Write the objects the store lacks as one durable pack; return how many."""
        new: dict[str, bytes] = {}
        for digest, data in objects:
            if digest not in self._index and digest not in new:
                new[digest] = data
        if not new:
            return 0
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.directory.parent)  # the new names are durable before a fact uses them
            fsync_dir(self.directory.parent.parent)
        hasher = hashlib.sha256()
        tmp = self.directory / f".{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        offsets: list[tuple[str, int, int]] = []
        try:
            try:
                pos = 0
                chunks = [MAGIC]
                pos += len(MAGIC)
                for digest, data in new.items():
                    head = _HEAD.pack(bytes.fromhex(digest), len(data))
                    chunks.append(head)
                    chunks.append(data)
                    offsets.append((digest, pos + len(head), len(data)))
                    pos += len(head) + len(data)
                body = b"".join(chunks)
                hasher.update(body)
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            final = self.directory / f"{hasher.hexdigest()}{SUFFIX}"
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(self.directory)
        self._seen.add(final.name)
        for digest, offset, length in offsets:
            self._index.setdefault(digest, (final, offset, length))
        return len(new)

    def statistics(self) -> dict[str, int]:
        return {"objects": len(self._index), "packs": len(self._seen)}
