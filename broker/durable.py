"""Small files replaced whole and durably, and small journals appended to.

A crash leaves the old file or the new one, never a mix; nothing is reached
through a link. See docs/state-layout.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the names in a directory (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: Path, data: bytes, *, read_only: bool = False, sync_dir: bool = True
) -> None:
    """Replace `path` with `data`: temp file (never following a link), fsync,
    rename, fsync of the directory. `read_only` leaves the file mode 0400
    (read-only, and private like every file corral writes)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a crash in the middle of an earlier write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if read_only:
                os.fchmod(fd, 0o400)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk keeps no half-written temp file
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)


_APPEND = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
           | os.O_NONBLOCK)


def open_append(path: Path, mode: int = 0o666) -> int:
    """An fd appending to the regular file at `path` (made if absent), for a
    journal that keeps it open. A link, a fifo or a device at the name is
    removed and a new file made: never written through, never waited on
    (O_NONBLOCK: a fifo with no reader). A directory there raises."""
    for _ in range(2):
        try:
            fd = os.open(path, _APPEND, mode)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):
                raise
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    raise OSError(errno.EEXIST, "the name was taken again as it was replaced", str(path))


def read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file at `path`; None when there is none, or
    when the name is a link, a fifo or anything else (never read through,
    never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO):
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
