"""Schedules, hooks and MCP servers as a user sets them up (docs/automation.md,
docs/mcp.md, docs/pipelines.md "Registries"): through `supervisor registry
apply` or an agent's own registry op, then seen to take effect through
`supervisor status`, `supervisor trace --json` and a hook's POST. One runtime
for the module; each test uses names of its own.

Each schedule fires every few seconds (a 6-field cron, seconds last) and is
removed once its first run is seen."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

EVERY_3_S = "* * * * * */3"
MCP_SERVER = Path(__file__).with_name("mcp_echo_server.py")


@pytest.fixture(scope="module")
def up(module_corral: Corral) -> Corral:
    """The runtime, from a user's copy of the packaged configuration whose
    automation checks the schedules every 0.1 s."""
    module_corral.up(config=module_corral.config_from_default({"automation": {"tick_s": 0.1}}))
    return module_corral


def apply(corral: Corral, op: str, args: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(corral.run(
        "registry", "apply", op, "--args", json.dumps(args)).stdout)
    return result


def trace(corral: Corral, agent: str) -> list[dict[str, Any]]:
    result = corral.run("trace", agent, "--json", rc=None)
    if result.returncode != 0:
        return []
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def finished(corral: Corral, agent: str) -> dict[str, Any] | None:
    """The payload of the agent's `session_exit`, once it has one."""
    return next((r["payload"] for r in trace(corral, agent)
                 if r["event"] == "session_exit"), None)


def spawned_by(corral: Corral, schedule: str) -> str | None:
    """The first agent a schedule's fire spawned (`<schedule>-<slot>`)."""
    names = sorted(n for n in corral.children() if n.startswith(f"{schedule}-"))
    return names[0] if names else None


def task(corral: Corral, name: str, steps: list[dict[str, Any]]) -> Path:
    return corral.write(f"{name}.yaml", json.dumps({"name": name, "steps": steps}))


def test_a_schedule_applied_by_the_operator_fires_and_runs_its_task(up: Corral) -> None:
    quick = task(up, "quick", [{"op": "write_file", "path": "ran.txt", "content": "ok"},
                               {"op": "finish", "summary": "scheduled run"}])
    done = apply(up, "schedule_add", {"entry": {"name": "tick", "cron": EVERY_3_S,
                                                "task": str(quick)}})
    assert done["registry"] == "schedules" and done["entries"] == ["tick"]
    run = up.wait(lambda: spawned_by(up, "tick"), "the schedule to spawn its run", 30)
    apply(up, "schedule_remove", {"name": "tick"})
    exit_ = up.wait(lambda: finished(up, run), f"{run} to finish", 30)
    assert exit_["reason"] == "finished" and exit_["summary"] == "scheduled run"


def test_a_schedule_an_agent_adds_with_its_op_fires(up: Corral) -> None:
    quick = task(up, "quick2", [{"op": "finish", "summary": "run of the agent's schedule"}])
    planner = task(up, "planner", [
        {"op": "schedule_add", "entry": {"name": "agentsched", "cron": EVERY_3_S,
                                         "task": str(quick)}},
        {"op": "finish", "summary": "planned"}])
    up.run("spawn", "planner", "--task", str(planner))
    added = up.wait(lambda: next((r["payload"] for r in trace(up, "planner")
                                  if r["event"] == "tool_result"), None),
                    "the planner's schedule_add", 30)
    assert added["status"] == "ok", added
    run = up.wait(lambda: spawned_by(up, "agentsched"), "the agent's schedule to fire", 30)
    apply(up, "schedule_remove", {"name": "agentsched"})
    exit_ = up.wait(lambda: finished(up, run), f"{run} to finish", 30)
    assert exit_["summary"] == "run of the agent's schedule"
    shown = json.loads(up.run("registry", "show", "schedules").stdout)
    assert shown["schedules"]["entries"] == []  # removed


class _Receiver(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        return


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", _Receiver.bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_hook_applied_by_the_operator_posts_on_its_event(
        up: Corral, receiver: tuple[str, list[dict[str, Any]]]) -> None:
    url, bodies = receiver
    apply(up, "hook_add", {"entry": {"name": "onfinish", "on": ["agent_finished"],
                                     "url": url, "retries": 2, "backoff_s": 0.1}})
    up.run("spawn", "hooked", "--task",
           str(task(up, "hooked", [{"op": "finish", "summary": "hook me"}])))
    body = up.wait(lambda: next((b for b in bodies if b.get("agent") == "hooked"), None),
                   "the hook's POST for hooked", 40)
    apply(up, "hook_remove", {"name": "onfinish"})
    assert body["event"] == "agent_finished" and body["hook"] == "onfinish"
    assert body["detail"] == {"reason": "finished", "summary": "hook me"}


@pytest.mark.timeout(180)  # the SDK's first import in the sandbox takes seconds
def test_an_mcp_server_installed_through_the_registry_answers_an_agents_call(
        up: Corral) -> None:
    apply(up, "mcp_install", {"entry": {
        "name": "echo", "command": [sys.executable, str(MCP_SERVER)], "call_timeout_s": 60}})
    up.run("spawn", "caller", "--task", str(task(up, "caller", [
        {"op": "mcp_call", "server": "echo", "tool": "shout", "arguments": {"text": "hi"}},
        {"op": "finish", "summary": "called"}])))
    up.wait(lambda: finished(up, "caller"), "the caller to finish", 150)
    results = [r["payload"] for r in trace(up, "caller") if r["event"] == "tool_result"]
    assert results[0]["status"] == "ok", results[0]
    result = results[0]["result"]
    assert (result["server"], result["tool"], result["is_error"]) == ("echo", "shout", False)
    assert "HI!" in json.dumps(result["content"])
