"""A stat cache seeded from a snapshot (actors/trees/statcache.py `seed`,
actors/subagents/host.py): a subagent child's first capture takes the
digests the snapshot computed for its copies instead of reading and hashing
every file, and still gives the digest a capture from scratch gives when a
copy changed after it was seeded, even by a rewrite that keeps its size
and mtime."""

from __future__ import annotations

import os
import time
from pathlib import Path

from actors.changesets.snapshot import snapshot
from actors.trees.capture import Capturer
from actors.trees.statcache import NO_DIGEST, StatCache, fs_now_ns, seed
from actors.trees.store import ObjectStore

FILES = {f"pkg{i // 10}/mod{i}.py": f"# module {i}\n" * (i + 1) for i in range(40)}


def _workspace(root: Path) -> Path:
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "top.txt").write_text("top\n")
    (root / "link").symlink_to("top.txt")
    return root


def _past_the_tick(directory: Path, newest_ns: int, deadline_s: float = 5.0) -> None:
    """Wait until the filesystem's clock has moved past `newest_ns`, so no
    copy is in the seed's racy tick (a condition with a deadline)."""
    deadline = time.monotonic() + deadline_s
    while fs_now_ns(directory) <= newest_ns:
        assert time.monotonic() < deadline, "the filesystem clock did not move"


def _seeded(tmp: Path) -> tuple[Path, Path, Path]:
    """A parent workspace snapshotted into `work`, the child's stat cache
    seeded from the snapshot; returns (work, cache path, stamp dir)."""
    parent = _workspace(tmp / "parent")
    index = snapshot(parent, tmp / "sub" / "base", tmp / "sub" / "work")
    stamp_dir = tmp / "cache"
    _past_the_tick(stamp_dir, max(max(c[3], c[4]) for c in index.copies.values()))
    files = {rel: (ident, index.entries[rel].sha256) for rel, ident in index.copies.items()}
    path = stamp_dir / "child.jsonl"
    assert seed(path, stamp_dir, files) == len(FILES) + 1
    return tmp / "sub" / "work", path, stamp_dir


def _capture(work: Path, store: ObjectStore, cache_path: Path | None,
             stamp_dir: Path) -> tuple[str, int]:
    got = Capturer(work, store, StatCache.load(cache_path), stamp_dir=stamp_dir).capture()
    return got.digest, got.hashed


def test_a_seeded_first_capture_hashes_nothing_the_store_holds(tmp_path: Path) -> None:
    work, cache_path, stamp_dir = _seeded(tmp_path)
    store = ObjectStore(tmp_path / "packs")
    # the parent's own captures put the same blobs in the store first
    reference, hashed = _capture(tmp_path / "parent", store, None, tmp_path / "ref")
    assert hashed == len(FILES) + 1
    digest, hashed = _capture(work, store, cache_path, stamp_dir)
    assert (digest, hashed) == (reference, 0)
    cache = StatCache.load(cache_path)
    assert cache.dirs["pkg0/"].digest != NO_DIGEST  # the capture's own digests replaced the seed's


def test_a_seeded_capture_reads_what_the_store_lacks(tmp_path: Path) -> None:
    work, cache_path, stamp_dir = _seeded(tmp_path)
    store = ObjectStore(tmp_path / "packs")
    digest, hashed = _capture(work, store, cache_path, stamp_dir)
    assert hashed == len(FILES) + 1  # a trusted digest still needs its object in the store
    assert store.has(digest)
    fresh, _ = _capture(work, ObjectStore(tmp_path / "fresh"), None, tmp_path / "ref")
    assert digest == fresh


def test_a_copy_changed_after_the_seed_is_read_again(tmp_path: Path) -> None:
    work, cache_path, stamp_dir = _seeded(tmp_path)
    store = ObjectStore(tmp_path / "packs")
    _capture(tmp_path / "parent", store, None, tmp_path / "ref")
    victim = work / "pkg1" / "mod12.py"
    st = victim.stat()
    data = victim.read_bytes()
    victim.write_bytes(bytes(b ^ 1 for b in data))  # same size
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: only ctime moves
    (work / "pkg2" / "new.py").write_text("new\n")
    (work / "pkg3" / "mod30.py").unlink()
    digest, hashed = _capture(work, store, cache_path, stamp_dir)
    fresh, _ = _capture(work, ObjectStore(tmp_path / "fresh"), None, tmp_path / "ref2")
    assert digest == fresh
    assert hashed == 2  # the rewritten copy and the new file; nothing else
