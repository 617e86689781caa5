"""The capture's incremental rebuild (actors/trees/capture.py `_rebuild`): a
changed directory's tree made from its cached rows, re-encoding only what
changed, must give the very digest a capture from scratch gives, whatever
changed the workspace and however, and its journal must replay to the same
cache; a hostile rewrite that keeps size and
mtime is seen; a collection that removed cached objects makes them stored
again; a cache that holds lines back (the agent's) replays to its last line,
and a start from one that lost them still names the right trees."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from actors.kernel.state import AgentState
from actors.trees import recorder, tree
from actors.trees.capture import Capturer
from actors.trees.recorder import TreeRecorder, stat_cache_path
from actors.trees.statcache import DirCache, StatCache
from actors.trees.store import ObjectStore
from actors.trees.watch import WorkspaceWatch
from broker.statedir import StateDir


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


def _state(cache: StatCache) -> dict[str, tuple[str, dict[str, object]]]:
    return {rel: (d.digest, dict(d.files)) for rel, d in cache.dirs.items()}


@pytest.mark.parametrize("watched", [False, True])
def test_a_cache_holding_lines_back_replays_to_its_last_line_and_flushes_the_rest(
        tmp_path: Path, watched: bool) -> None:
    """`save_every` above 1 (the agent's capturer): the file gets a line every
    n captures, each a whole state as of its capture; what is held goes out
    with `flush`."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(20):
        (ws / "out" / f"base{i}").write_text(f"base {i}\n")
    path = tmp_path / "state" / "c.jsonl"
    cache = StatCache.load(path)
    cache.save_every = 4
    cap = Capturer(ws, ObjectStore(tmp_path / "state" / "packs"), cache,
                   stamp_dir=tmp_path / "state",
                   watch=WorkspaceWatch.open() if watched else None)
    rng = random.Random(5)
    cap.capture()
    at_last_line = (cache.stamp_ns, _state(cache))  # the first capture writes its line
    lines = 0
    for step in range(30):
        _mutate(rng, ws, step)
        before = path.stat().st_size
        got = cap.capture()
        assert got.digest == _fresh_digest(tmp_path, ws, step), step
        if path.stat().st_size != before:
            lines += 1
            at_last_line = (cache.stamp_ns, _state(cache))
        loaded = StatCache.load(path)
        assert (loaded.stamp_ns, _state(loaded)) == at_last_line, step
    assert 30 // 4 - 1 <= lines <= 30 // 4 + 1  # (a rewrite past 64 lines aside: none here)
    cache.flush()
    loaded = StatCache.load(path)
    assert (loaded.stamp_ns, _state(loaded)) == (cache.stamp_ns, _state(cache))
    cap.close()


def test_a_start_from_a_cache_that_missed_its_last_lines_gets_every_digest_right(
        tmp_path: Path) -> None:
    """A kill loses what a cache held back: the next start's capture reads the
    files changed since its last line again (and only those and the racy
    ones), and names the same tree as a capture from scratch."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(40):
        (ws / "out" / f"base{i}").write_text(f"base {i}\n")
    path = tmp_path / "state" / "c.jsonl"
    store = ObjectStore(tmp_path / "state" / "packs")
    cache = StatCache.load(path)
    cache.save_every, cache.save_every_s = 100, 3600.0
    cap = Capturer(ws, store, cache, stamp_dir=tmp_path / "state")
    cap.capture()  # the file's first line
    cap.capture()  # a second capture: the first one's files are no longer racy
    rng = random.Random(11)
    for step in range(12):  # held back, all of them
        _mutate(rng, ws, step)
        cap.capture()
    held = path.read_bytes()
    # the process is killed: the held lines are gone; a new capturer starts from the file
    again = Capturer(ws, store, StatCache.load(path), stamp_dir=tmp_path / "state")
    got = again.capture()
    assert path.read_bytes() != held  # (it wrote its own line: save_every 1)
    assert got.digest == _fresh_digest(tmp_path, ws, 99)
    assert got.hashed < 40 + 12  # the stale lines still vouch for the files unchanged


def test_the_agents_recorder_holds_cache_lines_back_and_writes_them_when_it_closes(
        state_dir: StateDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder, "CACHE_LINE_EVERY_S", 3600.0)  # (a slow machine's second)
    ws = tmp_path / "ws"
    ws.mkdir()
    rec = TreeRecorder(state_dir, "a1", ws, watch=True)
    state = AgentState()
    path = stat_cache_path(state_dir, "a1")
    sizes = []
    for i in range(6):
        (ws / f"f{i}.txt").write_text(f"{i}\n")
        rec.hold()
        assert rec.fact(state) is not None
        rec.released()
        sizes.append(path.stat().st_size)
    assert len(set(sizes)) == 1  # the first capture's line only: the rest held (16 a line)
    capturer = rec._capturer
    assert capturer is not None
    rec.close()
    loaded = StatCache.load(path)
    assert (loaded.stamp_ns, _state(loaded)) == (capturer.cache.stamp_ns, _state(capturer.cache))
