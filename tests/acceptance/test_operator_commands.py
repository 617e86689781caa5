"""Answering agents as an operator does (docs/agents.md "Commands",
docs/operator-input.md): approve (also `--always`), deny, answer, correct and
resume, each on a scripted agent spawned from a task file, checked through
`supervisor trace`, `sessions list` and the agent's workspace. One runtime
for the module, with a token budget small enough to pause a long task."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

RELEASE_TASK = """\
name: release
prompt: prepare the release, ask before publishing
steps:
  - {op: write_file, path: release/NOTES.md, content: "corral 0.1.0\\n"}
  - {op: write_file, path: release/NOTES.md, content: "corral 0.1.0 notes\\n"}
  - {op: write_file, path: release/OTHER.md, content: "other\\n"}
  - {op: ask, question: "Publish 0.1.0 now?"}
  - {op: finish, summary: release prepared}
"""
LONG_TASK = """\
name: long
prompt: many small files
repeat: 30
steps:
  - {op: write_file, path: "f{i}.txt", content: "file {i}\\n"}
"""


@pytest.fixture(scope="module")
def corral(module_corral: Corral) -> Corral:
    config = module_corral.config_from_default(
        {"agent": {"budget": {"tokens": 1000, "cost_units": None}}})
    module_corral.up(config=config)
    return module_corral


def trace(corral: Corral, agent: str) -> list[dict[str, Any]]:
    """`trace AGENT --json` (nothing yet while the agent has no record: exit 1)."""
    result = corral.run("trace", agent, "--json", rc=None)
    if result.returncode == 1 and "no record" in result.stderr:
        return []
    assert result.returncode == 0, result
    return [json.loads(line) for line in result.stdout.splitlines()]


def waiting(corral: Corral, agent: str) -> bool:
    """The agent's heartbeat says a request waits (`status` is the cheap poll)."""
    result = corral.run("status", agent, "--json", rc=None)
    return result.returncode == 0 and result.json()["children"][0]["values"].get("waiting", 0) > 0


def wait_request(corral: Corral, agent: str, request: str) -> dict[str, Any]:
    """Wait until `agent` asks `request` (read in its trace once it waits)."""
    def found() -> dict[str, Any] | None:
        if not waiting(corral, agent):
            return None
        for record in trace(corral, agent):
            if record["event"] == "approval_requested" \
                    and record["payload"].get("request") == request:
                return record
        return None
    record: dict[str, Any] = corral.wait(found, f"{agent} to ask {request}")
    return record


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_approve_always_deny_correct_answer(corral: Corral) -> None:
    corral.write("release.yaml", RELEASE_TASK)
    corral.run("spawn", "r1", "--task", "release.yaml")
    wait_request(corral, "r1", "req-1.0")
    refused = corral.run("approve", "r1", "req-9.0", rc=1)
    assert "req-9.0" in refused.stderr and "req-1.0" in refused.stderr
    corral.run("approve", "r1", "req-1.0", "--always")
    # the grant covers the same write again: it is never asked
    wait_request(corral, "r1", "req-3.0")
    corral.run("deny", "r1", "req-3.0", "--note", "not that one")
    wait_request(corral, "r1", "req-4.0")
    wrong_way = corral.run("approve", "r1", "req-4.0", rc=1)
    assert "question" in wrong_way.stderr and "supervisor answer" in wrong_way.stderr

    correction, answer = "use the 0.1 branch", "yes, ship it"
    corral.run("correct", "r1", correction)
    second = corral.run("correct", "r1", "another", rc=1)
    assert "already has correction k1 pending" in second.stderr
    corral.run("answer", "r1", "req-4.0", answer)
    corral.wait_session("r1", {"finished"})

    records = trace(corral, "r1")
    asked = [r["payload"]["request"] for r in records if r["event"] == "approval_requested"]
    assert asked == ["req-1.0", "req-3.0", "req-4.0"]
    results = {r["payload"]["call_id"]: r["payload"]["status"] for r in records
               if r["event"] == "tool_result"}
    assert results["1.0"] == "ok" and results["2.0"] == "ok" and results["3.0"] != "ok"
    turns = [r["payload"].get("text") or "" for r in records if r["event"] == "turn"]
    delivered = [t for t in turns if "received" in t]
    assert len(delivered) == 1  # exactly once, with the next model request
    assert f"correction k1 sha256={sha256(correction)}" in delivered[0]
    assert f"answer req-4.0 sha256={sha256(answer)}" in delivered[0]
    workspace = corral.state_dir / "agents" / "r1" / "workspace" / "release"
    assert (workspace / "NOTES.md").read_text() == "corral 0.1.0 notes\n"
    assert not (workspace / "OTHER.md").exists()  # denied
    text = corral.run("trace", "r1").stdout
    assert "req-1.0: operator answered APPROVE" in text
    assert "DENIED" in text
    finished = corral.run("correct", "r1", "too late", rc=1)
    assert "finished" in finished.stderr


def test_resume_a_session_paused_on_its_budget(corral: Corral) -> None:
    corral.write("long.yaml", LONG_TASK)
    corral.run("spawn", "b1", "--task", "long.yaml")
    paused = corral.wait_session("b1", {"paused"})
    assert 0 < paused["turns"] < 30
    assert "BUDGET STOP" in corral.run("trace", "b1").stdout
    out = corral.run("resume", "b1", "--budget", "5000").stdout
    assert "+5000 tokens" in out
    done = corral.wait_session("b1", {"finished"})
    assert done["exit_reason"] == "finished" and done["segments"] == 2
    files = sorted((corral.state_dir / "agents" / "b1" / "workspace").iterdir())
    assert len(files) == 30
    again = corral.run("resume", "b1", "--budget", "10", rc=1)
    assert "b1" in again.stderr and len(again.stderr.splitlines()) == 1
