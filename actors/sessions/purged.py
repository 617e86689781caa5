"""What a reader of the WAL must not show: the seq ranges of purged sessions.

A purged session's records stay in the WAL until compaction removes them
(docs/wal.md); until then every reader skips them: the agents' rebuild
(actors/sessions/rebuild.py), `supervisor trace`, the session index. The ranges
come from the index's `purge_journal` (any state: a purge under way already
hides its session), read-only; no index means nothing was ever purged.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from actors.sessions.ids import index_path


@dataclass(frozen=True)
class Purged:
    session_id: str
    first_seq: int
    last_seq: int

    def covers(self, seq: int) -> bool:
        return self.first_seq <= seq <= self.last_seq


def purged_of(root: Path, stream: str) -> list[Purged]:
    path = index_path(root)
    if not path.exists():
        return []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        try:
            rows = conn.execute(
                "SELECT session_id, first_seq, last_seq FROM purge_journal WHERE stream=?",
                (stream,)).fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    return [Purged(str(s), int(a), int(b)) for s, a, b in rows]


def visible(seq: int, purged: Sequence[Purged]) -> bool:
    return not any(p.covers(seq) for p in purged)
