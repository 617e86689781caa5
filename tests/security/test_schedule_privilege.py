"""Privilege comes from the operator, never from a name an agent picked
(issue 33 item 4; actors/procs/grants.py, supervisor/automationgrants.py).

The operator opens the network to agents named `net-*`. An agent the operator
spawned under another name adds a schedule named `net-esc` with its
`schedule_add` op, so the schedule's runs are named `net-esc-<slot>`: a run
gets no network (its command cannot reach a listener of the test on
127.0.0.1, where an operator-spawned `net-ctl` running the same command can),
and the run's model use is charged to the agent that made the schedule (a
`schedule_usage` in its stream equal to what the run spent), which started it
with what was left of its own budget, not a fresh one. Real processes:
`supervisor up` with writer, broker and procs (bubblewrap)."""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import pytest
import yaml
import zmq

from actors.writer.client import WriterClient
from broker.errors import RequestTimeoutError
from broker.statedir import StateDir
from tests.agentkit import write_task
from tests.processes import ProcessTracker, wait_for
from tests.test_supervisor_process import cli
from tests.test_supervisor_run import fast_config, supervisor_up

pytestmark = pytest.mark.process

CONNECT = ("import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); "
           "print('CONNECTED')")


def _facts(writer: WriterClient, stream: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        return [(r.event, r.payload()) for r in writer.read_stream(stream)]  # type: ignore[misc]
    except RequestTimeoutError:  # a loaded host: the writer's answer came late
        return []


def _output(writer: WriterClient, agent: str) -> str | None:
    """The output of the agent's bash call, once its session has ended."""
    facts = _facts(writer, f"agent/{agent}")
    if not any(e == "session_exit" for e, _ in facts):
        return None
    results = [p["result"] for e, p in facts if e == "tool_result" and p.get("op") == "bash"]
    assert results, facts
    return str(results[0].get("output", results[0]))


def _tokens(writer: WriterClient, agent: str) -> int:
    return sum(int(p["usage"]["tokens_in"]) + int(p["usage"]["tokens_out"])
               for e, p in _facts(writer, f"agent/{agent}") if e == "turn")


@pytest.mark.timeout(120)
def test_an_agents_net_schedule_gets_no_network_and_spends_its_owners_budget(
        processes: ProcessTracker, state_dir: StateDir) -> None:
    path = fast_config(state_dir)
    config = yaml.safe_load(path.read_text())
    config["sandbox"]["network"] = ["net-*"]
    config["automation"] = {"tick_s": 0.05}
    config["children"] = [c for c in config["children"]
                          if c["kind"] in ("writer", "broker", "procs")]
    path.write_text(yaml.safe_dump(config))
    up = supervisor_up(processes, state_dir, path)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    writer = WriterClient(ctx, state_dir, "operator", timeout_s=5.0, retries=1)
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(8)
            command = (f"{sys.executable} -c \"{CONNECT.format(port=server.getsockname()[1])}\""
                       " 2>&1 | tail -1; echo finished")
            run_task = write_task(state_dir.root.parent / "run.yaml", [
                {"op": "bash", "command": command}, {"op": "finish", "summary": "ran"}])
            planner = write_task(state_dir.root.parent / "planner.yaml", [
                {"op": "schedule_add", "entry": {"name": "net-esc", "cron": "* * * * * */2",
                                                 "task": str(run_task), "owner": "operator"}},
                {"op": "finish", "summary": "planned"}])
            for name, task in (("net-ctl", run_task), ("planner", planner)):
                assert cli(processes, state_dir, "spawn", name, "--task",
                           str(task)).returncode == 0

            def fired() -> dict[str, Any] | None:
                return next((p for e, p in _facts(writer, "automation/schedules")
                             if e == "schedule_fired" and p["schedule"] == "net-esc"), None)

            fire = wait_for(fired, 40, "the agent's schedule to fire")
            removed = cli(processes, state_dir, "registry", "apply", "schedule_remove",
                          "--args", json.dumps({"name": "net-esc"}))
            assert removed.returncode == 0, removed.stderr
            run = fire["agent"]
            assert run.startswith("net-esc-") and fire["started"] is True
            escaped = wait_for(lambda: _output(writer, run), 40, f"{run} to run its command")
            granted = wait_for(lambda: _output(writer, "net-ctl"), 40, "net-ctl's command")
        assert "finished" in escaped and "CONNECTED" not in escaped
        assert "CONNECTED" in granted  # the operator's grant by name does open it
        assert (fire["owner"], fire["creator"]) == ("planner", "planner")

        # the run started with what was left of the planner's budget, not a fresh one
        limit = config["agent"]["budget"]["tokens"]
        assert limit - _tokens(writer, "planner") <= fire["budget"]["tokens"] < limit

        def charge() -> dict[str, Any] | None:
            return next((p for e, p in _facts(writer, "agent/planner")
                         if e == "schedule_usage" and p["run"] == run), None)

        usage = wait_for(charge, 30, "the run's use charged to the planner")
        assert usage["tokens"] == _tokens(writer, run) > 0
        assert usage["schedule"] == "net-esc"
    finally:
        writer.close()
        ctx.destroy(linger=0)
        assert cli(processes, state_dir, "stop").returncode == 0
        assert up.wait(timeout=30) == 0


def test_grants_are_held_by_the_operator_created_agent_at_the_root(
        state_dir: StateDir) -> None:
    from actors.kernel.settings import AgentSpec, write_spec
    from actors.procs.grants import holder

    for name, creator in (("planner", None), ("net-esc-1", "planner"),
                          ("net-esc-2", "net-esc-1"), ("loop-a", "loop-b"),
                          ("loop-b", "loop-a")):
        write_spec(state_dir, name, AgentSpec(task="/t.yaml", creator=creator))
    write_spec(state_dir, "planner.s-1", AgentSpec(task="/t.yaml", parent_agent="planner"))
    assert holder(state_dir, "planner") == "planner"  # the operator's: its own name
    assert holder(state_dir, "net-esc-1") == "planner"  # a run: its creator's
    assert holder(state_dir, "net-esc-2") == "planner"  # a run of a run: the root's
    assert holder(state_dir, "planner.s-1") == "planner"  # a subagent child: its parent's
    assert holder(state_dir, "net-esc-1.pl-3.0") == "planner"  # its pipeline runner
    assert holder(state_dir, "loop-a") is None  # a chain that never ends holds nothing
    assert holder(state_dir, "automation") is None  # hook commands hold no grant
    (state_dir.config_dir / "agents" / "bad.json").write_text("{")
    assert holder(state_dir, "bad") is None  # an unreadable spec holds nothing
