"""Context compaction with the scripted model and a small window, as real
processes over a real writer: an agent SIGKILLed between a compaction's record
and its boundary rebuilds a state whose context is the one before the record
(the orphaned half changes nothing), then finishes that very compaction, and
ends with the same context (summaries, exchanges, sizes seen by the model) as
an uninterrupted run; every request's context stays within the window; no
fact is deleted. The fold's rules as units: a boundary without its record, a
second record, an abandoned one."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.kernel import compaction
from actors.kernel.fold import fold
from actors.kernel.settings import CompactionSettings, write_spec
from actors.kernel.state import AgentState
from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from tests.agentkit import spec, write_task
from tests.processes import ProcessTracker
from tests.test_writer import start_writer

WINDOW = 2048
TEXT = "lorem ipsum dolor sit amet " * 12  # ~80 tokens a result


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start(processes: ProcessTracker, state_dir: StateDir, name: str, env: dict[str, str]
          ) -> Any:
    return processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir",
                            str(state_dir.root), "--no-broker"], name=name, env=env)


def test_killed_between_record_and_boundary_rebuilds_the_uninterrupted_context(
        processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
        tmp_path: Path) -> None:
    start_writer(processes, state_dir, ctx)
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "f{i}.txt", "content": TEXT},
        {"op": "read_file", "path": "f{i}.txt"}], repeat=20)
    settings = {"compaction": CompactionSettings(window_tokens=WINDOW, summary_chars=1000),
                "snapshot_every": 40}
    for name in ("ref", "victim"):
        write_spec(state_dir, name, spec(task, **settings))
    ref = start(processes, state_dir, "ref", {})
    victim = start(processes, state_dir, "victim",
                   {"CORRAL_AGENT_FAULT": "after_compaction_recorded@m2"})
    assert victim.wait(timeout=60) == -signal.SIGKILL, processes.output("victim")
    with WriterClient(ctx, state_dir, "probe") as writer:
        # the orphaned record: the rebuilt context is the one before it
        records = list(writer.read_stream("agent/victim"))
        assert records[-1].event == "compaction_recorded"
        rebuilt = rebuild(writer, state_dir, "victim").state
        before = fold(AgentState(), [(r.seq, r.event, r.payload()) for r in records[:-1]])
        assert rebuilt.compaction_pending is not None and rebuilt.compactions == 2
        assert (rebuilt.recent, rebuilt.summary) == (before.recent, before.summary)
        assert compaction.context_tokens(rebuilt) == compaction.context_tokens(before)
    victim = processes.spawn(["-m", "actors.agent", "--name", "victim", "--state-dir",
                              str(state_dir.root), "--no-broker"], name="victim-again",
                             env={"CORRAL_AGENT_FAULT": "after_compaction_recorded@m2"})
    assert victim.wait(timeout=60) == 0, processes.output("victim-again")
    assert ref.wait(timeout=60) == 0, processes.output("ref")
    with WriterClient(ctx, state_dir, "probe") as writer:
        states = {n: rebuild(writer, state_dir, n).state for n in ("ref", "victim")}
        events = {n: [(r.event, r.payload()) for r in writer.read_stream(f"agent/{n}")]
                  for n in ("ref", "victim")}
    r, v = states["ref"], states["victim"]
    assert r.compactions >= 3 and (v.recent, v.summary, v.compactions) == (
        r.recent, r.summary, r.compactions)
    sizes = {n: [p["context_tokens"] for e, p in ev if e == "turn"] for n, ev in events.items()}
    assert sizes["ref"] == sizes["victim"] and max(sizes["ref"]) <= WINDOW
    boundaries = {n: [p["compaction"] for e, p in ev if e == "compaction_boundary"]
                  for n, ev in events.items()}
    assert boundaries["ref"] == boundaries["victim"] == [f"m{i}" for i in
                                                        range(1, r.compactions + 1)]
    # the summaries in the compaction files are the same; every turn is still in the WAL
    files = {n: [json.loads(x) for x in compaction.path_of(state_dir.agent_dir(n))
                 .read_text().splitlines()] for n in ("ref", "victim")}
    assert [f["summary"] for f in files["ref"]] == [f["summary"] for f in files["victim"]]
    assert [p["turn"] for e, p in events["victim"] if e == "turn"] == list(range(1, r.turn + 1))
    assert v.summary is not None
    assert compaction.read_summary(state_dir.agent_dir("victim"), v.summary) == \
        files["ref"][-1]["summary"]


def test_the_fold_takes_a_boundary_only_after_its_record() -> None:
    items = [{"turn": t, "text": "x" * 40} for t in range(1, 6)]
    state = AgentState(recent=list(items))
    record = {"compaction": "m1", "items": 3, "through_turn": 3, "sha256": "s", "chars": 5,
              "summary_tokens": 2, "usage": {"tokens_in": 10, "tokens_out": 2}}
    orphan = fold(state, [(1, "compaction_boundary", {"compaction": "m1"})])
    assert orphan.recent == items and orphan.summary is None  # no record: no effect
    recorded = fold(state, [(1, "compaction_recorded", record)])
    assert recorded.recent == items and recorded.compaction_pending is not None
    assert recorded.budget.tokens_used == 12  # the summary call counts into the budget
    twice = fold(recorded, [(2, "compaction_recorded", {**record, "compaction": "m2"})])
    assert twice.compaction_pending == recorded.compaction_pending  # one pending at a time
    done = fold(recorded, [(2, "compaction_boundary", {"compaction": "m1"})])
    assert done.recent == items[3:] and done.summary is not None
    assert done.summary.compaction == "m1" and done.compaction_pending is None
    stale = fold(done, [(3, "compaction_boundary", {"compaction": "m1"})])
    assert stale.recent == done.recent
    dropped = fold(recorded, [(2, "compaction_abandoned", {"compaction": "m1"})])
    assert dropped.recent == items and dropped.compaction_pending is None
    assert dropped.compactions == 1  # the next one is m2: its keys are new


def test_the_compaction_file_keeps_only_what_something_readable_names(
        state_dir: StateDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once retention has removed the early records of the stream, a generation
    save prunes the lines no record left, no kept generation and not the state
    name; the summary in effect stays readable, so a restart's context is whole."""
    from actors.kernel import generations
    from tests.agentkit import FakeWriter
    from tests.test_trees_rewind import drive, start

    monkeypatch.setattr(compaction, "PRUNE_OVER_BYTES", 1)  # prune at every generation
    monkeypatch.setattr(compaction, "PRUNE_GROWTH", 0)
    writer = FakeWriter()
    floor = {"seq": 1}
    read_all = FakeWriter.read_stream

    def retained(self: FakeWriter, stream: str, from_seq: int = 1, page: int = 512) -> Any:
        return read_all(self, stream, max(from_seq, floor["seq"]), page)

    def everything(stream: str, from_seq: int) -> Any:
        return read_all(writer, stream, from_seq)

    monkeypatch.setattr(FakeWriter, "read_stream", retained)  # the loop's view of the WAL
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "f{i}.txt", "content": TEXT},
        {"op": "read_file", "path": "f{i}.txt"}], repeat=40)
    loop = start(state_dir, writer, "long", task, snapshot_every=8, generations_kept=2,
                 compaction=CompactionSettings(window_tokens=WINDOW, summary_chars=1000))
    for _ in range(2000):  # past a few compactions, then retention cuts the stream's start
        if loop.state.compactions >= 3 and loop.state.compaction_pending is None:
            break
        loop.step()
    assert loop.state.compactions >= 3
    lines = compaction.path_of(loop.agent_dir).read_text().splitlines()
    assert len(lines) == loop.state.compactions  # nothing cut yet: every line is named
    floor["seq"] = loop.state.last_seq
    drive(loop)
    state = loop.state
    kept = [json.loads(x) for x in compaction.path_of(loop.agent_dir).read_text().splitlines()]
    named = compaction.refs_of(state)
    for path in generations.list_generations(loop.agent_dir):
        generation = generations.read(path)
        assert generation is not None
        named |= compaction.refs_of(generation.state)
    for record in everything("agent/long", floor["seq"]):
        named |= compaction.named_by(record.event, record.payload())
    assert {(k["compaction"], k["sha256"]) for k in kept} == named
    assert len(kept) < state.compactions  # the lines of cut records went
    assert state.summary is not None
    again = start(state_dir, writer, "long")
    assert again.state.summary == state.summary
    assert compaction.read_summary(again.agent_dir, state.summary) is not None


def _naive_context_tokens(state: AgentState) -> int:
    summary = state.summary.tokens if state.summary is not None else 0
    inputs = sum(i.chars // compaction.CHARS_PER_TOKEN + 1 for i in state.inputs
                 if i.consumed_turn is not None)
    return (compaction.SYSTEM_TOKENS + summary + inputs
            + sum(compaction.tokens_of(item) for item in state.recent))


def test_context_tokens_stays_exact_as_one_state_is_folded_in_place() -> None:
    """The sizes are remembered per exchange (the loop folds one state in place
    and asks before every request): exact through appends, the RECENT_MAX cut,
    a compaction's boundary, a new session, and for states asked in turn."""
    from actors.kernel.fold import RECENT_MAX, fold_into

    state, other = AgentState(), AgentState()
    seq = 0

    def step(target: AgentState, event: str, payload: dict[str, Any]) -> None:
        nonlocal seq
        seq += 1
        fold_into(target, [(seq, event, payload)])
        assert compaction.context_tokens(target) == _naive_context_tokens(target)

    for turn in range(1, RECENT_MAX + 40):
        step(state, "turn", {"turn": turn, "actions": [{"op": "read_file", "path": "f"}],
                             "text": "t" * (turn % 50)})
        step(state, "tool_call", {"call_id": f"{turn}.0", "index": 0, "op": "read_file"})
        step(state, "tool_result", {"call_id": f"{turn}.0", "status": "ok",
                                    "result": {"content": "r" * turn}})
        if turn % 7 == 0:
            step(other, "turn", {"turn": turn, "actions": [], "text": "o" * turn})
    assert len(state.recent) == RECENT_MAX
    step(state, "compaction_recorded", {
        "compaction": "m1", "items": 100, "through_turn": 60, "sha256": "s", "chars": 400,
        "summary_tokens": 101})
    step(state, "compaction_boundary", {"compaction": "m1"})
    assert len(state.recent) == RECENT_MAX - 100
    step(state, "session_started", {"session": "01M8P3CHSKDGX7TXF1G4A3MHT5", "number": 2})
    assert state.recent == []
