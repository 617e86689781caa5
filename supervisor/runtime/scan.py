"""The per-child scan: restarts due, stop deadlines and liveness, at most
every SCAN_INTERVAL_S or at the next deadline, over the watched children.

The runtime (supervisor/runtime/loop.py) watches a child when it gives it a
deadline or it beats. See docs/supervisor.md ("Liveness").
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.runtime import monitor, spawner

if TYPE_CHECKING:
    from supervisor.runtime.children import Child

# The per-child scan (liveness, restarts, stop deadlines) runs this often at
# most, or at the next deadline, not on every loop turn: with 500 children a
# turn per heartbeat made the loop O(children) per message.
# It visits only the watched children (a deadline pending, or beating): an idle
# child, held alive by its process, costs the scan nothing.
SCAN_INTERVAL_S = 0.1
# Every child is looked at again this often (the watched set rebuilt), in case
# some path gave one a deadline without watching it.
RESCAN_ALL_S = 5.0

log = structlog.get_logger("supervisor")


class Scanner:
    """The watched children and the time of the next scan."""

    def __init__(self) -> None:
        self.at = 0.0  # monotonic: the next per-child scan (0: on the next turn)
        self.rescan_at = 0.0  # monotonic: the next scan of every child
        self.watched: dict[str, Child] = {}  # what the scan visits (see scan)

    def watch(self, child: Child) -> None:
        """The scan looks at `child` from now on (until nothing is pending)."""
        self.watched[child.name] = child

    def due_by(self, deadline: float) -> None:
        """The next scan no later than `deadline` (a restart or a stop deadline)."""
        self.at = min(self.at, deadline)

    def scan(self, now: float, children: dict[str, Child], *, stopping: bool,
             heartbeat_timeout_s: float, listening_since: float,
             start: Callable[[Child, float], None]) -> None:
        """The per-child deadlines: restarts due (`start`), stop deadlines,
        liveness; the next scan at the earliest deadline left, SCAN_INTERVAL_S
        at the latest. It visits the watched children only, and drops those
        with nothing pending: down and not due to restart, or idle (no
        heartbeat expected: their exits come from reap()); every child again
        each RESCAN_ALL_S."""
        self.at = now + SCAN_INTERVAL_S
        if now >= self.rescan_at:
            self.rescan_at = now + RESCAN_ALL_S
            self.watched = dict(children)
        for child in list(self.watched.values()):
            if children.get(child.name) is not child or (
                    child.restart_at is None and child.stop_deadline is None
                    and (child.pid is None or child.idle_at is not None)):
                del self.watched[child.name]
                continue
            if child.restart_at is not None and now >= child.restart_at and not stopping:
                child.restart_at = None
                child.restarts += 1
                start(child, now)
            if child.stop_deadline is not None and now >= child.stop_deadline and child.pid:
                log.warning("child_killed", child=child.name, pid=child.pid,
                            after_s=child.spec.shutdown_timeout_s)
                spawner.signal_group(child.pid, signal.SIGKILL)
                child.stop_deadline = None
            missed = monitor.overdue(child, now, heartbeat_timeout_s, listening_since)
            if missed is not None and child.pid is not None and not stopping:
                log.warning("child_unresponsive", child=child.name, pid=child.pid, missed=missed)
                spawner.signal_group(child.pid, signal.SIGKILL)
                child.heartbeat_at = None
                child.started_at = now  # one kill per deadline
            for t in (child.restart_at, child.stop_deadline):
                if t is not None and now < t < self.at:
                    self.at = t
