"""Subagents as a user meets them (docs/changesets.md), through `supervisor`
only: a spawned agent delegates to a child with `spawn_subagent`, reads its
change set and applies it once; the child's edits land in the parent's
workspace, `trace` shows each step, `status` counts the applied set. A
hostile parent that names a task file outside its workspace, or a child
that writes outside its own, gets a typed refusal and changes nothing.
One runtime for the module (the tests run in file order, on one worker)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

SECRET = "subagent-secret-3b9e1d"
PLANTED = "corral-subagent-planted-5c2a"  # a file the child tries to leave in the host's /tmp

CHILD = """\
name: child
steps:
  - {op: edit_file, path: src/app.py, old: greet, new: welcome, replace_all: true}
  - {op: write_file, path: NOTES.md, content: "written by the child"}
  - {op: finish, summary: renamed}
"""

PARENT = """\
name: parent
steps:
  - {op: write_file, path: src/app.py, content: "def greet():\\n    return 'hi'\\n"}
  - {op: write_file, path: child.yaml, content: %s}
  - {op: spawn_subagent, task: child.yaml, descriptor: renamer}
  - {op: subagent_changes, subagent_id: latest}
  - {op: apply_subagent, subagent_id: latest}
  - {op: apply_subagent, subagent_id: latest}
  - {op: finish, summary: delegated}
"""

HOSTILE_CHILD = """\
name: escaper
steps:
  - {op: write_file, path: ../../parent/workspace/planted.txt, content: planted}
  - {op: bash, command: "echo planted > %s/%s; echo planted > /tmp/%s"}
  - {op: finish, summary: tried}
"""

HOSTILE = """\
name: hostile
steps:
  - {op: spawn_subagent, task: %s, descriptor: stolen}
  - {op: spawn_subagent, task: ../../../secret.yaml, descriptor: climbed}
  - {op: write_file, path: escaper.yaml, content: %s}
  - {op: spawn_subagent, task: escaper.yaml, descriptor: escaper}
  - {op: subagent_changes, subagent_id: latest}
  - {op: finish, summary: tried}
"""


@pytest.fixture(scope="module")
def corral(module_corral: Corral) -> Corral:
    module_corral.up()
    return module_corral


def results(corral: Corral, agent: str) -> list[dict[str, Any]]:
    """The agent's tool results, as `supervisor trace --json` shows them."""
    lines = corral.run("trace", agent, "--json").stdout.splitlines()
    return [json.loads(line)["payload"] for line in lines if '"tool_result"' in line]


def run_to_end(corral: Corral, agent: str, text: str) -> None:
    task = corral.write(f"{agent}.yaml", text)
    corral.run("spawn", agent, "--task", str(task))
    corral.wait_state(agent, {"exited"}, timeout_s=120)


def test_a_parent_delegates_reads_and_applies_its_childs_change_set_once(
        corral: Corral) -> None:
    run_to_end(corral, "parent", PARENT % json.dumps(CHILD))

    workspace = corral.state_dir / "agents" / "parent" / "workspace"
    assert "def welcome():" in (workspace / "src" / "app.py").read_text()
    assert (workspace / "NOTES.md").read_text() == "written by the child"
    done = results(corral, "parent")
    assert [(r["op"], r["status"]) for r in done] == [
        ("write_file", "ok"), ("write_file", "ok"), ("spawn_subagent", "ok"),
        ("subagent_changes", "ok"), ("apply_subagent", "ok"), ("apply_subagent", "error"),
        ("finish", "ok")]
    assert "already_applied" in done[5]["result"]["error"]
    spawned = done[2]["result"]
    assert {f["path"] for f in spawned["files"]} == {"src/app.py", "NOTES.md"}
    def counted() -> bool:  # the host's next heartbeat carries its counters
        host = corral.json("status", "subagents")["children"][0]
        return bool(host["values"].get("applied_total", 0) >= 1)

    corral.wait(counted, "the subagents host to count the applied set")
    assert corral.json("sessions", "list", "--agent", "parent")[0]["status"] == "finished"


def test_a_hostile_parent_and_child_reach_nothing_outside_their_workspaces(
        corral: Corral) -> None:
    secret = corral.write("secret.yaml", f"name: secret\nprompt: {SECRET}\nsteps: []\n")
    child = HOSTILE_CHILD % (corral.home, PLANTED, PLANTED)
    run_to_end(corral, "hostile", HOSTILE % (json.dumps(str(secret)), json.dumps(child)))

    done = results(corral, "hostile")
    assert [r["op"] for r in done][:2] == ["spawn_subagent", "spawn_subagent"]
    # a task file outside the parent's workspace, by an absolute path or by
    # climbing out: refused with a typed error, no child started
    for refused in done[:2]:
        assert refused["status"] == "error", refused
        assert "workspace" in refused["result"]["error"], refused
    # the child's own escapes are refused inside its sandbox
    changes = done[4]
    planted = corral.state_dir / "agents" / "parent" / "workspace" / "planted.txt"
    assert not planted.exists()
    assert not Path(f"/tmp/{PLANTED}").exists()
    assert not (corral.home / PLANTED).exists()  # the host's files are read-only to it
    assert SECRET not in json.dumps(changes)
    # nothing of the secret reached any record of the run (a command could
    # read it: the host's files are read-only, not invisible, docs/security.md)
    held = [path for path, data in corral.files_text()
            if SECRET.encode() in data and corral.state_dir in path.parents]
    assert held == [], held
