"""The record of what storage collection removed on purpose.

Owns `state/wal.retention.json`. See docs/storage.md ("WAL retention").
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from broker.durable import write_atomic
from broker.errors import WalError

RETENTION_VERSION = 1
FILENAME = "wal.retention.json"


class RetentionState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = RETENTION_VERSION
    floor_seq: int = 1
    epoch: int = 0
    compacted: list[tuple[int, int]] = []


def path_in(state_dir: Path) -> Path:
    return state_dir / FILENAME


def load(path: Path) -> RetentionState:
    """The state (the default when the file is absent). A file that exists but
    does not parse is refused: without it a truncated WAL looks like loss."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return RetentionState()
    except OSError as exc:
        raise WalError(f"cannot read {path}: {exc}") from exc
    try:
        state = RetentionState.model_validate_json(raw)
    except (ValueError, ValidationError) as exc:
        raise WalError(f"{path} is damaged: {str(exc)[:200]}") from exc
    if state.version != RETENTION_VERSION:
        raise WalError(f"{path}: version {state.version} not {RETENTION_VERSION}")
    return state


def save(path: Path, state: RetentionState) -> None:
    write_atomic(path, state.model_dump_json().encode())


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Compacted:
    """Fast questions over the compacted ranges."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = merge(ranges)
        self._starts = [a for a, _ in self.ranges]

    def covers(self, first: int, last: int) -> bool:
        """True when every seq in [first, last] lies in a compacted range (an
        empty interval is covered)."""
        if first > last:
            return True
        i = bisect.bisect_right(self._starts, first) - 1
        return i >= 0 and self.ranges[i][1] >= last

    def contains(self, seq: int) -> bool:
        return self.covers(seq, seq)


def remove_leftovers(wal_dir: Path) -> list[Path]:
    """Delete temp files of a compaction that did not reach its swap."""
    gone: list[Path] = []
    if wal_dir.is_dir():
        for path in wal_dir.glob(".*.compact"):
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


def drop_compacted_ledger_lines(path: Path, compacted: Compacted, still_there: set[int]) -> int:
    """Remove from a ledger the lines whose seq was compacted out of the WAL (a
    crash between the segment's swap and the ledger's rewrite leaves them; a
    seq in `still_there` is still in the WAL: the swap had not happened):
    the ledger stays the exact projection of the WAL. Returns how many."""
    from actors.writer.wal import parse_record  # noqa: PLC0415 - recovery's rare path

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    kept, dropped = [], 0
    for line in data.splitlines(keepends=True):
        record = parse_record(line)
        if record is not None and compacted.contains(record.seq) and (
            record.seq not in still_there
        ):
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_atomic(path, b"".join(kept))
    return dropped
