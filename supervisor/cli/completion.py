"""`supervisor completion bash|zsh`: a shell completion script of every command.
See docs/operations.md."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from supervisor.cli.command import EXIT_OK, Command, Parents


def _add(sub: Any, parents: Parents) -> None:
    completion = sub.add_parser("completion", help="print a shell completion script")
    completion.add_argument("shell", choices=["bash", "zsh"])


def _run(args: argparse.Namespace) -> int:
    import shtab  # noqa: PLC0415

    from supervisor.cli import main  # noqa: PLC0415

    sys.stdout.write(shtab.complete(main.parser(), shell=args.shell))
    sys.stdout.flush()
    return EXIT_OK


COMMANDS = (Command("completion", _add, _run),)
