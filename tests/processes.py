"""Process bookkeeping for tests: every process a test starts is tracked, and
at teardown every group is killed and reaped; anything still alive that
carries the test's marker in its environment is a leak and fails the test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

MARKER_ENV = "CORRAL_TEST_ID"
REPO_ROOT = Path(__file__).resolve().parent.parent
PDEATHSIG_GRACE_S = 5.0  # how long children may take to die with their killed parent


def wait_for(
    condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.01
) -> Any:
    """Poll `condition` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class ProcessTracker:
    """Starts processes in their own session, remembers them, cleans up."""

    def __init__(self, log_dir: Path) -> None:
        self.marker = uuid.uuid4().hex
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env[MARKER_ENV] = self.marker
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env.pop("CORRAL_CONTROL", None)
        if extra:
            env.update(extra)
        return env

    def spawn(
        self,
        args: Sequence[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        python: bool = True,
        **kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """Start `python args...` (or `args` as is) with output in log_dir/name.out."""
        argv = [sys.executable, *args] if python else list(args)
        out = open(self.log_dir / f"{name}.out", "ab")  # noqa: SIM115 - closed by the child's exit
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env(env),
            start_new_session=True,
            **kwargs,
        )
        out.close()
        self.started.append(proc)
        return proc

    def output(self, name: str) -> str:
        path = self.log_dir / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def marked(self) -> list[psutil.Process]:
        """Live processes carrying this tracker's marker (zombies excluded)."""
        found = []
        for proc in psutil.process_iter(["pid", "status"]):
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if proc.environ().get(MARKER_ENV) == self.marker:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def cleanup(self) -> list[str]:
        """Kill and reap everything; return descriptions of leaked processes."""
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        # a test that leaves a supervisor running ends with its SIGKILL above: its
        # children then die of PDEATHSIG, which takes a moment on a busy machine;
        # what is still alive after this grace period was not tied to its parent
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not self.marked(), PDEATHSIG_GRACE_S, "orphans to go",
                     interval_s=0.05)
        leaked = []
        for proc in self.marked():
            try:
                leaked.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
                proc.kill()
            except psutil.Error:
                continue
        return leaked

