"""The stat cache: what makes a capture's cost follow what changed.

See docs/trees.md ("The stat cache").
"""

from __future__ import annotations

import errno
import json
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.durable import open_append

FORMAT_VERSION = 2  # 2: a directory's line may give only the files that changed
NO_DIGEST = ""  # a seeded directory's: no tree digest known (never one the store holds)
STAMP_NAME = ".stamp"  # the probe file fs_now_ns writes
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: the write is skipped
Ident = tuple[int, int, int, int, int]  # mode, inode, size, mtime_ns, ctime_ns
Signature = tuple[tuple[str, int, int, int, int, int], ...]


@dataclass
class DirCache:
    digest: str
    max_time_ns: int
    files: dict[str, tuple[Ident, str]]  # name -> (identity, digest)
    subdirs: tuple[tuple[str, str], ...] = ()
    # None after a load (compared file by file once) and after a watched capture
    # patched the directory (its entries are then compared as a set: `sigset`)
    signature: Signature | None = None
    # in memory only (None after a load): each entry's encoded tree row
    # (tree.encode_row) by name, the names sorted, the signature as a set; a
    # capture of this directory when it changed re-encodes only what changed,
    # and a watched capture updates these in place from the names changed
    rows: dict[str, str] | None = None
    order: list[str] | None = None
    sigset: set[tuple[str, int, int, int, int, int]] | None = None
    # the names whose file line changed since the journal's last line of this
    # directory (None: journal it whole)
    touched: set[str] | None = None
    # in memory only: the names whose newest listed timestamp (mtime or ctime)
    # is not older than `racy_floor`, with that timestamp (every such entry is
    # here; None: not known, found from the listing when needed): a watched
    # capture reads these again under the racy rule without a look at the rest
    racy: dict[str, int] | None = None
    racy_floor: int = 0


@dataclass
class StatCache:
    path: Path | None = None
    dirs: dict[str, DirCache] = field(default_factory=dict)
    stamp_ns: int = 0
    _lines: int = 0
    # the journal's fd, appended to (its closer, with this cache or at a rewrite;
    # a file removed meanwhile takes the lines up to the next rewrite with it,
    # as a cache may: the next start hashes what they would have saved)
    _append: weakref.finalize[Any, Any] | None = field(default=None, repr=False, compare=False)
    _append_fd: int = field(default=-1, repr=False, compare=False)
    # a line every `save_every` captures (1: every capture) or, when above 0,
    # `save_every_s` seconds after the last one, whichever comes first; what
    # the captures between changed waits in memory for the next line (`save`)
    save_every: int = 1
    save_every_s: float = 0.0
    _held: int = field(default=0, repr=False, compare=False)  # captures not yet in a line
    _held_changed: dict[str, None] = field(default_factory=dict, repr=False, compare=False)
    _held_gone: dict[str, None] = field(default_factory=dict, repr=False, compare=False)
    _line_at: float = field(default=0.0, repr=False, compare=False)  # monotonic, the last line

    @classmethod
    def load(cls, path: Path | None) -> StatCache:
        cache = cls(path)
        if path is None:
            return cache
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return cache
        for line in text.splitlines():
            try:
                doc = json.loads(line)
                if doc.get("version") != FORMAT_VERSION:
                    break
                stamp = int(doc["stamp_ns"])
                for rel in doc.get("gone", []):
                    cache.dirs.pop(str(rel), None)
                for rel, (digest, max_time, files, subdirs, *delta) in doc["dirs"].items():
                    got = {str(n): ((int(m), int(i), int(s), int(mt), int(ct)), str(d))
                           for n, (m, i, s, mt, ct, d) in files.items()}
                    if delta:  # [gone names]: the files given are those that changed
                        base = cache.dirs.get(str(rel))
                        merged = dict(base.files) if base is not None else {}
                        for name in delta[0]:
                            merged.pop(str(name), None)
                        merged.update(got)
                        got = merged
                    cache.dirs[str(rel)] = DirCache(
                        str(digest), int(max_time), got,
                        tuple((str(n), str(d)) for n, d in subdirs))
            except (ValueError, TypeError, KeyError, AttributeError):
                break
            cache.stamp_ns = stamp
            cache._lines += 1
        return cache

    def trusted(self, ident: Ident) -> bool:
        return ident[3] < self.stamp_ns and ident[4] < self.stamp_ns

    def save(self, changed: list[str], gone: list[str]) -> None:
        """Persist this capture's changes (append), or everything (rewrite).

        With `save_every` above 1, a line is written only when one is due
        (the file's first, a rewrite, `save_every` captures or `save_every_s`
        since the last line); until then the directories changed and gone
        are kept and go in the next line, each directory's files touched
        since its last line with it. A line is a whole state as of its
        capture, so a file that misses the last few is older, never wrong:
        a start after a kill reads again the files changed since (a cache
        may lose lines: the module's text). `flush()` writes what is held."""
        if self.path is None:
            return
        if self.save_every <= 1:
            self._save(changed, gone)
            return
        self._held += 1
        self._held_changed.update(dict.fromkeys(changed))
        self._held_gone.update(dict.fromkeys(gone))
        if (not self._lines or self._lines > 64 or self._held >= self.save_every
                or (self.save_every_s > 0
                    and time.monotonic() - self._line_at >= self.save_every_s)):
            self.flush()

    def flush(self) -> None:
        """Write the line `save` holds back, if any."""
        if not self._held:
            return
        changed, gone = list(self._held_changed), list(self._held_gone)
        self._held, self._held_changed, self._held_gone = 0, {}, {}
        self._line_at = time.monotonic()
        self._save(changed, gone)

    def _save(self, changed: list[str], gone: list[str]) -> None:
        assert self.path is not None
        rewrite = self._lines == 0 or self._lines > 64
        names = list(self.dirs) if rewrite else changed
        dirs: dict[str, list[Any]] = {}
        for rel in names:
            d = self.dirs.get(rel)
            if d is None:
                continue
            if rewrite or d.touched is None:
                dirs[rel] = [d.digest, d.max_time_ns,
                             {n: [*ident, dg] for n, (ident, dg) in d.files.items()},
                             [list(s) for s in d.subdirs]]
            else:  # only the files that changed, and the names gone
                dirs[rel] = [d.digest, d.max_time_ns,
                             {n: [*hit[0], hit[1]] for n in d.touched
                              if (hit := d.files.get(n)) is not None},
                             [list(s) for s in d.subdirs],
                             sorted(n for n in d.touched if n not in d.files)]
            d.touched = set()  # the next line of this directory is relative to this one
        line = json.dumps({
            "version": FORMAT_VERSION, "stamp_ns": self.stamp_ns,
            "gone": [] if rewrite else gone, "dirs": dirs,
        }, separators=(",", ":")) + "\n"
        try:
            try:
                self._write(line, rewrite)
            except FileNotFoundError:  # no cache directory (yet, or removed: it is derived)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._write(line, rewrite)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            # a full disk: the line is skipped (a cache, derived); the next one
            # rewrites the file whole, so a line cut short here is never followed
            self._lines = 0
            self._close_append()

    def _write(self, line: str, rewrite: bool) -> None:
        assert self.path is not None
        if rewrite:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(line, encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
            self._lines = 1
            self._close_append()  # it names the file replaced
            return
        if self._append is None:  # kept open from capture to capture: one write a line
            fd = open_append(self.path)  # a link there is replaced, never written through
            self._append = weakref.finalize(self, os.close, fd)
            self._append_fd = fd
        view = memoryview(line.encode("utf-8"))
        while view:
            view = view[os.write(self._append_fd, view):]
        self._lines += 1

    def _close_append(self) -> None:
        closer, self._append = self._append, None
        if closer is not None:
            closer()  # closes the fd


def seed(path: Path, stamp_dir: Path, files: Mapping[str, tuple[Ident, str]]) -> int:
    """Write the stat cache at `path` for a workspace whose files' lstat
    identities and digests are known without reading them (a subagent's
    snapshot hashed each file as it wrote the copy): its first capture then
    reads only the files that changed since, or that the racy rule does not
    let it trust. `files`: workspace-relative path -> (identity, sha256).

    The stamp is the filesystem's clock now (`fs_now_ns` in `stamp_dir`, the
    capturer's): call it after the files were written; one written within
    the stamp's own tick is read again, as after any capture. A seeded
    directory has no signature and no tree digest (NO_DIGEST), so a capture
    compares its files one by one and never takes its digest from the seed.
    Returns how many files the cache names."""
    cache = StatCache(path)
    cache.stamp_ns = fs_now_ns(stamp_dir)
    for rel, (ident, digest) in files.items():
        head, _, name = rel.rpartition("/")
        directory = f"{head}/" if head else ""
        entry = cache.dirs.get(directory)
        if entry is None:
            entry = cache.dirs[directory] = DirCache(NO_DIGEST, 0, {})
        entry.files[name] = (ident, digest)
        entry.max_time_ns = max(entry.max_time_ns, ident[3], ident[4])
    cache.save(list(cache.dirs), [])  # a whole file (its first line): a rewrite
    return len(files)


def fs_now_ns(directory: Path) -> int:
    """The filesystem's clock: the mtime of a file written now in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / STAMP_NAME
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        try:
            os.write(fd, b"s")
        except OSError as exc:  # a full disk: the times set to now, no byte written
            if exc.errno not in NO_SPACE:
                raise
            os.utime(fd)
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
