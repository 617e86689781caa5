"""`supervisor spawn NAME --task FILE [--model M] [--host auto|HOST] [--json]`: an
agent added to the running runtime (supervisor/cli/agents.py), or in fleet mode
to a host (supervisor/fleet/ctl.py). See docs/agents.md and docs/fleet.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from supervisor.cli.command import Command, Parents


def _add_spawn(sub: Any, parents: Parents) -> None:
    spawn = sub.add_parser("spawn", parents=[parents.common, parents.as_json],
                           help="add an agent to the running runtime (its configuration)")
    spawn.add_argument("name")
    spawn.add_argument("--task", required=True, help="task file (YAML)")
    spawn.add_argument("--model", default=None, help="scripted | replay:STREAM | openai[:MODEL]")
    spawn.add_argument("--host", default=None, metavar="auto|HOST",
                       help="fleet mode: on HOST, or the least-loaded live host (docs/fleet.md)")


def _run_spawn(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir  # noqa: PLC0415
    from supervisor.cli import agents  # noqa: PLC0415

    state_dir = StateDir.resolve(args.state_dir)
    if args.host is not None:  # fleet placement
        from supervisor.fleet import ctl  # noqa: PLC0415

        return ctl.remote_spawn(state_dir, os.environ.get("CORRAL_FLEET_CONFIG"),
                                args.name, args.task, args.model, host=args.host,
                                as_json=args.json)
    return agents.spawn(state_dir, args.name, args.task, args.model, as_json=args.json)


COMMANDS = (Command("spawn", _add_spawn, _run_spawn),)
