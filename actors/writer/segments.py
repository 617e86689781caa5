"""The active WAL segment: appending a batch, fdatasync, rotation.

Any OSError becomes DurabilityError: the caller must not acknowledge.
See docs/wal.md ("Files").
"""

from __future__ import annotations

import os
from pathlib import Path

from actors.writer.wal import segment_name
from broker.durable import fsync_dir
from broker.errors import DurabilityError

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
# Fault injection for tests and the soak run: fail the Nth fdatasync with EIO.
FAULT_ENV_FAIL_SYNC_AT = "CORRAL_FAULT_FAIL_FDATASYNC_AT"


class ActiveSegment:
    def __init__(self, wal_dir: Path, first_seq: int, segment_bytes: int) -> None:
        self.wal_dir = wal_dir
        self.segment_bytes = segment_bytes
        self.first_seq = first_seq
        self.path = wal_dir / segment_name(first_seq)
        self._fd = -1
        self.size = 0
        self.rotations = 0
        self.syncs = 0
        # a pass found a purged session's records here (actors/writer/walgc.py)
        # and seals the segment at once, between batches, to compact it
        self.seal_requested = False
        self._fail_sync_at = int(os.environ.get(FAULT_ENV_FAIL_SYNC_AT, "0") or 0)
        self._open()

    def _open(self) -> None:
        existed = self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.size = os.fstat(self._fd).st_size
            if not existed:
                fsync_dir(self.wal_dir)
        except OSError as exc:
            raise DurabilityError(f"cannot open WAL segment {self.path}: {exc}") from exc

    def write(self, data: bytes) -> int:
        """Append `data`; return the offset it starts at (not yet durable)."""
        start = self.size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise DurabilityError(f"write to {self.path} failed: {exc}") from exc
        self.size += len(data)
        return start

    def sync(self) -> None:
        self.syncs += 1
        if self.syncs == self._fail_sync_at:
            raise DurabilityError(f"fdatasync of {self.path} failed: injected EIO")
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise DurabilityError(f"fdatasync of {self.path} failed: {exc}") from exc

    def rotation_due(self) -> bool:
        """Full, or asked to be sealed and holding a record."""
        return self.size >= self.segment_bytes or (self.seal_requested and self.size > 0)

    def rotate_if_full(self, next_seq: int) -> bool:
        """Start a new segment at `next_seq` once this one reached its size
        (or was asked to be sealed)."""
        if not self.rotation_due():
            return False
        self.seal_requested = False
        self.close()
        self.first_seq = next_seq
        self.path = self.wal_dir / segment_name(next_seq)
        self._open()
        self.rotations += 1
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
