"""Snapshots: copy a parent's workspace into a child's isolated directory and
index the base it came from, without following links.

The base is kept as one pack file (`base.pack`: every file's bytes end to
end) and an index (`base.json`: path -> sha256, size, mode, pack offset, and
the stat identity of the child's copy). Building a change set then reads
only what the child touched: a copy whose (inode, size, mtime, ctime) is
unchanged was not written (ctime cannot be set by a program).
`.git` (any case, anywhere) and a top-level `.corral` are not copied.
Symlinks are copied as links and indexed with their target's hash, so a
child that changes one is refused, never followed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

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


class BaseIndex:
    def __init__(self, directory: Path, entries: dict[str, BaseEntry]) -> None:
        self.directory = directory
        self.entries = entries

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


def snapshot(source: Path, base_dir: Path, work_dir: Path) -> BaseIndex:
    """Copy `source` into `work_dir` and index it into `base_dir`."""
    base_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=False)
    entries: dict[str, BaseEntry] = {}
    offset = 0
    pack = os.open(base_dir / PACK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        stack: list[list[str]] = [[]]
        while stack:
            rel_parts = stack.pop()
            src_dir = source.joinpath(*rel_parts)
            dst_dir = work_dir.joinpath(*rel_parts)
            with os.scandir(src_dir) as it:
                items = sorted(it, key=lambda e: e.name)
            for item in items:
                if _skip(rel_parts, item.name):
                    continue
                rel = "/".join([*rel_parts, item.name])
                dst = dst_dir / item.name
                if item.is_symlink():
                    target = os.readlink(item.path)
                    os.symlink(target, dst)
                    entries[rel] = BaseEntry(hashlib.sha256(os.fsencode(target)).hexdigest(),
                                             0, 0o120000, -1,
                                             copy_key(os.lstat(dst)))
                elif item.is_dir(follow_symlinks=False):
                    dst.mkdir()
                    stack.append([*rel_parts, item.name])
                elif item.is_file(follow_symlinks=False):
                    fd = os.open(item.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        st = os.fstat(fd)
                        data = os.read(fd, st.st_size + 1) if st.st_size < (1 << 26) else b""
                        if len(data) != st.st_size:
                            data = Path(item.path).read_bytes()
                    finally:
                        os.close(fd)
                    mode = git_mode(st.st_mode)
                    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                  0o755 if mode == 0o100755 else 0o644)
                    try:
                        write_all(out, data)
                        key = copy_key(os.fstat(out))  # after the last write: final times
                    finally:
                        os.close(out)
                    write_all(pack, data)
                    entries[rel] = BaseEntry(hashlib.sha256(data).hexdigest(), len(data), mode,
                                             offset, key)
                    offset += len(data)
    finally:
        os.close(pack)
    index = BaseIndex(base_dir, entries)
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
