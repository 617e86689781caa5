"""The command line each kind of child runs, from its spec and the config.

See docs/supervisor.md ("Process tree").
"""

from __future__ import annotations

import os
import sys

from broker.statedir import StateDir
from supervisor.config import ChildSpec, Config

# Agents the zygote keeps forked ahead of requests (actors/zygote.py, "The
# pool") unless `agents.zygote_pool` says: as many as the supervisor starts at
# once (starter.AGENTS_STARTING).
ZYGOTE_POOL = max(2, os.cpu_count() or 2)

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
    if spec.kind == "writer":
        argv += log_args(config, config.writer.log_level)
        argv += config.storage.writer_args()  # WAL retention and compaction (docs/storage.md)
        argv += config.fleet.writer_args()  # fleet mode: replicate before the ack
    elif spec.kind == "broker":
        argv += log_args(config)
        if config.broker.heartbeat_interval_ms is not None:
            argv += ["--heartbeat-interval-ms", str(config.broker.heartbeat_interval_ms)]
        if config.broker.heartbeat_misses is not None:
            argv += ["--heartbeat-misses", str(config.broker.heartbeat_misses)]
        argv += config.fleet.broker_args()  # fleet mode: the bridge to other hosts
    elif spec.kind == "procs":
        argv += [*log_args(config), *config.sandbox.procs_args(config.fleet.secret_paths())]
    elif spec.kind == "agent":
        argv += ["--name", spec.name, *log_args(config),
                 "--heartbeat-interval-ms", str(config.heartbeat.interval_ms)]
    else:  # subagents (the host hands them on to its child agents)
        argv += [*log_args(config), *config.fleet.subagents_args()]
    return argv


def log_args(config: Config, level: str | None = None) -> list[str]:
    """`--log-level L --log-max-bytes N --log-backups K`: accepted by every child."""
    log = config.logging
    return ["--log-level", level or log.level, "--log-max-bytes", str(log.max_bytes),
            "--log-backups", str(log.backups)]


def zygote_args(config: Config, state_dir: StateDir) -> list[str]:
    """Arguments for `python -m actors.zygote` after `--fd N`."""
    return [
        "--state-dir", str(state_dir.root),
        "--heartbeat-interval-ms", str(config.heartbeat.interval_ms),
        "--broker-heartbeat-interval-ms", str(config.broker.heartbeat_interval_ms or 1000),
        "--broker-heartbeat-misses", str(config.broker.heartbeat_misses or 3),
        "--pool", str(ZYGOTE_POOL if config.agents.zygote_pool is None
                      else config.agents.zygote_pool),
        *log_args(config),
    ]
