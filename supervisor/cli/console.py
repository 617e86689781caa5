"""`supervisor console [--listen HOST:PORT] [--config F]`: serve the web console
(supervisor/console/). See docs/console.md."""

from __future__ import annotations

import argparse
from typing import Any

from supervisor.cli.command import Command, Parents


def _add(sub: Any, parents: Parents) -> None:
    console = sub.add_parser("console", parents=[parents.common],
                             help="serve the web console (supervisor/console/, docs/console.md)")
    console.add_argument("--listen", default=None, help="HOST:PORT (default 127.0.0.1:0)")
    console.add_argument("--config", default=None, help="configuration file (console:, storage:)")


def _run(args: argparse.Namespace) -> int:
    from supervisor.console import serve  # noqa: PLC0415

    return serve.run(args)


COMMANDS = (Command("console", _add, _run),)
