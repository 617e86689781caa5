"""Starting children: a fresh process, or a fork of the zygote.

Only the children that call the model (agents, the subagents host) get the
model's API key. See docs/supervisor.md ("Process tree", "The zygote").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from actors.zygotelink import ZygoteLink
from actors.zygotewire import RUNNABLE
from broker import auth
from broker.control import ENV_ACTOR, ENV_CONTROL
from broker.errors import SpawnError
from broker.lifeline import signal_group, spawn_command
from supervisor.config import ChildKind

__all__ = ["ZYGOTE_KINDS", "ZygoteLink", "child_env", "credential_fd", "run_from_zygote",
           "signal_group", "spawn_command", "spawn_with_credential", "zygote_runs"]

# Kinds the zygote starts and restarts (it preloads their modules): each start
# pays a fork, not a fresh interpreter's imports (docs/supervisor.md, "The zygote").
ZYGOTE_KINDS: frozenset[ChildKind] = frozenset({"writer", "broker", "procs", "subagents"})


def zygote_runs(argv: Sequence[str]) -> bool:
    """`argv` is `python -m <module> ...` (our interpreter) for a module the
    zygote runs: not a custom command."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" \
        and argv[2] in RUNNABLE


def run_from_zygote(link: ZygoteLink | None, name: str, argv: Sequence[str],
                    credential: auth.Credential, drop: Sequence[str]) -> bool:
    """Ask the zygote for `argv` (`python -m <module> ...`, our interpreter) as a
    fork holding `credential`, the environment names `drop` removed (as
    child_env removes them for a fresh start); False when it cannot (no zygote,
    not ready, a custom command): start a fresh interpreter instead."""
    if link is None or not link.ready or not zygote_runs(argv):
        return False
    fd = credential_fd(credential)
    try:
        return link.run(name, argv[2], list(argv[3:]), drop=drop, credential_fd=fd)
    finally:
        os.close(fd)


def credential_for(keyring: auth.Keyring, kind: str, name: str) -> auth.Credential:
    if kind == "agent" and name in auth.RESERVED:
        raise SpawnError(f"an agent may not be named {name!r} (a reserved role)")
    return keyring.credential(name)


def spawn_with_credential(argv: Sequence[str], env: Mapping[str, str],
                          credential: auth.Credential) -> int:
    """spawn_command, the child holding `credential` on an inherited pipe."""
    fd = auth.credential_pipe(credential)
    try:
        return spawn_command(argv, {**env, **auth.child_env_entry(fd)}, pass_fds=[fd])
    finally:
        os.close(fd)


def credential_fd(credential: auth.Credential) -> int:
    """A pipe holding `credential`, to send with a zygote fork request (close it after)."""
    fd = auth.credential_pipe(credential)
    os.set_inheritable(fd, False)
    return fd


MODEL_KEY_KINDS = frozenset({"agent", "subagents", "zygote"})  # they call the model


def model_key_names(kind: str, key_env: str) -> tuple[str, ...]:
    """The environment names to withhold from a child of `kind`: the model's
    key (`agent.openai.api_key_env`) unless the child calls the model."""
    return () if kind in MODEL_KEY_KINDS else tuple({key_env, "OPENAI_API_KEY"})


def child_env(base: Mapping[str, str], control_endpoint: str, name: str,
              drop: Iterable[str] = ()) -> dict[str, str]:
    dropped = set(drop)
    env = {k: v for k, v in base.items() if k not in dropped}
    env[ENV_CONTROL] = control_endpoint
    env[ENV_ACTOR] = name
    return env
