"""Copy-on-write workspaces (actors/changesets/overlay.py): a child's workspace
mounted as an overlay of its parent's. For the same edits (create, modify,
delete, rename, a directory removed or renamed) the set read from the upper
directory equals the copy's, byte for byte, and real git applies it; a file
the parent changed after the spawn makes the set stale, at build or at
apply; `.git` and `.corral` are hidden from the child; the mount survives an
unmount and a remount (a host's restart); where no overlay can be mounted
the probe says why and the host copies instead. An overlaid child's first
capture reads none of the files its parent's stat cache vouches for."""


from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.changesets import manifest as mf
from actors.changesets import overlay, overlaydiff
from actors.changesets.apply import apply
from actors.changesets.build import build, build_from
from actors.changesets.manifest import Manifest
from actors.changesets.snapshot import snapshot
from actors.subagents.children import ChildRecord, Children
from actors.subagents.host import SubagentsHost
from actors.trees import recorder
from broker.errors import ChangeSetRefusedError
from broker.statedir import StateDir
from tests.test_changesets import BASE_FILES, edit_child, git, read_tree, write_tree
from tests.test_trees_seed import _past_the_tick


def _overlay_refused() -> str | None:
    with tempfile.TemporaryDirectory(prefix="corral-cow-probe-") as scratch:
        return overlay.probe(Path(scratch) / "p")


REFUSED = _overlay_refused()
needs_overlay = pytest.mark.skipif(REFUSED is not None,
                                   reason=f"no overlay can be mounted here: {REFUSED}")


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[list[Path]]:
    """Child directories whose overlay is unmounted at teardown."""
    made: list[Path] = []
    yield made
    for directory in made:
        overlay.unmount(directory)


def edit_more(work: Path) -> None:
    edit_child(work)
    os.rename(work / "README.md", work / "READ_ME.md")  # a rename: delete + add
    shutil.rmtree(work / "data")  # a directory removed
    os.rename(work / "src", work / "lib")  # a directory renamed (copied by the overlay)


def _cow_set(tmp: Path, parent: Path, edit: object) -> tuple[Path, Manifest]:
    directory = tmp / "cow"
    base = overlay.prepare(parent, directory)
    edit(directory / "work")  # type: ignore[operator]
    out = tmp / "cow-set"
    return directory, build_from("cs-1", base.digest(), lambda: overlaydiff.diff(
        base, directory / overlay.UPPER, directory / "work"), out)


def _rows(manifest: Manifest) -> list[tuple[object, ...]]:
    return [(c.path, c.op, c.before_sha256, c.after_sha256, c.before_mode, c.after_mode)
            for c in manifest.files]


@needs_overlay
def test_the_overlays_set_equals_the_copys_and_applies_with_git(
        tmp_path: Path, mounts: list[Path]) -> None:
    parent = tmp_path / "parent"
    write_tree(parent, BASE_FILES, ("run.sh",))
    index = snapshot(parent, tmp_path / "copy" / "base", tmp_path / "copy" / "work")
    edit_more(tmp_path / "copy" / "work")
    copied = build("cs-1", index, tmp_path / "copy" / "work", tmp_path / "copy-set")
    mounts.append(tmp_path / "cow")
    directory, manifest = _cow_set(tmp_path, parent, edit_more)
    assert os.path.ismount(directory / "work")
    assert manifest.status == "ready", manifest.refusal
    assert _rows(manifest) == _rows(copied)
    ops = {c.path: c.op for c in manifest.files}
    assert ops["README.md"] == "delete" and ops["READ_ME.md"] == "add"
    assert ops["data/blob.bin"] == "delete" and ops["lib/app.py"] == "add"
    assert ops["src/app.py"] == "delete" and ops["gone.txt"] == "delete"
    assert ops["run.sh"] == "modify" and ops["new/deep/file.txt"] == "add"
    patch = (tmp_path / "cow-set" / mf.PATCH).read_bytes()
    assert patch == (tmp_path / "copy-set" / mf.PATCH).read_bytes()
    # only what the child wrote is in the upper directory, and nothing of the parent moved
    upper = directory / overlay.UPPER
    written = {p.relative_to(upper).as_posix() for p in upper.rglob("*") if p.is_file()}
    assert written and written <= {c.path for c in manifest.files if c.op != "delete"}
    assert read_tree(parent) == {k: (v, k == "run.sh") for k, v in BASE_FILES.items()}
    expected = read_tree(directory / "work")
    scratch = tmp_path / "scratch"
    shutil.copytree(parent, scratch)
    assert git(scratch, "init", "-q").returncode == 0
    assert git(scratch, "apply", str(tmp_path / "cow-set" / mf.PATCH)).returncode == 0
    assert read_tree(scratch) == expected
    apply(tmp_path / "cow-set", parent)
    assert read_tree(parent) == expected


@needs_overlay
def test_a_file_the_parent_changed_after_the_spawn_makes_the_set_stale(
        tmp_path: Path, mounts: list[Path]) -> None:
    parent = tmp_path / "parent"
    write_tree(parent, BASE_FILES, ("run.sh",))
    directory = tmp_path / "cow"
    mounts.append(directory)
    base = overlay.prepare(parent, directory)
    work = directory / "work"
    (work / "README.md").write_bytes(b"the child's\n")
    (work / "crlf.txt").write_bytes(b"the child's too\n")
    (parent / "src/app.py").write_bytes(b"the parent's, untouched by the child\n")
    (parent / "README.md").write_bytes(b"the parent's\n")  # both changed it: a conflict

    def built(name: str) -> Manifest:
        return build_from(name, base.digest(), lambda: overlaydiff.diff(
            base, directory / overlay.UPPER, work), tmp_path / name)

    stale = built("first")
    assert stale.status == "refused" and stale.refusal is not None
    assert (stale.refusal.bound, stale.refusal.path) == ("stale", "README.md")
    (parent / "README.md").unlink()  # removed by the parent: stale as well
    again = built("second")
    assert again.refusal is not None and again.refusal.bound == "stale"
    (work / "README.md").unlink()  # the child removes it too: the rest is ready
    ready = built("third")
    assert ready.status == "ready", ready.refusal
    assert {c.path for c in ready.files} == {"crlf.txt"}  # not the parent's own change
    (parent / "crlf.txt").write_bytes(b"changed after the build\n")
    with pytest.raises(ChangeSetRefusedError) as info:
        apply(tmp_path / "third", parent)
    assert info.value.bound == "stale"


@needs_overlay
def test_git_and_corral_are_hidden_and_a_git_the_child_makes_is_refused(
        tmp_path: Path, mounts: list[Path]) -> None:
    parent = tmp_path / "parent"
    write_tree(parent, {"a.txt": b"a\n", ".git/config": b"[core]\n", "sub/.git/HEAD": b"x\n",
                        ".corral/wal": b"secret\n", "sub/b.txt": b"b\n"})
    directory = tmp_path / "cow"
    mounts.append(directory)
    base = overlay.prepare(parent, directory)
    work = directory / "work"
    assert sorted(os.listdir(work)) == ["a.txt", "sub"]
    assert sorted(os.listdir(work / "sub")) == ["b.txt"]
    assert base.hidden == {".git", ".corral", "sub/.git"}
    ready = build_from("ok", base.digest(), lambda: overlaydiff.diff(
        base, directory / overlay.UPPER, work), tmp_path / "ok")
    assert (ready.status, ready.files) == ("ready", [])  # the whiteouts are no change
    (work / ".git").mkdir()
    (work / ".git/config").write_bytes(b"[core]\n\thooksPath = /tmp\n")
    refused = build_from("git", base.digest(), lambda: overlaydiff.diff(
        base, directory / overlay.UPPER, work), tmp_path / "git")
    assert refused.refusal is not None and refused.refusal.bound == "unsafe_path"
    assert (parent / ".git/config").read_bytes() == b"[core]\n"


@needs_overlay
def test_what_the_child_wrote_survives_an_unmount_and_a_remount(
        tmp_path: Path, mounts: list[Path]) -> None:
    parent = tmp_path / "parent"
    write_tree(parent, {"a.txt": b"a\n", "b.txt": b"b\n"})
    directory = tmp_path / "cow"
    mounts.append(directory)
    base = overlay.prepare(parent, directory)
    (directory / "work" / "a.txt").write_bytes(b"the child's\n")
    (directory / "work" / "b.txt").unlink()
    overlay.unmount(directory)
    assert not os.path.ismount(directory / "work")
    overlay.ensure_mounted(directory)
    overlay.ensure_mounted(directory)  # once
    assert (directory / "work" / "a.txt").read_bytes() == b"the child's\n"
    loaded = overlay.OverlayBase.load(directory / "base")
    assert loaded.digest() == base.digest()
    manifest = build_from("m", loaded.digest(), lambda: overlaydiff.diff(
        loaded, directory / overlay.UPPER, directory / "work"), tmp_path / "m")
    assert {(c.path, c.op) for c in manifest.files} == {("a.txt", "modify"), ("b.txt", "delete")}


def test_without_an_overlay_the_probe_says_why_and_the_host_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(lower: str, directory: Path) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", str(directory))

    monkeypatch.setattr(overlay, "mount", refused)
    assert overlay.probe(tmp_path / "probe") == "PermissionError: Operation not permitted"
    assert not (tmp_path / "probe").exists()
    parent = tmp_path / "parent"
    write_tree(parent, {"a.txt": b"a\n"})
    state = StateDir(tmp_path / ".corral").ensure()
    host = SimpleNamespace(cow=True, state=state)
    directory = tmp_path / "child"
    index = SubagentsHost._snapshot(host, parent, directory, copy=False)  # type: ignore[arg-type]
    assert not isinstance(index, overlay.OverlayBase)
    assert not (directory / overlay.UPPER).exists()  # the overlay's beginnings removed
    assert (directory / "work" / "a.txt").read_bytes() == b"a\n"  # a copy
    assert not overlay.is_overlay(directory / "base")


@needs_overlay
def test_an_overlaid_childs_first_capture_trusts_its_parents_stat_cache(
        tmp_path: Path, mounts: list[Path]) -> None:
    state = StateDir(tmp_path / ".corral").ensure()
    parent = tmp_path / "parent"
    write_tree(parent, {f"pkg{i // 10}/mod{i}.py": b"# %d\n" % i * 20 for i in range(40)})
    (parent / "pkg0" / "mod0.py").write_bytes(b"newest\n")
    newest = os.lstat(parent / "pkg0" / "mod0.py").st_ctime_ns
    _past_the_tick(state.cache_dir / "trees", newest)
    reference = recorder.capturer_for(state, "p", parent).capture()
    assert reference.hashed == 40
    directory = tmp_path / "cow"
    mounts.append(directory)
    overlay.prepare(parent, directory)
    (directory / "work" / "pkg1" / "mod10.py").write_bytes(b"the child's\n")
    host = SimpleNamespace(state=state)
    SubagentsHost._seed_from_parent(host, "p.s-1", "p")  # type: ignore[arg-type]
    child = recorder.capturer_for(state, "p.s-1", directory / "work").capture()
    assert child.hashed == 1  # only what the child wrote
    unseeded = recorder.capturer_for(state, "q", directory / "work").capture()
    assert unseeded.hashed == 40 and unseeded.digest == child.digest != reference.digest


def test_a_child_whose_overlay_cannot_be_mounted_again_is_failed_not_resumed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host restarted where it may no longer mount (its running child's
    overlay gone with a reboot) fails that child instead of starting it on
    an empty directory or dying at every start."""
    directory = tmp_path / "child"
    (directory / "base").mkdir(parents=True)
    (directory / "work").mkdir()
    overlay.OverlayBase(directory / "base", str(tmp_path), 0, {"": 1}, {}, []).save()

    def refused(lower: str, directory: Path) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", str(directory))

    monkeypatch.setattr(overlay, "mount", refused)
    children = Children(tmp_path / "registry.json")
    children.records["s-1"] = ChildRecord(subagent_id="s-1", parent="p", name="p.s-1",
                                          directory=str(directory), workspace=str(tmp_path),
                                          task="t", state="running")
    host = SimpleNamespace(children=children, counts={"failed": 0})
    host._start = lambda child: SubagentsHost._start(host, child)  # type: ignore[arg-type]
    SubagentsHost._recover(host)  # type: ignore[arg-type]
    assert children.records["s-1"].state == "failed" and host.counts == {"failed": 1}
    assert Children.load(tmp_path / "registry.json").records["s-1"].state == "failed"
