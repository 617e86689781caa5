"""The fleet soak with real hosts in small (ops/soak_hosts.py, docs/soak.md): two
corral hosts on a local 3-node cluster, each a supervisor with its writer,
broker and a scripted agent; one whole host SIGKILLed with its NATS node,
declared dead, fenced and adopted (each agent's adoption made 7 s slow, over
the status TTL: the adopter stays in the fleet all along); started again under
its name (fenced: it runs nothing) and replaced under a new name. Every
invariant holds, at least one agent was really adopted, and the planted faults
of `--tamper` are each reported by the same checks (so they can fail). On the
code before supervisor/fleet/beat.py the adopter's status entry expired during
the adoption (`live_hosts_expired`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT

pytestmark = [pytest.mark.fleet, pytest.mark.process, pytest.mark.soak]


@pytest.mark.timeout(300)  # ~35 s on a quiet machine: start-up, one host loss, the checks
def test_a_host_killed_with_its_node_is_adopted_fenced_and_loses_nothing() -> None:
    from supervisor.fleet import cluster

    # short: the hosts' ipc:// socket paths live under it (pytest-xdist's tmp_path is long)
    tmp_path = Path(tempfile.mkdtemp(prefix="corral-sh-", dir="/tmp"))
    try:  # the kill comes once the agents' bundles are up and they have done some work
        result = subprocess.run(
            [sys.executable, "ops/soak.py", "--hosts", "2", "--kill-host-interval-ms", "1000",
             "--duration", "1", "--agents", "1", "--new-host-agents", "0",
             "--task-repeat", "20",
             "--node-kill-chance", "1", "--seed", "5", "--tamper", "--json",
             # the adoption made slower than the status TTL (5 s): the adopter must
             # stay in the fleet (supervisor/fleet/beat.py)
             "--adopt-delay-s", "7",
             "--root", str(tmp_path / "soak"), "--finish-timeout", "90"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=280, check=False)
    finally:  # a soak killed by the timeout leaves its NATS nodes (their own sessions)
        cluster.down(tmp_path / "soak" / "cluster")
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert result.stdout, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    assert result.returncode == 0, (figures["violations"], figures.get("examples"),
                                    result.stderr[-2000:])
    assert figures["violations"] == []
    # something was really killed and adopted: a soak that never killed cannot pass
    assert figures["kills"] == 1 and figures["node_kills"] == 1
    assert figures["live_hosts_expired"] == 0, figures["live_hosts_expired_list"]
    assert figures["adoptions"] >= 1 and figures["adoptions_logged"] >= 1
    assert figures["adopted_records"] > 0
    [restart] = figures["fenced_restarts"]
    assert restart["exit"] == 69
    assert restart["stream_seq_after"] == restart["stream_seq_before"]
    assert figures["replacements"] == 1
    assert figures["agents"] == 2 and figures["agents_finished"] == 2
    assert figures["acked"] > 100
    for key in ("lost", "duplicates", "stream_gaps", "stream_mismatches", "adoption_missing",
                "appends_after_fence", "agents_on_two_hosts", "double_runs",
                "workspace_mismatches", "orphans"):
        assert figures[key] == 0, (key, figures["examples"])
    # the checks are not decorative: each planted fault is reported
    assert len(figures["tamper"]["planted"]) == 4, figures["tamper"]
    assert all(n >= 1 for n in figures["tamper"]["detected"].values()), figures["tamper"]
