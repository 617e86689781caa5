"""The append-only ledgers (`state/budget_ledger.jsonl`, `approvals.jsonl`):
each line is the exact WAL record of a ledger append, so a ledger is a
projection of the WAL that the writer can always complete from it. Only the
writer writes them; a batch's ledger lines are fdatasynced before any append
in the batch is acknowledged."""

from __future__ import annotations

import os
from pathlib import Path

from actors.writer.wal import parse_record
from broker.errors import DurabilityError

TAIL_READ_BYTES = 2 * 1024 * 1024


class Ledgers:
    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        self._fds: dict[str, int] = {}
        self._pending: dict[str, list[bytes]] = {}
        self.appended = 0

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = os.open(self.paths[name], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._fds[name] = fd
        return fd

    def add(self, name: str, line: bytes) -> None:
        self._pending.setdefault(name, []).append(line)

    def commit(self) -> None:
        """Write and fdatasync every pending line; raise DurabilityError on failure."""
        for name, lines in self._pending.items():
            fd = self._fd(name)
            try:
                view = memoryview(b"".join(lines))
                while view:
                    view = view[os.write(fd, view) :]
                os.fdatasync(fd)
            except OSError as exc:
                raise DurabilityError(f"ledger {self.paths[name]}: {exc}") from exc
            self.appended += len(lines)
        self._pending.clear()

    def repair_and_last_seq(self, name: str) -> tuple[int, int | None]:
        """Cut a torn last line; return (last seq in the ledger or 0, cut offset)."""
        path = self.paths[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0, None
        if size == 0:
            return 0, None
        with open(path, "rb") as f:
            start = max(0, size - TAIL_READ_BYTES)
            f.seek(start)
            tail = f.read()
        cut: int | None = None
        end = len(tail)
        if not tail.endswith(b"\n"):
            end = tail.rfind(b"\n") + 1
            cut = start + end
        last_start = tail.rfind(b"\n", 0, max(0, end - 1)) + 1
        last_seq = 0
        if end > 0:
            record = parse_record(tail[last_start:end])
            if record is None:
                # a damaged last line: cut it, the WAL still has the record
                cut = start + last_start
                prev_start = tail.rfind(b"\n", 0, max(0, last_start - 1)) + 1
                prev = parse_record(tail[prev_start:last_start]) if last_start else None
                last_seq = prev.seq if prev is not None else 0
            else:
                last_seq = record.seq
        if cut is not None:
            with open(path, "r+b") as f:
                f.truncate(cut)
                os.fsync(f.fileno())
        return last_seq, cut

    def cut_after(self, name: str, head_seq: int) -> int:
        """Drop the ledger's lines with seq > head_seq (the WAL lost its tail
        past them, so the ledger must not keep facts the WAL does not have).
        Returns how many lines were dropped."""
        path = self.paths[name]
        data = path.read_bytes()
        cut = len(data)
        dropped = 0
        while cut > 0:
            start = data.rfind(b"\n", 0, cut - 1) + 1
            record = parse_record(data[start:cut])
            if record is not None and record.seq <= head_seq:
                break
            cut = start
            dropped += 1
        if dropped:
            with open(path, "r+b") as f:
                f.truncate(cut)
                os.fsync(f.fileno())
        return dropped

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
