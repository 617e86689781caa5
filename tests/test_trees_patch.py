"""A watched capture patches a changed directory's cached state from the
names that moved (actors/trees/capture.py `_patch`): after any sequence of
changes its root digest is the tree of what is on disk (`tree.store_rows` of the
workspace read from scratch), including rewrites that keep a file's lstat
identity within the filesystem clock's tick (the racy rule, on a simulated
coarse clock), hard links, renames and subdirectories that empty or fill;
its work follows the names changed, not the directory's size; and a patch
that raises midway leaves no digest a later walk could keep."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from actors.trees import capture, tree
from actors.trees.capture import Capturer
from actors.trees.statcache import StatCache, fs_now_ns
from actors.trees.store import ObjectStore
from actors.trees.watch import WorkspaceWatch


def _disk_digest(path: Path) -> str:
    """The workspace's root digest, as `tree.encode` gives it for what is on
    disk now (special files and empty directories not recorded)."""
    got = _dir_digest(path)
    return got or hashlib.sha256(tree.encode({})).hexdigest()


def _dir_digest(path: Path) -> str:
    entries: tree.Entries = {}
    with os.scandir(path) as it:
        for item in it:
            st_ = item.stat(follow_symlinks=False)
            if stat.S_ISDIR(st_.st_mode):
                sub = _dir_digest(Path(item.path))
                if sub:
                    entries[item.name] = tree.Entry(tree.DIR_MODE, sub, 0)
            elif stat.S_ISLNK(st_.st_mode):
                target = os.fsencode(os.readlink(item.path))
                entries[item.name] = tree.Entry(tree.LINK_MODE,
                                                hashlib.sha256(target).hexdigest(), len(target))
            elif stat.S_ISREG(st_.st_mode):
                data = Path(item.path).read_bytes()
                entries[item.name] = tree.Entry(st_.st_mode, hashlib.sha256(data).hexdigest(),
                                                len(data))
    return tree.digest_of_entries(entries) if entries else ""


class _CoarseClock:
    """A filesystem clock with ticks the test decides (`advance`): every
    timestamp the capturer sees is floored to the start of its tick, as on
    a filesystem whose clock is coarse, so a file rewritten in place with
    the same size within a tick keeps its lstat identity (mode, inode,
    size, mtime, ctime) and only the racy rule can see the change."""

    def __init__(self, probe_dir: Path) -> None:
        self.probe_dir = probe_dir
        self.ticks = [self._moved()]  # where each tick starts, on the real clock
        self.values = list(self.ticks)  # the time the capturer sees in each

    def _moved(self) -> int:
        """A time of the real clock after every timestamp given so far and not
        after any given from now on: the clock is read (a probe written)
        until it moves, as timestamps given within its own tick are equal.
        A wait on the filesystem's clock, not a sleep: a few ms at most."""
        first = fs_now_ns(self.probe_dir)
        deadline = time.monotonic() + 10
        while (now := fs_now_ns(self.probe_dir)) <= first:
            assert time.monotonic() < deadline, "the filesystem's clock did not move"
        return now

    def advance(self, back_to: int | None = None) -> None:
        """A new tick from now on; `back_to`: the clock is set back to it."""
        start = self._moved()
        self.ticks.append(start)
        self.values.append(start if back_to is None else back_to)

    def floor(self, ns: int) -> int:
        i = bisect_right(self.ticks, ns)
        return self.values[i - 1] if i else ns

    def coarse(self, st_: os.stat_result) -> os.stat_result:
        mtime, ctime = self.floor(st_.st_mtime_ns), self.floor(st_.st_ctime_ns)
        return os.stat_result(tuple(st_)[:10], {
            "st_atime_ns": st_.st_atime_ns, "st_mtime_ns": mtime, "st_ctime_ns": ctime})


class _CoarseEntry:
    def __init__(self, item: os.DirEntry[str], clock: _CoarseClock) -> None:
        self._item = item
        self._clock = clock
        self.name = item.name

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._item.is_dir(follow_symlinks=follow_symlinks)

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return self._clock.coarse(self._item.stat(follow_symlinks=follow_symlinks))


class _CoarseOs:
    """The `os` the capture module sees: its stats go through the clock."""

    def __init__(self, clock: _CoarseClock) -> None:
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def stat(self, *args: Any, **kwargs: Any) -> os.stat_result:
        return self._clock.coarse(os.stat(*args, **kwargs))

    def fstat(self, fd: int) -> os.stat_result:
        return self._clock.coarse(os.fstat(fd))

    @contextlib.contextmanager
    def scandir(self, fd: int) -> Iterator[Iterator[_CoarseEntry]]:
        with os.scandir(fd) as it:
            yield (_CoarseEntry(item, self._clock) for item in it)


def _watched(state: Path, ws: Path, cache: StatCache | None = None) -> Capturer:
    watch = WorkspaceWatch.open()
    assert watch is not None, "this host refused an inotify instance"
    return Capturer(ws, ObjectStore(state / "packs"),
                    cache if cache is not None else StatCache.load(state / "c.jsonl"),
                    stamp_dir=state, watch=watch, full_every_s=3600.0)


def _capture(cap: Capturer) -> str:
    digest = cap.capture(durable=False).digest
    for fd in cap.store.take_unsynced():
        os.close(fd)
    return digest


def _files(ws: Path) -> list[Path]:
    return sorted(p for p in ws.rglob("*") if p.is_file() and not p.is_symlink())


def _dirs(ws: Path) -> list[Path]:
    return [ws, *sorted(p for p in ws.rglob("*") if p.is_dir() and not p.is_symlink())]


def _apply(op: str, k: int, ws: Path, clock: _CoarseClock) -> bool:
    """Make one change; whether the capture after it may walk in full (a
    directory made or removed, a name that now has other links)."""
    files, dirs = _files(ws), _dirs(ws)
    victim = files[k % len(files)] if files else None
    where = dirs[k % len(dirs)]
    walks = op in ("mkdir", "rmtree", "hardlink") or (
        op in ("rename", "rename_over") and victim is not None and victim.stat().st_nlink > 1)
    if op == "tick":
        clock.advance()
    elif op == "create" or victim is None:
        (where / f"n{k}").write_text(f"new {k}\n")
    elif op == "overwrite":
        victim.write_text(victim.read_text() + f"more {k}\n")
    elif op == "rewrite_same_size":  # in place: the same inode, the same size
        data = victim.read_bytes()
        with open(victim, "r+b") as f:
            f.write(bytes(b ^ 1 for b in data) if data else b"")
    elif op == "delete":
        victim.unlink()
    elif op == "rename":
        victim.rename(where / f"r{k}")
    elif op == "rename_over":  # onto another file: its name now names the victim's inode
        target = files[(k + 1) % len(files)]
        if target != victim:
            victim.rename(target)
    elif op == "hardlink":
        with contextlib.suppress(FileExistsError):
            os.link(victim, where / f"h{k}")
    elif op == "write_linked":  # through one name: no event for the other
        linked = [p for p in files if p.stat().st_nlink > 1]
        if linked:
            with open(linked[k % len(linked)], "a") as f:
                f.write(f"through a link {k}\n")
    elif op == "symlink":
        with contextlib.suppress(FileExistsError):
            (where / f"s{k}").symlink_to(f"target-{k}")
    elif op == "chmod":
        victim.chmod(victim.stat().st_mode ^ 0o100)
    elif op == "fifo":
        with contextlib.suppress(FileExistsError):
            os.mkfifo(where / f"p{k}")
    elif op == "mkdir":
        (where / f"d{k}").mkdir(exist_ok=True)
        (where / f"d{k}" / "inner").write_text(f"inner {k}\n")
    elif op == "rmtree" and len(dirs) > 1:
        shutil.rmtree(dirs[1 + k % (len(dirs) - 1)])
    return walks


_OPS = ["tick", "create", "create", "overwrite", "rewrite_same_size", "rewrite_same_size",
        "delete", "delete", "rename", "rename_over", "hardlink", "write_linked", "symlink",
        "chmod", "fifo", "mkdir", "rmtree"]


def _check_cached_state(cap: Capturer) -> None:
    """What the patches keep in place agrees with the listing."""
    for rel, index in cap._index.items():
        cached = cap.cache.dirs.get(rel)
        if cached is None or cached.rows is None:
            continue
        assert cached.order == sorted(cached.rows), rel
        assert cached.sigset == set(index.values()), rel
        if cached.racy is not None:
            for e in index.values():
                if max(e[4], e[5]) >= cached.racy_floor:
                    assert cached.racy.get(e[0]) == max(e[4], e[5]), (rel, e)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example([("tick", 0), ("hardlink", 0), ("overwrite", 0)])  # through a link made since the walk
@given(st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 10_000)), min_size=1,
                max_size=30))
def test_a_patched_capture_is_the_tree_on_disk_after_any_changes(
        ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws = root / "ws"
        (ws / "out" / "sub").mkdir(parents=True)
        (ws / "empty").mkdir()
        clock = _CoarseClock(root / "clock")
        for i in range(12):
            (ws / "out" / f"base{i}").write_text(f"base {i}\n")
        (ws / "out" / "sub" / "only").write_text("only\n")
        (ws / "top").write_text("top\n")
        os.link(ws / "top", ws / "out" / "top-link")
        cap = _watched(root / "state", ws)
        real_stamp: Callable[[], int] = cap._stamp
        cap._stamp = lambda: clock.floor(real_stamp())  # type: ignore[method-assign]
        saved = capture.os
        capture.os = _CoarseOs(clock)  # type: ignore[assignment]
        try:
            assert _capture(cap) == _disk_digest(ws)
            for n, (op, k) in enumerate(ops):
                may_walk = _apply(op, k, ws, clock)
                walks = cap.full_walks
                assert _capture(cap) == _disk_digest(ws), (n, op)
                if not may_walk:  # a file's change: from the events alone
                    assert cap.full_walks == walks, (n, op)
                _check_cached_state(cap)
                loaded = StatCache.load(root / "state" / "c.jsonl")  # the journal replays
                for rel, d in cap.cache.dirs.items():
                    assert (loaded.dirs[rel].digest, loaded.dirs[rel].files) == (
                        d.digest, d.files), (n, rel)
        finally:
            capture.os = saved  # type: ignore[assignment]
            cap.close()


def test_a_same_size_rewrite_within_the_tick_is_read_again(tmp_path: Path) -> None:
    """A file written and captured within one tick of the filesystem's clock,
    then rewritten in place with the same size: its lstat identity has not
    moved, and only the racy rule makes the watched capture read it again;
    once a tick has passed it is trusted, and no longer read."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(50):
        (ws / "out" / f"f{i}").write_text(f"{i}\n")
    clock = _CoarseClock(tmp_path / "clock")
    cap = _watched(tmp_path / "state", ws)
    real_stamp = cap._stamp
    cap._stamp = lambda: clock.floor(real_stamp())  # type: ignore[method-assign]
    saved = capture.os
    capture.os = _CoarseOs(clock)  # type: ignore[assignment]
    try:
        _capture(cap)
        victim = ws / "out" / "f7"
        victim.write_text("AB\n")
        ident = os.stat(victim)
        _capture(cap)
        victim.write_text("CD\n")  # the same size, in place
        assert (clock.coarse(os.stat(victim)).st_ctime_ns, os.stat(victim).st_ino) == (
            clock.coarse(ident).st_ctime_ns, ident.st_ino)  # the same identity
        assert _capture(cap) == _disk_digest(ws)
        clock.advance()
        _capture(cap)  # (no event: nothing read) its stamp starts the new tick
        (ws / "out" / "other").write_text("x\n")
        got = cap.capture(durable=False)
        assert got.digest == _disk_digest(ws)
        assert got.hashed == 1  # "other": f7 is older than the last stamp now
        assert cap.full_walks == 1
    finally:
        capture.os = saved  # type: ignore[assignment]
        cap.close()


class _Counted(dict[Any, Any]):
    """A dict that counts the calls that would look at every entry."""

    whole = 0

    def __iter__(self) -> Iterator[Any]:
        _Counted.whole += 1
        return super().__iter__()

    def keys(self) -> Any:
        _Counted.whole += 1
        return super().keys()

    def values(self) -> Any:
        _Counted.whole += 1
        return super().values()

    def items(self) -> Any:
        _Counted.whole += 1
        return super().items()

    def copy(self) -> Any:
        _Counted.whole += 1
        return super().copy()

    def __eq__(self, other: object) -> bool:
        _Counted.whole += 1
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]


class _CountedSet(set[Any]):
    whole = 0

    def __iter__(self) -> Iterator[Any]:
        _CountedSet.whole += 1
        return super().__iter__()

    def __eq__(self, other: object) -> bool:
        _CountedSet.whole += 1
        return super().__eq__(other)

    def issuperset(self, other: Any) -> bool:
        _CountedSet.whole += 1
        return super().issuperset(other)

    __hash__ = None  # type: ignore[assignment]


class _CountedList(list[Any]):
    whole = 0

    def __iter__(self) -> Iterator[Any]:
        _CountedList.whole += 1
        return super().__iter__()


def test_adding_a_file_to_a_big_directory_looks_at_that_name_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that adds one file to a directory of 2,000 entries reads that
    file, inserts its row, and goes over the directory's entries only to
    join the rows and find its parts (twice): no listing made into a signature or a set,
    no rows or files copied or compared, no name sorted again."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    old = 1_000_000_000 * 10**9  # 2001: not racy
    for i in range(2000):
        p = ws / "out" / f"f{i:04d}"
        p.write_text(f"{i}\n")
        os.utime(p, ns=(old, old))
    cap = _watched(tmp_path / "state", ws)
    _capture(cap)  # the full walk
    (ws / "out" / "warm").write_text("warm\n")
    _capture(cap)  # a watched capture
    cached = cap.cache.dirs["out/"]
    assert cached.rows is not None and cached.sigset is not None and cached.order is not None
    cap._index["out/"] = _Counted(cap._index["out/"])
    cached.rows, cached.files = _Counted(cached.rows), _Counted(cached.files)
    cached.sigset, cached.order = _CountedSet(cached.sigset), _CountedList(cached.order)
    _Counted.whole = _CountedSet.whole = _CountedList.whole = 0

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole directory was gone over")

    for name in ("_all_rows", "_changed_rows", "_rebuild"):
        monkeypatch.setattr(Capturer, name, refused)
    read: list[str] = []
    entry = Capturer._entry

    def counted_entry(self: Capturer, fd: int, ent: Any, *args: Any) -> int:
        read.append(ent[0])
        return entry(self, fd, ent, *args)

    monkeypatch.setattr(Capturer, "_entry", counted_entry)
    (ws / "out" / "new").write_text("new\n")
    digest = _capture(cap)
    assert (_Counted.whole, _CountedSet.whole) == (0, 0)
    # the rows joined in their order, and the names' part ends looked up (a
    # directory this large is split into parts: tree.store_rows)
    assert _CountedList.whole <= 2
    assert "new" in read and set(read) <= {"new", "warm"}  # warm: if within the last tick
    assert cap.full_walks == 1
    monkeypatch.undo()
    assert digest == _disk_digest(ws)
    (ws / "out" / "f0100").unlink()  # and a removal, still patched in place
    assert _capture(cap) == _disk_digest(ws)
    assert cap.cache.dirs["out/"].order == sorted(cap.cache.dirs["out/"].rows or {})
    cap.close()


def test_a_patch_that_raises_midway_leaves_no_digest_to_keep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watched capture whose read of a changed file fails (here an
    injected PermissionError) has already put the file's new identity in
    the directory's cached entries: the walk that follows finds the
    listing equal to them, every timestamp older than the last stamp, and
    must not keep the digest of the tree before the change."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(20):
        (ws / "out" / f"f{i}").write_text(f"{i}\n")
    cap = _watched(tmp_path / "state", ws)
    before = _capture(cap)
    _capture(cap)  # nothing changed: its stamp is newer than every file
    (ws / "out" / "f5").write_text("changed\n")
    real_read = capture._read

    def failing(dir_fd: int, name: str) -> Any:
        if name == "f5":
            raise PermissionError(13, "injected", name)
        return real_read(dir_fd, name)

    with monkeypatch.context() as m:
        m.setattr(capture, "_read", failing)
        with pytest.raises(PermissionError):
            cap.capture(durable=False)
    assert cap.full_walks == 1  # it failed in the watched pass
    got = _capture(cap)
    assert got == _disk_digest(ws) != before
    assert cap.full_walks == 2  # a failed capture is followed by a walk
    (ws / "out" / "f6").write_text("and then watched again\n")
    assert _capture(cap) == _disk_digest(ws)
    assert cap.full_walks == 2
    cap.close()


def test_a_clock_set_back_makes_the_racy_entries_found_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The racy entries a directory keeps are those not older than the last
    stamp; when the clock is set back below that stamp, entries pruned as
    older are racy again, and a watched capture finds them from the listing
    (a same-size rewrite within the tick the clock went back to is read
    again, as `_changed_rows` reads it)."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    clock = _CoarseClock(tmp_path / "clock")
    for i in range(10):
        (ws / "out" / f"f{i}").write_text(f"{i}\n")
    clock.advance()
    t1 = clock.values[-1]
    cap = _watched(tmp_path / "state", ws)
    real_stamp = cap._stamp
    monkeypatch.setattr(cap, "_stamp", lambda: clock.floor(real_stamp()))
    monkeypatch.setattr(capture, "os", _CoarseOs(clock))
    victim = ws / "out" / "v"
    victim.write_text("AB\n")
    _capture(cap)
    for name in ("w", "x"):  # two ticks later, the victim is pruned as not racy
        clock.advance()
        (ws / "out" / name).write_text(f"{name}\n")
        assert _capture(cap) == _disk_digest(ws)
    assert "v" not in (cap.cache.dirs["out/"].racy or {})
    clock.advance(back_to=t1)
    victim.write_text("CD\n")  # in place, the same size, in the tick the clock is back in
    _capture(cap)  # the last stamp is newer than the victim: trusted (the racy rule's blind spot)
    (ws / "out" / "y").write_text("y\n")
    assert _capture(cap) == _disk_digest(ws)  # this capture's threshold is t1: read again
    assert cap.full_walks == 1
    cap.close()


@pytest.mark.parametrize("where", ["out/", ""])
def test_a_hard_link_made_after_the_walk_is_followed_through_either_name(
        tmp_path: Path, where: str) -> None:
    """A hard link made in the workspace since the last walk raises an event
    for the new name only (the link count's change is no event in the
    directory of the file's other name): the capture that sees a name with
    other links it did not know walks, and from then on a write through
    either name is read from the events."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    for i in range(10):
        (ws / "out" / f"f{i}").write_text(f"{i}\n")
    cap = _watched(tmp_path / "state", ws)
    _capture(cap)
    link = ws / where / "link"
    os.link(ws / "out" / "f3", link)
    assert _capture(cap) == _disk_digest(ws)
    walks = cap.full_walks
    with open(link, "a") as f:
        f.write("through the new name\n")
    assert _capture(cap) == _disk_digest(ws)
    with open(ws / "out" / "f3", "a") as f:
        f.write("through the old name\n")
    assert _capture(cap) == _disk_digest(ws)
    assert cap.full_walks == walks
    cap.close()
