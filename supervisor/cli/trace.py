"""`supervisor trace AGENT [-f] [--since SEQ] [--json]`: an agent's session as a
person reads it (the work: supervisor/trace.py). See docs/supervisor.md
("Trace")."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from supervisor.cli.command import EXIT_USAGE, PROG, Command, Parents, seq


def _add(sub: Any, parents: Parents) -> None:
    trace = sub.add_parser("trace", parents=[parents.common],
                           help="an agent's session as a person reads it (from the WAL)")
    trace.add_argument("agent", metavar="AGENT")
    trace.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    trace.add_argument("--since", type=seq, default=1, metavar="SEQ",
                       help="start at this WAL seq (default 1)")
    trace.add_argument("--json", action="store_true", help="one JSON object per record")


def _run(args: argparse.Namespace) -> int:
    from broker.errors import CorralError  # noqa: PLC0415
    from broker.statedir import StateDir, check_actor_name  # noqa: PLC0415
    from supervisor import trace  # noqa: PLC0415

    try:
        check_actor_name(args.agent)
    except CorralError as exc:
        print(f"{PROG}: trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return trace.run(StateDir.resolve(args.state_dir), args.agent, since=args.since,
                     follow=args.follow, json_out=args.json)


COMMANDS = (Command("trace", _add, _run),)
