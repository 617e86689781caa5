"""`supervisor wal verify [--state-dir D] [--json]`: check a WAL offline,
without the writer. Reads every segment to the end (it does not stop at the
first problem), and reports records, head seq, gaps, checksum failures, a torn
tail and ledger lines that do not match the WAL.

Exit 0 only when the WAL is sound; 1 when it is not (a torn tail included:
the writer's next start cuts it); 2 when there is nothing to check."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from actors.writer.wal import list_segments, parse_record
from broker.statedir import StateDir

MAX_REPORTED = 100


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
    head_seq: int = 0
    bytes: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (after seq, next seq)
    checksum_failures: list[Problem] = field(default_factory=list)
    torn_tail: Problem | None = None
    segment_name_mismatches: list[Problem] = field(default_factory=list)
    ledger_problems: list[Problem] = field(default_factory=list)
    sound: bool = False


def _verify_segments(report: Report, segments: list[tuple[int, Path]]) -> dict[int, bytes]:
    """Scan every segment; return the ledger records' lines by seq."""
    ledger_lines: dict[int, bytes] = {}
    previous: int | None = None
    for position, (first, path) in enumerate(segments):
        last_segment = position == len(segments) - 1
        data = path.read_bytes()
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
                if first_in_file and record.seq != first:
                    report.segment_name_mismatches.append(
                        Problem(str(path), offset, f"named {first}, first record {record.seq}")
                    )
                first_in_file = False
                if previous is None:
                    report.first_seq = record.seq
                    if record.seq != 1 and len(report.gaps) < MAX_REPORTED:
                        report.gaps.append((0, record.seq))
                elif record.seq != previous + 1 and len(report.gaps) < MAX_REPORTED:
                    report.gaps.append((previous, record.seq))
                previous = record.seq
                report.records += 1
                report.head_seq = max(report.head_seq, record.seq)
                if record.ledger is not None:
                    ledger_lines[record.seq] = record.line
            offset += len(line)
    return ledger_lines


def _verify_ledger(report: Report, name: str, path: Path, wal_lines: dict[int, bytes]) -> None:
    if not path.exists():
        return
    offset = 0
    for line in path.read_bytes().splitlines(keepends=True):
        record = parse_record(line)
        if record is None or record.ledger != name:
            report.ledger_problems.append(Problem(str(path), offset, "not a record of this ledger"))
        elif wal_lines.get(record.seq) != line:
            report.ledger_problems.append(
                Problem(str(path), offset, f"seq {record.seq} differs from the WAL or is absent")
            )
        offset += len(line)
        if len(report.ledger_problems) >= MAX_REPORTED:
            return


def verify(state_dir: StateDir) -> Report:
    report = Report(state_dir=str(state_dir.root))
    segments = list_segments(state_dir.wal_dir)
    report.segments = len(segments)
    wal_lines = _verify_segments(report, segments)
    _verify_ledger(report, "budget", state_dir.budget_ledger_path, wal_lines)
    _verify_ledger(report, "approvals", state_dir.approvals_ledger_path, wal_lines)
    report.sound = not (
        report.gaps
        or report.checksum_failures
        or report.torn_tail
        or report.segment_name_mismatches
        or report.ledger_problems
    )
    return report


def _print_text(report: Report) -> None:
    verdict = "sound" if report.sound else "NOT SOUND"
    print(f"WAL {report.state_dir}: {verdict}")
    print(
        f"  segments {report.segments}, records {report.records}, head seq {report.head_seq}, "
        f"{report.bytes} bytes"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="supervisor wal verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--state-dir", default=None, help="state directory (default ./.corral)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    state_dir = StateDir.at(args.state_dir)
    if not state_dir.wal_dir.is_dir():
        print(f"supervisor: no WAL at {state_dir.wal_dir}", file=sys.stderr)
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
