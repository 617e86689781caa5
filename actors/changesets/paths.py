"""Path rules for change sets and file access that never follows a link.

A change-set path is relative, '/'-separated, and refused (ChangeSetRefusedError
with bound `unsafe_path`) when it is absolute, empty, has an empty, `.` or `..`
component, a `.git` component in any letter case (also with the trailing dots,
spaces and ignorable code points that Windows and macOS drop), a backslash or
a control character, starts with `.corral`, or is too long.

Files are reached from an fd of the workspace root, one component at a time
with O_NOFOLLOW | O_DIRECTORY: a symlink anywhere on the way (a write below
a symlink) is refused with bound `symlink`, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from broker.errors import ChangeSetRefusedError

MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255
_IGNORABLE = "".join(chr(c) for c in (
    0x200C, 0x200D, 0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E,
    0x206A, 0x206B, 0x206C, 0x206D, 0x206E, 0x206F, 0xFEFF,
))
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(path: str, detail: str, bound: str = "unsafe_path") -> ChangeSetRefusedError:
    return ChangeSetRefusedError(bound, f"{path!r}: {detail}", path)


def is_git_name(component: str) -> bool:
    cleaned = "".join(ch for ch in component if ch not in _IGNORABLE).rstrip(" .").lower()
    return cleaned in (".git", "git~1")  # git~1: the NTFS short name of .git


def check_path(path: str) -> str:
    """Return `path` if it is a safe change-set path, else raise."""
    if not path:
        raise _refuse(path, "empty path")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise _refuse(path, "path too long")
    if path.startswith("/"):
        raise _refuse(path, "absolute path")
    if "\\" in path:
        raise _refuse(path, "backslash in path")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise _refuse(path, "control character in path")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise _refuse(path, f"component {part!r}")
        if is_git_name(part):
            raise _refuse(path, "a .git component")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            raise _refuse(path, "component too long")
    if parts[0].lower().rstrip(" .") == ".corral":
        raise _refuse(path, "a path into .corral/")
    return path


@contextmanager
def open_root(workspace: str) -> Iterator[int]:
    fd = os.open(workspace, _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def parent_dir(root_fd: int, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """(fd of the directory holding `path`, leaf name), walking without links.
    With `create`, missing directories are made. Refuses a symlink on the way."""
    parts = check_path(path).split("/")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(path, f"{part!r} on the way is a symlink or not a directory",
                                  "symlink") from exc
                raise
            os.close(fd)
            fd = nxt
        yield fd, parts[-1]
    finally:
        os.close(fd)


def read_file(root_fd: int, path: str) -> tuple[bytes, int] | None:
    """(content, st_mode) of a regular file, None if absent; refuses links."""
    try:
        with parent_dir(root_fd, path) as (dir_fd, leaf):
            try:
                fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             dir_fd=dir_fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _refuse(path, "is a symlink", "symlink") from exc
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise _refuse(path, "is not a regular file", "special_file")
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                return b"".join(chunks), st.st_mode
            finally:
                os.close(fd)
    except FileNotFoundError:
        return None


def write_file(root_fd: int, path: str, data: bytes, mode: int) -> None:
    """Replace `path` atomically and durably: a temp file in the same
    directory (O_EXCL | O_NOFOLLOW), fsync, rename, fsync of the directory."""
    with parent_dir(root_fd, path, create=True) as (dir_fd, leaf):
        tmp = f".{leaf[:200]}.corral-tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o755 if mode & 0o111 else 0o644)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            os.unlink(tmp, dir_fd=dir_fd)
            raise _refuse(path, "target is not a regular file", "symlink")
        os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)


def delete_file(root_fd: int, path: str) -> None:
    """Remove a regular file (absent is fine: deletes are idempotent)."""
    try:
        with parent_dir(root_fd, path) as (dir_fd, leaf):
            try:
                st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(path, "is not a regular file", "symlink")
            os.unlink(leaf, dir_fd=dir_fd)
            os.fsync(dir_fd)
    except FileNotFoundError:
        return
