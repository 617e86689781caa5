"""Rewind and fork as real processes over a real writer: the agent runs a
scripted session of file ops and `bash` edits (writer, broker, procs),
`supervisor rewind` and `supervisor fork` run as CLI
processes SIGKILLed (CORRAL_TREES_FAULT, actors/trees/layout.py) at every
step; after each kill the state is the old branch or the new one, never a
mix; a retry (or the agent's own start) completes; the resumed agent runs
the rewound turns again to the same final workspace."""

from __future__ import annotations

import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.kernel.fold import fold
from actors.kernel.settings import write_spec
from actors.kernel.state import AgentState
from actors.sessions.rebuild import rebuild
from actors.trees import branch
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from supervisor import trace
from tests.agentkit import spec, tree, write_task
from tests.processes import ProcessTracker
from tests.test_writer import start_writer

pytestmark = pytest.mark.process

STEPS: list[Any] = [  # file ops and bash edits (through the real procs and its sandbox)
    {"op": "write_file", "path": "a.txt", "content": "one\n"},
    {"op": "bash", "command": "mkdir -p d && printf 'two\\n' > d/b.txt"},
    {"op": "edit_file", "path": "a.txt", "old": "one", "new": "ONE"},
    {"op": "bash", "command": "printf 'three\\n' > d/c.txt && rm d/b.txt && ln -s c.txt d/link"},
    {"op": "finish", "summary": "done"},
]
AT_TWO = {"a.txt": "one\n", "d/b.txt": "two\n"}
FINAL = {"a.txt": "ONE\n", "d/c.txt": "three\n", "d/link": "three\n"}


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def run_agent(processes: ProcessTracker, state_dir: StateDir, name: str) -> int:
    return processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir",
                            str(state_dir.root)], name=name).wait(timeout=40)


def cli(processes: ProcessTracker, state_dir: StateDir, *args: str, fault: str = "") -> int:
    env = {"CORRAL_TREES_FAULT": fault} if fault else None
    proc = processes.spawn(["-m", "supervisor.cli", *args, "--state-dir", str(state_dir.root)],
                           name=f"cli-{args[0]}", env=env)
    return proc.wait(timeout=30)


def active_state(writer: WriterClient, name: str) -> AgentState:
    events = [(r.seq, r.event, r.payload()) for r in writer.read_stream(f"agent/{name}")]
    return fold(AgentState(), branch.active(events))


@pytest.mark.timeout(180)  # about 17 interpreters in a row: 9 s in CI, far more at load ~10
def test_sigkill_at_every_step_of_rewind_and_fork(
        processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
        tmp_path: Path) -> None:
    start_writer(processes, state_dir, ctx)
    processes.spawn(["-m", "broker.server", "--state-dir", str(state_dir.root)], name="broker")
    processes.spawn(["-m", "actors.procs", "--state-dir", str(state_dir.root)], name="procs")
    write_spec(state_dir, "a1", spec(write_task(tmp_path / "t.yaml", STEPS)))
    assert run_agent(processes, state_dir, "a1") == 0
    ws = state_dir.agent_dir("a1") / "workspace"
    assert tree(ws) == FINAL, processes.output("a1")
    assert os.readlink(ws / "d" / "link") == "c.txt"
    with WriterClient(ctx, state_dir, "probe") as writer:
        before = active_state(writer, "a1")
        assert before.phase == "finished"
        for point in ("rewind:after_intent", "rewind:after_restore"):
            code = cli(processes, state_dir, "rewind", "a1", "--to-turn", "2", fault=point)
            assert code == -signal.SIGKILL, processes.output("cli-rewind")
            assert active_state(writer, "a1") == before  # still the old branch
            assert tree(ws) in (FINAL, AT_TWO)  # restore is idempotent: finished on retry
        # the agent's own start finishes the rewind a crash cut short
        assert run_agent(processes, state_dir, "a1") == 0
        assert tree(ws) == FINAL  # it rewound to turn 2, then ran turns 3.. again
        turns = [p["turn"] for e, p in
                 ((r.event, r.payload()) for r in writer.read_stream("agent/a1"))
                 if e == "turn"]
        assert turns == [1, 2, 3, 4, 5, 3, 4, 5]
        # a fact appended, then a kill before the intent is gone: the retry is a no-op
        code = cli(processes, state_dir, "rewind", "a1", "--to-turn", "2",
                   fault="rewind:after_fact")
        assert code == -signal.SIGKILL
        assert tree(ws) == AT_TWO  # bash's edits undone, its deleted file back, its link gone
        assert not (ws / "d" / "link").is_symlink()
        rewound = active_state(writer, "a1")
        assert rewound.turn == 2 and rewound.phase == "running"
        assert cli(processes, state_dir, "rewind", "a1", "--to-turn", "2") == 0
        assert active_state(writer, "a1") == rewound  # repeated: no second record
        assert sum(1 for r in writer.read_stream("agent/a1") if r.event == "rewind") == 2
        # fork, killed at every step: nothing published, nothing left behind
        for point in ("fork:after_intent", "fork:after_workspace", "fork:before_fact"):
            code = cli(processes, state_dir, "fork", "a1", "--name", "kid", "--at-turn", "1",
                       fault=point)
            assert code == -signal.SIGKILL, processes.output("cli-fork")
            assert next(iter(writer.read_stream("agent/kid")), None) is None
        assert cli(processes, state_dir, "fork", "a1", "--name", "kid", "--at-turn", "1") == 0
        assert not list((state_dir.root / "agents").glob(".fork-*"))
        assert not list((state_dir.root / "trees" / "forks").glob("*.json"))
        kid_ws = state_dir.agent_dir("kid") / "workspace"
        assert tree(kid_ws) == {"a.txt": "one\n"}
        assert run_agent(processes, state_dir, "kid") == 0
        assert run_agent(processes, state_dir, "a1") == 0
        assert tree(kid_ws) == tree(ws) == FINAL  # both ran on, each in its own files
        assert os.readlink(kid_ws / "d" / "link") == "c.txt"
        kid_events = [r.event for r in writer.read_stream("agent/kid")]
        assert kid_events[0] == "session_fork"
        for name in ("a1", "kid"):
            assert rebuild(writer, state_dir, name).state == active_state(writer, name)
    out = io.StringIO()
    assert trace.run(state_dir, "a1", since=1, follow=False, json_out=True, out=out) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    gone = {r["seq"] for r in rows if r.get("abandoned")}
    assert gone and all(r["event"] != "rewind" for r in rows if r["seq"] in gone)
    assert {r["event"] for r in rows} >= {"rewind", "workspace_tree"}
