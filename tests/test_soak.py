"""The soak test in small: the real runtime under SIGKILLs of every kind of
child and cuts of the WAL tail, then every invariant of ops/soak.py holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import REPO_ROOT


@pytest.mark.soak
@pytest.mark.timeout(400)
def test_thirty_seconds_of_kills_lose_nothing_acknowledged() -> None:
    result = subprocess.run(
        [sys.executable, "ops/soak.py", "--duration", "30", "--agents", "8",
         "--kill-interval-ms", "250", "--task-repeat", "40", "--cut-chance", "0.1",
         "--seed", "7", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=380, check=False,
    )
    assert result.stdout, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    # the broken invariants first: pytest cuts a long message, and the figures are long
    examples = {k: v for k, v in figures.items() if k.endswith("_examples") and v}
    assert result.returncode == 0, (figures.get("violations"), examples, figures)
    kills = figures["kills"]
    assert kills["total"] >= 60
    assert {"writer", "broker", "agent"} <= set(kills), kills
    assert figures["acked"] > 1000
    assert figures["lost"] == 0
    assert figures["duplicates"] == 0
    assert figures["gapless"] is True
    assert figures["checksum_failures"] == 0
    # agents whose acknowledged facts a WAL cut destroyed are exempt from the
    # agent-level checks; enough must remain for those checks to mean something
    assert figures["agents_checked"] >= 4
    assert figures["agents_finished"] == figures["agents_checked"]
    assert figures["state_mismatches"] == 0
    assert figures["workspace_mismatches"] == 0
    assert figures["orphans"] == 0
    assert figures["approvals_answered"] >= figures["agents_checked"]
