"""The writer on a full or failing disk: roll back, refuse, probe, resume.

See docs/storage.md ("A full disk").
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from actors.writer.ledgers import Ledgers
from actors.writer.segments import ActiveSegment
from broker.errors import DurabilityError

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
PROBE_INTERVAL_S = 0.5
RESERVE_BYTES = 1024 * 1024  # free space needed before appends resume
PROBE_BYTES = 64 * 1024
PROBE_NAME = ".space-probe"


def space_errno(exc: BaseException) -> int | None:
    """The errno of a full or failing disk behind `exc`, else None."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in SPACE_ERRNOS:
            return cause.errno
        cause = cause.__cause__
    return None


def free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


@dataclass
class StorageFull:
    """The writer is stopped: where and why, and when it last probed."""

    path: str
    error: str
    errno: int
    free_bytes: int
    since: float
    probed_at: float = 0.0
    probes: int = 0


def rollback(segment: ActiveSegment, batch_offset: int, ledgers: Ledgers, head_seq: int) -> None:
    """Cut the failed batch out of the active segment and the ledgers, durably.
    Raises DurabilityError when even that fails (the caller exits 74)."""
    try:
        fd = os.open(segment.path, os.O_WRONLY)
        try:
            os.ftruncate(fd, batch_offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        segment.size = batch_offset
        ledgers._pending.clear()  # the failed batch's ledger lines were never written
        for name, path in ledgers.paths.items():
            if path.exists():
                ledgers.cut_after(name, head_seq)
        ledgers.sync_existing()
    except OSError as exc:
        raise DurabilityError(
            f"rollback of a failed batch in {segment.path} failed: {exc}"
        ) from exc


def probe(directory: Path) -> bool:
    """True when `directory`'s filesystem has room again and takes a write and
    an fsync (the probe file is removed again)."""
    if free_bytes(directory) < RESERVE_BYTES:
        return False
    path = directory / PROBE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    return True


def stopped(exc: DurabilityError, path: Path, code: int) -> StorageFull:
    return StorageFull(
        path=str(path),
        error=f"{errno.errorcode.get(code, code)}: {exc}"[:500],
        errno=code,
        free_bytes=free_bytes(path.parent),
        since=time.time(),
    )
