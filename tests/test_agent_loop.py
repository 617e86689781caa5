"""The agent loop in-process over an in-memory writer: a scripted task runs to
its end; malformed actions are rejected and nothing runs; `ask` waits and an
`--always` answer covers exactly its op and pattern; approvals survive a
restart and are not asked twice; a budget stop pauses and a resume goes on;
max turns close the session; a crash at any point of a call, then a restart,
runs each op at most once and leaves the workspace an uninterrupted run
leaves; generations are derived (deleting them changes nothing)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from actors.agent.loop import AgentLoop, Step
from actors.agent.recordable import recordable_actions, recordable_text
from actors.kernel import generations
from actors.kernel.fold import fold
from actors.kernel.operator_input import record_answer
from actors.kernel.settings import Budget, Rule
from actors.kernel.state import AgentState
from actors.sessions.rebuild import rebuild
from broker.statedir import StateDir
from supervisor.cli.agents import answer_approval
from tests.agentkit import FakeWriter, spec, tree, write_task

STREAM = "agent/a1"


def drive(loop: AgentLoop, limit: int = 2000) -> Step:
    for _ in range(limit):
        result = loop.step()
        if result is not Step.PROGRESS:
            return result
    raise AssertionError("the loop did not settle")


def new_loop(state_dir: StateDir, writer: FakeWriter, task: Path, **kw: Any) -> AgentLoop:
    loop = AgentLoop("a1", state_dir, spec(task, **kw), writer)  # type: ignore[arg-type]
    loop.rebuild()
    return loop


def events(writer: FakeWriter, name: str | None = None) -> list[Any]:
    return [p for e, p in writer.events(STREAM) if name is None or e == name]


COUNTER = [
    {"op": "write_file", "path": "tally.txt", "content": "start\n"},
    {"op": "edit_file", "path": "tally.txt", "old": "start", "new": "start+1"},
    {"op": "edit_file", "path": "tally.txt", "old": "+1", "new": "+1+2"},
    {"op": "memory_write", "key": "m", "content": "remembered"},
    {"op": "edit_file", "path": "tally.txt", "old": "+2", "new": "+2+3"},
    {"op": "finish", "summary": "done"},
]


def test_scripted_task_runs_to_finish(state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, write_task(tmp_path / "t.yaml", COUNTER))
    assert drive(loop) is Step.DONE
    assert loop.state.phase == "finished"
    assert tree(loop.workspace) == {"tally.txt": "start+1+2+3\n"}
    assert (state_dir.memory_dir / "a1" / "m.md").read_text() == "remembered"
    kinds = [e for e, _ in writer.events(STREAM) if e != "workspace_tree"]  # docs/trees.md
    assert kinds[:2] == ["session_started", "session_start"] and kinds[-1] == "session_exit"
    assert kinds[2:8] == ["turn", "tool_call", "permission", "tool_start", "tool_result", "turn"]
    assert all(r.ledger == "budget" for r in writer.records if r.event == "turn")


MALFORMED: list[Any] = [
    {"op": "no_such_op"},
    {"op": "write_file", "path": "x.txt"},  # content missing
    {"op": "write_file", "path": "x.txt", "content": 7},  # wrong type (strict)
    {"op": "write_file", "path": "x.txt", "content": "y", "mode": "777"},  # extra field
    {"op": "edit_file", "path": "x.txt", "old": "", "new": "z"},  # empty old
    "write_file x.txt",  # not an object
    {"path": "x.txt", "content": "no op"},
]


def test_malformed_actions_are_rejected_and_nothing_runs(state_dir: StateDir,
                                                         tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, write_task(tmp_path / "t.yaml", [*MALFORMED,
                                                                        {"op": "finish"}]))
    assert drive(loop) is Step.DONE
    rejects = events(writer, "schema_reject")
    assert len(rejects) == len(MALFORMED)
    assert all("x.txt" not in str(r) and "777" not in str(r) for r in rejects)  # value-free
    assert len(events(writer, "tool_start")) == 1  # only finish ran
    assert tree(loop.workspace) == {}
    assert loop.state.counts.rejects == len(MALFORMED)


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


UNRECORDABLE = [
    {"op": "write_file", "path": "deep.txt", "content": _nested(200)},  # past the depth limit
    {"op": "write_file", "path": "nan.txt", "content": float("nan")},
    {"op": "write_file", "path": "inf.txt", "content": [1, float("inf")]},
]


def test_actions_the_wal_would_refuse_are_rejected_not_fatal(state_dir: StateDir,
                                                             tmp_path: Path) -> None:
    """A model's action that breaks the WAL's JSON policy (deep nesting, NaN,
    infinity) becomes a schema_reject; the append never fails, the agent
    goes on, and nothing of it is written."""
    writer = FakeWriter()  # refuses what the real writer refuses
    loop = new_loop(state_dir, writer, write_task(tmp_path / "t.yaml", [*UNRECORDABLE,
                                                                        {"op": "finish"}]))
    assert drive(loop) is Step.DONE
    rejects = events(writer, "schema_reject")
    assert len(rejects) == len(UNRECORDABLE)
    assert [r["op"] for r in rejects] == ["write_file"] * 3
    assert tree(loop.workspace) == {}


def test_lone_surrogates_from_a_model_server_are_made_recordable() -> None:
    """Task files refuse lone surrogates; a model server's JSON can carry them."""
    actions = recordable_actions([{"op": "write_file", "path": "a", "content": "x\ud800"},
                                  {"op": "\udc00"}, {"op": "finish"}])
    assert actions[0]["op"] == "write_file" and "unrecordable" in actions[0]
    assert actions[1]["op"] is None and "unrecordable" in actions[1]
    assert actions[2] == {"op": "finish"}
    assert recordable_text("a\ud800b") == "a\ufffdb"


ASK_RULES = [Rule(op="write_file", path="release/*", decision="ask"),
             Rule(op="edit_file", path="release/*", decision="ask")]


def test_ask_waits_and_always_covers_exactly_its_op_and_pattern(state_dir: StateDir,
                                                                 tmp_path: Path) -> None:
    steps = [
        {"op": "write_file", "path": "release/a.md", "content": "1"},
        {"op": "write_file", "path": "release/a.md", "content": "2"},  # granted: same op+path
        {"op": "write_file", "path": "release/b.md", "content": "3"},  # other path: asks
        {"op": "edit_file", "path": "release/a.md", "old": "2", "new": "4"},  # other op: asks
        {"op": "finish"},
    ]
    writer = FakeWriter()
    operator = writer.as_origin("operator")
    loop = new_loop(state_dir, writer, write_task(tmp_path / "t.yaml", steps), rules=ASK_RULES)
    assert drive(loop) is Step.WAIT
    assert not (loop.workspace / "release").exists()
    [pending] = loop.state.pending_approvals()
    answer_approval(operator, "a1", loop.state, pending.request,  # type: ignore[arg-type]
                    decision="approve", always=True, note=None)
    loop.sync()
    assert drive(loop) is Step.WAIT  # release/b.md
    [pending] = loop.state.pending_approvals()
    assert pending.pattern == "release/b.md"
    answer_approval(operator, "a1", loop.state, pending.request,  # type: ignore[arg-type]
                    decision="approve", always=False, note=None)
    loop.sync()
    assert drive(loop) is Step.WAIT  # edit_file release/a.md
    [pending] = loop.state.pending_approvals()
    assert pending.op == "edit_file"
    answer_approval(operator, "a1", loop.state, pending.request,  # type: ignore[arg-type]
                    decision="deny", always=False, note=None)
    loop.sync()
    assert drive(loop) is Step.DONE
    assert tree(loop.workspace) == {"release/a.md": "2", "release/b.md": "3"}
    verdicts = [p["rule"] for p in events(writer, "permission") if p["op"] == "write_file"]
    assert verdicts == ["rules[0]", "always", "rules[0]"]
    assert [p["status"] for p in events(writer, "tool_result")][:4] == [
        "ok", "ok", "ok", "denied"]
    assert all(r.ledger == "approvals" for r in writer.records
               if r.event in ("approval_requested", "approval_answer"))


def test_approvals_survive_a_restart_and_are_not_asked_twice(state_dir: StateDir,
                                                             tmp_path: Path) -> None:
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "release/a.md", "content": "1"},
        {"op": "ask", "question": "ship?"}, {"op": "finish"}])
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, task, rules=ASK_RULES)
    assert drive(loop) is Step.WAIT
    loop = new_loop(state_dir, writer, task, rules=ASK_RULES)  # a restart while waiting
    assert drive(loop) is Step.WAIT
    assert len(events(writer, "approval_requested")) == 1
    [pending] = loop.state.pending_approvals()
    answer_approval(writer.as_origin("operator"), "a1", loop.state,  # type: ignore[arg-type]
                    pending.request, decision="approve", always=False, note=None)
    loop = new_loop(state_dir, writer, task, rules=ASK_RULES)  # restart after the answer
    assert drive(loop) is Step.WAIT  # now the `ask` op's question
    [question] = loop.state.pending_approvals()
    assert question.kind == "clarification"
    with pytest.raises(LookupError, match="never answers a question"):
        answer_approval(writer.as_origin("operator"), "a1", loop.state,  # type: ignore[arg-type]
                        question.request, decision="approve", always=False, note="yes")
    record_answer(writer.as_origin("operator"), loop.agent_dir, "a1", loop.state,
                  question.request, text="yes")
    loop.sync()
    assert drive(loop) is Step.DONE
    assert len(events(writer, "approval_requested")) == 2
    assert events(writer, "tool_result")[1]["result"]["answered"] is True
    assert [p["request"] for p in events(writer, "clarification_consumed")] == [question.request]


def test_budget_stop_pauses_and_resume_continues(state_dir: StateDir, tmp_path: Path) -> None:
    task = write_task(tmp_path / "t.yaml", COUNTER)
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, task, budget=Budget(tokens=150))
    assert drive(loop) is Step.WAIT
    assert loop.state.phase == "paused" and loop.state.exit_reason == "budget"
    exit_event = events(writer, "session_exit")[-1]
    assert exit_event["reason"] == "budget" and exit_event["resumable"] is True
    loop = new_loop(state_dir, writer, task, budget=Budget(tokens=150))  # survives a restart
    assert drive(loop) is Step.WAIT
    writer.as_origin("operator").append(STREAM, "budget_resumed", {"tokens": 10_000},
                                        key="resume:a1:s1", ledger="budget")
    loop.sync()
    assert drive(loop) is Step.DONE
    assert tree(loop.workspace) == {"tally.txt": "start+1+2+3\n"}
    assert [p["resumed"] for p in events(writer, "session_start")] == [False, True]


def test_max_turns_closes_the_session(state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, write_task(tmp_path / "t.yaml", COUNTER), max_turns=3)
    assert drive(loop) is Step.DONE
    assert loop.state.phase == "closed" and loop.state.exit_reason == "max_turns"
    assert loop.state.turn == 3


class CrashError(Exception):
    pass


@pytest.mark.parametrize("point", ["before_tool_call", "after_tool_start", "after_effect",
                                   "after_tool_result"])
@pytest.mark.parametrize("call", ["2.0", "3.0", "4.0"])
def test_a_crash_at_any_point_runs_each_op_at_most_once(
        state_dir: StateDir, tmp_path: Path, point: str, call: str) -> None:
    task = write_task(tmp_path / "t.yaml", COUNTER)
    reference = StateDir(tmp_path / "ref" / ".corral").ensure()
    ref = new_loop(reference, FakeWriter(), task)
    assert drive(ref) is Step.DONE

    writer = FakeWriter()
    loop = new_loop(state_dir, writer, task)

    def hit(where: str, call_id: str) -> None:
        if (where, call_id) == (point, call):
            raise CrashError

    loop.faults.hit = hit  # type: ignore[method-assign]
    with pytest.raises(CrashError):
        drive(loop)
    loop = new_loop(state_dir, writer, task)  # the restarted process
    assert drive(loop) is Step.DONE
    assert tree(loop.workspace) == tree(ref.workspace)
    assert (state_dir.memory_dir / "a1" / "m.md").read_text() == "remembered"
    # Every call of COUNTER before `finish` has an effect, whose result joins the
    # next group of facts: a crash before that group's flush (at the next call's
    # start, or right after the result) loses the result, and the call is settled
    # from its digests as applied. Only a crash between the intent and the write
    # finds the effect not applied.
    turn, index = call.split(".")
    lost = f"{int(turn) - 1}.{index}" if point == "before_tool_call" else call
    [fact] = events(writer, "turn_aborted")
    assert [(c["call_id"], c["effect_applied"]) for c in fact["calls"]] == [
        (lost, point != "after_tool_start")]
    results = [p["call_id"] for p in events(writer, "tool_result")]
    assert len(results) == len(set(results))


def test_generations_are_derived(state_dir: StateDir, tmp_path: Path) -> None:
    steps = [{"op": "write_file", "path": "f{i}.txt", "content": "{i}"}]
    task = write_task(tmp_path / "t.yaml", steps, repeat=40)
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, task, snapshot_every=16)
    assert drive(loop) is Step.DONE
    agent_dir = state_dir.agent_dir("a1")
    gens = generations.list_generations(agent_dir)
    assert 1 <= len(gens) <= 3
    snapshot = agent_dir / "state" / "snapshot.json"  # another name for the newest
    assert snapshot.stat().st_ino == gens[-1].stat().st_ino
    full = fold(AgentState(), [(r.seq, r.event, r.payload()) for r in writer.records
                               if r.stream == STREAM])
    with_gen = rebuild(writer, state_dir, "a1")  # type: ignore[arg-type]
    assert with_gen.from_generation > 0
    assert with_gen.state == full
    shutil.rmtree(agent_dir / "state")
    assert rebuild(writer, state_dir, "a1").state == full  # type: ignore[arg-type]


def test_a_generation_s_bytes_parse_back_and_a_stale_snapshot_is_replaced(
        tmp_path: Path) -> None:
    """A generation's bytes (pydantic's JSON inside the envelope) parse back
    to the state they were made from, text outside ASCII and fractional
    costs included; a snapshot.json that is not the newest generation (a
    copy, a stale file) is made another name for it."""
    state = AgentState(last_seq=7, turn=3)
    state.recent.append({"turn": 3, "text": "é ✓ \u2028 \"quoted\""})
    state.budget.cost_used = 0.1 + 0.2
    state.todos = [{"n": 2**70}]
    body = generations.encode("a1", state, "k")
    gen = generations.parse(body)
    assert gen is not None and gen.state == state and gen.key == "k"
    odd = state.model_copy(deep=True)  # pydantic cannot write it as UTF-8: json does
    odd.recent.append({"text": "\ud800"})
    back = generations.parse(generations.encode("a1", odd, None))
    assert back is not None and back.state == odd
    agent_dir = tmp_path / "agents" / "a1"
    snapshot = generations.state_dir_of(agent_dir) / "snapshot.json"
    snapshot.parent.mkdir(parents=True)
    snapshot.write_bytes(b"stale")
    digest = generations.write(agent_dir, "a1", state, key="k")
    [newest] = generations.list_generations(agent_dir)
    assert snapshot.read_bytes() == newest.read_bytes() == body
    assert snapshot.stat().st_ino == newest.stat().st_ino
    assert digest == gen.sha256


def test_a_generation_equals_the_fold_when_other_streams_interleave(
        state_dir: StateDir, tmp_path: Path) -> None:
    """Seqs are global: another stream's records put this stream's facts at
    seqs other than the ones the loop folds them at before they are durable.
    A generation must still be the fold of the WAL up to its seq (the soak's
    invariant): a fact whose seq the state keeps (`session_started`) is folded
    at its real seq. A soak run caught a generation with a provisional one."""
    steps = [{"op": "write_file", "path": "f{i}.txt", "content": "{i}"}]
    task = write_task(tmp_path / "t.yaml", steps, repeat=30)
    writer = FakeWriter()
    for i in range(7):
        writer.append("agent/other", "note", {"i": i}, key=f"n{i}")
    assert drive(new_loop(state_dir, writer, task, snapshot_every=16)) is Step.DONE
    stream = [(r.seq, r.event, r.payload()) for r in writer.records if r.stream == STREAM]
    gens = generations.candidates(state_dir.agent_dir("a1"))
    assert gens, "the run wrote no generation"
    for gen in gens:
        upto = fold(AgentState(), [e for e in stream if e[0] <= gen.state.last_seq])
        assert gen.state == upto
    assert gens[0].state.session_seq == next(s for s, e, _ in stream if e == "session_started")


def test_replay_plays_a_recorded_session_again(state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    task = write_task(tmp_path / "t.yaml", COUNTER)
    assert drive(new_loop(state_dir, writer, task)) is Step.DONE
    replay_spec = spec(task).model_copy(update={"backend": "replay", "replay_stream": STREAM})
    again = AgentLoop("a2", state_dir, replay_spec,
                      writer.as_origin("a2"))  # type: ignore[arg-type]
    again.rebuild()
    assert drive(again) is Step.DONE
    assert tree(again.workspace) == {"tally.txt": "start+1+2+3\n"}
    recorded = [p["actions"] for e, p in writer.events(STREAM) if e == "turn"]
    replayed = [p["actions"] for e, p in writer.events("agent/a2") if e == "turn"]
    assert replayed == recorded


def test_a_generation_the_wal_no_longer_holds_is_skipped(state_dir: StateDir,
                                                         tmp_path: Path) -> None:
    steps = [{"op": "write_file", "path": "f{i}.txt", "content": "{i}"}]
    task = write_task(tmp_path / "t.yaml", steps, repeat=20)
    writer = FakeWriter()
    assert drive(new_loop(state_dir, writer, task, snapshot_every=16)) is Step.DONE
    newest = generations.candidates(state_dir.agent_dir("a1"))[0].state.last_seq
    del writer.records[newest - 5:]  # the WAL lost its tail: the newest generation is ahead
    remaining = [(r.seq, r.event, r.payload()) for r in writer.records if r.stream == STREAM]
    rebuilt = rebuild(writer, state_dir, "a1")  # type: ignore[arg-type]
    assert rebuilt.from_generation < newest
    assert rebuilt.state == fold(AgentState(), remaining)
    writer.append("agent/other", "filler", {}, key="x")  # a new record takes a lost seq
    writer.records[-1] = writer.records[-1].__class__(
        newest, "agent/other", "filler", b"{}", None, "x")
    assert rebuild(writer, state_dir, "a1").state == fold(  # type: ignore[arg-type]
        AgentState(), remaining)


def test_a_write_is_not_applied_twice_when_the_wal_lost_its_records(
        state_dir: StateDir, tmp_path: Path) -> None:
    """A disk that lost an acknowledged tail (the soak test cuts one): the effect
    journal still knows the write of call 3.0 is on disk."""
    task = write_task(tmp_path / "t.yaml", COUNTER)
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, task)

    def hit(where: str, call_id: str) -> None:
        if (where, call_id) == ("after_tool_result", "3.0"):
            raise CrashError

    loop.faults.hit = hit  # type: ignore[method-assign]
    with pytest.raises(CrashError):
        drive(loop)
    cut = next(r.seq for r in writer.records
               if r.event == "tool_start" and r.payload()["call_id"] == "3.0")  # type: ignore[index]
    del writer.records[cut - 1:]
    writer.keys = {k: s for k, s in writer.keys.items() if s < cut}
    loop = new_loop(state_dir, writer, task)
    assert drive(loop) is Step.DONE
    assert tree(loop.workspace) == {"tally.txt": "start+1+2+3\n"}


def test_each_action_is_parsed_once_a_turn_and_again_after_a_rebuild(
        state_dir: StateDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's `_parsed`: a turn's action was parsed for its `tool_call`, its
    `permission` and its dispatch; now once, and anew for a state folded again."""
    from actors.agent import catalog

    parsed: list[object] = []
    real = catalog.parse_action

    def counting(action: object) -> object:
        parsed.append(action)
        return real(action)

    monkeypatch.setattr(catalog, "parse_action", counting)
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, write_task(tmp_path / "t.yaml", COUNTER))
    assert drive(loop) is Step.DONE
    assert tree(loop.workspace) == {"tally.txt": "start+1+2+3\n"}
    assert len(parsed) == len(COUNTER)  # one parse a turn, one action a turn
    # a state folded again mid-turn parses again: the kept parse is the old state's
    loop = new_loop(state_dir, FakeWriter(), write_task(tmp_path / "u.yaml", COUNTER))
    parsed.clear()
    while not loop.state.calls:  # up to the first turn's tool_call
        loop.step()
    loop.rebuild()
    assert drive(loop) is Step.DONE
    assert tree(loop.workspace) == {"tally.txt": "start+1+2+3\n"}
    assert len(parsed) == len(COUNTER) + 1
