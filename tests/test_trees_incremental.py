"""The capture's incremental rebuild (actors/trees/capture.py `_rebuild`): a
changed directory's tree made from its cached rows, re-encoding only what
changed, must give the very digest a capture from scratch gives, whatever
changed the workspace and however, and its journal must replay to the same
cache; a hostile rewrite that keeps size and
mtime is seen; a collection that removed cached objects makes them stored
again."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from actors.trees import tree
from actors.trees.capture import Capturer
from actors.trees.statcache import DirCache, StatCache
from actors.trees.store import ObjectStore


def _fresh_digest(tmp: Path, ws: Path, n: int) -> str:
    """The workspace's tree by a capture with no cache at all (its own store)."""
    store = ObjectStore(tmp / f"ref{n}" / "packs")
    return Capturer(ws, store, StatCache(), stamp_dir=tmp / f"ref{n}").capture().digest


def _mutate(rng: random.Random, ws: Path, step: int) -> None:
    d = ws / rng.choice(["out", "out", "sub/deep", "."])
    if (d.exists() or d.is_symlink()) and not d.is_dir():
        d = ws  # a file now (to_file)
    if d.parent.exists() and not d.parent.is_dir():
        d = ws
    d.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in d.iterdir() if p.is_file() and not p.is_symlink())
    op = rng.choice(["add", "add", "rewrite_same_stat", "append", "remove", "chmod", "link",
                     "to_dir", "to_file", "rename"])
    victim = rng.choice(files) if files else None
    if op == "add" or victim is None:
        (d / f"f{step}-\"ü\\.txt").write_text(f"new {step}\n")
    elif op == "rewrite_same_stat":  # same size, mtime put back: only ctime moves
        st = victim.stat()
        data = victim.read_bytes()
        victim.write_bytes(bytes(b ^ 1 for b in data) if data else b"")
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif op == "append":
        with open(victim, "a") as f:
            f.write("more\n")
    elif op == "remove":
        victim.unlink()
    elif op == "chmod":
        victim.chmod(victim.stat().st_mode ^ 0o100)
    elif op == "link":
        link = d / f"l{step}"
        link.symlink_to(f"target-{step}")
    elif op == "to_dir":
        victim.unlink()
        victim.mkdir()
        (victim / "inner").write_text(str(step))
    elif op == "to_file":
        subdirs = [p for p in d.iterdir() if p.is_dir() and not p.is_symlink()]
        if subdirs:
            shutil.rmtree(subdirs[0])
            subdirs[0].write_text(f"was a dir {step}")
    else:
        victim.rename(d / f"renamed{step}")


def test_incremental_capture_equals_a_capture_from_scratch_after_any_change(
        tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(30):
        (ws / "out" / f"base{i}").write_text(f"base {i}\n")
    store = ObjectStore(tmp_path / "state" / "packs")
    cap = Capturer(ws, store, StatCache.load(tmp_path / "state" / "c.jsonl"),
                   stamp_dir=tmp_path / "state")
    rng = random.Random(17)
    cap.capture()
    for step in range(60):
        for k in range(rng.randint(1, 3)):
            _mutate(rng, ws, step * 10 + k)
        got = cap.capture()
        assert got.digest == _fresh_digest(tmp_path, ws, step), step
        # every tree and blob the digest names is in the store, checked on read
        tree.flatten(store.get, got.digest)
        # the journal (lines giving only the files that changed) replays to
        # the cache in memory
        loaded = StatCache.load(tmp_path / "state" / "c.jsonl")
        assert loaded.stamp_ns == cap.cache.stamp_ns
        for rel, d in cap.cache.dirs.items():
            assert (loaded.dirs[rel].digest, loaded.dirs[rel].files) == (d.digest, d.files), rel


def test_a_rewrite_keeping_size_and_mtime_in_a_big_directory_is_seen(tmp_path: Path) -> None:
    """A process in the workspace rewrites a file and puts its mtime back
    (no racy tick involved: the file is old): its ctime moves, so its identity
    is not the cached one and it is read again."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(200):
        (ws / "out" / f"f{i:03d}").write_text("same\n")
    old = 1_000_000_000 * 10**9
    for p in (ws / "out").iterdir():
        os.utime(p, ns=(old, old))
    store = ObjectStore(tmp_path / "state" / "packs")
    cap = Capturer(ws, store, StatCache(), stamp_dir=tmp_path / "state")
    first = cap.capture().digest
    (ws / "out" / "new").write_text("x")  # the directory changed: its rows are used
    cap.capture()
    victim = ws / "out" / "f100"
    victim.write_text("evil\n")
    os.utime(victim, ns=(old, old))
    got = cap.capture()
    assert 1 <= got.hashed <= 2  # the victim (and "new" if it was racy)
    entries = tree.flatten(store.get, got.digest)
    assert store.get(entries["out/f100"].digest) == b"evil\n"
    assert got.digest == _fresh_digest(tmp_path, ws, 0) != first


def test_only_the_changed_entry_is_read_and_an_equal_tree_is_not_stored_again(
        tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(200):
        (ws / "out" / f"f{i:03d}").write_text(f"{i}\n")
        os.utime(ws / "out" / f"f{i:03d}", ns=(10**18, 10**18))  # not racy
    store = ObjectStore(tmp_path / "state" / "packs")
    cap = Capturer(ws, store, StatCache(), stamp_dir=tmp_path / "state")
    assert cap.capture().hashed == 200
    (ws / "out" / "f200").write_text("new\n")
    assert 1 <= cap.capture().hashed <= 2  # f200 (and the racy last of the 200)
    before = cap.capture().digest
    os.utime(ws / "out" / "f007")  # identity changes, content does not
    got = cap.capture()
    # f007 read again (and f200 if it was racy): the same tree, nothing stored
    assert (got.digest, got.stored) == (before, 0)
    assert 1 <= got.hashed <= 2


def test_objects_a_collection_removed_are_stored_again(tmp_path: Path) -> None:
    """The cached rows name digests the store held; once its index is reset
    (a pack replaced or removed: a collection ran) they are checked again."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(20):
        (ws / "out" / f"f{i}").write_text(f"{i}\n")
    packs = tmp_path / "state" / "packs"
    store = ObjectStore(packs, "me")
    cap = Capturer(ws, store, StatCache(), stamp_dir=tmp_path / "state")
    cap.capture()
    cap.capture()
    for p in packs.iterdir():
        p.unlink()  # as a collection of an unnamed capture would
    (ws / "out" / "another").write_text("a\n")
    got = cap.capture()
    assert got.hashed == 21
    assert sorted(tree.flatten(store.get, got.digest)) == sorted(
        [f"out/f{i}" for i in range(20)] + ["out/another"])


def test_the_journal_kept_open_follows_its_rewrites(tmp_path: Path) -> None:
    """The stat cache appends through an fd it keeps; a rewrite replaces the
    file, so the lines after it must reach the new file, not the one replaced:
    70 captures (one rewrite at the first, one past 64 lines) load back whole."""
    path = tmp_path / "cache" / "a1.jsonl"
    cache = StatCache(path)
    for i in range(70):
        rel = f"d{i}/"
        cache.dirs[rel] = DirCache(f"{i:064x}", i, {"f": ((0o100644, i, 1, i, i), f"{i:064x}")})
        cache.stamp_ns = i + 1
        cache.save([rel], [])
    loaded = StatCache.load(path)
    assert loaded.stamp_ns == 70
    assert {r: (d.digest, d.files) for r, d in loaded.dirs.items()} == \
        {r: (d.digest, d.files) for r, d in cache.dirs.items()}


def test_a_link_at_the_journals_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    """The kept journal fd is opened by name after a rewrite: a link put there
    meanwhile is replaced by a new file, the file it named untouched."""
    path = tmp_path / "cache" / "a1.jsonl"
    cache = StatCache(path)
    cache.dirs["d/"] = DirCache("0" * 64, 1, {"f": ((0o100644, 1, 1, 1, 1), "1" * 64)})
    cache.stamp_ns = 2
    cache.save(["d/"], [])  # the first line rewrites the file
    outside = tmp_path / "outside"
    outside.write_text("mine\n")
    path.unlink()
    path.symlink_to(outside)
    cache.stamp_ns = 3
    cache.save(["d/"], [])  # appended: through a new file, not the link
    assert outside.read_text() == "mine\n"
    assert not path.is_symlink()
    assert StatCache.load(path).stamp_ns == 3
