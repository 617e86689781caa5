"""`supervisor logs` merging (supervisor/logs.py): rotated files in order,
filters, and following across a rotation."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor import logs


def _line(ts: str, actor: str, event: str, level: str = "info") -> str:
    return json.dumps({"timestamp": ts, "actor": actor, "event": event, "level": level}) + "\n"


def test_merge_reads_rotated_files_oldest_first_across_actors(tmp_path: Path) -> None:
    (tmp_path / "a.log.2").write_text(_line("2024-01-01T00:00:01Z", "a", "one"))
    (tmp_path / "a.log.1").write_text(_line("2024-01-01T00:00:03Z", "a", "three"))
    (tmp_path / "a.log").write_text(_line("2024-01-01T00:00:05Z", "a", "five", "error"))
    (tmp_path / "b.log").write_text(_line("2024-01-01T00:00:02Z", "b", "two")
                                    + "not json\n" + _line("2024-01-01T00:00:04Z", "b", "four"))
    events = [r["event"] for r in logs.merged(tmp_path, logs.Filter())]
    assert events == ["one", "two", "three", "four", "five"]
    only_a = [r["event"] for r in logs.merged(tmp_path, logs.Filter(actors=frozenset({"a"})))]
    assert only_a == ["one", "three", "five"]
    errors = [r["event"] for r in logs.merged(tmp_path, logs.Filter(min_level=40))]
    assert errors == ["five"]
    later = logs.Filter(since="2024-01-01T00:00:03.5Z")
    assert [r["event"] for r in logs.merged(tmp_path, later)] == ["four", "five"]


def test_follow_continues_across_rotation(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text(_line("2024-01-01T00:00:00Z", "a", "old"))
    tail = logs._Tail(path, from_end=True)
    with path.open("a") as fh:
        fh.write(_line("2024-01-01T00:00:01Z", "a", "before-rotation"))
    path.rename(tmp_path / "a.log.1")
    path.write_text(_line("2024-01-01T00:00:02Z", "a", "after-rotation"))
    events = [json.loads(line)["event"] for line in tail.lines()]
    tail.close()
    assert events == ["before-rotation", "after-rotation"]


def test_parse_since_accepts_relative_and_iso() -> None:
    assert logs.parse_since("2024-01-01T00:00:00+00:00") == "2024-01-01T00:00:00.000000Z"
    assert logs.parse_since("5m") < logs.parse_since("1s")
