"""`supervisor wal verify` checks a WAL offline: exit 0 only when sound; gaps,
damaged records, a torn tail and ledger lines that disagree with the WAL are
each reported with file and byte offset."""

from __future__ import annotations

import json
import subprocess
import sys

from actors.writer.wal import encode_record, segment_name
from broker.statedir import StateDir
from supervisor.walverify import verify
from tests.processes import REPO_ROOT


def _lines(seqs: list[int], ledger_every: int = 0) -> list[bytes]:
    return [
        encode_record(
            s,
            1.0,
            "agent/a",
            "turn",
            "o",
            f"k{s}",
            "budget" if ledger_every and s % ledger_every == 0 else None,
            b'{"s":1}',
        )
        for s in seqs
    ]


def _cli(state_dir: StateDir, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "wal",
            "verify",
            "--state-dir",
            str(state_dir.root),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=30,
        check=False,
    )


def test_sound_wal_exits_zero_with_counts(state_dir: StateDir) -> None:
    lines = _lines(list(range(1, 11)), ledger_every=3)
    (state_dir.wal_dir / segment_name(1)).write_bytes(b"".join(lines[:6]))
    (state_dir.wal_dir / segment_name(7)).write_bytes(b"".join(lines[6:]))
    state_dir.budget_ledger_path.write_bytes(lines[2] + lines[5] + lines[8])
    result = _cli(state_dir, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["records"], report["head_seq"], report["segments"], report["sound"]) == (
        10,
        10,
        2,
        True,
    )


def test_every_kind_of_damage_is_reported_and_exit_is_one(state_dir: StateDir) -> None:
    lines = _lines([1, 2, 3, 5, 6, 7], ledger_every=2)
    damaged = bytearray(lines[1])
    damaged[25] ^= 0x02
    body = lines[0] + bytes(damaged) + lines[2] + lines[3] + lines[4] + lines[5][:30]
    path = state_dir.wal_dir / segment_name(1)
    path.write_bytes(body)
    state_dir.budget_ledger_path.write_bytes(_lines([4], ledger_every=2)[0])  # seq 4 not in the WAL
    report = verify(state_dir)
    assert not report.sound
    assert report.gaps == [(1, 3), (3, 5)]  # the damaged record 2 is missing too
    assert [(p.file, p.offset) for p in report.checksum_failures] == [(str(path), len(lines[0]))]
    assert report.torn_tail is not None and report.torn_tail.offset == len(body) - 30
    assert len(report.ledger_problems) == 1
    result = _cli(state_dir)
    assert result.returncode == 1
    assert f"byte {len(lines[0])}" in result.stdout and "torn tail" in result.stdout


def test_missing_wal_is_a_usage_error(state_dir: StateDir) -> None:
    state_dir.wal_dir.rmdir()
    result = _cli(state_dir)
    assert result.returncode == 2 and "no WAL" in result.stderr
