"""Compaction of one sealed WAL segment: the records of purged sessions removed.

Steps written, recorded, swapped, indexed (each a `CORRAL_FAULT_GC_KILL_AT`
point). See docs/storage.md ("Compaction").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.writer.wal import WalRecord, parse_record
from broker.durable import fsync_dir
from broker.errors import WalCorruptionError

FAULT_ENV_GC_KILL_AT = "CORRAL_FAULT_GC_KILL_AT"
WRITE_CHUNK_BYTES = 1 << 20


def fault_point(step: str) -> None:
    """SIGKILL this process when the fault injection names `step`."""
    if os.environ.get(FAULT_ENV_GC_KILL_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def temp_path(segment: Path) -> Path:
    return segment.with_name(f".{segment.name}.compact")


@dataclass
class Rewrite:
    """A segment rewritten to its temp file, not yet swapped in."""

    first_seq: int
    path: Path
    tmp: Path
    kept: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # seq, off, len
    dropped: dict[str, list[int]] = field(default_factory=dict)  # stream -> seqs
    dropped_ledger: dict[str, set[int]] = field(default_factory=dict)  # ledger -> seqs
    bytes_before: int = 0
    bytes_after: int = 0

    def dropped_seqs(self) -> set[int]:
        return {seq for seqs in self.dropped.values() for seq in seqs}

    def ranges(self) -> list[tuple[int, int]]:
        """The removed seqs as inclusive ranges of consecutive seqs."""
        out: list[tuple[int, int]] = []
        for seq in sorted(self.dropped_seqs()):
            if out and seq == out[-1][1] + 1:
                out[-1] = (out[-1][0], seq)
            else:
                out.append((seq, seq))
        return out


def rewrite(first_seq: int, path: Path, drop: Callable[[WalRecord], bool]) -> Rewrite:
    """Write the segment's records that `drop` does not select to its temp file
    and fsync it. A damaged record refuses the compaction (WalCorruptionError):
    damage is never rewritten into a segment that looks whole."""
    tmp = temp_path(path)
    result = Rewrite(first_seq, path, tmp)
    out_offset = 0
    buffer: list[bytes] = []
    buffered = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with open(path, "rb", buffering=WRITE_CHUNK_BYTES) as f:
            offset = 0
            for line in f:
                record = _checked(path, offset, line)
                offset += len(line)
                if drop(record):
                    result.dropped.setdefault(record.stream, []).append(record.seq)
                    if record.ledger is not None:
                        result.dropped_ledger.setdefault(record.ledger, set()).add(record.seq)
                    continue
                result.kept.setdefault(record.stream, []).append(
                    (record.seq, out_offset, len(line))
                )
                out_offset += len(line)
                buffer.append(line)
                buffered += len(line)
                if buffered >= WRITE_CHUNK_BYTES:
                    _write_all(fd, b"".join(buffer))
                    buffer.clear()
                    buffered = 0
            result.bytes_before = offset
        _write_all(fd, b"".join(buffer))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    result.bytes_after = out_offset
    return result


def rewrite_in_child(todo: list[tuple[int, Path]], purged: dict[str, list[tuple[int, int]]]
                     ) -> list[Rewrite]:
    """`rewrite` of every segment in `todo`, in one child process (`python -m
    actors.writer.compactor`), so that its CPU work never holds the writer's
    GIL (appends go on at full speed); the calling thread only waits for it.
    Raises OSError when it fails."""
    if not todo:
        return []
    result_path = temp_path(todo[0][1]).with_suffix(".result")
    done = subprocess.run(
        [sys.executable, "-m", "actors.writer.compactor", json.dumps(purged), str(result_path),
         *(f"{first}:{path}" for first, path in todo)],
        stdin=subprocess.DEVNULL, capture_output=True, check=False,
    )
    try:
        if done.returncode != 0:
            raise OSError(f"compactor exited {done.returncode}: "
                          f"{done.stderr.decode(errors='replace')[-300:]}")
        items = json.loads(result_path.read_bytes())
    finally:
        result_path.unlink(missing_ok=True)
    out = []
    for (first, path), data in zip(todo, items, strict=True):
        result = Rewrite(first, path, temp_path(path),
                         bytes_before=data["bytes_before"], bytes_after=data["bytes_after"])
        result.kept = {s: [tuple(e) for e in entries] for s, entries in data["kept"].items()}
        result.dropped = data["dropped"]
        result.dropped_ledger = {k: set(v) for k, v in data["dropped_ledger"].items()}
        out.append(result)
    fault_point("written")
    return out


def to_dict(result: Rewrite) -> dict[str, object]:
    return {
        "bytes_before": result.bytes_before, "bytes_after": result.bytes_after,
        "kept": result.kept, "dropped": result.dropped,
        "dropped_ledger": {k: sorted(v) for k, v in result.dropped_ledger.items()},
    }


def swap(result: Rewrite) -> None:
    """Rename the rewritten segment over the old one and make it durable."""
    os.replace(result.tmp, result.path)
    fsync_dir(result.path.parent)
    fault_point("swapped")


def _checked(path: Path, offset: int, line: bytes) -> WalRecord:
    record = parse_record(line)
    if record is None:
        raise WalCorruptionError(path, offset, "damaged record: not compacted")
    return record


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
