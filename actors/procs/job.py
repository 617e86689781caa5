"""What background commands and terminals share: entry, log cursor, ending.

Final states: exited, killed, capped, expired, quota_exceeded, lost.
See docs/procs.md ("Ending a tree").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from actors.procs import cgroup, launch
from actors.procs.quota import WorkspaceQuota
from actors.procs.registry import Entry, JobState

SANDBOX_KEY = "sandbox"  # Entry.extra: "on" | "off", how the job was started
GROUP_KEY = "cgroup"  # Entry.extra: "on" when the job runs in a control group of its own

_STATE_BY_REASON: dict[str, JobState] = {
    "request": "killed",
    "session_end": "killed",
    "shutdown": "killed",
    "cap": "capped",
    "lifetime": "expired",
    "timeout": "expired",
    "quota": "quota_exceeded",
}


def state_for(reason: str) -> JobState:
    return _STATE_BY_REASON[reason]


def read_log(path: str, cursor: int, max_bytes: int) -> tuple[bytes, int]:
    """(bytes of the log from `cursor`, at most max_bytes; the log's size)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return b"", 0
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, max_bytes, cursor) if cursor < size else b""
    finally:
        os.close(fd)
    return data, size


class Job:
    """One started program; the host drives it with refresh()/escalate()."""

    def __init__(self, entry: Entry, *, ours: bool, kill_grace_s: float) -> None:
        self.entry = entry
        self.ours = ours  # our child (we reap it) or re-attached after a restart
        self.kill_grace_s = kill_grace_s
        self.wait_status: int | None = None
        self.kill_deadline: float | None = None  # monotonic: SIGKILL when passed
        self.killed_hard = False
        # the process group is the job's only while it runs under this procs (or
        # was re-attached running): a job known only as ended (an older registry
        # entry, or remembered from its files) left a pgid that may be reused, so
        # ending it reaches only its marked processes
        self.group_known = entry.state == "running"
        self.cgroup: cgroup.Group | None = None  # set by the host (start, re-attach)
        self.quota: WorkspaceQuota | None = None  # set by the host at start (none re-attached)

    @property
    def proc_id(self) -> str:
        return self.entry.proc_id

    @property
    def sandboxed(self) -> bool | None:
        """Whether it runs in a sandbox (None: not known, an entry of before)."""
        mark = self.entry.extra.get(SANDBOX_KEY)
        return None if mark is None else mark == "on"

    @property
    def running(self) -> bool:
        return self.entry.state == "running"

    def log_size(self) -> int:
        try:
            return os.stat(self.entry.log_path, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0

    def read(self, cursor: int, max_bytes: int) -> tuple[bytes, bool]:
        """(data, eof): eof once the job ended and every byte was returned."""
        data, size = read_log(self.entry.log_path, cursor, max_bytes)
        return data, (not self.running and cursor + len(data) >= size)

    def expired(self) -> bool:
        return time.time() >= self.entry.deadline_wall

    def kill(self, reason: str) -> None:
        """Start ending the tree (idempotent; the first reason wins)."""
        if self.entry.kill_reason is None and self.running:
            self.entry.kill_reason = reason
        if self.kill_deadline is None:
            self.kill_deadline = time.monotonic() + self.kill_grace_s
            if self.cgroup is not None:
                self._signal_group(signal.SIGTERM)
            elif self.running or self.sandboxed is not True:  # an ended sandbox left nothing
                launch.end_tree(self.entry.pid, self.proc_id, signal.SIGTERM,
                                group=self.group_known, sandboxed=self.sandboxed)

    def escalate(self) -> None:
        """SIGKILL the tree once the grace period is over."""
        if self.kill_deadline is None or self.killed_hard:
            return
        if time.monotonic() >= self.kill_deadline:
            self.killed_hard = True
            if self.cgroup is not None:
                cgroup.kill(self.cgroup)
                return
            launch.end_tree(self.entry.pid, self.proc_id, signal.SIGKILL, group=self.group_known,
                            sandboxed=self.sandboxed)

    def settled(self) -> bool:
        """Ended, and nothing of its tree is left (checked after kills)."""
        if self.cgroup is not None:
            return not self.running and not cgroup.members(self.cgroup)
        return not self.running and launch.tree_gone(self.entry.pid, self.proc_id,
                                                     group=self.group_known,
                                                     sandboxed=self.sandboxed)

    def _signal_group(self, sig: int) -> None:
        """`sig` to the group's programs: sandboxed, those inside the sandbox
        but its init (bwrap does not pass signals on, and the end of its init
        kills the rest at once, leaving no grace period); else all of them."""
        pids = cgroup.members(self.cgroup) if self.cgroup is not None else []
        inner = [p for p in pids if cgroup.sandbox_inner(p)]
        for pid in inner if self.sandboxed is not False and inner else pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def refresh(self) -> bool:
        """Advance the job; True when it just reached an end state."""
        raise NotImplementedError

    def leader_gone(self) -> bool:
        if self.ours:
            return self.wait_status is not None
        return not launch.alive(self.entry.pid, self.entry.start_ticks)
