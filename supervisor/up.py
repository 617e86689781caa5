"""`supervisor up`: take the lock, load the config, run the supervisor loop.

Exit codes (also in docs/supervisor.md):
    0   stopped cleanly (stop request, SIGTERM, Ctrl-C)
    1   unexpected internal error (traceback in logs/supervisor.log)
    65  the writer found the WAL corrupt and gave up: repair before restarting
    69  the writer or the broker gave up (over its restart intensity)
    75  another supervisor holds this state directory (its pid is named)
    78  invalid configuration or unusable state directory
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from broker.errors import ConfigError, LockHeldError, StateDirError
from broker.statedir import StateDir

EXIT_INTERNAL = 1
EXIT_LOCKED = 75
EXIT_CONFIG = 78
DETACH_WAIT_S = 30.0


def run(state_arg: str | None, config_arg: str | None) -> int:
    """Run the supervisor in the foreground until it stops; returns the exit code."""
    from broker import logconfig
    from broker.pidlock import PidLock
    from supervisor import config as config_mod
    from supervisor import identity
    from supervisor.runtime import Runtime

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
    try:
        path = Path(config_arg).resolve() if config_arg else config_mod.DEFAULT_CONFIG_PATH
        runtime = Runtime(config, state_dir, path)
        code = runtime.run()
    except Exception as exc:
        log.exception("supervisor_crashed")
        print(f"supervisor: internal error: {exc} (traceback in "
              f"{state_dir.log_path('supervisor')})", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        lock.release()
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
    from supervisor import statusfile

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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
