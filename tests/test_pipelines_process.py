"""Pipelines as real processes: a runner SIGKILLed at every step (each at
another point of a call: before it is recorded, after `tool_start` before
and after the effect, after `tool_result`, after the handler ran with
nothing recorded) resumes at its first unsettled step, never repeats a settled
one, and leaves what an uninterrupted run leaves. Under a supervisor: a
pipeline installed with `registry apply` runs with `pipeline run --wait` as a
supervised child seen by `status`; a bad file is refused before anything is
spawned; `registry restore` gives the earlier content back; an agent of the
authenticated runtime installs a pipeline and runs it with `pipeline_run`."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
from actors.pipelines import runfile
from actors.registries import store
from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from tests.agentkit import tree
from tests.processes import ProcessTracker, wait_for
from tests.test_supervisor_process import children, cli
from tests.test_supervisor_run import fast_config, supervisor_up
from tests.test_writer import start_writer

pytestmark = pytest.mark.process

# four independent steps: the runner batches them in one turn, so the call ids
# below are fixed: s0..s3 are 1.0..1.3; after the abort at 1.1 the rest is
# turn 2 (s1..s3 = 2.0..2.2); after the applied abort at 2.0, turn 3 (s2, s3);
# s2 has no named output, so its result rides with the next group: killed
# after it, the result is lost and the applied abort settles s2; turn 4 is s3
STEPS = [
    {"id": "s0", "op": "write_file", "args": {"path": "tally.txt", "content": "0"}},
    {"id": "s1", "op": "edit_file", "args": {"path": "tally.txt", "old": "0", "new": "01"}},
    {"id": "s2", "op": "write_file", "args": {"path": "other.txt", "content": "${inputs.x}"}},
    {"id": "s3", "op": "edit_file", "args": {"path": "tally.txt", "old": "01", "new": "013"}},
]
FAULTS = ("before_tool_call@1.0,after_tool_start@1.1,after_effect@2.0,"
          "after_tool_result@3.0,before_tool_start@4.0")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start_runner(processes: ProcessTracker, state_dir: StateDir, name: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir",
                            str(state_dir.root), "--no-broker"], name=name, env=env)


@pytest.mark.timeout(120)  # six process starts: slow on a loaded host
def test_a_runner_killed_at_every_step_resumes_and_never_repeats_a_settled_step(
        processes: ProcessTracker, state_dir: StateDir,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    start_writer(processes, state_dir, ctx)
    text = yaml.safe_dump({"name": "tally", "inputs": ["x"], "steps": STEPS})
    path = runfile.write(state_dir, "victim", runfile.RunFile(
        pipeline="tally", source="test", text=text, inputs={"x": "X"}))
    write_spec(state_dir, "victim", AgentSpec(task=str(path), backend="pipeline",
                                              settings=runfile.runner_settings(AgentSettings())))
    kills = 0
    while True:
        code = start_runner(processes, state_dir, "victim",
                            env={"CORRAL_AGENT_FAULT": FAULTS}).wait(timeout=30)
        if code == 0:
            break
        assert code == -signal.SIGKILL, processes.output("victim")
        kills += 1
        assert kills <= 5
    assert kills == 5  # every step was killed, at each point of a call once
    # what an uninterrupted run leaves; an edit_file run twice would have failed
    # (its `old` gone) and halted the run
    assert tree(state_dir.agent_dir("victim") / "workspace") == {"tally.txt": "013",
                                                                 "other.txt": "X"}
    with WriterClient(ctx, state_dir, "probe") as writer:
        events = [(r.event, r.payload()) for r in writer.read_stream("agent/victim")]
        metas: dict[str, Any] = {}
        settled: Counter[str] = Counter()
        for event, p in events:
            if event == "turn":
                metas = {f"{p['turn']}.{i}": m for i, m in enumerate(p.get("pipeline") or [])}
            elif event == "tool_result" and p["call_id"] in metas:
                assert p["status"] == "ok", p
                settled[metas[p["call_id"]]["id"]] += 1
            elif event == "turn_aborted":
                for call in p["calls"]:
                    if call["effect_applied"] is True:
                        settled[metas[call["call_id"]]["id"]] += 1
        assert settled == {s["id"]: 1 for s in STEPS}  # each step settled exactly once
        aborted = [c["effect_applied"] for e, p in events if e == "turn_aborted"
                   for c in p["calls"]]
        # killed before the effect, after it, and after a result not yet durable
        assert aborted == [False, True, True]
        final = rebuild(writer, state_dir, "victim").state
        assert final.phase == "finished" and final.pipeline is not None
        assert final.pipeline.done == len(STEPS) and final.pipeline.halted is None


HELLO = """\
name: hello
inputs: [who]
steps:
  - id: greet
    op: write_file
    args: {path: "hello.txt", content: "hello ${inputs.who}"}
    output: greet
outputs: {bytes: "${outputs.greet.result.bytes}"}
"""


@pytest.mark.timeout(120)
def test_install_run_supervised_and_restore_through_the_cli(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    config = fast_config(state_dir)
    up = supervisor_up(processes, state_dir, config)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nsteps:\n  - id: a\n    op: rm_everything\n")
    refused = cli(processes, state_dir, "pipeline", "run", str(bad), "--runner", "pl-bad")
    assert refused.returncode == 2
    assert f"{bad.resolve()}:4: steps.0.op: unknown op 'rm_everything'" in refused.stderr
    assert not (state_dir.config_dir / "agents" / "pl-bad.json").exists()  # nothing spawned

    source = tmp_path / "hello.yaml"
    source.write_text(HELLO)
    done = cli(processes, state_dir, "registry", "apply", "pipeline_install",
               "--args", json.dumps({"path": str(source)}))
    assert done.returncode == 0, done.stderr
    installed_at = json.loads(done.stdout)["generation_seq"]
    assert yaml.safe_load(store.yaml_path(state_dir, "pipelines").read_text())[
        "entries"][0]["name"] == "hello"

    ran = cli(processes, state_dir, "pipeline", "run", "hello", "--input", "who=corral",
              "--runner", "pl-hello", "--wait", "--json", timeout_s=60)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["outputs"] == {"bytes": len("hello corral")}
    assert (state_dir.agent_dir("pl-hello") / "workspace" / "hello.txt").read_text() == \
        "hello corral"
    child = children(processes, state_dir)["pl-hello"]
    assert child["kind"] == "agent"  # a supervised child, like any agent
    trace = cli(processes, state_dir, "trace", "pl-hello")
    assert trace.returncode == 0 and "write_file" in trace.stdout

    removed = cli(processes, state_dir, "registry", "apply", "pipeline_remove",
                  "--args", '{"name": "hello"}')
    assert removed.returncode == 0, removed.stderr
    assert store.newest(state_dir, "pipelines").names() == []
    restored = cli(processes, state_dir, "registry", "restore", str(installed_at))
    assert restored.returncode == 0, restored.stderr
    assert store.newest(state_dir, "pipelines").names() == ["hello"]

    # an agent under the authenticated runtime: its registry op records a generation
    # and its pipeline_run appends to its own runner's stream (the writer's rules)
    task = tmp_path / "agent.yaml"
    task.write_text(yaml.safe_dump({"name": "installer", "setup": [
        {"op": "write_file", "path": "bye.yaml",
         "content": HELLO.replace("hello", "bye")},
        {"op": "pipeline_install", "path": "bye.yaml"},
        {"op": "pipeline_run", "name": "bye", "inputs": {"who": "agent"}},
        {"op": "finish", "summary": "done"}]}))
    assert cli(processes, state_dir, "spawn", "installer", "--task", str(task)).returncode == 0
    wait_for(lambda: children(processes, state_dir).get("installer", {}).get("last_exit")
             == "exit 0", 60, "the installing agent to finish")
    assert store.newest(state_dir, "pipelines").names() == ["hello", "bye"]
    workspace = state_dir.agent_dir("installer") / "workspace"
    assert (workspace / "bye.txt").read_text() == "bye agent"
    assert cli(processes, state_dir, "stop").returncode == 0
    assert up.wait(timeout=30) == 0
