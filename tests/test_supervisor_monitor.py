"""The supervisor's liveness decisions about pids: an exit reaped under an
unknown pid is attributed to a freshly forked agent only when it is recent and
no live process holds that pid (pid numbers of reaped orphans are reused)."""

from __future__ import annotations

import subprocess
import sys

from supervisor.monitor import EARLY_EXIT_TTL_S, early_exit_applies, pid_alive


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
