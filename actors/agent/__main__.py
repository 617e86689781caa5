"""`python -m actors.agent --name N --state-dir D`: one agent, fresh interpreter.

The fallback when the zygote is off, the benchmark baseline and the
process-level tests. See docs/agents.md ("Specs and process").
"""

from __future__ import annotations

import argparse
import sys

from actors.agent.process import AgentOptions, serve
from broker import skeleton
from broker.errors import StateDirError
from broker.statedir import check_actor_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.agent", description=__doc__)
    parser.add_argument("--name", required=True)
    skeleton.add_arguments(parser)
    parser.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--no-broker", action="store_true", help="do not join the broker")
    args = parser.parse_args(argv)
    proc = skeleton.Process("agent")  # until the name is checked: serve() is the agent's
    try:
        state = proc.state_dir(args.state_dir)
        name = check_actor_name(args.name)
    except StateDirError as exc:
        return proc.refuse(exc)
    options = AgentOptions(
        heartbeat_interval_s=args.heartbeat_interval_ms / 1000.0,
        log_level=args.log_level,
        log_max_bytes=args.log_max_bytes,
        log_backups=args.log_backups,
        join_broker=not args.no_broker,
    )
    return serve(name, state, options)


if __name__ == "__main__":
    sys.exit(main())
