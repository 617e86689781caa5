"""Writer start-up: where the durable WAL ends, and the writer's state rebuilt.

`plan()` is the read-only half `supervisor wal verify` shares.
See docs/wal.md ("Start-up", "The ledgers at start-up").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from actors.writer import checkpoint, retention
from actors.writer.dedupe import DedupeWindows
from actors.writer.ledgers import LedgerCheck, Ledgers
from actors.writer.streamindex import StreamIndex
from actors.writer.wal import list_segments, parse_record
from actors.writer.walscan import ScanStart, TornBatch, WalScan
from broker.errors import WalCorruptionError, WalError
from broker.statedir import StateDir


@dataclass(frozen=True)
class LedgerRepair:
    ledger: str
    path: Path
    offset: int
    size: int  # bytes cut
    reason: str


@dataclass
class Recovered:
    floor_seq: int  # the lowest seq the WAL holds (retention truncated below it)
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
    repaired: TornBatch | None = None
    ledger_appends: dict[str, int] = field(default_factory=dict)
    ledger_dropped: dict[str, int] = field(default_factory=dict)
    ledger_repairs: list[LedgerRepair] = field(default_factory=list)
    ledger_last_seq: dict[str, int] = field(default_factory=dict)
    index_problem: str | None = None


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
    if record.batch_last != record.seq:
        return f"record at {path}:{cp.last_record_offset} does not end its batch"
    return None


def checkpoints(
    state_dir: StateDir, segments: list[tuple[int, Path]]
) -> list[tuple[checkpoint.Checkpoint | None, str | None]]:
    """The newest and the previous checkpoint, each (checkpoint, None) when it
    agrees with the WAL, else (None, why not). Raises WalError when one names
    a head but the WAL holds no segment (the WAL is missing)."""
    by_first = dict(segments)
    out: list[tuple[checkpoint.Checkpoint | None, str | None]] = []
    for path in (state_dir.checkpoint_path, checkpoint.previous_path(state_dir.checkpoint_path)):
        cp, why = checkpoint.load(path)
        if cp is None:
            out.append((None, f"{path.name} {why}"))
            continue
        if not segments and cp.head_seq > 0:
            raise WalError(
                f"checkpoint {path} records head seq {cp.head_seq} "
                f"but {state_dir.wal_dir} holds no segment: the WAL is missing"
            )
        mismatch = _checkpoint_matches(cp, by_first) if segments else None
        out.append((cp, None) if mismatch is None else (None, f"{path.name} ignored: {mismatch}"))
    return out


def kept_segments(
    segments: list[tuple[int, Path]], kept: retention.RetentionState
) -> list[tuple[int, Path]]:
    """The segments at or above the retention floor (one below it is left
    over from a retention pass that crashed before removing it)."""
    if kept.floor_seq <= 1:
        return segments
    above = [(first, path) for first, path in segments if first >= kept.floor_seq]
    if not above and segments:  # everything is below the floor: keep the last
        return segments[-1:]
    return above


def first_start(segments: list[tuple[int, Path]], kept: retention.RetentionState) -> ScanStart:
    """Where a full scan begins: the retention floor (seq 1 of a WAL never
    truncated)."""
    first = segments[0][0] if segments else kept.floor_seq
    return ScanStart(max(kept.floor_seq - 1, 0), first, 0)


@dataclass(frozen=True)
class StartPlan:
    """What start-up will do, found without changing anything."""

    checkpoint_head_seq: int | None  # None: a full scan
    head_seq: int
    torn: TornBatch | None


def plan(state_dir: StateDir) -> StartPlan:
    """Read-only: the checkpoint the writer would start from and what its scan
    finds. Raises WalError / WalCorruptionError exactly when the writer would
    refuse to start (exit 65)."""
    kept = retention.load(retention.path_in(state_dir.state_dir))
    segments = kept_segments(list_segments(state_dir.wal_dir), kept)
    start, cp_head = first_start(segments, kept), None
    for cp, _ in checkpoints(state_dir, segments):
        if cp is not None and cp.storage_epoch == kept.epoch:
            start = ScanStart(cp.head_seq, cp.segment_first_seq, cp.offset)
            cp_head = cp.head_seq
            break
    scan = WalScan(segments, start, retention.Compacted(kept.compacted))
    for _ in scan.records():
        pass
    return StartPlan(cp_head, scan.head_seq, scan.torn)


def _wal_ledger_records(
    segments: list[tuple[int, Path]], name: str, after_seq: int, upto_seq: int
) -> list[bytes]:
    """The lines of ledger `name` with after_seq < seq <= upto_seq, read from
    the WAL's acknowledged part (a bad line there is damage: refused)."""
    start = 0
    for i, (first, _) in enumerate(segments):
        if first <= after_seq + 1:
            start = i
    found: list[bytes] = []
    for _, path in segments[start:]:
        offset = 0
        with open(path, "rb") as f:
            for line in iter(f.readline, b""):
                record = parse_record(line)
                if record is None:
                    raise WalCorruptionError(path, offset, "damaged record before the checkpoint")
                if record.seq > upto_seq:
                    return found
                if record.seq > after_seq and record.ledger == name:
                    found.append(line)
                offset += len(line)
    return found


def recover(state_dir: StateDir, window: int, ledgers: Ledgers) -> Recovered:
    kept = retention.load(retention.path_in(state_dir.state_dir))
    retention.remove_leftovers(state_dir.wal_dir)  # a compaction that did not swap
    every = list_segments(state_dir.wal_dir)
    segments = kept_segments(every, kept)
    for first, path in every:  # below the floor: a retention pass crashed before removing it
        if (first, path) not in segments:
            path.unlink(missing_ok=True)
    index = StreamIndex(state_dir.stream_index_dir)
    dedupe = DedupeWindows(window)
    start = first_start(segments, kept)
    chosen: checkpoint.Checkpoint | None = None
    notes: list[str] = []
    for cp, why in checkpoints(state_dir, segments):
        if cp is None:
            notes.append(why or "")
            continue
        if cp.storage_epoch != kept.epoch:
            notes.append(f"checkpoint of storage epoch {cp.storage_epoch}, not {kept.epoch}")
            continue
        if not index.restore(cp.index_counts):
            notes.append("stream index shorter than the checkpoint")
            continue
        chosen = cp
        start = ScanStart(cp.head_seq, cp.segment_first_seq, cp.offset)
        dedupe = DedupeWindows.load(cp.dedupe, window)
        break
    note = "; ".join(notes) or None
    full_scan = chosen is None
    index_problem = index.unusable
    if full_scan:
        stuck = index.reset()
        if stuck:
            index_problem = f"cannot delete {len(stuck)} index files, e.g. {stuck[0]}"

    compacted = retention.Compacted(kept.compacted)
    # The ledgers' lines since the checkpoint (all of them after a full scan).
    checks: dict[str, LedgerCheck] = {}
    for name in ledgers.paths:
        if chosen is not None and name in chosen.ledger_sizes:
            checks[name] = ledgers.check(
                name, chosen.ledger_sizes[name], chosen.ledger_last_seq.get(name, 0)
            )
        else:
            checks[name] = ledgers.check(name)
    missing: dict[str, list[tuple[int, bytes]]] = {name: [] for name in ledgers.paths}

    head, last_off = start.head_seq, chosen.last_record_offset if chosen is not None else -1
    head_seg, head_end = start.segment_first_seq, start.offset
    scan = WalScan(segments, start, compacted)
    scanned = 0
    still_there: set[int] = set()  # ledger records in a compacted range the WAL still holds
    for first, off, item in scan.records():
        if item.ledger is not None and full_scan and compacted.contains(item.seq):
            still_there.add(item.seq)
        head, last_off = item.seq, off
        head_seg, head_end = first, off + len(item.line)
        dedupe.remember(item.origin, item.key, item.seq)
        index.add(item.stream, item.seq, first, off, len(item.line))
        if item.ledger in checks and item.seq > checks[item.ledger].last_seq:
            missing[item.ledger].append((item.seq, item.line))
        scanned += 1

    repaired = scan.torn
    if repaired is not None:
        with open(repaired.path, "r+b") as f:
            f.truncate(repaired.offset)
            os.fsync(f.fileno())
    if segments:
        # What the scan accepted may be only in the page cache (the writer was
        # killed, the machine was not): make it durable before anyone is
        # answered from it, e.g. a retried key found in this tail.
        fd = os.open(segments[-1][1], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if full_scan and compacted.ranges:  # a crash between a compaction's swap and its ledgers
        for path in ledgers.paths.values():
            retention.drop_compacted_ledger_lines(path, compacted, still_there)
    appended: dict[str, int] = {}
    dropped: dict[str, int] = {}
    repairs: list[LedgerRepair] = []
    ledger_last: dict[str, int] = {}
    for name, check in checks.items():
        last_seq = check.last_seq
        if check.bad_offset is not None:
            ledgers.cut(name, check.bad_offset)
            repairs.append(
                LedgerRepair(
                    name, ledgers.paths[name], check.bad_offset, check.size - check.bad_offset,
                    check.reason,
                )
            )
        lines = [line for seq, line in missing[name]]
        if last_seq > head:  # the WAL lost records the ledger has: follow the WAL
            dropped[name], last_seq = ledgers.cut_after(name, head)
            lines = _wal_ledger_records(segments, name, last_seq, head)
        elif last_seq < start.head_seq and (
            chosen is None or chosen.ledger_last_seq.get(name, -1) != last_seq
        ):
            # The ledger lacks records from before the checkpoint (a torn
            # ledger write kept by an older writer, say): read them from the
            # WAL's acknowledged part. Cheap to decide: the checkpoint says
            # which ledger seq the WAL held last when it was written.
            lines = _wal_ledger_records(segments, name, last_seq, start.head_seq) + lines
        for line in lines:
            ledgers.add(name, line)
        appended[name] = len(lines)
        last_record = parse_record(lines[-1]) if lines else None
        ledger_last[name] = last_record.seq if last_record is not None else last_seq
    ledgers.commit()
    ledgers.sync_existing()

    return Recovered(
        floor_seq=kept.floor_seq,
        head_seq=head,
        segment_first_seq=scan.active_first_seq if segments else head + 1,
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
        ledger_repairs=repairs,
        ledger_last_seq=ledger_last,
        index_problem=index_problem,
    )
