"""`supervisor run [CONFIG] [--agents N]`: the demo job (its work:
supervisor/cli/demo.py, loaded only when it runs). See docs/agents.md ("Commands").
"""

from __future__ import annotations

import argparse
from typing import Any

from supervisor.cli.command import Command, Parents, positive


def _add_run(sub: Any, parents: Parents) -> None:
    run = sub.add_parser("run", parents=[parents.common], help="run N agents on the demo tasks")
    run.add_argument("config", nargs="?",
                     help="configuration file (default: the packaged default.yaml)")
    run.add_argument("--agents", type=int, default=None, help="number of agents (default 8)")
    run.add_argument("--timeout-s", type=positive, default=None)


def _run_demo(args: argparse.Namespace) -> int:
    from supervisor.cli import demo  # noqa: PLC0415

    return demo.run(args.config, args.state_dir, args.agents, args.timeout_s)


COMMANDS = (Command("run", _add_run, _run_demo),)
