"""Workspace trees without processes: the store, capture with its stat cache
(racy entries, links never followed), restore byte for byte touching only
what differs (actors/trees)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actors.changesets import confined
from actors.trees import restore, tree
from actors.trees.capture import Capturer
from actors.trees.statcache import StatCache
from actors.trees.store import CorruptObjectError, ObjectStore, digest_of
from tests.processes import wait_for


def _snapshot(ws: Path) -> dict[str, tuple[str, bytes, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(ws):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = p.relative_to(ws).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p).encode(), 0)
            else:
                out[rel] = ("file", p.read_bytes(), p.stat().st_mode & 0o777)
    return out


def _capturer(tmp: Path, ws: Path) -> Capturer:
    store = ObjectStore(tmp / "state" / "trees" / "packs")
    return Capturer(ws, store, StatCache.load(tmp / "state" / "cache" / "t.jsonl"))


def test_capture_restore_round_trip_with_links_modes_and_kind_changes(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "b" / "f.txt").write_bytes(b"one\n")
    (ws / "x.sh").write_bytes(b"#!/bin/sh\n")
    (ws / "x.sh").chmod(0o755)
    (ws / "out").symlink_to("/etc")  # recorded as a link, never followed
    (ws / "k").write_bytes(b"a file that becomes a directory")
    cap = _capturer(tmp_path, ws)
    first = cap.capture()
    before = _snapshot(ws)
    # change everything: content, mode, kinds, deletions, a new deep directory
    (ws / "a" / "b" / "f.txt").write_bytes(b"two\n")
    (ws / "x.sh").chmod(0o644)
    (ws / "out").unlink()
    (ws / "out").mkdir()
    (ws / "out" / "inner").write_bytes(b"inner")
    (ws / "k").unlink()
    (ws / "k").mkdir()
    (ws / "k" / "z").write_bytes(b"z")
    (ws / "new" / "deep").mkdir(parents=True)
    (ws / "new" / "deep" / "n").write_bytes(b"n")
    second = cap.capture()
    assert second.digest != first.digest
    after = _snapshot(ws)
    restore.restore(ws, cap.store, second.digest, first.digest)
    assert _snapshot(ws) == before
    assert not (ws / "new").exists()
    assert cap.capture().digest == first.digest
    restore.restore(ws, cap.store, first.digest, second.digest)
    assert _snapshot(ws) == after
    # idempotent: restoring again (as a retried rewind does) changes nothing
    restore.restore(ws, cap.store, first.digest, second.digest)
    assert _snapshot(ws) == after


def test_stat_cache_reads_only_changed_files_and_rehashes_racy_ones(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    for i in range(50):
        d = ws / f"d{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(b"x" * i)
    cap = _capturer(tmp_path, ws)
    first = cap.capture()
    assert first.hashed == 50
    # same size, same mtime as before (a racy rewrite): must still be seen
    p = ws / "d1" / "f1"
    st = p.stat()
    p.write_bytes(b"y")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = cap.capture()
    assert again.digest != first.digest  # racy entry re-hashed, change caught
    calm = cap.capture()
    assert calm.hashed <= 1 and calm.digest == again.digest
    # a new process (cache loaded from disk) agrees and hashes nothing more than racy files
    fresh = Capturer(ws, cap.store, StatCache.load(cap.cache.path))
    assert fresh.capture().digest == again.digest


def test_capture_skips_protected_dirs_and_never_follows_links(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / ".corral").mkdir(parents=True)
    (ws / ".corral" / "secret").write_bytes(b"no")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o").write_bytes(b"outside")
    (ws / "lnk").symlink_to(outside)
    (ws / "f").write_bytes(b"f")
    store = ObjectStore(tmp_path / "packs")
    guard = confined.Guard(confined.identities([ws / ".corral"]))
    got = Capturer(ws, store, StatCache.load(None), guard, tmp_path).capture()
    flat = tree.flatten(store.get, got.digest)
    assert set(flat) == {"lnk", "f"}
    assert flat["lnk"].mode == tree.LINK_MODE


def test_store_refuses_damaged_objects_and_forged_trees(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "packs")
    data = b"hello" * 100
    from actors.trees.store import digest_of
    d = digest_of(data)
    store.put_many([(d, data)])
    assert store.put_many([(d, data)]) == 0  # deduplicated
    pack = next((tmp_path / "packs").glob("*.pack"))
    raw = bytearray(pack.read_bytes())
    raw[-3] ^= 0xFF
    pack.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError):
        ObjectStore(tmp_path / "packs").get(d)
    # a torn append (a crash mid-write) is cut away by the next one; both objects read back
    fresh = ObjectStore(tmp_path / "packs2", "w")
    one, two = b"first" * 10, b"second" * 10
    fresh.put_many([(digest_of(one), one)])
    packed = tmp_path / "packs2" / "w.pack"
    with open(packed, "ab") as f:
        f.write(b"\x00" * 20)  # half a header
    again = ObjectStore(tmp_path / "packs2", "w")
    assert again.put_many([(digest_of(two), two)]) == 1
    reader = ObjectStore(tmp_path / "packs2")
    assert reader.get(digest_of(one)) == one and reader.get(digest_of(two)) == two
    for bad in (b'{"version":1,"entries":[["..",33188,"' + b"0" * 64 + b'",1]]}',
                b'{"version":1,"entries":[["a/b",33188,"' + b"0" * 64 + b'",1]]}',
                b'{"version":1,"entries":[["a",8192,"' + b"0" * 64 + b'",1]]}', b"[1"):
        with pytest.raises(tree.TreeFormatError):
            tree.decode(bad)


def test_a_check_with_the_clock_stats_the_directory_once_and_still_sees_a_repack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actors.trees.statcache import fs_now_ns

    packs, clock_dir = tmp_path / "packs", tmp_path / "clock"
    for writer in range(20):  # twenty agents' packs
        ObjectStore(packs, f"agent-{writer}").put_many([(f"{writer:064x}", b"x")])
    # the objects are named by their digest in the store's checks on read, not here
    reader = ObjectStore(packs, "reader")
    stats: list[str] = []
    real_stat = os.stat

    def counting_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(packs)):  # the store's own, not the clock's
            stats.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    def clock_past_the_directory() -> int:
        """The filesystem's clock once it is past the directory's last change
        (a change in the same tick as a check is racy: every pack is checked)."""
        st = real_stat(packs)
        now: int = wait_for(lambda: (t := fs_now_ns(clock_dir)) > max(st.st_mtime_ns,
                                                                     st.st_ctime_ns) and t,
                            5, "the filesystem's clock to tick")
        return now

    monkeypatch.setattr(os, "stat", counting_stat)  # the store's module uses os.stat
    assert reader.validate(clock_past_the_directory()) is False  # first: every pack
    assert len(stats) == 21
    stats.clear()
    assert reader.validate(fs_now_ns(clock_dir)) is False  # nothing renamed: one stat
    assert stats == [str(packs)]
    # a collection rewrites one pack (a new file renamed over it)
    victim = packs / "agent-7.pack"
    copy = packs / ".agent-7.pack.tmp"
    copy.write_bytes(victim.read_bytes())
    os.replace(copy, victim)
    generation = reader.generation
    assert reader.validate(fs_now_ns(clock_dir)) is True
    assert reader.generation == generation + 1
    # racy: a check whose clock is not newer than the directory's timestamps
    # vouches for nothing, so the next check looks at every pack again
    racy = ObjectStore(packs, "racy")
    assert racy.validate(0) is False  # a clock older than every timestamp
    stats.clear()
    assert racy.validate(clock_past_the_directory()) is False
    assert len(stats) == 21
    stats.clear()
    assert racy.validate(fs_now_ns(clock_dir)) is False  # that check had a good clock
    assert len(stats) == 1


def test_an_append_to_the_same_pack_by_another_process_is_indexed_at_the_next_put(
    tmp_path: Path,
) -> None:
    """`put_many` skips scanning its own pack when it is as this store left it;
    one appended to meanwhile (a second process under the same writer name,
    e.g. a rewind's capture) is scanned, and what was appended is indexed."""
    packs = tmp_path / "packs"
    mine, other = ObjectStore(packs, "agent-1"), ObjectStore(packs, "agent-1")
    a, b, c, d = ((digest_of(x), x) for x in (b"one", b"two", b"three", b"four"))
    assert mine.put_many([a]) == 1
    assert mine.put_many([d]) == 1  # as it left it: no scan needed
    assert other.put_many([b]) == 1
    assert not mine.has(b[0])
    assert mine.put_many([c]) == 1
    assert mine.has(b[0])  # the other's append was scanned, not skipped
    assert all(mine.get(name) == data for name, data in (a, b, c, d))
    assert all(ObjectStore(packs, "reader").get(name) == data for name, data in (a, b, c, d))
