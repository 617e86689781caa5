"""The soak test's invariants, checked offline after the runtime has stopped.

See docs/soak.md ("What it checks (`ops/soakcheck.py`, `ops/soakagents.py`)").
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from actors.writer.wal import list_segments, parse_record
from broker.statedir import StateDir
from supervisor.walverify import verify


def wal_keys(state_dir: StateDir) -> dict[tuple[str, str], list[int]]:
    """(origin, key) -> every seq it was written at."""
    keys: dict[tuple[str, str], list[int]] = defaultdict(list)
    for _, path in list_segments(state_dir.wal_dir):
        with open(path, "rb") as f:
            for line in f:
                record = parse_record(line)
                if record is not None:
                    keys[(record.origin, record.key)].append(record.seq)
    return keys


def read_journal(path: Path) -> list[tuple[str, int, float]]:
    """(key, seq, ack time) lines; a torn last line (the client was killed
    mid-write) was never a complete acknowledgement record and is skipped."""
    entries = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        try:
            entries.append((parts[0], int(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return entries


def _excused(seq: int, at: float, cuts: list[dict[str, object]]) -> bool:
    return any(
        int(c["first_seq"]) <= seq <= int(c["head_seq"]) and at <= float(c["at"])  # type: ignore[call-overload,arg-type]
        for c in cuts
    )


def cut_victims(journal_dir: Path, cuts: list[dict[str, object]]) -> set[str]:
    """Origins that had an acknowledged append destroyed by a cut."""
    victims = set()
    for path in sorted(journal_dir.glob("*.acks")) if journal_dir.is_dir() else []:
        if any(_excused(seq, at, cuts) for _, seq, at in read_journal(path)):
            victims.add(path.name.removesuffix(".acks").replace("%", "/"))
    return victims


def check(
    state_dir: StateDir,
    journal_dir: Path,
    cuts: list[dict[str, object]],
    repeat: int | None,
    tainted: set[str],
) -> dict[str, object]:
    report = verify(state_dir)
    keys = wal_keys(state_dir)
    acked = lost = cut_acked = 0
    lost_examples: list[str] = []
    for path in sorted(journal_dir.glob("*.acks")) if journal_dir.is_dir() else []:
        origin = path.name.removesuffix(".acks").replace("%", "/")
        for key, seq, at in read_journal(path):
            acked += 1
            if seq in keys.get((origin, key), ()):
                continue
            if _excused(seq, at, cuts):
                cut_acked += 1
                continue
            lost += 1
            if len(lost_examples) < 10:
                lost_examples.append(f"{origin}/{key}@{seq}")
    duplicates = sum(1 for seqs in keys.values() if len(seqs) > 1)
    figures: dict[str, object] = {
        "acked": acked,
        "lost": lost,
        "lost_examples": lost_examples,
        "cut_acked": cut_acked,
        "duplicates": duplicates,
        "gapless": not report.gaps,
        "checksum_failures": len(report.checksum_failures),
        "torn_tail": report.torn_tail is not None,
        "wal_records": report.records,
        "wal_head_seq": report.head_seq,
        "ledger_problems": len(report.ledger_problems),
    }
    from ops import soakagents

    figures.update(soakagents.check(state_dir, repeat, tainted))
    return figures
