"""Pipelines in-process over the in-memory writer: a file with recursion, an
unbounded loop, a nested launch or an unknown op is refused before it runs,
with file:line:key; `for`, `if` and named outputs run in order; a step denied
by a rule halts the run (nothing after it runs); a step asked of the operator
waits and goes on once approved; a raw write into `.corral/config/` is
refused like an agent's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.agent import catalog
from actors.agent.loop import AgentLoop, Step
from actors.kernel.settings import AgentSettings, AgentSpec, Permissions, Rule
from actors.pipelines import dsl, runfile
from broker.statedir import StateDir
from supervisor.cli.agents import answer_approval
from tests.agentkit import FakeWriter, tree

catalog.install()  # the ops these tests parse and run (a process does it at start)


def runner(state_dir: StateDir, writer: FakeWriter, text: str, *, name: str = "pl",
           inputs: dict[str, str] | None = None, rules: list[Rule] | None = None,
           workspace: str | None = None) -> AgentLoop:
    run = runfile.RunFile(pipeline="p", source="test.yaml", text=text, inputs=inputs or {})
    path = runfile.write(state_dir, name, run)
    settings = runfile.runner_settings(AgentSettings(permissions=Permissions(rules=rules or [])))
    spec = AgentSpec(task=str(path), backend="pipeline", settings=settings, workspace=workspace)
    loop = AgentLoop(name, state_dir, spec, writer.as_origin(name))  # type: ignore[arg-type]
    loop.rebuild()
    return loop


def drive(loop: AgentLoop, limit: int = 3000) -> Step:
    for _ in range(limit):
        result = loop.step()
        if result is not Step.PROGRESS:
            return result
    raise AssertionError("the runner did not settle")


def summary(writer: FakeWriter, name: str = "pl") -> dict[str, Any]:
    exits = [p for e, p in writer.events(f"agent/{name}") if e == "session_exit"]
    assert exits and exits[-1]["reason"] == "finished"
    turns = [p for e, p in writer.events(f"agent/{name}") if e == "turn"]
    finish = turns[-1]["actions"][-1]
    assert finish["op"] == "finish"
    result: dict[str, Any] = json.loads(finish["summary"])
    return result


def ws(state_dir: StateDir, name: str = "pl") -> dict[str, str]:
    return tree(state_dir.agent_dir(name) / "workspace")


STEP = "  - {id: a, op: read_file, args: {path: x}}\n"


@pytest.mark.parametrize(("text", "where", "says"), [
    ("name: p\nsteps: &s\n  - id: a\n    op: read_file\n    args: {path: *s}\n",
     "test.yaml:5: steps.0.args.path:", "aliases are not allowed (no recursion)"),
    ("name: p\nsteps:\n  - id: a\n    op: pipeline_run\n    args: {name: p}\n",
     "test.yaml:4: steps.0.op:", "cannot launch a pipeline"),
    ("name: p\nsteps:\n  - id: a\n    for: {items: [1, 2], as: i}\n    steps:\n" + STEP[:0]
     + "      - {id: b, op: read_file, args: {path: x}}\n",
     "test.yaml:4: steps.0.for.max:", "Field required"),
    ("name: p\nsteps:\n  - id: a\n    for: {items: [1, 2, 3], as: i, max: 2}\n    steps:\n"
     "      - {id: b, op: read_file, args: {path: x}}\n",
     "test.yaml:4: steps.0.for.items:", "more than max 2"),
    ("name: p\nsteps:\n  - id: a\n    while: {output: x}\n",
     "test.yaml:4: steps.0.while:", "Extra inputs are not permitted"),
    ("name: p\nsteps:\n" + STEP + "  - id: b\n    op: launch_missiles\n",
     "test.yaml:5: steps.1.op:", "unknown op 'launch_missiles'"),
    ("name: p\nsteps:\n  - id: a\n    op: write_file\n    args: {path: x, content: 3}\n",
     "test.yaml:5: steps.0.args.content:", "valid string"),
    ("name: p\nsteps:\n  - id: a\n    op: write_file\n    args: {path: '${outputs.b}', "
     "content: x}\n", "test.yaml:5: steps.0.args.path:", "no earlier step"),
    ("name: p\nsteps:\n  - id: a\n    op: write_file\n    timeout_s: 5\n"
     "    args: {path: x, content: y}\n", "test.yaml:5: steps.0.timeout_s:", "takes no timeout"),
])
def test_a_bad_file_is_refused_before_it_runs_with_file_line_and_key(
        text: str, where: str, says: str, state_dir: StateDir) -> None:
    with pytest.raises(dsl.PipelineError) as refused:
        dsl.parse(text, "test.yaml")
    assert str(refused.value).startswith(where), str(refused.value)
    assert says in str(refused.value)
    writer = FakeWriter()
    with pytest.raises(dsl.PipelineError):  # a runner given it refuses to start: nothing runs
        runner(state_dir, writer, text).backend  # noqa: B018
    assert writer.records == []


PIPELINE = """\
name: notes
inputs: [version, files]
steps:
  - id: notes
    op: write_file
    args: {path: "notes/${inputs.version}.md", content: "v${inputs.version}"}
    output: notes
  - id: each
    for: {items: "${inputs.files}", as: f, max: 3}
    steps:
      - {id: w, op: write_file, args: {path: "${f}.txt", content: "${index}"}, output: w}
      - id: check
        if: {output: w, status: ok}
        then: [{id: r, op: read_file, args: {path: "${f}.txt"}, output: r}]
  - id: maybe
    if: {output: notes, status: error}
    then: [{id: bad, op: write_file, args: {path: bad.txt, content: x}}]
    else: [{id: good, op: write_file, args: {path: good.txt, content: "${outputs.notes.status}"}}]
outputs: {written: "${outputs.notes.result.bytes}", status: "${outputs.notes.status}"}
"""


def test_for_if_and_named_outputs_run_in_order(state_dir: StateDir) -> None:
    writer = FakeWriter()
    loop = runner(state_dir, writer, PIPELINE,
                  inputs={"version": "7", "files": '["a", "b", "c", "d"]'})
    assert drive(loop) is Step.DONE
    assert ws(state_dir) == {"notes/7.md": "v7", "a.txt": "0", "b.txt": "1", "c.txt": "2",
                             "good.txt": "ok"}  # max 3 cut the fourth item
    assert summary(writer) == {"pipeline": "notes", "status": "ok",
                               "outputs": {"written": 2, "status": "ok"}}
    assert loop.state.pipeline is not None and loop.state.pipeline.done == 8
    assert loop.state.pipeline.outputs["r#2"]["result"]["content"] == "2"
    usage = [p["usage"] for e, p in writer.events("agent/pl") if e == "turn"]
    assert all(u["tokens_in"] == u["tokens_out"] == 0 for u in usage)  # no model


def test_a_step_denied_by_a_rule_halts_the_run(state_dir: StateDir) -> None:
    text = yaml.safe_dump({"name": "p", "steps": [
        {"id": "a", "op": "write_file", "args": {"path": "a.txt", "content": "a"}},
        {"id": "s", "op": "write_file", "args": {"path": "secret/k", "content": "k"}},
        {"id": "b", "op": "write_file", "args": {"path": "b.txt", "content": "b"}}]})
    writer = FakeWriter()
    loop = runner(state_dir, writer, text,
                  rules=[Rule(op="write_file", path="secret/*", decision="deny")])
    assert drive(loop) is Step.DONE
    assert ws(state_dir) == {"a.txt": "a"}  # neither the denied step nor the one after it
    events = writer.events("agent/pl")
    perms = [p for e, p in events if e == "permission"]
    assert [(p["decision"], p["rule"]) for p in perms[:2]] == [
        ("allow", "default"), ("deny", "rules[0]")]
    assert [p["status"] for e, p in events if e == "tool_result"][:2] == ["ok", "denied"]
    assert any(e == "turn_aborted" and p["reason"] == "halted" for e, p in events)
    assert summary(writer)["status"] == "failed"
    assert "step s ended denied" in summary(writer)["error"]


def test_a_step_waits_for_the_operator_and_goes_on_when_approved(state_dir: StateDir) -> None:
    text = yaml.safe_dump({"name": "p", "steps": [
        {"id": "n", "op": "write_file", "args": {"path": "release/NOTES.md", "content": "1.0"}},
        {"id": "d", "op": "write_file", "args": {"path": "done.txt", "content": "yes"}}]})
    writer = FakeWriter()
    loop = runner(state_dir, writer, text,
                  rules=[Rule(op="write_file", path="release/*", decision="ask")])
    assert drive(loop) is Step.WAIT
    assert ws(state_dir) == {}
    (pending,) = loop.state.pending_approvals()
    answer_approval(writer.as_origin("operator"), "pl", loop.state, pending.request,
                    decision="approve", always=False, note=None)  # type: ignore[arg-type]
    loop.sync()
    assert drive(loop) is Step.DONE
    assert ws(state_dir) == {"release/NOTES.md": "1.0", "done.txt": "yes"}
    assert summary(writer)["status"] == "ok"


def test_a_raw_write_into_config_is_refused(state_dir: StateDir, tmp_path: Path) -> None:
    """The state-dir gate (existing) holds for a pipeline step: a workspace that
    contains `.corral/` still cannot write its registries by a file op."""
    project = state_dir.root.parent
    (state_dir.config_dir).mkdir(parents=True, exist_ok=True)
    registry = state_dir.config_dir / "pipelines.yaml"
    registry.write_text("entries: []\n")
    text = yaml.safe_dump({"name": "p", "steps": [
        {"id": "w", "op": "write_file",
         "args": {"path": ".corral/config/pipelines.yaml", "content": "evil: true"}}]})
    writer = FakeWriter()
    loop = runner(state_dir, writer, text, workspace=str(project))
    assert drive(loop) is Step.DONE
    perms = [p for e, p in writer.events("agent/pl") if e == "permission"]
    assert perms[0]["decision"] == "refused"
    assert registry.read_text() == "entries: []\n"
    assert summary(writer)["status"] == "failed"


def test_pipeline_run_from_an_agent_returns_outputs_and_resumes_by_call(
        state_dir: StateDir, tmp_path: Path) -> None:
    from actors.pipelines import ops as pipeline_ops
    from actors.registries import store
    from tests.agentkit import spec, write_task

    text = yaml.safe_dump({"name": "greet", "inputs": ["who"], "steps": [
        {"id": "g", "op": "write_file", "output": "g",
         "args": {"path": "greeting.txt", "content": "hi ${inputs.who}"}}],
        "outputs": {"bytes": "${outputs.g.result.bytes}"}})
    writer = FakeWriter()
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "greet.yaml", "content": text},
        {"op": "pipeline_install", "path": "greet.yaml"},
        {"op": "pipeline_run", "name": "greet", "inputs": {"who": "you"}},
        {"op": "finish", "summary": "done"}])
    loop = AgentLoop("a1", state_dir, spec(task), writer.as_origin("a1"))  # type: ignore[arg-type]
    loop.rebuild()
    assert drive(loop) is Step.DONE
    results = [p for e, p in writer.events("agent/a1") if e == "tool_result"]
    run = results[2]
    assert run["status"] == "ok", run
    assert run["result"]["outputs"] == {"bytes": len("hi you")}
    runner_name = run["result"]["runner"]
    assert runner_name == "a1.pl-3.0"
    workspace = state_dir.agent_dir("a1") / "workspace"
    assert (workspace / "greeting.txt").read_text() == "hi you"  # the agent's workspace
    nested = writer.events(f"agent/{runner_name}")
    assert [e for e, _ in nested].count("tool_result") == 2  # the step, then finish
    # the call run again (a crash before its result): the same runner, nothing repeated
    ctx = loop._context(None, "3.0")
    again = pipeline_ops.pipeline_run(pipeline_ops.PipelineRun(name="greet",
                                                               inputs={"who": "you"}), ctx)
    assert again.ok and again.result["outputs"] == {"bytes": 6}  # type: ignore[union-attr]
    assert writer.events(f"agent/{runner_name}") == nested
    assert store.newest(state_dir, "pipelines").names() == ["greet"]


def test_the_writer_lets_an_agent_append_only_to_its_own_runners() -> None:
    from broker import auth

    assert auth.append_refusal("a1", "agent/a1.pl-3.0", "a1.pl-3.0", "turn") is None
    assert auth.append_refusal("a1", "agent/a2.pl-3.0", "a2.pl-3.0", "turn")
    assert auth.append_refusal("a1", "agent/a1.pl-3.0", "a1", "turn")
    assert auth.append_refusal("a1", "agent/a1.pl-3.0", "a1.pl-3.0", "approval_answer")
    assert auth.append_refusal("a1", "config/registries", "a1", "config_generation") is None
    assert auth.append_refusal("a1", "config/registries", "a1", "turn")
    assert auth.append_refusal("a1", "config/registries", "a2", "config_generation")
