"""The atomic multi-record append (`append_many`): one round trip, one
fdatasync, consecutive seqs, all or none of it after a crash, idempotent as a
whole; and the agent loop on it (one durable wait for a step that writes a
file, recovery unchanged after a group is cut).

A group is written as one group-commit batch (every record names the batch's
first and last seq, docs/wal.md), and start-up keeps a batch whole or cuts it
whole: a WAL cut at any byte of a group's records recovers to the record
before the group (it was never acknowledged), also when the cut falls exactly
between two of its records (no torn record to give it away)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.agent.loop import AgentLoop, Step
from actors.writer import checkpoint
from actors.writer.client import WriterClient, encode_payload
from actors.writer.ledgers import Ledgers
from actors.writer.recovery import recover
from actors.writer.wal import encode_record, list_segments, parse_record, segment_name
from broker.errors import RemoteError
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, spec, tree, write_task
from tests.processes import ProcessTracker
from tests.test_writer import kill_and_reap, start_writer, wal_records


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _ledgers(state_dir: StateDir) -> Ledgers:
    return Ledgers({"budget": state_dir.budget_ledger_path,
                    "approvals": state_dir.approvals_ledger_path})


def _write_wal_with_group(state_dir: StateDir) -> tuple[list[int], int]:
    """Records 1-2 alone, then 3-6 as one group (5 in the budget ledger), last,
    where a crash can cut it. Returns each record's offset and the group's."""
    state_dir.wal_dir.mkdir(parents=True, exist_ok=True)
    lines = [encode_record(seq, 1.0, "agent/a", "turn", "a", f"k{seq}", None, b'{"n":1}')
             for seq in (1, 2)]
    lines += [encode_record(seq, 1.0, "agent/a", "tool_call", "a", f"k{seq}",
                            "budget" if seq == 5 else None, b'{"n":2}', (3, 6))
              for seq in (3, 4, 5, 6)]
    offsets, offset = [], 0
    for line in lines:
        offsets.append(offset)
        offset += len(line)
    (state_dir.wal_dir / segment_name(1)).write_bytes(b"".join(lines))
    return offsets, offsets[2]


def test_a_group_cut_at_any_byte_recovers_none_of_it(state_dir: StateDir) -> None:
    offsets, group_at = _write_wal_with_group(state_dir)
    path = state_dir.wal_dir / segment_name(1)
    pristine = path.read_bytes()
    record = parse_record(pristine[offsets[3]:offsets[4]])
    assert record is not None and (record.batch_first, record.batch_last) == (3, 6)
    for cut in range(group_at, len(pristine) + 1):
        path.write_bytes(pristine[:cut])
        state_dir.checkpoint_path.unlink(missing_ok=True)
        ledgers = _ledgers(state_dir)
        rec = recover(state_dir, 64, ledgers)
        ledgers.close()
        rec.index.close()
        whole = cut == len(pristine)
        assert rec.head_seq == (6 if whole else 2), cut
        assert path.stat().st_size == (len(pristine) if whole else group_at), cut
        assert (rec.repaired is not None) == (cut not in (group_at, len(pristine))), cut
        assert rec.dedupe.lookup("a", "k3") == (3 if whole else None), cut
        ledger = state_dir.budget_ledger_path.read_bytes() if whole else b""
        assert (b'"seq":5' in ledger) == whole, cut
        state_dir.budget_ledger_path.unlink(missing_ok=True)


def _items(n: int, tag: str, ledger: Any = None) -> list[tuple[str, bytes, str, Any]]:
    return [("tool_call", encode_payload({"i": i}), f"{tag}{i}", ledger) for i in range(n)]


@pytest.mark.process
def test_append_many_is_gapless_atomic_and_idempotent_as_a_whole(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a", timeout_s=2, retries=10)
    other = WriterClient(ctx, state_dir, "operator")
    lone = client.append("agent/a", "turn", {"n": 0}, key="t0")
    group = client.append_many("agent/a", _items(4, "g", "budget"))
    assert (group.seq, group.count, group.prev_seq, group.duplicate) == (2, 4, 1, False)
    other.append("agent/b", "turn", {}, key="b1")  # another stream in between: seq 6
    other.append("agent/a", "approval_answer", {}, key="ans")  # our stream: seq 7
    nxt = client.append_many("agent/a", _items(2, "h"))
    assert (nxt.seq, nxt.prev_seq) == (8, 7)  # the client learns an answer came between
    assert [r["seq"] for r in wal_records(state_dir)] == list(range(1, 10))
    assert [r.seq for r in client.read_stream("agent/a")] == [1, 2, 3, 4, 5, 7, 8, 9]
    assert {(r.batch_first, r.batch_last) for r in client.read_stream("agent/a", 2)
            if r.seq <= 5} == {(2, 5)}  # the group is one batch: one write, one fdatasync
    assert lone.seq == 1
    # a retry of the whole group is answered with its first seq, also after a crash
    again = client.append_many("agent/a", _items(4, "g", "budget"))
    assert (again.seq, again.count, again.duplicate) == (2, 4, True)
    kill_and_reap(writer)
    start_writer(processes, state_dir, ctx)
    late = client.append_many("agent/a", _items(4, "g", "budget"))
    assert (late.seq, late.duplicate) == (2, True)
    # keys partly written, or repeated: refused, nothing written
    with pytest.raises(RemoteError, match="partly written"):
        client.append_many("agent/a", [*_items(2, "h"), *_items(1, "new")])
    with pytest.raises(RemoteError, match="repeat"):
        client.append_many("agent/a", [*_items(1, "x"), *_items(1, "x")])
    assert len(wal_records(state_dir)) == 9
    ledger = [json.loads(x)["seq"] for x in state_dir.budget_ledger_path.read_bytes().splitlines()]
    assert ledger == [2, 3, 4, 5]
    client.close()
    other.close()


@pytest.mark.process
def test_a_torn_group_is_gone_after_restart_and_a_retry_writes_it_whole(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """The writer is killed with a group on disk that a torn write left half
    there (as a crash mid-write would: it was never acknowledged); after the
    restart none of it exists, and the client's retry writes all of it."""
    writer = start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a", timeout_s=2, retries=10)
    client.append("agent/a", "turn", {"n": 0}, key="t0")
    client.append_many("agent/a", _items(3, "g"))
    writer.send_signal(signal.SIGTERM)  # a clean stop: its checkpoint names seq 4
    assert writer.wait(timeout=10) == 0
    [(_, path)] = list_segments(state_dir.wal_dir)
    data = path.read_bytes()
    group = [encode_record(5 + i, 2.0, "agent/a", "tool_call", "agent-a", f"n{i}", None,
                           encode_payload({"i": i}), (5, 7)) for i in range(3)]
    path.write_bytes(data + group[0] + group[1][:17])  # two of three, the second torn
    start_writer(processes, state_dir, ctx)
    assert [r.seq for r in client.read_stream("agent/a")] == [1, 2, 3, 4]
    assert path.read_bytes() == data
    redo = client.append_many("agent/a", _items(3, "n"))
    assert (redo.seq, redo.count, redo.duplicate) == (5, 3, False)
    assert [r.key for r in client.read_stream("agent/a", 5)] == ["n0", "n1", "n2"]
    client.close()


class CrashError(Exception):
    pass


STEPS = [{"op": "write_file", "path": "f{i}.txt", "content": "pass {i}"}]


def _drive(loop: AgentLoop) -> None:
    for _ in range(500):
        if loop.step() is Step.DONE:
            return
    raise AssertionError("the loop did not finish")


def test_a_step_that_writes_a_file_pays_one_durable_append(
    state_dir: StateDir, tmp_path: Path
) -> None:
    task = write_task(tmp_path / "t.yaml", STEPS, repeat=5)
    writer = FakeWriter()
    loop = AgentLoop("a1", state_dir, spec(task), writer)  # type: ignore[arg-type]
    loop.rebuild()
    while loop.state.turn < 1 or loop.state.open_turn is not None:  # turn 1 settled
        loop.step()
    before = writer.many_calls
    while loop.state.turn < 2 or loop.state.open_turn is not None:  # turn 2 settled
        loop.step()
    # turn 1's tool_result (pending since its effect), turn 2's workspace tree,
    # turn, tool_call, permission, tool_start: one group; turn 2's result waits
    assert writer.many_calls - before == 1
    events = [r.event for r in writer.records if r.stream == "agent/a1"]
    assert events[-6:] == ["tool_result", "workspace_tree", "turn", "tool_call", "permission",
                           "tool_start"]
    assert loop.state.open_turn is None and loop.journal.pending  # (turn 2's result)
    _drive(loop)
    assert sorted(tree(loop.workspace)) == [f"f{i}.txt" for i in range(5)]


@pytest.mark.process
def test_an_agent_recovers_after_its_group_is_cut_from_the_wal(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
    tmp_path: Path,
) -> None:
    """The real writer; the agent's last group (the previous call's result, a
    turn with its call, its permission and its intent) is cut from the WAL as a
    torn write would: the restarted agent rebuilds without any of it, settles
    the previous call from its digests (applied), decides the turn again, and
    ends with the workspace of an uninterrupted run."""
    task = write_task(tmp_path / "t.yaml", STEPS, repeat=4)
    reference = StateDir(tmp_path / "ref" / ".corral").ensure()
    ref = AgentLoop("a1", reference, spec(task), FakeWriter())  # type: ignore[arg-type]
    ref.rebuild()
    _drive(ref)

    writer = start_writer(processes, state_dir, ctx)
    with WriterClient(ctx, state_dir, "a1", timeout_s=2, retries=10) as client:
        loop = AgentLoop("a1", state_dir, spec(task), client)
        loop.rebuild()
        def crash(where: str, call_id: str) -> None:
            if (where, call_id) == ("after_tool_start", "3.0"):
                raise CrashError  # the group holding turn 3 and its intent is on disk

        loop.faults.hit = crash  # type: ignore[method-assign]
        with pytest.raises(CrashError):
            _drive(loop)
    kill_and_reap(writer)
    [(_, path)] = list_segments(state_dir.wal_dir)
    lines = path.read_bytes().splitlines(keepends=True)
    first = next(i for i, x in enumerate(lines)
                 if json.loads(x)["event"] == "turn" and json.loads(x)["payload"]["turn"] == 3)
    record = parse_record(lines[first])
    # the group: the previous call's tool_result, (the previous turn's
    # workspace_tree, if its workspace changed,) turn, tool_call, permission,
    # tool_start
    assert record is not None and record.batch_first is not None
    assert record.batch_first <= record.seq and record.batch_last == record.seq + 3
    path.write_bytes(b"".join(lines[: first + 2]) + lines[first + 2][:10])  # torn in the group
    for stale in (state_dir.checkpoint_path, checkpoint.previous_path(state_dir.checkpoint_path)):
        stale.unlink(missing_ok=True)  # as if the crash came before any checkpoint of it

    start_writer(processes, state_dir, ctx)
    with WriterClient(ctx, state_dir, "a1", timeout_s=2, retries=10) as client:
        loop = AgentLoop("a1", state_dir, spec(task), client)
        loop.rebuild()
        assert loop.state.turn == 2 and loop.state.open_turn == 2  # 2.0 without a result
        _drive(loop)
        events = [(r.event, r.payload()) for r in client.read_stream("agent/a1")]
    assert tree(loop.workspace) == tree(ref.workspace)
    assert [(c["call_id"], c["effect_applied"]) for e, p in events if e == "turn_aborted"
            for c in p["calls"]] == [("2.0", True)]  # type: ignore[index]
    assert [p["turn"] for e, p in events if e == "turn"] == [1, 2, 3, 4, 5]  # type: ignore[index]
