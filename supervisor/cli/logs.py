"""`supervisor logs [-f] [--actor A] [--level L] [--since T] [--json]`: the
actors' logs merged (the work: supervisor/logs.py). See docs/operations.md
("Logs")."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from supervisor.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE, PROG, Command, Parents


def _add(sub: Any, parents: Parents) -> None:
    logs = sub.add_parser("logs", parents=[parents.common], help="merged actor logs")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("--actor", action="append", default=[])
    logs.add_argument("--level", default=None, choices=["debug", "info", "warning", "error"])
    logs.add_argument("--since", default=None, help="30s, 5m, 2h, 1d or an ISO time")
    logs.add_argument("--json", action="store_true")


def _run(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir  # noqa: PLC0415
    from supervisor import logs  # noqa: PLC0415

    log_dir = StateDir.resolve(args.state_dir).logs_dir
    try:
        flt = logs.Filter(
            actors=frozenset(args.actor),
            min_level=logs.LEVELS[args.level] if args.level else 0,
            since=logs.parse_since(args.since) if args.since else None,
        )
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not log_dir.is_dir():
        print(f"{PROG}: no log directory {log_dir}", file=sys.stderr)
        return EXIT_FAILED
    present = logs.actors_in(log_dir)
    unknown = sorted(set(args.actor) - set(present))
    if unknown:
        known = ", ".join(present[:20]) + (", ..." if len(present) > 20 else "") or "none"
        print(f"{PROG}: no log for {', '.join(unknown)} in {log_dir} (actors: {known})",
              file=sys.stderr)
        return EXIT_FAILED
    for record in logs.merged(log_dir, flt):
        sys.stdout.write(logs.render(record, args.json) + "\n")
    sys.stdout.flush()
    if args.follow:
        logs.follow(log_dir, flt, args.json)
    return EXIT_OK


COMMANDS = (Command("logs", _add, _run),)
