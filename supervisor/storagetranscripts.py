"""Transcripts rotated by size: `transcript.jsonl` -> `transcript.old.jsonl`.

See docs/storage.md ("Transcripts").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from broker.durable import fsync_dir
from broker.statedir import StateDir

CURRENT = "transcript.jsonl"
OLD = "transcript.old.jsonl"


def over_cap(state_dir: StateDir, max_bytes: int, pinned: Callable[[str], bool]
             ) -> list[Path]:
    """Current transcripts over the cap (none when the cap is 0)."""
    if max_bytes <= 0:
        return []
    root = state_dir.root / "sessions"
    found = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    for name in names:
        path = root / name / CURRENT
        try:
            size = path.stat(follow_symlinks=False).st_size
        except OSError:
            continue
        if size > max_bytes and not pinned(name):
            found.append(path)
    return found


def rotate(paths: list[Path], dry_run: bool) -> int:
    """Rename each to `transcript.old.jsonl`; returns the bytes the replaced
    old files held (what the rotation gave back)."""
    freed = 0
    for path in paths:
        old = path.with_name(OLD)
        with contextlib.suppress(OSError):
            freed += old.stat(follow_symlinks=False).st_size
        if dry_run:
            continue
        try:
            os.replace(path, old)
            fsync_dir(path.parent)
        except OSError:
            continue  # gone meanwhile (a purge): nothing to rotate
    return freed
