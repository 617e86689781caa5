"""Transcripts rotated by size (issue 16; supervisor/storagetranscripts.py,
docs/storage.md "Transcripts"): a session's transcript over
`transcript_max_bytes` becomes `transcript.old.jsonl` (the one before it
goes), the next line starts a new current file, a pinned session and a cap
of 0 are left alone, and the janitor sees the cap exceeded. Before, nothing
bounded a transcript: it grew with every model call."""

from __future__ import annotations

from pathlib import Path

from broker.statedir import StateDir
from supervisor.storage import Janitor, StorageConfig, gc

CAP = 4096


def transcript(sd: StateDir, session: str, lines: int, tag: str) -> Path:
    path = sd.root / "sessions" / session / "transcript.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for i in range(lines):
            f.write(f'{{"turn": {i}, "tag": "{tag}", "pad": "{"x" * 100}"}}\n')
    return path


def test_a_transcript_over_its_cap_is_rotated_once_and_bounded(state_dir: StateDir) -> None:
    config = StorageConfig(transcript_max_bytes=CAP, pins=["pinned-*"])
    big = transcript(state_dir, "s-big", 60, "first")  # ~7.6 KB
    small = transcript(state_dir, "s-small", 5, "small")
    pinned = transcript(state_dir, "pinned-1", 60, "kept")
    assert Janitor(state_dir, config).over_caps() == "transcripts"
    first = big.read_bytes()

    report = gc(state_dir, config, dry_run=True, wal=False, trees=False)
    assert report.transcripts_rotated == 1 and big.read_bytes() == first  # dry run: says only

    report = gc(state_dir, config, dry_run=False, wal=False, trees=False)
    assert report.transcripts_rotated == 1
    old = big.with_name("transcript.old.jsonl")
    assert old.read_bytes() == first and not big.exists()
    assert small.stat().st_size < CAP and not small.with_name("transcript.old.jsonl").exists()
    assert pinned.stat().st_size > CAP and not pinned.with_name("transcript.old.jsonl").exists()
    assert Janitor(state_dir, config).over_caps() is None

    # the agent goes on writing: a new current file, and the next rotation
    # replaces the old one, so the session never holds much more than twice the cap
    second = transcript(state_dir, "s-big", 60, "second").read_bytes()
    report = gc(state_dir, config, dry_run=False, wal=False, trees=False)
    assert report.transcripts_rotated == 1 and report.transcript_bytes_removed == len(first)
    assert old.read_bytes() == second and not big.exists()
    assert sum(p.stat().st_size for p in big.parent.iterdir()) <= 2 * CAP + len(second)

    # a cap of 0 never rotates
    transcript(state_dir, "s-big", 60, "third")
    assert gc(state_dir, StorageConfig(), dry_run=False, wal=False,
              trees=False).transcripts_rotated == 0
