"""`supervisor wal verify [--state-dir D] [--json]`: check a WAL offline.

See docs/wal.md ("`supervisor wal verify [--state-dir D] [--json]`").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from actors.writer import checkpoint, retention
from actors.writer.recovery import kept_segments, plan
from actors.writer.wal import list_segments, parse_record
from actors.writer.walscan import TornBatch
from broker.errors import WalCorruptionError, WalError
from broker.statedir import StateDir

MAX_REPORTED = 100
LedgerLines = dict[int, tuple[str, bytes]]  # seq -> (ledger, the WAL line)


@dataclass
class Problem:
    file: str
    offset: int
    reason: str


@dataclass
class Report:
    state_dir: str
    segments: int = 0
    records: int = 0
    first_seq: int | None = None
    floor_seq: int = 1  # retention truncated every seq below (not a gap)
    compacted_ranges: int = 0  # seq ranges compaction removed on purpose (not gaps)
    compacted_missing: int = 0  # seqs absent because they were compacted
    below_floor_segments: int = 0  # left by a crashed retention pass; the writer removes them
    head_seq: int = 0
    bytes: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (after seq, next seq)
    checksum_failures: list[Problem] = field(default_factory=list)
    torn_tail: Problem | None = None
    segment_name_mismatches: list[Problem] = field(default_factory=list)
    ledger_problems: list[Problem] = field(default_factory=list)
    ledger_missing: dict[str, list[int]] = field(default_factory=dict)  # seqs, first 100
    ledger_missing_total: dict[str, int] = field(default_factory=dict)
    writer_start: str = ""  # what the writer does at its next start
    writer_refuses: bool = False
    sound: bool = False


def _verify_segments(
    report: Report, segments: list[tuple[int, Path]], torn: TornBatch | None,
    kept: retention.RetentionState,
) -> LedgerLines:
    """Scan every segment (up to a torn batch the writer will cut); return
    the ledger records' lines by seq. Seqs below the retention floor and
    compacted seqs are absent on purpose: not gaps."""
    ledger_lines: LedgerLines = {}
    compacted = retention.Compacted(kept.compacted)
    report.floor_seq = kept.floor_seq
    report.compacted_ranges = len(compacted.ranges)
    previous: int | None = None
    for position, (first, path) in enumerate(segments):
        last_segment = position == len(segments) - 1
        data = path.read_bytes()
        if torn is not None and path == torn.path:
            report.torn_tail = Problem(
                str(path), torn.bad_offset,
                f"torn batch from seq {torn.first_seq} ({torn.reason}); the writer cuts "
                f"{torn.size} bytes at byte {torn.offset}",
            )
            data = data[: torn.offset]
        report.bytes += len(data)
        offset = 0
        first_in_file = True
        while offset < len(data):
            end = data.find(b"\n", offset)
            line = data[offset:] if end < 0 else data[offset : end + 1]
            record = parse_record(line)
            if record is None:
                at_tail = last_segment and offset + len(line) == len(data)
                problem = Problem(str(path), offset, "torn" if end < 0 else "checksum or format")
                if at_tail:
                    report.torn_tail = problem
                elif len(report.checksum_failures) < MAX_REPORTED:
                    report.checksum_failures.append(problem)
            else:
                if first_in_file and not compacted.covers(first, record.seq - 1):
                    report.segment_name_mismatches.append(
                        Problem(str(path), offset, f"named {first}, first record {record.seq}")
                    )
                first_in_file = False
                expected = kept.floor_seq if previous is None else previous + 1
                if previous is None:
                    report.first_seq = record.seq
                if record.seq > expected and compacted.covers(expected, record.seq - 1):
                    report.compacted_missing += record.seq - expected
                elif record.seq != expected and len(report.gaps) < MAX_REPORTED:
                    report.gaps.append((expected - 1, record.seq))
                previous = record.seq
                report.records += 1
                report.head_seq = max(report.head_seq, record.seq)
                if record.ledger is not None:
                    ledger_lines[record.seq] = (record.ledger, record.line)
            offset += len(line)
    return ledger_lines


def _verify_ledger(report: Report, name: str, path: Path, wal_lines: LedgerLines) -> None:
    present: set[int] = set()
    offset = 0
    data = path.read_bytes() if path.exists() else b""
    for line in data.splitlines(keepends=True):
        record = parse_record(line)
        if record is None or record.ledger != name:
            if len(report.ledger_problems) < MAX_REPORTED:
                report.ledger_problems.append(
                    Problem(str(path), offset, "not a record of this ledger (torn or damaged)")
                )
        elif record.seq < report.floor_seq:
            pass  # the WAL was truncated below it on purpose; the ledger keeps it
        elif wal_lines.get(record.seq) != (name, line):
            if len(report.ledger_problems) < MAX_REPORTED:
                reason = f"seq {record.seq} differs from the WAL or is absent"
                report.ledger_problems.append(Problem(str(path), offset, reason))
        else:
            present.add(record.seq)
        offset += len(line)
    missing = sorted(
        seq for seq, (ledger, _) in wal_lines.items() if ledger == name and seq not in present
    )
    if missing:
        report.ledger_missing[name] = missing[:MAX_REPORTED]
        report.ledger_missing_total[name] = len(missing)


def _writer_start(report: Report, state_dir: StateDir) -> TornBatch | None:
    """Run the writer's read-only start-up plan; record its verdict."""
    try:
        found = plan(state_dir)
    except WalCorruptionError as exc:
        report.writer_refuses = True
        report.writer_start = (
            f"refuses to start (exit 65): {exc.path} byte {exc.offset}: {exc.reason}"
        )
        return None
    except WalError as exc:
        report.writer_refuses = True
        report.writer_start = f"refuses to start (exit 65): {exc}"
        return None
    where = "from its checkpoint" if found.checkpoint_head_seq is not None else "after a full scan"
    if found.torn is not None:
        t = found.torn
        report.writer_start = (
            f"starts {where} at head seq {found.head_seq} after cutting a torn, never "
            f"acknowledged batch: {t.path} byte {t.offset}, {t.size} bytes ({t.reason})"
        )
    else:
        report.writer_start = f"starts {where} at head seq {found.head_seq}"
    return found.torn


def verify(state_dir: StateDir) -> Report:
    report = Report(state_dir=str(state_dir.root))
    try:
        kept = retention.load(retention.path_in(state_dir.state_dir))
    except WalError as exc:
        report.writer_refuses = True
        report.writer_start = f"refuses to start (exit 65): {exc}"
        return report
    every = list_segments(state_dir.wal_dir)
    segments = kept_segments(every, kept)
    report.below_floor_segments = len(every) - len(segments)
    report.segments = len(segments)
    torn = _writer_start(report, state_dir)
    wal_lines = _verify_segments(report, segments, torn, kept)
    _verify_ledger(report, "budget", state_dir.budget_ledger_path, wal_lines)
    _verify_ledger(report, "approvals", state_dir.approvals_ledger_path, wal_lines)
    report.sound = not (
        report.gaps
        or report.checksum_failures
        or report.torn_tail
        or report.segment_name_mismatches
        or report.ledger_problems
        or report.ledger_missing
        or report.writer_refuses
    )
    return report


def _print_text(report: Report) -> None:
    verdict = "sound" if report.sound else "NOT SOUND"
    print(f"WAL {report.state_dir}: {verdict}")
    print(
        f"  segments {report.segments}, records {report.records}, head seq {report.head_seq}, "
        f"{report.bytes} bytes"
    )
    if report.floor_seq > 1 or report.compacted_ranges:
        print(
            f"  retention floor seq {report.floor_seq} (earlier seqs truncated on purpose); "
            f"{report.compacted_missing} seqs compacted away in {report.compacted_ranges} ranges"
        )
    for after, nxt in report.gaps:
        print(f"  gap: seq {nxt} follows {after}")
    for p in report.checksum_failures:
        print(f"  damaged record: {p.file} byte {p.offset} ({p.reason})")
    if report.torn_tail:
        t = report.torn_tail
        print(f"  torn tail: {t.file} byte {t.offset} (the writer cuts it on its next start)")
    for p in report.segment_name_mismatches + report.ledger_problems:
        print(f"  {p.file} byte {p.offset}: {p.reason}")
    for name, seqs in report.ledger_missing.items():
        total = report.ledger_missing_total[name]
        shown = ", ".join(str(s) for s in seqs[:10]) + (", ..." if total > 10 else "")
        print(
            f"  ledger {name}: {total} records of the WAL missing (seq {shown}); "
            "the writer adds them at its next start"
        )
    print(f"  writer: {report.writer_start}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="supervisor wal verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--state-dir", default=None,
                        help="state directory (default $CORRAL_STATE_DIR, else ./.corral)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    state_dir = StateDir.resolve(args.state_dir)
    if not state_dir.wal_dir.is_dir():
        cp, _ = checkpoint.load(state_dir.checkpoint_path)
        named = (
            f", but {state_dir.checkpoint_path} names head seq {cp.head_seq}: the writer "
            "refuses to start (exit 65) until the WAL is restored"
            if cp is not None and cp.head_seq > 0
            else ""
        )
        print(f"supervisor: no WAL at {state_dir.wal_dir}{named}", file=sys.stderr)
        return 2
    try:
        report = verify(state_dir)
    except OSError as exc:
        print(f"supervisor: cannot read the WAL: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        _print_text(report)
    return 0 if report.sound else 1
