"""Change sets: built from a snapshot and a child's tree, bounded, rendered as
a git patch that real `git apply` accepts with the same result as our
applier; unsafe paths and links refused (git's own escape cases), nothing
written outside the workspace; stale check, at most once, and SIGKILL at
every step of an apply still applies it exactly once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import zmq

from actors.changesets import manifest as mf
from actors.changesets import snapshot as snapshot_module
from actors.changesets.apply import FAULT_ENV, apply
from actors.changesets.build import build
from actors.changesets.manifest import FileChange, Limits, Manifest
from actors.changesets.paths import check_path
from actors.changesets.snapshot import snapshot
from actors.writer.client import WriterClient
from broker.errors import ChangeSetRefusedError, RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

BINARY = bytes(range(256)) * 5 + b"\0tail"


def write_tree(root: Path, files: dict[str, bytes], exec_paths: tuple[str, ...] = ()) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o755 if rel in exec_paths else 0o644)


def read_tree(root: Path, skip: tuple[str, ...] = (".git",)) -> dict[str, tuple[bytes, bool]]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in skip or path.is_dir():
            continue
        out[rel] = (path.read_bytes(), bool(path.stat().st_mode & 0o100))
    return out


BASE_FILES = {
    "README.md": b"hello\nworld\n",
    "src/app.py": b"".join(b"line %d\n" % i for i in range(40)),
    "src/no_newline.txt": b"first\nlast without newline",
    "crlf.txt": b"a\r\nb\r\n",
    "data/blob.bin": BINARY,
    "gone.txt": b"to be deleted\n",
    "gone.bin": b"\0\1\2",
    "dir with space/na\u00efve \"q\".txt".encode().decode(): b"x\n",
    "run.sh": b"#!/bin/sh\necho hi\n",
    "empty.txt": b"",
}


def edit_child(work: Path) -> None:
    (work / "README.md").write_bytes(b"hello\nthere\nworld\n")
    app = (work / "src/app.py").read_bytes().replace(b"line 20\n", b"LINE twenty\n")
    (work / "src/app.py").write_bytes(app + b"tail")
    (work / "src/no_newline.txt").write_bytes(b"first\nlast with newline now\n")
    (work / "crlf.txt").write_bytes(b"a\r\nB\r\n")
    (work / "data/blob.bin").write_bytes(BINARY[::-1])
    (work / "gone.txt").unlink()
    (work / "gone.bin").unlink()
    (work / "new/deep/file.txt").parent.mkdir(parents=True)
    (work / "new/deep/file.txt").write_bytes(b"new\n")
    (work / "new/empty").write_bytes(b"")
    (work / "new/bin.dat").write_bytes(b"\0\0\xff")
    (work / "dir with space/na\u00efve \"q\".txt").write_bytes(b"y\n")
    (work / "run.sh").chmod(0o644)
    (work / "empty.txt").write_bytes(b"now text\n")


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


def make_set(tmp: Path, files: dict[str, bytes], edit: object, *, limits: Limits | None = None,
             exec_paths: tuple[str, ...] = ("run.sh",),
             changeset_id: str = "cs-1") -> tuple[Path, Path, Manifest]:
    parent = tmp / "parent"
    write_tree(parent, files, exec_paths)
    index = snapshot(parent, tmp / "sub" / "base", tmp / "sub" / "work")
    edit(tmp / "sub" / "work")  # type: ignore[operator]
    out = tmp / "sub" / "set"
    return parent, out, build(changeset_id, index, tmp / "sub" / "work", out, limits=limits)


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, env=env, check=False)


def test_patch_applies_with_real_git_and_equals_our_apply(tmp: Path) -> None:
    parent, out, manifest = make_set(tmp, BASE_FILES, edit_child)
    assert manifest.status == "ready", manifest.refusal
    assert {c.path: c.op for c in manifest.files}["gone.txt"] == "delete"
    expected = read_tree(tmp / "sub" / "work")
    scratch = tmp / "scratch"
    shutil.copytree(parent, scratch, symlinks=True)
    assert git(scratch, "init", "-q").returncode == 0
    check = git(scratch, "apply", "--check", "-v", str(out / mf.PATCH))
    assert check.returncode == 0, check.stderr.decode()
    assert git(scratch, "apply", str(out / mf.PATCH)).returncode == 0
    assert read_tree(scratch) == expected
    receipt = apply(out, parent)
    assert read_tree(parent) == expected
    assert receipt.changeset_id == "cs-1" and not receipt.recovered
    assert mf.load_receipt(out) == receipt
    assert (out / mf.MANIFEST).stat().st_mode & 0o777 == 0o400  # immutable, private
    with pytest.raises(ChangeSetRefusedError) as info:
        apply(out, parent)
    assert info.value.bound == "already_applied"


def test_untouched_workspace_gives_an_empty_ready_set(tmp: Path) -> None:
    _, _, manifest = make_set(tmp, BASE_FILES, lambda work: None)
    assert (manifest.status, manifest.files, manifest.patch_bytes) == ("ready", [], 0)


@pytest.mark.parametrize("path", [
    "/etc/passwd", "../escape", "a/../../b", "./a", "a//b", ".git/config", ".GIT/config",
    "sub/.Git/hooks/pre-commit", ".git./config", ".git /x", "git~1/config", "a\x01b", "a\nb",
    "a\\b", ".corral/state/x", ".Corral/x", "", "a/\u200c.git/x",
])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(ChangeSetRefusedError) as info:
        check_path(path)
    assert info.value.bound == "unsafe_path"


@pytest.mark.parametrize("path", ["a.txt", "dir with space/f", ".gitignore", ".github/x",
                                  "x.git", "corral/x", "sub/.corral/x"])
def test_safe_paths_are_accepted(path: str) -> None:
    assert check_path(path) == path


@pytest.mark.parametrize(("edit", "bound"), [
    (lambda w: (w / "link").symlink_to("/etc/passwd"), "symlink"),
    (lambda w: (w / "dot").mkdir() or (w / "dot" / ".git").mkdir()
     or (w / "dot/.git/config").write_text("x"), "unsafe_path"),
    (lambda w: (w / ".git").mkdir() or (w / ".git" / "HEAD").write_text("x"), "unsafe_path"),
    (lambda w: (w / ".corral").mkdir() or (w / ".corral" / "x").write_text("x"), "unsafe_path"),
    (lambda w: os.mkfifo(w / "fifo"), "special_file"),
])
def test_child_changes_that_a_set_cannot_carry_are_refused(
    tmp: Path, edit: object, bound: str,
) -> None:
    _, out, manifest = make_set(tmp, {"a.txt": b"a\n"}, edit)
    assert manifest.status == "refused"
    assert manifest.refusal is not None and manifest.refusal.bound == bound
    assert not (out / mf.PATCH).exists()
    with pytest.raises(ChangeSetRefusedError) as info:
        apply(out, tmp / "parent")
    assert info.value.bound == "not_ready"


@pytest.mark.parametrize("piece", [7, 1 << 30])  # a write for each file; one at the end
def test_a_snapshot_copies_each_kind_and_packs_every_byte(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, piece: int,
) -> None:
    """The copy is made through directory fds on both sides and the pack is
    written in pieces: with pieces of a few bytes, every file's packed bytes
    are still its own, links are copied as links, and what a set cannot
    carry (a fifo, `.git`, a top-level `.corral`) is not copied."""
    monkeypatch.setattr(snapshot_module, "PACK_FLUSH_BYTES", piece)
    parent = tmp / "parent"
    write_tree(parent, BASE_FILES, ("run.sh",))
    (parent / "src" / "link").symlink_to("app.py")
    os.mkfifo(parent / "fifo")
    (parent / ".git").mkdir()
    (parent / ".git" / "HEAD").write_text("ref\n")
    (parent / ".corral").mkdir()
    (parent / ".corral" / "x").write_text("x")
    index = snapshot(parent, tmp / "sub" / "base", tmp / "sub" / "work")
    work = tmp / "sub" / "work"
    assert set(index.entries) == {*BASE_FILES, "src/link"}
    for rel, data in BASE_FILES.items():
        assert index.content(rel) == data
        assert (work / rel).read_bytes() == data
    assert os.readlink(work / "src" / "link") == "app.py"
    assert index.entries["src/link"].mode == 0o120000
    assert index.entries["run.sh"].mode == 0o100755
    assert not (work / "fifo").exists() and not (work / ".git").exists()
    assert not (work / ".corral").exists()
    packed = sum(len(data) for data in BASE_FILES.values())
    assert (tmp / "sub" / "base" / "base.pack").stat().st_size == packed


def test_renaming_a_symlink_then_writing_through_it_is_refused(tmp: Path) -> None:
    files = {"a.txt": b"a\n"}
    parent = tmp / "parent"
    write_tree(parent, files)
    (parent / "link").symlink_to(tmp / "outside")
    (tmp / "outside").mkdir()
    index = snapshot(parent, tmp / "sub" / "base", tmp / "sub" / "work")
    work = tmp / "sub" / "work"
    (work / "link").rename(work / "renamed")
    out = tmp / "sub" / "set"
    manifest = build("cs-1", index, work, out)
    assert manifest.refusal is not None and manifest.refusal.bound == "symlink"
    assert list((tmp / "outside").iterdir()) == []


@pytest.mark.parametrize(("limits", "bound"), [
    (Limits(max_files=3), "max_files"),
    (Limits(max_input_bytes=100), "max_input_bytes"),
    (Limits(max_patch_bytes=200), "max_patch_bytes"),
])
def test_oversized_sets_are_refused_naming_the_bound(
    tmp: Path, limits: Limits, bound: str,
) -> None:
    _, out, manifest = make_set(tmp, BASE_FILES, edit_child, limits=limits)
    assert manifest.status == "refused" and manifest.refusal is not None
    assert manifest.refusal.bound == bound
    assert manifest.refusal.limit is not None and manifest.refusal.actual is not None
    assert manifest.refusal.actual > manifest.refusal.limit
    assert json.loads((out / mf.MANIFEST).read_text())["refusal"]["bound"] == bound


def test_default_bounds_are_the_seeds(tmp: Path) -> None:
    files = {f"f{i}.txt": b"x\n" for i in range(70)}

    def edit(work: Path) -> None:
        for i in range(65):
            (work / f"f{i}.txt").write_bytes(b"y\n")

    _, _, manifest = make_set(tmp, files, edit)
    assert manifest.refusal is not None and manifest.refusal.bound == "max_files"
    assert manifest.limits == Limits(max_files=64, max_input_bytes=256 * 1024,
                                     max_patch_bytes=512 * 1024)


def _forged(out: Path, manifest: Manifest, path: str) -> None:
    """Rewrite a ready set's manifest to touch `path` (a tampered set)."""
    change = FileChange(path=path, op="add", before_sha256=None,
                        after_sha256=manifest.files[0].after_sha256, before_size=0,
                        after_size=manifest.files[0].after_size, before_mode=None,
                        after_mode=0o100644, binary=False)
    forged = manifest.model_copy(update={"files": [change]})
    (out / mf.MANIFEST).chmod(0o644)
    (out / mf.MANIFEST).write_text(forged.model_dump_json())


@pytest.mark.parametrize("path", ["../escape.txt", "/tmp/abs-escape.txt", "out/pwned.txt",
                                  "outfile", ".git/hooks/post-checkout", ".corral/x"])
def test_tampered_sets_never_write_outside_the_workspace(tmp: Path, path: str) -> None:
    parent, out, manifest = make_set(tmp, {"a.txt": b"a\n"},
                                     lambda w: (w / "a.txt").write_bytes(b"b\n"))
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "target").write_text("keep")
    (parent / "out").symlink_to(outside)
    (parent / "outfile").symlink_to(outside / "target")
    (parent / ".git" / "hooks").mkdir(parents=True)
    _forged(out, manifest, path)
    before = read_tree(tmp, skip=())
    with pytest.raises(ChangeSetRefusedError) as info:
        apply(out, parent)
    assert info.value.bound in {"unsafe_path", "symlink"}
    assert read_tree(tmp, skip=()) == before
    assert not Path("/tmp/abs-escape.txt").exists()


def test_stale_workspace_is_refused_and_nothing_changes(tmp: Path) -> None:
    parent, out, _ = make_set(tmp, BASE_FILES, edit_child)
    (parent / "src/app.py").write_bytes(b"edited by the parent meanwhile\n")
    before = read_tree(parent)
    with pytest.raises(ChangeSetRefusedError) as info:
        apply(out, parent)
    assert (info.value.bound, info.value.path) == ("stale", "src/app.py")
    assert read_tree(parent) == before
    assert not (out / mf.INTENT).exists() and not (out / mf.RECEIPT).exists()


@pytest.mark.process
@pytest.mark.timeout(180)  # about 20 interpreters in a row: 30 s quiet, 60+ s on a loaded host
def test_sigkill_at_every_step_of_an_apply_applies_it_exactly_once(
    tmp: Path, processes: ProcessTracker, state_dir: StateDir,
) -> None:
    files = {"a.txt": b"a\n", "b.txt": b"b\n", "c.txt": b"c\n"}

    def edit(work: Path) -> None:
        (work / "a.txt").write_bytes(b"A\n")
        (work / "b.txt").unlink()
        (work / "d.txt").write_bytes(b"d\n")

    expected: dict[str, tuple[bytes, bool]] = {}
    processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="writer")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    reader = WriterClient(ctx, state_dir, "test")
    try:
        def answered() -> bool:
            try:
                reader.ping(timeout_s=0.2, retries=0)
            except RequestTimeoutError:
                return False
            return True

        wait_for(answered, 15, "the writer")
        steps = ["checked", "intent", "file0", "file1", "file2", "files", "receipt", "fact",
                 "done"]
        for step in steps:
            ws, cs, manifest = make_set(tmp / step, files, edit, changeset_id=f"cs-{step}")
            expected = read_tree(tmp / step / "sub" / "work")
            assert len(manifest.files) == 3
            argv = ["-m", "actors.changesets", "apply", str(cs), "--workspace", str(ws),
                    "--state-dir", str(state_dir.root), "--stream", f"apply/{step}"]
            crashed = processes.spawn(argv, name=f"apply-{step}", env={FAULT_ENV: step})
            assert crashed.wait(30) == -signal.SIGKILL, processes.output(f"apply-{step}")
            again = processes.spawn(argv, name=f"again-{step}")
            code = again.wait(30)
            assert code == (1 if step == "done" else 0), processes.output(f"again-{step}")
            assert read_tree(ws) == expected, step
            assert mf.load_receipt(cs) is not None
            assert not (cs / mf.INTENT).exists()
            facts = [r.event for r in reader.read_stream(f"apply/{step}")]
            assert facts == ["subagent_applied"], (step, facts)
            third = processes.spawn(argv, name=f"third-{step}")
            assert third.wait(30) == 1  # refused: already applied
            assert "already_applied" in processes.output(f"third-{step}")
    finally:
        reader.close()
        ctx.destroy(linger=0)
