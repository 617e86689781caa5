"""Copy-on-write snapshots: a child's workspace as a kernel overlayfs whose
lower layer is the parent's workspace (read-only to the child) and whose
upper directory holds what the child wrote; the change set's candidates are
read from the upper directory alone (overlaydiff.py). Where the host cannot mount overlayfs,
snapshot.py's copy is used instead (docs/changesets.md, "Copy-on-write
workspaces").

The base (`overlay.json`) is the parent workspace's listing (names and
directory inodes, no file read) and the filesystem's clock at the spawn: a
file the child changed is read from the parent at build time and must be as
it was then (its ctime older than the stamp, its directories the same), else
the set is refused with bound `stale`. What the copy would not copy (`.git`
anywhere, a top-level `.corral`, the state directory, special files) is
hidden by a whiteout.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import hashlib
import json
import os
import stat
from pathlib import Path

from actors.changesets import confined
from actors.changesets.paths import is_git_name

INDEX = "overlay.json"
UPPER = "upper"  # what the child wrote (beside work/, in the child's directory)
SCRATCH = "ovl-work"  # overlayfs's own work directory
_MNT_DETACH = 2
# no metadata-only copy-up (an upper file holds its bytes); a directory
# renamed is a redirect (an upper directory naming its lower one), whose
# files are found in the child's view
_OPTIONS = "redirect_dir=on,metacopy=off,index=off,xino=off"



class OverlayBase:
    """The parent's workspace as the child's overlay found it: its
    directories' inodes and the kind of each other entry, by path (names
    only: read from the directory listings, no file is looked at), and the
    filesystem's clock when they were listed (`stamp_ns`)."""

    def __init__(self, directory: Path, lower: str, stamp_ns: int,  # noqa: PLR0917
                 dirs: dict[str, int], entries: dict[str, str], hidden: list[str]) -> None:
        self.directory = directory
        self.lower = lower
        self.stamp_ns = stamp_ns
        self.dirs = dirs  # "" for the root -> its inode
        self.entries = entries  # path -> "file" or "link"
        self.hidden = set(hidden)
        self._sorted = sorted(entries)

    def under(self, rel: str) -> list[str]:
        """The base's paths below the directory `rel`."""
        prefix = rel + "/"
        at = bisect.bisect_left(self._sorted, prefix)
        out = []
        for path in self._sorted[at:]:
            if not path.startswith(prefix):
                break
            out.append(path)
        return out

    def digest(self) -> str:
        """One hash naming this exact base."""
        h = hashlib.sha256(f"overlay\0{self.lower}\0{self.stamp_ns}\n".encode(
            "utf-8", "surrogateescape"))
        for path in self._sorted:
            h.update(f"{path}\0{self.entries[path]}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def save(self) -> None:
        (self.directory / INDEX).write_text(json.dumps(
            {"version": 1, "lower": self.lower, "stamp_ns": self.stamp_ns, "dirs": self.dirs,
             "entries": self.entries, "hidden": sorted(self.hidden)}, separators=(",", ":")))

    @classmethod
    def load(cls, directory: Path) -> OverlayBase:
        raw = json.loads((directory / INDEX).read_text())
        if raw.get("version") != 1:
            raise ValueError(f"{directory / INDEX}: version {raw.get('version')!r}, expected 1")
        return cls(directory, raw["lower"], raw["stamp_ns"], raw["dirs"], raw["entries"],
                   raw["hidden"])


def is_overlay(base_dir: Path) -> bool:
    return (base_dir / INDEX).exists()


# --- mounting ----------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def _plain(*paths: Path | str) -> bool:
    """Paths the mount options can carry as they are."""
    return not any(c in str(p) for p in paths for c in ",:\\\n=")


def mount(lower: str, directory: Path) -> None:
    """Mount the overlay at `directory/work` (OSError when the kernel refuses)."""
    upper, scratch, work = directory / UPPER, directory / SCRATCH, directory / "work"
    if not _plain(lower, directory):
        raise OSError(errno.EINVAL, "a path the overlay's options cannot carry", str(directory))
    scratch.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    options = f"lowerdir={lower},upperdir={upper},workdir={scratch},{_OPTIONS}"
    if _libc.mount(b"corral-cow", os.fsencode(work), b"overlay", 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(work))


def unmount(directory: Path) -> None:
    """Unmount `directory/work` if it is mounted (detached if still busy)."""
    target = os.fsencode(directory / "work")
    if not os.path.ismount(directory / "work"):
        return
    if _libc.umount2(target, 0) != 0 and _libc.umount2(target, _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(directory / "work"))


def ensure_mounted(directory: Path) -> None:
    if not os.path.ismount(directory / "work"):
        mount(OverlayBase.load(directory / "base").lower, directory)


def probe(scratch: Path) -> str | None:
    """None when this process can mount an overlay with whiteouts under
    `scratch` (a new directory, removed after), else why not."""
    lower = scratch / "lower"
    try:
        if scratch.exists():  # a probe's leftover (a process of the same pid that died)
            unmount(scratch)
            _remove(scratch)
        (lower / "d").mkdir(parents=True)
        (scratch / UPPER).mkdir()
        os.mknod(scratch / UPPER / "w", stat.S_IFCHR | 0o600, os.makedev(0, 0))
        mount(str(lower), scratch)
        try:
            os.rmdir(scratch / "work" / "d")  # a whiteout made by the kernel
            os.setxattr(scratch / UPPER, "trusted.corral-probe", b"1")
        finally:
            unmount(scratch)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    finally:
        _remove(scratch)
    return None


def _remove(path: Path) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            if os.path.islink(full):
                os.unlink(full)
            else:
                os.rmdir(full)
    if path.exists():
        path.rmdir()


# --- the base ------------------------------------------------------------------------------
def _hidden_name(rel_parts: list[str], name: str) -> bool:
    if name.isascii() and "git" not in name.lower():  # most names: no `.git` spelling
        return not rel_parts and name.lower() == ".corral"
    return is_git_name(name) or (not rel_parts and name.lower() == ".corral")


def prepare(lower: Path, directory: Path, guard: confined.Guard = confined.NO_GUARD,
            ) -> OverlayBase:
    """List the parent's workspace `lower` (its directories' names only), hide
    what a copy would not carry by whiteouts in the upper directory, and
    mount the child's workspace at `directory/work`. OSError when the overlay
    cannot be used (`lower` on another filesystem than `directory`: the
    stamp must come from the lower's clock and granularity)."""
    base_dir, upper = directory / "base", directory / UPPER
    base_dir.mkdir(parents=True, exist_ok=True)
    upper.mkdir()
    root = os.open(lower, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if os.fstat(root).st_dev != os.stat(base_dir).st_dev:
            raise OSError(errno.EXDEV, "the workspace is on another filesystem", str(lower))
        stamp_ns = _stamp(base_dir)
        dirs: dict[str, int] = {"": os.fstat(root).st_ino}
        entries: dict[str, str] = {}
        hidden: list[str] = []
        stack: list[tuple[list[str], int]] = [([], os.dup(root))]
        try:
            while stack:
                parts, dir_fd = stack.pop()
                try:
                    _list_dir(dir_fd, parts, guard, (dirs, entries, hidden), stack)
                finally:
                    os.close(dir_fd)
        finally:
            for _, fd in stack:
                os.close(fd)
    finally:
        os.close(root)
    for rel in hidden:
        _whiteout(lower, upper, rel)
    base = OverlayBase(base_dir, str(lower), stamp_ns, dirs, entries, hidden)
    base.save()
    mount(str(lower), directory)
    return base


def _stamp(base_dir: Path) -> int:
    """The filesystem's clock now: the mtime of a file written now (a change
    after it has a ctime at or past it)."""
    fd = os.open(base_dir / "stamp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"stamp\n")
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)


_Listing = tuple[dict[str, int], dict[str, str], list[str]]


def _list_dir(dir_fd: int, parts: list[str], guard: confined.Guard, listing: _Listing,
              stack: list[tuple[list[str], int]]) -> None:
    dirs, entries, hidden = listing
    with os.scandir(dir_fd) as it:
        items = list(it)
    prefix = "/".join(parts) + "/" if parts else ""
    for item in items:
        name = item.name
        rel = prefix + name
        try:
            if _hidden_name(parts, name):
                hidden.append(rel)
            elif item.is_dir(follow_symlinks=False):
                try:
                    sub = confined.open_dir(dir_fd, name, [*parts, name], guard)
                except (OSError, confined.UnsafeFileError):
                    hidden.append(rel)  # the state directory, or swapped meanwhile
                    continue
                dirs[rel] = os.fstat(sub).st_ino
                stack.append(([*parts, name], sub))
            elif item.is_symlink():
                entries[rel] = "link"
            elif item.is_file(follow_symlinks=False):
                entries[rel] = "file"
            else:
                hidden.append(rel)  # a fifo, socket or device: not the child's
        except FileNotFoundError:
            continue  # gone since the listing


def _whiteout(lower: Path, upper: Path, rel: str) -> None:
    """A whiteout for `rel`, its parents made in the upper directory with the
    lower's modes (merged with the lower's, not opaque)."""
    parts = rel.split("/")
    for depth in range(1, len(parts)):
        sub = "/".join(parts[:depth])
        target = upper / sub
        if not target.exists():
            mode = os.lstat(lower / sub).st_mode & 0o7777
            target.mkdir()
            os.chmod(target, mode)
    os.mknod(upper / rel, stat.S_IFCHR | 0o600, os.makedev(0, 0))
