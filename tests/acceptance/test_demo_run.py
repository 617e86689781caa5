"""The README's first command: `supervisor run` starts the whole runtime, runs
scripted agents on the demo tasks, prints a summary, stops everything and
exits 0 when every agent finished (docs/agents.md "Commands")."""

from __future__ import annotations

import re

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


def test_run_the_demo_with_two_agents(corral: Corral) -> None:
    out = corral.run("run", "--agents", "2", timeout_s=170).stdout
    assert "2/2 agents finished" in out
    rows = {m.group(1): m.group(2) for m in
            re.finditer(r"^(agent-\d+)\s+(\w+)\s+\d+\s+\d+", out, re.MULTILINE)}
    assert rows == {"agent-1": "finished", "agent-2": "finished"}
    # agent i plays task i of the packaged tasks (sorted): counter, then notes
    workspaces = corral.state_dir / "agents"
    tally = (workspaces / "agent-1" / "workspace" / "tally.txt").read_text()
    assert tally.splitlines() == ["tally", *(f"pass {i}" for i in range(6)), "end"]
    notes = (workspaces / "agent-2" / "workspace" / "notes.md").read_text()
    assert "status: reviewed" in notes
    effective = corral.state_dir / "config" / "run.yaml"
    assert "count: 2" in effective.read_text()
    stopped = corral.run("status", rc=3)  # the runtime is stopped at the end
    assert "no supervisor" in stopped.stderr
