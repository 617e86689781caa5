"""Workspace confinement and the write-gate: every path an op names is resolved
here, and nowhere else.

A path is refused when it is empty, absolute (or `~`), has a `..` component,
or resolves (symlinks followed, at every level) outside the workspace. A write
is also refused when its real target lies under the state directory's
`state/` or `config/` (the recovery-core tier of seeds/state-layout.txt: only
the writer and dedicated commands write there), whatever the workspace is.

Writes are atomic: a temp file in the target's directory, fsync, rename.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from broker.errors import PathRefusedError


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def resolve(workspace: Path, rel: str, *, write: bool, protected: Sequence[Path] = ()) -> Path:
    """The real path of `rel` inside `workspace`; raise PathRefusedError."""
    if not rel or "\x00" in rel:
        raise PathRefusedError(rel, "empty path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("~") or os.path.isabs(rel):
        raise PathRefusedError(rel, "absolute paths are refused; use a workspace-relative path")
    if ".." in pure.parts:
        raise PathRefusedError(rel, "'..' is refused")
    root = Path(os.path.realpath(workspace))
    real = Path(os.path.realpath(root / pure))
    if not _inside(real, root):
        raise PathRefusedError(rel, "resolves outside the workspace (symlink)")
    if write:
        for guarded in protected:
            if _inside(real, Path(os.path.realpath(guarded))):
                raise PathRefusedError(rel, f"write-gate: {guarded.name}/ is recovery-core")
    return real


def relative(workspace: Path, real: Path) -> str:
    """`real` as a workspace-relative posix path ("." for the root)."""
    return real.relative_to(os.path.realpath(workspace)).as_posix() or "."


def digest(path: Path) -> str | None:
    """sha256 of a file's bytes, None when it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return "directory"
    return hashlib.sha256(data).hexdigest()


def content_digest(content: bytes | None) -> str | None:
    return None if content is None else hashlib.sha256(content).hexdigest()


def apply_write(target: Path, content: bytes | None) -> None:
    """Replace `target` atomically (None: delete it)."""
    if content is None:
        target.unlink(missing_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.corral-tmp")
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
