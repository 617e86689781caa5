"""The WAL floor of procs' streams (issue 16; actors/writer/procsfloor.py,
docs/storage.md): a `procs/<session>` stream holds the floor only at the
start fact of its oldest job still running, so the floor moves past an old
command's records while the session keeps running commands; and procs,
SIGKILLed and restarted after such a pass, re-attaches its running command,
answers for the ended ones from their files and runs new ones.

Real writer (4 KiB segments, a rewind horizon of 5 records), broker and
procs. Fails on the rule before (a procs stream kept whole): the first pass
leaves the floor at the session's first record."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from actors.writer import retention
from actors.writer.wal import list_segments
from broker.statedir import StateDir
from supervisor.walverify import verify
from tests.processes import ProcessTracker, wait_for
from tests.storagekit import run_gc, start_writer
from tests.test_procs import SESSION, Stack, procs_stack, read_all

pytestmark = pytest.mark.process


@pytest.fixture
def stack(processes: ProcessTracker, state_dir: StateDir) -> Iterator[Stack]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    start_writer(processes, state_dir, ctx, "writer", "--gc-keep-records", "5")
    yield from procs_stack(processes, state_dir, ctx)


def run_commands(stack: Stack, count: int, tag: str) -> list[str]:
    """Short commands, each started and read to its end (facts on the stream)."""
    ids = []
    for i in range(count):
        status = stack.client.start(f"echo {tag}-{i}", str(stack.workdir))
        assert status.proc_id is not None
        data, last = read_all(stack.client, status.proc_id)
        assert data == f"{tag}-{i}\n".encode() and last.exit_code == 0
        ids.append(status.proc_id)
    return ids


def start_seq(stack: Stack, proc_id: str) -> int:
    seqs = [r.seq for r in stack.writer.read_stream(f"procs/{SESSION}", 1)
            if r.event == "proc_start" and r.payload()["proc_id"] == proc_id]  # type: ignore[index]
    assert len(seqs) == 1, seqs
    return seqs[0]


def ended(stack: Stack, proc_id: str) -> bool:
    return any(f["proc_id"] == proc_id for f in stack.facts("proc_exit"))


def test_floor_passes_old_procs_records_and_procs_recovers_after_gc(stack: Stack) -> None:
    gates = [stack.workdir / "gate", stack.workdir / "gate2"]
    try:
        check_floor_and_recovery(stack, *gates)
    finally:  # a failed check leaves no command waiting
        for gate in gates:
            gate.touch()


def check_floor_and_recovery(stack: Stack, gate: Path, gate2: Path) -> None:
    work = str(stack.workdir)
    first = run_commands(stack, 1, "old")[0]
    seq_first = start_seq(stack, first)
    run_commands(stack, 8, "fill")
    # a command that runs until the test lets it end: its start must stay
    long = stack.client.start(f"echo begun; while [ ! -e {gate} ]; do sleep 0.02; done; "
                              "echo finished", work).proc_id
    assert long is not None
    seq_long = start_seq(stack, long)
    run_commands(stack, 8, "more")

    result = run_gc(stack.state)
    assert not result["error"], result
    floor = int(result["floor_seq"])  # type: ignore[call-overload]
    # past the session's old records (the old rule: at its first record, seq_first) ...
    assert seq_first < floor <= seq_long, (seq_first, floor, seq_long)
    # ... but not past the start of its running command
    kept = list(stack.writer.read_stream(f"procs/{SESSION}", 1))
    assert kept[0].seq >= floor
    assert any(r.seq == seq_long and r.event == "proc_start" for r in kept)
    assert verify(stack.state).sound

    # it ends: nothing of the session holds the floor any more
    gate.touch()
    wait_for(lambda: ended(stack, long), 20, "the long command's proc_exit")
    run_commands(stack, 8, "after")
    result = run_gc(stack.state)
    assert not result["error"], result
    assert int(result["floor_seq"]) > seq_long, (result, seq_long)  # type: ignore[call-overload]

    # procs SIGKILLed with a command running, a pass meanwhile, then restarted
    live = stack.client.start(f"echo one; while [ ! -e {gate2} ]; do sleep 0.02; done; "
                              "echo two", work).proc_id
    assert live is not None
    seq_live = start_seq(stack, live)
    run_commands(stack, 8, "pre-kill")
    os.kill(stack.procs.pid, signal.SIGKILL)
    stack.procs.wait(timeout=10)
    result = run_gc(stack.state)
    assert not result["error"], result
    floor = int(result["floor_seq"])  # type: ignore[call-overload]
    assert seq_long < floor <= seq_live, (floor, seq_live)
    kept_floor = retention.load(retention.path_in(stack.state.state_dir)).floor_seq
    assert seq_long < kept_floor and all(
        f >= kept_floor for f, _ in list_segments(stack.state.wal_dir))
    stack.start_procs()
    wait_for(lambda: any(f["proc_id"] == live for f in stack.facts("proc_reattached")), 20,
             "the running command re-attached")
    gate2.touch()
    data, last = read_all(stack.client, live)
    assert data == b"one\ntwo\n" and last.state == "exited" and last.exit_code == 0
    # a command ended long ago (its facts truncated) is answered from its files
    old = stack.client.poll(first)
    assert old.data == b"old-0\n" and old.state == "exited" and old.exit_code == 0
    assert run_commands(stack, 1, "new")
    result = run_gc(stack.state)
    assert not result["error"] and int(result["floor_seq"]) > seq_live, result  # type: ignore[call-overload]
    assert verify(stack.state).sound
