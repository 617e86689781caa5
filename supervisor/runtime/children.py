"""One child's bookkeeping as the supervisor sees it, and its status line.

Facts only; decisions are supervisor/runtime/policy.py's. See docs/supervisor.md
("Status").
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Literal

from broker.protocol import Busy, ChildStatus
from supervisor.config import ChildSpec
from supervisor.runtime.policy import Exit, Policy

State = Literal["starting", "running", "backoff", "exited", "fatal", "stopping", "stopped"]


def describe_exit(code: int | None, sig: int | None) -> str:
    if sig is not None:
        try:
            return f"signal {signal.Signals(sig).name}"
        except ValueError:
            return f"signal {sig}"
    return f"exit {code}"


@dataclass
class Child:
    spec: ChildSpec
    policy: Policy
    state: State = "starting"
    pid: int | None = None
    started_at: float | None = None  # monotonic, when the process was spawned
    requested_at: float | None = None  # monotonic, when its start was asked for
    ready_ms: float | None = None
    restarts: int = 0
    history: list[Exit] = field(default_factory=list)
    last_exit: str | None = None
    restart_at: float | None = None
    stop_deadline: float | None = None
    restart_requested: bool = False
    fork_pending: bool = False  # asked the zygote, no pid yet
    held: bool = False  # stopped by the operator: stays down until `start`/`restart`
    removing: bool = False  # `remove` or a reload dropped it: forgotten once it is down
    spawned_by_operator: bool = False  # added by `spawn`, not by the configuration
    heartbeat_at: float | None = None
    values: dict[str, int | float] = field(default_factory=dict)
    busy: Busy | None = None  # the call its last heartbeat said it was in
    idle_at: float | None = None  # monotonic: its last heartbeat said it waits for work
    exited_pid: int | None = None  # the pid of the process that exited last
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    uss_bytes: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    def spawned(self, pid: int, now: float) -> None:
        self.pid = pid
        self.exited_pid = None
        self.started_at = now
        self.fork_pending = False
        self.heartbeat_at = None
        self.busy = None
        self.idle_at = None
        self.ready_ms = None
        self.cpu_percent = self.rss_bytes = self.uss_bytes = None
        self.state = "starting" if self.spec.ready_timeout_s is not None else "running"

    def exited(self, code: int | None, sig: int | None, now: float) -> Exit:
        record = Exit(at_s=now, code=code, signal=sig, requested=self.restart_requested)
        self.history.append(record)
        self.last_exit = describe_exit(code, sig)
        self.exited_pid = self.pid
        self.pid = None
        self.busy = None
        self.idle_at = None
        self.started_at = None
        self.stop_deadline = None
        self.cpu_percent = self.rss_bytes = self.uss_bytes = None
        return record

    def beat(self, now: float, values: dict[str, int | float], busy: Busy | None) -> bool:
        """A heartbeat from the running process; True when it changed what
        status shows beyond counters (it went idle, woke up, entered or left
        a call). A beat with `values["idle"]` says the child waits for work:
        no beat follows until it wakes (docs/supervisor.md, "Liveness")."""
        idle = bool(values.get("idle"))
        changed = idle != (self.idle_at is not None) or (busy is None) != (self.busy is None) \
            or (busy is not None and self.busy is not None and busy.op != self.busy.op)
        self.heartbeat_at = now
        self.values = dict(values)
        self.busy = busy
        if not idle:
            self.idle_at = None
        elif self.idle_at is None:
            self.idle_at = now
        return changed

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the last proof of life: the last beat, or, for an idle
        child, now: it is held alive by its process, whose exit the supervisor
        reaps the moment it happens."""
        if self.heartbeat_at is None:
            return None
        if self.idle_at is not None and self.pid is not None:
            return 0.0
        return round(now - self.heartbeat_at, 3)

    def status(self, now: float) -> ChildStatus:
        values: dict[str, int | float] = dict(self.values)
        if self.ready_ms is not None:
            values["ready_ms"] = self.ready_ms
        if self.idle_at is not None:
            values["idle_s"] = round(now - self.idle_at, 3)
        return ChildStatus(
            name=self.name,
            kind=self.spec.kind,
            pid=self.pid,
            state=self.state,
            uptime_s=round(now - self.started_at, 3) if self.started_at is not None else None,
            restarts=self.restarts,
            last_exit=self.last_exit,
            cpu_percent=self.cpu_percent,
            rss_bytes=self.rss_bytes,
            uss_bytes=self.uss_bytes,
            heartbeat_age_s=self.heartbeat_age(now),
            values=values,
            busy=self._busy_now(now),
        )

    def _busy_now(self, now: float) -> Busy | None:
        """The call the child is in, its age brought up to `now`."""
        if self.busy is None or self.heartbeat_at is None:
            return None
        return Busy(op=self.busy.op, since_s=round(self.busy.since_s + now - self.heartbeat_at, 3))
