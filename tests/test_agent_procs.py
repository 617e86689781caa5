"""A real agent driving real procs, SIGKILLed (CORRAL_AGENT_FAULT) after its
handler asked procs for something and before the call was recorded as
started, and after it was recorded as started with no result: the
restarted agent runs the same call again, and procs, which keys a start by
the call, starts each command once and types a terminal's input once. The
input text itself is never in the WAL, the ledgers or the logs."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import zmq

from actors.kernel.settings import AgentSpec, write_spec
from actors.procs.host import new_proc_id
from actors.writer.client import WriterClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from tests.agentkit import write_task
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process

AGENT = "agent-1"
SECRET = "hunter2-typed"
TERMINAL = new_proc_id("terminal", AGENT, "t:1.0")  # the call ids of the script below
FIRST = new_proc_id("command", AGENT, "s:3.0")
# killed: after typing (nothing recorded), after starting a command (nothing
# recorded), after recording a start (no result)
FAULTS = "before_tool_start@2.0,before_tool_start@3.0,after_tool_start@4.0"


def _ping(peer: BrokerPeer) -> bool:
    try:
        reply = peer.request("procs", protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.2,
                             retries=0)
    except (RequestTimeoutError, RemoteError):
        return False
    return isinstance(reply, protocol.Pong)


def test_a_restarted_agent_runs_a_lost_call_again_and_procs_does_it_once(
    processes: ProcessTracker, state_dir: StateDir, tmp_path: Path,
) -> None:
    root = str(state_dir.root)
    processes.spawn(["-m", "actors.writer", "--state-dir", root], name="writer")
    processes.spawn(["-m", "broker.server", "--state-dir", root], name="broker")
    processes.spawn(["-m", "actors.procs", "--state-dir", root], name="procs")
    task = write_task(tmp_path / "t.yaml", [
        {"op": "terminal_start", "command": "python3 -i -q"},
        {"op": "terminal_input", "proc_id": TERMINAL,
         "text": f"x = '{SECRET}'; print('len', len(x) * 3)\n"},
        {"op": "bash_start", "command": "echo started >> first.txt"},
        {"op": "bash_start", "command": "echo started >> second.txt"},
        {"op": "bash_poll", "proc_id": FIRST},
        {"op": "terminal_input", "proc_id": TERMINAL, "text": "exit()\n"},
        {"op": "finish", "summary": "done"},
    ])
    ws = tmp_path / "ws"
    ws.mkdir()
    write_spec(state_dir, AGENT, AgentSpec(task=str(task), workspace=str(ws)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "probe")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        wait_for(lambda: _ping(peer), 20, "procs")
        kills = 0
        while True:
            agent = processes.spawn(["-m", "actors.agent", "--name", AGENT, "--state-dir", root],
                                    name=f"agent{kills}", env={"CORRAL_AGENT_FAULT": FAULTS})
            code = agent.wait(60)
            if code == 0:
                break
            assert code == -signal.SIGKILL, processes.output(f"agent{kills}")
            kills += 1
            assert kills <= 3
        assert kills == 3
        events = [(r.event, r.payload()) for r in writer.read_stream(f"agent/{AGENT}")]
        results = {p["call_id"]: p for e, p in events if e == "tool_result"}  # type: ignore[index]
        assert not any(e == "turn_aborted" for e, _ in events)  # every lost call ran again
        assert results["1.0"]["result"]["proc_id"] == TERMINAL  # type: ignore[index]
        assert results["3.0"]["result"]["proc_id"] == FIRST  # type: ignore[index]
        assert results["4.0"]["result"]["proc_id"] == new_proc_id(  # type: ignore[index]
            "command", AGENT, "s:4.0")
        facts = [(r.event, r.payload()) for r in writer.read_stream(f"procs/{AGENT}")]
        kinds = [e for e, _ in facts]
        assert kinds.count("proc_start") == 2
        assert kinds.count("terminal_start") == 1
        assert kinds.count("terminal_input") == 2  # the typed line once, and exit()
        wait_for(lambda: (ws / "first.txt").exists() and (ws / "second.txt").exists(), 10,
                 "both commands' output")
        assert (ws / "first.txt").read_text() == "started\n"
        assert (ws / "second.txt").read_text() == "started\n"
        # the session ended with the agent: the terminal's log is complete
        log = state_dir.agent_dir(AGENT) / ".terminals" / f"{TERMINAL}.log"
        wait_for(lambda: log.exists() and b"len 39" in log.read_bytes(), 10, "python's answer")
        assert log.read_bytes().count(b"len 39") == 1  # typed once, answered once
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)
    for directory in (state_dir.state_dir, state_dir.logs_dir):
        for path in directory.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path
