"""The command line each kind of child runs, from its spec and the config."""

from __future__ import annotations

import sys

from broker.statedir import StateDir
from supervisor.config import ChildSpec, Config

_MODULES = {
    "writer": "actors.writer",
    "broker": "broker.server",
    "procs": "actors.procs",
    "subagents": "actors.subagents",
    "agent": "actors.agent",
}


def argv_for(spec: ChildSpec, config: Config, state_dir: StateDir) -> list[str]:
    """argv for a child started as its own interpreter."""
    root = str(state_dir.root)
    if spec.command is not None:
        return [a.replace("{python}", sys.executable).replace("{state_dir}", root)
                for a in spec.command]
    argv = [sys.executable, "-m", _MODULES[spec.kind], "--state-dir", root]
    log = config.logging
    if spec.kind == "writer":
        argv += ["--log-level", config.writer.log_level or log.level,
                 "--log-max-bytes", str(log.max_bytes), "--log-backups", str(log.backups)]
    elif spec.kind == "broker":
        argv += ["--log-level", log.level]
        if config.broker.heartbeat_interval_ms is not None:
            argv += ["--heartbeat-interval-ms", str(config.broker.heartbeat_interval_ms)]
        if config.broker.heartbeat_misses is not None:
            argv += ["--heartbeat-misses", str(config.broker.heartbeat_misses)]
    elif spec.kind == "agent":
        argv += ["--name", spec.name, "--log-level", log.level,
                 "--heartbeat-interval-ms", str(config.heartbeat.interval_ms)]
    return argv


def zygote_args(config: Config, state_dir: StateDir) -> list[str]:
    """Arguments for `python -m actors.zygote` after `--fd N`."""
    log = config.logging
    return [
        "--state-dir", str(state_dir.root),
        "--heartbeat-interval-ms", str(config.heartbeat.interval_ms),
        "--broker-heartbeat-interval-ms", str(config.broker.heartbeat_interval_ms or 1000),
        "--broker-heartbeat-misses", str(config.broker.heartbeat_misses or 3),
        "--log-level", log.level,
        "--log-max-bytes", str(log.max_bytes),
        "--log-backups", str(log.backups),
    ]
