"""The agent's side of workspace trees: a `workspace_tree` fact when it changed.
Where the store and the stat cache live is actors/trees/layout.py's.

The tree is durable in the store before the fact is appended.
See docs/trees.md ("Trees").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from actors.changesets import confined
from actors.kernel.state import AgentState
from actors.trees import rewind, statcache
from actors.trees.capture import Capturer
from actors.trees.layout import capturer_for, stat_cache_path
from actors.trees.statcache import Ident
from actors.trees.store import LEASE_NAME, packs_dir, sync_fds, take_lease
from actors.trees.store import lease as store_lease
from actors.writer.client import WriterClient
from broker.statedir import StateDir

CACHE_LINE_EVERY = 16  # captures a stat cache line may hold back (StatCache.save)
CACHE_LINE_EVERY_S = 1.0  # and seconds


def seed_stat_cache(state_dir: StateDir, name: str,
                    files: Mapping[str, tuple[Ident, str]]) -> int:
    """Agent `name`'s stat cache, written from identities and digests known
    without reading the files (statcache.seed); how many it names."""
    return statcache.seed(stat_cache_path(state_dir, name), state_dir.cache_dir / "trees",
                          files)


class TreeRecorder:
    """Captures at turn boundaries. The agent loop appends the fact pending
    and makes it durable at its next flush (actors/agent/loop.py), so:

    - the collection lease is taken for the capture and held until that
      flush has made the fact durable (`hold()` ... `released()`): a
      collection reads its roots from the WAL on disk, where a pending fact
      is not yet;
    - the pack's fdatasync runs on a thread of its own from the capture on,
      overlapping the turn's work, and the flush waits for it (`settle()`)
      before the group naming the tree goes to the writer: a fact never
      names an object that is not durable."""

    def __init__(self, state_dir: StateDir, name: str, workspace: Path, *,
                 watch: bool = False) -> None:
        self.state_dir, self.name, self.workspace = state_dir, name, workspace
        self.watch = watch  # captures read what inotify reports (capturer_for)
        self._capturer: Capturer | None = None
        self._lease: weakref.finalize[Any, Any] | None = None  # the lock file's fd closer
        self._lease_fd = -1
        self._lease_id: tuple[int, int] | None = None  # its (device, inode)
        self._held = False  # the lock is taken (shared) on it
        self._lease_path = os.fspath(packs_dir(state_dir.root).parent / LEASE_NAME)
        self._syncs: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None

    def lease(self) -> contextlib.AbstractContextManager[None]:
        """Held from the capture until its fact is appended: no collection
        (actors/trees/collect.py) runs in between."""
        return store_lease(packs_dir(self.state_dir.root))

    def hold(self) -> None:
        """Take the collection lease (shared) unless held already. The lock
        file stays open from one hold to the next (a lock and an unlock a
        turn, not an open and a close), while it is still the file at its
        path: one that was removed or replaced locks nothing a collection
        takes, so then it is opened again."""
        if self._held:
            return
        if self._lease is not None:
            fcntl.flock(self._lease_fd, fcntl.LOCK_SH)
            try:
                same = self._lease_id == confined.identity(os.stat(self._lease_path))
            except OSError:  # gone (or its directory): take it anew, or say why not
                same = False
            if same:
                self._held = True
                return
            self._close_lease()
        fd = take_lease(packs_dir(self.state_dir.root))
        self._lease = weakref.finalize(self, os.close, fd)  # closed when this recorder goes
        self._lease_fd, self._lease_id = fd, confined.identity(os.fstat(fd))
        self._held = True

    def settle(self) -> None:
        """Wait for the syncs of the objects captured so far (raises their error)."""
        syncs, self._syncs = self._syncs, []
        for sync in syncs:
            sync.result()

    def unsure(self) -> None:
        """The next capture walks the whole workspace: an op ran that may have
        changed it in a way no event reports (a command, a change set)."""
        if self._capturer is not None:
            self._capturer.unsure()

    def released(self) -> None:
        """The facts are durable (or none was appended): let collections run."""
        self.settle()
        if self._held:
            self._held = False
            try:
                fcntl.flock(self._lease_fd, fcntl.LOCK_UN)
            except OSError:
                self._close_lease()  # closing it releases the lock too

    def close(self) -> None:
        """The agent ends: the stat cache's held line written, the watch closed
        (a kill skips this; the next start reads again what changed since)."""
        capturer, self._capturer = self._capturer, None
        if capturer is not None:
            with contextlib.suppress(OSError):  # a cache: never worth failing an exit
                capturer.cache.flush()
            capturer.close()

    def _close_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease()  # closes the fd (and releases a lock it holds)

    def fact(self, state: AgentState) -> tuple[str, dict[str, Any], str] | None:
        """(event, payload, key) of the `workspace_tree` to append, None if
        unchanged. Call under `hold()`; the new objects' sync runs meanwhile."""
        if self._capturer is None:
            self._capturer = capturer_for(self.state_dir, self.name, self.workspace,
                                          watch=self.watch)
            # a stat cache line a second or every 16 captures, not one a turn: a
            # line was a tenth of a lone step's capture
            self._capturer.cache.save_every = CACHE_LINE_EVERY
            self._capturer.cache.save_every_s = CACHE_LINE_EVERY_S
        got = self._capturer.capture(durable=False)
        fds = self._capturer.store.take_unsynced()
        if fds:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="trees-sync")
            self._syncs.append(self._pool.submit(sync_fds, fds))
        if got.digest == state.tree:
            return None
        return ("workspace_tree", {"turn": state.turn, "tree": got.digest, "hashed": got.hashed,
                                   "stored": got.stored}, f"w{state.last_seq}:tree")


def finish_pending(writer: WriterClient, state_dir: StateDir, name: str) -> None:
    """Finish (or abandon) a rewind a crash cut short, before the agent folds."""
    if rewind.intent_path(state_dir, name).exists():
        rewind.recover(writer, state_dir, name)
