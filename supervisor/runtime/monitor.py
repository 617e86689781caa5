"""Watching children: exits (waitpid), liveness deadlines, gaps of the loop.

`reap()` is also the liveness of an idle child, which sends no heartbeat.
See docs/supervisor.md ("Liveness").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from broker import lifeline
from supervisor.runtime.children import Child


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


def early_exit_applies(reaped_at: float, now: float, alive: bool) -> bool:
    """Whether an exit reaped under an unknown pid belongs to the fork the
    zygote has just named with that pid. As a child subreaper the supervisor
    also reaps orphans (commands' descendants, the zygote's go-betweens); once
    reaped, their pid numbers are free for reuse. So the stored exit counts
    only if it is recent and no live process holds the pid: a live one means
    the number was reused and the exit was some other orphan's."""
    return not alive and now - reaped_at <= EARLY_EXIT_TTL_S


def overdue(
    child: Child, now: float, heartbeat_timeout_s: float, listening_since: float = 0.0
) -> Literal["ready", "heartbeat"] | None:
    """Which liveness deadline a child has missed, if any. Silence is counted
    from `listening_since` at the earliest: the supervisor's own resumption
    after a gap (GapDetector), so time it could not listen is not the child's."""
    if child.pid is None or child.started_at is None:
        return None
    ready_s = child.spec.ready_timeout_s
    started = max(child.started_at, listening_since)
    if child.state == "starting" and ready_s is not None and now - started > ready_s:
        return "ready"
    beat = child.heartbeat_at
    if child.idle_at is not None:  # waits for work: held alive by its process (reap())
        return None
    if (child.state == "running" and beat is not None
            and now - max(beat, listening_since) > heartbeat_timeout_s):
        return "heartbeat"
    return None


def _boottime() -> float:
    """CLOCK_BOOTTIME: like CLOCK_MONOTONIC, but it also runs while the machine sleeps."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


class GapDetector:
    """Notices that the supervisor's own loop did not run for a while: the
    process was stopped (SIGSTOP, a debugger) or the machine suspended. The
    loop calls `gap()` once per turn; a turn normally takes at most its poll
    timeout (100 ms) plus its work. CLOCK_MONOTONIC runs while a process is
    stopped but, on Linux, not while the machine sleeps; CLOCK_BOOTTIME runs
    in both cases; the larger of the two deltas is the gap."""

    def __init__(self, boottime: Callable[[], float] = _boottime) -> None:
        self._boottime = boottime
        self._last: tuple[float, float] | None = None

    @staticmethod
    def threshold_s(heartbeat_timeout_s: float) -> float:
        """A loop turn longer than this was not the loop's own work."""
        return max(0.5, heartbeat_timeout_s / 4)

    def gap(self, now: float, heartbeat_timeout_s: float) -> float | None:
        """The time since the last call when it exceeds the threshold, else None."""
        boot = self._boottime()
        last, self._last = self._last, (now, boot)
        if last is None:
            return None
        delta = max(now - last[0], boot - last[1])
        return delta if delta > self.threshold_s(heartbeat_timeout_s) else None
