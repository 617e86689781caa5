"""The budget ledger follows the WAL's floor (issue 16, docs/storage.md "The
budget ledger"): a retention pass rewrites `state/budget_ledger.jsonl`
without its lines below the new floor, atomically and durably, so it stays
the exact projection of the WAL and does not grow with the work done. The
writer SIGKILLed after the pass (a start from its checkpoint, and a full
scan) and between the segments' removal and the trim (the `removed` fault
point): every start is clean (no ledger line cut), `wal verify` is sound,
and the next pass trims what the killed one left. Fails before the change:
the ledger kept every line."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.compaction import FAULT_ENV_GC_KILL_AT
from actors.writer.wal import list_segments, parse_record
from broker.statedir import StateDir
from supervisor.walverify import verify
from tests.processes import ProcessTracker
from tests.storagekit import Ctx, request_gc, run_gc, start_writer

pytestmark = pytest.mark.process
EXTRA = ("--gc-keep-records", "10", "--gc-disposable", "work/*")


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def work(ctx: Ctx, sd: StateDir, start: int, count: int) -> None:
    """Records as an agent's steps make them: every third a budget line."""
    with WriterClient(ctx, sd, "w") as client:
        for i in range(start, start + count):
            client.append("work/x", "turn", {"i": i, "pad": "p" * 120}, key=f"w{i}",
                          ledger="budget" if i % 3 == 0 else None)


def ledger_seqs(sd: StateDir) -> list[int]:
    seqs = []
    for line in sd.budget_ledger_path.read_bytes().splitlines(keepends=True):
        record = parse_record(line)
        assert record is not None and record.ledger == "budget", line
        seqs.append(record.seq)
    return seqs


def wal_budget_seqs(sd: StateDir) -> list[int]:
    seqs = []
    for _, path in list_segments(sd.wal_dir):
        for line in path.read_bytes().splitlines(keepends=True):
            record = parse_record(line)
            if record is not None and record.ledger == "budget":
                seqs.append(record.seq)
    return seqs


def floor_seq(sd: StateDir) -> int:
    return int(json.loads((sd.state_dir / "wal.retention.json").read_text())["floor_seq"])


def clean_start(sd: StateDir) -> None:
    """No start so far cut or completed a ledger (the writer's log says so)."""
    log = sd.log_path("writer").read_text()
    assert "wal_recovered" in log
    for event in ("ledger_repaired", "ledger_cut_to_wal", "ledger_completed_from_wal"):
        assert event not in log, log[-3000:]


def test_budget_ledger_is_trimmed_to_the_floor_and_survives_kills(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    writer = start_writer(processes, state_dir, ctx, "writer", *EXTRA)
    work(ctx, state_dir, 0, 120)
    assert ledger_seqs(state_dir) == wal_budget_seqs(state_dir)
    before = len(ledger_seqs(state_dir))
    result = run_gc(state_dir)
    assert not result["error"] and result["segments_removed"], result
    floor = floor_seq(state_dir)
    assert ledger_seqs(state_dir)[0] >= floor  # nothing below the floor is kept ...
    assert ledger_seqs(state_dir) == wal_budget_seqs(state_dir)  # ... and all above it
    assert len(ledger_seqs(state_dir)) < before
    assert verify(state_dir).sound

    # appends after the trim go to the new file; a kill and a start from the checkpoint
    work(ctx, state_dir, 120, 30)
    writer.kill()
    writer.wait(timeout=10)
    writer = start_writer(processes, state_dir, ctx, "writer2", *EXTRA)
    clean_start(state_dir)
    assert ledger_seqs(state_dir) == wal_budget_seqs(state_dir)
    assert verify(state_dir).sound

    # killed after the segments went and before the ledger was trimmed
    writer.kill()
    writer.wait(timeout=10)
    writer = start_writer(processes, state_dir, ctx, "writer3", *EXTRA,
                          env={FAULT_ENV_GC_KILL_AT: "removed"})
    work(ctx, state_dir, 150, 60)
    request_gc(state_dir)
    assert writer.wait(timeout=20) == -9
    assert floor_seq(state_dir) > floor
    assert ledger_seqs(state_dir)[0] < floor_seq(state_dir)  # the kill left old lines
    state_dir.checkpoint_path.unlink()  # and a full scan from the floor this time
    start_writer(processes, state_dir, ctx, "writer4", *EXTRA)
    clean_start(state_dir)
    assert verify(state_dir).sound  # lines below the floor are allowed, not a problem
    work(ctx, state_dir, 210, 60)
    result = run_gc(state_dir)
    assert not result["error"], result
    assert ledger_seqs(state_dir)[0] >= floor_seq(state_dir)
    assert ledger_seqs(state_dir) == wal_budget_seqs(state_dir)
    assert verify(state_dir).sound
