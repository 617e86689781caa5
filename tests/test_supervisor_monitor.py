"""The supervisor's liveness decisions about pids: an exit reaped under an
unknown pid is attributed to a freshly forked agent only when it is recent and
no live process holds that pid (pid numbers of reaped orphans are reused)."""

from __future__ import annotations

import subprocess
import sys

from broker import protocol
from broker.pidlock import pid_alive
from broker.statedir import StateDir
from supervisor.config import load
from supervisor.runtime.control import Incoming
from supervisor.runtime.loop import Runtime
from supervisor.runtime.monitor import EARLY_EXIT_TTL_S, early_exit_applies


def test_a_recent_exit_of_a_pid_nobody_holds_belongs_to_the_fork() -> None:
    assert early_exit_applies(reaped_at=10.0, now=10.5, alive=False)


def test_an_exit_stored_for_a_pid_a_live_process_now_holds_is_someone_elses() -> None:
    assert not early_exit_applies(reaped_at=10.0, now=10.001, alive=True)


def test_an_old_stored_exit_is_never_attributed() -> None:
    assert not early_exit_applies(reaped_at=10.0, now=10.0 + EARLY_EXIT_TTL_S + 0.1, alive=False)


def test_pid_alive_sees_a_live_child_and_not_a_reaped_one() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert pid_alive(child.pid)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    assert not pid_alive(child.pid)


def test_a_final_heartbeat_read_after_the_reap_still_counts(state_dir: StateDir) -> None:
    """A child's last beat (an agent's phase finished) is sent just before it
    exits; the supervisor may reap the exit before it reads the beat. The beat's counters
    still land on the child, and a beat from any other pid does not."""
    runtime = Runtime(load(None), state_dir)
    try:
        child = runtime.children["procs"]
        child.spawned(4242, now=1.0)
        child.exited(0, None, now=2.0)

        def beat(pid: int, phase: int) -> None:
            runtime._on_message(Incoming(b"x", protocol.Heartbeat(
                actor=child.name, pid=pid, values={"phase": phase})), now=2.1)

        beat(9999, 1)  # not the process that exited
        assert child.values == {}
        beat(4242, 3)
        assert child.values == {"phase": 3}
        assert child.pid is None and child.heartbeat_at is None  # still exited
    finally:
        runtime.control.close()
        runtime.ctx.destroy(linger=0)
