"""Caps hold over a run with real background commands (issue 16,
docs/storage.md): procs runs commands that each leave a log, the runtime's
storage janitor (the real thread the supervisor starts) prunes ended jobs'
files oldest first down to the per-session cap while commands go on, never a
running job's; `supervisor du --json` and `supervisor gc --dry-run --json`
report usage and what a pass would take. (The 50-agent flat-usage run is a
measurement: `python ops/bench.py storage-flat --json`; docs/storage.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from actors.kernel.settings import AgentSpec, write_spec
from actors.procs.client import ProcsClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.statedir import StateDir
from supervisor.storage import Janitor, StorageConfig, du, session_jobs
from tests.processes import REPO_ROOT, ProcessTracker, wait_for

pytestmark = pytest.mark.process

SESSION = "agent-1"
JOB_BYTES = 20_000
CAP = 3 * JOB_BYTES + JOB_BYTES // 2


@pytest.fixture
def procs(processes: ProcessTracker, state_dir: StateDir) -> Iterator[ProcsClient]:
    processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="writer")
    processes.spawn(["-m", "broker.server", "--state-dir", str(state_dir.root),
                     "--heartbeat-interval-ms", "200"], name="broker")
    workdir = state_dir.root.parent / "work"
    workdir.mkdir()
    write_spec(state_dir, SESSION, AgentSpec(task="unused.yaml", workspace=str(workdir)))
    proc = processes.spawn(["-m", "actors.procs", "--state-dir", str(state_dir.root)],
                           name="procs")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, SESSION, heartbeat_interval_s=0.2)

    def answered() -> bool:
        assert proc.poll() is None, processes.output("procs")
        try:
            reply = peer.request("procs", protocol.Ping(msg_id=f"w{time.monotonic_ns()}"),
                                 timeout_s=0.2, retries=0)
        except (RequestTimeoutError, RemoteError):
            return False
        return isinstance(reply, protocol.Pong)

    try:
        wait_for(answered, 20, "procs to answer")
        yield ProcsClient(peer, SESSION)
    finally:
        peer.close()
        ctx.destroy(linger=0)


def cli(state_dir: StateDir, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args, "--state-dir", str(state_dir.root),
         "--json"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    data: dict[str, object] = json.loads(done.stdout)
    return data


def test_job_log_caps_hold_while_commands_run_and_running_jobs_are_kept(
    procs: ProcsClient, state_dir: StateDir
) -> None:
    workdir = str(state_dir.root.parent / "work")
    running = procs.start(f"head -c {JOB_BYTES} /dev/zero | tr '\\0' r; sleep 60", workdir)
    session_dir = state_dir.agent_dir(SESSION)
    running_log = session_dir / ".procs" / f"{running.proc_id}.log"
    wait_for(lambda: running_log.exists() and running_log.stat().st_size == JOB_BYTES, 20,
             "the running job's output")
    config = StorageConfig(procs_max_bytes_per_session=CAP, interval_s=0.2)
    before = cli(state_dir, "gc", "--dry-run")
    assert before["jobs_removed"] == 0 and before["running_jobs_kept"] == 1
    janitor = Janitor(state_dir, config)
    janitor.start()
    peak = 0
    order: list[str] = []  # the jobs in the order they ended (each ends before the next)
    try:
        for i in range(10):  # ten jobs of JOB_BYTES each: over three times the cap
            status = procs.start(f"head -c {JOB_BYTES} /dev/zero | tr '\\0' {i % 10}", workdir)
            order.append(f".procs/{status.proc_id}")
            log = session_dir / ".procs" / f"{status.proc_id}.log"
            end = log.with_suffix(".end")
            wait_for(lambda end=end, log=log: end.exists() or not log.exists(),  # type: ignore[misc]
                     20, "the job to end")
            ended, _ = session_jobs(session_dir)
            peak = max(peak, sum(j.size for j in ended))
        wait_for(lambda: sum(j.size for j in session_jobs(session_dir)[0]) <= CAP, 20,
                 "the janitor to prune down to the cap")
    finally:
        janitor.stop()
    ended, still_running = session_jobs(session_dir)
    assert still_running == 1 and running_log.stat().st_size == JOB_BYTES  # never touched
    assert sum(j.size for j in ended) <= CAP
    assert len(ended) < 10 and peak > 0  # ended jobs were removed
    assert janitor.passes >= 1
    # the newest ended jobs are the ones kept (oldest ended went first); the check
    # here was `all(t >= kept[0])` over a sorted list, which could not fail
    kept = [j.job_id for j in ended]
    assert kept and sorted(kept) == sorted(order[-len(kept):])
    usage = cli(state_dir, "du")
    sessions = usage["sessions"]
    assert isinstance(sessions, dict) and sessions[SESSION]["procs"] > 0
    assert usage["tiers"]["recovery-core"] > 0  # type: ignore[index]
    assert du(state_dir, config).sessions[SESSION].procs <= CAP + JOB_BYTES + 64 * 1024
    procs.kill(running.proc_id)


def test_a_wrappers_cut_exit_file_goes_with_its_job(tmp_path: Path) -> None:
    """A wrapper killed between writing `<id>.exit.tmp` and its rename leaves
    the temp file: it belongs to its job, and goes when the job is collected."""
    procs = tmp_path / "a1" / ".procs"
    procs.mkdir(parents=True)
    for name in ("p-1.log", "p-1.exit.tmp", "p-1.end", "p-2.log", "p-2.exit.tmp"):
        (procs / name).write_text("x")
    ended, running = session_jobs(tmp_path / "a1")
    assert running == 1  # p-2: no end noted
    assert [sorted(f.name for f in job.files) for job in ended] == [
        ["p-1.end", "p-1.exit.tmp", "p-1.log"]]
