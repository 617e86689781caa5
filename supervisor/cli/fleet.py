"""`supervisor fleet up|down|fence ...`: a fleet of hosts (supervisor/fleet/cli.py
parses its own arguments). See docs/fleet.md."""

from __future__ import annotations

from typing import Any

from supervisor.cli.command import Command, Parents


def _add(sub: Any, parents: Parents) -> None:
    sub.add_parser("fleet", help="`fleet up|down|fence ...`: a fleet of hosts (docs/fleet.md)")


def _run_argv(argv: list[str]) -> int:
    from supervisor.fleet.cli import main as fleet_main  # noqa: PLC0415

    return fleet_main(argv)


COMMANDS = (Command("fleet", _add, run_argv=_run_argv),)
