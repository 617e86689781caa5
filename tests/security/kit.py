"""Helpers for the security tests: a scripted agent run in-process over the
in-memory writer (tests/agentkit.py), on a workspace the test chooses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.agent.loop import AgentLoop, Step
from actors.kernel.settings import AgentSettings, AgentSpec, Decision, Permissions, Rule
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, write_task

DEFAULT_RULES = [Rule(op="*", path="secrets/*", decision="deny")]  # config/default.yaml's


def run_agent(state_dir: StateDir, ws: Path, steps: list[dict[str, Any]], *,
              rules: list[Rule] | None = None, default: Decision = "allow", name: str = "a1",
              limit: int = 100_000, **extra: Any) -> tuple[FakeWriter, AgentLoop]:
    """Run a scripted agent on `ws` to its end; its writer holds every fact."""
    task = write_task(state_dir.root.parent / f"{name}-task.yaml", steps,
                      **{k: v for k, v in extra.items() if k == "repeat"})
    settings = AgentSettings(permissions=Permissions(
        default=default, rules=DEFAULT_RULES if rules is None else rules),
        **{k: v for k, v in extra.items() if k != "repeat"})
    spec = AgentSpec(task=str(task), workspace=str(ws), settings=settings)
    writer = FakeWriter()
    loop = AgentLoop(name, state_dir, spec, writer)  # type: ignore[arg-type]
    loop.rebuild()
    for _ in range(limit):
        if loop.step() is not Step.PROGRESS:
            return writer, loop
    raise AssertionError("the agent did not settle")


def results(writer: FakeWriter, name: str = "a1") -> list[dict[str, Any]]:
    """Every tool_result of the agent, in order."""
    return [p for e, p in writer.events(f"agent/{name}") if e == "tool_result"]


def decisions(writer: FakeWriter, name: str = "a1") -> list[str]:
    return [p["decision"] for e, p in writer.events(f"agent/{name}") if e == "permission"]


def reasons(writer: FakeWriter, name: str = "a1") -> list[str]:
    """The gate's reason of every permission decision (empty when none)."""
    return [p.get("reason", "") for e, p in writer.events(f"agent/{name}") if e == "permission"]
