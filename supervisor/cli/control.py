"""The control commands: kill, restart, start, stop [NAME], remove, reload.

See docs/supervisor.md ("Start, stop, restart", "Exit codes").
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker import pidlock
from broker.errors import RemoteError, RequestTimeoutError
from broker.statedir import StateDir
from supervisor import client
from supervisor.cli.command import (
    EXIT_FAILED,
    EXIT_NO_ANSWER,
    EXIT_NO_SUPERVISOR,
    EXIT_OK,
    Command,
    Parents,
    positive,
)

if TYPE_CHECKING:
    from broker import protocol

REQUEST_TIMEOUT_S = 5.0


def signal_number(text: str) -> int:
    """`--signal`: a name (TERM, SIGTERM, kill) or a number 1..64."""
    import signal

    if text.isdigit():
        number = int(text)
        if 1 <= number <= 64:
            return number
        raise argparse.ArgumentTypeError(f"{text} is not a signal number (1..64)")
    name = text.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown signal {text!r} (a name like TERM, KILL, HUP or a number 1..64)"
        ) from None


def _add_kill(sub: Any, parents: Parents) -> None:
    kill = sub.add_parser("kill", parents=[parents.common, parents.as_json],
                          help="signal a child's process group")
    kill.add_argument("target", metavar="NAME|all")
    kill.add_argument("--signal", "-s", default=15, type=signal_number,
                      help="signal name or number (default TERM)")


def _add_one(verb: str, text: str) -> Callable[[Any, Parents], None]:
    """`restart`, `start`, `remove`: one named child."""

    def add(sub: Any, parents: Parents) -> None:
        one = sub.add_parser(verb, parents=[parents.common, parents.as_json], help=text)
        one.add_argument("target", metavar="NAME")
        if verb == "remove":
            one.add_argument("--timeout-s", type=positive, default=120.0)

    return add


def _add_stop(sub: Any, parents: Parents) -> None:
    stop = sub.add_parser("stop", parents=[parents.common, parents.as_json],
                          help="stop one child (it stays stopped) or the whole tree")
    stop.add_argument("target", nargs="?", default=None, metavar="NAME")
    stop.add_argument("--timeout-s", type=positive, default=120.0)


def _add_reload(sub: Any, parents: Parents) -> None:
    sub.add_parser("reload", parents=[parents.common, parents.as_json],
                   help="re-read the configuration; restart only what changed")


def _run_fleet_aware(args: argparse.Namespace) -> int:
    """`kill`, `stop`, `start` of HOST:AGENT go to that host (docs/fleet.md)."""
    target = getattr(args, "target", None) or ""
    if ":" in target:
        from supervisor.fleet import ctl

        return ctl.remote_control(StateDir.resolve(args.state_dir),
                                  os.environ.get("CORRAL_FLEET_CONFIG"), args.command,
                                  target, sig=getattr(args, "signal", 15), as_json=args.json)
    return run(args)


def _message(args: argparse.Namespace) -> client.Request:
    from broker import protocol
    from broker.requester import new_msg_id

    target: str = getattr(args, "target", None) or ""
    match args.command:
        case "kill":
            return protocol.SignalRequest(msg_id=new_msg_id("k"), target=target,
                                          signal=args.signal)
        case "restart":
            return protocol.RestartRequest(msg_id=new_msg_id("r"), target=target)
        case "start":
            return protocol.StartRequest(msg_id=new_msg_id("sa"), target=target)
        case "remove":
            return protocol.RemoveRequest(msg_id=new_msg_id("rm"), target=target)
        case "reload":
            return protocol.ReloadRequest(msg_id=new_msg_id("rl"))
        case _:
            return protocol.StopRequest(msg_id=new_msg_id("s"), target=target or None)


def _emit(args: argparse.Namespace, code: int, line: str, **data: Any) -> int:
    if args.json:
        body = {"ok": code == EXIT_OK, "command": args.command,
                "target": getattr(args, "target", None), **data}
        print(json.dumps(body))
        if code != EXIT_OK:
            print(f"supervisor: {line}", file=sys.stderr)
    else:
        print(f"supervisor: {line}", file=sys.stderr if code != EXIT_OK else sys.stdout)
    return code


def run(args: argparse.Namespace) -> int:
    from broker.errors import CorralError
    from broker.statedir import check_actor_name

    state_dir = StateDir.resolve(args.state_dir)
    target = getattr(args, "target", None)
    if target is not None and target != "all":
        try:
            check_actor_name(target)
        except CorralError as exc:
            return _emit(args, 2, str(exc), error="usage")
    try:
        message = _message(args)
    except ValueError as exc:  # a field the protocol refuses: say it in our words
        return _emit(args, 2, f"{args.command}: invalid argument ({str(exc).splitlines()[0]})",
                     error="usage")
    from broker import protocol

    holder = pidlock.read_holder(state_dir.lock_path)
    try:
        reply = client.ask(state_dir, message, timeout_s=REQUEST_TIMEOUT_S)
    except client.NoSupervisorError:
        return _emit(args, EXIT_NO_SUPERVISOR, f"no supervisor for {state_dir.root}",
                     error="no_supervisor")
    except RequestTimeoutError:
        return _emit(args, EXIT_NO_ANSWER, f"no answer from the supervisor of {state_dir.root}",
                     error="no_answer")
    except RemoteError as exc:
        return _emit(args, EXIT_FAILED, f"{args.command} refused: {exc.detail}",
                     error=str(exc.code), detail=exc.detail)
    except CorralError as exc:  # the operator credential cannot be read (broker/auth.py)
        return _emit(args, EXIT_FAILED, str(exc), error="credential")
    if isinstance(reply, protocol.ReloadReply):
        return _emit(args, EXIT_OK, _reload_line(reply), config=reply.config,
                     started=reply.started, stopped=reply.stopped, restarted=reply.restarted,
                     unchanged=reply.unchanged)
    affected: list[str] = list(getattr(reply, "affected", []))
    if args.command == "stop" and target is None:
        return _wait_tree_down(args, state_dir, holder, affected)
    if args.command in ("stop", "remove") and affected and target is not None:
        return _wait_child(args, state_dir, target, affected)
    line = _done_line(args.command, target, affected)
    if args.command == "kill" and affected:
        import signal

        try:
            name = signal.Signals(args.signal).name
        except ValueError:
            name = f"signal {args.signal}"
        line = f"sent {name} to {', '.join(affected)}"
    return _emit(args, EXIT_OK, line, affected=affected)


DONE = {"start": "started", "restart": "restarted", "stop": "stopped", "remove": "removing"}


def _done_line(command: str, target: str | None, affected: list[str]) -> str:
    if affected:
        return f"{DONE.get(command, command)} {', '.join(affected)}"
    nothing = {"start": "already running", "stop": "already stopped"}
    return f"{command} {target}: {nothing.get(command, 'nothing to do')}"


def _reload_line(reply: protocol.ReloadReply) -> str:
    parts = [f"{label} {', '.join(names)}" for label, names in
             (("started", reply.started), ("stopped", reply.stopped),
              ("restarted", reply.restarted)) if names]
    return (f"reloaded {reply.config}: " + ("; ".join(parts) or "nothing changed")
            + f" ({reply.unchanged} unchanged)")


def _wait_tree_down(args: argparse.Namespace, state_dir: StateDir, holder: int | None,
                    affected: list[str]) -> int:
    deadline = time.monotonic() + args.timeout_s
    while client.running(state_dir):
        if time.monotonic() > deadline:
            return _emit(args, EXIT_FAILED,
                         f"pid {holder} still stopping after {args.timeout_s:g}s",
                         error="timeout")
        time.sleep(0.05)
    return _emit(args, EXIT_OK, f"stopped (pid {holder})", affected=affected)


def _wait_child(args: argparse.Namespace, state_dir: StateDir, target: str,
                affected: list[str]) -> int:
    """`stop NAME` returns when the child is down; `remove NAME` when it is gone."""
    from broker import protocol
    from broker.requester import new_msg_id

    deadline = time.monotonic() + args.timeout_s
    while True:
        try:
            reply = client.ask(state_dir, protocol.StatusRequest(msg_id=new_msg_id("w")),
                               timeout_s=REQUEST_TIMEOUT_S)
        except (client.NoSupervisorError, RequestTimeoutError, RemoteError):
            return _emit(args, EXIT_FAILED, f"lost the supervisor while waiting for {target}",
                         error="no_answer")
        children = {c.name: c for c in getattr(reply, "children", [])}
        child = children.get(target)
        if args.command == "remove" and child is None:
            return _emit(args, EXIT_OK, f"removed {target} (its history stays in the WAL)",
                         affected=affected)
        if args.command == "stop" and child is not None and child.pid is None \
                and child.state in ("stopped", "exited", "fatal"):
            return _emit(args, EXIT_OK, f"stopped {target}", affected=affected,
                         state=child.state, last_exit=child.last_exit)
        if time.monotonic() > deadline:
            return _emit(args, EXIT_FAILED,
                         f"{target} still {child.state if child else 'there'} after "
                         f"{args.timeout_s:g}s", error="timeout")
        time.sleep(0.05)


COMMANDS = (
    Command("kill", _add_kill, _run_fleet_aware),
    Command("restart", _add_one("restart", "restart one child"), run),
    Command("start", _add_one("start", "start a stopped, exited or fatal child"),
            _run_fleet_aware),
    Command("remove", _add_one("remove", "stop an agent and drop its spec (its history stays)"),
            run),
    Command("stop", _add_stop, _run_fleet_aware),
    Command("reload", _add_reload, run),
)
