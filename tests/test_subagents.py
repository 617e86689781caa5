"""Subagents end to end with the real agent loop: a scripted parent agent runs
`bash` through procs, spawns a child (a real agent process on a snapshot of
its workspace), reads the change set that came back through the broker,
applies it once (a second apply is refused), and the child's usage is
counted into the parent's budget. The patch also applies with real git."""

from __future__ import annotations

import json
import os
import shutil
import signal
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


CRASH_CHILD_TASK = """
name: child
steps:
  - {op: write_file, path: before.txt, content: "before the crash\\n"}
  - {op: bash, command: "sleep 1.5"}
  - {op: write_file, path: after.txt, content: "after the crash\\n"}
  - {op: finish, summary: done}
"""


def test_host_sigkilled_mid_child_resumes_the_child_and_delivers_its_change_set(
    processes: ProcessTracker, state_dir: StateDir,
) -> None:
    root = str(state_dir.root)
    processes.spawn(["-m", "actors.writer", "--state-dir", root], name="writer")
    processes.spawn(["-m", "broker.server", "--state-dir", root], name="broker")
    processes.spawn(["-m", "actors.procs", "--state-dir", root], name="procs")
    host = processes.spawn(["-m", "actors.subagents", "--state-dir", root], name="subagents")
    tmp = state_dir.root.parent
    ws = tmp / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("keep\n")
    (tmp / "child.yaml").write_text(CRASH_CHILD_TASK)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "agent-9")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        wait_for(lambda: _ping(peer, "procs") and _ping(peer, "subagents"), 20, "hosts")
        first = peer.request("subagents", protocol.SpawnSubagent(
            msg_id=new_msg_id("s"), parent="agent-9", workspace=str(ws),
            task=str(tmp / "child.yaml"), wait_s=0), timeout_s=10)
        assert isinstance(first, protocol.SubagentReply)
        assert first.state == "running"
        child = f"agent-9.{first.subagent_id}"

        def child_in_bash() -> bool:
            return any(r.event == "proc_start" for r in writer.read_stream(f"procs/{child}"))

        wait_for(child_in_bash, 20, "the child inside its bash op")
        os.killpg(host.pid, signal.SIGKILL)  # the child dies with it (PDEATHSIG)
        host.wait()
        processes.spawn(["-m", "actors.subagents", "--state-dir", root], name="subagents2")
        wait_for(lambda: _ping(peer, "subagents"), 20, "the restarted host")
        reply = peer.request("subagents", protocol.SubagentChanges(
            msg_id=new_msg_id("c"), parent="agent-9", subagent_id="latest", wait_s=30),
            timeout_s=40, retries=0)
        assert isinstance(reply, protocol.SubagentReply)
        assert reply.state == "ended", reply
        assert reply.manifest is not None
        manifest = json.loads(reply.manifest)
        assert manifest["status"] == "ready"
        assert {f["path"] for f in manifest["files"]} == {"before.txt", "after.txt"}
        registry = json.loads((state_dir.root / "subagents" / "registry.json").read_text())
        assert registry["children"][0]["starts"] == 2
        assert not (ws / "after.txt").exists()  # nothing reaches the parent before an apply
        applied = peer.request("subagents", protocol.ApplySubagent(
            msg_id=new_msg_id("a"), parent="agent-9", subagent_id="latest"), timeout_s=10)
        assert isinstance(applied, protocol.SubagentReply)
        assert applied.state == "applied" and applied.refusal is None
        assert (ws / "after.txt").read_text() == "after the crash\n"
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)
