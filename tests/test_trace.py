"""`supervisor trace`: an agent's session as a person reads it.

In-process: the loop's sealed terminal input stays sealed in the trace, and the
loop's info logs name the op and the reason of a rejected or refused action.
Real processes: a scripted agent spawned into a running runtime is traced
(turns, actions, verdicts, results, an approval asked and answered); `-f`
prints the answer appended after it started; reading the segments offline
gives the records the writer serves."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from actors.agent.loop import AgentLoop, Step
from actors.kernel.settings import Rule
from actors.writer.wal import WalRecord, encode_record, parse_record
from broker.statedir import StateDir
from supervisor import trace
from tests.agentkit import FakeWriter, spec, write_task
from tests.processes import ProcessTracker, wait_for
from tests.test_supervisor_process import cli
from tests.test_supervisor_run import fast_config

SECRET = "hunter2-do-not-print"


def _wal_records(writer: FakeWriter) -> list[WalRecord]:
    out = []
    for r in writer.records:
        line = encode_record(r.seq, time.time(), r.stream, r.event, "a1", r.key or "k",
                             r.ledger, r.body)
        record = parse_record(line)
        assert record is not None
        out.append(record)
    return out


def _drive(loop: AgentLoop) -> None:
    for _ in range(200):
        if loop.step() is not Step.PROGRESS:
            return


def test_sealed_input_stays_sealed_and_rejects_are_explained(
        state_dir: StateDir, tmp_path: Path) -> None:
    steps: list[dict[str, Any]] = [
        {"op": "terminal_input", "proc_id": "p1", "text": SECRET},  # sealed, then rejected
        {"op": "write_file", "path": "x.txt"},  # content missing: rejected
        {"op": "read_file", "path": "secrets/key.txt"},  # denied by a rule
        {"op": "finish", "summary": "done"},
    ]
    writer = FakeWriter()
    loop = AgentLoop("a1", state_dir, spec(  # type: ignore[arg-type]
        write_task(tmp_path / "t.yaml", steps),
        rules=[Rule(op="*", path="secrets/*", decision="deny")]), writer)
    loop.rebuild()
    with structlog.testing.capture_logs() as logs:
        _drive(loop)
    text = "\n".join(trace.render(r) for r in _wal_records(writer))
    assert SECRET not in text
    assert "<sealed 20 bytes sha256:" in text
    assert "REJECTED write_file" in text and "content" in text
    assert "read_file -> DENY (rule rules[0])" in text
    assert "session exit: finished" in text
    rejected = {e["op"]: e for e in logs if e["event"] == "action_rejected"}
    assert rejected["write_file"]["reason"] == "content: missing"
    assert rejected["terminal_input"]["reason"] == "proc_id: string_pattern_mismatch"
    refused = [e for e in logs if e["event"] == "action_refused"]
    assert refused and refused[0]["op"] == "read_file" and refused[0]["decision"] == "deny"
    assert refused[0]["rule"] == "rules[0]"
    assert all(SECRET not in json.dumps(e, default=str) for e in logs)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_trace_of_a_real_agent_and_follow(processes: ProcessTracker, state_dir: StateDir,
                                          tmp_path: Path) -> None:
    config = fast_config(state_dir)
    task = write_task(tmp_path / "traced.yaml", [
        {"op": "write_file", "path": "notes.md", "content": "first\n"},
        {"op": "write_file", "path": "broken.md"},
        {"op": "read_file", "path": "secrets/token"},
        {"op": "write_file", "path": "release/NOTES.md", "content": "v1\n"},
        {"op": "finish", "summary": "traced"},
    ])
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(config)], name="up")
    wait_for(lambda: up.poll() is None and cli(processes, state_dir, "status").returncode == 0,
             30, "the supervisor")
    assert cli(processes, state_dir, "spawn", "traced", "--task", str(task)).returncode == 0
    assert cli(processes, state_dir, "trace", "nosuch").returncode == 1

    follower = processes.spawn(["-m", "supervisor.cli", "trace", "traced", "-f",
                                "--state-dir", str(state_dir.root)], name="trace-f")
    wait_for(lambda: "req-4.0: asks approval for write_file on release/NOTES.md"
             in processes.output("trace-f"), 40, "the approval request in trace -f")
    assert "operator answered" not in processes.output("trace-f")
    done = cli(processes, state_dir, "approve", "traced", "req-4.0", "--note", "ship it")
    assert done.returncode == 0, done.stderr
    # appended after `trace -f` started, printed by it
    wait_for(lambda: "session exit: finished" in processes.output("trace-f"), 40,
             "the answer and the end of the session in trace -f")
    followed = processes.output("trace-f")
    assert 'req-4.0: operator answered APPROVE, note "ship it"' in followed
    assert follower.poll() is None  # still following

    whole = cli(processes, state_dir, "trace", "traced")
    assert whole.returncode == 0, whole.stderr
    text = whole.stdout
    for expected in (
        "session 1 started: task traced.yaml",
        'action 1.0: write_file(content="first\\n", path="notes.md")',  # keys as stored
        "call 1.0: write_file -> ALLOW (rule default)",
        "call 1.0: start write_file writes notes.md (none -> ",
        "call 1.0: write_file OK: {bytes: 6}",
        "call 2.0: REJECTED write_file: [\"content: missing\"]",
        "call 3.0: read_file -> DENY (rule rules[0])",
        "call 3.0: read_file DENIED",
        "call 4.0: write_file -> ASK (rule rules[1]) [req-4.0]",
        "req-4.0: operator answered APPROVE",
        "session exit: finished at turn 5: \"traced\"",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"
    assert text in followed, "trace -f printed the same session"

    as_json = cli(processes, state_dir, "trace", "traced", "--json", "--since", "3")
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert lines[0]["seq"] >= 3 and {"approval_requested", "approval_answer"} <= {
        r["event"] for r in lines}

    # the offline reader (segments, read-only) gives what the writer serves
    writer_seqs = [r["seq"] for r in json.loads("[" + ",".join(
        cli(processes, state_dir, "trace", "traced", "--json").stdout.splitlines()) + "]")]
    offline = trace.SegmentReader(state_dir, "agent/traced").read(1)
    assert [r.seq for r in offline] == writer_seqs

    log = (state_dir.logs_dir / "traced.log").read_text()
    rejected = [json.loads(line) for line in log.splitlines() if "action_rejected" in line]
    assert rejected and rejected[0]["op"] == "write_file" and "content" in rejected[0]["reason"]


def _record(event: str, payload: dict[str, Any], seq: int = 7) -> WalRecord:
    line = encode_record(seq, 1.0, "agent/a1", event, "a1", f"k{seq}", None,
                         json.dumps(payload).encode())
    record = parse_record(line)
    assert record is not None
    return record


def test_change_sets_aborts_and_budget_stops_read_plainly() -> None:
    changes = trace.render(_record("tool_result", {
        "call_id": "3.0", "op": "subagent_changes", "status": "ok", "result": {
            "subagent_id": "sa-1", "state": "ended", "exit_code": 0, "status": "ready",
            "files": [{"path": "src/a.py", "op": "modify"}, {"path": "b.md", "op": "add"}],
            "patch_bytes": 321, "patch": "--- a/src/a.py\n+++ b/src/a.py\n" + "x" * 2000}}))
    assert "subagent sa-1 ended (exit 0)" in changes
    assert "change set ready: 2 files, 321 patch bytes: modify src/a.py, add b.md" in changes
    assert "chars)" in changes and len(changes) < 1200  # the patch is bounded
    aborted = trace.render(_record("turn_aborted", {"turn": 4, "reason": "recovery", "calls": [
        {"call_id": "4.0", "op": "write_file", "effect_applied": True},
        {"call_id": "4.1", "op": "edit_file", "effect_applied": None}]}))
    assert ("turn 4 ABORTED (recovery): 4.0 write_file effect applied; "
            "4.1 edit_file effect unknown") in aborted
    budget = trace.render(_record("session_exit", {"reason": "budget", "resumable": True,
                                                   "turn": 9, "summary": ""}))
    assert "session exit: BUDGET STOP at turn 9 (resumable: `supervisor resume`)" in budget
    resumed = trace.render(_record("budget_resumed", {"tokens": 500, "cost_units": 1.0,
                                                      "segment": 1}))
    assert "budget resumed by the operator: +500 tokens" in resumed


def test_the_model_cannot_reach_the_terminal_with_escape_sequences() -> None:
    hostile = "\x1b]0;owned\x07\x1b[2J\x9b31m"
    text = trace.render(_record("schema_reject", {"call_id": "1.0", "op": hostile,
                                                  "errors": [hostile]}))
    text += trace.render(_record("turn", {"turn": 1, "text": hostile, "usage": {},
                                          "actions": [{"op": hostile, hostile: hostile}]}))
    assert not any((ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0 for c in text)
    assert "\\x1b" in text
    assert all(ord(c) < 0x80 for c in trace.as_json(_record("turn", {"text": hostile})))


@pytest.mark.parametrize(("event", "payload"), [
    ("turn", {"turn": 1, "usage": [], "actions": "x"}),
    ("todos", {"items": 5}),
    ("turn_aborted", {"calls": 3}),
    ("tool_result", {"result": {"subagent_id": 1, "files": [1, None]}}),
    ("permission", {}),
])
def test_fields_of_another_shape_still_print(event: str, payload: dict[str, Any]) -> None:
    """A record whose fields have unexpected types is printed, never a traceback."""
    text = trace.render(_record(event, payload))
    assert text.startswith("#7 ")
    assert len(text.splitlines()) >= 1
