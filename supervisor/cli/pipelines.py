"""The argument parsers of `supervisor pipeline ...` and `supervisor registry ...`.

Their work is in supervisor/cli/pipelinework.py, imported only when one runs.
See docs/pipelines.md and docs/registries.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from supervisor.cli.command import Command, Parents
from supervisor.cli.command import seq as _seq

REGISTRIES = ("pipelines", "schedules", "hooks", "mcp")


def _add_pipeline(sub: Any, parents: Parents) -> None:
    common, as_json = parents
    pipeline = sub.add_parser("pipeline", help="run or check a pipeline (docs/pipelines.md)")
    verbs = pipeline.add_subparsers(dest="pipeline_command", required=True, metavar="VERB")
    run = verbs.add_parser("run", parents=[common, as_json],
                           help="run a pipeline file or an installed pipeline")
    run.add_argument("target", metavar="NAME|FILE")
    run.add_argument("--input", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--runner", default=None, help="the runner's actor name")
    run.add_argument("--wait", action="store_true", help="wait for the end, print outputs")
    run.add_argument("--timeout-s", type=float, default=600.0, help="with --wait")
    check = verbs.add_parser("check", parents=[common], help="check a pipeline file")
    check.add_argument("file")


def _add_registry(sub: Any, parents: Parents) -> None:
    common = parents.common
    registry = sub.add_parser("registry", help="the config registries (docs/pipelines.md, "
                                               "docs/automation.md)")
    rverbs = registry.add_subparsers(dest="registry_command", required=True, metavar="VERB")
    show = rverbs.add_parser("show", parents=[common], help="entries (at a seq)")
    show.add_argument("registry", nargs="?", choices=REGISTRIES)
    show.add_argument("--seq", type=_seq, default=None)
    apply = rverbs.add_parser("apply", parents=[common],
                              help="run a registry op (pipeline_install, hook_add, ...)")
    apply.add_argument("op")
    apply.add_argument("--args", default="{}", help="the op's arguments as a JSON object")
    restore = rverbs.add_parser("restore", parents=[common],
                                help="make every registry as it was at SEQ (new generations)")
    restore.add_argument("seq", type=_seq)


def _run_pipeline(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir  # noqa: PLC0415
    from supervisor.cli import pipelinework as work  # noqa: PLC0415

    work.quiet_logs()
    if args.pipeline_command == "check":
        return work.check(args.file)
    return work.run(StateDir.resolve(args.state_dir), args.target, args.input,
                    runner=args.runner, wait=args.wait, timeout_s=args.timeout_s,
                    as_json=args.json)


def _run_registry(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir  # noqa: PLC0415
    from supervisor.cli import pipelinework as work  # noqa: PLC0415

    work.quiet_logs()
    state_dir = StateDir.resolve(args.state_dir)
    if args.registry_command == "show":
        return work.registry_show(state_dir, args.registry, args.seq)
    if args.registry_command == "apply":
        return work.registry_apply(state_dir, args.op, args.args)
    return work.registry_restore(state_dir, args.seq)


COMMANDS = (Command("pipeline", _add_pipeline, _run_pipeline),
            Command("registry", _add_registry, _run_registry))
