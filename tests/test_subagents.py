"""Subagents end to end with the real agent loop: a scripted parent agent runs
`bash` through procs, spawns a child (a real agent process on a snapshot of
its workspace), reads the change set that came back through the broker,
applies it once (a second apply is refused), and the child's usage is
counted into the parent's budget. The patch also applies with real git."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import zmq

from actors.agent.settings import AgentSpec, write_spec
from actors.changesets import manifest as mf
from actors.writer_client import WriterClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process

CHILD_TASK = """
name: child
steps:
  - {op: edit_file, path: src/app.py, old: "greet", new: "welcome", replace_all: true}
  - {op: write_file, path: docs/NOTES.md, content: "written by the child\\n"}
  - {op: bash, command: "echo from-child-bash > made_by_bash.txt"}
  - {op: finish, summary: renamed}
"""

PARENT_TASK = """
name: parent
steps:
  - {op: bash, command: "echo parent-was-here"}
  - {op: spawn_subagent, task: "%s", descriptor: renamer}
  - {op: subagent_changes, subagent_id: latest}
  - {op: apply_subagent, subagent_id: latest}
  - {op: apply_subagent, subagent_id: latest}
  - {op: finish, summary: delegated}
"""


def _ping(peer: BrokerPeer, to: str) -> bool:
    try:
        reply = peer.request(to, protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.2,
                             retries=0)
    except (RequestTimeoutError, RemoteError):
        return False
    return isinstance(reply, protocol.Pong)


def test_parent_spawns_child_reads_and_applies_its_change_set_once(
    processes: ProcessTracker, state_dir: StateDir,
) -> None:
    root = str(state_dir.root)
    processes.spawn(["-m", "actors.writer", "--state-dir", root], name="writer")
    processes.spawn(["-m", "broker.server", "--state-dir", root], name="broker")
    processes.spawn(["-m", "actors.procs", "--state-dir", root], name="procs")
    processes.spawn(["-m", "actors.subagents", "--state-dir", root], name="subagents")
    tmp = state_dir.root.parent
    ws = tmp / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src/app.py").write_text("def greet():\n    return 'hi'\n\nprint(greet())\n")
    (ws / "README.md").write_text("readme\n")
    original = tmp / "original"
    shutil.copytree(ws, original)
    (tmp / "child.yaml").write_text(CHILD_TASK)
    (tmp / "parent.yaml").write_text(PARENT_TASK % (tmp / "child.yaml"))
    write_spec(state_dir, "agent-1", AgentSpec(task=str(tmp / "parent.yaml"), workspace=str(ws)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "probe")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        wait_for(lambda: _ping(peer, "procs") and _ping(peer, "subagents"), 20, "hosts")
        agent = processes.spawn(["-m", "actors.agent", "--name", "agent-1", "--state-dir", root],
                                name="agent")
        assert agent.wait(60) == 0, processes.output("agent")
        # the child's edits are in the parent's workspace, applied once
        assert "def welcome()" in (ws / "src/app.py").read_text()
        assert (ws / "docs/NOTES.md").read_text() == "written by the child\n"
        assert (ws / "made_by_bash.txt").read_text() == "from-child-bash\n"
        results = [r.payload() for r in writer.read_stream("agent/agent-1")
                   if r.event == "tool_result"]
        by_op = [(r["op"], r["status"]) for r in results]  # type: ignore[index]
        assert by_op == [("bash", "ok"), ("spawn_subagent", "ok"), ("subagent_changes", "ok"),
                         ("apply_subagent", "ok"), ("apply_subagent", "error"), ("finish", "ok")]
        assert "already_applied" in results[4]["result"]["error"]  # type: ignore[index]
        assert results[0]["result"]["output"] == "parent-was-here\n"  # type: ignore[index]
        spawned = results[1]["result"]  # type: ignore[index]
        assert spawned["status"] == "ready"
        assert {f["path"] for f in spawned["files"]} == {"src/app.py", "docs/NOTES.md",
                                                         "made_by_bash.txt"}
        events = [r.event for r in writer.read_stream("agent/agent-1")]
        assert "subagent_usage" in events
        facts = [r.event for r in writer.read_stream("subagents/agent-1")]
        assert facts == ["subagent_spawned", "subagent_ended", "subagent_applied"]
        sid = spawned["subagent_id"]
        child_events = [r.event for r in writer.read_stream(f"agent/agent-1.{sid}")]
        assert "tool_result" in child_events and "session_exit" in child_events
        directory = state_dir.agent_dir("agent-1") / "subagents" / sid
        receipt = json.loads((directory / mf.RECEIPT).read_text())
        assert receipt["changeset_id"] == sid
        check = subprocess.run(["git", "apply", "--check", str(directory / mf.PATCH)],
                               cwd=original, capture_output=True, check=False)
        assert check.returncode == 0, check.stderr
        stats = peer.request("subagents", protocol.StatsRequest(msg_id="st"), timeout_s=5)
        assert isinstance(stats, protocol.Stats)
        assert stats.values["applied_total"] == 1 and stats.values["running_children"] == 0
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)
