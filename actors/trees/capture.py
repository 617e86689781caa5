"""Capturing a workspace as a tree: one walk that reads only what changed.

The walk starts from an fd of the workspace root and goes down with
`O_DIRECTORY | O_NOFOLLOW` opens relative to the parent's fd
(actors/changesets/confined.py), so no symlink is ever followed, in or out
of the workspace: a link is recorded as a link (its target is its content).
Directories the guard protects (the state directory, when the workspace is
a project directory holding `.corral/`) are skipped, as are special files
and empty directories (as git does). Every entry is lstat'ed at its
directory's fd (the floor of any capture, git's included); what happens next
follows the stat cache (actors/trees/statcache.py): an unchanged directory
keeps its tree digest, an unchanged file its content digest, and only the
rest is read, hashed and staged. A cached digest the store no longer holds
(a collection removed it: the capture that cached it was never named by a
fact) is a miss: read and stored again (actors/trees/collect.py).

`Capturer.capture()` returns the root tree's digest; the trees and every new
blob are in the store, durably (one pack), when it returns, so the caller
can then append the fact that names the tree.
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path

from actors.changesets import confined
from actors.trees import tree
from actors.trees.statcache import STAMP_NAME, DirCache, Ident, StatCache, fs_now_ns
from actors.trees.store import ObjectStore, digest_of

EMPTY = ""


@dataclass(frozen=True)
class Captured:
    digest: str  # the root tree (the empty tree's digest for an empty workspace)
    hashed: int  # files read and hashed (not served by the stat cache)
    dirs_changed: int
    stored: int  # new objects written


class Capturer:
    def __init__(self, workspace: Path, store: ObjectStore, cache: StatCache,
                 guard: confined.Guard = confined.NO_GUARD, stamp_dir: Path | None = None
                 ) -> None:
        self.workspace = workspace
        self.store = store
        self.cache = cache
        self.guard = guard
        self.stamp_dir = stamp_dir if stamp_dir is not None else store.directory.parent

    def _stamp(self) -> int:
        """The filesystem's clock (statcache.fs_now_ns), from a probe file kept
        open: a write to it sets its mtime to now, without an open and a close
        per capture."""
        fd = getattr(self, "_stamp_fd", None)
        if fd is None:
            stamp = fs_now_ns(self.stamp_dir)  # makes the directory and the probe
            try:
                fd = os.open(self.stamp_dir / STAMP_NAME,
                             os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return stamp
            self._stamp_fd = fd
            weakref.finalize(self, os.close, fd)
            return stamp
        os.pwrite(fd, b"s", 0)
        return os.fstat(fd).st_mtime_ns

    def capture(self, *, durable: bool = True) -> Captured:
        """`durable=False`: the new objects' sync is left to the caller
        (`store.take_unsynced()`, before a fact names the tree)."""
        stamp = self._stamp()
        self.store.validate()  # a collection since the last capture: index again
        self._new: dict[str, bytes] = {}
        self._seen: set[str] = set()
        self._changed: list[str] = []
        self._hashed = 0
        with confined.open_root(self.workspace) as root_fd:
            digest = self._dir(os.dup(root_fd), "", 0)
        if digest == EMPTY:
            body = tree.encode({})
            digest = digest_of(body)
            self._new[digest] = body
        stored = self.store.put_many(self._new.items(), durable=durable)
        gone = [rel for rel in self.cache.dirs if rel not in self._seen]
        for rel in gone:
            del self.cache.dirs[rel]
        self.cache.stamp_ns = stamp
        self.cache.save(self._changed, gone)
        done = Captured(digest, self._hashed, len(self._changed), stored)
        del self._new
        return done

    def _dir(self, fd: int, rel: str, depth: int) -> str:
        """The tree digest of the directory open at `fd` (closed here); EMPTY
        when it holds nothing recorded."""
        try:
            sig = []
            subdirs = []
            protected = self.guard.protected
            with os.scandir(fd) as it:
                for item in it:
                    # the entry's type comes with the listing (d_type): a directory
                    # costs no lstat here (its own walk stats what it holds)
                    if item.is_dir(follow_symlinks=False):
                        if depth < tree.MAX_DEPTH and not (
                                protected and _identity_of(item) in protected):
                            subdirs.append(item.name)
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    sig.append((item.name, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns,
                                st.st_ctime_ns))
            sub_digests = []
            for name in sorted(subdirs):
                try:
                    sub = os.open(name, confined.DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        continue  # gone, or swapped for a link: never followed
                    raise
                d = self._dir(sub, f"{rel}{name}/", depth + 1)
                if d != EMPTY:
                    sub_digests.append((name, d))
            signature = tuple(sig)
            subs = tuple(sub_digests)
            self._seen.add(rel)
            cached = self.cache.dirs.get(rel)
            if (cached is not None and cached.signature == signature and cached.subdirs == subs
                    and cached.max_time_ns < self.cache.stamp_ns
                    and self.store.has(cached.digest)):
                return cached.digest
            return self._rebuild(fd, rel, signature, subs, cached)
        finally:
            os.close(fd)

    def _rebuild(self, fd: int, rel: str, signature: tuple[tuple[str, int, int, int, int, int],
                                                            ...],
                 subs: tuple[tuple[str, str], ...], cached: DirCache | None) -> str:
        entries: tree.Entries = {name: tree.Entry(tree.DIR_MODE, d, 0) for name, d in subs}
        files: dict[str, tuple[Ident, str]] = {}
        old = cached.files if cached is not None else {}
        max_time = 0
        stamp = self.cache.stamp_ns  # the racy rule (StatCache.trusted), inlined:
        has = self.store.has  # this loop runs once per file of a changed directory
        for name, mode, ino, size, mtime, ctime in signature:
            ident: Ident = (mode, ino, size, mtime, ctime)
            if stat.S_ISLNK(mode):
                try:
                    target = os.fsencode(os.readlink(name, dir_fd=fd))
                except OSError:
                    continue
                d = digest_of(target)
                self._new.setdefault(d, target)
                entries[name] = tree.Entry(tree.LINK_MODE, d, len(target))
                continue
            if not stat.S_ISREG(mode):
                continue  # fifo, socket, device: not workspace content
            hit = old.get(name)
            if (hit is not None and hit[0] == ident and mtime < stamp and ctime < stamp
                    and has(hit[1])):
                d = hit[1]
                files[name] = hit
                if mtime > max_time or ctime > max_time:
                    max_time = max(max_time, mtime, ctime)
                entries[name] = tree.Entry(mode, d, size)
                continue
            got = _read(fd, name)
            if got is None:
                continue
            data, st = got
            ident = (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            d = digest_of(data)
            self._new.setdefault(d, data)
            self._hashed += 1
            files[name] = (ident, d)
            max_time = max(max_time, ident[3], ident[4])
            entries[name] = tree.Entry(ident[0], d, ident[2])
        if not entries:
            self.cache.dirs.pop(rel, None)
            return EMPTY
        body = tree.encode(entries)
        digest = digest_of(body)
        self._new.setdefault(digest, body)
        self.cache.dirs[rel] = DirCache(digest, max_time, files, subs, signature)
        self._changed.append(rel)
        return digest


def _identity_of(item: os.DirEntry[str]) -> tuple[int, int] | None:
    try:
        return confined.identity(item.stat(follow_symlinks=False))
    except FileNotFoundError:
        return None


def _read(dir_fd: int, name: str) -> tuple[bytes, os.stat_result] | None:
    try:
        fd = os.open(name, confined.FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return confined.read_all(fd), st
    finally:
        os.close(fd)
