"""Agents as real processes over a real writer: SIGKILL (injected at exact
points through CORRAL_AGENT_FAULT, see actors/agent/faults.py) before an op
is recorded, between `tool_call` and `tool_result` (before and after the
effect) and after `tool_result`: each op runs at most once and the final
workspace equals an uninterrupted run's. An approval request survives a
SIGKILL of the waiting agent and is not asked twice."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.kernel.settings import Rule, write_spec
from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from supervisor.cli.agents import answer_approval
from tests.agentkit import spec, tree, write_task
from tests.processes import ProcessTracker, wait_for
from tests.test_writer import start_writer

pytestmark = pytest.mark.process

STEPS = [
    {"op": "write_file", "path": "tally.txt", "content": "start\n"},
    {"op": "edit_file", "path": "tally.txt", "old": "start", "new": "start+1"},
    {"op": "edit_file", "path": "tally.txt", "old": "+1", "new": "+1+2"},
    {"op": "memory_write", "key": "m", "content": "remembered"},
    {"op": "edit_file", "path": "tally.txt", "old": "+2", "new": "+2+3"},
    {"op": "write_file", "path": "out/{i}.txt", "content": "pass {i}"},
    {"op": "finish", "summary": "done"},
]
FAULTS = "before_tool_call@2.0,after_tool_start@3.0,after_effect@4.0,after_tool_result@5.0"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start_agent(processes: ProcessTracker, state_dir: StateDir, name: str,
                env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir",
                            str(state_dir.root), "--no-broker"], name=name, env=env)


def stream_events(writer: WriterClient, name: str) -> list[tuple[str, Any]]:
    return [(r.event, r.payload()) for r in writer.read_stream(f"agent/{name}")]


def test_sigkill_at_every_point_runs_each_op_at_most_once(
        processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
        tmp_path: Path) -> None:
    start_writer(processes, state_dir, ctx)
    task = write_task(tmp_path / "t.yaml", STEPS)
    for name in ("ref", "victim"):
        write_spec(state_dir, name, spec(task))
    assert start_agent(processes, state_dir, "ref").wait(timeout=30) == 0
    kills = 0
    while True:
        code = start_agent(processes, state_dir, "victim",
                           env={"CORRAL_AGENT_FAULT": FAULTS}).wait(timeout=30)
        if code == 0:
            break
        assert code == -signal.SIGKILL, processes.output("victim")
        kills += 1
        assert kills <= 4
    assert kills == 4
    ref_ws, victim_ws = (state_dir.agent_dir(n) / "workspace" for n in ("ref", "victim"))
    assert tree(victim_ws) == tree(ref_ws) == {"tally.txt": "start+1+2+3\n",
                                               "out/0.txt": "pass 0"}
    assert (state_dir.memory_dir / "victim" / "m.md").read_text() == "remembered"
    with WriterClient(ctx, state_dir, "probe") as writer:
        events = stream_events(writer, "victim")
        results = [p["call_id"] for e, p in events if e == "tool_result"]
        assert len(results) == len(set(results))
        aborted = [(c["call_id"], c["effect_applied"])
                   for e, p in events if e == "turn_aborted" for c in p["calls"]]
        # killed before 2.0's call (1.0's result, pending with the next group, is
        # lost: applied), before 3.0's effect, after 4.0's, and after 5.0's result
        assert aborted == [("1.0", True), ("3.0", False), ("4.0", True), ("5.0", True)]
        assert events[-1][0] == "session_exit" and events[-1][1]["reason"] == "finished"
        assert rebuild(writer, state_dir, "victim").state == rebuild(
            writer, state_dir, "victim", use_generations=False).state


def test_a_stop_right_after_a_result_keeps_it(
        processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
        tmp_path: Path) -> None:
    """A write's `tool_result` joins the next group of facts (docs/agents.md); an
    operator's stop (SIGTERM) right after it makes it durable before the agent
    exits, so the restarted agent goes on with no call settled by the abort rule."""
    start_writer(processes, state_dir, ctx)
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "out/{i}.txt", "content": "pass {i}"}], repeat=4)
    write_spec(state_dir, "stopped", spec(task))
    code = start_agent(processes, state_dir, "stopped",
                       env={"CORRAL_AGENT_FAULT": "after_tool_result@2.0:term"}).wait(timeout=30)
    assert code == 75, processes.output("stopped")  # stopped with its session open
    with WriterClient(ctx, state_dir, "probe") as writer:
        events = stream_events(writer, "stopped")
        assert [p["call_id"] for e, p in events if e == "tool_result"] == ["1.0", "2.0"]
    assert start_agent(processes, state_dir, "stopped").wait(timeout=30) == 0
    assert tree(state_dir.agent_dir("stopped") / "workspace") == {
        f"out/{i}.txt": f"pass {i}" for i in range(4)}
    with WriterClient(ctx, state_dir, "probe") as writer:
        events = stream_events(writer, "stopped")
        assert [e for e, _ in events if e == "turn_aborted"] == []
        assert [p["call_id"] for e, p in events if e == "tool_result"] == [
            "1.0", "2.0", "3.0", "4.0", "5.0"]


def test_an_approval_survives_sigkill_and_is_not_asked_twice(
        processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
        tmp_path: Path) -> None:
    start_writer(processes, state_dir, ctx)
    task = write_task(tmp_path / "t.yaml", [
        {"op": "write_file", "path": "release/n.md", "content": "v1"}, {"op": "finish"}])
    write_spec(state_dir, "a1", spec(task, rules=[
        Rule(op="write_file", path="release/*", decision="ask")], approval_poll_ms=20))
    with WriterClient(ctx, state_dir, "operator") as writer:
        def pending() -> list[Any]:
            return rebuild(writer, state_dir, "a1").state.pending_approvals()

        first = start_agent(processes, state_dir, "a1")
        wait_for(pending, 20, "the approval request")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        log = state_dir.log_path("a1")
        second = start_agent(processes, state_dir, "a1")
        wait_for(lambda: log.read_text().count('"agent_started"') == 2, 20, "the restart")
        state = rebuild(writer, state_dir, "a1").state
        [request] = state.pending_approvals()
        answer_approval(writer, "a1", state, request.request, decision="approve",
                        always=False, note=None)
        assert second.wait(timeout=30) == 0
        events = stream_events(writer, "a1")
    assert [e for e, _ in events].count("approval_requested") == 1
    assert (state_dir.agent_dir("a1") / "workspace" / "release" / "n.md").read_text() == "v1"
