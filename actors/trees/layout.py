"""Where an agent's trees live in a state directory, and the capturer over
them: the object store, the stat cache, the fault points of the trees' tests.
The recorder (the agent's captures), rewind and fork all start from here
(docs/trees.md).

    .corral/trees/packs/                the object store (recovery-core: rewind reads it)
    .corral/cache/trees/<agent>.jsonl   the stat cache (cache tier)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from actors.kernel import workspace as agent_workspace
from actors.trees.capture import Capturer
from actors.trees.statcache import StatCache
from actors.trees.store import ObjectStore, packs_dir
from actors.trees.watch import WorkspaceWatch
from broker.statedir import StateDir

ENV_FAULT = "CORRAL_TREES_FAULT"


def fault(point: str) -> None:
    """Tests only: SIGKILL this process at `point` when CORRAL_TREES_FAULT names it."""
    if point in os.environ.get(ENV_FAULT, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def store_for(state_dir: StateDir, writer: str = "shared") -> ObjectStore:
    """The object store; objects this process adds go to `writer`'s pack."""
    return ObjectStore(packs_dir(state_dir.root), writer)


def stat_cache_path(state_dir: StateDir, name: str) -> Path:
    """Agent `name`'s stat cache (the cache tier: derived, never needed)."""
    return state_dir.cache_dir / "trees" / f"{name}.jsonl"


def capturer_for(state_dir: StateDir, name: str, workspace: Path,
                 store: ObjectStore | None = None, *, watch: bool = False) -> Capturer:
    """`watch`: captures read what inotify reports changed (the agent's own
    capturer; without an instance from the host, every capture walks)."""
    store = store if store is not None else store_for(state_dir, name)
    cache = StatCache.load(stat_cache_path(state_dir, name))
    return Capturer(workspace, store, cache, agent_workspace.guard_for(state_dir),
                    state_dir.cache_dir / "trees",
                    watch=WorkspaceWatch.open(packs_dir(state_dir.root).parent / "watch-slots")
                    if watch else None)
