"""Watched captures (actors/trees/watch.py, actors/trees/capture.py): after a
full walk, a capture lstats only what inotify reported, and must still give
the digest a capture from scratch gives after any change; what the events
cannot describe (a directory created or renamed, an overflowed queue, a
refused watch) makes it walk in full; a file with another link is looked at
every time; what no event reports (a write through a shared mapping after
close) is seen at the next full walk (`unsure()`, `full_every_s`); the
slots bound a runtime's inotify instances."""

from __future__ import annotations

import mmap
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.agent.loop import Step
from actors.trees import restore, tree
from actors.trees.capture import Capturer
from actors.trees.statcache import StatCache, fs_now_ns
from actors.trees.store import ObjectStore
from actors.trees.watch import WorkspaceWatch, take_slot
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, write_task
from tests.test_trees_incremental import _fresh_digest, _mutate
from tests.test_trees_rewind import drive, start


def _watched(tmp: Path, ws: Path, watch: WorkspaceWatch | None = None,
             full_every_s: float = 3600.0) -> Capturer:
    watch = watch if watch is not None else WorkspaceWatch.open()
    assert watch is not None, "this host refused an inotify instance"
    return Capturer(ws, ObjectStore(tmp / "state" / "packs"),
                    StatCache.load(tmp / "state" / "c.jsonl"), stamp_dir=tmp / "state",
                    watch=watch, full_every_s=full_every_s)


def _workspace(tmp: Path, files: int = 30) -> Path:
    ws = tmp / "ws"
    (ws / "out").mkdir(parents=True)
    (ws / "sub" / "deep").mkdir(parents=True)
    for i in range(files):
        (ws / "out" / f"base{i}").write_text(f"base {i}\n")
    (ws / "sub" / "deep" / "d").write_text("deep\n")
    return ws


def test_a_watched_capture_equals_a_capture_from_scratch_after_any_change(
        tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    cap = _watched(tmp_path, ws)
    rng = random.Random(23)
    cap.capture()
    incremental = 0
    for step in range(80):
        for k in range(rng.randint(1, 3)):
            _mutate(rng, ws, step * 10 + k)
        walks = cap.full_walks
        got = cap.capture()
        incremental += cap.full_walks == walks
        assert got.digest == _fresh_digest(tmp_path, ws, step), step
        tree.flatten(cap.store.get, got.digest)  # every object named is stored
        loaded = StatCache.load(tmp_path / "state" / "c.jsonl")
        for rel, d in cap.cache.dirs.items():  # the journal replays to the cache
            assert (loaded.dirs[rel].digest, loaded.dirs[rel].files) == (d.digest, d.files), rel
    # the mutations that create, remove or rename directories walk; the others do not
    assert incremental >= 30, incremental
    cap.close()


def test_file_changes_are_read_from_the_events_alone(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, files=200)
    cap = _watched(tmp_path, ws)
    cap.capture()
    assert cap.full_walks == 1
    victim = ws / "out" / "base7"
    changes: list[Callable[[], object]] = [
        lambda: (ws / "out" / "new").write_text("new\n"),
        lambda: victim.write_text("base 8\n"),  # same size, likely the same tick
        lambda: victim.chmod(0o755),
        lambda: (ws / "sub" / "deep" / "d").write_text("deeper\n"),
        lambda: (ws / "out" / "new").rename(ws / "out" / "renamed"),
        lambda: (ws / "out" / "link").symlink_to("base1"),
        (ws / "out" / "base3").unlink,
    ]
    for n, change in enumerate(changes):
        change()
        got = cap.capture()
        assert got.digest == _fresh_digest(tmp_path, ws, n), n
        # nothing read but the changed file and one written in the last capture's tick
        assert got.hashed <= 2, (n, got.hashed)
    assert cap.full_walks == 1
    (ws / "out" / "newdir").mkdir()  # the watched directories change: a full walk
    (ws / "out" / "newdir" / "x").write_text("x\n")
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 99)
    assert cap.full_walks == 2
    (ws / "out" / "newdir" / "x").write_text("y\n")  # watched since that walk
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 100)
    assert cap.full_walks == 2
    cap.close()


def test_a_file_with_a_link_outside_the_workspace_is_looked_at_every_time(
        tmp_path: Path) -> None:
    """A write through another link raises no event in the workspace's
    directory: a file with more than one link is lstat'ed at every capture."""
    ws = _workspace(tmp_path)
    outside = tmp_path / "outside"
    os.link(ws / "out" / "base1", outside)
    cap = _watched(tmp_path, ws)
    cap.capture()
    with open(outside, "a") as f:
        f.write("through the other link\n")
    got = cap.capture()
    assert got.digest == _fresh_digest(tmp_path, ws, 0)
    assert cap.full_walks == 1


def _write_through(mapped: mmap.mmap, target: Path, clock: Path, byte: bytes) -> None:
    """Write one byte through the mapping once the filesystem's clock has
    passed the file's mtime (the write fault then moves it: a stat sees the
    change), and write it back (the next write faults again)."""
    deadline = time.monotonic() + 10
    while fs_now_ns(clock) <= target.stat().st_mtime_ns:
        assert time.monotonic() < deadline, "the filesystem's clock did not move"
        time.sleep(0.001)  # the clock's tick, not a peer, is awaited
    mapped[0:1] = byte
    mapped.flush()


def test_a_write_no_event_reports_is_seen_at_the_next_full_walk(tmp_path: Path) -> None:
    """inotify(7): modifications through mmap(2) are not reported; the
    mapping holds the file open, so its IN_CLOSE_WRITE comes at munmap. A
    write through a mapping still in place is seen when the caller says it
    is unsure (a command ran) or once `full_every_s` has passed since the
    last full walk; its unmapping is an event."""
    ws = _workspace(tmp_path)
    clock = tmp_path / "clock"
    target = ws / "out" / "base2"
    cap = _watched(tmp_path, ws)
    before = cap.capture().digest
    fd = os.open(target, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    try:
        _write_through(mapped, target, clock, b"B")
        assert cap.capture().digest == before  # no event: the watched capture cannot know
        cap.unsure()
        seen = cap.capture().digest
        assert seen == _fresh_digest(tmp_path, ws, 1) != before
        assert cap.full_walks == 2
        _write_through(mapped, target, clock, b"C")
        assert cap.capture().digest == seen
        cap.full_every_s = 0.0  # the bound passed
        assert cap.capture().digest == _fresh_digest(tmp_path, ws, 2) != seen
        assert cap.full_walks == 3
        cap.full_every_s = 3600.0
        _write_through(mapped, target, clock, b"D")
    finally:
        mapped.close()  # the last reference to the file: IN_CLOSE_WRITE
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 3)
    assert cap.full_walks == 3  # the unmapping's event, read by a watched capture
    cap.close()


def test_an_overflowed_queue_makes_the_capture_walk(tmp_path: Path) -> None:
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 200_000:
        pytest.skip(f"max_queued_events is {limit}: too many events to overflow it here")
    ws = _workspace(tmp_path)
    cap = _watched(tmp_path, ws)
    cap.capture()
    a, b = ws / "out" / "base1", ws / "out" / "base2"
    for i in range(limit // 2 + 10):  # alternating: the kernel merges only repeats
        os.utime(a, ns=(i, i))
        os.utime(b, ns=(i, i))
    (ws / "out" / "base3").write_text("after the overflow\n")
    got = cap.capture()
    assert cap.full_walks == 2
    assert got.digest == _fresh_digest(tmp_path, ws, 0)


class _RefusingWatch(WorkspaceWatch):
    """A host whose watch limit is reached (an injected fault)."""

    def watch(self, dir_fd: int, rel: str) -> bool:
        return rel == ""  # the root is watched, its subdirectories refused


def test_a_refused_watch_makes_every_capture_walk(tmp_path: Path) -> None:
    from inotify_simple import INotify

    ws = _workspace(tmp_path)
    cap = _watched(tmp_path, ws, watch=_RefusingWatch(INotify(nonblocking=True,
                                                                closefd=False)))
    cap.capture()
    assert cap.watch is None  # given up: walked as without a watch
    (ws / "out" / "new").write_text("new\n")
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 0)
    assert cap.full_walks == 2


def test_slots_bound_a_runtimes_instances_and_free_with_their_holder(tmp_path: Path) -> None:
    slots = tmp_path / "watch-slots"
    held = [take_slot(slots, 2), take_slot(slots, 2)]
    assert None not in held
    assert take_slot(slots, 2) is None  # both taken
    os.close(held[0])  # type: ignore[arg-type]  # its holder ended
    again = take_slot(slots, 2)
    assert again is not None
    for fd in (again, held[1]):
        os.close(fd)  # type: ignore[arg-type]
    (slots / "0.lock").unlink()
    (slots / "0.lock").symlink_to(tmp_path / "elsewhere")  # never followed
    fd = take_slot(slots, 1)
    assert fd is None
    assert not (tmp_path / "elsewhere").exists()


def test_the_agents_captures_are_watched_and_walk_after_a_command(
        state_dir: StateDir, tmp_path: Path) -> None:
    """The loop's boundaries: file ops are read from the events; after an op
    that may change the workspace unseen (here `bash`: whatever it did), the
    next capture walks in full."""
    steps: list[Any] = [
        {"op": "write_file", "path": "a.txt", "content": "one\n"},
        {"op": "write_file", "path": "d/b.txt", "content": "two\n"},
        {"op": "edit_file", "path": "a.txt", "old": "one", "new": "ONE"},
        {"op": "bash", "command": "true"},
        {"op": "write_file", "path": "d/c.txt", "content": "three\n"},
        {"op": "finish", "summary": "done"},
    ]
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", steps))
    walks: list[tuple[str, int]] = []
    record = loop._record_tree

    def recorded() -> bool:
        done = record()
        capturer = loop.trees._capturer
        assert capturer is not None and capturer.watch is not None
        walks.append((loop.state.last_op or "", capturer.full_walks))
        return done

    loop._record_tree = recorded  # type: ignore[method-assign]
    assert drive(loop) is Step.DONE
    last = {op: n for op, n in walks}  # each op's last boundary: full walks so far
    first = {op: n for op, n in reversed(walks)}
    assert first["write_file"] == 1  # a.txt: a file event, read from the queue
    assert last["edit_file"] == 2  # d/ made by the second write: one walk
    assert last["bash"] == 3  # the command: one more
    assert last["write_file"] == last["finish"] == 3  # d/c.txt: from the queue again
    fresh = _fresh_digest(tmp_path, loop.workspace, 0)
    assert loop.state.tree == fresh


def test_only_local_ops_are_taken_as_writing_through_the_runtime() -> None:
    """The loop trusts an op to change the workspace only by the runtime's own
    writes (an event each) when it is served in the agent's process
    (`is_local`); a procs, MCP or subagents op runs code the watch may not
    see, and the next capture walks."""
    from actors.agent import catalog
    from actors.kernel.ops import is_local

    catalog.install()
    local = {op for op in catalog.op_names() if is_local(op)}
    assert local >= {"write_file", "edit_file"}
    for op in ("bash", "bash_start", "terminal_input", "mcp_call", "apply_subagent",
               "pipeline_run"):
        assert op not in local


def test_hostile_names_are_read_from_the_events_as_the_walk_reads_them(
        tmp_path: Path) -> None:
    """Names that are not UTF-8, hold a newline or a backslash, start with a
    dash or take the whole 255 bytes: an event's name goes back to the
    kernel as the walk's does (fsdecode / fsencode), and the tree records
    it (a name that is not UTF-8 made every capture raise before: any
    command could stop its agent's captures with one `touch`)."""
    ws = _workspace(tmp_path)
    cap = _watched(tmp_path, ws)
    cap.capture()
    out = os.fsencode(ws / "out")
    for n, name in enumerate([b"\xff\xfe-not-utf8", b"line\nbreak", b"-rf", b"back\\slash",
                              b"x" * 255]):
        with open(os.path.join(out, name), "wb") as f:
            f.write(b"hostile %d\n" % n)
        assert cap.capture().digest == _fresh_digest(tmp_path, ws, n), name
    recorded = tree.flatten(cap.store.get, cap.capture().digest)
    assert "out/" + os.fsdecode(b"\xff\xfe-not-utf8") in recorded  # byte for byte, back
    hostile = os.path.join(out, b"\xff\xfe-not-utf8")
    before = cap.capture().digest
    with open(hostile, "wb") as f:
        f.write(b"changed\n")
    after = cap.capture().digest
    restore.restore(ws, cap.store, after, before)  # a rewind puts it back by its own name
    with open(hostile, "rb") as f:
        assert f.read() == b"hostile 0\n"
    os.unlink(os.path.join(out, b"\xff\xfe-not-utf8"))
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 10)
    assert cap.full_walks == 1  # all of it from the queue
    cap.close()


class _FailingWatch(WorkspaceWatch):
    """A walk that fails in the middle (an injected fault at one directory)."""

    fail_at: str | None = None

    def watch(self, dir_fd: int, rel: str) -> bool:
        if rel == self.fail_at:
            raise RuntimeError(f"injected at {rel!r}")
        return super().watch(dir_fd, rel)


def test_a_walk_that_failed_is_followed_by_a_full_walk(tmp_path: Path) -> None:
    from inotify_simple import INotify

    ws = _workspace(tmp_path)
    watch = _FailingWatch(INotify(nonblocking=True, closefd=False))
    cap = _watched(tmp_path, ws, watch=watch)
    cap.capture()
    cap.unsure()
    watch.fail_at = "sub/deep/"
    with pytest.raises(RuntimeError):
        cap.capture()
    watch.fail_at = None
    (ws / "sub" / "deep" / "d").write_text("after the failed walk\n")
    (ws / "out" / "base4").write_text("and here\n")
    walks = cap.full_walks
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 0)
    assert cap.full_walks == walks + 1  # not trusted: walked again
    (ws / "out" / "base5").write_text("watched again\n")
    assert cap.capture().digest == _fresh_digest(tmp_path, ws, 1)
    assert cap.full_walks == walks + 1
    cap.close()
