"""What a reload changes: running children against the configuration re-read.

Pure. See docs/decisions.md ("`stop NAME` does not persist; SIGHUP reloads").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from broker.statedir import StateDir
from supervisor.config import ChildSpec, Config
from supervisor.runtime import commands


@dataclass(frozen=True)
class Running:
    """What the plan needs to know of one running child."""

    spec: ChildSpec
    spawned_by_operator: bool = False


@dataclass(frozen=True)
class ReloadPlan:
    start: list[ChildSpec] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    restart: list[ChildSpec] = field(default_factory=list)
    unchanged: int = 0
    zygote_changed: bool = False


def launch(spec: ChildSpec, config: Config, state_dir: StateDir) -> tuple[object, ...]:
    """Everything that decides how this child is started."""
    argv = commands.argv_for(spec, config, state_dir)
    zygote = commands.zygote_args(config, state_dir) if spec.kind == "agent" else []
    return (spec.model_dump_json(), tuple(argv), tuple(zygote),
            config.agents.zygote if spec.kind == "agent" else None)


def plan(old: Config, new: Config, running: Mapping[str, Running],
         state_dir: StateDir) -> ReloadPlan:
    """Compare the running children (under `old`) with `new`. Raises ConfigError
    when `new` cannot be expanded into children."""
    wanted = {s.name: s for s in new.child_specs()}
    start: list[ChildSpec] = []
    restart: list[ChildSpec] = []
    stop: list[str] = []
    unchanged = 0
    for name, spec in wanted.items():
        current = running.get(name)
        if current is None:
            start.append(spec)
        elif launch(current.spec, old, state_dir) != launch(spec, new, state_dir):
            restart.append(spec)
        else:
            unchanged += 1
    for name, current in running.items():
        if name in wanted:
            continue
        if current.spawned_by_operator:
            unchanged += 1
        else:
            stop.append(name)
    zygote_changed = (commands.zygote_args(old, state_dir) != commands.zygote_args(new, state_dir)
                      or old.agents.zygote != new.agents.zygote)
    return ReloadPlan(start=start, stop=stop, restart=restart, unchanged=unchanged,
                      zygote_changed=zygote_changed)
