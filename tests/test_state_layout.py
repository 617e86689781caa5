"""docs/state-layout.md classifies every path under `.corral/`: a full session
(every op, a terminal, a background command, a subagent whose change set is
applied, an operator answer, a second `supervisor run` in the same
directory (a second session of the same agent), the session commands, then
a rewind and a fork of the stopped session) run by the real runtime, then
every file left under `.corral/` must match a row of the document's table
(its patterns are parsed from the document itself).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import zmq

from broker.statedir import StateDir
from tests.processes import REPO_ROOT, ProcessTracker
from tests.test_supervisor_process import cli
from tests.test_supervisor_run import fast_config
from tests.test_writer import start_writer

pytestmark = pytest.mark.process

DOC = REPO_ROOT / "docs" / "state-layout.md"
TIERS = {"recovery-core", "persist", "audit", "cache", "outside"}
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([a-z-]+)\s*\|")

CHILD = """
name: child
steps:
  - {op: write_file, path: from_child.txt, content: "child\\n"}
  - {op: finish, summary: child done}
"""

FULL = """
name: full
steps:
  - {op: write_file, path: a.txt, content: "one\\n"}
  - {op: edit_file, path: a.txt, old: one, new: two}
  - {op: read_file, path: a.txt}
  - {op: list_dir, path: "."}
  - {op: search, text: two}
  - {op: memory_write, key: note, content: remembered}
  - {op: memory_read, key: note}
  - {op: todos, items: [{text: check, done: false}]}
  - {op: bash, command: "echo hi > b.txt"}
  - {op: bash_start, command: "echo background"}
  - {op: bash_poll, proc_id: "{last_command}"}
  - {op: bash_kill, proc_id: "{last_command}"}
  - {op: terminal_start, command: "cat"}
  - {op: terminal_input, proc_id: "{last_terminal}", text: "typed\\n"}
  - {op: terminal_read, proc_id: "{last_terminal}"}
  - {op: terminal_end, proc_id: "{last_terminal}"}
  - {op: write_file, path: child.yaml, content: %s}
  - {op: spawn_subagent, task: child.yaml, descriptor: helper}
  - {op: subagent_changes, subagent_id: latest}
  - {op: apply_subagent, subagent_id: latest}
  - {op: ask, question: "all good?"}
  - {op: finish, summary: everything}
"""


def classification() -> list[tuple[str, str]]:
    """(pattern, tier) for every row of the document's table."""
    rows = [(m.group(1), m.group(2)) for line in DOC.read_text().splitlines()
            if (m := ROW.match(line))]
    assert len(rows) > 20, "the table of docs/state-layout.md was not found"
    bad = [r for r in rows if r[1] not in TIERS]
    assert bad == [], f"rows with an unknown tier: {bad}"
    return rows


def matches(rel: str, pattern: str) -> bool:
    """`*` is one path component (or part of one), `**` any number of them."""
    regex = "".join(
        ".*" if part == "**" else "[^/]*" if part == "*" else re.escape(part)
        for part in re.split(r"(\*\*|\*)", pattern))
    return re.fullmatch(regex, rel) is not None


def unclassified(root: Path, rows: list[tuple[str, str]]) -> list[str]:
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        rel = str(path.relative_to(root))
        if not any(matches(rel, pattern) for pattern, _ in rows):
            out.append(rel)
    return out


def test_the_pattern_matcher() -> None:
    assert matches("agents/a1/state/generations/gen-1.json", "agents/*/state/generations/*")
    assert not matches("agents/a1/x/state/snapshot.json", "agents/*/state/snapshot.json")
    assert matches("agents/a1/workspace/d/e/f.txt", "agents/*/workspace/**")
    assert not fnmatchcase("x", "y")
    rows = classification()
    assert unclassified(REPO_ROOT / "config", rows)  # files the table does not name fail


@pytest.mark.timeout(240)  # two whole runtimes on a shared machine; ~15 s when idle
def test_every_file_of_a_full_session_is_classified(
        processes: ProcessTracker, state_dir: StateDir) -> None:
    rows = classification()
    tmp = state_dir.root.parent
    (tmp / "full.yaml").write_text(FULL % json.dumps(CHILD))  # the child's task: in the workspace
    config = fast_config(state_dir, agent={"approval_poll_ms": 20}, timeout_s=120,
                         tasks=[str(tmp / "full.yaml")])
    # twice: `supervisor run` again in the same directory is a new session of
    # agent-1 (the case: it used to find the first one finished)
    for attempt in (1, 2):
        done = subprocess.run(
            [sys.executable, "-m", "supervisor.cli", "run", str(config), "--agents", "1",
             "--state-dir", str(state_dir.root)],
            env=processes.env(), capture_output=True, text=True, timeout=150, check=False)
        assert done.returncode == 0, (attempt, done.stdout + done.stderr)
        assert "1/1 agents finished" in done.stdout  # the ask answered by run's rules
    listed = cli(processes, state_dir, "sessions", "list", "--agent", "agent-1", "--json")
    assert listed.returncode == 0, listed.stderr
    sessions = json.loads(listed.stdout)
    assert [(s["number"], s["status"], s["turns"]) for s in sessions] == [
        (1, "finished", 22), (2, "finished", 22)]  # the 22 steps of FULL
    assert sessions[1]["previous"] == sessions[0]["session_id"]
    children = [s for s in sessions if s["parent_agent"]]
    assert children == []  # the subagents' sessions are their own agents'
    child = cli(processes, state_dir, "sessions", "list", "--json")
    lineage = [(s["agent"].split(".")[0], s["parent_session"]) for s in json.loads(child.stdout)
               if s["parent_agent"] == "agent-1"]
    assert sorted(lineage) == [("agent-1", sessions[0]["session_id"]),
                               ("agent-1", sessions[1]["session_id"])]
    assert cli(processes, state_dir, "sessions", "archive", sessions[0]["session_id"]
               ).returncode == 0
    workspace = state_dir.agent_dir("agent-1") / "workspace"
    assert (workspace / "from_child.txt").read_text() == "child\n"  # the subagent's change
    files = [p for p in state_dir.root.rglob("*") if p.is_file()]
    assert len(files) > 20
    assert (state_dir.root / "sessions" / sessions[1]["session_id"] / "transcript.jsonl"
            ).exists()
    # a rewind and a fork of the stopped session, with the writer alone running
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        start_writer(processes, state_dir, ctx)
        rewound = cli(processes, state_dir, "rewind", "agent-1", "--to-turn", "5")
        assert rewound.returncode == 0, rewound.stdout + rewound.stderr
        forked = cli(processes, state_dir, "fork", "agent-1", "--name", "forked",
                     "--at-turn", "3")
        assert forked.returncode == 0, forked.stdout + forked.stderr
    finally:
        ctx.destroy(linger=0)
    assert (state_dir.agent_dir("forked") / "workspace").is_dir()
    assert unclassified(state_dir.root, rows) == []
