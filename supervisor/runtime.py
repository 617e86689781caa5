"""The supervisor loop: wires spawner, monitor, policy and control socket.

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
from typing import TYPE_CHECKING

import structlog
import zmq

from actors.procs import launch
from actors.writer.hooks import EXIT_HALTED
from actors.zygotewire import Forked
from broker import lifeline, protocol
from broker.control import ENV_HEARTBEAT_TIMEOUT
from broker.errors import SpawnError
from broker.statedir import StateDir
from supervisor import automation, commands, monitor, requests, spawner, statusfile, storage
from supervisor.children import Child, describe_exit
from supervisor.config import CORE_KINDS, KIND_ORDER, Config
from supervisor.control import ControlServer, Incoming
from supervisor.hooks import StatusHook, status_hooks
from supervisor.policy import Exit, GiveUp, Policy, Restart, decide, trim
from supervisor.sampling import SamplerThread, apply_samples

EXIT_OK = 0
EXIT_WAL_CORRUPT = 65  # the writer found the WAL corrupt: the operator must act
EXIT_CORE_GAVE_UP = 69  # the writer or the broker gave up (EX_UNAVAILABLE)
FORKS_IN_FLIGHT = 8  # forks asked of the zygote and not yet answered (flow control)
# Agents asked of the zygote and not yet ready: more only share the cores with
# these (docs/decisions.md, "Agents fork from a zygote: one clone, a pool, paced starts")
AGENTS_STARTING = max(2, os.cpu_count() or 2)
ZYGOTE_POLICY = Policy(max_restarts=5, period_s=60.0, base_s=0.2, cap_s=5.0)
# The per-child scan (liveness, restarts, stop deadlines) runs this often at
# most, or at the next deadline, not on every loop turn: with 500 children a
# turn per heartbeat made the loop O(children) per message.
# It visits only the watched children (a deadline pending, or beating): an idle
# child, held alive by its process, costs the scan nothing.
SCAN_INTERVAL_S = 0.1
# Every child is looked at again this often (the watched set rebuilt), in case
# some path gave one a deadline without watching it.
RESCAN_ALL_S = 5.0
# run/status.json is rewritten when a child's state changes, at most every
# status interval; otherwise this often (its counters, samples and ages), so
# that 1,000 idle children do not cost a rewrite a second.
STATUS_REFRESH_S = 30.0
# While nobody asked for a status for this long (and no metrics endpoint nor
# fleet wants samples), a sampling pass reads only SAMPLE_TRICKLE children in
# turn instead of all of them (supervisor/sampling.py).
WATCHED_S = 10.0
SAMPLE_TRICKLE = 16

if TYPE_CHECKING:
    from supervisor.metrics import MetricsServer

log = structlog.get_logger("supervisor")


class Runtime:
    """The running supervisor of one state directory."""

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
        self.started_at = time.time()
        self.phase = 0  # index into KIND_ORDER while starting
        self.stop_phase = len(KIND_ORDER) - 1  # the same, backwards, while stopping
        self.stopping = False
        self.exit_code = EXIT_OK
        self._status_error: int | None = None  # errno of the failing status.json write
        self.fenced = False  # the writer stopped fenced: this host's agents live elsewhere
        self.rng = random.Random()  # noqa: S311 - backoff jitter, not secrets
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.control = ControlServer(self.ctx, state_dir)
        self.sampler = SamplerThread()  # psutil's reads, off this loop
        self.base_env = dict(os.environ)
        self.fork_queue: deque[Child] = deque()
        self.in_flight = 0
        self.starting: set[str] = set()  # agents asked of the zygote, not yet ready
        self.zygote: spawner.ZygoteLink | None = None
        self.zygote_history: list[Exit] = []
        self.zygote_restart_at: float | None = None
        self.use_zygote = config.agents.zygote
        self.zygote_stale = False  # a reload changed its arguments: replace it when idle
        self.retired_zygotes: set[int] = set()
        self._signals: deque[int] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._next_status = 0.0
        self._status_dirty = True  # a child's state changed since the last status file
        self._status_written_at = -STATUS_REFRESH_S  # monotonic
        self._status_asked_at = -WATCHED_S  # monotonic: the last status request
        self._scan_at = 0.0  # monotonic: the next per-child scan (0: on the next turn)
        self._rescan_at = 0.0  # monotonic: the next scan of every child
        self._watched: dict[str, Child] = {}  # what the scan visits (see _scan)
        self._phase_due = True  # a start phase may move: _advance_start on the next turn
        self.gaps = monitor.GapDetector()
        self.listening_since = 0.0  # monotonic: silence before this is not counted
        self.metrics: MetricsServer | None = None  # started by run() when configured
        self.status_hooks: list[StatusHook] = []  # the fleet's host (supervisor/hooks.py)
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
        self._start_metrics()
        janitor = storage.Janitor(self.state_dir, self.config.storage)  # caps (docs/storage.md)
        janitor.start()
        self._finish_purges()
        self.status_hooks = status_hooks(self.config, self.state_dir)  # docs/fleet.md
        self.automation.start()
        log.info("supervisor_started", state_dir=str(self.state_dir.root),
                 children=len(self.children), endpoint=self.control.endpoint)
        if self.use_zygote and any(c.kind == "agent" for c in self.children.values()):
            self._start_zygote(time.monotonic())
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
                if self.zygote is not None and self.zygote.fileno() != zygote_fd:
                    if zygote_fd >= 0:
                        poller.unregister(zygote_fd)
                    zygote_fd = self.zygote.fileno()
                    if zygote_fd >= 0:
                        poller.register(zygote_fd, zmq.POLLIN)
                events = dict(poller.poll(self._timeout_ms(now)))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                self._handle_signals()
                now = time.monotonic()
                for reaped in monitor.reap():
                    self._on_reaped(reaped, now)
                if self.zygote is not None and zygote_fd in events:
                    self._on_zygote_replies(now)
                for incoming in self.control.receive():
                    try:
                        self._on_message(incoming, time.monotonic())
                    except Exception:  # noqa: BLE001 - no message may stop the supervisor
                        self.control.handling_failed(incoming)
        finally:
            janitor.stop()
            self.sampler.close()
            self.automation.close()
            self._publish_status(time.monotonic())
            if self.metrics is not None:
                self.metrics.close()
            for hook in self.status_hooks:
                hook.close()
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

    def _child_base_env(self) -> dict[str, str]:
        """The environment every child starts from: ours, plus the heartbeat timeout
        (the children's pulse stops beating for a main thread stalled that long)."""
        return {**self.base_env, ENV_HEARTBEAT_TIMEOUT: repr(self.config.heartbeat.timeout_s)}

    def _timeout_ms(self, now: float) -> int:
        wake = [self._next_status, self._scan_at]  # the scan's time covers every deadline
        if self.zygote_restart_at is not None:
            wake.append(self.zygote_restart_at)
        wait_s = min(wake) - now
        # liveness deadlines are checked at least every 100 ms
        return max(0, min(100, int(wait_s * 1000) + 1))

    def _advance(self, now: float) -> None:
        """Everything driven by time: restarts, deadlines, start phases, status."""
        if now >= self._scan_at:
            self._scan(now)
        if self.zygote_restart_at is not None and now >= self.zygote_restart_at:
            self.zygote_restart_at = None
            if not self.stopping:
                self._start_zygote(now)
        self._flush_forks()
        if self.stopping:
            self._advance_stop(now)
        else:
            if self._phase_due:
                self._phase_due = False
                self._advance_start(now)
            automation.service(self, now)
        if now >= self._next_status:
            self._next_status = now + self.config.status_interval_s
            self._status_round(now)

    def _status_round(self, now: float) -> None:
        """Samples and the status file, every status interval, each at the cost
        of what changed: a full sampling pass only while someone looks (a
        status request within WATCHED_S, metrics, the fleet), a rewrite of the
        status file only when a child's state changed (or STATUS_REFRESH_S
        passed); otherwise a few children sampled in turn, nothing written."""
        samples = self.sampler.take()
        if samples:
            apply_samples(self.children.values(), samples)
        watched = (now - self._status_asked_at < WATCHED_S or self.metrics is not None
                   or bool(self.status_hooks))
        self.sampler.submit((c.pid for c in self.children.values() if c.pid is not None),
                            uss=not self._agents_starting(),
                            limit=None if watched else SAMPLE_TRICKLE)
        if (self._status_dirty or self.metrics is not None or self.status_hooks
                or now - self._status_written_at >= STATUS_REFRESH_S):
            self._publish_status(now)

    def _watch(self, child: Child) -> None:
        """The scan looks at `child` from now on (until nothing is pending)."""
        self._watched[child.name] = child

    def _scan(self, now: float) -> None:
        """The per-child deadlines: restarts due, stop deadlines, liveness; the
        next scan at the earliest deadline left, SCAN_INTERVAL_S at the latest.
        It visits the watched children only, and drops those with nothing
        pending: down and not due to restart, or idle (no heartbeat expected:
        their exits come from reap()); every child again each RESCAN_ALL_S."""
        self._scan_at = now + SCAN_INTERVAL_S
        self._phase_due = True  # and the start phases, as often (besides their events)
        if now >= self._rescan_at:
            self._rescan_at = now + RESCAN_ALL_S
            self._watched = dict(self.children)
        for child in list(self._watched.values()):
            if self.children.get(child.name) is not child or (
                    child.restart_at is None and child.stop_deadline is None
                    and (child.pid is None or child.idle_at is not None)):
                del self._watched[child.name]
                continue
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                child.restart_at = None
                child.restarts += 1
                self._start(child, now)
            if child.stop_deadline is not None and now >= child.stop_deadline and child.pid:
                log.warning("child_killed", child=child.name, pid=child.pid,
                            after_s=child.spec.shutdown_timeout_s)
                spawner.signal_group(child.pid, signal.SIGKILL)
                child.stop_deadline = None
            missed = monitor.overdue(child, now, self.config.heartbeat.timeout_s,
                                     self.listening_since)
            if missed is not None and child.pid is not None and not self.stopping:
                log.warning("child_unresponsive", child=child.name, pid=child.pid, missed=missed)
                spawner.signal_group(child.pid, signal.SIGKILL)
                child.heartbeat_at = None
                child.started_at = now  # one kill per deadline
            for t in (child.restart_at, child.stop_deadline):
                if t is not None and now < t < self._scan_at:
                    self._scan_at = t

    # --- starting ----------------------------------------------------------------
    def _advance_start(self, now: float) -> None:
        while self.phase < len(KIND_ORDER):
            group = [c for c in self.children.values() if c.kind == KIND_ORDER[self.phase]]
            for child in group:
                if child.pid is None and not child.fork_pending and child.state == "starting" \
                        and child.requested_at is None:
                    self._start(child, now)
            if any(c.state in ("starting", "backoff") for c in group):
                return  # the next kind waits until this one is ready (or given up)
            self.phase += 1
            log.info("phase_started", kind=KIND_ORDER[self.phase - 1], children=len(group))

    def _start(self, child: Child, now: float) -> None:
        self._status_dirty = True
        child.requested_at = now
        child.state = "starting"
        child.restart_requested = False
        if child.kind == "agent" and self.use_zygote:
            child.fork_pending = True
            self.starting.discard(child.name)  # queued again: not starting until asked
            self.fork_queue.append(child)
            self._flush_forks()
            return
        argv = commands.argv_for(child.spec, self.config, self.state_dir)
        if child.kind in spawner.ZYGOTE_KINDS and self._run_from_zygote(child, argv):
            child.fork_pending = True  # its reply comes with the agents' (_on_zygote_replies)
            self.in_flight += 1
            return
        self._spawn_fresh(child, argv, now)

    def _run_from_zygote(self, child: Child, argv: list[str]) -> bool:
        """Ask the zygote for the writer or broker `child` (its credential, without
        the model key, as a fresh start); False: start a fresh interpreter."""
        if self.zygote is None or not self.zygote.ready:
            return False
        try:
            credential = spawner.credential_for(self.control.zap.keyring, child.kind, child.name)
        except SpawnError:
            return False  # _spawn_fresh reports it
        return spawner.run_from_zygote(self.zygote, child.name, argv, credential,
                                       spawner.model_key_names(
                                           child.kind, self.config.agent.openai.api_key_env))

    def _spawn_fresh(self, child: Child, argv: list[str], now: float) -> None:
        env = spawner.child_env(self._child_base_env(), self.control.endpoint, child.name,
                                drop=spawner.model_key_names(
                                    child.kind, self.config.agent.openai.api_key_env))
        try:
            credential = spawner.credential_for(self.control.zap.keyring, child.kind, child.name)
            pid = spawner.spawn_with_credential(argv, env, credential)
        except SpawnError as exc:
            log.error("spawn_failed", child=child.name, error=str(exc))
            self._after_exit(child, child.exited(127, None, now), now)
            return
        self._register(child, pid, now)

    def _register(self, child: Child, pid: int, now: float) -> None:
        child.spawned(pid, now)
        self._watch(child)
        self._status_dirty = True
        self._phase_due = True  # a child without a ready timeout runs at once
        self.by_pid[pid] = child
        log.info("actor_spawned", child=child.name, kind=child.kind, pid=pid)
        ready_at = self.early_ready.pop(pid, None)
        if ready_at is not None:
            self._ready(child, ready_at)
        if child.held or child.removing or child.restart_requested:
            self._terminate(child, now)  # stopped, removed or reloaded while being forked
        early = self.early_exits.pop(pid, None)
        if early is not None:
            reaped, reaped_at = early
            if monitor.early_exit_applies(reaped_at, now, monitor.pid_alive(pid)):
                self._on_reaped(reaped, now)
            else:
                log.info("early_exit_discarded", child=child.name, pid=pid)

    def _flush_forks(self) -> None:
        if self.zygote_stale:
            if self.zygote is not None and self.in_flight > 0:
                return  # no fork to the old zygote; replace it once its forks are answered
            self._retire_zygote()
        if self.zygote is None:
            if not self.use_zygote:
                while self.fork_queue:  # the zygote gave up: fresh interpreters
                    child = self.fork_queue.popleft()
                    child.fork_pending = False
                    if child.state == "starting" and child.pid is None:
                        child.requested_at = None
                        self._start(child, time.monotonic())
            return
        while self.fork_queue and self.in_flight < FORKS_IN_FLIGHT and self._may_start_agent():
            child = self.fork_queue[0]
            if not child.fork_pending or self.stopping:
                self.fork_queue.popleft()
                continue
            try:
                credential = spawner.credential_for(self.control.zap.keyring, child.kind,
                                                    child.name)
            except SpawnError as exc:
                self.fork_queue.popleft()
                child.fork_pending = False
                log.error("spawn_failed", child=child.name, error=str(exc))
                self._after_exit(child, child.exited(127, None, time.monotonic()),
                                 time.monotonic())
                continue
            fd = spawner.credential_fd(credential)
            try:
                if not self.zygote.request(child.name, credential_fd=fd):
                    return
            finally:
                os.close(fd)
            child.requested_at = time.monotonic()  # ready_ms: fork request to `ready`
            self.fork_queue.popleft()
            self.in_flight += 1
            self.starting.add(child.name)

    def _may_start_agent(self) -> bool:
        """Fewer than AGENTS_STARTING agents between their fork request and
        `ready` (one that exited, failed or went back to the queue is out)."""
        if len(self.starting) >= AGENTS_STARTING:  # (a child queued again left it in _start)
            self.starting = {
                name for name in self.starting
                if (c := self.children.get(name)) is not None and c.state == "starting"
                and (c.fork_pending or c.pid is not None)}
        return len(self.starting) < AGENTS_STARTING

    def _agents_starting(self) -> bool:
        """Agents are being started (queued, or asked of the zygote and not ready)."""
        return bool(self.fork_queue) or any(
            (c := self.children.get(name)) is not None and c.state == "starting"
            for name in self.starting)

    def _start_zygote(self, now: float) -> None:
        link = spawner.ZygoteLink(commands.zygote_args(self.config, self.state_dir),
                                  spawner.child_env(self._child_base_env(),
                                                    self.control.endpoint, "zygote"))
        try:
            pid = link.start()
        except SpawnError as exc:
            log.error("zygote_spawn_failed", error=str(exc))
            self._zygote_lost(None, now)
            return
        self.zygote = link
        self.in_flight = 0
        self.starting.clear()
        log.info("zygote_spawned", pid=pid)
        pending = [c for c in self.children.values() if c.fork_pending]
        self.fork_queue = deque(pending)

    def _retire_zygote(self) -> None:
        """Replace the zygote after a reload changed its arguments (or turned it off)."""
        self.zygote_stale = False
        old = self.zygote
        if old is not None:
            self.zygote = None
            if old.pid is not None:
                self.retired_zygotes.add(old.pid)
                old.close()
                spawner.signal_group(old.pid, signal.SIGTERM)
        if self.use_zygote and not self.stopping:
            self.zygote_restart_at = None  # one zygote, started now with the new arguments
            self._start_zygote(time.monotonic())

    def _on_zygote_replies(self, now: float) -> None:
        assert self.zygote is not None
        for reply in self.zygote.replies():
            self.in_flight = max(0, self.in_flight - 1)
            child = self.children.get(reply.name)
            if child is None or not child.fork_pending:
                continue
            if isinstance(reply, Forked):
                self._register(child, reply.pid, now)
            else:
                log.error("spawn_failed", child=child.name, error=reply.reason)
                child.fork_pending = False
                if child.kind in spawner.ZYGOTE_KINDS:  # the writer, the broker: fresh
                    self._spawn_fresh(child, commands.argv_for(
                        child.spec, self.config, self.state_dir), now)
                    continue
                self._after_exit(child, child.exited(127, None, now), now)

    def _zygote_lost(self, reaped: monitor.Reaped | None, now: float) -> None:
        if self.zygote is not None:
            self.zygote.lost()
        self.zygote = None
        for child in self.children.values():  # a writer or broker asked of it: fresh
            if child.fork_pending and child.kind in spawner.ZYGOTE_KINDS:
                child.fork_pending = False
                self._spawn_fresh(child, commands.argv_for(
                    child.spec, self.config, self.state_dir), now)
        if self.stopping:
            return
        self.zygote_history.append(Exit(now, reaped.code if reaped else 127,
                                        reaped.signal if reaped else None))
        self.zygote_history = trim(ZYGOTE_POLICY, self.zygote_history, now)
        decision = decide(ZYGOTE_POLICY, self.zygote_history, now, self.rng.random())
        log.warning("zygote_exited", last_exit=describe_exit(reaped.code, reaped.signal)
                    if reaped else "spawn failed")
        if isinstance(decision, Restart):
            self.zygote_restart_at = now + decision.delay_s
        else:
            log.error("zygote_gave_up", fallback="fresh interpreters")
            self.use_zygote = False

    # --- exits -------------------------------------------------------------------
    def _on_reaped(self, reaped: monitor.Reaped, now: float) -> None:
        if self.zygote is not None and reaped.pid == self.zygote.pid:
            self._zygote_lost(reaped, now)
            return
        if reaped.pid in self.retired_zygotes:
            self.retired_zygotes.discard(reaped.pid)
            return
        child = self.by_pid.pop(reaped.pid, None)
        if child is None or child.pid != reaped.pid:
            # maybe a fork not yet announced, maybe an orphan's: see _register
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
        self._after_exit(child, record, now)

    def _after_exit(self, child: Child, record: Exit, now: float) -> None:
        self._phase_due = True
        self._status_dirty = True
        self._watch(child)
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
            self._scan_at = min(self._scan_at, child.restart_at)  # restarted on time
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
        self._status_dirty = True
        self.stop_phase = len(KIND_ORDER) - 1
        self.automation.close(timeout_s=0)  # no more schedules or hooks; joined at the end
        self.fork_queue.clear()
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
                    self._terminate(child, now)
            if any(c.pid is not None for c in group):
                return
            if kind == "agent" and self.zygote is not None:
                if self.zygote.pid is not None and self.zygote.sock is not None:
                    self.zygote.close()  # EOF: the zygote exits by itself
                    spawner.signal_group(self.zygote.pid, signal.SIGTERM)
                return
            self.stop_phase -= 1

    def _terminate(self, child: Child, now: float) -> None:
        assert child.pid is not None
        child.state = "stopping"
        child.stop_deadline = now + child.spec.shutdown_timeout_s
        self._watch(child)
        self._status_dirty = True
        self._scan_at = min(self._scan_at, child.stop_deadline)
        spawner.signal_group(child.pid, signal.SIGTERM)

    def _all_down(self) -> bool:
        return self.stop_phase < 0 and all(c.pid is None for c in self.children.values())

    # --- control -----------------------------------------------------------------
    def _on_message(self, incoming: Incoming, now: float) -> None:
        msg = incoming.message
        if not isinstance(msg, protocol.Heartbeat | protocol.StatusRequest):
            self._phase_due = True  # a request may start or stop children
            self._status_dirty = True
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
                        self._status_dirty = True
                    if child.idle_at is None:
                        self._watch(child)  # beating: its silence is watched
                elif child is not None and child.pid is None and child.exited_pid == pid:
                    # a final beat sent just before a clean exit, read after the reap:
                    # its counters are the last word (an agent's phase `finished`)
                    child.values = dict(values)
            case protocol.StatusRequest(msg_id=msg_id):
                self._status_asked_at = now  # someone looks: full sampling passes
                self.control.reply(incoming.identity, self._status(msg_id, now))
            case protocol.Ping(msg_id=msg_id):  # every identity may (docs/protocol.md)
                self.control.reply(incoming.identity, protocol.Pong(
                    msg_id=msg_id, actor="supervisor", pid=os.getpid()))
            case protocol.StatsRequest(msg_id=msg_id):
                self.control.reply(incoming.identity, protocol.Stats(
                    msg_id=msg_id, actor="supervisor",
                    values={"children": len(self.children), **self.control.values()}))
            case protocol.StopRequest(msg_id=msg_id, target=str() as target):
                self.control.reply(incoming.identity, requests.stop(self, msg_id, target, now))
            case protocol.StartRequest(msg_id=msg_id, target=target):
                self.control.reply(incoming.identity, requests.start(self, msg_id, target, now))
            case protocol.RemoveRequest(msg_id=msg_id, target=target):
                self.control.reply(incoming.identity, requests.remove(self, msg_id, target, now))
            case protocol.ReloadRequest(msg_id=msg_id):
                self.control.reply(incoming.identity, requests.reload(self, msg_id, now))
            case protocol.StopRequest(msg_id=msg_id):
                self.control.reply(incoming.identity, protocol.Ack(
                    msg_id=msg_id, affected=list(self.children)))
                log.info("stop_requested")
                self._begin_stop(EXIT_OK)
            case protocol.SignalRequest(msg_id=msg_id, target=target, signal=sig):
                self.control.reply(incoming.identity, self._signal(msg_id, target, sig))
            case protocol.RestartRequest(msg_id=msg_id, target=target):
                self.control.reply(incoming.identity, self._restart(msg_id, target, now))
            case protocol.SpawnRequest():
                self.control.reply(incoming.identity, requests.spawn(self, msg, now))
            case _:
                ref: str | None = getattr(msg, "msg_id", None)
                self.control.reply(incoming.identity, protocol.Error(
                    msg_id=ref, code=protocol.ErrorCode.UNEXPECTED_MESSAGE,
                    detail=f"the supervisor does not serve {msg.kind}"))

    def _ready(self, child: Child, now: float) -> None:
        if child.state != "starting":
            return
        child.state = "running"
        child.heartbeat_at = now
        self._phase_due = True
        self._status_dirty = True
        self._watch(child)
        if child.requested_at is not None:
            child.ready_ms = round((now - child.requested_at) * 1000, 2)
        log.info("actor_ready", child=child.name, pid=child.pid, ready_ms=child.ready_ms)

    def _refusal(self, msg_id: str, target: str) -> protocol.Error | None:
        if self.stopping:
            return protocol.Error(msg_id=msg_id, code=protocol.ErrorCode.SHUTTING_DOWN,
                                  detail="the supervisor is stopping")
        if target != "all" and target not in self.children:
            return protocol.Error(msg_id=msg_id, code=protocol.ErrorCode.NOT_FOUND,
                                  detail=f"no child named {target!r}")
        return None

    def _signal(self, msg_id: str, target: str, sig: int) -> protocol.Ack | protocol.Error:
        refused = self._refusal(msg_id, target)
        if refused is not None:
            return refused
        chosen = list(self.children.values()) if target == "all" else [self.children[target]]
        affected = [c.name for c in chosen if c.pid is not None
                    and spawner.signal_group(c.pid, sig)]
        if target != "all" and not affected:
            return protocol.Error(msg_id=msg_id, code=protocol.ErrorCode.NOT_FOUND,
                                  detail=f"{target} has no process (state "
                                         f"{self.children[target].state})")
        log.info("child_signalled", target=target, signal=sig, affected=len(affected))
        return protocol.Ack(msg_id=msg_id, affected=affected)

    def _restart(self, msg_id: str, target: str, now: float) -> protocol.Ack | protocol.Error:
        refused = self._refusal(msg_id, target) or (
            protocol.Error(msg_id=msg_id, code=protocol.ErrorCode.NOT_FOUND,
                           detail="restart takes one child's name") if target == "all" else None)
        if refused is not None:
            return refused
        child = self.children[target]
        if child.removing:
            return protocol.Error(msg_id=msg_id, code=protocol.ErrorCode.INVALID_MESSAGE,
                                  detail=f"{target} is being removed")
        child.held = False  # a restart also ends an operator's stop
        log.info("restart_requested", child=target, state=child.state)
        if child.pid is not None:
            child.restart_requested = True
            if child.state != "stopping":
                self._terminate(child, now)
        elif not child.fork_pending:
            child.history.clear()  # the operator resets a fatal or exited child
            child.restart_at = None
            child.restarts += 1
            self._start(child, now)
        return protocol.Ack(msg_id=msg_id, affected=[target])

    def _status(self, msg_id: str, now: float) -> protocol.StatusReply:
        return protocol.StatusReply(
            msg_id=msg_id, supervisor_pid=os.getpid(), state_dir=str(self.state_dir.root),
            started_at=self.started_at,
            children=[c.status(now) for c in self.children.values()],
        )

    def _publish_status(self, now: float) -> None:
        self._status_dirty = False
        self._status_written_at = now
        status = self._status("status-file", now).model_dump(mode="json")
        if self.metrics is not None:
            self.metrics.update(status)
        for hook in self.status_hooks:
            hook.update(status)
        try:
            statusfile.write(self.state_dir.status_path, status)
        except OSError as exc:
            # said once when it starts failing (a full disk fails it every round),
            # and once when it works again
            if self._status_error != exc.errno:
                log.warning("status_write_failed", error=str(exc))
            self._status_error = exc.errno
        else:
            if self._status_error is not None:
                log.info("status_write_recovered")
            self._status_error = None

    def _start_metrics(self) -> None:
        """The Prometheus endpoint (`metrics.listen`); a port that cannot be bound is
        logged and the runtime runs without it (metrics never stop the tree)."""
        listen = self.config.metrics.listen
        if listen is None:
            return
        from supervisor.metrics import MetricsServer  # noqa: PLC0415 - only when configured

        server = MetricsServer(listen, self.state_dir.run_dir / "metrics.port")
        try:
            port = server.start()
        except OSError as exc:
            log.error("metrics_listen_failed", listen=listen, error=str(exc))
            return
        self.metrics = server
        log.info("metrics_listening", host=server.host, port=port)

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
