"""The append-only ledgers (`budget_ledger.jsonl`, `approvals.jsonl`).

Each line is the exact WAL record; fdatasynced before each checkpoint.
See docs/wal.md ("The ledgers at start-up") and docs/decisions.md ("Ledger
lines are WAL records, fdatasynced at checkpoints").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from actors.writer.wal import parse_record
from broker import durable
from broker.errors import DurabilityError


@dataclass(frozen=True)
class LedgerCheck:
    """A ledger's lines from a known-good offset: the last good seq, and the
    first bad line (to cut from) if any."""

    last_seq: int
    bad_offset: int | None
    size: int
    reason: str = ""


class Ledgers:
    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        self._fds: dict[str, int] = {}
        self._pending: dict[str, list[bytes]] = {}
        self._unsynced: set[str] = set()
        self.appended = 0

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = self.paths[name]
            existed = path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._fds[name] = fd
            if not existed:
                durable.fsync_dir(path.parent)  # the new name is durable before any ack
        return fd

    def add(self, name: str, line: bytes) -> None:
        self._pending.setdefault(name, []).append(line)

    def commit(self) -> None:
        """Write every pending line (not synced: `sync()` before a checkpoint);
        raise DurabilityError on failure."""
        for name, lines in self._pending.items():
            try:
                fd = self._fd(name)
                view = memoryview(b"".join(lines))
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                raise DurabilityError(f"ledger {self.paths[name]}: {exc}") from exc
            self.appended += len(lines)
            self._unsynced.add(name)
        self._pending.clear()

    def sync(self) -> None:
        """fdatasync every ledger written since the last sync (before a checkpoint
        names a head: the ledgers then hold every ledger record up to it)."""
        for name in sorted(self._unsynced):
            try:
                os.fdatasync(self._fd(name))
            except OSError as exc:
                raise DurabilityError(f"ledger {self.paths[name]}: {exc}") from exc
        self._unsynced.clear()

    def take_unsynced(self) -> list[str]:
        """The ledgers written since the last sync, forgotten here: the caller
        syncs them off the loop (`sync_named`) or gives them back on failure."""
        names = sorted(self._unsynced)
        self._unsynced.clear()
        return names

    def restore_unsynced(self, names: list[str]) -> None:
        for name in names:
            self._unsynced.add(name)

    def sync_named(self, names: list[str]) -> None:
        """fdatasync the named ledgers through fds of their own (safe in another
        thread while the loop's fds keep appending); DurabilityError on failure."""
        for name in names:
            try:
                fd = os.open(self.paths[name], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise DurabilityError(f"ledger {self.paths[name]}: {exc}") from exc

    def check(self, name: str, start_offset: int = 0, start_last_seq: int = 0) -> LedgerCheck:
        """Check every line from `start_offset` (a checkpointed size, where the
        ledger's last seq was `start_last_seq`): each must be a whole record of
        this ledger with a seq above the one before. Read-only."""
        path = self.paths[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return LedgerCheck(0, None, 0)
        if size < start_offset:  # shorter than when checkpointed: check it all
            start_offset, start_last_seq = 0, 0
        last_seq, offset = start_last_seq, start_offset
        with open(path, "rb") as f:
            f.seek(start_offset)
            for line in iter(f.readline, b""):
                record = parse_record(line)
                if record is None or record.ledger != name or record.seq <= last_seq:
                    reason = (
                        "torn or damaged line"
                        if record is None
                        else f"seq {record.seq} ({record.ledger}) after {last_seq}"
                    )
                    return LedgerCheck(last_seq, offset, size, reason)
                last_seq = record.seq
                offset += len(line)
        return LedgerCheck(last_seq, None, size)

    def cut(self, name: str, offset: int) -> None:
        """Truncate a ledger at `offset` (a bad line) and make it durable."""
        with open(self.paths[name], "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())

    def sync_existing(self) -> None:
        """fsync every ledger file: lines written before a crash of the writer
        (not of the machine) may still be only in the page cache."""
        for path in self.paths.values():
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def sizes(self) -> dict[str, int]:
        """Each ledger's size now (for the checkpoint; call while no batch is
        in flight, when every line written is durable)."""
        out: dict[str, int] = {}
        for name, path in self.paths.items():
            try:
                out[name] = path.stat().st_size
            except FileNotFoundError:
                out[name] = 0
        return out

    def cut_after(self, name: str, head_seq: int) -> tuple[int, int]:
        """Drop the ledger's lines with seq > head_seq (the WAL lost its tail
        past them, so the ledger must not keep facts the WAL does not have).
        Returns how many lines were dropped and the last seq kept (0: none)."""
        path = self.paths[name]
        data = path.read_bytes()
        cut = len(data)
        dropped = 0
        kept = 0
        while cut > 0:
            start = data.rfind(b"\n", 0, cut - 1) + 1
            record = parse_record(data[start:cut])
            if record is not None and record.seq <= head_seq:
                kept = record.seq
                break
            cut = start
            dropped += 1
        if dropped:
            self.cut(name, cut)
        return dropped, kept

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
