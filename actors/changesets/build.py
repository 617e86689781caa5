"""Building a change set: the child's tree against its base, bounds enforced.

A set over a bound is written `refused`, with no patch. See docs/changesets.md
("Building").
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from actors.changesets import confined, gitpatch
from actors.changesets.manifest import (
    BLOBS,
    MANIFEST,
    PATCH,
    FileChange,
    Limits,
    Manifest,
    Refusal,
    encode,
    write_once,
)
from actors.changesets.paths import check_path
from actors.changesets.snapshot import BaseIndex, copy_key, git_mode
from broker.durable import fsync_dir
from broker.errors import ChangeSetRefusedError

_Current = tuple[int, bytes, os.stat_result]  # (git mode, content or link target, stat)


def scan(work: Path) -> dict[str, os.stat_result]:
    """Every non-directory under `work` by relative path, walked through
    directory fds without following a link (a directory swapped for a
    symlink during the walk is refused with bound `symlink`)."""
    found: dict[str, os.stat_result] = {}
    stack: list[tuple[list[str], int]] = []
    try:
        stack.append(([], os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)))
        while stack:
            parts, dir_fd = stack.pop()
            try:
                with os.scandir(dir_fd) as it:
                    names = [item.name for item in it]
                for name in names:
                    st = confined.lstat_at(dir_fd, name)
                    if st is None:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(([*parts, name], _open_dir(dir_fd, [*parts, name])))
                    else:
                        found["/".join([*parts, name])] = st
            finally:
                os.close(dir_fd)
    finally:
        for _, fd in stack:
            os.close(fd)
    return found


def _open_dir(dir_fd: int, parts: list[str]) -> int:
    try:
        return confined.open_dir(dir_fd, parts[-1], parts, confined.NO_GUARD)
    except confined.UnsafeFileError as exc:
        rel = "/".join(parts)
        raise ChangeSetRefusedError("symlink", f"{rel!r}: {exc.reason}", rel) from exc


def _read(work: Path, rel: str, st: os.stat_result) -> bytes:
    """A changed file's bytes (a link's target), reached through directory fds."""
    parts = rel.split("/")
    try:
        with confined.open_root(work) as root_fd, \
                confined.walk(root_fd, parts[:-1]) as dir_fd:
            return _read_leaf(dir_fd, parts[-1], rel, st)
    except confined.UnsafeFileError as exc:
        raise ChangeSetRefusedError("symlink", f"{rel!r}: {exc.reason}", rel) from exc


def _read_leaf(dir_fd: int, leaf: str, rel: str, st: os.stat_result) -> bytes:
    if stat.S_ISLNK(st.st_mode):
        return os.fsencode(os.readlink(leaf, dir_fd=dir_fd))
    try:
        fd = os.open(leaf, confined.FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise ChangeSetRefusedError("symlink", f"{rel!r} changed while the set was built",
                                    rel) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ChangeSetRefusedError("special_file", f"{rel!r} is not a regular file", rel)
        return confined.read_all(fd)
    finally:
        os.close(fd)


def check_after(dir_fd: int, rel: str, st: os.stat_result) -> bytes:
    """The child's bytes of `rel` (a link's target), whose lstat is `st`, in
    the directory `dir_fd`; a special file is refused."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        check_path(rel)
        raise ChangeSetRefusedError("special_file", f"{rel!r} is not a regular file", rel)
    return _read_leaf(dir_fd, rel.rsplit("/", 1)[-1], rel, st)


def diff_trees(index: BaseIndex, work: Path) -> list[gitpatch.FileDiff]:
    """What changed from the base to `work`; raises ChangeSetRefusedError for
    a change the set cannot carry (a link, a special file, an unsafe path)."""
    current = scan(work)
    diffs: list[gitpatch.FileDiff] = []
    for rel in sorted(set(index.entries) | set(current)):
        base = index.entries.get(rel)
        st = current.get(rel)
        if base is not None and st is not None and base.copy_key == copy_key(st):
            continue  # the child never wrote it
        after: bytes | None = None
        after_mode: int | None = None
        if st is not None:
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                check_path(rel)
                raise ChangeSetRefusedError("special_file", f"{rel!r} is not a regular file", rel)
            after = _read(work, rel, st)
            after_mode = git_mode(st.st_mode)
        if base is not None and after is not None and after_mode == base.mode and \
                hashlib.sha256(after).hexdigest() == base.sha256:
            continue  # rewritten with the same bytes
        check_path(rel)
        if after_mode == 0o120000 or (base is not None and base.mode == 0o120000):
            raise ChangeSetRefusedError("symlink", f"{rel!r}: a symlink was added, changed or "
                                        "removed (symlink mode is refused)", rel)
        before = index.content(rel) if base is not None else None
        diffs.append(gitpatch.FileDiff(rel, before, after, base.mode if base else None,
                                       after_mode))
    return diffs


def _change(d: gitpatch.FileDiff) -> FileChange:
    op = "add" if d.before is None else "delete" if d.after is None else "modify"
    return FileChange(
        path=d.path, op=op,
        before_sha256=hashlib.sha256(d.before).hexdigest() if d.before is not None else None,
        after_sha256=hashlib.sha256(d.after).hexdigest() if d.after is not None else None,
        before_size=len(d.before or b""), after_size=len(d.after or b""),
        before_mode=d.before_mode, after_mode=d.after_mode,
        binary=gitpatch.is_binary(d.before) or gitpatch.is_binary(d.after),
    )


def build(
    changeset_id: str, index: BaseIndex, work: Path, out: Path, *,
    limits: Limits | None = None, task_sha256: str | None = None,
) -> Manifest:
    """Write the change set of `work` against `index` into `out`; return it."""
    return build_from(changeset_id, index.digest(), lambda: diff_trees(index, work), out,
                      limits=limits, task_sha256=task_sha256)


def build_from(
    changeset_id: str, base_sha256: str, diff: Callable[[], list[gitpatch.FileDiff]],
    out: Path, *, limits: Limits | None = None, task_sha256: str | None = None,
) -> Manifest:
    """Write the change set `diff()` gives against the base `base_sha256`
    into `out` (the copy's diff_trees, or actors/changesets/overlay.py's)."""
    limits = limits or Limits()
    out.mkdir(parents=True, exist_ok=True)
    common = {"changeset_id": changeset_id, "created_at": time.time(),
              "task_sha256": task_sha256, "base_sha256": base_sha256, "limits": limits}
    try:
        diffs = diff()
    except ChangeSetRefusedError as exc:
        return _refused(out, common, Refusal(bound=exc.bound, detail=exc.detail, path=exc.path))
    changes = [_change(d) for d in diffs]
    input_bytes = sum(c.before_size + c.after_size for c in changes)
    if len(changes) > limits.max_files:
        return _refused(out, common, Refusal(
            bound="max_files", detail=f"{len(changes)} files changed > {limits.max_files}",
            limit=limits.max_files, actual=len(changes)), changes, input_bytes)
    if input_bytes > limits.max_input_bytes:
        return _refused(out, common, Refusal(
            bound="max_input_bytes",
            detail=f"{input_bytes} bytes before+after > {limits.max_input_bytes}",
            limit=limits.max_input_bytes, actual=input_bytes), changes, input_bytes)
    patch = gitpatch.render(diffs)
    if len(patch) > limits.max_patch_bytes:
        return _refused(out, common, Refusal(
            bound="max_patch_bytes", detail=f"patch of {len(patch)} bytes > "
            f"{limits.max_patch_bytes}", limit=limits.max_patch_bytes, actual=len(patch)),
            changes, input_bytes)
    blobs = out / BLOBS
    blobs.mkdir(exist_ok=True)
    # each file's data fsynced on its own, their names by one fsync of each
    # directory, all before the manifest that names them (the commit point)
    for d, c in zip(diffs, changes, strict=True):
        if d.after is not None and c.after_sha256 is not None:
            write_once(blobs / c.after_sha256, d.after, sync_dir=False)
    write_once(out / PATCH, patch, sync_dir=False)
    fsync_dir(blobs)
    fsync_dir(out)
    manifest = Manifest(**common, status="ready", files=changes, input_bytes=input_bytes,
                        patch_bytes=len(patch), patch_sha256=hashlib.sha256(patch).hexdigest())
    write_once(out / MANIFEST, encode(manifest))
    return manifest


def _refused(out: Path, common: dict[str, object], refusal: Refusal,
             changes: list[FileChange] | None = None, input_bytes: int = 0) -> Manifest:
    manifest = Manifest.model_validate({
        **common, "status": "refused", "files": changes or [], "input_bytes": input_bytes,
        "patch_bytes": 0, "patch_sha256": None, "refusal": refusal,
    })
    write_once(out / MANIFEST, encode(manifest))
    return manifest
