"""Workspace confinement: every path an agent op names is normalised here.

Paths are reached through actors/changesets/confined.py; `.corral/` is never
entered (the guard compares (st_dev, st_ino) while walking).
See docs/agents.md ("Workspace") and docs/security.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from actors.changesets import confined
from actors.changesets.paths import has_format_char
from broker.errors import PathRefusedError
from broker.statedir import StateDir

STATE_DIR_LABEL = "inside the state directory (.corral/): no op reads or writes it"


_GUARDS: dict[Path, confined.Guard] = {}


def guard_for(state_dir: StateDir) -> confined.Guard:
    """The guard of a state directory: its root and every tier in it, kept
    for the process once the root exists. A walk reaches a tier only through
    the root, which is always in it; the tiers (those that existed then)
    guard against a second name for them, such as a bind mount."""
    root = state_dir.root
    cached = _GUARDS.get(root)
    if cached is not None:
        return cached
    tiers = [root, state_dir.state_dir, state_dir.config_dir, state_dir.run_dir,
             state_dir.memory_dir, state_dir.logs_dir, state_dir.cache_dir, root / "agents",
             root / "subagents"]
    guard = confined.Guard(confined.identities(tiers), STATE_DIR_LABEL)
    if guard.protected and root.is_dir():
        _GUARDS[root] = guard
    return guard


_CONTROL = re.compile("[\x00-\x1f\x7f]")  # control characters: refused in a path


def normalise(workspace: Path, raw: str) -> str:
    """The workspace-relative form of `raw` ("." for the root); raise
    PathRefusedError when it is malformed or escapes the workspace."""
    if not raw:
        raise PathRefusedError(raw, "empty path")
    if _CONTROL.search(raw):
        raise PathRefusedError(raw, "control character in path")
    if has_format_char(raw):
        raise PathRefusedError(raw, "invisible format character in path (Unicode Cf, "
                               "e.g. a bidi override)")
    if raw.startswith("~"):
        raise PathRefusedError(raw, "'~' paths are refused; use a workspace-relative path")
    rel = raw
    if raw.startswith("/"):
        absolute = "/" + os.path.normpath(raw).lstrip("/")
        for base in dict.fromkeys((os.path.abspath(workspace), os.path.realpath(workspace))):
            if absolute == base:
                return "."
            if absolute.startswith(base.rstrip("/") + "/"):
                rel = absolute[len(base.rstrip("/")) + 1:]
                break
        else:
            raise PathRefusedError(raw, "absolute path outside the workspace")
    out: list[str] = []
    for part in rel.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                raise PathRefusedError(raw, "escapes the workspace ('..' above its root)")
            out.pop()
            continue
        out.append(part)
    return "/".join(out) or "."


@dataclass(frozen=True)
class Place:
    """A normalised path `rel` below `root`, reached under `guard`."""

    root: Path
    rel: str
    guard: confined.Guard = confined.NO_GUARD

    @property
    def parts(self) -> list[str]:
        return [] if self.rel == "." else self.rel.split("/")


def place(workspace: Path, raw: str, guard: confined.Guard = confined.NO_GUARD) -> Place:
    return Place(workspace, normalise(workspace, raw), guard)


def check(where: Place, *, want_dir: bool | None = None) -> None:
    """Refuse now what the walk would refuse later (a link on the way, the
    state directory, a multi-linked file); a missing path passes."""
    parts = where.parts
    if not parts:
        return
    try:
        with confined.open_root(where.root) as root_fd, \
                confined.walk(root_fd, parts[:-1], where.guard) as dir_fd:
            st = confined.lstat_at(dir_fd, parts[-1])
            if st is not None:
                confined.check_leaf(st, parts, where.guard, allow_dir=want_dir is not False)
    except (FileNotFoundError, NotADirectoryError):
        return


def resolve(workspace: Path, raw: str, *, write: bool = False,
            guard: confined.Guard = confined.NO_GUARD) -> Path:
    """`workspace / normalise(raw)` after `check`: for callers that hand a
    path to another process (a command's cwd, a child's task file)."""
    where = place(workspace, raw, guard)
    check(where, want_dir=None if not write else False)
    return workspace / where.rel if where.parts else workspace


def read_bytes(where: Place, limit: int | None = None) -> bytes | None:
    """The file's bytes (at most about `limit`), None when it does not exist."""
    if not where.parts:
        raise confined.UnsafeFileError(".", "is_a_directory", "'.' is a directory")
    try:
        with confined.open_root(where.root) as root_fd:
            found = confined.read(root_fd, where.parts, where.guard, limit)
    except FileNotFoundError:  # no root yet (a memory directory before its first note)
        return None
    return None if found is None else found[0]


def digest(where: Place) -> str | None:
    """sha256 of the file's bytes; None when absent, "directory" for a
    directory, "refused" when the walk refuses it (a link, several links)."""
    try:
        data = read_bytes(where)
    except confined.UnsafeFileError as exc:
        return "directory" if exc.kind == "is_a_directory" else "refused"
    except NotADirectoryError:
        return None
    return None if data is None else hashlib.sha256(data).hexdigest()


def content_digest(content: bytes | None) -> str | None:
    return None if content is None else hashlib.sha256(content).hexdigest()


def apply_write(where: Place, content: bytes | None) -> None:
    """Replace the file atomically (None: delete it), through the walk."""
    if not where.parts:
        raise confined.UnsafeFileError(".", "is_a_directory", "'.' is a directory")
    with contextlib.ExitStack() as stack:
        try:
            root_fd = stack.enter_context(confined.open_root(where.root))
        except FileNotFoundError:  # the first write of a workspace (or memory directory)
            where.root.mkdir(parents=True, exist_ok=True)
            root_fd = stack.enter_context(confined.open_root(where.root))
        if content is None:
            confined.delete(root_fd, where.parts, where.guard)
        else:
            confined.write(root_fd, where.parts, content, where.guard)


def remove_leftovers(root: Path, state_dir: StateDir) -> int:
    """After a restart: the temporary files of writes that a kill cut between
    creating and renaming them (confined.remove_leftovers); ops never showed
    them, and nothing else would ever remove them. Not while a change set may
    be being applied here: the subagents host writes this workspace then."""
    if not root.is_dir():
        return 0
    with confined.open_root(root) as root_fd:
        return confined.remove_leftovers(root_fd, guard_for(state_dir))

