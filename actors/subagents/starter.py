"""Starting a child agent's process: a zygote fork, or a fresh interpreter.

The child gets its credential on a pipe and waits at a start gate until the
registry has it. See docs/changesets.md ("The host and the ops") and
docs/decisions.md ("The zygote also serves the subagents host, the writer and
the broker").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog

from actors.procs import launch
from actors.zygotelink import ZygoteLink
from actors.zygotewire import Forked
from broker import auth
from broker.control import ENV_ACTOR, ENV_CONTROL
from broker.errors import SpawnError
from broker.lifeline import signal_group
from broker.statedir import StateDir

log = structlog.get_logger("actors.subagents")
OUTPUT_NAME = "child.out"  # the child's stdout and stderr, in its directory
# A spawn waits for a zygote still preloading until it is this old (so the host
# blocks at most this long per zygote start); later, a fresh interpreter.
ZYGOTE_READY_WAIT_S = 2.0
ZYGOTE_READY_LIMIT_S = 30.0  # still not ready at this age: it is killed (a failure)
ZYGOTE_FORK_TIMEOUT_S = 2.0  # a fork not answered by then: the zygote is killed
ZYGOTE_MAX_FAILURES = 3  # in a row: fresh interpreters from then on

Via = Literal["zygote", "interpreter"]


@dataclass
class Started:
    """A child process held at its start gate."""

    pid: int
    via: Via
    _gate_fd: int = field(repr=False)
    _spawned: launch.Spawned | None = field(default=None, repr=False)

    def open_gate(self) -> None:
        if self._spawned is not None:
            launch.open_gate(self._spawned)
            return
        try:
            os.write(self._gate_fd, b"g")
        except BrokenPipeError:
            pass  # the child is gone already: its exit status tells
        finally:
            os.close(self._gate_fd)

    def abandon(self) -> None:
        if self._spawned is not None:
            launch.abandon(self._spawned)
        else:
            os.close(self._gate_fd)


class ChildStarter:
    """The host's zygote and its fallback."""

    def __init__(self, state: StateDir, *, use_zygote: bool = True,
                 zygote_args: list[str] | None = None,
                 log_args: list[str] | None = None) -> None:
        self.state = state
        self.use_zygote = use_zygote
        self._log_args = list(log_args or [])  # --log-level/--log-max-bytes/--log-backups
        self._zygote_args = zygote_args if zygote_args is not None else [
            "--state-dir", str(state.root), *self._log_args]
        self._env = {k: v for k, v in os.environ.items()
                     if k not in (ENV_CONTROL, ENV_ACTOR, auth.ENV_CREDENTIAL_FD)}
        self.zygote: ZygoteLink | None = None
        self.failures = 0  # zygote failures in a row
        self.counts: dict[Via, int] = {"zygote": 0, "interpreter": 0}
        self._zygote_started_at = 0.0

    # --- the zygote -------------------------------------------------------------------
    def start_zygote(self) -> None:
        """Start the zygote if it is wanted and not running; it preloads meanwhile."""
        if self.zygote is not None or not self.use_zygote:
            return
        link = ZygoteLink(self._zygote_args, self._env)
        try:
            pid = link.start()
        except (SpawnError, OSError) as exc:
            self._failed("zygote_spawn_failed", error=str(exc))
            return
        self.zygote = link
        self._zygote_started_at = time.monotonic()
        log.info("zygote_spawned", pid=pid)

    def zygote_ready(self) -> bool:
        """The zygote is up and has preloaded (reads its `ready` without waiting)."""
        if self.zygote is None:
            return False
        self.zygote.replies()  # between forks nothing else can be waiting there
        return self.zygote.ready

    def reaped(self, pid: int, status: int) -> bool:
        """True when `pid` was the zygote: it is forgotten (restarted on the next spawn)."""
        if self.zygote is None or pid != self.zygote.pid:
            return False
        self.zygote.lost()
        self.zygote = None
        self._failed("zygote_exited", returncode=os.waitstatus_to_exitcode(status))
        return True

    def close(self) -> int | None:
        """Let the zygote go (it exits when its socket closes); its pid, to reap."""
        if self.zygote is None:
            return None
        pid = self.zygote.pid
        self.zygote.lost()
        self.zygote = None
        return pid

    def _drop_zygote(self) -> None:
        """An unresponsive zygote: kill it (its exit is reaped as an unknown pid)."""
        if self.zygote is None:
            return
        if self.zygote.pid is not None:
            signal_group(self.zygote.pid, signal.SIGKILL)
        self.zygote.lost()
        self.zygote = None

    def _failed(self, event: str, **values: object) -> None:
        self.failures += 1
        log.warning(event, failures=self.failures, **values)
        if self.failures >= ZYGOTE_MAX_FAILURES and self.use_zygote:
            self.use_zygote = False
            self._drop_zygote()
            log.error("zygote_gave_up", fallback="fresh interpreters")

    # --- starting a child -------------------------------------------------------------
    def start(self, name: str, directory: Path) -> Started:
        """The child's process, held at its start gate; raises OSError or
        SpawnError when not even a fresh interpreter could be started."""
        output = directory / OUTPUT_NAME
        started = self._fork(name, output) if self.use_zygote else None
        if started is None:
            started = self._launch(name, directory, output)
        self.counts[started.via] += 1
        return started

    def _fork(self, name: str, output: Path) -> Started | None:
        self.start_zygote()
        if self.zygote is None:
            return None
        ready_by = self._zygote_started_at + ZYGOTE_READY_WAIT_S
        if not self.zygote.wait_ready(max(0.0, ready_by - time.monotonic())):
            age_s = round(time.monotonic() - self._zygote_started_at, 3)
            if self.zygote.sock is None:  # it died: reaped() counts the failure
                log.warning("zygote_lost", age_s=age_s)
            elif age_s > ZYGOTE_READY_LIMIT_S:
                self._drop_zygote()
                self._failed("zygote_never_ready", age_s=age_s)
            else:
                log.warning("zygote_not_ready", age_s=age_s)
            return None
        cred_r = self._credential_pipe(name)
        gate_r, gate_w = os.pipe()
        try:
            reply = self.zygote.fork(name, ZYGOTE_FORK_TIMEOUT_S, output=output, gate_fd=gate_r,
                                     credential_fd=cred_r)
        finally:
            os.close(gate_r)
            os.close(cred_r)
        if isinstance(reply, Forked):
            self.failures = 0
            return Started(reply.pid, "zygote", gate_w)
        os.close(gate_w)  # a fork that still happens exits unrun
        if reply is None:
            self._drop_zygote()
            self._failed("zygote_unresponsive", child=name, after_s=ZYGOTE_FORK_TIMEOUT_S)
        else:
            self._failed("zygote_fork_failed", child=name, reason=reply.reason)
        return None

    def _credential_pipe(self, name: str) -> int:
        try:
            return auth.credential_pipe(auth.child_credential(self.state, name))
        except auth.AuthError as exc:
            raise SpawnError(f"no credential for {name}: {exc}") from exc

    def _launch(self, name: str, directory: Path, output: Path) -> Started:
        out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        argv = [sys.executable, "-m", "actors.agent", "--name", name,
                "--state-dir", str(self.state.root), *self._log_args]
        # the credential pipe is inheritable for this one spawn (this host is one thread)
        cred_r = self._credential_pipe(name)
        try:
            spawned = launch.spawn(argv, {**self._env, **auth.child_env_entry(cred_r)},
                                   str(directory), stdio_fd=out, die_with_parent=True,
                                   pass_fds=[cred_r])
        finally:
            os.close(cred_r)
            with contextlib.suppress(OSError):
                os.close(out)
        if self.use_zygote or self.failures:  # the zygote was wanted
            log.info("fresh_interpreter_started", child=name, pid=spawned.pid)
        return Started(spawned.pid, "interpreter", spawned.gate_fd, spawned)
