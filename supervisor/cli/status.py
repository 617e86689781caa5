"""`supervisor status [NAME...] [--json] [--watch] [--fleet]`.

The fast path: no pydantic, no broker.protocol; the reply is checked by
supervisor/statusclient.py, the stale fallback read from run/status.json.
See docs/supervisor.md ("Status") and docs/fleet.md for `--fleet`.
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from supervisor.cli.command import (
    EXIT_FAILED,
    EXIT_NO_ANSWER,
    EXIT_NO_SUPERVISOR,
    EXIT_OK,
    PROG,
    Command,
    Parents,
)

STATUS_TIMEOUT_S = 1.0


def _add(sub: Any, parents: Parents) -> None:
    status = sub.add_parser("status", parents=[parents.common, parents.as_json],
                            help="show every child, or the named ones")
    status.add_argument("names", nargs="*", metavar="NAME")
    status.add_argument("--watch", action="store_true", help="refresh every second")
    status.add_argument("--fleet", action="store_true",
                        help="every host of the fleet (supervisor/fleet/ctl.py)")


def _run(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir

    if args.fleet:  # docs/fleet.md: every host, from the KV bucket
        from supervisor.fleet import ctl

        return ctl.print_fleet_status(StateDir.resolve(args.state_dir),
                                      os.environ.get("CORRAL_FLEET_CONFIG"), args.json)
    from supervisor import client, statusclient
    from supervisor.cli import statusview
    from supervisor.runtime import statusfile

    state_dir = StateDir.resolve(args.state_dir)
    names: list[str] = args.names

    def refuse(code: int, error: str, line: str) -> int:
        """One line on stderr; with --json also the object `stop --json` prints."""
        if args.json:
            import json

            print(json.dumps({"ok": False, "command": "status", "target": names or None,
                              "error": error, "detail": line}))
        print(f"{PROG}: {line}", file=sys.stderr)
        return code

    while True:
        if not client.running(state_dir):
            return refuse(EXIT_NO_SUPERVISOR, "no_supervisor",
                          f"no supervisor for {state_dir.root}")
        stale: float | None = None
        try:
            data: dict[str, Any] | None = statusclient.ask_status(state_dir, STATUS_TIMEOUT_S)
        except statusclient.RefusedError as exc:
            return refuse(EXIT_FAILED, "refused", f"status refused: {exc.detail}")
        except statusclient.NoAnswerError:
            if not client.running(state_dir):
                return refuse(EXIT_NO_SUPERVISOR, "no_supervisor",
                              f"no supervisor for {state_dir.root}")
            data = statusfile.read(state_dir.status_path)
            if data is None:
                return refuse(EXIT_NO_ANSWER, "no_answer",
                              f"no answer from the supervisor of {state_dir.root} and "
                              f"no status file")
            stale = max(0.0, time.time() - float(data.get("written_at", 0)))
            data["stale"] = True
            data["stale_age_s"] = round(stale, 3)
        assert data is not None
        data.pop("msg_id", None)
        if names:
            children = {c["name"]: c for c in data.get("children", [])}
            unknown = [n for n in names if n not in children]
            if unknown:
                return refuse(EXIT_FAILED, "not_found",
                              f"no child named {', '.join(unknown)} in {state_dir.root}")
            data["children"] = [children[n] for n in names]
        if args.json:
            import json

            text = json.dumps(data, indent=None if args.watch else 2)
        else:
            text = statusview.render(data, stale)
        if args.watch:
            # the screen is cleared only on a terminal; a pipe or a file gets each
            # round as it is, one after another
            clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
            sys.stdout.write(clear + text + "\n")
            sys.stdout.flush()
            time.sleep(1.0)
            continue
        print(text)
        sys.stdout.flush()
        return EXIT_NO_ANSWER if stale is not None else EXIT_OK


COMMANDS = (Command("status", _add, _run),)
