"""Restoring a workspace to a tree, touching only what differs.

Idempotent, durable before it returns, nothing followed. See docs/trees.md
("Rewind").
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from actors.changesets import confined
from actors.trees import tree
from actors.trees.store import ObjectStore

_BATCH = 64


@dataclass(frozen=True)
class Restored:
    removed: int
    written: int


def _rmtree_at(dir_fd: int, name: str) -> None:
    """Remove `name` below dir_fd, whatever it is, never following a link."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, confined.DIR_FLAGS, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):
            _rmtree_at(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def restore(workspace: Path, store: ObjectStore, current: str | None, target: str,
            guard: confined.Guard = confined.NO_GUARD) -> Restored:
    """Make the workspace, whose tree is `current`, hold the tree `target`."""
    remove, write = tree.diff(store.get, current, target)
    touched: set[str] = set()
    with confined.open_root(workspace) as root_fd:
        for path in remove:
            parts = path.split("/")
            try:
                with confined.walk(root_fd, parts[:-1], guard) as dir_fd:
                    _rmtree_at(dir_fd, parts[-1])
            except FileNotFoundError:
                continue
            except confined.UnsafeFileError:
                continue  # an ancestor is now a link: its own entry's removal handles it
            touched.add(_parent(path))
        for path in sorted({d for p in remove for d in _ancestors(p)},
                           key=lambda d: -d.count("/")):
            parts = path.split("/")
            try:
                with confined.walk(root_fd, parts[:-1], guard) as dir_fd:
                    os.rmdir(parts[-1], dir_fd=dir_fd)
                touched.add(_parent(path))
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.ENOTDIR, errno.ELOOP):
                    raise
        paths = sorted(write)
        for start in range(0, len(paths), _BATCH):
            _write_batch(root_fd, store, write, paths[start:start + _BATCH], guard, touched)
        _fsync_dirs(root_fd, touched, guard)
    return Restored(len(remove), len(write))


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _ensure_dirs(root_fd: int, parts: list[str], guard: confined.Guard) -> None:
    """Make the directories of `parts`, replacing a non-directory in the way."""
    fd = os.dup(root_fd)
    try:
        for depth, part in enumerate(parts):
            st = confined.lstat_at(fd, part)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                os.unlink(part, dir_fd=fd)  # a file or link where the target has a directory
                st = None
            if st is None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            nxt = confined.open_dir(fd, part, parts[: depth + 1], guard)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def _write_batch(root_fd: int, store: ObjectStore, target: tree.Entries, paths: list[str],  # noqa: PLR0917
                 guard: confined.Guard, touched: set[str]) -> None:
    staged: list[tuple[int, int, str, str]] = []  # dir fd, file fd (-1 link), temp, leaf
    try:
        for path in paths:
            entry = target[path]
            data = store.get(entry.digest)
            parts = path.split("/")
            _ensure_dirs(root_fd, parts[:-1], guard)
            with confined.walk(root_fd, parts[:-1], guard) as dir_fd:
                kept = os.dup(dir_fd)
            leaf = parts[-1]
            st = confined.lstat_at(kept, leaf)
            if st is not None and stat.S_ISDIR(st.st_mode):
                _rmtree_at(kept, leaf)
            tmp = f".{leaf[:100]}.{secrets.token_hex(8)}{confined.TMP_SUFFIX}"
            if entry.mode == tree.LINK_MODE:
                os.symlink(os.fsdecode(data), tmp, dir_fd=kept)
                staged.append((kept, -1, tmp, leaf))
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=kept)
                staged.append((kept, fd, tmp, leaf))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, stat.S_IMODE(entry.mode))
            touched.add(_parent(path))
        files = [fd for _, fd, _, _ in staged if fd >= 0]
        if len(files) > 1:
            with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
                list(pool.map(os.fsync, files))
        elif files:
            os.fsync(files[0])
        for dir_fd, _, tmp, leaf in staged:
            os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        for dir_fd, _, tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        for dir_fd, fd, _, _ in staged:
            if fd >= 0:
                os.close(fd)
            os.close(dir_fd)


def _fsync_dirs(root_fd: int, dirs: set[str], guard: confined.Guard) -> None:
    fds: list[int] = []
    try:
        for rel in sorted(dirs):
            parts = rel.split("/") if rel else []
            try:
                with confined.walk(root_fd, parts, guard) as fd:
                    fds.append(os.dup(fd))
            except (FileNotFoundError, confined.UnsafeFileError):
                continue
        if len(fds) > 1:
            with ThreadPoolExecutor(max_workers=min(8, len(fds))) as pool:
                list(pool.map(os.fsync, fds))
        elif fds:
            os.fsync(fds[0])
    finally:
        for fd in fds:
            os.close(fd)
