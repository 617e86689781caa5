"""`supervisor wal verify ...`: check the WAL offline (supervisor/walverify.py
parses its own arguments). See docs/wal.md."""

from __future__ import annotations

import sys
from typing import Any

from supervisor.cli.command import EXIT_USAGE, PROG, Command, Parents


def _add(sub: Any, parents: Parents) -> None:
    sub.add_parser("wal", help="`wal verify ...`: check the WAL (see wal verify --help)")


def _run_argv(argv: list[str]) -> int:
    if argv[:1] != ["verify"]:
        print(f"{PROG}: usage: {PROG} wal verify ...", file=sys.stderr)
        return EXIT_USAGE
    from supervisor.walverify import main as wal_verify  # noqa: PLC0415

    return wal_verify(argv[1:])


COMMANDS = (Command("wal", _add, run_argv=_run_argv),)
