"""Rewind and fork in-process over the in-memory writer (tests/agentkit.py):
a rewind restores the workspace byte for byte (file ops and edits made by
other means, as `bash` makes them) and the conversation, the resumed
scripted model runs the rewound turns again under new keys, memory and
`--always` grants survive; a repeated rewind is a no-op; a fork starts as
its parent after turn N with its own copy of the workspace and both go on
without touching each other; and, for any sequence of ops, rewinds and
forks, the fold (generations + tail) equals a fresh replay of the active
branch (hypothesis)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.agent.loop import AgentLoop, Step
from actors.kernel.fold import fold
from actors.kernel.settings import write_spec
from actors.kernel.state import AgentState
from actors.sessions.rebuild import rebuild
from actors.trees import branch
from actors.trees import fork as forking
from actors.trees import rewind as rewinding
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, spec, tree, write_task

STEPS: list[Any] = [
    {"op": "write_file", "path": "a.txt", "content": "one\n"},
    {"op": "write_file", "path": "d/b.txt", "content": "two\n"},
    {"op": "edit_file", "path": "a.txt", "old": "one", "new": "ONE"},
    {"op": "memory_write", "key": "m", "content": "kept"},
    {"op": "write_file", "path": "d/c.txt", "content": "three\n"},
    {"op": "finish", "summary": "done"},
]


def drive(loop: AgentLoop, limit: int = 500) -> Step:
    for _ in range(limit):
        result = loop.step()
        if result is not Step.PROGRESS:
            return result
    raise AssertionError("the loop did not settle")


def start(state_dir: StateDir, writer: FakeWriter, name: str, task: Path | None = None,
          **kw: Any) -> AgentLoop:
    if task is not None:
        write_spec(state_dir, name, spec(task, **kw))
    from actors.kernel.settings import read_spec

    loaded = read_spec(state_dir, name)
    assert loaded is not None
    loop = AgentLoop(name, state_dir, loaded, writer.as_origin(name))  # type: ignore[arg-type]
    loop.rebuild()
    return loop


def events(writer: FakeWriter, name: str) -> list[branch.Event]:
    return [(r.seq, r.event, r.payload()) for r in writer.records if r.stream == f"agent/{name}"]


def replayed(writer: FakeWriter, name: str) -> AgentState:
    return fold(AgentState(), branch.active(events(writer, name)))


def test_rewind_restores_workspace_and_conversation_and_reruns_the_turns(
        state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    task = write_task(tmp_path / "t.yaml", STEPS)
    loop = start(state_dir, writer, "a1", task)
    ws = loop.workspace
    assert drive(loop) is Step.DONE
    final = tree(ws)
    # turn 2 done: a.txt and d/b.txt exist; edit a.txt by other means (as bash would)
    at_two = rewinding.state_at(events(writer, "a1"), branch.turn_point(events(writer, "a1"), 2)
                                or 0)
    assert at_two.turn == 2
    (ws / "a.txt").write_text("changed outside the ops\n")
    (ws / "stray.bin").write_bytes(os.urandom(64))
    done = rewinding.rewind(writer.as_origin("operator"), state_dir, "a1",  # type: ignore[arg-type]
                            to_turn=2)
    assert not done.noop
    assert tree(ws) == {"a.txt": "one\n", "d/b.txt": "two\n"}
    state = rebuild(writer, state_dir, "a1").state  # type: ignore[arg-type]
    assert state.turn == 2 and state.phase == "running"
    assert state.recent == at_two.recent  # the conversation the model sees is turn 2's
    assert state.branch.startswith("r")
    assert (state_dir.memory_dir / "a1" / "m.md").read_text() == "kept"  # persist tier
    # a repeated rewind is a no-op
    again = rewinding.rewind(writer.as_origin("operator"), state_dir, "a1",  # type: ignore[arg-type]
                             to_turn=2)
    assert again.noop
    # resumed: the scripted model runs turns 3.. again, under the branch's keys
    resumed = start(state_dir, writer, "a1")
    assert drive(resumed) is Step.DONE
    assert tree(ws) == final
    turns = [(s, p["turn"]) for s, e, p in branch.active(events(writer, "a1")) if e == "turn"]
    assert [t for _, t in turns] == [1, 2, 3, 4, 5, 6]
    cut_at = next(r.seq for r in writer.records if r.event == "rewind")
    rerun_keys = [r.key for r in writer.records if r.event == "turn" and r.seq > cut_at]
    assert rerun_keys and all(k.startswith(state.branch) for k in rerun_keys)
    assert rebuild(writer, state_dir, "a1").state == replayed(writer, "a1")  # type: ignore[arg-type]
    abandoned = branch.abandoned(events(writer, "a1"))
    assert abandoned  # the old turns 3..6 are still in the WAL, off the branch


def test_fork_copies_the_turn_and_both_diverge(state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    task = write_task(tmp_path / "t.yaml", STEPS)
    src = start(state_dir, writer, "src", task)
    assert drive(src) is Step.DONE
    src_tree = tree(src.workspace)
    done = forking.fork(writer.as_origin("operator"), state_dir, "src", "kid",  # type: ignore[arg-type]
                        at_turn=3)
    assert done.point_turn == 3
    kid_ws = state_dir.agent_dir("kid") / "workspace"
    assert tree(kid_ws) == {"a.txt": "ONE\n", "d/b.txt": "two\n"}
    for p in kid_ws.rglob("*"):
        if p.is_file():
            assert p.stat().st_nlink == 1
            assert p.stat().st_ino != (src.workspace / p.relative_to(kid_ws)).stat().st_ino
    first = events(writer, "kid")[0]
    assert first[1] == "session_fork"
    assert first[2]["parent_agent"] == "src" and first[2]["source_digest"]
    kid = start(state_dir, writer, "kid")
    point = rewinding.state_at(events(writer, "src"), done.point_seq)
    assert kid.state.turn == point.turn == 3 and kid.state.recent == point.recent
    assert (state_dir.memory_dir / "kid" / "m.md").read_text() == "kept"  # a copy
    assert (state_dir.memory_dir / "kid" / "m.md").stat().st_ino != (
        state_dir.memory_dir / "src" / "m.md").stat().st_ino
    assert drive(kid) is Step.DONE
    (kid_ws / "only-kid.txt").write_text("mine")
    assert tree(src.workspace) == src_tree  # the parent is untouched
    assert tree(kid_ws)["d/c.txt"] == "three\n"
    # a second fork under a taken name is refused and leaves nothing
    try:
        forking.fork(writer.as_origin("operator"), state_dir, "src", "kid")  # type: ignore[arg-type]
    except forking.ForkError:
        pass
    else:
        raise AssertionError("a taken name was forked onto")
    assert not list((state_dir.root / "agents").glob(".fork-*"))


OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 3), st.text("ab\n", max_size=5)),
    st.tuples(st.just("rewind"), st.integers(0, 3)),
    st.tuples(st.just("fork"), st.integers(0, 3)),
    st.tuples(st.just("outside"), st.integers(0, 3)),
), min_size=2, max_size=8)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_fold_equals_fresh_replay_of_the_active_branch(
        state_dir: StateDir, tmp_path: Path, ops: list[Any]) -> None:
    import shutil

    shutil.rmtree(state_dir.root / "agents", ignore_errors=True)
    shutil.rmtree(state_dir.config_dir / "agents", ignore_errors=True)
    writer = FakeWriter()
    steps: list[Any] = []
    for op in ops:
        if op[0] == "write":
            steps.append({"op": "write_file", "path": f"f{op[1]}", "content": op[2]})
    steps.append({"op": "finish", "summary": "end"})
    task = write_task(tmp_path / "h.yaml", steps)
    loop = start(state_dir, writer, "h", task, snapshot_every=5)
    drive(loop)
    names = ["h"]
    forks = 0
    for op in ops:
        name = names[-1]
        if op[0] == "rewind":
            try:
                rewinding.rewind(writer.as_origin("operator"), state_dir, name,  # type: ignore[arg-type]
                                 to_turn=op[1])
            except rewinding.RewindError:
                continue
            drive(start(state_dir, writer, name))
        elif op[0] == "fork":
            forks += 1
            try:
                forking.fork(writer.as_origin("operator"), state_dir, name,  # type: ignore[arg-type]
                             f"k{forks}", at_turn=op[1])
            except forking.ForkError:
                continue
            names.append(f"k{forks}")
            drive(start(state_dir, writer, f"k{forks}"))
        elif op[0] == "outside":
            spec_ws = state_dir.agent_dir(name) / "workspace"
            (spec_ws / f"x{op[1]}").write_text("by bash")
    for name in names:
        built = rebuild(writer, state_dir, name).state  # type: ignore[arg-type]
        assert built == replayed(writer, name)
        assert built == rebuild(writer, state_dir, name,  # type: ignore[arg-type]
                                use_generations=False).state


def test_rewind_restores_the_registries_the_session_changed_after_the_cut(
        state_dir: StateDir, tmp_path: Path) -> None:
    """Registries are config generations (actors/registries/store.py): a rewind
    to turn 2 takes back the hook the session added at turn 3 (as a new
    generation, the old ones kept) and keeps the pipeline installed at turn 2;
    a registry the operator changed is not the session's to take back."""
    import yaml

    from actors.registries import store

    pipe = {"name": "hello", "steps": [
        {"id": "w", "op": "write_file", "args": {"path": "hello.txt", "content": "hi"}}]}
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "hello.yaml", "content": yaml.safe_dump(pipe)},
        {"op": "pipeline_install", "path": "hello.yaml"},
        {"op": "hook_add", "entry": {"name": "notify", "on": ["agent_finished"],
                                     "url": "http://127.0.0.1:9/x"}},
        {"op": "finish", "summary": "done"},
    ])
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", task)
    assert drive(loop) is Step.DONE
    assert [e["name"] for e in store.newest(state_dir, "hooks").entries] == ["notify"]
    hooks_before = len(store.history(state_dir, "hooks"))
    done = rewinding.rewind(writer.as_origin("operator"), state_dir, "a1",  # type: ignore[arg-type]
                            to_turn=2)
    assert not done.noop
    assert store.newest(state_dir, "hooks").entries == []  # taken back, as a new generation
    assert len(store.history(state_dir, "hooks")) == hooks_before + 1
    assert [e["name"] for e in store.newest(state_dir, "pipelines").entries] == ["hello"]
    assert "notify" not in (state_dir.config_dir / "hooks.yaml").read_text()
    again = rewinding.rewind(writer.as_origin("operator"), state_dir, "a1",  # type: ignore[arg-type]
                             to_turn=2)
    assert again.noop and len(store.history(state_dir, "hooks")) == hooks_before + 1


def test_a_rewound_questions_answer_never_enters_later_context(
        state_dir: StateDir, tmp_path: Path) -> None:
    """Issue 14 with rewind: the answer to a question asked at turn 3 is off the
    active branch after a rewind to turn 2; the question asked again waits for
    a new answer, and only the new one reaches the model (the scripted model
    echoes the sha256 of each input it received)."""
    import hashlib

    from actors.kernel.operator_input import record_answer

    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "a.txt", "content": "one\n"},
        {"op": "write_file", "path": "b.txt", "content": "two\n"},
        {"op": "ask", "question": "which colour?"},
        {"op": "write_file", "path": "c.txt", "content": "three\n"},
        {"op": "finish", "summary": "done"},
    ])
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", task)

    def answer(text: str) -> str:
        assert drive(loop) is Step.WAIT
        state = rebuild(writer, state_dir, "a1").state  # type: ignore[arg-type]
        [question] = [a for a in state.pending_approvals() if a.kind == "clarification"]
        record_answer(writer.as_origin("operator"), state_dir.agent_dir("a1"), "a1", state,
                      question.request, text=text)
        loop.sync()
        return hashlib.sha256(text.encode()).hexdigest()

    def received(sha: str, after: int = 0) -> int:
        return sum(1 for s, e, p in branch.active(events(writer, "a1"))
                   if s > after and e == "turn" and f"sha256={sha}" in (p.get("text") or ""))

    old = answer("blue, the rewound answer")
    assert drive(loop) is Step.DONE
    assert received(old) == 1
    rewinding.rewind(writer.as_origin("operator"), state_dir, "a1",  # type: ignore[arg-type]
                     to_turn=2)
    loop = start(state_dir, writer, "a1")
    assert not loop.state.inputs and received(old) == 0  # off the active branch
    new = answer("green, the answer after the rewind")
    assert drive(loop) is Step.DONE
    cut = next(r.seq for r in writer.records if r.event == "rewind")
    assert received(new) == 1 and received(old, after=cut) == 0


def test_turns_are_looked_up_in_their_own_session(state_dir: StateDir, tmp_path: Path) -> None:
    """Turn numbers start again in each session: a rewind's --to-turn cuts the
    newest session (not the first session's turn of that number), a rewind to
    a seq of an earlier session is refused, and a fork may start from an
    earlier session at one of its turns, with that session's state and tree."""
    from actors.sessions.ids import new_session_id

    writer = FakeWriter()
    first_task = write_task(tmp_path / "t1.yaml", STEPS)
    loop = start(state_dir, writer, "two", first_task)
    assert drive(loop) is Step.DONE
    first_session = loop.state.session
    second_task = write_task(tmp_path / "t2.yaml", [
        {"op": "write_file", "path": "s2.txt", "content": "second\n"},
        {"op": "write_file", "path": "s2b.txt", "content": "again\n"},
        {"op": "finish", "summary": "done"},
    ])
    write_spec(state_dir, "two", spec(second_task).model_copy(
        update={"session": new_session_id()}))
    loop = start(state_dir, writer, "two")
    assert drive(loop) is Step.DONE
    second_session = loop.state.session
    assert first_session and second_session and second_session != first_session
    all_events = events(writer, "two")
    first_records = branch.session_events(all_events, first_session)
    assert first_records[0][1] == "session_started"
    assert all(seq < branch.session_events(all_events)[0][0] for seq, _, _ in first_records)

    operator = writer.as_origin("operator")
    done = rewinding.rewind(operator, state_dir, "two", to_turn=1)  # type: ignore[arg-type]
    assert done.to_seq > first_records[-1][0]  # in the second session, not the first
    state = replayed(writer, "two")
    assert state.session == second_session and state.turn == 1
    assert (loop.workspace / "s2.txt").exists() and not (loop.workspace / "s2b.txt").exists()
    with pytest.raises(rewinding.RewindError, match="earlier session"):
        rewinding.rewind(operator, state_dir, "two",  # type: ignore[arg-type]
                         to_seq=first_records[3][0])

    forked = forking.fork(operator, state_dir, "two", "from-first",  # type: ignore[arg-type]
                          at_turn=2, session=first_session)
    assert forked.point_seq <= first_records[-1][0]
    kid = start(state_dir, writer, "from-first")
    assert kid.state.turn == 2
    assert tree(state_dir.agent_dir("from-first") / "workspace") == {
        "a.txt": "one\n", "d/b.txt": "two\n"}
    with pytest.raises(forking.ForkError, match="no session"):
        forking.fork(operator, state_dir, "two", "nope",  # type: ignore[arg-type]
                     session=new_session_id())


def test_a_fork_of_a_compacted_session_keeps_its_summary(
        state_dir: StateDir, tmp_path: Path) -> None:
    """The state at the cut names a summary in the parent's compaction file; the
    fork's context must have that text, not 'summary unavailable'."""
    from actors.kernel import compaction
    from actors.kernel.settings import CompactionSettings

    text = "lorem ipsum dolor sit amet " * 12
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "f{i}.txt", "content": text},
        {"op": "read_file", "path": "f{i}.txt"}], repeat=12)
    writer = FakeWriter()
    src = start(state_dir, writer, "long", task, compaction=CompactionSettings(
        window_tokens=2048, summary_chars=1000))
    assert drive(src) is Step.DONE
    assert src.state.summary is not None and src.state.compactions >= 2
    forked = forking.fork(writer.as_origin("operator"), state_dir, "long",  # type: ignore[arg-type]
                          "long-kid")
    kid = start(state_dir, writer, "long-kid")
    assert kid.state.summary == src.state.summary
    assert compaction.read_summary(state_dir.agent_dir("long-kid"), kid.state.summary) == \
        compaction.read_summary(state_dir.agent_dir("long"), src.state.summary)
    assert forked.point_turn == src.state.turn
