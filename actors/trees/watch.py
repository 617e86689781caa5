"""An inotify watch over a workspace's directories: which names changed.

See docs/trees.md ("Watched captures") and docs/decisions.md ("Captures
watch the workspace with inotify").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from inotify_simple import Event, INotify, flags

# what a watched directory reports about its entries and itself
MASK = (flags.MODIFY | flags.ATTRIB | flags.CLOSE_WRITE | flags.CREATE | flags.DELETE
        | flags.MOVED_FROM | flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF
        | flags.ONLYDIR | flags.EXCL_UNLINK)
_UNSURE = (flags.Q_OVERFLOW | flags.DELETE_SELF | flags.MOVE_SELF | flags.IGNORED
           | flags.UNMOUNT)
_ENTRIES = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO
MAX_DIRS = 4096  # a workspace with more directories is walked, not watched
INSTANCES_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")


def slot_count() -> int:
    """How many agents of one runtime may hold a watch: a quarter of the
    host's per-user instance limit."""
    try:
        return int(INSTANCES_LIMIT.read_text()) // 4
    except (OSError, ValueError):
        return 0


def take_slot(slots_dir: Path, count: int) -> int | None:
    """The fd holding a free slot's lock, or None when all `count` are held."""
    try:
        slots_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    for n in range(count):
        try:
            fd = os.open(slots_dir / f"{n}.lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return fd
    return None


@dataclass
class Changes:
    """What the queue said since the last read: `sure` False means walk in full."""

    sure: bool
    names: dict[str, set[str]] = field(default_factory=dict)  # directory (rel) -> names


class WorkspaceWatch:
    """One inotify instance; watch descriptors mapped to the directories'
    workspace-relative paths ("" for the root, "a/b/" below it)."""

    def __init__(self, notify: INotify, slot: int | None = None) -> None:
        """`notify` does not close its fd (closefd=False): this watch's
        finalizer closes it and the slot's, when closed or collected."""
        self._notify = notify
        fds = [notify.fileno()] if slot is None else [notify.fileno(), slot]
        self._closer = weakref.finalize(self, _close_all, fds)
        self._rel_of: dict[int, str] = {}
        self._walk_of: dict[int, str] = {}  # the watches the walk in progress made

    @classmethod
    def open(cls, slots_dir: Path | None = None) -> WorkspaceWatch | None:
        """A new watch, holding a slot of `slots_dir` when given; None without
        a free slot or when this host refuses an inotify instance."""
        slot = None
        if slots_dir is not None:
            slot = take_slot(slots_dir, slot_count())
            if slot is None:
                return None
        try:
            return cls(INotify(nonblocking=True, closefd=False), slot)
        except OSError:
            if slot is not None:
                os.close(slot)
            return None

    def begin_walk(self) -> None:
        """A full walk starts: what the queue holds is in its listings."""
        self._drain()
        self._walk_of = {}

    def watch(self, dir_fd: int, rel: str) -> bool:
        """Watch the directory open at `dir_fd` (the very directory the walk
        opened without following links; the fd's /proc link names it).
        False when refused (a limit): the walk goes on, the watch is unusable."""
        if len(self._walk_of) >= MAX_DIRS:
            return False
        try:
            wd = self._notify.add_watch(f"/proc/self/fd/{dir_fd}", MASK)
        except OSError:
            return False
        self._walk_of[wd] = rel
        return True

    def end_walk(self) -> None:
        """The walk ended: its watches are the map; the others (directories
        no longer in the workspace) are removed."""
        for wd in self._rel_of.keys() - self._walk_of.keys():
            with contextlib.suppress(OSError):  # already gone with its directory
                self._notify.rm_watch(wd)
        self._rel_of, self._walk_of = self._walk_of, {}

    def changes(self) -> Changes:
        """The names changed since the last read, by directory."""
        out = Changes(True)
        for event in self._drain():
            if event.mask & flags.Q_OVERFLOW:
                return Changes(False)
            rel = self._rel_of.get(event.wd)
            if rel is None:
                continue  # a watch removed at the last walk's end: not in the workspace
            if event.mask & _UNSURE:
                return Changes(False)
            if event.mask & flags.ISDIR:
                if event.mask & _ENTRIES:
                    return Changes(False)  # the directories watched change
                continue  # a subdirectory's own mode or times: not in any tree
            if event.name:
                out.names.setdefault(rel, set()).add(event.name)
        return out

    def _drain(self) -> list[Event]:
        events: list[Event] = []
        while True:
            batch = self._notify.read(timeout=0)
            if not batch:
                return events
            events.extend(batch)

    def close(self) -> None:
        self._closer()
        self._rel_of, self._walk_of = {}, {}


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
