"""A kill between `confined.write()` creating its temporary file and renaming it
leaves `.<leaf>.<16 hex>.corral-tmp` behind (the soak found one in a
workspace); a restarted agent sweeps them: only those, never through a link,
never in a protected directory."""

from __future__ import annotations

import os
from pathlib import Path

from actors.changesets import confined
from actors.kernel import workspace
from broker.statedir import StateDir

LEFT = ".log.txt.df7907de86865e14.corral-tmp"


def test_leftovers_are_swept_and_nothing_else(state_dir: StateDir, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "d" / "e").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    for where in (ws, ws / "d" / "e", outside):
        (where / LEFT).write_text("cut write")
    keep = {ws / "log.txt": "log", ws / ".notes.corral-tmp": "not ours: no token",
            ws / "d" / ".x.0123456789abcdef.corral-tmp.bak": "another suffix"}
    for path, text in keep.items():
        path.write_text(text)
    (ws / "link").symlink_to(outside, target_is_directory=True)
    os.symlink(outside / LEFT, ws / ".y.0123456789abcdef.corral-tmp")  # a link: not a file
    assert workspace.remove_leftovers(ws, state_dir) == 2
    assert not (ws / LEFT).exists() and not (ws / "d" / "e" / LEFT).exists()
    assert (outside / LEFT).read_text() == "cut write"  # never through a link
    assert all(path.read_text() == text for path, text in keep.items())
    assert (ws / ".y.0123456789abcdef.corral-tmp").is_symlink()
    assert workspace.remove_leftovers(ws, state_dir) == 0


def test_a_protected_directory_is_not_swept(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "guarded").mkdir(parents=True)
    (ws / "guarded" / LEFT).write_text("x")
    guard = confined.Guard(confined.identities([ws / "guarded"]), "protected")
    with confined.open_root(ws) as fd:
        assert confined.remove_leftovers(fd, guard) == 0
    assert (ws / "guarded" / LEFT).exists()
