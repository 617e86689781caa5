"""The workspace quota's looks (actors/procs/quota.py): what it measures, and
that a slow look (a large workspace) spaces the next one out, so the quota
costs at most about 1/DUTY of a core whatever the workspace's size."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.procs import quota


def test_usage_counts_allocated_bytes_of_files_not_links(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 10_000)
    (tmp_path / "link").symlink_to("/usr")  # never followed
    used = quota.usage_bytes(str(tmp_path))
    assert 10_000 <= used < 64 * 1024


def test_a_slow_look_spaces_out_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    look_s = [0.001]

    def monotonic() -> float:
        return clock[0]

    def usage(_root: str, max_entries: int = quota.MAX_ENTRIES) -> int:
        clock[0] += look_s[0]  # the walk's own time
        return 0

    monkeypatch.setattr(quota.time, "monotonic", monotonic)
    monkeypatch.setattr(quota, "usage_bytes", usage)
    job = quota.WorkspaceQuota(str(tmp_path), limit_bytes=1, base_bytes=0, next_check=100.0)
    assert not job.exceeded()
    assert job.next_check == pytest.approx(100.0 + 0.001 + quota.CHECK_S)  # a quick look
    clock[0] = job.next_check
    look_s[0] = 1.0  # a large workspace: the look took a second
    start = clock[0]
    assert not job.exceeded()
    assert job.next_check == pytest.approx(start + 1.0 + quota.DUTY * 1.0)
    clock[0] = job.next_check - 0.01
    calls_before = clock[0]
    assert not job.exceeded()  # not due yet: no walk
    assert clock[0] == calls_before
