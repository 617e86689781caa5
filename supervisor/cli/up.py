"""`supervisor up`: run the supervisor (supervisor/runtime/up.py) in the
foreground or detached. See docs/supervisor.md ("Start, stop, restart")."""

from __future__ import annotations

import argparse
from typing import Any

from supervisor.cli.command import Command, Parents


def _add(sub: Any, parents: Parents) -> None:
    up = sub.add_parser("up", parents=[parents.common], help="start the runtime (foreground)")
    up.add_argument("--config", help="configuration file (default: the packaged default.yaml)")
    up.add_argument("--detach", action="store_true", help="run in the background")
    up.add_argument("--quiet", "-q", action="store_true",
                    help="no start, progress and ready lines (errors still)")


def _run(args: argparse.Namespace) -> int:
    from supervisor.runtime import up  # noqa: PLC0415

    if args.detach:
        return up.detach(args.state_dir, args.config)
    return up.run(args.state_dir, args.config, quiet=args.quiet)


COMMANDS = (Command("up", _add, _run),)
