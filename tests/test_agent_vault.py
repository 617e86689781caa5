"""Secret arguments (a terminal's input) never reach the WAL: the turn event
holds their hash and size, the text waits in the agent's vault until the call
runs, a new turn clears it, and a sealed text that is gone or altered is
refused as the call's error, never guessed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from actors.agent import catalog
from actors.agent.loop import AgentLoop, Step
from actors.kernel.vault import SealedInputMissingError, Vault
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, spec, write_task

catalog.install()  # the ops these tests parse and run (a process does it at start)

SECRET = "hunter2-not-for-the-wal\n"
PROC = "t-0123456789abcdef"
STEPS: list[dict[str, Any]] = [
    {"op": "terminal_input", "proc_id": PROC, "text": SECRET},
    {"op": "finish", "summary": "typed"},
]


def new_loop(state_dir: StateDir, writer: FakeWriter, tmp_path: Path) -> AgentLoop:
    task = write_task(tmp_path / "t.yaml", STEPS)
    loop = AgentLoop("a1", state_dir, spec(task), writer)  # type: ignore[arg-type]
    loop.rebuild()
    return loop


def drive(loop: AgentLoop, until: str | None = None, writer: FakeWriter | None = None) -> None:
    for _ in range(200):
        if until is not None and writer is not None and any(
                r.event == until for r in writer.records):
            return
        if loop.step() is not Step.PROGRESS:
            return
    raise AssertionError("the loop did not settle")


def test_terminal_input_is_sealed_in_the_turn_and_opened_for_the_call(
        state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, tmp_path)
    drive(loop)
    assert loop.state.phase == "finished"
    everything = b"".join(r.body for r in writer.records)
    assert SECRET.encode() not in everything and b"hunter2" not in everything
    turn = next(r.payload() for r in writer.records if r.event == "turn")
    sealed = turn["actions"][0]["text"]  # type: ignore[index]
    assert sealed == {"sha256": hashlib.sha256(SECRET.encode()).hexdigest(),
                      "bytes": len(SECRET.encode())}
    results = [r.payload() for r in writer.records if r.event == "tool_result"]
    # the call was parsed with its text back (no schema_reject) and ran: with no
    # broker connection its result is procs' absence, not a refusal of the action
    assert not any(r.event == "schema_reject" for r in writer.records)
    assert "procs is not reachable" in results[0]["result"]["error"]  # type: ignore[index]
    # the next turn cleared the vault
    assert list((state_dir.agent_dir("a1") / "vault").iterdir()) == []


def test_a_sealed_input_gone_from_the_vault_is_refused(state_dir: StateDir,
                                                       tmp_path: Path) -> None:
    writer = FakeWriter()
    loop = new_loop(state_dir, writer, tmp_path)
    while loop.state.turn == 0:  # the turn is decided (folded; durable with its calls)
        assert loop.step() is Step.PROGRESS
    vault = state_dir.agent_dir("a1") / "vault"
    [kept] = list(vault.iterdir())
    assert kept.read_bytes() == SECRET.encode()
    assert kept.stat().st_mode & 0o077 == 0
    kept.unlink()  # e.g. the agent directory was restored without it
    drive(loop)
    [reject] = [r.payload() for r in writer.records if r.event == "schema_reject"]
    assert reject["op"] == "terminal_input"  # type: ignore[index]
    assert "sealed input is gone" in reject["errors"][0]  # type: ignore[index]
    assert loop.state.phase == "finished"


def test_open_refuses_altered_or_forged_seals(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    [action] = vault.seal([{"op": "terminal_input", "proc_id": PROC, "text": "ok\n"}])
    assert vault.open(action) == {"op": "terminal_input", "proc_id": PROC, "text": "ok\n"}
    digest = action["text"]["sha256"]
    (tmp_path / "vault" / digest).write_bytes(b"changed\n")
    with pytest.raises(SealedInputMissingError):
        vault.open(action)
    (tmp_path / "outside").write_bytes(b"x")
    forged = {**action, "text": {"sha256": "../outside", "bytes": 1}}
    with pytest.raises(SealedInputMissingError):
        vault.open(forged)
    # ops without secret fields, and non-dict actions, pass through unchanged
    plain = {"op": "bash_poll", "proc_id": "p-0123456789abcdef"}
    assert vault.seal([plain, "not an action"]) == [plain, "not an action"]
    assert json.dumps(vault.open(plain)) == json.dumps(plain)
