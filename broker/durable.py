"""Small files replaced whole and durably: a crash leaves the old file or the
new one, never a mix. Every checkpoint, registry, manifest, receipt and spec
corral writes goes through here (the WAL and the ledgers are appended, not
replaced: see actors/segments.py and actors/ledgers.py)."""

from __future__ import annotations

import contextlib
import os
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
    rename, fsync of the directory. `read_only` leaves the file mode 0444."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a crash in the middle of an earlier write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if read_only:
            os.fchmod(fd, 0o444)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)
