"""Watching children: exits (waitpid), liveness deadlines and resource samples.

`reap()` collects every exited child of the supervisor (including the agents
it adopted as a subreaper). `overdue()` is the pure liveness rule. The
`Sampler` reads CPU and RSS for every child on each pass, and USS (which needs
/proc/<pid>/smaps_rollup, the expensive part) for a bounded number of children
per pass, round robin, so that 500 agents cost the supervisor little.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import psutil

from broker import lifeline
from supervisor.children import Child

USS_PER_PASS = 25


@dataclass(frozen=True)
class Reaped:
    pid: int
    code: int | None
    signal: int | None


def reap() -> list[Reaped]:
    """Every child that has exited since the last call (never blocks)."""
    out: list[Reaped] = []
    for pid, status in lifeline.reap_exited():
        if os.WIFSIGNALED(status):
            out.append(Reaped(pid, None, os.WTERMSIG(status)))
        elif os.WIFEXITED(status):
            out.append(Reaped(pid, os.WEXITSTATUS(status), None))
    return out


# An exit reaped before the zygote named its pid is kept this long at most.
EARLY_EXIT_TTL_S = 5.0


def pid_alive(pid: int) -> bool:
    """True when some process (a zombie included) holds `pid` now."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def early_exit_applies(reaped_at: float, now: float, alive: bool) -> bool:
    """Whether an exit reaped under an unknown pid belongs to the fork the
    zygote has just named with that pid. As a child subreaper the supervisor
    also reaps orphans (commands' descendants, the zygote's go-betweens); once
    reaped, their pid numbers are free for reuse. So the stored exit counts
    only if it is recent and no live process holds the pid: a live one means
    the number was reused and the exit was some other orphan's."""
    return not alive and now - reaped_at <= EARLY_EXIT_TTL_S


def overdue(
    child: Child, now: float, heartbeat_timeout_s: float
) -> Literal["ready", "heartbeat"] | None:
    """Which liveness deadline a child has missed, if any."""
    if child.pid is None or child.started_at is None:
        return None
    ready_s = child.spec.ready_timeout_s
    if child.state == "starting" and ready_s is not None and now - child.started_at > ready_s:
        return "ready"
    beat = child.heartbeat_at
    if child.state == "running" and beat is not None and now - beat > heartbeat_timeout_s:
        return "heartbeat"
    return None


class Sampler:
    """CPU %, RSS and USS per child through psutil, cached per pid."""

    def __init__(self, uss_per_pass: int = USS_PER_PASS) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._uss_per_pass = uss_per_pass
        self._cursor = 0

    def sample(self, children: Iterable[Child]) -> None:
        live = [c for c in children if c.pid is not None]
        pids = {c.pid for c in live}
        for pid in list(self._procs):
            if pid not in pids:
                del self._procs[pid]
        uss_turn = set()
        if live:
            start = self._cursor % len(live)
            order = live[start:] + live[:start]
            uss_turn = {id(c) for c in order[: self._uss_per_pass]}
            self._cursor = start + self._uss_per_pass
        for child in live:
            assert child.pid is not None
            proc = self._procs.get(child.pid)
            try:
                if proc is None:
                    proc = psutil.Process(child.pid)
                    self._procs[child.pid] = proc
                    proc.cpu_percent(None)  # primes the counter; the next call is real
                    child.cpu_percent = 0.0
                else:
                    child.cpu_percent = round(proc.cpu_percent(None), 1)
                if id(child) in uss_turn or child.uss_bytes is None:
                    info = proc.memory_full_info()
                    child.rss_bytes = int(info.rss)
                    child.uss_bytes = int(info.uss)
                else:
                    child.rss_bytes = int(proc.memory_info().rss)
            except (psutil.Error, OSError):
                self._procs.pop(child.pid, None)
