"""`supervisor`: the operator's command line.

    supervisor up [--state-dir D] [--config F] [--detach]
    supervisor status [--json] [--watch]
    supervisor kill NAME|all [--signal SIG]
    supervisor restart NAME
    supervisor stop [--timeout-s S]
    supervisor logs [-f] [--actor A] [--level L] [--since T] [--json]
    supervisor wal verify ...
    supervisor run [CONFIG] [--agents N]          (supervisor/run.py)
    supervisor spawn NAME --task FILE [--model M]  (supervisor/agentcli.py)
    supervisor approve AGENT REQUEST [--always] | deny AGENT REQUEST
    supervisor resume AGENT --budget N

Each subcommand imports only what it needs (`status` never imports structlog
or PyYAML). Errors print one line; exit codes: 0 done, 1 refused or failed,
2 usage, 3 no supervisor for that state directory, 4 the supervisor did not
answer (status shows the status file, marked stale); `up` has its own codes
(supervisor/up.py, docs/supervisor.md).
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_SUPERVISOR = 3
EXIT_NO_ANSWER = 4
STATUS_TIMEOUT_S = 1.0


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", default=os.environ.get("CORRAL_STATE_DIR"),
                        help="state directory (default ./.corral)")
    parser = argparse.ArgumentParser(prog="supervisor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="start the runtime (foreground)")
    up.add_argument("--config", help="configuration file (default config/default.yaml)")
    up.add_argument("--detach", action="store_true", help="run in the background")
    status = sub.add_parser("status", parents=[common], help="show every child")
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", action="store_true", help="refresh every second")
    kill = sub.add_parser("kill", parents=[common], help="signal a child's process group")
    kill.add_argument("target", metavar="NAME|all")
    kill.add_argument("--signal", "-s", default="TERM", help="signal name or number")
    restart = sub.add_parser("restart", parents=[common], help="restart one child")
    restart.add_argument("target", metavar="NAME")
    stop = sub.add_parser("stop", parents=[common], help="stop the whole tree")
    stop.add_argument("--timeout-s", type=float, default=120.0)
    logs = sub.add_parser("logs", parents=[common], help="merged actor logs")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("--actor", action="append", default=[])
    logs.add_argument("--level", default=None, choices=["debug", "info", "warning", "error"])
    logs.add_argument("--since", default=None, help="30s, 5m, 2h, 1d or an ISO time")
    logs.add_argument("--json", action="store_true")
    sub.add_parser("wal", help="`wal verify ...`: check the WAL (see wal verify --help)")
    _agent_parsers(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["wal"]:
        if argv[1:2] != ["verify"]:
            print("supervisor: usage: supervisor wal verify ...", file=sys.stderr)
            return 2
        from supervisor.walverify import main as wal_verify  # type: ignore[import-not-found,unused-ignore]

        result: int = wal_verify(argv[2:])
        return result
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return EXIT_OK


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "up":
        from supervisor import up

        if args.detach:
            return up.detach(args.state_dir, args.config)
        return up.run(args.state_dir, args.config)
    if args.command == "logs":
        return _logs(args)
    if args.command in ("run", "spawn", "approve", "deny", "resume"):
        return _agent_command(args)
    from broker.statedir import StateDir

    state_dir = StateDir.at(args.state_dir)
    if args.command == "status":
        return _status(state_dir, args.json, args.watch)
    return _control(state_dir, args)


def _agent_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """`run`, `spawn`, `approve`, `deny`, `resume` (supervisor/run.py, supervisor/agentcli.py)."""
    run = sub.add_parser("run", parents=[common], help="run N agents on the demo tasks")
    run.add_argument("config", nargs="?", help="configuration file (default config/default.yaml)")
    run.add_argument("--agents", type=int, default=None, help="number of agents (default 8)")
    run.add_argument("--timeout-s", type=float, default=None)
    spawn = sub.add_parser("spawn", parents=[common], help="add an agent to a running runtime")
    spawn.add_argument("name")
    spawn.add_argument("--task", required=True, help="task file (YAML)")
    spawn.add_argument("--model", default=None, help="scripted | replay:STREAM | openai[:MODEL]")
    spawn.add_argument("--config", default=None, help="agent settings from this configuration")
    for verb in ("approve", "deny"):
        answer = sub.add_parser(verb, parents=[common], help=f"{verb} an agent's request")
        answer.add_argument("agent")
        answer.add_argument("request")
        answer.add_argument("--note", default=None)
        if verb == "approve":
            answer.add_argument("--always", action="store_true",
                                help="also allow this op on this pattern from now on")
    resume = sub.add_parser("resume", parents=[common], help="resume an agent paused on budget")
    resume.add_argument("agent")
    resume.add_argument("--budget", type=int, required=True, help="tokens to add")
    resume.add_argument("--cost-units", type=float, default=0.0, help="cost units to add")


def _agent_command(args: argparse.Namespace) -> int:
    if args.command == "run":
        from supervisor import run

        return run.run(args.config, args.state_dir, args.agents, args.timeout_s)
    from broker.statedir import StateDir
    from supervisor import agentcli

    state_dir = StateDir.at(args.state_dir)
    if args.command == "spawn":
        return agentcli.spawn(state_dir, args.name, args.task, args.model, args.config)
    if args.command == "resume":
        return agentcli.resume(state_dir, args.agent, args.budget, args.cost_units)
    return agentcli.approve(state_dir, args.agent, args.request, deny=args.command == "deny",
                            always=getattr(args, "always", False), note=args.note)


def _status(state_dir: Any, as_json: bool, watch: bool) -> int:
    from supervisor import client, statusfile, statusview

    while True:
        if not client.running(state_dir):
            print(f"supervisor: no supervisor for {state_dir.root}", file=sys.stderr)
            return EXIT_NO_SUPERVISOR
        from broker import protocol
        from broker.errors import CorralError
        from broker.requester import new_msg_id

        stale: float | None = None
        try:
            reply = client.ask(state_dir, protocol.StatusRequest(msg_id=new_msg_id("st")),
                               timeout_s=STATUS_TIMEOUT_S)
            data: dict[str, Any] | None = reply.model_dump(mode="json")
        except client.NoSupervisorError:
            print(f"supervisor: no supervisor for {state_dir.root}", file=sys.stderr)
            return EXIT_NO_SUPERVISOR
        except CorralError:
            data = statusfile.read(state_dir.status_path)
            if data is None:
                print(f"supervisor: no answer from the supervisor of {state_dir.root} and "
                      f"no status file", file=sys.stderr)
                return EXIT_NO_ANSWER
            stale = max(0.0, time.time() - float(data.get("written_at", 0)))
            data["stale"] = True
            data["stale_age_s"] = round(stale, 3)
        assert data is not None
        data.pop("msg_id", None)
        if as_json:
            import json

            text = json.dumps(data, indent=None if watch else 2)
        else:
            text = statusview.render(data, stale)
        if watch:
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
            sys.stdout.flush()
            time.sleep(1.0)
            continue
        print(text)
        return EXIT_NO_ANSWER if stale is not None else EXIT_OK


def _signal_number(text: str) -> int:
    import signal

    if text.isdigit():
        return int(text)
    name = text.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ValueError(f"unknown signal {text!r}") from None


def _control(state_dir: Any, args: argparse.Namespace) -> int:
    from broker import pidlock, protocol
    from broker.errors import RemoteError, RequestTimeoutError
    from broker.requester import new_msg_id
    from supervisor import client

    message: protocol.SignalRequest | protocol.RestartRequest | protocol.StopRequest
    try:
        if args.command == "kill":
            message = protocol.SignalRequest(msg_id=new_msg_id("k"), target=args.target,
                                             signal=_signal_number(args.signal))
        elif args.command == "restart":
            message = protocol.RestartRequest(msg_id=new_msg_id("r"), target=args.target)
        else:
            message = protocol.StopRequest(msg_id=new_msg_id("s"))
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        print(f"supervisor: {first}", file=sys.stderr)
        return 2
    holder = pidlock.read_holder(state_dir.lock_path)
    try:
        reply = client.ask(state_dir, message, timeout_s=5.0)
    except client.NoSupervisorError:
        print(f"supervisor: no supervisor for {state_dir.root}", file=sys.stderr)
        return EXIT_NO_SUPERVISOR
    except RequestTimeoutError:
        print(f"supervisor: no answer from the supervisor of {state_dir.root}", file=sys.stderr)
        return EXIT_NO_ANSWER
    except RemoteError as exc:
        print(f"supervisor: {args.command} refused: {exc.detail}", file=sys.stderr)
        return EXIT_FAILED
    affected = getattr(reply, "affected", [])
    if args.command != "stop":
        print(f"supervisor: {args.command} {args.target}: {', '.join(affected) or 'none'}")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout_s
    while client.running(state_dir):
        if time.monotonic() > deadline:
            print(f"supervisor: pid {holder} still stopping after {args.timeout_s:g}s",
                  file=sys.stderr)
            return EXIT_FAILED
        time.sleep(0.05)
    print(f"supervisor: stopped (pid {holder})")
    return EXIT_OK


def _logs(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir
    from supervisor import logs

    log_dir = StateDir.at(args.state_dir).logs_dir
    try:
        flt = logs.Filter(
            actors=frozenset(args.actor),
            min_level=logs.LEVELS[args.level] if args.level else 0,
            since=logs.parse_since(args.since) if args.since else None,
        )
    except ValueError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return 2
    if not log_dir.is_dir():
        print(f"supervisor: no log directory {log_dir}", file=sys.stderr)
        return EXIT_FAILED
    try:
        for record in logs.merged(log_dir, flt):
            sys.stdout.write(logs.render(record, args.json) + "\n")
        sys.stdout.flush()
        if args.follow:
            logs.follow(log_dir, flt, args.json)
    except BrokenPipeError:
        return EXIT_OK
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
