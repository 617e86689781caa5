"""A pipeline with a procs step (`bash`) run by an agent with `pipeline_run`
under a real supervisor and a real procs: the in-process runner
(`<agent>.pl-<call>`) has no spec of its own, so procs must take its
workspace (and network policy) from its agent; the command runs in the
sandbox inside the agent's workspace, and a runner session still reaches
nothing of another agent (actors/procs/ownership.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from actors.procs.ownership import owner_of
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for
from tests.test_supervisor_process import children, cli
from tests.test_supervisor_run import fast_config, supervisor_up

pytestmark = pytest.mark.process

SHELL = """\
name: shell
inputs: [word]
steps:
  - id: echo
    op: bash
    args: {command: "printf %s ${inputs.word} > said.txt; pwd", timeout_s: 20}
    output: echo
outputs: {said: "${outputs.echo.result.exit_code}"}
"""


@pytest.mark.timeout(120)
def test_an_agents_pipeline_run_runs_a_bash_step_in_the_agents_workspace(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    config = fast_config(state_dir)
    up = supervisor_up(processes, state_dir, config)
    task = tmp_path / "agent.yaml"
    task.write_text(yaml.safe_dump({"name": "sheller", "setup": [
        {"op": "write_file", "path": "shell.yaml", "content": SHELL},
        {"op": "pipeline_install", "path": "shell.yaml"},
        {"op": "pipeline_run", "name": "shell", "inputs": {"word": "hi"}},
        {"op": "finish", "summary": "done"}]}))
    assert cli(processes, state_dir, "spawn", "sheller", "--task", str(task)).returncode == 0
    wait_for(lambda: children(processes, state_dir).get("sheller", {}).get("last_exit")
             == "exit 0", 60, "the agent to finish")
    workspace = state_dir.agent_dir("sheller") / "workspace"
    assert (workspace / "said.txt").read_text() == "hi"
    # the runner's own directory holds the job's files, not a workspace of its own
    runners = list(state_dir.root.glob("agents/sheller.pl-*"))
    assert len(runners) == 1 and not (runners[0] / "workspace").exists()
    assert cli(processes, state_dir, "stop").returncode == 0
    assert up.wait(timeout=30) == 0


def test_a_runner_session_is_owned_by_its_agent() -> None:
    assert owner_of("agent-3.pl-12.0") == "agent-3"
    assert owner_of("agent-3.pl-r5-4.0") == "agent-3"
    assert owner_of("p.x.pl-1.0") == "p.x"  # a subagent child's runner
    assert owner_of("agent-3") == "agent-3"
    assert owner_of("pl-hello-abc123") == "pl-hello-abc123"  # a `pipeline run` runner
    assert owner_of(".pl-1.0") == ".pl-1.0" and owner_of("a.pl-") == "a.pl-"
