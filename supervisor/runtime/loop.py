"""The supervisor loop: owns the children and wires the parts that start
them (starter.py: fresh or through the zygote), scan them (scan.py:
restarts, stop deadlines, liveness) and publish their status (publisher.py),
with the control socket's requests (requests.py).

One thread does everything (PDEATHSIG is tied to the parent thread).
See docs/supervisor.md ("Process tree", "Start, stop, restart").
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from collections import deque
from pathlib import Path
from types import FrameType

import structlog
import zmq

from actors.procs import launch
from actors.writer.hooks import EXIT_HALTED
from broker import lifeline, pidlock, protocol
from broker.statedir import StateDir
from supervisor import automation, storage
from supervisor.config import CORE_KINDS, KIND_ORDER, Config
from supervisor.runtime import monitor, requests, spawner
from supervisor.runtime.children import Child
from supervisor.runtime.control import ControlServer, Incoming
from supervisor.runtime.policy import Exit, GiveUp, Restart, decide, trim
from supervisor.runtime.publisher import StatusPublisher
from supervisor.runtime.scan import Scanner
from supervisor.runtime.starter import Starter

EXIT_OK = 0
EXIT_WAL_CORRUPT = 65  # the writer found the WAL corrupt: the operator must act
EXIT_CORE_GAVE_UP = 69  # the writer or the broker gave up (EX_UNAVAILABLE)

log = structlog.get_logger("supervisor")


class Runtime:
    """The running supervisor of one state directory: its children, the
    loop, and the parts it wires (starter, scanner, publisher)."""

    def __init__(self, config: Config, state_dir: StateDir,
                 config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path  # re-read by a reload (None: the default file)
        self.state_dir = state_dir
        self.children = {
            s.name: Child(spec=s, policy=s.policy()) for s in config.child_specs()
        }
        self.by_pid: dict[int, Child] = {}
        # reaped before the zygote's reply named the pid: (exit, when reaped)
        self.early_exits: dict[int, tuple[monitor.Reaped, float]] = {}
        self.early_ready: dict[int, float] = {}  # `ready` before the zygote's reply
        self.phase = 0  # index into KIND_ORDER while starting
        self.stop_phase = len(KIND_ORDER) - 1  # the same, backwards, while stopping
        self.stopping = False
        self.exit_code = EXIT_OK
        self.fenced = False  # the writer stopped fenced: this host's agents live elsewhere
        self.rng = random.Random()  # noqa: S311 - backoff jitter, not secrets
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.control = ControlServer(self.ctx, state_dir)
        self._signals: deque[int] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._phase_due = True  # a start phase may move: _advance_start on the next turn
        self.gaps = monitor.GapDetector()
        self.listening_since = 0.0  # monotonic: silence before this is not counted
        # the parts: starting children (and the zygote), the scan, the status
        self.starter = Starter(self, state_dir, self.control.zap.keyring,
                               self.control.endpoint, use_zygote=config.agents.zygote)
        self.scanner = Scanner()
        self.publisher = StatusPublisher(state_dir, lambda: self.children)
        self.automation = automation.Automation(state_dir, config.automation,
                                                self.control.zap.keyring)

    def _finish_purges(self) -> None:
        """Purges stopped before their end are finished before any agent
        starts (docs/sessions.md, "Purge")."""
        from actors.sessions import purge  # noqa: PLC0415 - only at start

        try:
            finished = purge.finish_interrupted(self.state_dir.root)
        except (OSError, sqlite3.Error) as exc:
            log.warning("purges_not_finished", error=str(exc))
            return
        if finished:
            log.info("purges_finished", sessions=finished)

    # --- main loop ---------------------------------------------------------------
    def run(self) -> int:
        lifeline.become_subreaper()
        self._install_signals()
        self.publisher.start_metrics(self.config)
        janitor = storage.Janitor(self.state_dir, self.config.storage)  # caps (docs/storage.md)
        janitor.start()
        self._finish_purges()
        self.publisher.start_hooks(self.config)  # docs/fleet.md
        self.automation.start()
        log.info("supervisor_started", state_dir=str(self.state_dir.root),
                 children=len(self.children), endpoint=self.control.endpoint)
        if self.starter.use_zygote:  # first: it forks the system children too (starter.py)
            self.starter.start_zygote(time.monotonic())
        poller = zmq.Poller()
        poller.register(self.control.sock, zmq.POLLIN)
        poller.register(self.control.zap.socket, zmq.POLLIN)  # authentication (auth.py)
        poller.register(self._wake_r, zmq.POLLIN)
        zygote_fd = -1
        try:
            while True:
                now = time.monotonic()
                gap_s = self.gaps.gap(now, self.config.heartbeat.timeout_s)
                if gap_s is not None:  # stopped or suspended: we could not listen
                    self.listening_since = now
                    log.warning("supervisor_resumed_after_gap", gap_s=round(gap_s, 3))
                self._advance(now)
                if self.stopping and self._all_down():
                    break
                zygote = self.starter.zygote
                if zygote is not None and zygote.fileno() != zygote_fd:
                    if zygote_fd >= 0:
                        poller.unregister(zygote_fd)
                    zygote_fd = zygote.fileno()
                    if zygote_fd >= 0:
                        poller.register(zygote_fd, zmq.POLLIN)
                events = dict(poller.poll(self._timeout_ms(now)))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                self._handle_signals()
                now = time.monotonic()
                for reaped in monitor.reap():
                    self._on_reaped(reaped, now)
                if self.starter.zygote is not None and zygote_fd in events:
                    self.starter.on_replies(now)
                for incoming in self.control.receive():
                    try:
                        self._on_message(incoming, time.monotonic())
                    except Exception:  # noqa: BLE001 - no message may stop the supervisor
                        self.control.handling_failed(incoming)
        finally:
            janitor.stop()
            self.automation.close()
            self.publisher.close()  # the last status file
            self.control.close()
            self.ctx.destroy(linger=0)
            signal.set_wakeup_fd(-1)
            if self.fenced:
                self._end_fenced_jobs()
            log.info("supervisor_stopped", exit_code=self.exit_code)
        return self.exit_code

    def _end_fenced_jobs(self) -> None:
        """A fenced host runs nothing of its agents (they were adopted
        elsewhere): the command jobs its procs left running before it died,
        which outlive procs by design so that a restarted procs finds them
        again, are ended once every child is down (docs/fleet.md)."""
        ended = launch.end_runtime_jobs(str(self.state_dir.root))
        log.warning("fenced_jobs_ended", processes=len(ended))

    def _timeout_ms(self, now: float) -> int:
        # the scan's time covers every child's deadline
        wake = [self.publisher.next_at, self.scanner.at]
        if self.starter.zygote_restart_at is not None:
            wake.append(self.starter.zygote_restart_at)
        wait_s = min(wake) - now
        # liveness deadlines are checked at least every 100 ms
        return max(0, min(100, int(wait_s * 1000) + 1))

    def _advance(self, now: float) -> None:
        """Everything driven by time: restarts, deadlines, start phases, status."""
        if now >= self.scanner.at:
            self._phase_due = True  # and the start phases, as often (besides their events)
            self.scanner.scan(now, self.children, stopping=self.stopping,
                              heartbeat_timeout_s=self.config.heartbeat.timeout_s,
                              listening_since=self.listening_since, start=self.start)
        self.starter.restart_zygote_if_due(now)
        self.starter.flush()
        if self.stopping:
            self._advance_stop(now)
        else:
            if self._phase_due:
                self._phase_due = False
                self._advance_start(now)
            automation.service(self, now)
        self.publisher.round_if_due(now, self.config.status_interval_s,
                                    self.starter.agents_starting())

    # --- starting ----------------------------------------------------------------
    def _advance_start(self, now: float) -> None:
        while self.phase < len(KIND_ORDER):
            group = [c for c in self.children.values() if c.kind == KIND_ORDER[self.phase]]
            for child in group:
                if child.pid is None and not child.fork_pending and child.state == "starting" \
                        and child.requested_at is None:
                    self.start(child, now)
            if any(c.state in ("starting", "backoff") for c in group):
                return  # the next kind waits until this one is ready (or given up)
            self.phase += 1
            log.info("phase_started", kind=KIND_ORDER[self.phase - 1], children=len(group))

    def start(self, child: Child, now: float) -> None:
        """Start `child` (the starter picks how); its pid comes back to register()."""
        self.publisher.dirty = True
        self.starter.start(child, now)

    def register(self, child: Child, pid: int, now: float) -> None:
        """`child` runs as `pid` (spawned, or forked by the zygote)."""
        child.spawned(pid, now)
        self.scanner.watch(child)
        self.publisher.dirty = True
        self._phase_due = True  # a child without a ready timeout runs at once
        self.by_pid[pid] = child
        log.info("actor_spawned", child=child.name, kind=child.kind, pid=pid)
        ready_at = self.early_ready.pop(pid, None)
        if ready_at is not None:
            self._ready(child, ready_at)
        if child.held or child.removing or child.restart_requested:
            self.terminate(child, now)  # stopped, removed or reloaded while being forked
        early = self.early_exits.pop(pid, None)
        if early is not None:
            reaped, reaped_at = early
            if monitor.early_exit_applies(reaped_at, now, pidlock.pid_alive(pid)):
                self._on_reaped(reaped, now)
            else:
                log.info("early_exit_discarded", child=child.name, pid=pid)

    # --- exits -------------------------------------------------------------------
    def _on_reaped(self, reaped: monitor.Reaped, now: float) -> None:
        if self.starter.reaped(reaped, now):
            return
        child = self.by_pid.pop(reaped.pid, None)
        if child is None or child.pid != reaped.pid:
            # maybe a fork not yet announced, maybe an orphan's: see register()
            if len(self.early_exits) >= 1_000:
                self.early_exits = {
                    p: e for p, e in self.early_exits.items()
                    if now - e[1] <= monitor.EARLY_EXIT_TTL_S
                }
            self.early_exits[reaped.pid] = (reaped, now)
            return
        record = child.exited(reaped.code, reaped.signal, now)
        log.info("actor_exited", child=child.name, pid=reaped.pid, returncode=reaped.code,
                 signal=reaped.signal, last_exit=child.last_exit)
        self.after_exit(child, record, now)

    def after_exit(self, child: Child, record: Exit, now: float) -> None:
        """`child` exited (or never started): restart it, hold it, or give up."""
        self._phase_due = True
        self.publisher.dirty = True
        self.scanner.watch(child)
        if child.kind == "writer" and record.code == EXIT_HALTED:  # the fleet fenced it
            self.fenced = True
        if child.removing:
            requests.forget(self, child)
            return
        if child.held:
            child.state = "stopped"
            log.info("child_stopped", child=child.name, last_exit=child.last_exit)
            return
        if self.stopping:
            child.state = "exited"
            return
        child.history = trim(child.policy, child.history, now)
        decision = decide(child.policy, child.history, now, self.rng.random())
        if isinstance(decision, Restart):
            child.state = "backoff"
            child.restart_at = now + decision.delay_s
            self.scanner.due_by(child.restart_at)  # restarted on time
            if decision.delay_s > 0:
                log.info("child_backed_off", child=child.name, delay_s=round(decision.delay_s, 3))
        elif isinstance(decision, GiveUp):
            child.state = "fatal"
            log.error("child_gave_up", child=child.name, kind=child.kind, reason=decision.reason,
                      last_exit=child.last_exit)
            self.automation.child_gave_up(child.name, child.kind, decision.reason)
            if child.kind in CORE_KINDS:
                code = EXIT_WAL_CORRUPT if (child.kind == "writer"
                                            and record.code == EXIT_WAL_CORRUPT) else (
                    EXIT_CORE_GAVE_UP)
                log.error("runtime_stopping", reason=f"{child.kind} {child.name} gave up",
                          exit_code=code)
                self._begin_stop(code)
        else:
            child.state = "exited"
            log.info("child_left_exited", child=child.name, reason=decision.reason)

    # --- stopping ----------------------------------------------------------------
    def _begin_stop(self, code: int) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.exit_code = code
        self.publisher.dirty = True
        self.stop_phase = len(KIND_ORDER) - 1
        self.automation.close(timeout_s=0)  # no more schedules or hooks; joined at the end
        self.starter.stop()
        for child in self.children.values():
            child.restart_at = None
            child.fork_pending = False
            if child.pid is None and child.state in ("backoff", "starting"):
                child.state = "exited"
        log.info("runtime_stop_started", exit_code=code)

    def _advance_stop(self, now: float) -> None:
        while self.stop_phase >= 0:
            kind = KIND_ORDER[self.stop_phase]
            group = [c for c in self.children.values() if c.kind == kind]
            for child in group:
                if child.pid is not None and child.state != "stopping":
                    self.terminate(child, now)
            if any(c.pid is not None for c in group):
                return
            if kind == "agent" and self.starter.zygote is not None:
                self.starter.close_zygote()  # it exits at EOF
                return
            self.stop_phase -= 1

    def terminate(self, child: Child, now: float) -> None:
        """SIGTERM `child`'s group; SIGKILL at its stop deadline (the scan)."""
        assert child.pid is not None
        child.state = "stopping"
        child.stop_deadline = now + child.spec.shutdown_timeout_s
        self.scanner.watch(child)
        self.publisher.dirty = True
        self.scanner.due_by(child.stop_deadline)
        spawner.signal_group(child.pid, signal.SIGTERM)

    def _all_down(self) -> bool:
        return self.stop_phase < 0 and all(c.pid is None for c in self.children.values())

    # --- control -----------------------------------------------------------------
    def _on_message(self, incoming: Incoming, now: float) -> None:
        msg = incoming.message
        if not isinstance(msg, protocol.Heartbeat | protocol.StatusRequest):
            self._phase_due = True  # a request may start or stop children
            self.publisher.dirty = True
        match msg:
            case protocol.Ready(actor=actor, pid=pid):
                child = self.children.get(actor)
                if child is not None and child.fork_pending:
                    # a fast agent can be ready before the zygote's reply names its pid
                    self.early_ready[pid] = now
                elif child is not None and child.pid == pid:
                    self._ready(child, now)
            case protocol.Heartbeat(actor=actor, pid=pid, values=values):
                child = self.children.get(actor)
                if child is not None and child.pid == pid:
                    self._ready(child, now)  # a heartbeat also proves it serves
                    if child.beat(now, values, msg.busy):
                        self.publisher.dirty = True
                    if child.idle_at is None:
                        self.scanner.watch(child)  # beating: its silence is watched
                elif child is not None and child.pid is None and child.exited_pid == pid:
                    # a final beat sent just before a clean exit, read after the reap:
                    # its counters are the last word (an agent's phase `finished`)
                    child.values = dict(values)
            case protocol.StatusRequest(msg_id=msg_id):
                # someone looks: full sampling passes for a while
                self.control.reply(incoming.identity, self.publisher.asked(msg_id, now))
            case protocol.Ping(msg_id=msg_id):  # every identity may (docs/protocol.md)
                self.control.reply(incoming.identity, protocol.Pong(
                    msg_id=msg_id, actor="supervisor", pid=os.getpid()))
            case protocol.StatsRequest(msg_id=msg_id):
                self.control.reply(incoming.identity, protocol.Stats(
                    msg_id=msg_id, actor="supervisor",
                    values={"children": len(self.children), **self.control.values()}))
            case protocol.StopRequest(msg_id=msg_id, target=None):
                self.control.reply(incoming.identity, protocol.Ack(
                    msg_id=msg_id, affected=list(self.children)))
                log.info("stop_requested")
                self._begin_stop(EXIT_OK)
            case _:  # the operator's requests on one child, the reload, the unknown
                self.control.reply(incoming.identity, requests.answer(self, msg, now))

    def _ready(self, child: Child, now: float) -> None:
        if child.state != "starting":
            return
        child.state = "running"
        child.heartbeat_at = now
        self._phase_due = True
        self.publisher.dirty = True
        self.scanner.watch(child)
        if child.requested_at is not None:
            child.ready_ms = round((now - child.requested_at) * 1000, 2)
        log.info("actor_ready", child=child.name, pid=child.pid, ready_ms=child.ready_ms)

    # --- signals -----------------------------------------------------------------
    def _install_signals(self) -> None:
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _handle_signals(self) -> None:
        while self._signals:
            self._phase_due = True
            sig = self._signals.popleft()
            if sig == signal.SIGHUP:  # like supervisord and systemd's ExecReload: reload
                log.info("reload_signalled", signal="SIGHUP")
                requests.reload(self, "sighup", time.monotonic())
            elif sig in (signal.SIGTERM, signal.SIGINT):
                log.info("stop_signalled", signal=signal.Signals(sig).name)
                self._begin_stop(EXIT_OK)
