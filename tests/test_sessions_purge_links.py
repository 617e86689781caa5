"""A purge never reaches through a link (docs/sessions.md, "Purge"): a
`purge-staging` that is a symbolic link is refused before anything under it
is touched, and so is a linked directory above a file the purge would take."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.sessions import purge
from actors.sessions.ids import new_session_id, staging_dir


def test_a_linked_purge_staging_is_refused_and_what_it_points_at_stays(tmp_path: Path) -> None:
    root, outside = tmp_path / "state", tmp_path / "outside"
    sid = new_session_id()
    (outside / sid).mkdir(parents=True)
    (outside / sid / "keep.txt").write_text("not the purge's")
    root.mkdir()
    (root / "purge-staging").symlink_to(outside)

    with pytest.raises(purge.PurgeRefusedError, match="symbolic link"):
        purge._remove_tree(staging_dir(root, sid))
    with pytest.raises(purge.PurgeRefusedError, match="symbolic link"):
        purge._real_dir(root / "purge-staging")
    assert (outside / sid / "keep.txt").read_text() == "not the purge's"


def test_a_linked_directory_above_an_owned_file_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "state", tmp_path / "outside"
    (outside / "state").mkdir(parents=True)
    (outside / "state" / "snapshot.json").write_text("{}")
    (root / "agents" / "a1").mkdir(parents=True)
    (root / "agents" / "a1" / "state").symlink_to(outside / "state")

    with pytest.raises(purge.PurgeRefusedError, match="symbolic link"):
        purge._walk(root / "agents" / "a1" / "state" / "snapshot.json", root)
