"""WAL retention and compaction with the real writer (issue 16,
docs/storage.md): a purged session's records are removed from sealed
segments byte for byte around them, and no byte of it remains under
`.corral/`; compaction SIGKILLed at each step leaves the old segment or the
new one, never both or neither, and the writer recovers; retention removes
only segments wholly below the floor (generations, readers, the horizon)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.compaction import FAULT_ENV_GC_KILL_AT
from actors.writer.wal import list_segments, parse_record
from broker.statedir import StateDir
from supervisor.walverify import verify
from tests.processes import ProcessTracker, wait_for
from tests.storagekit import Ctx, grep_tree, purge, request_gc, run_gc, start_writer

pytestmark = pytest.mark.process

MARKER = "zq7marker"


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def fill(ctx: Ctx, sd: StateDir, count: int = 90, marker: str = MARKER, round_: int = 0
         ) -> dict[int, bytes]:
    """Interleave a kept stream and a to-be-purged one; return the kept lines by seq."""
    with WriterClient(ctx, sd, "keeper") as keep, WriterClient(ctx, sd, f"s-{marker}") as gone:
        for i in range(count):
            keep.append("agent/keep", "turn", {"i": i, "pad": "k" * 60}, key=f"k{round_}-{i}",
                        ledger="budget" if i % 10 == 0 else None)
            gone.append(f"session/{marker}", "turn", {"secret": marker, "i": i}, key=f"g{i}",
                        ledger="budget" if i % 10 == 0 else None)
    return kept_lines(sd)


def kept_lines(sd: StateDir) -> dict[int, bytes]:
    out = {}
    for _, path in list_segments(sd.wal_dir):
        for line in path.read_bytes().splitlines(keepends=True):
            record = parse_record(line)
            assert record is not None
            if record.stream == "agent/keep":
                out[record.seq] = line
    return out


def purged_range(sd: StateDir, marker: str = MARKER) -> tuple[int, int]:
    seqs = []
    for _, path in list_segments(sd.wal_dir):
        for line in path.read_bytes().splitlines(keepends=True):
            record = parse_record(line)
            assert record is not None
            if record.stream == f"session/{marker}":
                seqs.append(record.seq)
    return min(seqs), max(seqs)


def more_keep(ctx: Ctx, sd: StateDir, round_: int = 0) -> None:
    with WriterClient(ctx, sd, "keeper") as keep:
        for i in range(12):
            keep.append("agent/keep", "turn", {"i": i, "pad": "k" * 500}, key=f"m{round_}-{i}")


def check_kept(ctx: Ctx, sd: StateDir, before: dict[int, bytes]) -> None:
    """Every kept record is on disk byte for byte, and read back with its seq."""
    assert kept_lines(sd) == before
    with WriterClient(ctx, sd, "reader") as reader:
        assert [r.line for r in reader.read_stream("agent/keep")] == list(before.values())


def test_purged_session_is_compacted_away_and_nothing_of_it_remains(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    before = fill(ctx, state_dir)
    first, last = purged_range(state_dir)
    purge(state_dir, MARKER, f"session/{MARKER}", first, last)
    result = run_gc(state_dir)
    assert result["segments_compacted"] and not result["error"], result
    # the one pass sealed the active segment that held some of them: all gone
    assert grep_tree(state_dir, MARKER.encode()) == []
    assert verify(state_dir).compacted_missing == 90
    check_kept(ctx, state_dir, before)
    # appends go on in the new active segment; a later pass finds nothing to do
    more_keep(ctx, state_dir)
    before = kept_lines(state_dir)
    second = run_gc(state_dir)
    assert not second["error"] and not second["segments_compacted"], second
    report = verify(state_dir)
    assert report.sound, report
    assert report.compacted_missing == 90  # every record of the purged session
    assert grep_tree(state_dir, MARKER.encode()) == []  # no byte of it, index and ledger included
    check_kept(ctx, state_dir, before)
    # a restart (full scan: no checkpoint) reads the compacted WAL as sound
    os.killpg(writer.pid, 9)
    writer.wait(timeout=10)
    state_dir.checkpoint_path.unlink()
    start_writer(processes, state_dir, ctx, "writer2")
    check_kept(ctx, state_dir, before)
    with WriterClient(ctx, state_dir, "keeper") as keep:  # the next seq is the head's next
        assert keep.append("agent/keep", "turn", {}, key="after").seq == max(before) + 1


STEPS = ["written", "recorded", "swapped", "indexed"]


def test_compaction_killed_at_each_step_leaves_old_or_new_and_recovers(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """One session purged per step; the writer is SIGKILLed at that step of its
    compaction, restarted with the next step's fault, and so on."""
    writer = start_writer(processes, state_dir, ctx, "writer-0",
                          env={FAULT_ENV_GC_KILL_AT: STEPS[0]})
    for n, step in enumerate(STEPS):
        marker = f"{MARKER}{n}"
        before = fill(ctx, state_dir, 30, marker, n)
        more_keep(ctx, state_dir, n)  # so the purged records' segments are all sealed
        before = kept_lines(state_dir)
        names = sorted(p.name for _, p in list_segments(state_dir.wal_dir))
        first, last = purged_range(state_dir, marker)
        purge(state_dir, marker, f"session/{marker}", first, last)
        request_gc(state_dir)
        assert writer.wait(timeout=20) == -9, processes.output(f"writer-{n}")
        # every segment is there exactly once (old or new content), nothing else named like one
        assert sorted(p.name for _, p in list_segments(state_dir.wal_dir)) == names, step
        env = {FAULT_ENV_GC_KILL_AT: STEPS[n + 1]} if n + 1 < len(STEPS) else None
        writer = start_writer(processes, state_dir, ctx, f"writer-{n + 1}", env=env)
        assert not list(state_dir.wal_dir.glob(".*.compact")), step  # gone after a start
        check_kept(ctx, state_dir, before)
        assert verify(state_dir).sound, step
    result = run_gc(state_dir)  # the passes complete after the last restart
    assert not result["error"], result
    assert grep_tree(state_dir, MARKER.encode()) == []
    check_kept(ctx, state_dir, before)
    assert verify(state_dir).sound


def test_retention_keeps_what_sessions_need_and_survives_kills(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    extra = ("--gc-keep-records", "30", "--gc-disposable", "noise/*")
    writer = start_writer(processes, state_dir, ctx, "writer", *extra,
                          env={FAULT_ENV_GC_KILL_AT: "floor_recorded"})
    with WriterClient(ctx, state_dir, "a") as a, WriterClient(ctx, state_dir, "n") as n:
        for i in range(150):
            n.append("noise/x", "tick", {"i": i, "pad": "n" * 80}, key=f"n{i}")
            if i % 3 == 0:
                a.append("agent/a", "turn", {"i": i}, key=f"a{i}")
    with WriterClient(ctx, state_dir, "r") as reader:
        a_records = list(reader.read_stream("agent/a"))
    # agent a's oldest kept generation is at its 20th record: that is what it needs
    gen_seq = a_records[20].seq
    gens = state_dir.agent_dir("a") / "state" / "generations"
    gens.mkdir(parents=True)
    (gens / f"gen-{gen_seq:020d}.json").write_text("{}")
    segments_before = len(list_segments(state_dir.wal_dir))
    request_gc(state_dir)
    assert writer.wait(timeout=20) == -9  # killed after the floor was recorded
    writer = start_writer(processes, state_dir, ctx, "writer2", *extra)
    floor = json.loads((state_dir.state_dir / "wal.retention.json").read_text())["floor_seq"]
    assert 1 < floor <= gen_seq
    assert all(first >= floor for first, _ in list_segments(state_dir.wal_dir))
    assert len(list_segments(state_dir.wal_dir)) < segments_before
    with WriterClient(ctx, state_dir, "r") as reader:
        kept = list(reader.read_stream("agent/a"))
        assert [r.line for r in kept] == [r.line for r in a_records if r.seq >= floor]
        assert kept[0].seq <= gen_seq
    report = verify(state_dir)
    assert report.sound and report.floor_seq == floor, report
    # a second pass, the agent's generation moved on: more goes, the head stays
    (gens / f"gen-{gen_seq:020d}.json").unlink()
    (gens / f"gen-{a_records[-2].seq:020d}.json").write_text("{}")
    result = run_gc(state_dir)
    assert result["floor_seq"] > floor and not result["error"], result
    os.killpg(writer.pid, 9)
    writer.wait(timeout=10)
    state_dir.checkpoint_path.unlink()  # a full scan from the floor
    start_writer(processes, state_dir, ctx, "writer3", *extra)
    with WriterClient(ctx, state_dir, "a") as a:
        assert a.append("agent/a", "turn", {}, key="next").seq == a_records[-1].seq + 1 + (
            149 - 147)  # the noise appended after a's last record (i = 148, 149)
        assert [r.line for r in a.read_stream("agent/a", a_records[-2].seq)][:2] == [
            r.line for r in a_records[-2:]]
    assert verify(state_dir).sound
    wait_for(lambda: True, 1, "nothing")
