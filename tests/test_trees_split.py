"""A large directory's tree in parts (actors/trees/tree.py, docs/trees.md
"Trees"): a turn that edits one file of a 1,000-file directory adds to the
packs about what it changed, not the directory's listing again; trees the
earlier format wrote (a large directory in one object) still read, diff and
restore; collection walks the parts, keeping what a kept turn reaches and
dropping what only a dropped turn did."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from actors.trees import collect, restore, tree
from actors.trees.capture import Capturer
from actors.trees.layout import capturer_for, store_for
from actors.trees.statcache import StatCache
from actors.trees.store import ObjectStore, digest_of, packs_dir
from broker.statedir import StateDir
from tests.agentkit import FakeWriter
from tests.test_trees_collect import dump_wal

pytestmark = pytest.mark.timeout(120)
FILES = 1000
FILE_BYTES = 1024


def _big_workspace(ws: Path, rnd: random.Random) -> list[Path]:
    (ws / "big").mkdir(parents=True)
    (ws / "README").write_text("a workspace with one large directory\n")
    paths = [ws / "big" / f"f{i:04d}.txt" for i in range(FILES)]
    for p in paths:
        p.write_bytes(rnd.randbytes(FILE_BYTES))
    return paths


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _pack_bytes(packs: Path) -> int:
    return sum(p.stat().st_size for p in packs.glob("*.pack"))


def _capturer(root: Path, ws: Path) -> Capturer:
    return Capturer(ws, ObjectStore(root / "packs", "a"), StatCache.load(root / "cache.jsonl"))


def test_a_turn_editing_one_file_of_a_large_directory_adds_about_what_it_changed(
        tmp_path: Path) -> None:
    """Each of 30 turns rewrites one 1 KiB file of a 1,000-file directory: the
    packs grow by at most 4x the bytes changed a turn (the blob, one part and
    the nodes above it; the whole listing was ~90 KiB a turn), no turn adds
    more than a few objects, and every tree still reads back whole."""
    rnd = random.Random(7)
    ws = tmp_path / "ws"
    paths = _big_workspace(ws, rnd)
    cap = _capturer(tmp_path, ws)
    first = cap.capture()
    big = tree.read(cap.store.get, tree.read(cap.store.get, first.digest)["big"].digest)
    assert len(big) == FILES
    root_objects = tree.links(cap.store.get(tree.read(cap.store.get, first.digest)["big"].digest))
    assert root_objects[1], "a directory this large is a node of parts"
    before = _pack_bytes(tmp_path / "packs")
    turns = 30
    digests = []
    for _ in range(turns):
        rnd.choice(paths).write_bytes(rnd.randbytes(FILE_BYTES))
        got = cap.capture()
        assert 1 <= got.hashed <= 2  # this turn's file (and the last one's, if racy)
        assert got.stored <= 8  # the blob, a part, the nodes above it, the root
        digests.append(got.digest)
    per_turn = (_pack_bytes(tmp_path / "packs") - before) / turns
    assert per_turn <= 4 * FILE_BYTES, per_turn
    assert per_turn >= FILE_BYTES  # the changed content itself is stored
    flat = tree.flatten(cap.store.get, digests[-1])
    assert len(flat) == FILES + 1
    assert {p: e.digest for p, e in flat.items() if p.startswith("big/")} == {
        f"big/{p.name}": digest_of(p.read_bytes()) for p in paths}


def test_the_split_is_a_function_of_the_entries_and_equal_to_a_fresh_capture(
        tmp_path: Path) -> None:
    """Adding and removing names keeps the digest equal to that of a capture
    from scratch (equal directories, equal digests, whatever the history),
    and a name added changes few parts."""
    rnd = random.Random(11)
    ws = tmp_path / "ws"
    paths = _big_workspace(ws, rnd)
    cap = _capturer(tmp_path / "a", ws)
    first = cap.capture().digest
    (ws / "big" / "f0500.txt.new").write_bytes(b"new\n")
    paths[10].unlink()
    changed = cap.capture()
    assert changed.stored <= 10
    fresh = _capturer(tmp_path / "b", ws).capture()
    assert fresh.digest == changed.digest
    load = cap.store.get
    old_big = tree.read(load, first)["big"].digest
    new_big = tree.read(load, changed.digest)["big"].digest
    shared = {d for d, _ in tree.leaves(load, old_big)} & {d for d, _ in tree.leaves(load, new_big)}
    assert len(shared) >= len(tree.leaves(load, new_big)) - 4
    remove, write = tree.diff(load, first, changed.digest)
    assert remove == ["big/f0010.txt"] and list(write) == ["big/f0500.txt.new"]


def test_a_tree_in_the_earlier_format_still_reads_diffs_and_restores(tmp_path: Path) -> None:
    """A store written before the split held a large directory in one object:
    it reads (`read`, `flatten`), restores byte for byte, diffs against the
    split form of the same directory as nothing to do, and a capture over it
    writes the split form."""
    rnd = random.Random(3)
    ws = tmp_path / "ws"
    _big_workspace(ws, rnd)
    store = ObjectStore(tmp_path / "packs", "old")
    objects: list[tuple[str, bytes]] = []
    big: tree.Entries = {}
    for p in sorted((ws / "big").iterdir()):
        data = p.read_bytes()
        objects.append((digest_of(data), data))
        big[p.name] = tree.Entry(p.stat().st_mode, digest_of(data), len(data))
    readme = (ws / "README").read_bytes()
    objects.append((digest_of(readme), readme))
    old_big = tree.encode(big)  # the one object the earlier format wrote
    assert len(old_big) > tree.SPLIT_BYTES
    root = tree.encode({"README": tree.Entry((ws / "README").stat().st_mode, digest_of(readme),
                                             len(readme)),
                        "big": tree.Entry(tree.DIR_MODE, digest_of(old_big), 0)})
    objects += [(digest_of(old_big), old_big), (digest_of(root), root)]
    store.put_many(objects)
    old = digest_of(root)
    assert json.loads(old_big)["version"] == 1
    assert tree.read(store.get, digest_of(old_big)) == big
    out = tmp_path / "out"
    out.mkdir()
    restore.restore(out, store, None, old)
    assert files_of(out) == files_of(ws)
    cap = Capturer(ws, store, StatCache.load(tmp_path / "cache.jsonl"))
    new = cap.capture().digest
    assert new != old  # the new form for the same entries
    assert tree.flatten(store.get, new) == tree.flatten(store.get, old)
    assert tree.diff(store.get, old, new) == ([], {})
    assert restore.restore(ws, store, new, old).written == 0


def test_a_forged_node_is_refused(tmp_path: Path) -> None:
    """A node is input like any other: parts out of name order (a part named
    twice), an empty parts list and a chain of nodes deeper than the bound
    are refused (TreeFormatError), never read as a directory."""
    store = ObjectStore(tmp_path / "packs", "x")
    part = tree.encode({"a": tree.Entry(0o100644, "0" * 64, 1)})
    node = (b'{"parts":["' + digest_of(part).encode() + b'","' + digest_of(part).encode()
            + b'"],"version":2}')
    empty = b'{"parts":[],"version":2}'
    chain = [part]
    for _ in range(tree.MAX_PART_DEPTH + 1):
        chain.append(b'{"parts":["' + digest_of(chain[-1]).encode() + b'"],"version":2}')
    store.put_many([(digest_of(o), o) for o in (part, node, empty, *chain)])
    for bad in (node, empty, chain[-1]):
        with pytest.raises(tree.TreeFormatError):
            tree.read(store.get, digest_of(bad))
    assert tree.read(store.get, digest_of(chain[3])) == tree.decode(part)
    with pytest.raises(tree.TreeFormatError):
        tree.decode(chain[1])  # a node is no directory's one object


def _tree_record(writer: FakeWriter, turn: int, digest: str) -> None:
    writer.append("agent/a1", "workspace_tree", {"turn": turn, "tree": digest, "hashed": 1,
                                                 "stored": 1}, key=f"w{turn}:tree")


def _closure_of(store: ObjectStore, digest: str) -> set[str]:
    """Every object below the tree `digest`: its nodes, parts and blobs."""
    out = {digest}
    entries, parts = tree.links(store.get(digest))
    for part in parts:
        out |= _closure_of(store, part)
    for entry in entries.values():
        out |= _closure_of(store, entry.digest) if entry.is_dir else {entry.digest}
    return out


def test_collection_keeps_what_a_kept_turn_reaches_through_parts_and_drops_the_rest(
        state_dir: StateDir, tmp_path: Path) -> None:
    """Three turns of a 1,000-file directory, the WAL naming the first and the
    third: a pass keeps every node, part and blob those two reach (both
    restore byte for byte from the repacked store) and removes what only the
    second reached (its blob, its changed part and its nodes)."""
    rnd = random.Random(5)
    ws = tmp_path / "ws"
    paths = _big_workspace(ws, rnd)
    cap = capturer_for(state_dir, "a1", ws, store_for(state_dir, "a1"))
    t1 = cap.capture().digest
    want_t1 = files_of(ws)
    paths[400].write_bytes(b"turn two\n")
    t2 = cap.capture().digest
    paths[400].write_bytes(b"turn three\n")
    t3 = cap.capture().digest
    want_t3 = files_of(ws)
    store = cap.store
    keep = _closure_of(store, t1) | _closure_of(store, t3)
    only_t2 = _closure_of(store, t2) - keep
    assert digest_of(b"turn two\n") in only_t2 and t2 in only_t2
    assert len(only_t2) >= 3  # the blob, the root and the big directory's changed part and nodes
    writer = FakeWriter()
    _tree_record(writer, 1, t1)
    _tree_record(writer, 3, t3)
    dump_wal(state_dir, writer)

    report = collect.collect(state_dir)
    assert not report.error and report.missing == 0
    assert report.objects_removed == len(only_t2)
    fresh = ObjectStore(packs_dir(state_dir.root))
    assert all(fresh.has(d) for d in keep)
    assert not any(fresh.has(d) for d in only_t2)
    for digest, want in ((t1, want_t1), (t3, want_t3)):
        out = tmp_path / f"out-{digest[:8]}"
        out.mkdir()
        restore.restore(out, fresh, None, digest)
        assert files_of(out) == want
    assert collect.collect(state_dir).objects_removed == 0  # nothing more to drop


def test_a_directory_small_enough_is_one_object_as_before(tmp_path: Path) -> None:
    """Below SPLIT_BYTES a directory is the one version 1 object it always
    was: its digest is the sha256 of `tree.encode` of its entries."""
    entries = {f"f{i}": tree.Entry(0o100644, hashlib.sha256(str(i).encode()).hexdigest(), i)
               for i in range(20)}
    body = tree.encode(entries)
    assert len(body) <= tree.SPLIT_BYTES
    assert tree.digest_of_entries(entries) == hashlib.sha256(body).hexdigest()
    out: dict[str, bytes] = {}
    rows = {n: tree.encode_row(n, e.mode, e.digest, e.size) for n, e in entries.items()}
    assert tree.store_rows(sorted(rows), rows, out) == digest_of(body)
    assert list(out.values()) == [body]
