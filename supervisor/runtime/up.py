"""`supervisor up`: take the lock, load the config, run the supervisor loop.

See docs/supervisor.md ("Start, stop, restart", "Exit codes").
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from broker.errors import ConfigError, LockHeldError, StateDirError
from broker.statedir import StateDir

if TYPE_CHECKING:
    from supervisor.runtime.loop import Runtime

EXIT_INTERNAL = 1
EXIT_LOCKED = 75
EXIT_CONFIG = 78
DETACH_WAIT_S = 30.0


def _say(line: str, out: TextIO | None = None) -> bool:
    """One line for the operator; False when nobody reads it any more (a closed
    terminal or pipe never changes the runtime's course or its exit code)."""
    stream = out or sys.stdout
    try:
        print(f"supervisor: {line}", file=stream, flush=True)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):  # nor the interpreter's final flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return False
    return True


class Progress(threading.Thread):
    """The foreground `up`'s lines, read from the runtime's child table (only
    read: the supervisor's loop owns it) until the start phase is over."""

    def __init__(self, runtime: Runtime, out: TextIO, *, poll_s: float = 0.1,
                 every_s: float = 1.0) -> None:
        super().__init__(name="up-progress", daemon=True)
        self.runtime = runtime
        self.out = out
        self.poll_s = poll_s
        self.every_s = every_s  # at most one progress line this often (500 agents)
        self.done = threading.Event()

    def say(self, line: str) -> None:
        if not _say(line, self.out):
            self.done.set()

    def counts(self) -> tuple[int, int, list[str]]:
        while True:
            try:
                kids = list(self.runtime.children.values())
                break
            except RuntimeError:  # the loop changed the table meanwhile: read it again
                continue
        ready = [c.spec.name for c in kids if c.state == "running"]
        problems = [f"{c.spec.name} {c.state}" for c in kids
                    if c.state in ("fatal", "exited", "backoff")]
        return len(ready), len(kids), problems

    def run(self) -> None:
        from supervisor.config import KIND_ORDER

        shown, last_at = -1, 0.0
        while not self.done.wait(self.poll_s):
            if self.runtime.stopping:
                return
            ready, total, problems = self.counts()
            if self.runtime.phase >= len(KIND_ORDER):
                rt = self.runtime
                trouble = f"; not running: {', '.join(problems)}" if problems else ""
                self.say(f"ready: {ready} of {total} children running{trouble}; state "
                         f"{rt.state_dir.root}, control socket "
                         f"{rt.control.endpoint} (`supervisor status`; "
                         f"Ctrl-C or `supervisor stop` stops)")
                return
            now = time.monotonic()
            if ready != shown and now - last_at >= self.every_s:
                self.say(f"{ready} of {total} ready")
                shown, last_at = ready, now


def run(state_arg: str | None, config_arg: str | None, *, quiet: bool = False) -> int:
    """Run the supervisor in the foreground until it stops; returns the exit code."""
    from broker import logconfig
    from broker.pidlock import PidLock
    from supervisor import config as config_mod
    from supervisor import identity
    from supervisor.runtime.loop import Runtime

    foreign = identity.foreign_supervisor()
    if foreign is not None:
        print(f"supervisor: warning: {foreign}", file=sys.stderr)
    try:
        config = config_mod.load(Path(config_arg) if config_arg else None)
        state_dir = StateDir.resolve(state_arg).ensure()
        state_dir.endpoint("supervisor")  # fails early when the path is too long
    except ConfigError as exc:
        print(f"supervisor: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StateDirError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    lock = PidLock(state_dir.lock_path)
    try:
        lock.acquire()
    except LockHeldError as exc:
        who = f"pid {exc.pid}" if exc.pid is not None else "another process"
        print(f"supervisor: {state_dir.root} is already supervised by {who}; "
              f"use `supervisor status` or `supervisor stop`", file=sys.stderr)
        return EXIT_LOCKED
    log = logconfig.configure(
        "supervisor", state_dir.log_path("supervisor"), level=config.logging.level,
        max_bytes=config.logging.max_bytes, backups=config.logging.backups,
    )
    log.info("corral_started", version=identity.version(), python=sys.version.split()[0])
    if foreign is not None:
        log.warning("supervisord_detected", detail=foreign)
    progress: Progress | None = None
    try:
        path = Path(config_arg).resolve() if config_arg else config_mod.DEFAULT_CONFIG_PATH
        runtime = Runtime(config, state_dir, path)
        if not quiet:
            _say(f"starting corral {identity.version()} (pid {os.getpid()}, "
                 f"{len(runtime.children)} children, config {path}, state {state_dir.root})")
            progress = Progress(runtime, sys.stdout)
            progress.start()
        code = runtime.run()
    except Exception as exc:
        log.exception("supervisor_crashed")
        print(f"supervisor: internal error: {exc} (traceback in "
              f"{state_dir.log_path('supervisor')})", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        if progress is not None:
            progress.done.set()
            progress.join(timeout=1.0)
        lock.release()
    if not quiet:
        _say(f"stopped (exit {code})")
    if code == 65:
        print("supervisor: stopped: the writer found the WAL corrupt; run `supervisor wal "
              "verify` and repair before starting again", file=sys.stderr)
    elif code == 69:
        print("supervisor: stopped: a core child (writer or broker) gave up; see "
              "`supervisor logs --level error`", file=sys.stderr)
    return code


def detach(state_arg: str | None, config_arg: str | None) -> int:
    """Start `supervisor up` in the background and return once it is serving."""
    from broker import pidlock
    from supervisor.runtime import statusfile

    state_dir = StateDir.resolve(state_arg)
    try:
        state_dir.ensure()
    except StateDirError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    argv = [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root)]
    if config_arg:
        argv += ["--config", str(Path(config_arg).resolve())]
    out_path = state_dir.logs_dir / "supervisor.out"
    with open(out_path, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            tail = out_path.read_text(errors="replace").strip().splitlines()[-1:]
            print(tail[0] if tail else f"supervisor: exited with {code}", file=sys.stderr)
            return code
        status = statusfile.read(state_dir.status_path)
        if (status is not None and status.get("supervisor_pid") == proc.pid
                and pidlock.read_holder(state_dir.lock_path) == proc.pid):
            print(f"supervisor: started, pid {proc.pid}, state {state_dir.root}")
            return 0
        time.sleep(0.05)
    print(f"supervisor: pid {proc.pid} started but did not publish its status within "
          f"{DETACH_WAIT_S:g}s; see {out_path}", file=sys.stderr)
    return EXIT_INTERNAL
