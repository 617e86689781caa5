"""Snapshots: a parent's workspace copied for a child, its base indexed.

See docs/changesets.md ("Files").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from actors.changesets import confined
from actors.changesets.paths import is_git_name

INDEX = "base.json"
PACK = "base.pack"


@dataclass(frozen=True)
class BaseEntry:
    sha256: str
    size: int
    mode: int  # 0o100644, 0o100755 or 0o120000 (symlink)
    offset: int  # in base.pack (-1 for a symlink)
    copy_key: tuple[int, int, int, int]  # (ino, size, mtime_ns, ctime_ns) of the child's copy


CopyStat = tuple[int, int, int, int, int]  # st_mode, st_ino, st_size, st_mtime_ns, st_ctime_ns


class BaseIndex:
    def __init__(self, directory: Path, entries: dict[str, BaseEntry],
                 copies: dict[str, CopyStat] | None = None) -> None:
        self.directory = directory
        self.entries = entries
        # in memory only, from `snapshot` (not saved): each regular file's copy
        # as lstat shows it once written, with its mode (the child's stat cache
        # is seeded from it: actors/trees/statcache.py, `seed`)
        self.copies: dict[str, CopyStat] = copies if copies is not None else {}

    def content(self, path: str) -> bytes:
        entry = self.entries[path]
        fd = os.open(self.directory / PACK, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, entry.size, entry.offset) if entry.size else b""
        finally:
            os.close(fd)

    def digest(self) -> str:
        """One hash naming this exact base."""
        h = hashlib.sha256()
        for path in sorted(self.entries):
            e = self.entries[path]
            h.update(f"{path}\0{e.sha256}\0{e.mode:o}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def save(self) -> None:
        """`{"version": 1, "entries": {path: [sha256, size, mode, offset, copy_key]}}`."""
        body = {p: [e.sha256, e.size, e.mode, e.offset, e.copy_key]
                for p, e in self.entries.items()}
        (self.directory / INDEX).write_text(
            json.dumps({"version": 1, "entries": body}, separators=(",", ":")))

    @classmethod
    def load(cls, directory: Path) -> BaseIndex:
        raw = json.loads((directory / INDEX).read_text())
        if raw.get("version") != 1:
            raise ValueError(f"{directory / INDEX}: version {raw.get('version')!r}, expected 1")
        entries = {p: BaseEntry(e[0], e[1], e[2], e[3], tuple(e[4]))
                   for p, e in raw["entries"].items()}
        return cls(directory, entries)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def copy_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def git_mode(st_mode: int) -> int:
    if stat.S_ISLNK(st_mode):
        return 0o120000
    return 0o100755 if st_mode & 0o100 else 0o100644


def _skip(rel_parts: list[str], name: str) -> bool:
    return is_git_name(name) or (not rel_parts and name.lower() == ".corral")


def _copy_file(dir_fd: int, name: str) -> tuple[bytes, os.stat_result] | None:
    """A regular file's bytes and stat, read through its directory fd (None:
    gone, or no longer a regular file)."""
    try:
        fd = os.open(name, confined.FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return (confined.read_all(fd), st) if stat.S_ISREG(st.st_mode) else None
    finally:
        os.close(fd)


PACK_FLUSH_BYTES = 1 << 20  # the pack is written in pieces of about this size
_COPY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class _Copy:
    """One snapshot in progress: where copies and packed bytes go."""

    pack: int
    guard: confined.Guard
    entries: dict[str, BaseEntry]
    copies: dict[str, CopyStat]
    # directories still to copy: (path parts, the source's fd, the copy's fd)
    stack: list[tuple[list[str], int, int]]
    offset: int = 0  # where the next file's bytes start in the pack
    pending: list[bytes] = field(default_factory=list)  # bytes not yet written to it
    pending_bytes: int = 0

    def pack_bytes(self, data: bytes) -> int:
        """Queue `data` for the pack; return its offset there."""
        at = self.offset
        self.pending.append(data)
        self.pending_bytes += len(data)
        self.offset += len(data)
        if self.pending_bytes >= PACK_FLUSH_BYTES:
            self.flush_pack()
        return at

    def flush_pack(self) -> None:
        if self.pending:
            write_all(self.pack, b"".join(self.pending))
            self.pending, self.pending_bytes = [], 0


def _copy_dir(copy: _Copy, dir_fd: int, dst_fd: int, rel_parts: list[str]) -> None:
    """Copy one directory's entries into the directory `dst_fd`; its
    subdirectories go on the stack as fds. An entry's kind is its directory
    entry's (no lstat where the filesystem reports it); every open that
    follows checks it again without following a link, so an entry swapped
    meanwhile is copied as what it is then or skipped, never followed."""
    entries, guard = copy.entries, copy.guard
    with os.scandir(dir_fd) as it:
        listed = sorted((item for item in it if not _skip(rel_parts, item.name)),
                        key=lambda item: item.name)
    for item in listed:
        name = item.name
        rel = "/".join([*rel_parts, name])
        try:
            is_link = item.is_symlink()
            is_dir = not is_link and item.is_dir(follow_symlinks=False)
            is_file = not is_link and not is_dir and item.is_file(follow_symlinks=False)
        except OSError:
            continue  # gone since the listing
        if is_link:
            try:
                target = os.readlink(name, dir_fd=dir_fd)
            except OSError:
                continue  # gone, or no longer a link
            os.symlink(target, name, dir_fd=dst_fd)
            key = copy_key(os.stat(name, dir_fd=dst_fd, follow_symlinks=False))
            entries[rel] = BaseEntry(hashlib.sha256(os.fsencode(target)).hexdigest(),
                                     0, 0o120000, -1, key)
        elif is_dir:
            try:
                sub = confined.open_dir(dir_fd, name, [*rel_parts, name], guard)
            except (OSError, confined.UnsafeFileError):
                continue  # the state directory, or swapped for a link meanwhile: not copied
            try:
                os.mkdir(name, 0o777, dir_fd=dst_fd)
                sub_dst = os.open(name, confined.DIR_FLAGS, dir_fd=dst_fd)
            except BaseException:
                os.close(sub)
                raise
            copy.stack.append(([*rel_parts, name], sub, sub_dst))
        elif is_file:
            found = _copy_file(dir_fd, name)
            if found is None:
                continue
            data, fst = found
            mode = git_mode(fst.st_mode)
            out = os.open(name, _COPY_FLAGS, 0o755 if mode == 0o100755 else 0o644,
                          dir_fd=dst_fd)
            try:
                write_all(out, data)
                ost = os.fstat(out)  # after the last write: final times
            finally:
                os.close(out)
            entries[rel] = BaseEntry(hashlib.sha256(data).hexdigest(), len(data), mode,
                                     copy.pack_bytes(data), copy_key(ost))
            copy.copies[rel] = (ost.st_mode, ost.st_ino, ost.st_size, ost.st_mtime_ns,
                                ost.st_ctime_ns)


def snapshot(source: Path, base_dir: Path, work_dir: Path,
             guard: confined.Guard = confined.NO_GUARD) -> BaseIndex:
    """Copy `source` into `work_dir` and index it into `base_dir`, walking
    `source` through directory fds without following a link (a directory
    swapped for a symlink meanwhile is not copied, nor one `guard` protects:
    the state directory). The copies are made through directory fds too."""
    base_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=False)
    entries: dict[str, BaseEntry] = {}
    pack = os.open(base_dir / PACK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    copy = _Copy(pack, guard, entries, {}, [])
    try:
        src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dst = os.open(work_dir, confined.DIR_FLAGS)
        except BaseException:
            os.close(src)
            raise
        copy.stack.append(([], src, dst))
        while copy.stack:
            rel_parts, dir_fd, dst_fd = copy.stack.pop()
            try:
                _copy_dir(copy, dir_fd, dst_fd, rel_parts)
            finally:
                os.close(dir_fd)
                os.close(dst_fd)
        copy.flush_pack()
    finally:
        for _, fd, dst_fd in copy.stack:
            os.close(fd)
            os.close(dst_fd)
        os.close(pack)
    index = BaseIndex(base_dir, entries, copy.copies)
    index.save()
    return index


def index_tree(tree: Path, base_dir: Path) -> BaseIndex:
    """Index an existing base tree (no child copy): copy keys are never equal,
    so every path present in both trees is compared by content."""
    scratch = base_dir / "scratch-copy"
    index = snapshot(tree, base_dir, scratch)
    entries = {p: BaseEntry(e.sha256, e.size, e.mode, e.offset, (-1, -1, -1, -1))
               for p, e in index.entries.items()}
    shutil.rmtree(scratch)
    result = BaseIndex(base_dir, entries)
    result.save()
    return result
