"""Start-up's scan of the WAL: whole records, a torn batch, or corruption.

A torn, never-acknowledged last batch is cut; damage to acknowledged records
raises WalCorruptionError. See docs/wal.md ("Start-up").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from actors.writer.retention import Compacted
from actors.writer.wal import WalRecord, parse_record
from broker.errors import WalCorruptionError


@dataclass(frozen=True)
class TornBatch:
    """A batch that never became durable: cut the file at `offset`."""

    path: Path
    offset: int  # where the torn batch starts: the file is cut here
    bad_offset: int  # the first bad byte (or the end of the file)
    size: int  # bytes from offset to the end of the file
    first_seq: int  # the seq the torn batch started at (nothing from it is kept)
    reason: str


@dataclass(frozen=True)
class ScanStart:
    """A batch boundary to scan from: after `head_seq`, at `offset` of the
    segment whose first seq is `segment_first_seq`."""

    head_seq: int = 0
    segment_first_seq: int = 1
    offset: int = 0


ScannedRecord = tuple[int, int, WalRecord]  # segment first seq, offset, record


class WalScan:
    """Iterate `records()` for every record of a whole batch, in seq order;
    afterwards `torn` holds the batch to cut, if any. Read-only: the caller
    cuts. Raises WalCorruptionError for damage to acknowledged records."""

    def __init__(
        self, segments: list[tuple[int, Path]], start: ScanStart, compacted: Compacted | None = None
    ) -> None:
        # seqs removed on purpose by compaction (actors/writer/retention.py):
        # their absence is not a gap, and a batch may lose its first or last
        self.compacted = compacted if compacted is not None else Compacted([])
        self.segments = [(f, p) for f, p in segments if f >= start.segment_first_seq]
        self.start = start
        self.torn: TornBatch | None = None
        self.head_seq = start.head_seq
        self.active_first_seq = self.segments[-1][0] if self.segments else start.head_seq + 1

    def records(self) -> Iterator[ScannedRecord]:
        head = self.start.head_seq
        for position, (first, path) in enumerate(self.segments):
            last_segment = position == len(self.segments) - 1
            offset = self.start.offset if first == self.start.segment_first_seq else 0
            gone = self.compacted.covers
            if offset == 0 and not gone(head + 1, first - 1) and os.path.getsize(path) > 0:
                raise WalCorruptionError(
                    path, 0, f"segment starts at seq {first}, expected {head + 1}"
                )
            batch: tuple[int, int] | None = None  # (first, last) of the open batch
            batch_start = offset
            pending: list[ScannedRecord] = []
            with open(path, "rb") as f:
                f.seek(offset)
                for line in iter(f.readline, b""):
                    record = parse_record(line)
                    if record is None:
                        reason = "torn record (no newline)" if not line.endswith(b"\n") else (
                            "checksum or format failure"
                        )
                        self._damage(
                            path, f, offset, len(line), head, batch, batch_start, last_segment,
                            reason,
                        )
                        return
                    if batch is not None and record.seq > batch[1] and gone(head + 1, batch[1]):
                        # the open batch's last records were compacted away
                        yield from pending
                        pending.clear()
                        self.head_seq = head
                        batch = None
                    if record.seq != head + 1 and not gone(head + 1, record.seq - 1):
                        raise WalCorruptionError(path, offset, f"seq {record.seq} follows {head}")
                    span = (record.batch_first, record.batch_last)
                    if batch is None:
                        if not gone(record.batch_first, record.seq - 1) or not (
                            record.batch_first <= record.seq <= record.batch_last
                        ):
                            raise WalCorruptionError(
                                path, offset, f"seq {record.seq} opens batch {list(span)}"
                            )
                        batch, batch_start = span, offset
                    elif span != batch:
                        raise WalCorruptionError(
                            path, offset, f"seq {record.seq} of batch {list(span)} inside "
                            f"batch {list(batch)}"
                        )
                    pending.append((first, offset, record))
                    head = record.seq
                    offset += len(line)
                    if head == batch[1]:
                        yield from pending
                        pending.clear()
                        self.head_seq = head
                        batch = None
            if batch is not None and gone(head + 1, batch[1]) and (
                not last_segment or offset == os.path.getsize(path)
            ):
                yield from pending  # the batch's last records were compacted away
                pending.clear()
                self.head_seq = head
                batch = None
            if batch is not None:  # the file ends inside a batch
                if not last_segment:
                    raise WalCorruptionError(
                        path, offset, f"sealed segment ends inside batch {list(batch)}"
                    )
                self.torn = TornBatch(
                    path, batch_start, offset, offset - batch_start, batch[0],
                    f"batch {list(batch)} ends after seq {head}",
                )
                return

    def _damage(  # noqa: PLR0917 - the scan's state at the bad line
        self,
        path: Path,
        f: BinaryIO,
        bad_offset: int,
        bad_size: int,
        head: int,
        batch: tuple[int, int] | None,
        batch_start: int,
        last_segment: bool,
        reason: str,
    ) -> None:
        """Decide about a bad line at `bad_offset`: set `self.torn` or raise."""
        if not last_segment:
            raise WalCorruptionError(
                path, bad_offset, f"{reason} in a sealed segment (a later segment follows)"
            )
        # The suspect: the open batch, or the batch that should start here.
        suspect_first = batch[0] if batch is not None else self.head_seq + 1
        cut = batch_start if batch is not None else bad_offset
        last_whole = head if batch is not None else self.head_seq
        offset = bad_offset + bad_size
        seen: tuple[int, int] | None = batch
        for line in iter(f.readline, b""):
            record = parse_record(line)
            if record is not None:
                span = (record.batch_first, record.batch_last)
                if seen is None and span[0] == suspect_first:
                    seen = span
                if span != seen or not last_whole < record.seq <= span[1]:
                    raise WalCorruptionError(
                        path,
                        bad_offset,
                        f"{reason}, followed by seq {record.seq} of batch {list(span)} at byte "
                        f"{offset}: a later batch was written, so this one was acknowledged",
                    )
            offset += len(line)
        self.torn = TornBatch(path, cut, bad_offset, offset - cut, suspect_first, reason)
