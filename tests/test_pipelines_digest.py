"""A pipeline runs what was checked (docs/pipelines.md): the runner records
the run file's digest with its first batch, and a run file changed under the
run (its runner killed, the file edited, the runner started again) runs
nothing more: the run ends failed with `pipeline_changed`, and its report
says so rather than `ok`. A run file that breaks a bound is refused with the
key and the bound named."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
import zmq

from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
from actors.pipelines import report, runfile
from actors.writer.client import WriterClient
from broker.errors import ConfigError
from broker.statedir import StateDir
from tests.agentkit import tree
from tests.processes import ProcessTracker
from tests.test_pipelines_process import start_runner
from tests.test_writer import start_writer

pytestmark = pytest.mark.process

STEPS: list[dict[str, Any]] = [
    {"id": "s0", "op": "write_file", "args": {"path": "a.txt", "content": "a"}},
    {"id": "s1", "op": "write_file", "args": {"path": "b.txt", "content": "b"}},
]
TAMPERED: list[dict[str, Any]] = [
    STEPS[0],
    {"id": "s1", "op": "write_file", "args": {"path": "b.txt", "content": "CHANGED"}},
    {"id": "s2", "op": "write_file", "args": {"path": "added.txt", "content": "added"}},
]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def run_file(steps: list[dict[str, Any]]) -> runfile.RunFile:
    text = yaml.safe_dump({"name": "pair", "steps": steps})
    return runfile.RunFile(pipeline="pair", source="test", text=text)


@pytest.mark.timeout(120)
def test_a_run_file_changed_under_its_run_runs_nothing_more(
        processes: ProcessTracker, state_dir: StateDir,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    start_writer(processes, state_dir, ctx)
    path = runfile.write(state_dir, "pl", run_file(STEPS))
    write_spec(state_dir, "pl", AgentSpec(task=str(path), backend="pipeline",
                                          settings=runfile.runner_settings(AgentSettings())))
    killed = start_runner(processes, state_dir, "pl",
                          env={"CORRAL_AGENT_FAULT": "after_tool_result@1.0"}).wait(timeout=30)
    assert killed == -signal.SIGKILL, processes.output("pl")
    runfile.write(state_dir, "pl", run_file(TAMPERED))  # edited while the runner was down

    assert start_runner(processes, state_dir, "pl", env={}).wait(timeout=30) == 0

    # the kill aborted the batch after s0's effect; nothing of the new text runs
    assert tree(state_dir.agent_dir("pl") / "workspace") == {"a.txt": "a"}
    with WriterClient(ctx, state_dir, "probe") as writer:
        outcome = report.outcome(writer, state_dir, "pl")
    assert outcome is not None
    assert outcome["status"] == "failed" and outcome["code"] == "pipeline_changed", outcome


def test_a_bound_broken_by_a_run_file_is_named() -> None:
    with pytest.raises(ConfigError, match=r"inputs\.k: .*at most 65536 characters"):
        runfile.build(pipeline="p", source="s", text="t", inputs={"k": "v" * 70_000})
    with pytest.raises(ConfigError, match=r"inputs: .*at most 1024 items"):
        runfile.build(pipeline="p", source="s", text="t",
                      inputs={f"k{i}": "v" for i in range(20_000)})
