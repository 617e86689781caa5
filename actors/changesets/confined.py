"""Confined file access: the one implementation of reaching a file below a
root directory without following a link, used by change-set apply
(actors/changesets/paths.py) and by every agent file op
(actors/kernel/workspace.py).

A path is a list of plain components (the callers normalise and check the
text first). From an fd of the root, each directory on the way is opened
with `O_DIRECTORY | O_NOFOLLOW` relative to the fd before it, so a symlink
anywhere (planted, or swapped in by a racing rename) makes the open fail
instead of leading elsewhere; nothing is ever re-opened by name from the
root after a check. Directories whose (st_dev, st_ino) are in the guard's
`protected` set (the state directory and its tiers) are never entered, so
the write-gate holds wherever the state directory sits and whatever name
reaches it.

Files are opened with `O_NOFOLLOW | O_NONBLOCK` and checked on the open fd:
a regular file with exactly one link (a hard link to a file outside would
otherwise be read or replaced through). A write goes to a temp file created
with `O_CREAT | O_EXCL | O_NOFOLLOW` under a random name in the target's
directory fd, is fsynced, renamed onto the target with the same directory
fd as source and destination, and the directory is fsynced.

Errors: `UnsafeFileError` (a PathRefusedError) with `kind` one of
`symlink`, `not_a_directory`, `special_file`, `hard_link`, `protected`,
`is_a_directory`; a missing file is FileNotFoundError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from broker.errors import PathRefusedError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
TMP_SUFFIX = ".corral-tmp"
_TMP_TRIES = 16

Identity = tuple[int, int]  # (st_dev, st_ino)


class UnsafeFileError(PathRefusedError):
    """A component of the path is a link, a special file, a file with more
    than one link, or a protected directory; `kind` says which."""

    def __init__(self, path: str, kind: str, reason: str) -> None:
        super().__init__(path, reason)
        self.kind = kind


@dataclass(frozen=True)
class Guard:
    """What a walk refuses besides links: directories never to enter."""

    protected: frozenset[Identity] = frozenset()
    label: str = "the state directory"


NO_GUARD = Guard()


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def identities(paths: Sequence[os.PathLike[str] | str]) -> frozenset[Identity]:
    """(dev, ino) of each existing directory among `paths` (followed: these
    are the operator's own paths, not the model's)."""
    found = set()
    for path in paths:
        try:
            found.add(identity(os.stat(path)))
        except OSError:
            continue
    return frozenset(found)


@contextmanager
def open_root(root: str | os.PathLike[str]) -> Iterator[int]:
    """An fd of the root directory (the root itself is the operator's: followed)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _shown(parts: Sequence[str]) -> str:
    return "/".join(parts) or "."


def _check_dir(fd: int, parts: Sequence[str], guard: Guard) -> None:
    if identity(os.fstat(fd)) in guard.protected:
        raise UnsafeFileError(_shown(parts), "protected",
                              f"write-gate: {_shown(parts)!r} is {guard.label}")


def open_dir(dir_fd: int, name: str, parts: Sequence[str], guard: Guard) -> int:
    """Open `name` below `dir_fd` as a directory, never through a link."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = _kind_at(dir_fd, name)
            raise UnsafeFileError(_shown(parts), kind, f"{_shown(parts)!r} is "
                                  f"{'a symlink' if kind == 'symlink' else 'not a directory'}"
                                  ) from exc
        raise
    try:
        _check_dir(fd, parts, guard)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind_at(dir_fd: int, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "symlink"  # it changed under us: call it what the open saw
    return "symlink" if stat.S_ISLNK(st.st_mode) else "not_a_directory"


@contextmanager
def walk(root_fd: int, parts: Sequence[str], guard: Guard = NO_GUARD, *,
         create: bool = False, dir_mode: int = 0o777) -> Iterator[int]:
    """An fd of the directory `parts` names below `root_fd` (every component
    a real directory, none protected). With `create`, missing ones are made."""
    fd = os.dup(root_fd)
    try:
        for depth, part in enumerate(parts):
            try:
                nxt = open_dir(fd, part, parts[: depth + 1], guard)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_mode, dir_fd=fd)
                nxt = open_dir(fd, part, parts[: depth + 1], guard)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def lstat_at(dir_fd: int, leaf: str) -> os.stat_result | None:
    try:
        return os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def check_leaf(st: os.stat_result, parts: Sequence[str], guard: Guard, *,
               allow_dir: bool = False) -> None:
    """Refuse a leaf that is a link, a special file, a multi-linked file, a
    protected directory (or any directory unless `allow_dir`)."""
    shown = _shown(parts)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(shown, "symlink", f"{shown!r} is a symlink (links are not followed)")
    if stat.S_ISDIR(st.st_mode):
        if identity(st) in guard.protected:
            raise UnsafeFileError(shown, "protected", f"write-gate: {shown!r} is {guard.label}")
        if not allow_dir:
            raise UnsafeFileError(shown, "is_a_directory", f"{shown!r} is a directory")
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(shown, "special_file", f"{shown!r} is not a regular file")
    if st.st_nlink > 1:
        raise UnsafeFileError(shown, "hard_link", f"{shown!r} has {st.st_nlink} links "
                              "(a file with more than one link is refused)")


def open_file(dir_fd: int, leaf: str, parts: Sequence[str], guard: Guard) -> int:
    """An fd of the regular, singly-linked file `leaf`; FileNotFoundError if absent."""
    try:
        fd = os.open(leaf, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(_shown(parts), "symlink",
                                  f"{_shown(parts)!r} is a symlink (links are not followed)"
                                  ) from exc
        raise
    try:
        check_leaf(os.fstat(fd), parts, guard)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_all(fd: int, limit: int | None = None) -> bytes:
    chunks = []
    total = 0
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
        total += len(chunk)
        if limit is not None and total > limit:
            break
    return b"".join(chunks)


def read(root_fd: int, parts: Sequence[str], guard: Guard = NO_GUARD,
         limit: int | None = None) -> tuple[bytes, int] | None:
    """(content, st_mode) of the file at `parts`, None when it (or a directory
    on the way) does not exist."""
    try:
        with walk(root_fd, parts[:-1], guard) as dir_fd:
            fd = open_file(dir_fd, parts[-1], parts, guard)
            try:
                return read_all(fd, limit), os.fstat(fd).st_mode
            finally:
                os.close(fd)
    except FileNotFoundError:
        return None


def _temp(dir_fd: int, leaf: str, mode: int) -> tuple[int, str]:
    for _ in range(_TMP_TRIES):
        name = f".{leaf[:100]}.{os.urandom(8).hex()}{TMP_SUFFIX}"  # (what secrets.token_hex reads)
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                           | os.O_CLOEXEC, mode, dir_fd=dir_fd), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp name", leaf)


_LEFTOVER = re.compile(r"^\..+\.[0-9a-f]{16}" + re.escape(TMP_SUFFIX) + "$")
_MAX_DEPTH = 256


def remove_leftovers(root_fd: int, guard: Guard = NO_GUARD) -> int:
    """Unlink the temporary files `write()` left behind when its process was
    killed between creating one and renaming it into place (regular files
    named `.<leaf>.<16 hex>.corral-tmp`), anywhere below `root_fd`, never
    through a link and never inside a protected directory. Returns how many
    went. Only for a writer that has just restarted: a live `write()` of the
    same tree would lose its temporary file."""
    removed = 0

    def sweep(dir_fd: int, parts: list[str]) -> None:
        nonlocal removed
        if len(parts) > _MAX_DEPTH:
            return
        with os.scandir(dir_fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False),
                      e.is_file(follow_symlinks=False)) for e in entries]
        for name, is_dir, is_file in names:
            if is_file and _LEFTOVER.match(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
            elif is_dir:
                try:
                    fd = open_dir(dir_fd, name, [*parts, name], guard)
                except (UnsafeFileError, OSError):
                    continue  # a link, a protected or vanished directory: not ours to sweep
                try:
                    sweep(fd, [*parts, name])
                finally:
                    os.close(fd)

    sweep(root_fd, [])
    return removed


def write(root_fd: int, parts: Sequence[str], data: bytes, guard: Guard = NO_GUARD, *,
          mode: int | None = None, create_dirs: bool = True) -> None:
    """Replace the file at `parts` atomically and durably. `mode` None keeps
    an existing file's permission bits (a new one gets 0o666 less the umask)."""
    with walk(root_fd, parts[:-1], guard, create=create_dirs) as dir_fd:
        leaf = parts[-1]
        before = lstat_at(dir_fd, leaf)
        if before is not None:
            check_leaf(before, parts, guard)
        fd, tmp = _temp(dir_fd, leaf, 0o666 if mode is None else 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                want = mode if mode is not None else (
                    stat.S_IMODE(before.st_mode) if before is not None else None)
                if want is not None and stat.S_IMODE(os.fstat(fd).st_mode) != want:
                    os.fchmod(fd, want)
                os.fsync(fd)
            finally:
                os.close(fd)
            now = lstat_at(dir_fd, leaf)  # refuse a leaf swapped for a directory or link
            if now is not None:
                check_leaf(now, parts, guard)
            os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)


def delete(root_fd: int, parts: Sequence[str], guard: Guard = NO_GUARD) -> None:
    """Remove the regular file at `parts` (absent is fine: deletes are idempotent)."""
    try:
        with walk(root_fd, parts[:-1], guard) as dir_fd:
            st = lstat_at(dir_fd, parts[-1])
            if st is None:
                return
            check_leaf(st, parts, guard)
            os.unlink(parts[-1], dir_fd=dir_fd)
            os.fsync(dir_fd)
    except FileNotFoundError:
        return
