"""Capturing a workspace as a tree: one walk that reads only what changed.

No symlink is followed; the tree and its blobs are durable (one pack) when
`capture()` returns. See docs/trees.md ("Trees", "Watched captures").
"""

from __future__ import annotations

import errno
import os
import stat
import time
import weakref
from bisect import bisect_left, insort
from dataclasses import dataclass
from pathlib import Path

from actors.changesets import confined
from actors.trees import tree
from actors.trees.statcache import (
    NO_DIGEST,
    STAMP_NAME,
    DirCache,
    Ident,
    Signature,
    StatCache,
    fs_now_ns,
)
from actors.trees.store import ObjectStore, digest_of
from actors.trees.watch import WorkspaceWatch

EMPTY = ""
# the newest timestamp of an entry listed but not kept (gone, or swapped, between
# the listing and the read): its directory is looked at file by file next time
UNSURE = 1 << 62
Files = dict[str, tuple[Ident, str]]  # name -> (identity, digest)
Entry = tuple[str, int, int, int, int, int]  # name, mode, ino, size, mtime, ctime
# a watched capturer walks in full at least this often: what no event reports (a
# write through a shared mapping after its file was closed, a write through a hard
# link made from outside the workspace) is in a tree this much later at most
FULL_EVERY_S = 1.0


class _UnsureError(Exception):
    """The watched capture met what the events did not describe: walk in full."""


@dataclass(frozen=True)
class Captured:
    digest: str  # the root tree (the empty tree's digest for an empty workspace)
    hashed: int  # files read and hashed (not served by the stat cache)
    dirs_changed: int
    stored: int  # new objects written


class Capturer:
    def __init__(self, workspace: Path, store: ObjectStore, cache: StatCache,  # noqa: PLR0917
                 guard: confined.Guard = confined.NO_GUARD, stamp_dir: Path | None = None,
                 watch: WorkspaceWatch | None = None, full_every_s: float = FULL_EVERY_S
                 ) -> None:
        """`watch`: captures after a full walk read only what it reports (this
        capturer owns and closes it; it is dropped when a limit refuses a watch)."""
        self.workspace = workspace
        self.store = store
        self.cache = cache
        self.guard = guard
        self.stamp_dir = stamp_dir if stamp_dir is not None else store.directory.parent
        self._fast_gen: int | None = None  # the store's generation the cached rows are good for
        self._fast = False
        self._now_ns = 0  # the stamp of the capture in progress
        self.watch = watch
        self.full_every_s = full_every_s
        self.full_walks = 0  # captures that walked the whole workspace (watched or not)
        self._watched = False  # the last full walk watched every directory it read
        self._refused = False  # a watch was refused in the walk in progress
        self._full_at = 0.0  # (monotonic) when that walk began
        self._unsure = False
        # what the last full walk listed, kept current by the watched captures since
        self._index: dict[str, dict[str, Entry]] = {}  # directory -> name -> entry
        self._subnames: dict[str, list[str]] = {}  # directory -> subdirectories walked
        self._linked: dict[str, set[str]] = {}  # directory -> files with other links

    def unsure(self) -> None:
        """The next capture walks in full: the caller knows of a change an event
        may not report (a command ran)."""
        self._unsure = True

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

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
        stamp = self._now_ns = self._stamp()
        self.store.validate(stamp)  # a collection since the last capture: index again
        # cached rows name only objects held when the last capture ended well
        # and the index was not reset since (DirCache.rows; _rebuild)
        self._fast = self._fast_gen == self.store.generation
        self._fast_gen = None  # until this capture has stored its objects
        self._new: dict[str, bytes] = {}
        self._seen: set[str] = set()
        self._changed: list[str] = []
        self._hashed = 0
        full = True
        with confined.open_root(self.workspace) as root_fd:
            changes = self._watched_changes()
            if changes is not None:
                try:
                    digest = self._watched_dir(os.dup(root_fd), "", changes, _dirty_dirs(
                        changes, self._linked))
                    full = False
                except _UnsureError:
                    pass
            if full:
                digest = self._full_walk(root_fd)
        if digest == EMPTY:
            body = tree.encode({})
            digest = digest_of(body)
            self._new[digest] = body
        gen = self.store.generation
        stored = self.store.put_many(self._new.items(), durable=durable, now_ns=stamp)
        if self.store.generation == gen:
            self._fast_gen = gen
        gone = [rel for rel in self.cache.dirs if rel not in self._seen] if full else []
        for rel in gone:
            del self.cache.dirs[rel]
        self.cache.stamp_ns = stamp
        self.cache.save(list(dict.fromkeys(self._changed)), gone)
        done = Captured(digest, self._hashed, len(self._changed), stored)
        del self._new
        return done

    def _watched_changes(self) -> dict[str, set[str]] | None:
        """The names to look at again, by directory, when the watch can say
        them; None when this capture walks in full."""
        watch = self.watch
        if (watch is None or not self._watched or self._unsure or not self._fast
                or time.monotonic() - self._full_at >= self.full_every_s):
            return None
        changes = watch.changes()
        return changes.names if changes.sure else None

    def _full_walk(self, root_fd: int) -> str:
        """Walk every directory (watching each before it is listed, with a watch)."""
        self.full_walks += 1
        self._unsure = False
        self._seen = set()
        watch = self.watch
        if watch is None:
            return self._dir(os.dup(root_fd), "", 0)
        self._full_at = time.monotonic()
        self._watched = False  # until this walk has watched every directory it read
        self._refused = False
        self._index, self._subnames, self._linked = {}, {}, {}
        watch.begin_walk()
        digest = self._dir(os.dup(root_fd), "", 0)  # (raising: the next capture walks too)
        if self._refused:  # a limit refused a watch: walk every time, as without one
            self.close()
            self._index, self._subnames, self._linked = {}, {}, {}
        else:
            watch.end_walk()
            self._watched = True
        return digest

    def _watched_dir(self, fd: int, rel: str, changed: dict[str, set[str]],
                     dirty: set[str]) -> str:
        """The tree digest of the directory open at `fd` (closed here), from
        the last listing and the names reported changed in it (and its files
        with other links, which an event through another link does not
        reach); the subdirectories with nothing changed below keep theirs."""
        try:
            index = self._index.get(rel)
            subnames = self._subnames.get(rel)
            if index is None or subnames is None:
                raise _UnsureError
            linked = self._linked.get(rel)
            names = changed.get(rel, set())
            if linked:
                names = names | linked
            moved: dict[str, Entry | None] = {}  # name -> its entry before (None: new)
            for name in names:
                old = index.get(name)
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    if old is not None:
                        del index[name]
                        moved[name] = old
                    if linked:
                        linked.discard(name)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    raise _UnsureError  # a directory where none was listed
                ent = (name, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if st.st_nlink > 1 and not (linked and name in linked):
                    # a link made since the walk (or a linked file moved in): a
                    # link count's change is no event in the directory of the
                    # file's other names, which a walk finds
                    raise _UnsureError
                if ent != old:
                    index[name] = ent
                    moved[name] = old
                if st.st_nlink == 1 and linked:
                    linked.discard(name)
            sub_digests = []
            for name in subnames:
                sub_rel = f"{rel}{name}/"
                if sub_rel in dirty:
                    try:
                        sub = os.open(name, confined.DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        raise _UnsureError from None  # gone, or swapped for a link
                    d = self._watched_dir(sub, sub_rel, changed, dirty)
                else:
                    kept = self.cache.dirs.get(sub_rel)
                    d = EMPTY if kept is None else kept.digest
                    if kept is not None and not self.store.has(d):
                        raise _UnsureError
                if d != EMPTY:
                    sub_digests.append((name, d))
            subs = tuple(sub_digests)
            cached = self.cache.dirs.get(rel)
            if cached is not None and _patchable(cached, index, moved):
                if (not moved and cached.subdirs == subs
                        and cached.max_time_ns < self.cache.stamp_ns
                        and self.store.has(cached.digest)):
                    return cached.digest
                return self._patch(fd, rel, subs, cached, index=index, moved=moved)
            signature = tuple(index.values())  # (not patchable: from the whole listing)
            if (cached is not None and _listed(cached, signature) and cached.subdirs == subs
                    and cached.max_time_ns < self.cache.stamp_ns
                    and self.store.has(cached.digest)):
                return cached.digest
            if cached is None and not signature and not subs:
                return EMPTY
            return self._rebuild(fd, rel, signature, subs, cached)
        finally:
            os.close(fd)

    def _dir(self, fd: int, rel: str, depth: int) -> str:
        """The tree digest of the directory open at `fd` (closed here); EMPTY
        when it holds nothing recorded."""
        try:
            sig = []
            subdirs = []
            protected = self.guard.protected
            watch = self.watch
            if watch is not None and not self._refused and not watch.watch(fd, rel):
                self._refused = True
            linked: set[str] | None = set() if watch is not None else None
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
                    if linked is not None and st.st_nlink > 1:
                        linked.add(item.name)
            subdirs.sort()
            if linked is not None:
                self._index[rel] = {e[0]: e for e in sig}
                self._subnames[rel] = subdirs
                if linked:
                    self._linked[rel] = linked
            sub_digests = []
            for name in subdirs:
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
            if (cached is not None and _listed(cached, signature) and cached.subdirs == subs
                    and cached.max_time_ns < self.cache.stamp_ns
                    and self.store.has(cached.digest)):
                cached.signature = signature  # (compared as a tuple next time)
                return cached.digest
            return self._rebuild(fd, rel, signature, subs, cached)
        finally:
            os.close(fd)

    def _rebuild(self, fd: int, rel: str, signature: Signature,
                 subs: tuple[tuple[str, str], ...], cached: DirCache | None) -> str:
        """The tree of a directory whose signature or subdirectories changed.

        Each entry's encoded row is kept by name (DirCache.rows). When the
        store was not reset since the last capture ended well (every digest
        the rows name is still held), only the entries whose lstat identity
        is not in the cached signature, and those kept whose timestamps are
        not older than the last capture's stamp (the racy rule), are read and
        encoded again (`_changed_rows`); otherwise (after a load, a
        collection, a failed capture) each file is checked one by one against
        the store (`_all_rows`). The tree is encoded from the rows, sorted by
        name (`tree.store_rows`: one object, or a large directory's parts),
        and not encoded again when the rows did not change. (A watched capture patches the directory
        instead when its cached state allows: `_patch`.)"""
        touched: set[str] | None = None  # None: journal the directory whole
        sigset = set(signature)
        if (cached is not None and cached.rows is not None and cached.sigset is not None
                and self._fast):
            touched = set()
            rows, files, max_time = self._changed_rows(fd, sigset, subs, cached, touched)
            # names changed earlier in this capture and not journaled yet (a
            # watched pass that turned unsure, then the full walk): kept
            touched = None if cached.touched is None else touched | cached.touched
        else:
            rows, files, max_time = self._all_rows(fd, signature, subs, cached)
        if not rows:
            self.cache.dirs.pop(rel, None)
            return EMPTY
        if cached is not None and cached.rows == rows and cached.order is not None \
                and self.store.has(cached.digest):
            digest, order = cached.digest, cached.order  # the same tree: not encoded again
        else:
            order = (cached.order if cached is not None and cached.order is not None
                     and cached.rows is not None and rows.keys() == cached.rows.keys()
                     else sorted(rows))
            digest = tree.store_rows(order, rows, self._new)
        racy = None
        if self.watch is not None:  # (what a watched capture of it reads again: _patch)
            now = self._now_ns
            racy = {e[0]: t for e in signature if (t := max(e[4], e[5])) >= now}
        self.cache.dirs[rel] = DirCache(digest, max_time, files, subs, signature, rows, order,
                                        sigset, touched, racy=racy, racy_floor=self._now_ns)
        self._changed.append(rel)
        return digest

    def _patch(self, fd: int, rel: str, subs: tuple[tuple[str, str], ...], cached: DirCache, *,
               index: dict[str, Entry], moved: dict[str, Entry | None]) -> str:
        """The tree of a watched directory, its cached state updated in place
        from the names whose entries moved (`moved`: name -> its entry before,
        None for a new name; `index` holds the entries now) and its racy
        entries, never from the whole listing: the signature's set, rows,
        files and sorted names (bisect) change by those names only, and the
        rows are joined and hashed again only when one of them changed.

        The racy rule is the walk's (`_changed_rows`): the kept entries whose
        mtime or ctime is not older than the last capture's stamp are read
        again, found in `DirCache.racy` instead of among every entry. The
        digest is cleared first, so a pass that raises midway leaves none to
        keep: the capture that follows is not `_fast` (no store generation
        was recorded), walks in full and makes these rows again from scratch
        (`_all_rows`), checking each file against the store."""
        rows, order, sigset = cached.rows, cached.order, cached.sigset
        assert rows is not None  # (_patchable)
        assert order is not None
        assert sigset is not None
        stamp = self.cache.stamp_ns
        racy = _racy(cached, index, stamp)
        kept_racy = [name for name in racy if name not in moved]
        before, cached.digest, cached.signature = cached.digest, NO_DIGEST, None
        max_time = cached.max_time_ns  # an upper bound, as in _changed_rows
        changed = False
        touched: set[str] = set()
        for name, old in moved.items():
            ent = index.get(name)
            if old is not None:
                sigset.discard(old)
            racy.pop(name, None)
            if ent is not None:
                sigset.add(ent)
                if (t := max(ent[4], ent[5])) >= stamp:
                    racy[name] = t
            row_changed, t = self._reread(fd, cached, name, ent)
            changed |= row_changed
            max_time = max(max_time, t)
            touched.add(name)
        for name in kept_racy:  # listed as before, but maybe changed within the stamp's tick
            row_changed, t = self._reread(fd, cached, name, index.get(name))
            changed |= row_changed
            max_time = max(max_time, t)
            touched.add(name)
        if subs != cached.subdirs:
            old_subs, new_subs = dict(cached.subdirs), dict(subs)
            for name in old_subs.keys() | new_subs.keys():
                d = new_subs.get(name)
                row = None if d is None else tree.encode_row(name, tree.DIR_MODE, d, 0)
                changed |= _set_row(rows, order, name, row, rows.get(name))
            cached.subdirs = subs
        if not rows:
            self.cache.dirs.pop(rel, None)
            return EMPTY
        if changed or not self.store.has(before):
            before = tree.store_rows(order, rows, self._new)
        cached.digest, cached.max_time_ns = before, max_time
        if cached.touched is not None:
            cached.touched |= touched  # (None: the journal's next line gives it whole)
        self._changed.append(rel)
        return before

    def _reread(self, fd: int, cached: DirCache, name: str, ent: Entry | None
                ) -> tuple[bool, int]:
        """Read one entry again (`ent`; None: gone) into the directory's rows,
        files and sorted names: whether its row changed, and its newest
        timestamp (0 for none kept)."""
        rows, files, order = cached.rows, cached.files, cached.order
        assert rows is not None  # (_patchable)
        assert order is not None
        row = rows.pop(name, None)
        files.pop(name, None)
        t = 0 if ent is None else self._entry(fd, ent, rows, files, None)
        now = rows.pop(name, None)
        return _set_row(rows, order, name, now, row), t

    def _changed_rows(self, fd: int, new: set[Entry], subs: tuple[tuple[str, str], ...],
                      cached: DirCache, touched: set[str]) -> tuple[dict[str, str], Files, int]:
        old = cached.sigset if cached.sigset is not None else set()
        added, removed = new - old, old - new
        stamp = self.cache.stamp_ns
        if cached.max_time_ns >= stamp:  # racy entries among those kept: read again
            racy = {e for e in new & old if e[4] >= stamp or e[5] >= stamp}
            added |= racy
            removed |= racy
        rows, files = dict(cached.rows or {}), dict(cached.files)
        max_time = cached.max_time_ns  # an upper bound: a removed entry may have held it
        for ent in removed:
            rows.pop(ent[0], None)
            files.pop(ent[0], None)
            touched.add(ent[0])
        if subs != cached.subdirs:
            for name, _ in cached.subdirs:
                rows.pop(name, None)
            for name, d in subs:
                rows[name] = tree.encode_row(name, tree.DIR_MODE, d, 0)
        for ent in added:
            max_time = max(max_time, self._entry(fd, ent, rows, files, None))
            touched.add(ent[0])
        return rows, files, max_time

    def _all_rows(self, fd: int, signature: Signature, subs: tuple[tuple[str, str], ...],
                  cached: DirCache | None) -> tuple[dict[str, str], Files, int]:
        rows = {name: tree.encode_row(name, tree.DIR_MODE, d, 0) for name, d in subs}
        files: Files = {}
        old = cached.files if cached is not None else {}
        max_time = 0
        for ent in signature:
            max_time = max(max_time, self._entry(fd, ent, rows, files, old.get(ent[0])))
        return rows, files, max_time

    def _entry(self, fd: int, ent: tuple[str, int, int, int, int, int], rows: dict[str, str],
               files: Files, hit: tuple[Ident, str] | None) -> int:
        """Put the row of one listed entry (and a file's cache line) in `rows`
        and `files`; return the newest of its timestamps (0 for none kept).
        `hit`: the file's cached (identity, digest), trusted under the racy
        rule (StatCache.trusted) when the identity is the one listed now."""
        name, mode, ino, size, mtime, ctime = ent
        ident: Ident = (mode, ino, size, mtime, ctime)
        if stat.S_ISLNK(mode):
            try:
                target = os.fsencode(os.readlink(name, dir_fd=fd))
            except OSError:
                return UNSURE
            d = digest_of(target)
            self._new.setdefault(d, target)
            rows[name] = tree.encode_row(name, tree.LINK_MODE, d, len(target))
            return max(mtime, ctime)
        if not stat.S_ISREG(mode):
            return 0  # fifo, socket, device: not workspace content
        if (hit is not None and hit[0] == ident and self.cache.trusted(ident)
                and self.store.has(hit[1])):
            files[name] = hit
            rows[name] = tree.encode_row(name, mode, hit[1], size)
            return max(mtime, ctime)
        got = _read(fd, name)
        if got is None:
            return UNSURE
        data, st = got
        d = digest_of(data)
        self._new.setdefault(d, data)
        self._hashed += 1
        # keyed by the identity listed (before the read): a change after the
        # listing gives another identity at the next capture, read again then
        files[name] = (ident, d)
        rows[name] = tree.encode_row(name, st.st_mode, d, st.st_size)
        return max(mtime, ctime, st.st_mtime_ns, st.st_ctime_ns)


def _patchable(cached: DirCache, index: dict[str, Entry], moved: dict[str, Entry | None]
               ) -> bool:
    """Whether a watched capture can patch the directory's cached state from
    the names that moved: it holds rows, and its signature's set is the
    listing these names changed (what each entry was before is in it, what
    each is now is not, and the sizes agree)."""
    sigset = cached.sigset
    if cached.rows is None or cached.order is None or sigset is None:
        return False
    size = len(index)
    for name, old in moved.items():
        ent = index.get(name)
        if (old is not None and old not in sigset) or (ent is not None and ent in sigset):
            return False
        size += (old is not None) - (ent is not None)
    return size == len(sigset)


def _listed(cached: DirCache, signature: Signature) -> bool:
    """Whether the directory lists what its cache holds: the signature, or
    (after a watched capture patched it) the set of its entries."""
    if cached.signature is not None:
        return cached.signature == signature
    sigset = cached.sigset
    return sigset is not None and len(sigset) == len(signature) and sigset.issuperset(signature)


def _racy(cached: DirCache, index: dict[str, Entry], stamp: int) -> dict[str, int]:
    """The directory's entries whose newest timestamp is not older than
    `stamp` (the last capture's), by name: the cached ones pruned, or (none
    kept, or the clock went back past them) found from the listing."""
    racy = cached.racy
    if racy is None or stamp < cached.racy_floor:
        racy = {e[0]: t for e in index.values() if (t := max(e[4], e[5])) >= stamp}
    else:
        for name in [name for name, t in racy.items() if t < stamp]:
            del racy[name]
    cached.racy, cached.racy_floor = racy, stamp
    return racy


def _set_row(rows: dict[str, str], order: list[str], name: str, row: str | None,
             was: str | None) -> bool:
    """Make `row` (None: none) the row of `name` in `rows`, keeping `order`
    (the names of `rows`, sorted) by bisection; `was`: its row before.
    Whether the row changed."""
    if row is None:
        rows.pop(name, None)
        if was is not None:
            i = bisect_left(order, name)
            if i < len(order) and order[i] == name:
                del order[i]
    else:
        rows[name] = row
        if was is None:
            insort(order, name)
    return row != was


def _dirty_dirs(changed: dict[str, set[str]], linked: dict[str, set[str]]) -> set[str]:
    """The directories a watched capture goes into: those with names to look
    at again, and every directory above them ("" the root; "a/b/" below it)."""
    out = {""}
    for start in (*changed, *(r for r, names in linked.items() if names)):
        rel = start
        while rel and rel not in out:
            out.add(rel)
            rel = rel[: rel.rstrip("/").rfind("/") + 1]
    return out


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
