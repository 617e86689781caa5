"""Writer start-up: find where the durable WAL ends and rebuild the writer's
in-memory state (head seq, idempotency windows, stream index, ledgers).

With a valid checkpoint only the records after it are scanned, so start-up time
does not grow with the WAL's length; without one, everything is scanned and the
derived index is rebuilt. A torn or checksum-failing final record is cut and
reported; damage before the tail raises WalCorruptionError (file + offset)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from actors.writer import checkpoint
from actors.writer.dedupe import DedupeWindows
from actors.writer.ledgers import Ledgers
from actors.writer.streamindex import StreamIndex
from actors.writer.wal import TornTail, WalRecord, iter_segment, list_segments, parse_record
from broker.errors import WalCorruptionError, WalError
from broker.statedir import StateDir


@dataclass
class Recovered:
    head_seq: int
    segment_first_seq: int  # the active (last) segment
    head_segment_first_seq: int  # the segment holding the head record
    head_end_offset: int  # where the head record ends in it
    last_record_offset: int
    dedupe: DedupeWindows
    index: StreamIndex
    scanned_records: int
    full_scan: bool
    checkpoint_note: str | None
    repaired: TornTail | None = None
    ledger_appends: dict[str, int] = field(default_factory=dict)
    ledger_dropped: dict[str, int] = field(default_factory=dict)


def _checkpoint_matches(cp: checkpoint.Checkpoint, segments: dict[int, Path]) -> str | None:
    """None when the checkpoint agrees with the files, else why not."""
    path = segments.get(cp.segment_first_seq)
    if path is None:
        return f"segment {cp.segment_first_seq} named by the checkpoint is missing"
    if path.stat().st_size < cp.offset:
        return f"{path} is shorter than the checkpoint offset {cp.offset}"
    if cp.head_seq == 0:
        return None
    if cp.last_record_offset < 0:
        return "checkpoint has a head but no record offset"
    with open(path, "rb") as f:
        f.seek(cp.last_record_offset)
        line = f.read(cp.offset - cp.last_record_offset)
    record = parse_record(line)
    if record is None or record.seq != cp.head_seq:
        return f"record at {path}:{cp.last_record_offset} is not seq {cp.head_seq}"
    return None


def recover(state_dir: StateDir, window: int, ledgers: Ledgers) -> Recovered:
    segments = list_segments(state_dir.wal_dir)
    by_first = dict(segments)
    index = StreamIndex(state_dir.stream_index_dir)
    head, last_off, start_first, start_off = 0, -1, 1, 0
    head_seg, head_end = 1, 0
    dedupe = DedupeWindows(window)
    full_scan = True
    notes: list[str] = []
    for path in (state_dir.checkpoint_path, checkpoint.previous_path(state_dir.checkpoint_path)):
        cp, why = checkpoint.load(path)
        if cp is None:
            notes.append(f"{path.name} {why}")
            continue
        if not segments and cp.head_seq > 0:
            raise WalError(
                f"checkpoint {path} records head seq {cp.head_seq} "
                f"but {state_dir.wal_dir} holds no segment: the WAL is missing"
            )
        mismatch = _checkpoint_matches(cp, by_first) if segments else None
        if mismatch is None and not index.restore(cp.index_counts):
            mismatch = "stream index shorter than the checkpoint"
        if mismatch is not None:
            notes.append(f"{path.name} ignored: {mismatch}")
            continue
        head, last_off = cp.head_seq, cp.last_record_offset
        head_seg, head_end = cp.segment_first_seq, cp.offset
        start_first, start_off = cp.segment_first_seq, cp.offset
        dedupe = DedupeWindows.load(cp.dedupe, window)
        full_scan = False
        break
    note = "; ".join(notes) or None
    if full_scan:
        index.reset()
        if segments:
            start_first = segments[0][0]

    scanned = 0
    repaired: TornTail | None = None
    ledger_tail: list[WalRecord] = []
    active_first = start_first
    todo = [(first, path) for first, path in segments if first >= start_first]
    for pos, (first, path) in enumerate(todo):
        offset = start_off if first == start_first else 0
        if offset == 0 and first != head + 1 and os.path.getsize(path) > 0:
            raise WalCorruptionError(path, 0, f"segment starts at seq {first}, expected {head + 1}")
        active_first = first
        for off, item in iter_segment(path, offset):
            if isinstance(item, TornTail):
                if pos != len(todo) - 1:
                    raise WalCorruptionError(
                        path, off, "damaged record at the end of a sealed segment"
                    )
                repaired = item
                break
            if item.seq != head + 1:
                raise WalCorruptionError(path, off, f"seq {item.seq} follows {head}")
            head, last_off = item.seq, off
            head_seg, head_end = first, off + len(item.line)
            dedupe.remember(item.origin, item.key, item.seq)
            index.add(item.stream, item.seq, first, off, len(item.line))
            if item.ledger is not None:
                ledger_tail.append(item)
            scanned += 1

    if repaired is not None:
        with open(repaired.path, "r+b") as f:
            f.truncate(repaired.offset)
            os.fsync(f.fileno())

    appended: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for name in ledgers.paths:
        last_seq, _ = ledgers.repair_and_last_seq(name)
        if last_seq > head:
            dropped[name] = ledgers.cut_after(name, head)
            last_seq = head
        missing = [r for r in ledger_tail if r.ledger == name and r.seq > last_seq]
        for record in missing:
            ledgers.add(name, record.line)
        appended[name] = len(missing)
    ledgers.commit()

    return Recovered(
        head_seq=head,
        segment_first_seq=active_first if segments else head + 1,
        head_segment_first_seq=head_seg,
        head_end_offset=head_end,
        last_record_offset=last_off,
        dedupe=dedupe,
        index=index,
        scanned_records=scanned,
        full_scan=full_scan,
        checkpoint_note=note,
        repaired=repaired,
        ledger_appends=appended,
        ledger_dropped=dropped,
    )
