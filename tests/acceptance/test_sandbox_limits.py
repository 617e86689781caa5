"""The sandbox's walls as docs/security.md tells an operator to set them: the
`sandbox.limits` and `sandbox.tmp_bytes` keys of the configuration file, a
scripted agent whose commands try to pass them (a fork bomb, a full /tmp, a
workspace quota, ptrace of the sandbox's init), and what `supervisor trace`
shows of each."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

PROCESSES = 32
BOMB = (  # forks until the kernel says no, then says how many it got
    "import os, time\\n"
    "n = 0\\n"
    "for _ in range(400):\\n"
    "    try:\\n"
    "        pid = os.fork()\\n"
    "    except OSError:\\n"
    "        break\\n"
    "    if pid == 0:\\n"
    "        time.sleep(60)\\n"
    "        os._exit(0)\\n"
    "    n += 1\\n"
    "print('forked', n, flush=True)\\n")
PTRACE = (  # PTRACE_ATTACH to the sandbox's init
    "import ctypes\\n"
    "libc = ctypes.CDLL(None, use_errno=True)\\n"
    "print('ptrace', libc.ptrace(16, 1, None, None), ctypes.get_errno(), flush=True)\\n")
FILL = "for i in $(seq 1 80); do head -c 1048576 /dev/zero > f$i; sleep 0.05; done; echo wrote-all"
TASK = f"""\
name: walls
prompt: try every wall
steps:
  - {{op: write_file, path: bomb.py, content: "{BOMB}"}}
  - {{op: bash, command: "{sys.executable} bomb.py", timeout_s: 60}}
  - {{op: bash, command: "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?"}}
  - {{op: bash, command: "{FILL}", timeout_s: 60}}
  - {{op: write_file, path: ptrace.py, content: "{PTRACE}"}}
  - {{op: bash, command: "{sys.executable} ptrace.py"}}
  - {{op: finish, summary: walls tried}}
"""


def results(corral: Corral, agent: str) -> dict[str, dict[str, Any]]:
    """call_id -> the tool result's `result`, from `supervisor trace --json`."""
    out = {}
    for line in corral.run("trace", agent, "--json").stdout.splitlines():
        record = json.loads(line)
        if record["event"] == "tool_result":
            out[str(record["payload"]["call_id"])] = record["payload"]["result"]
    return out


def test_configured_limits_hold_a_hostile_agents_commands(corral: Corral) -> None:
    config = corral.config_from_default({"sandbox": {
        "tmp_bytes": 8 << 20,
        "limits": {"processes": PROCESSES, "workspace_bytes": 16 << 20}}})
    corral.up(config=config)
    corral.write("walls.yaml", TASK)
    corral.run("spawn", "walls", "--task", "walls.yaml")
    corral.wait(lambda: corral.json("status", "walls")["children"][0]["state"] == "exited",
                "the agent to try every wall", timeout_s=150)
    got = results(corral, "walls")

    forked = int(got["2.0"]["output"].split("forked", 1)[1].split()[0])
    assert 0 < forked < PROCESSES, got["2.0"]  # bwrap, the shell and python count too
    assert "No space left on device" in got["3.0"]["output"] and "rc=1" in got["3.0"]["output"]
    assert got["4.0"]["state"] == "quota_exceeded", got["4.0"]
    assert "wrote-all" not in got["4.0"].get("output", "")
    assert got["6.0"]["output"].split() == ["ptrace", "-1", "1"], got["6.0"]  # EPERM
    # the runtime went on: the agent finished its task, the others are up
    assert {c["name"]: c["state"] for c in corral.json("status")["children"]
            if c["kind"] != "agent"} == dict.fromkeys(
                ("writer", "broker", "procs", "subagents"), "running")
