"""Starting children: fresh interpreters or forks of the zygote, the fork
queue and its pacing, and the zygote's own life (start, restart, retire).

The runtime (supervisor/runtime/loop.py) owns the children; this part starts
them and hands each pid back to it. See docs/supervisor.md ("Process tree")
and docs/decisions.md ("Agents fork from a zygote: one clone, a pool, paced
starts").
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

import structlog

from actors.zygotewire import Forked
from broker.control import ENV_HEARTBEAT_TIMEOUT
from broker.errors import SpawnError
from supervisor.runtime import commands, monitor, spawner
from supervisor.runtime.children import Child, describe_exit
from supervisor.runtime.policy import Exit, Policy, Restart, decide, trim

if TYPE_CHECKING:
    from broker.auth import Keyring
    from broker.statedir import StateDir
    from supervisor.config import Config

FORKS_IN_FLIGHT = 8  # forks asked of the zygote and not yet answered (flow control)
# Agents asked of the zygote and not yet ready: more only share the cores with
# these (docs/decisions.md, "Agents fork from a zygote: one clone, a pool, paced starts")
AGENTS_STARTING = max(2, os.cpu_count() or 2)
ZYGOTE_POLICY = Policy(max_restarts=5, period_s=60.0, base_s=0.2, cap_s=5.0)
# A system child (writer, broker, procs, subagents) waits this long after the
# zygote's start for its `ready`, then starts as a fresh interpreter instead.
ZYGOTE_READY_WAIT_S = 5.0

log = structlog.get_logger("supervisor")


class StarterHost(Protocol):
    """What the starter needs of the runtime that owns the children."""

    config: Config
    children: dict[str, Child]
    stopping: bool

    def start(self, child: Child, now: float) -> None: ...

    def register(self, child: Child, pid: int, now: float) -> None: ...

    def after_exit(self, child: Child, record: Exit, now: float) -> None: ...


class Starter:
    """Starts the children the runtime asks for, fresh or through the zygote."""

    def __init__(self, host: StarterHost, state_dir: StateDir, keyring: Keyring,
                 endpoint: str, *, use_zygote: bool) -> None:
        self.host = host
        self.state_dir = state_dir
        self.keyring = keyring
        self.endpoint = endpoint  # the control socket the children report to
        self.base_env = dict(os.environ)
        self.rng = random.Random()  # noqa: S311 - backoff jitter, not secrets
        self.fork_queue: deque[Child] = deque()
        self.in_flight = 0
        self.starting: set[str] = set()  # agents asked of the zygote, not yet ready
        self.zygote: spawner.ZygoteLink | None = None
        self.zygote_started_at = 0.0  # monotonic: when the current zygote was started
        # system children waiting for the zygote's `ready` (fork_pending, not asked yet)
        self.awaiting: list[Child] = []
        self.zygote_history: list[Exit] = []
        self.zygote_restart_at: float | None = None
        self.use_zygote = use_zygote
        self.zygote_stale = False  # a reload changed its arguments: replace it when idle
        self.retired_zygotes: set[int] = set()

    def child_base_env(self) -> dict[str, str]:
        """The environment every child starts from: ours, plus the heartbeat timeout
        (the children's pulse stops beating for a main thread stalled that long)."""
        return {**self.base_env,
                ENV_HEARTBEAT_TIMEOUT: repr(self.host.config.heartbeat.timeout_s)}

    # --- children ----------------------------------------------------------------
    def start(self, child: Child, now: float) -> None:
        """Start `child`: queued for the zygote (an agent), asked of it (the
        writer, broker, procs, subagents; held until it is ready, for at most
        ZYGOTE_READY_WAIT_S after its start), or a fresh interpreter."""
        child.requested_at = now
        child.state = "starting"
        child.restart_requested = False
        if child.kind == "agent" and self.use_zygote:
            child.fork_pending = True
            self.starting.discard(child.name)  # queued again: not starting until asked
            self.fork_queue.append(child)
            self.flush()
            return
        config = self.host.config
        argv = commands.argv_for(child.spec, config, self.state_dir)
        if child.kind in spawner.ZYGOTE_KINDS and spawner.zygote_runs(argv):
            if self._run_from_zygote(child, argv):
                child.fork_pending = True  # its reply comes with the agents' (on_replies)
                self.in_flight += 1
                return
            if self._zygote_coming(now):
                child.fork_pending = True  # asked once the zygote says ready (serve_awaiting)
                self.awaiting.append(child)
                return
        self.spawn_fresh(child, argv, now)

    def _zygote_coming(self, now: float) -> bool:
        """The zygote is preloading and may still be waited for."""
        return self.zygote is not None and self.zygote.sock is not None \
            and not self.zygote.ready and now < self.zygote_started_at + ZYGOTE_READY_WAIT_S

    def serve_awaiting(self, now: float) -> None:
        """The system children waiting for the zygote: asked of it once it is
        ready, fresh interpreters once it is not coming (gone, too slow, off)."""
        if not self.awaiting or self._zygote_coming(now):
            return
        waiting = [c for c in self.awaiting if c.fork_pending and c.pid is None]
        self.awaiting = []
        if not waiting or self.host.stopping:
            return
        if self.zygote is None or not self.zygote.ready:
            log.warning("zygote_not_ready", waited_s=round(now - self.zygote_started_at, 3),
                        fallback="fresh interpreters", children=[c.name for c in waiting])
        for child in waiting:
            child.fork_pending = False
            argv = commands.argv_for(child.spec, self.host.config, self.state_dir)
            if self._run_from_zygote(child, argv):
                child.fork_pending = True
                self.in_flight += 1
            else:
                self.spawn_fresh(child, argv, now)

    def withdraw(self, child: Child) -> bool:
        """Take `child` back before it was asked of the zygote (queued or
        awaiting its `ready`); False when it was asked already (or never queued)."""
        for waiting in (self.fork_queue, self.awaiting):
            if child in waiting:
                waiting.remove(child)
                child.fork_pending = False
                return True
        return False

    def _run_from_zygote(self, child: Child, argv: list[str]) -> bool:
        """Ask the zygote for the writer or broker `child` (its credential, without
        the model key, as a fresh start); False: start a fresh interpreter."""
        if self.zygote is None or not self.zygote.ready:
            return False
        try:
            credential = spawner.credential_for(self.keyring, child.kind, child.name)
        except SpawnError:
            return False  # spawn_fresh reports it
        return spawner.run_from_zygote(self.zygote, child.name, argv, credential,
                                       spawner.model_key_names(
                                           child.kind, self.host.config.agent.openai.api_key_env))

    def spawn_fresh(self, child: Child, argv: list[str], now: float) -> None:
        env = spawner.child_env(self.child_base_env(), self.endpoint, child.name,
                                drop=spawner.model_key_names(
                                    child.kind, self.host.config.agent.openai.api_key_env))
        try:
            credential = spawner.credential_for(self.keyring, child.kind, child.name)
            pid = spawner.spawn_with_credential(argv, env, credential)
        except SpawnError as exc:
            log.error("spawn_failed", child=child.name, error=str(exc))
            self.host.after_exit(child, child.exited(127, None, now), now)
            return
        self.host.register(child, pid, now)

    def _spawn_fresh_spec(self, child: Child, now: float) -> None:
        self.spawn_fresh(child, commands.argv_for(child.spec, self.host.config,
                                                  self.state_dir), now)

    def flush(self) -> None:
        """Ask the zygote for the queued agents, as many as the pacing allows
        (and for the system children awaiting it, or start them fresh)."""
        self.serve_awaiting(time.monotonic())
        if self.zygote_stale:
            if self.zygote is not None and self.in_flight > 0:
                return  # no fork to the old zygote; replace it once its forks are answered
            self.retire_zygote()
        if self.zygote is None:
            if not self.use_zygote:
                while self.fork_queue:  # the zygote gave up: fresh interpreters
                    child = self.fork_queue.popleft()
                    child.fork_pending = False
                    if child.state == "starting" and child.pid is None:
                        child.requested_at = None
                        self.host.start(child, time.monotonic())
            return
        while self.fork_queue and self.in_flight < FORKS_IN_FLIGHT and self.may_start_agent():
            child = self.fork_queue[0]
            if not child.fork_pending or self.host.stopping:
                self.fork_queue.popleft()
                continue
            try:
                credential = spawner.credential_for(self.keyring, child.kind, child.name)
            except SpawnError as exc:
                self.fork_queue.popleft()
                child.fork_pending = False
                log.error("spawn_failed", child=child.name, error=str(exc))
                self.host.after_exit(child, child.exited(127, None, time.monotonic()),
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

    def may_start_agent(self) -> bool:
        """Fewer than AGENTS_STARTING agents between their fork request and
        `ready` (one that exited, failed or went back to the queue is out)."""
        if len(self.starting) >= AGENTS_STARTING:  # (a child queued again left it in start)
            children = self.host.children
            self.starting = {
                name for name in self.starting
                if (c := children.get(name)) is not None and c.state == "starting"
                and (c.fork_pending or c.pid is not None)}
        return len(self.starting) < AGENTS_STARTING

    def agents_starting(self) -> bool:
        """Agents are being started (queued, or asked of the zygote and not ready)."""
        children = self.host.children
        return bool(self.fork_queue) or any(
            (c := children.get(name)) is not None and c.state == "starting"
            for name in self.starting)

    def stop(self) -> None:
        """The runtime stops: nothing more is asked of the zygote."""
        self.fork_queue.clear()
        self.awaiting.clear()

    # --- the zygote --------------------------------------------------------------
    def start_zygote(self, now: float) -> None:
        link = spawner.ZygoteLink(commands.zygote_args(self.host.config, self.state_dir),
                                  spawner.child_env(self.child_base_env(),
                                                    self.endpoint, "zygote"))
        try:
            pid = link.start()
        except SpawnError as exc:
            log.error("zygote_spawn_failed", error=str(exc))
            self.zygote_lost(None, now)
            return
        self.zygote = link
        self.zygote_started_at = now
        self.in_flight = 0
        self.starting.clear()
        log.info("zygote_spawned", pid=pid)
        # the agents asked of a lost or retired zygote (system children await it)
        pending = [c for c in self.host.children.values()
                   if c.fork_pending and c.kind == "agent"]
        self.fork_queue = deque(pending)

    def restart_zygote_if_due(self, now: float) -> None:
        if self.zygote_restart_at is not None and now >= self.zygote_restart_at:
            self.zygote_restart_at = None
            if not self.host.stopping:
                self.start_zygote(now)

    def retire_zygote(self) -> None:
        """Replace the zygote after a reload changed its arguments (or turned it off)."""
        self.zygote_stale = False
        old = self.zygote
        if old is not None:
            self.zygote = None
            if old.pid is not None:
                self.retired_zygotes.add(old.pid)
                old.close()
                spawner.signal_group(old.pid, signal.SIGTERM)
        if self.use_zygote and not self.host.stopping:
            self.zygote_restart_at = None  # one zygote, started now with the new arguments
            self.start_zygote(time.monotonic())

    def close_zygote(self) -> None:
        """The agents are down while stopping: the zygote exits at EOF."""
        if self.zygote is not None and self.zygote.pid is not None \
                and self.zygote.sock is not None:
            self.zygote.close()  # EOF: the zygote exits by itself
            spawner.signal_group(self.zygote.pid, signal.SIGTERM)

    def on_replies(self, now: float) -> None:
        """The zygote's answers: each fork registered with the runtime, each
        failure a fresh start (the writer, the broker) or an exit (an agent)."""
        assert self.zygote is not None
        children = self.host.children
        was_ready = self.zygote.ready
        replies = self.zygote.replies()
        if self.zygote.ready and not was_ready:
            log.info("zygote_ready", pid=self.zygote.pid,
                     ready_ms=round((now - self.zygote_started_at) * 1000, 2))
            self.serve_awaiting(now)
        for reply in replies:
            self.in_flight = max(0, self.in_flight - 1)
            child = children.get(reply.name)
            if child is None or not child.fork_pending:
                continue
            if isinstance(reply, Forked):
                self.host.register(child, reply.pid, now)
            else:
                log.error("spawn_failed", child=child.name, error=reply.reason)
                child.fork_pending = False
                if child.kind in spawner.ZYGOTE_KINDS:  # the writer, the broker: fresh
                    self._spawn_fresh_spec(child, now)
                    continue
                self.host.after_exit(child, child.exited(127, None, now), now)

    def reaped(self, reaped: monitor.Reaped, now: float) -> bool:
        """True when `reaped` was the zygote (or a retired one), not a child."""
        if self.zygote is not None and reaped.pid == self.zygote.pid:
            self.zygote_lost(reaped, now)
            return True
        if reaped.pid in self.retired_zygotes:
            self.retired_zygotes.discard(reaped.pid)
            return True
        return False

    def zygote_lost(self, reaped: monitor.Reaped | None, now: float) -> None:
        if self.zygote is not None:
            self.zygote.lost()
        self.zygote = None
        self.awaiting.clear()
        for child in self.host.children.values():  # a system child asked of it: fresh
            if child.fork_pending and child.kind in spawner.ZYGOTE_KINDS:
                child.fork_pending = False
                self._spawn_fresh_spec(child, now)
        if self.host.stopping:
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
