"""Collection of the trees store by reachability (actors/trees/collect.py):
objects only abandoned or truncated turns name are removed, objects of kept
turns survive and a rewind to a kept turn restores byte for byte after it; a
capture cut short (never named by a fact) is stored again by the next one;
an append made after the roots were read survives, and a capture waits for
the pass (the lease); a fully purged session's pack and cache go; SIGKILL at
each step of a repack leaves a readable store.

The agents run in-process over the in-memory writer (tests/agentkit.py);
their records are then written to a real WAL segment with the real encoder
(`dump_wal`), since the pass reads the WAL from disk as it does in a run."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.agent.loop import Step
from actors.trees import branch, collect, restore
from actors.trees import rewind as rewinding
from actors.trees.layout import capturer_for, store_for
from actors.trees.recorder import TreeRecorder
from actors.trees.store import LEASE_NAME, ObjectStore, digest_of, packs_dir, take_lease
from actors.writer import retention
from actors.writer.wal import encode_record, segment_name
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, tree, write_task
from tests.storagekit import purge
from tests.test_trees_rewind import STEPS, drive, events, start

REPO_ROOT = Path(__file__).resolve().parents[1]


def dump_wal(state_dir: StateDir, writer: FakeWriter, floor: int = 1) -> None:
    """The writer's records from `floor` up as one WAL segment (and the
    retention record saying the WAL starts there)."""
    state_dir.wal_dir.mkdir(parents=True, exist_ok=True)
    for old in state_dir.wal_dir.iterdir():
        old.unlink()
    kept = [r for r in writer.records if r.seq >= floor]
    (state_dir.wal_dir / segment_name(kept[0].seq)).write_bytes(b"".join(
        encode_record(r.seq, 1.0, r.stream, r.event, "test", r.key, r.ledger, r.body)
        for r in kept))
    retention.save(retention.path_in(state_dir.state_dir),
                   retention.RetentionState(floor_seq=floor))


def fresh(state_dir: StateDir) -> ObjectStore:
    return ObjectStore(packs_dir(state_dir.root))


def blob(text: str) -> str:
    return digest_of(text.encode())


def test_abandoned_turns_collected_kept_turns_survive_and_rewind_restores(
        state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", STEPS))
    ws = loop.workspace
    assert drive(loop) is Step.DONE
    at_one = {"a.txt": "one\n"}
    assert fresh(state_dir).has(blob("three\n")) and fresh(state_dir).has(blob("ONE\n"))
    # turns 3..6 abandoned: "ONE" (turn 3) and d/c.txt "three" (turn 5) only they name
    rewinding.rewind(writer, state_dir, "a1", to_turn=2)  # type: ignore[arg-type]
    assert tree(ws) == {"a.txt": "one\n", "d/b.txt": "two\n"}
    dump_wal(state_dir, writer)

    report = collect.collect(state_dir)
    assert not report.error and report.missing == 0
    assert report.objects_removed >= 2 and report.packs_rewritten == ["a1.pack"]
    store = fresh(state_dir)
    assert not store.has(blob("three\n")) and not store.has(blob("ONE\n"))
    assert store.has(blob("one\n")) and store.has(blob("two\n"))
    # a second pass finds nothing more
    again = collect.collect(state_dir)
    assert again.objects_removed == 0 and again.packs_rewritten == []

    # a rewind to a kept turn restores byte for byte from the repacked store
    rewinding.rewind(writer, state_dir, "a1", to_turn=1)  # type: ignore[arg-type]
    assert tree(ws) == at_one
    # and the session goes on: it runs its turns again, capturing into the new pack
    loop = start(state_dir, writer, "a1")
    assert drive(loop) is Step.DONE
    assert tree(ws)["d/c.txt"] == "three\n"
    dump_wal(state_dir, writer)
    collect.collect(state_dir)
    target = branch.tree_at(events(writer, "a1"), events(writer, "a1")[-1][0])
    assert target is not None
    out = tmp_path / "out"
    out.mkdir()
    restore.restore(out, fresh(state_dir), None, target)
    assert tree(out) == tree(ws)


def test_old_turns_below_the_floor_collected_kept_generation_survives(
        state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", STEPS))
    assert drive(loop) is Step.DONE
    facts = [e for e in events(writer, "a1") if e[1] == "workspace_tree"]
    assert len(facts) >= 4
    # retention took every record before turn 3's tree: "one" (turns 1-2) is named by none
    floor = next(seq for seq, _, p in facts if p["turn"] >= 3)
    dump_wal(state_dir, writer, floor=floor)
    report = collect.collect(state_dir)
    assert report.objects_removed >= 1 and report.missing == 0
    store = fresh(state_dir)
    assert not store.has(blob("one\n"))
    final = facts[-1][2]["tree"]
    out = tmp_path / "out"
    out.mkdir()
    restore.restore(out, store, None, final)
    assert tree(out) == tree(loop.workspace)
    # with the full WAL, every turn's tree is a root again: nothing more is lost
    dump_wal(state_dir, writer)
    assert collect.collect(state_dir).objects_removed == 0


def test_a_capture_never_named_by_a_fact_is_stored_again(state_dir: StateDir,
                                                         tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "x.txt").write_text("cached only\n")
    capturer = capturer_for(state_dir, "a1", ws)
    first = capturer.capture().digest  # stored and cached, but no fact names it (a crash)
    (ws / "y.txt").write_text("new\n")
    dump_wal(state_dir, _writer_with_tree("a2", _tree_of_text(state_dir, "other\n")))
    collect.collect(state_dir)
    assert not fresh(state_dir).has(first)
    # the same capturer's cache still names d/'s tree and x.txt: it must not trust them
    second = capturer.capture().digest
    out = tmp_path / "out"
    out.mkdir()
    restore.restore(out, fresh(state_dir), None, second)
    assert tree(out) == {"d/x.txt": "cached only\n", "y.txt": "new\n"}


def _tree_of_text(state_dir: StateDir, text: str) -> str:
    from actors.trees import tree as trees

    body = trees.encode({"f": trees.Entry(0o100644, blob(text), len(text))})
    store_for(state_dir, "a2").put_many([(blob(text), text.encode()), (digest_of(body), body)])
    return digest_of(body)


def _writer_with_tree(name: str, digest: str) -> FakeWriter:
    writer = FakeWriter()
    writer.append(f"agent/{name}", "session_start", {}, key="s1:start")
    writer.append(f"agent/{name}", "workspace_tree", {"turn": 0, "tree": digest}, key="w1:tree")
    return writer


def test_appends_after_the_roots_were_read_survive_and_captures_wait(
        state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", STEPS))
    assert drive(loop) is Step.DONE
    rewinding.rewind(writer, state_dir, "a1", to_turn=2)  # type: ignore[arg-type]
    dump_wal(state_dir, writer)
    late = b"appended after the roots were read\n"
    (loop.workspace / "during.txt").write_text("captured during the pass\n")
    recorder = TreeRecorder(state_dir, "a1", loop.workspace)
    recorder._capturer = capturer_for(state_dir, "a1", loop.workspace)  # indexed before the pass
    state = loop.state
    captured: dict[str, str] = {}

    def capture_and_record() -> None:  # the agent's turn boundary (loop._record_tree)
        with recorder.lease():
            fact = recorder.fact(state)
            assert fact is not None
            writer.append("agent/a1", *fact[:2], key=fact[2])
            captured["tree"] = fact[1]["tree"]

    thread = threading.Thread(target=capture_and_record)

    def hook(step: str) -> None:
        assert step == "roots_read"
        # a writer appending without the lease, to a pack the pass is about to repack
        ObjectStore(packs_dir(state_dir.root), "a1").put_many([(digest_of(late), late)])
        # the pass holds the lease: a capture cannot start storing until it ends
        fd = os.open(packs_dir(state_dir.root).parent / LEASE_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        thread.start()

    report = collect.collect(state_dir, hook=hook)
    thread.join(timeout=30)
    assert not thread.is_alive() and "tree" in captured
    assert report.objects_removed >= 2 and report.objects_appended_during >= 1
    store = fresh(state_dir)
    assert store.get(digest_of(late)) == late
    out = tmp_path / "out"
    out.mkdir()
    restore.restore(out, store, None, captured["tree"])
    assert tree(out) == tree(loop.workspace)
    dump_wal(state_dir, writer)  # the capture's fact is a root from now on
    assert collect.collect(state_dir).objects_removed == 1  # only `late`: no fact names it
    assert fresh(state_dir).get(captured["tree"])


def test_a_fully_purged_sessions_pack_and_cache_are_removed(state_dir: StateDir,
                                                           tmp_path: Path) -> None:
    writer = FakeWriter()
    only_gone = [{"op": "write_file", "path": "g.txt", "content": "gone only\n"},
                 {"op": "finish", "summary": "done"}]
    for name, steps in (("keep", STEPS), ("gone", only_gone)):
        loop = start(state_dir, writer, name, write_task(tmp_path / f"{name}.yaml", steps))
        assert drive(loop) is Step.DONE
    gone = [r.seq for r in writer.records if r.stream == "agent/gone"]
    purge(state_dir, "s-gone", "agent/gone", min(gone), max(gone))
    dump_wal(state_dir, writer)
    cache = state_dir.cache_dir / "trees" / "gone.jsonl"
    assert cache.exists()
    dry = collect.collect(state_dir, dry_run=True)
    assert dry.packs_removed == ["gone.pack"] and (packs_dir(state_dir.root) / "gone.pack").exists()
    assert collect.pack_usage(state_dir)[0] == 2
    report = cli(state_dir, "gc")["trees"]
    assert isinstance(report, dict)
    assert report["packs_removed"] == ["gone.pack"] and report["caches_removed"] == ["gone.jsonl"]
    assert not (packs_dir(state_dir.root) / "gone.pack").exists() and not cache.exists()
    assert cli(state_dir, "du")["tree_packs"] == 1
    keep = [e for e in events(writer, "keep") if e[1] == "workspace_tree"][-1][2]["tree"]
    out = tmp_path / "out"
    out.mkdir()
    restore.restore(out, fresh(state_dir), None, keep)
    assert tree(out) == tree(state_dir.agent_dir("keep") / "workspace")


def cli(state_dir: StateDir, *args: str) -> dict[str, object]:
    import json

    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args, "--state-dir", str(state_dir.root),
         "--json"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    data: dict[str, object] = json.loads(done.stdout)
    return data


@pytest.mark.parametrize("step", ["written", "renamed", "synced", "removed"])
def test_sigkill_at_each_step_of_a_repack_leaves_a_readable_store(
        state_dir: StateDir, tmp_path: Path, step: str) -> None:
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "a.txt").write_text("kept a\n")
    (ws / "d" / "b.txt").write_text("kept b\n")
    kept = capturer_for(state_dir, "a1", ws).capture().digest
    garbage = [(digest_of(b"garbage %d\n" % i), b"garbage %d\n" % i) for i in range(5)]
    store_for(state_dir, "a1").put_many(garbage[:3])  # a1.pack: rewritten
    store_for(state_dir, "old").put_many(garbage[3:])  # old.pack: removed
    writer = FakeWriter()
    writer.append("agent/a1", "workspace_tree", {"turn": 0, "tree": kept}, key="w0:tree")
    dump_wal(state_dir, writer)
    expected = tree(ws)

    code = ("import sys; from actors.trees.collect import collect; "
            "from broker.statedir import StateDir; collect(StateDir.at(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, str(state_dir.root)], cwd=REPO_ROOT,
                          env={**os.environ, collect.FAULT_ENV: step}, timeout=60, check=False,
                          capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr

    def readable() -> None:
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        restore.restore(out, fresh(state_dir), None, kept)
        assert tree(out) == expected

    readable()  # old pack or new one: the kept tree is whole
    report = collect.collect(state_dir)  # the next pass finishes the job
    assert report.temp_files_removed == (1 if step == "written" else 0)
    readable()
    names = sorted(os.listdir(packs_dir(state_dir.root)))
    assert names == ["a1.pack"]
    store = fresh(state_dir)
    assert not any(store.has(d) for d, _ in garbage)
    assert collect.collect(state_dir).objects_removed == 0


def test_forged_roots_are_counted_never_fatal(state_dir: StateDir, tmp_path: Path) -> None:
    good = _tree_of_text(state_dir, "kept\n")
    forged = b'{"version": 1, "entries": [["../x", 33188, "' + b"0" * 64 + b'", 1]]}'
    not_a_tree = b"plain bytes, not a tree\n"
    store_for(state_dir, "a2").put_many([(digest_of(forged), forged),
                                         (digest_of(not_a_tree), not_a_tree)])
    writer = _writer_with_tree("a2", good)
    for i, digest in enumerate([digest_of(forged), digest_of(not_a_tree), "f" * 64, "short"]):
        writer.append("agent/a2", "workspace_tree", {"turn": i + 1, "tree": digest},
                      key=f"x{i}:tree")
    writer.append("agent/a2", "rewind", {"to_seq": "nonsense"}, key="r:1")
    dump_wal(state_dir, writer)
    (state_dir.agent_dir("a2")).mkdir(parents=True, exist_ok=True)
    (state_dir.agent_dir("a2") / "rewind.json").write_bytes(b"[not, an intent")
    report = collect.collect(state_dir)
    assert not report.error and report.missing == 3  # the forged tree, the blob, the absent one
    store = fresh(state_dir)
    assert store.get(good) and store.get(digest_of(not_a_tree)) == not_a_tree


def test_the_runtimes_janitor_collects_the_store_over_max_bytes(state_dir: StateDir,
                                                                tmp_path: Path) -> None:
    from supervisor.storage import Janitor, StorageConfig
    from tests.processes import wait_for

    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", STEPS))
    assert drive(loop) is Step.DONE
    rewinding.rewind(writer, state_dir, "a1", to_turn=2)  # type: ignore[arg-type]
    dump_wal(state_dir, writer)
    assert fresh(state_dir).has(blob("three\n"))
    janitor = Janitor(state_dir, StorageConfig(max_bytes=1, interval_s=0.05))
    janitor.start()
    try:
        wait_for(lambda: janitor.passes >= 1, 20, "a janitor pass")
    finally:
        janitor.stop()
    assert not fresh(state_dir).has(blob("three\n")) and fresh(state_dir).has(blob("two\n"))


def _lease_free(state_dir: StateDir) -> bool:
    """Whether a collection pass could take the lease now (exclusively): no
    lease file yet (no capture has run) is a free lease."""
    try:
        fd = os.open(packs_dir(state_dir.root).parent / LEASE_NAME, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_the_lease_is_held_until_the_flush_makes_the_tree_fact_durable(
        state_dir: StateDir, tmp_path: Path) -> None:
    """The loop appends `workspace_tree` pending (durable at its next flush)
    and a pass reads its roots from the WAL on disk: so the capture's lease
    must outlast the append until the flush, or a pass in between would
    collect the objects of a tree the WAL is about to name."""
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", STEPS))
    seen_pending_tree = False
    for _ in range(200):
        before = len(writer.records)
        result = loop.step()
        pending_tree = any(event == "workspace_tree" for event, *_ in loop.journal.pending)
        if pending_tree:
            seen_pending_tree = True
            assert not _lease_free(state_dir), "a pass could run before the tree is durable"
        if len(writer.records) > before and not loop.journal.pending:
            assert _lease_free(state_dir)  # flushed: passes run again
        if result is not Step.PROGRESS:
            break
    assert result is Step.DONE and seen_pending_tree
    named = {r.payload()["tree"] for r in writer.records if r.event == "workspace_tree"}
    store = fresh(state_dir)
    for digest in named:
        assert store.get(digest)


def test_a_tree_fact_goes_to_the_writer_only_after_its_objects_are_synced(
        state_dir: StateDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack's fdatasync runs on the recorder's thread while the turn goes
    on; the flush that carries `workspace_tree` waits for it first."""
    from actors.trees import recorder as recording

    synced: list[int] = []
    real_sync = recording.sync_fds

    def counted(fds: list[int]) -> None:
        real_sync(fds)
        synced.append(len(fds))

    monkeypatch.setattr(recording, "sync_fds", counted)
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", STEPS))
    real_append_many = loop.writer.append_many
    trees_sent = 0

    def checked(stream: str, records: list[tuple[str, bytes, str, str | None]]) -> object:
        nonlocal trees_sent
        if any(event == "workspace_tree" for event, *_ in records):
            trees_sent += 1
            assert not loop.trees._syncs, "a tree's objects were not synced before its fact"
            assert synced, "no sync ran for the objects of the tree"
        return real_append_many(stream, records)

    monkeypatch.setattr(loop.writer, "append_many", checked)
    assert drive(loop) is Step.DONE
    assert trees_sent >= 3


def test_the_recorders_lease_is_held_from_hold_to_released_on_the_lock_file_in_place(
        state_dir: StateDir, tmp_path: Path) -> None:
    """The recorder keeps the lock file open from turn to turn and locks it
    at `hold()`, unlocks it at `released()`; when the file was removed and
    made again (a collection opens it by name), the next hold locks the file
    in place, not the one it still has open."""
    recorder = TreeRecorder(state_dir, "a1", tmp_path / "ws")
    lock = packs_dir(state_dir.root).parent / LEASE_NAME

    def a_collection_could_run() -> bool:
        return _lease_free(state_dir)

    for _ in range(3):
        recorder.hold()
        recorder.hold()  # held already: no second lock to undo
        assert not a_collection_could_run()
        recorder.released()
        assert a_collection_could_run()
    lock.unlink()
    os.close(take_lease(packs_dir(state_dir.root), exclusive=True))  # makes it anew
    recorder.hold()
    assert not a_collection_could_run()
    recorder.released()
    assert a_collection_could_run()
