"""Change-set files are private to their owner: the manifest, the patch, the
blobs, the apply receipt are written read-only for the owner alone (0400),
never world-readable (they hold the child's file contents), like everything
else corral writes (docs/security.md, docs/changesets.md)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from actors.changesets import manifest as mf
from actors.changesets.apply import apply
from actors.changesets.build import build
from actors.changesets.snapshot import snapshot

pytestmark = pytest.mark.timeout(30)


def test_every_change_set_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    (parent / "src").mkdir(parents=True)
    (parent / "src" / "a.txt").write_bytes(b"secret-ish content\n")
    index = snapshot(parent, tmp_path / "sub" / "base", tmp_path / "sub" / "work")
    work = tmp_path / "sub" / "work"
    (work / "src" / "a.txt").write_bytes(b"changed\n")
    (work / "b.bin").write_bytes(b"\0new\xff")
    out = tmp_path / "sub" / "set"
    manifest = build("cs-modes", index, work, out)
    assert manifest.status == "ready", manifest.refusal
    apply(out, parent)
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {mf.MANIFEST, mf.PATCH, "application.json"} <= names and (out / "blobs").is_dir()
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert modes[mf.MANIFEST] == 0o400, modes
