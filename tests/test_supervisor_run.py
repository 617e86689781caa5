"""`supervisor run` and the operator's agent commands as real processes:
`run --agents 8` runs the demo tasks to the end (answering the release
approval and the question itself), exits 0 and leaves no process; `spawn`
adds an agent to a running runtime, `approve` and `deny` answer it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.statedir import StateDir
from supervisor.config import DEFAULT_CONFIG_PATH
from tests.processes import REPO_ROOT, ProcessTracker, wait_for
from tests.test_supervisor_process import cli, status

pytestmark = pytest.mark.process


def fast_config(state_dir: StateDir, agent: dict[str, Any] | None = None, **run: Any) -> Path:
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["agent"].update(agent or {})
    config["heartbeat"] = {"interval_ms": 200, "timeout_s": 10}
    config["status_interval_s"] = 0.2
    config["run"].update({"tasks": [str(p) for p in sorted(
        (REPO_ROOT / "config" / "tasks").glob("*.yaml"))], "refresh_s": 0.1, **run})
    path = state_dir.root.parent / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def supervisor_up(processes: ProcessTracker, state_dir: StateDir, config: Path,
                  name: str = "up", env: dict[str, str] | None = None) -> Any:
    """`supervisor up` with `config`, once its status answers."""
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(config)], name=name, env=env)
    wait_for(lambda: up.poll() is None and cli(processes, state_dir, "status").returncode == 0,
             30, "the supervisor")
    return up


def test_run_with_8_agents_exits_0_and_leaves_no_process(
        processes: ProcessTracker, state_dir: StateDir) -> None:
    config = fast_config(state_dir, timeout_s=90)
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "run", str(config), "--agents", "8",
         "--state-dir", str(state_dir.root)],
        env=processes.env(), capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8/8 agents finished" in done.stdout
    assert "approved agent-" in done.stdout  # release notes and the question
    assert processes.marked() == []
    notes = state_dir.agent_dir("agent-2") / "workspace" / "notes.md"
    assert "status: reviewed" in notes.read_text()
    release = sorted(state_dir.root.glob("agents/*/workspace/release/NOTES.md"))
    assert len(release) == 2
    ledger = state_dir.approvals_ledger_path.read_text()
    # the release notes are approved; the question is answered (an approval never answers it)
    assert ledger.count('"approval_answer"') == 2 and ledger.count('"operator_answer"') == 2


def test_spawn_approve_and_deny_on_a_running_runtime(
        processes: ProcessTracker, state_dir: StateDir) -> None:
    config = fast_config(state_dir)
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(config)], name="up")
    wait_for(lambda: up.poll() is None and cli(processes, state_dir, "status").returncode == 0,
             30, "the supervisor")
    task = REPO_ROOT / "config" / "tasks" / "release.yaml"
    done = cli(processes, state_dir, "spawn", "extra", "--task", str(task))
    assert done.returncode == 0, done.stderr

    def answered(verb: str, request: str, *extra: str) -> bool:
        result = cli(processes, state_dir, verb, "extra", request, *extra)
        return result.returncode == 0

    wait_for(lambda: answered("approve", "req-2.0"), 30, "the release approval")
    again = cli(processes, state_dir, "approve", "extra", "req-2.0")
    assert again.returncode == 1 and "no request req-2.0" in again.stderr  # answered, settled
    # the question: deny (an approval) never answers it; `answer` does, with its text
    wait_for(lambda: "is a question" in cli(processes, state_dir, "deny", "extra",
                                            "req-3.0").stderr, 30, "the question")
    assert answered("answer", "req-3.0", "not yet")
    late = cli(processes, state_dir, "answer", "extra", "req-3.0", "again")
    # settled: refused, as answered (turn still open) or as gone (turn closed)
    assert late.returncode == 1 and re.search("already answered|no question req-3.0",
                                              late.stderr), late.stderr

    def exited() -> bool:
        children = {c["name"]: c for c in status(processes, state_dir)["children"]}
        return children.get("extra", {}).get("last_exit") == "exit 0"

    wait_for(exited, 30, "the spawned agent to finish")
    assert (state_dir.agent_dir("extra") / "workspace" / "release" / "NOTES.md").exists()
    child = {c["name"]: c for c in status(processes, state_dir)["children"]}["extra"]
    assert (child["state"], child["restarts"]) == ("exited", 0)  # transient: not restarted
    assert child["values"]["phase"] == 3  # its final heartbeat: finished
    assert cli(processes, state_dir, "stop").returncode == 0
    assert up.wait(timeout=30) == 0


def test_budget_pause_and_resume_through_the_cli(
        processes: ProcessTracker, state_dir: StateDir) -> None:
    config = fast_config(state_dir, agent={"budget": {"tokens": 150, "cost_units": None},
                                           "approval_poll_ms": 20})
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(config)], name="up")
    wait_for(lambda: up.poll() is None and cli(processes, state_dir, "status").returncode == 0,
             30, "the supervisor")
    task = REPO_ROOT / "config" / "tasks" / "notes.yaml"
    # the running configuration's budget (150 tokens) reaches the spawned agent
    assert cli(processes, state_dir, "spawn", "thrifty", "--task", str(task)).returncode == 0
    # refused until the agent is paused (no session yet, or running); whether the
    # first tries come before the pause is a race, so they are not counted on
    wait_for(lambda: cli(processes, state_dir, "resume", "thrifty", "--budget",
                         "100000").returncode == 0, 30, "the budget pause")
    notes = state_dir.agent_dir("thrifty") / "workspace" / "notes.md"
    wait_for(lambda: notes.exists() and "reviewed" in notes.read_text(), 30, "the task to go on")
    # with 100,000 tokens more it cannot be paused again: a resume now has nothing
    # to resume, and is refused
    late = cli(processes, state_dir, "resume", "thrifty", "--budget", "1")
    assert late.returncode == 1, late.stdout + late.stderr
    assert "not paused on its budget" in late.stderr, late.stderr
    budget = state_dir.budget_ledger_path.read_text()
    assert '"budget_resumed"' in budget and '"turn"' in budget
    assert cli(processes, state_dir, "stop").returncode == 0
    assert up.wait(timeout=30) == 0
