"""What a child changed in its overlaid workspace (actors/changesets/overlay.py):
the candidates read from the upper directory, each compared through the
child's mounted view with the parent's bytes as the spawn found them
(docs/changesets.md, "Copy-on-write workspaces").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from actors.changesets import confined, gitpatch
from actors.changesets.build import check_after, scan
from actors.changesets.overlay import OverlayBase
from actors.changesets.paths import check_path
from actors.changesets.snapshot import git_mode
from broker.errors import ChangeSetRefusedError

_OPAQUE = "trusted.overlay.opaque"
_REDIRECT = "trusted.overlay.redirect"


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def changed_paths(base: OverlayBase, upper: Path, work: Path) -> list[str]:
    """Every path the child may have changed: what its upper directory holds,
    the base's paths below a directory it removed or replaced, and what its
    view `work` holds below a directory it renamed (a redirect)."""
    found: set[str] = set()
    stack: list[tuple[list[str], int]] = [([], os.open(upper, confined.DIR_FLAGS))]
    try:
        while stack:
            parts, dir_fd = stack.pop()
            try:
                with os.scandir(dir_fd) as it:
                    names = [item.name for item in it]
                for name in names:
                    rel = "/".join([*parts, name])
                    st = confined.lstat_at(dir_fd, name)
                    if st is None:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        sub = os.open(name, confined.DIR_FLAGS, dir_fd=dir_fd)
                        stack.append(([*parts, name], sub))
                        if _opaque(sub):
                            found.update(base.under(rel))
                        elif _redirected(sub):
                            found.update(f"{rel}/{p}" for p in scan(work / rel))
                        if rel in base.entries:
                            found.add(rel)  # a file replaced by a directory
                        continue
                    if _is_whiteout(st) and rel in base.hidden:
                        continue
                    found.add(rel)
                    found.update(base.under(rel))  # a directory removed or replaced
            finally:
                os.close(dir_fd)
    finally:
        for _, fd in stack:
            os.close(fd)
    return sorted(found)


def _redirected(dir_fd: int) -> bool:
    try:
        os.getxattr(dir_fd, _REDIRECT)
    except OSError:
        return False
    return True


def _opaque(dir_fd: int) -> bool:
    try:
        return os.getxattr(dir_fd, _OPAQUE) == b"y"
    except OSError:
        return False


def _merged(work_fd: int, rel: str) -> tuple[os.stat_result | None, int | None]:
    """lstat of `rel` in the child's view and an fd of its directory (None,
    None when a component is missing or not a directory)."""
    parts = rel.split("/")
    fd = os.dup(work_fd)
    try:
        for depth, part in enumerate(parts[:-1]):
            try:
                nxt = confined.open_dir(fd, part, parts[: depth + 1], confined.NO_GUARD)
            except FileNotFoundError:
                os.close(fd)
                return None, None
            except confined.UnsafeFileError as exc:
                if exc.kind == "symlink":
                    raise ChangeSetRefusedError("symlink", f"{rel!r}: {exc.reason}",
                                                rel) from exc
                os.close(fd)
                return None, None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    st = confined.lstat_at(fd, parts[-1])
    if st is None or stat.S_ISDIR(st.st_mode):
        os.close(fd)
        return None, None
    return st, fd


def _before(base: OverlayBase, rel: str) -> tuple[int, bytes]:
    """The parent's mode and bytes of `rel`, which must be as the spawn found
    them: every directory on the way the same inode, the file's ctime older
    than the stamp (no program can set a ctime back); else the set is stale."""
    parts = rel.split("/")
    stale = ChangeSetRefusedError(
        "stale", f"{rel!r} changed in the parent's workspace after the child started", rel)
    try:
        with confined.open_root(base.lower) as root_fd:
            fd = os.dup(root_fd)
            try:
                for depth in range(len(parts)):
                    if os.fstat(fd).st_ino != base.dirs.get("/".join(parts[:depth])):
                        raise stale
                    if depth < len(parts) - 1:
                        nxt = confined.open_dir(fd, parts[depth], parts[: depth + 1],
                                                confined.NO_GUARD)
                        os.close(fd)
                        fd = nxt
                return _leaf_before(base, fd, parts[-1], stale)
            finally:
                os.close(fd)
    except (OSError, confined.UnsafeFileError) as exc:
        raise stale from exc


def _leaf_before(base: OverlayBase, dir_fd: int, leaf: str,
                 stale: ChangeSetRefusedError) -> tuple[int, bytes]:
    st = confined.lstat_at(dir_fd, leaf)
    if st is None or st.st_ctime_ns >= base.stamp_ns:
        raise stale
    if stat.S_ISLNK(st.st_mode):
        return 0o120000, os.fsencode(os.readlink(leaf, dir_fd=dir_fd))
    fd = os.open(leaf, confined.FILE_FLAGS, dir_fd=dir_fd)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or fst.st_ctime_ns >= base.stamp_ns:
            raise stale
        return git_mode(fst.st_mode), confined.read_all(fd)
    finally:
        os.close(fd)


def diff(base: OverlayBase, upper: Path, work: Path) -> list[gitpatch.FileDiff]:
    """What the child changed, from its upper directory, read through its
    mounted view `work` and checked against the parent's workspace; raises
    ChangeSetRefusedError as build.diff_trees does, and `stale` for a file
    the parent changed since the spawn."""
    diffs: list[gitpatch.FileDiff] = []
    with confined.open_root(work) as work_fd:
        for rel in changed_paths(base, upper, work):
            entry = base.entries.get(rel)
            st, dir_fd = _merged(work_fd, rel)
            after: bytes | None = None
            after_mode: int | None = None
            if st is not None and dir_fd is not None:
                try:
                    after = check_after(dir_fd, rel, st)
                finally:
                    os.close(dir_fd)
                after_mode = git_mode(st.st_mode)
            if entry is None and after is None:
                continue  # made and removed again
            before_mode, before = _before(base, rel) if entry is not None else (None, None)
            if after is not None and after_mode == before_mode and after == before:
                continue  # rewritten with the same bytes
            check_path(rel)
            if after_mode == 0o120000 or before_mode == 0o120000:
                raise ChangeSetRefusedError("symlink", f"{rel!r}: a symlink was added, changed "
                                            "or removed (symlink mode is refused)", rel)
            diffs.append(gitpatch.FileDiff(rel, before, after, before_mode, after_mode))
    return diffs
