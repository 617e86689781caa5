"""Subagents end to end with the real agent loop: a scripted parent agent runs
`bash` through procs, spawns a child (a real agent process on a snapshot of
its workspace), reads the change set that came back through the broker,
applies it once (a second apply is refused), and the child's usage is
counted into the parent's budget. The patch also applies with real git.

The child's process: forked by the host's zygote (its parent is the host, its
argv the zygote's), a fresh interpreter without the zygote or when the
zygote fails; after a SIGKILL of the host neither the child nor the zygote
is left, and a restart resumes the child. The child runs on what remains of
its parent's budget; a relative task path stays inside the parent's
workspace."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from actors import zygotewire
from actors.changesets import manifest as mf
from actors.changesets import overlay
from actors.kernel import operator_input
from actors.kernel.ops import OpContext
from actors.kernel.settings import AgentSettings, AgentSpec, Budget, read_spec, write_spec
from actors.kernel.state import BudgetUse
from actors.procs.launch import GATE_CLOSED_EXIT
from actors.sessions.rebuild import rebuild
from actors.subagents import starter as starter_mod
from actors.subagents.host import remaining
from actors.subagents.ops import SpawnSubagentOp, spawn_subagent, task_path
from actors.writer.client import WriterClient
from broker import protocol
from broker.errors import PathRefusedError, RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from tests.processes import MARKER_ENV, ProcessTracker, wait_for

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


def _overlay_refused() -> str | None:
    with tempfile.TemporaryDirectory(prefix="corral-cow-probe-") as scratch:
        return overlay.probe(Path(scratch) / "p")


OVERLAY_REFUSED = _overlay_refused()  # None: the host mounts children's workspaces


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop_host(host: subprocess.Popen[bytes]) -> None:
    """SIGTERM: the host stops its children and its zygote, then exits 0."""
    kids = psutil.Process(host.pid).children()
    host.send_signal(signal.SIGTERM)
    assert host.wait(20) == 0
    wait_for(lambda: all(_gone(k.pid) for k in kids), 10, "the host's children to go")


def _ping(peer: BrokerPeer, to: str) -> bool:
    try:
        reply = peer.request(to, protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.2,
                             retries=0)
    except (RequestTimeoutError, RemoteError):
        return False
    return isinstance(reply, protocol.Pong)


@pytest.mark.process
@pytest.mark.parametrize(("faults", "host_args"), [
    ("", []), ("before_tool_start@2.0,after_tool_start@2.0", []), ("", ["--no-cow"])],
    ids=["uninterrupted", "parent-killed-around-its-spawn", "copied-workspace"])
def test_parent_spawns_child_reads_and_applies_its_change_set_once(
    processes: ProcessTracker, state_dir: StateDir, faults: str, host_args: list[str],
) -> None:
    """Killed after its spawn call came back with nothing recorded, and again
    after `tool_start`, the parent runs the call again (`replay_safe`) and
    gets the same child: one spawn, one change set, applied once. The child's
    workspace is an overlay of the parent's where the host can mount one
    (its `bash` through procs writes into it), a copy with --no-cow."""
    root = str(state_dir.root)
    processes.spawn(["-m", "actors.writer", "--state-dir", root], name="writer")
    processes.spawn(["-m", "broker.server", "--state-dir", root], name="broker")
    processes.spawn(["-m", "actors.procs", "--state-dir", root], name="procs")
    host = processes.spawn(["-m", "actors.subagents", "--state-dir", root, *host_args],
                           name="subagents")
    tmp = state_dir.root.parent
    ws = tmp / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src/app.py").write_text("def greet():\n    return 'hi'\n\nprint(greet())\n")
    (ws / "README.md").write_text("readme\n")
    (ws / "child.yaml").write_text(CHILD_TASK)  # the child's task: in the workspace
    original = tmp / "original"
    shutil.copytree(ws, original)
    (tmp / "parent.yaml").write_text(PARENT_TASK % (ws / "child.yaml"))
    write_spec(state_dir, "agent-1", AgentSpec(task=str(tmp / "parent.yaml"), workspace=str(ws)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "probe")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        wait_for(lambda: _ping(peer, "procs") and _ping(peer, "subagents"), 20, "hosts")
        kills = 0
        while True:
            agent = processes.spawn(["-m", "actors.agent", "--name", "agent-1", "--state-dir",
                                     root], name=f"agent{kills}",
                                    env={"CORRAL_AGENT_FAULT": faults})
            code = agent.wait(60)
            if code == 0:
                break
            assert code == -signal.SIGKILL, processes.output(f"agent{kills}")
            kills += 1
            assert kills <= 2
        assert kills == faults.count("@")
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
        assert "subagent_usage" in events and "turn_aborted" not in events
        facts = [r.event for r in writer.read_stream("subagents/agent-1")]
        assert facts == ["subagent_spawned", "subagent_ended", "subagent_applied"]
        sid = spawned["subagent_id"]
        child_events = [r.event for r in writer.read_stream(f"agent/agent-1.{sid}")]
        assert "tool_result" in child_events and "session_exit" in child_events
        directory = state_dir.agent_dir("agent-1") / "subagents" / sid
        receipt = json.loads((directory / mf.RECEIPT).read_text())
        assert receipt["changeset_id"] == sid
        cow = not host_args and OVERLAY_REFUSED is None
        assert overlay.is_overlay(directory / "base") == cow
        assert not os.path.ismount(directory / "work")  # unmounted once the set was built
        assert (directory / overlay.UPPER / "made_by_bash.txt").exists() == cow
        check = subprocess.run(["git", "apply", "--check", str(directory / mf.PATCH)],
                               cwd=original, capture_output=True, check=False)
        assert check.returncode == 0, check.stderr
        stats = peer.request("subagents", protocol.StatsRequest(msg_id="st"), timeout_s=5)
        assert isinstance(stats, protocol.Stats)
        assert stats.values["applied_total"] == 1 and stats.values["running_children"] == 0
        _stop_host(host)
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


@pytest.mark.process
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
    (ws / "child.yaml").write_text(CRASH_CHILD_TASK)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "agent-9")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        wait_for(lambda: _ping(peer, "procs") and _ping(peer, "subagents"), 20, "hosts")
        first = peer.request("subagents", protocol.SpawnSubagent(
            msg_id=new_msg_id("s"), parent="agent-9", workspace=str(ws),
            task=str(ws / "child.yaml"), wait_s=0), timeout_s=10)
        assert isinstance(first, protocol.SubagentReply)
        assert first.state == "running"
        child = f"agent-9.{first.subagent_id}"

        def child_in_bash() -> bool:
            return any(r.event == "proc_start" for r in writer.read_stream(f"procs/{child}"))

        wait_for(child_in_bash, 20, "the child inside its bash op")
        os.killpg(host.pid, signal.SIGKILL)  # the child dies with it (PDEATHSIG)
        host.wait()
        host = processes.spawn(["-m", "actors.subagents", "--state-dir", root],
                               name="subagents2")
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
        _stop_host(host)
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)


# --- the child's process --------------------------------------------------------------

ASKING_CHILD_TASK = """
name: child
steps:
  - {op: write_file, path: a.txt, content: "before the question\\n"}
  - {op: ask, question: "go on?"}
  - {op: write_file, path: b.txt, content: "after the answer\\n"}
  - {op: finish, summary: done}
"""


@dataclass
class Rig:
    """A writer and a broker, a peer named like a parent agent, a writer client."""

    state_dir: StateDir
    processes: ProcessTracker
    peer: BrokerPeer
    writer: WriterClient
    ws: Path

    def start_host(self, name: str, *extra: str,
                   env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        host = self.processes.spawn(
            ["-m", "actors.subagents", "--state-dir", str(self.state_dir.root), *extra],
            name=name, env=env)
        wait_for(lambda: _ping(self.peer, "subagents"), 20, "the subagents host")
        return host

    def request(self, message: protocol.Message, timeout_s: float = 10) -> Any:
        return self.peer.request("subagents", message, timeout_s=timeout_s, retries=0)

    def spawn(self, task: str, wait_s: float = 0) -> protocol.SubagentReply:
        reply = self.request(protocol.SpawnSubagent(
            msg_id=new_msg_id("s"), parent=self.peer.name, workspace=str(self.ws), task=task,
            wait_s=wait_s), timeout_s=wait_s + 10)
        assert isinstance(reply, protocol.SubagentReply)
        return reply

    def stats(self) -> dict[str, Any]:
        reply = self.request(protocol.StatsRequest(msg_id=new_msg_id("st")))
        assert isinstance(reply, protocol.Stats)
        return reply.values

    def registry(self) -> dict[str, dict[str, Any]]:
        raw = json.loads((self.state_dir.root / "subagents" / "registry.json").read_text())
        return {c["subagent_id"]: c for c in raw["children"]}

    def asking(self, child: str) -> bool:
        return bool(rebuild(self.writer, self.state_dir, child).state.pending_approvals())

    def answer(self, child: str) -> None:
        state = rebuild(self.writer, self.state_dir, child).state
        [request] = state.pending_approvals()
        # the child's `ask` is a question: the operator answers it (not an approval)
        operator_input.record_answer(self.writer, self.state_dir.agent_dir(child), child,
                                     state, request.request, text="go on")

    def changes(self, subagent_id: str) -> protocol.SubagentReply:
        reply = self.request(protocol.SubagentChanges(
            msg_id=new_msg_id("c"), parent=self.peer.name, subagent_id=subagent_id,
            wait_s=30), timeout_s=40)
        assert isinstance(reply, protocol.SubagentReply)
        return reply


@pytest.fixture
def rig(processes: ProcessTracker, state_dir: StateDir) -> Iterator[Rig]:
    root = str(state_dir.root)
    processes.spawn(["-m", "actors.writer", "--state-dir", root], name="writer")
    processes.spawn(["-m", "broker.server", "--state-dir", root], name="broker")
    ws = state_dir.root.parent / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("keep\n")
    (ws / "asking.yaml").write_text(ASKING_CHILD_TASK)  # in the workspace
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "agent-7")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        yield Rig(state_dir, processes, peer, writer, ws)
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)


def _zygotes(host_pid: int, *children: int) -> list[psutil.Process]:
    """The host's zygote (a forked child shows the same argv: `children` are left out)."""
    return [p for p in psutil.Process(host_pid).children()
            if p.pid not in children and "actors.zygote" in p.cmdline()]


@pytest.mark.process
@pytest.mark.parametrize("use_zygote", [True, False], ids=["zygote", "no-zygote"])
def test_child_is_a_fork_of_the_hosts_zygote_or_without_it_a_fresh_interpreter(
    rig: Rig, use_zygote: bool,
) -> None:
    """With the zygote the child's parent is the host and its argv is the
    zygote's (forked, never exec'd); with --no-zygote it is `python -m
    actors.agent`. Either way: stdout/stderr go to <child dir>/child.out, the
    supervisor's variables are not inherited, and the change set comes back."""
    supervised = {"CORRAL_CONTROL": f"ipc://{rig.state_dir.run_dir}/nobody.sock",
                  "CORRAL_ACTOR": "subagents"}
    host = rig.start_host("subagents", *([] if use_zygote else ["--no-zygote"]), env=supervised)
    if use_zygote:  # else the first spawn may find it still preloading: a fresh interpreter
        wait_for(lambda: rig.stats()["zygote_ready"] == 1, 20, "the zygote preloaded")
    first = rig.spawn(str(rig.ws / "asking.yaml"))
    assert first.state == "running"
    child = f"agent-7.{first.subagent_id}"
    wait_for(lambda: rig.asking(child), 20, "the child waiting for its answer")
    record = rig.registry()[first.subagent_id]
    proc = psutil.Process(record["pid"])
    assert proc.ppid() == host.pid
    zygotes = _zygotes(host.pid, proc.pid)
    if use_zygote:
        assert len(zygotes) == 1
        assert proc.cmdline() == zygotes[0].cmdline()
        assert "CORRAL_CONTROL" not in zygotes[0].environ()
    else:
        assert zygotes == []
        assert proc.cmdline()[1:5] == ["-m", "actors.agent", "--name", child]
    out = str(Path(record["directory"]) / "child.out")
    assert os.readlink(f"/proc/{proc.pid}/fd/1") == out
    assert os.readlink(f"/proc/{proc.pid}/fd/2") == out
    assert "CORRAL_CONTROL" not in proc.environ()
    rig.answer(child)
    reply = rig.changes(first.subagent_id)
    assert reply.state == "ended", reply
    assert reply.manifest is not None
    assert {f["path"] for f in json.loads(reply.manifest)["files"]} == {"a.txt", "b.txt"}
    stats = rig.stats()
    assert stats["zygote_forks_total"] == (1 if use_zygote else 0)
    assert stats["interpreter_starts_total"] == (0 if use_zygote else 1)
    _stop_host(host)


@pytest.mark.process
def test_host_sigkilled_leaves_no_child_or_zygote_and_a_restart_resumes_the_child(
    rig: Rig,
) -> None:
    """PDEATHSIG takes the forked child and the zygote with the host; the
    restarted host starts the child again (as its own child) and the child
    carries on from its stream (its question still pending)."""
    host = rig.start_host("subagents")
    wait_for(lambda: rig.stats()["zygote_ready"] == 1, 20, "the zygote preloaded")
    first = rig.spawn(str(rig.ws / "asking.yaml"))
    child = f"agent-7.{first.subagent_id}"
    wait_for(lambda: rig.asking(child), 20, "the child waiting for its answer")
    pid = rig.registry()[first.subagent_id]["pid"]
    [template] = _zygotes(host.pid, pid)
    assert psutil.Process(pid).cmdline() == template.cmdline()  # a fork of the zygote
    os.killpg(host.pid, signal.SIGKILL)
    host.wait()
    wait_for(lambda: _gone(pid) and _gone(template.pid), 10, "the child and the zygote to die")
    host = rig.start_host("subagents2")
    wait_for(lambda: rig.registry()[first.subagent_id]["starts"] == 2, 20, "the child resumed")
    resumed = psutil.Process(rig.registry()[first.subagent_id]["pid"])
    assert resumed.pid != pid
    # forked, or fresh if the new zygote was still preloading: either way the
    # host's own child, once the go-between of its double fork has exited (the
    # registry may name it before the host has adopted it)
    wait_for(lambda: resumed.ppid() == host.pid, 10, "the resumed child adopted by the host")
    rig.answer(child)
    reply = rig.changes(first.subagent_id)
    assert reply.state == "ended", reply
    assert reply.manifest is not None
    assert {f["path"] for f in json.loads(reply.manifest)["files"]} == {"a.txt", "b.txt"}
    _stop_host(host)


def test_a_zygote_that_dies_before_ready_falls_back_to_a_fresh_interpreter(
    processes: ProcessTracker, state_dir: StateDir, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken zygote costs a failure, not the child: it starts as a fresh
    interpreter (held at its gate: abandoned here, it exits unrun); after
    ZYGOTE_MAX_FAILURES failures in a row no zygote is started any more."""
    monkeypatch.setenv(MARKER_ENV, processes.marker)  # the leak check sees our processes
    starter = starter_mod.ChildStarter(state_dir, zygote_args=["--no-such-option"])
    directory = state_dir.root / "child"
    directory.mkdir()
    for failures in range(1, starter_mod.ZYGOTE_MAX_FAILURES + 1):
        started = starter.start("child", directory)
        started.abandon()
        assert started.via == "interpreter"
        _, status = os.waitpid(started.pid, 0)
        assert os.waitstatus_to_exitcode(status) == GATE_CLOSED_EXIT
        assert starter.zygote is not None and starter.zygote.pid is not None
        zygote_pid = starter.zygote.pid
        _, status = os.waitpid(zygote_pid, 0)
        assert starter.reaped(zygote_pid, status)
        assert starter.failures == failures and starter.zygote is None
    assert not starter.use_zygote
    started = starter.start("child", directory)
    started.abandon()
    os.waitpid(started.pid, 0)
    assert starter.zygote is None
    assert starter.counts == {"zygote": 0, "interpreter": starter_mod.ZYGOTE_MAX_FAILURES + 1}


def test_zygote_request_format_keeps_the_old_form_and_carries_an_output_path() -> None:
    assert (zygotewire.parse_request(zygotewire.fork_request("agent-1"))
            == zygotewire.ForkRequest("agent-1"))
    data = zygotewire.fork_request("a.s-0123456789ab", "/tmp/with space/child.out")
    assert data == b"fork a.s-0123456789ab /tmp/with space/child.out"
    assert zygotewire.parse_request(data) == zygotewire.ForkRequest(
        "a.s-0123456789ab", b"/tmp/with space/child.out")
    assert zygotewire.parse_request(b"spoon agent-1") is None
    assert zygotewire.parse_request(b"fork") is None
    assert zygotewire.parse_reply(b"ready 42") == zygotewire.Ready(42)
    assert zygotewire.parse_reply(b"forked agent-1 43") == zygotewire.Forked("agent-1", 43)
    assert zygotewire.parse_reply(b"failed agent-1 out of memory") == zygotewire.ForkFailed(
        "agent-1", "out of memory")


# --- budget and task path ---------------------------------------------------------------

@pytest.mark.parametrize(("limit", "used", "left"), [
    (Budget(), BudgetUse(tokens_used=10**9, cost_used=1e9), Budget()),
    (Budget(tokens=1000), BudgetUse(tokens_used=300), Budget(tokens=700)),
    (Budget(tokens=1000), BudgetUse(tokens_used=1200, extra_tokens=500), Budget(tokens=300)),
    (Budget(tokens=1000), BudgetUse(tokens_used=5000), Budget(tokens=0)),
    (Budget(cost_units=2.0), BudgetUse(cost_used=0.5, extra_cost=1.0),
     Budget(cost_units=2.5)),
    (Budget(tokens=10, cost_units=1.0), BudgetUse(tokens_used=3, cost_used=4.0),
     Budget(tokens=7, cost_units=0.0)),
])
def test_remaining_budget_is_limit_plus_extra_minus_use_floored_at_zero(
    limit: Budget, used: BudgetUse, left: Budget,
) -> None:
    assert remaining(limit, used) == left


def test_a_task_path_resolves_inside_the_workspace_and_cannot_escape(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    (ws / "tasks").mkdir(parents=True)
    (ws / "tasks/child.yaml").write_text("name: child\n")
    (tmp_path / "outside.yaml").write_text("name: outside\n")
    (ws / "out").symlink_to(tmp_path)
    assert task_path(ws, "tasks/child.yaml") == str((ws / "tasks/child.yaml").resolve())
    # an absolute path: inside the workspace as a relative one, else refused
    assert task_path(ws, str(ws / "tasks/child.yaml")) == str((ws / "tasks/child.yaml").resolve())
    with pytest.raises(PathRefusedError):
        task_path(ws, str(tmp_path / "outside.yaml"))
    with pytest.raises(PathRefusedError):
        task_path(ws, str(ws / "out/outside.yaml"))  # inside by name, a link out
    for escape in ("../outside.yaml", "out/outside.yaml", "~/x.yaml", "tasks/../../x"):
        with pytest.raises(PathRefusedError):
            task_path(ws, escape)
    # the op resolves before it asks the host: an escape never leaves the agent
    ctx = OpContext(agent="a1", workspace=ws, memory_dir=tmp_path,
                    state_dir=StateDir(tmp_path / ".corral"))
    with pytest.raises(PathRefusedError):
        spawn_subagent(SpawnSubagentOp(task="../outside.yaml"), ctx)


@pytest.mark.process
def test_child_gets_what_remains_of_its_parents_budget_and_its_task_from_the_workspace(
    rig: Rig,
) -> None:
    """The child's spec holds the parent's remaining budget (bounds plus
    granted extra minus use); a parent with none left is refused; a relative
    task path names a file in the parent's workspace, an escape is refused."""
    (rig.ws / "tasks").mkdir()
    (rig.ws / "tasks/child.yaml").write_text("name: child\nsteps:\n  - {op: finish}\n")
    (rig.ws / "out").symlink_to(rig.ws.parent)
    write_spec(rig.state_dir, "agent-7", AgentSpec(
        task=str(rig.ws / "tasks/child.yaml"), workspace=str(rig.ws),
        settings=AgentSettings(budget=Budget(tokens=1000, cost_units=2.0))))
    stream = "agent/agent-7"
    rig.writer.append(stream, "subagent_usage", {"tokens": 700, "cost_units": 0.5}, key="u1")
    rig.writer.append(stream, "budget_resumed", {"tokens": 100}, key="r1")
    host = rig.start_host("subagents")
    reply = rig.spawn("tasks/child.yaml", wait_s=30)
    assert reply.state == "ended", reply
    spec = read_spec(rig.state_dir, f"agent-7.{reply.subagent_id}")
    assert spec is not None
    assert spec.settings.budget == Budget(tokens=400, cost_units=1.5)
    assert spec.task == str((rig.ws / "tasks/child.yaml").resolve())
    for escape in ("../asking.yaml", "out/asking.yaml"):
        with pytest.raises(RemoteError, match="refused"):
            rig.spawn(escape)
    rig.writer.append(stream, "subagent_usage", {"tokens": 400}, key="u2")
    with pytest.raises(RemoteError, match="budget"):
        rig.spawn("tasks/child.yaml")
    _stop_host(host)
