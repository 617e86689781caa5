"""Idle agents as an operator sees them (docs/supervisor.md, "Idle children:
liveness from the process table"), through `supervisor` only: an agent
without a task beats once and then costs no message; `status` shows it
`idle` with how long, no heartbeat deadline kills it however long it stays
quiet, and its death is still seen at once and restarted."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

TIMEOUT_S = 1.0  # the heartbeat deadline of a busy child (3 intervals)
SETTINGS: dict[str, Any] = {"agents": {"count": 2},
                            "heartbeat": {"interval_ms": 300, "timeout_s": TIMEOUT_S}}


def agent(corral: Corral, name: str) -> dict[str, Any]:
    found: dict[str, Any] = corral.json("status", name)["children"][0]
    return found


def test_an_idle_agent_shows_idle_outlives_the_heartbeat_deadline_and_is_restarted_on_death(
        corral: Corral) -> None:
    corral.up(config=corral.config_from_default(SETTINGS))

    def idle_long() -> dict[str, Any] | None:
        row = agent(corral, "agent-1")
        idle_s = row["values"].get("idle_s") or 0
        return row if row["values"].get("idle") == 1 and idle_s >= 3 * TIMEOUT_S else None

    row = corral.wait(idle_long, "agent-1 idle past three heartbeat deadlines")
    # quiet for three deadlines, yet alive and never restarted
    assert row["state"] == "running" and row["restarts"] == 0, row
    assert row["heartbeat_age_s"] == 0 and row.get("busy") is None, row
    table = corral.run("status", "agent-1").stdout
    assert re.search(r"agent-1 .* idle \d", table), table

    # its death is seen from the process table, and it comes back idle
    pid = row["pid"]
    corral.run("kill", "agent-1", "--signal", "KILL")

    def back() -> dict[str, Any] | None:
        now = agent(corral, "agent-1")
        ok = now["state"] == "running" and now["pid"] not in (None, pid) \
            and now["values"].get("idle") == 1
        return now if ok else None

    again = corral.wait(back, "agent-1 restarted and idle again")
    assert again["restarts"] == 1, again
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
