"""Operator input as real processes over a real writer: an answer to the
model's question and a correction are each delivered to the model exactly
once, at the next model request, whatever SIGKILL hits the agent between the
input being recorded and that request (fault points of actors/agent/faults.py:
the `ask` call started and settled, before and after the consumption fact,
after the model replied and before its turn was recorded). The scripted model
echoes the sha256 of each input it received, so the test counts deliveries
and checks the exact text arrived. The text itself never enters the WAL.
Answers to unknown or settled questions and corrections to a finished session
are refused; an approval never answers a question and an answer never grants
a permission."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.kernel import operator_input
from actors.kernel.operator_input import InputRefusedError, record_answer, record_correction
from actors.kernel.settings import Rule, write_spec
from actors.kernel.state import AgentState
from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from supervisor.cli.agents import answer_approval
from tests.agentkit import FakeWriter, spec, write_task
from tests.processes import ProcessTracker, wait_for
from tests.test_writer import start_writer

ANSWER = "Blue, and keep the old name: ünïcode ok\nsecond line"
CORRECTION = "Stop editing a.txt; write b.txt instead. (correction 1)"
Q_FAULTS = ("after_tool_start@1.0,after_tool_result@1.0,before_input_consumed@t2,"
            "after_input_consumed@t2,after_model_reply@t2")
C_FAULTS = "before_input_consumed@t2,after_input_consumed@t2,after_model_reply@t2"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start(processes: ProcessTracker, state_dir: StateDir, name: str, run: int,
          faults: str) -> subprocess.Popen[bytes]:
    return processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir",
                            str(state_dir.root), "--no-broker"], name=f"{name}-{run}",
                           env={"CORRAL_AGENT_FAULT": faults})


def run_to_end(processes: ProcessTracker, state_dir: StateDir,
               agents: dict[str, tuple[Any, str, int]]) -> None:
    """Wait for the agents (name: (process, faults, kills)) side by side; restart
    each after every injected SIGKILL; exactly `kills` of them each."""
    live = {name: [proc, 0] for name, (proc, _, _) in agents.items()}

    def step() -> bool:
        for name, entry in live.items():
            code = entry[0].poll()
            if code is None or code == 0:
                continue
            assert code == -signal.SIGKILL, processes.output(f"{name}-{entry[1]}")
            entry[1] += 1
            assert entry[1] <= agents[name][2]
            entry[0] = start(processes, state_dir, name, entry[1], agents[name][1])
        return all(entry[0].poll() == 0 for entry in live.values())

    # q alone runs six interpreters in a row: ~10 s at load 5, several times that at 10
    wait_for(step, 100, "the agents to finish", interval_s=0.02)
    assert {n: e[1] for n, e in live.items()} == {n: a[2] for n, a in agents.items()}


def delivered(events: list[tuple[str, Any]], sha: str) -> int:
    """How many model turns say they received the input whose text hashes to sha."""
    return sum(1 for e, p in events if e == "turn" and f"sha256={sha}" in (p.get("text") or ""))


@pytest.mark.timeout(180)  # eleven interpreters, six of them in a row: slow on a loaded host
def test_answer_and_correction_delivered_exactly_once_through_sigkills(
        processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
        tmp_path: Path) -> None:
    start_writer(processes, state_dir, ctx)
    qtask = write_task(tmp_path / "q.yaml", [
        {"op": "ask", "question": "Which colour?"},
        {"op": "write_file", "path": "a.txt", "content": "a"}, {"op": "finish"}])
    ctask = write_task(tmp_path / "c.yaml", [
        {"op": "write_file", "path": "release/n.md", "content": "n"},
        {"op": "write_file", "path": "b.txt", "content": "b"}, {"op": "finish"}])
    write_spec(state_dir, "q", spec(qtask, approval_poll_ms=20))
    write_spec(state_dir, "c", spec(ctask, rules=[
        Rule(op="write_file", path="release/*", decision="ask")], approval_poll_ms=20))
    with WriterClient(ctx, state_dir, "operator") as op:
        def state(name: str) -> AgentState:
            return rebuild(op, state_dir, name).state

        def pending(name: str) -> Callable[[], list[Any]]:
            return lambda: state(name).pending_approvals()

        q = start(processes, state_dir, "q", 0, Q_FAULTS)
        c = start(processes, state_dir, "c", 0, C_FAULTS)
        [question] = wait_for(pending("q"), 20, "q's question")
        [permission] = wait_for(pending("c"), 20, "c's permission request")
        assert question.kind == "clarification" and question.question == "Which colour?"
        # an approval never answers a question; an answer never grants a permission
        with pytest.raises(LookupError, match="never answers a question"):
            answer_approval(op, "q", state("q"), question.request, decision="approve",
                            always=False, note="yes")
        with pytest.raises(InputRefusedError, match="never grants"):
            record_answer(op, state_dir.agent_dir("c"), "c", state("c"), permission.request,
                          text="yes")
        with pytest.raises(InputRefusedError, match=r"no question req-9\.0"):
            record_answer(op, state_dir.agent_dir("q"), "q", state("q"), "req-9.0", text="x")
        # c is stopped (killed while it waits): a correction is still taken
        os.killpg(c.pid, signal.SIGKILL)
        c.wait(timeout=10)
        record_correction(op, state_dir.agent_dir("c"), "c", state("c"), CORRECTION)
        with pytest.raises(InputRefusedError, match="already has correction k1 pending"):
            record_correction(op, state_dir.agent_dir("c"), "c", state("c"), "another")
        record_answer(op, state_dir.agent_dir("q"), "q", state("q"), question.request,
                      text=ANSWER)
        with pytest.raises(InputRefusedError, match="already answered"):
            record_answer(op, state_dir.agent_dir("q"), "q", state("q"), question.request,
                          text="again")
        c = start(processes, state_dir, "c", 100, C_FAULTS)
        answer_approval(op, "c", wait_for(lambda: state("c").phase == "running" and state("c"),
                                          20, "c rebuilt"),
                        permission.request, decision="approve", always=False, note=None)
        run_to_end(processes, state_dir, {"q": (q, Q_FAULTS, 5), "c": (c, C_FAULTS, 3)})
        qe = [(r.event, r.payload()) for r in op.read_stream("agent/q")]
        ce = [(r.event, r.payload()) for r in op.read_stream("agent/c")]
        # finished: a correction is refused with a clear message; the settled question too
        with pytest.raises(InputRefusedError, match="session is finished"):
            record_correction(op, state_dir.agent_dir("c"), "c", state("c"), "too late")
        with pytest.raises(InputRefusedError, match="no question"):
            record_answer(op, state_dir.agent_dir("q"), "q", state("q"), question.request,
                          text="late")
    answer_sha = hashlib.sha256(ANSWER.encode()).hexdigest()
    correction_sha = hashlib.sha256(CORRECTION.encode()).hexdigest()
    assert delivered(qe, answer_sha) == 1 and delivered(ce, correction_sha) == 1
    assert [p["turn"] for e, p in qe if e == "clarification_consumed"] == [2]
    assert [p["turn"] for e, p in ce if e == "correction_consumed"] == [2]
    assert [e for e, _ in qe].count("approval_requested") == 1  # never asked again
    assert qe[-1][1]["reason"] == ce[-1][1]["reason"] == "finished"
    # the exact texts are in the agents' input files (0600), never in the WAL
    wal = b"".join(p.read_bytes() for p in sorted(state_dir.wal_dir.rglob("*")) if p.is_file())
    for name, text in (("q", ANSWER), ("c", CORRECTION)):
        [file] = operator_input.input_dir(state_dir.agent_dir(name)).iterdir()
        assert file.read_text() == text and file.stat().st_mode & 0o777 == 0o600
        assert text.encode() not in wal and text[:20].encode() not in wal


def test_fold_keeps_an_input_until_its_turn_and_refuses_crossed_kinds(tmp_path: Path) -> None:
    """Pure parts: an approval does not answer a question in the fold either, an
    answer does not approve a permission, a second pending correction is not
    taken, and a consumed input joins the history with the turn it fed."""
    from actors.kernel.fold import fold

    ev: list[tuple[int, str, Any]] = [
        (1, "session_start", {"segment": 1}),
        (2, "turn", {"turn": 1, "actions": [{"op": "ask"}, {"op": "write_file"}]}),
        (3, "tool_call", {"call_id": "1.0", "index": 0, "op": "ask"}),
        (4, "tool_call", {"call_id": "1.1", "index": 1, "op": "write_file"}),
        (5, "approval_requested", {"request": "req-1.0", "call_id": "1.0", "op": "ask",
                                   "pattern": "*", "kind": "clarification"}),
        (6, "approval_requested", {"request": "req-1.1", "call_id": "1.1",
                                   "op": "write_file", "pattern": "a", "kind": "permission"}),
        (7, "approval_answer", {"request": "req-1.0", "decision": "approve"}),
        (8, "operator_answer", {"request": "req-1.1", "sha256": "x", "chars": 1, "file": "f"}),
    ]
    s = fold(AgentState(), ev)
    assert {a.request: a.status for a in s.approvals.values()} == {
        "req-1.0": "pending", "req-1.1": "pending"}
    assert s.inputs == []
    s = fold(s, [
        (9, "operator_answer", {"request": "req-1.0", "sha256": "a", "chars": 3,
                                "file": "answer-req-1.0-a.txt"}),
        (10, "operator_correction", {"correction": "k1", "sha256": "c", "chars": 2,
                                     "file": "correction-k1-c.txt"}),
        (11, "operator_correction", {"correction": "k2", "sha256": "d", "chars": 2,
                                     "file": "correction-k2-d.txt"}),
        (12, "clarification_consumed", {"request": "req-1.0", "turn": 2}),
        (13, "correction_consumed", {"correction": "k1", "turn": 2}),
    ])
    assert s.approvals["req-1.0"].status == "answered"
    assert [(i.ident, i.consumed_turn) for i in s.inputs] == [("req-1.0", 2), ("k1", 2)]
    assert s.corrections == 1
    s = fold(s, [(14, "turn", {"turn": 2, "actions": []})])
    assert s.inputs == []
    assert [(r.get("input"), r.get("id"), r["turn"]) for r in s.recent[-2:]] == [
        ("answer", "req-1.0", 2), ("correction", "k1", 2)]
    # a loop spends each input once: a consumed one is never consumed again
    writer = FakeWriter()
    agent_dir = tmp_path / "agent"
    ref = operator_input.write_text(agent_dir, "correction", "k3", "text")
    s.inputs = [operator_input_pending(ref)]
    calls: list[str] = []

    def append(event: str, payload: dict[str, Any], key: str) -> None:
        writer.append("agent/a", event, payload, key=key)
        calls.append(key)
        s.inputs[0].consumed_turn = payload["turn"]

    flushed: list[int] = []
    operator_input.consume(s, 3, append, lambda: flushed.append(1), lambda *a: None)
    operator_input.consume(s, 3, append, lambda: flushed.append(1), lambda *a: None)
    assert flushed == [1]  # durable before the request, once
    assert calls == [f"t3:in:correction:k3:{ref['sha256'][:16]}"]
    [got] = operator_input.texts(agent_dir, s, 3)
    assert got.text == "text"
    (operator_input.input_dir(agent_dir) / ref["file"]).write_text("tampered")
    assert operator_input.texts(agent_dir, s, 3)[0].text.startswith(
        "[operator input unavailable")


def operator_input_pending(ref: dict[str, Any]) -> Any:
    from actors.kernel.state import PendingInput

    return PendingInput(kind="correction", ident="k3", **ref)


def test_trace_shows_the_exact_text_from_the_file_and_the_wal_only_its_hash(
        tmp_path: Path) -> None:
    from supervisor import trace
    from tests.test_trace import _record

    agent_dir = tmp_path / "a1"
    ref = operator_input.write_text(agent_dir, "correction", "k1", CORRECTION)
    record = _record("operator_correction", {"correction": "k1", "segment": 1, **ref})
    assert CORRECTION[:20] not in json.dumps(record.payload())  # the fact: hash and size
    text = trace.render(record, agent_dir=agent_dir)
    assert "CORRECTION k1" in text and CORRECTION[:40] in text
    assert json.loads(trace.as_json(record, agent_dir=agent_dir))["text"] == CORRECTION
    assert "text:" not in trace.render(record)  # without the agent's files: hash and size
    consumed = trace.render(_record("correction_consumed", {"correction": "k1", "turn": 4}))
    assert "k1: delivered to the model with turn 4" in consumed


def test_an_answer_on_a_full_disk_is_refused_in_one_line_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while the answer's text is written (the fault injected at os.write)
    is a typed refusal naming the cause, with nothing left behind, not a
    traceback from `supervisor answer`."""
    import errno

    def full(_fd: int, _data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(InputRefusedError, match="No space left on device"):
        operator_input.write_text(tmp_path, "answer", "req-1.0", "the answer")
    monkeypatch.undo()
    assert [p.name for p in operator_input.input_dir(tmp_path).iterdir()] == []
