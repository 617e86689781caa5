"""`supervisor`: corral's operator command line.

A new subcommand adds its parser in `_parser()`, its handler to `HANDLERS`
and its usage line to `USAGE` (checked against the README by
tests/acceptance/test_docs_match.py). See docs/supervisor.md.
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from broker.statedir import private_umask
from supervisor import pipelineparse, sessionscli

USAGE = """\
commands:
  supervisor up [--state-dir D] [--config F] [--detach] [--quiet]
  supervisor status [NAME...] [--json] [--watch] [--fleet]
  supervisor stop [NAME] [--timeout-s S] [--json]     the whole tree, or one child
  supervisor start NAME [--json]                      also an agent made by `fork`
  supervisor restart NAME [--json]
  supervisor remove NAME [--json]                     an agent: stop it, drop its spec
  supervisor reload [--json]                          re-read the configuration (SIGHUP)
  supervisor spawn NAME --task FILE [--model M] [--json]
  supervisor kill NAME|all [--signal SIG] [--json]
  supervisor logs [-f] [--actor A] [--level L] [--since T] [--json]
  supervisor trace AGENT [-f] [--since SEQ] [--json]  an agent's session, readable
  supervisor wal verify [--json]                      check the WAL offline
  supervisor run [CONFIG] [--agents N]                the demo job
  supervisor approve AGENT REQUEST [--always] | deny AGENT REQUEST
  supervisor answer AGENT REQUEST TEXT | --file F     (docs/operator-input.md)
  supervisor correct AGENT TEXT | --file F
  supervisor resume AGENT --budget N [--cost-units C] [--request-id ID]
  supervisor sessions list|show|label|archive|unarchive|reindex|purge ...  (docs/sessions.md)
  supervisor rewind REF --to-turn N | --to-seq S      (docs/trees.md)
  supervisor fork REF --name NEW [--at-turn N]
  supervisor du [--json] | gc [--dry-run] [--json]    storage (docs/storage.md)
  supervisor pipeline run NAME|FILE [--input k=v] [--wait] | check FILE   (docs/pipelines.md)
  supervisor registry show|apply|restore ...          (docs/pipelines.md, docs/automation.md)
  supervisor fleet up|down|fence ...                  (docs/fleet.md)
  supervisor console [--listen HOST:PORT] [--config F]  the web console (docs/console.md)
  supervisor completion bash|zsh                      a shell completion script
  supervisor --version

State directory: --state-dir D, else $CORRAL_STATE_DIR, else ./.corral.
Exit codes: 0 done; 1 refused (an unknown name, a child that cannot do that)
or failed; 2 usage (one line says which argument and why); 3 no supervisor for
that state directory; 4 the supervisor did not answer (status shows the status
file, marked stale). `up` has its own (docs/supervisor.md). A closed standard
output (`supervisor status | head`) ends the command quietly.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_SUPERVISOR = 3
EXIT_NO_ANSWER = 4
STATUS_TIMEOUT_S = 1.0
PROG = "supervisor"


def version() -> str:
    from supervisor.identity import version as corral_version

    return corral_version()


class _Parser(argparse.ArgumentParser):
    """Refusals in one line, in the CLI's words; `--help` names corral."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def format_help(self) -> str:
        text = super().format_help()
        if self.prog == PROG:
            text = f"corral {version()}: the operator's command line of corral\n\n{text}"
        return text


class _Version(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"corral {version()} (the `{PROG}` command; Python {sys.version.split()[0]})")
        parser.exit(EXIT_OK)


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


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0")
    return value


def _seq(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a WAL seq (a whole number >= 1)")
    return int(text)


class _Unbuilt:
    """A command's parser left unbuilt: every call on it does nothing."""

    def __getattr__(self, name: str) -> _Unbuilt:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Unbuilt:
        return self


class _OnlyCommand:
    """The subparsers of a run whose command is known: only that command's
    parser is built (building all of them was a third of `supervisor status`'s
    own time: argparse looks up its translations at each call)."""

    def __init__(self, sub: Any, command: str) -> None:
        self.sub = sub
        self.command = command
        self.built = False

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if name != self.command:
            return _Unbuilt()
        self.built = True
        return self.sub.add_parser(name, **kwargs)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; given `command`, with only that command's parser
    (parsing its arguments exactly the same), else with all of them (help,
    completion, an unknown command's error)."""
    if command is not None:
        only: list[_OnlyCommand] = []

        def wrap(sub: Any) -> _OnlyCommand:
            only.append(_OnlyCommand(sub, command))
            return only[0]

        parser = _parser_with(wrap)
        if only[0].built:
            return parser
    return _parser_with(lambda sub: sub)


def _parser_with(wrap: Callable[[Any], Any]) -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--state-dir", default=None,
                        help="state directory (default $CORRAL_STATE_DIR, else ./.corral)")
    as_json = _Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print the result as JSON")
    parser = _Parser(prog=PROG, description=USAGE,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, nargs=0, help="print corral's version")
    sub = wrap(parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser))
    up = sub.add_parser("up", parents=[common], help="start the runtime (foreground)")
    up.add_argument("--config", help="configuration file (default: the packaged default.yaml)")
    up.add_argument("--detach", action="store_true", help="run in the background")
    up.add_argument("--quiet", "-q", action="store_true",
                    help="no start, progress and ready lines (errors still)")
    status = sub.add_parser("status", parents=[common, as_json],
                            help="show every child, or the named ones")
    status.add_argument("names", nargs="*", metavar="NAME")
    status.add_argument("--watch", action="store_true", help="refresh every second")
    status.add_argument("--fleet", action="store_true",
                        help="every host of the fleet (supervisor/fleet/ctl.py)")
    kill = sub.add_parser("kill", parents=[common, as_json],
                          help="signal a child's process group")
    kill.add_argument("target", metavar="NAME|all")
    kill.add_argument("--signal", "-s", default=15, type=signal_number,
                      help="signal name or number (default TERM)")
    for verb, text in (("restart", "restart one child"),
                       ("start", "start a stopped, exited or fatal child"),
                       ("remove", "stop an agent and drop its spec (its history stays)")):
        one = sub.add_parser(verb, parents=[common, as_json], help=text)
        one.add_argument("target", metavar="NAME")
        if verb == "remove":
            one.add_argument("--timeout-s", type=_positive, default=120.0)
    stop = sub.add_parser("stop", parents=[common, as_json],
                          help="stop one child (it stays stopped) or the whole tree")
    stop.add_argument("target", nargs="?", default=None, metavar="NAME")
    stop.add_argument("--timeout-s", type=_positive, default=120.0)
    sub.add_parser("reload", parents=[common, as_json],
                   help="re-read the configuration; restart only what changed")
    logs = sub.add_parser("logs", parents=[common], help="merged actor logs")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("--actor", action="append", default=[])
    logs.add_argument("--level", default=None, choices=["debug", "info", "warning", "error"])
    logs.add_argument("--since", default=None, help="30s, 5m, 2h, 1d or an ISO time")
    logs.add_argument("--json", action="store_true")
    trace = sub.add_parser("trace", parents=[common],
                           help="an agent's session as a person reads it (from the WAL)")
    trace.add_argument("agent", metavar="AGENT")
    trace.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    trace.add_argument("--since", type=_seq, default=1, metavar="SEQ",
                       help="start at this WAL seq (default 1)")
    trace.add_argument("--json", action="store_true", help="one JSON object per record")
    sub.add_parser("wal", help="`wal verify ...`: check the WAL (see wal verify --help)")
    sub.add_parser("fleet", help="`fleet up|down|fence ...`: a fleet of hosts (docs/fleet.md)")
    _agent_parsers(sub, common, as_json)
    pipelineparse.add_parsers(sub, common, as_json)
    sessionscli.add_parser(sub, common)
    console = sub.add_parser("console", parents=[common],
                             help="serve the web console (supervisor/console/, docs/console.md)")
    console.add_argument("--listen", default=None, help="HOST:PORT (default 127.0.0.1:0)")
    console.add_argument("--config", default=None, help="configuration file (console:, storage:)")
    completion = sub.add_parser("completion", help="print a shell completion script")
    completion.add_argument("shell", choices=["bash", "zsh"])
    return parser


def _agent_parsers(sub: Any, common: argparse.ArgumentParser,
                   as_json: argparse.ArgumentParser) -> None:
    """`run`, `spawn`, `approve`, `deny`, `resume` (supervisor/run.py, supervisor/agentcli.py)."""
    run = sub.add_parser("run", parents=[common], help="run N agents on the demo tasks")
    run.add_argument("config", nargs="?",
                     help="configuration file (default: the packaged default.yaml)")
    run.add_argument("--agents", type=int, default=None, help="number of agents (default 8)")
    run.add_argument("--timeout-s", type=_positive, default=None)
    spawn = sub.add_parser("spawn", parents=[common, as_json],
                           help="add an agent to the running runtime (its configuration)")
    spawn.add_argument("name")
    spawn.add_argument("--task", required=True, help="task file (YAML)")
    spawn.add_argument("--model", default=None, help="scripted | replay:STREAM | openai[:MODEL]")
    spawn.add_argument("--host", default=None, metavar="auto|HOST",
                       help="fleet mode: on HOST, or the least-loaded live host (docs/fleet.md)")
    for verb in ("approve", "deny"):
        answer = sub.add_parser(verb, parents=[common], help=f"{verb} an agent's request")
        answer.add_argument("agent")
        answer.add_argument("request")
        answer.add_argument("--note", default=None)
        if verb == "approve":
            answer.add_argument("--always", action="store_true",
                                help="also allow this op on this pattern from now on")
    for verb, text in (("du", "storage usage per tier and per session"),
                       ("gc", "run a storage collection pass now (docs/storage.md)")):
        store = sub.add_parser(verb, parents=[common, as_json], help=text)
        store.add_argument("--config", help="configuration file (its storage: caps)")
        if verb == "gc":
            store.add_argument("--dry-run", action="store_true", help="only report")
            store.add_argument("--timeout-s", type=float, default=120.0,
                               help="how long to wait for the writer's WAL pass")
    reply = sub.add_parser("answer", parents=[common], help="answer an agent's question")
    reply.add_argument("agent")
    reply.add_argument("request")
    reply.add_argument("text", nargs="?", default=None)
    reply.add_argument("--file", default=None, help="read the answer from this file")
    correct = sub.add_parser("correct", parents=[common],
                             help="tell an agent something at its next model request")
    correct.add_argument("agent")
    correct.add_argument("text", nargs="?", default=None)
    correct.add_argument("--file", default=None, help="read the correction from this file")
    resume = sub.add_parser("resume", parents=[common], help="resume an agent paused on budget")
    resume.add_argument("agent")
    resume.add_argument("--budget", type=int, required=True, help="tokens to add")
    resume.add_argument("--cost-units", type=float, default=0.0, help="cost units to add")
    resume.add_argument("--request-id", default=None, metavar="ID",
                        help="this request's id (default: a new one); the same id again "
                             "is written once (docs/operator-input.md)")
    rewind = sub.add_parser("rewind", parents=[common, as_json],
                            help="rewind a stopped session to a turn (supervisor/treecli.py)")
    rewind.add_argument("ref", help="an agent's name (its newest session), or that session's id")
    rewind.add_argument("--to-turn", type=int, default=None,
                        help="keep turns 1..N of the newest session")
    rewind.add_argument("--to-seq", type=int, default=None,
                        help="cut at this record of the newest session's active branch")
    fork = sub.add_parser("fork", parents=[common, as_json],
                          help="fork a session into a new agent at a turn")
    fork.add_argument("ref", help="a session id (or a unique prefix), or an agent's name "
                                  "(its newest session)")
    fork.add_argument("--name", required=True, help="the new agent's name")
    fork.add_argument("--at-turn", type=int, default=None,
                      help="after this turn of that session (default: its last)")


def main(argv: list[str] | None = None) -> int:
    private_umask()  # whatever it writes under the state directory is private
    # Ctrl-C ends a follower (`status --watch`, `trace -f`, `logs -f`) even when
    # the command was started with SIGINT ignored (a background job of a shell
    # without job control passes that on)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, and keep the interpreter's
        # final flush from raising again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK


def _main(argv: list[str]) -> int:
    if argv[:1] == ["wal"]:
        if argv[1:2] != ["verify"]:
            print(f"{PROG}: usage: {PROG} wal verify ...", file=sys.stderr)
            return EXIT_USAGE
        from supervisor.walverify import main as wal_verify  # type: ignore[import-not-found,unused-ignore]

        result: int = wal_verify(argv[2:])
        return result
    if argv[:1] == ["fleet"]:  # supervisor/fleet/cli.py (docs/fleet.md)
        from supervisor.fleet.cli import main as fleet_main

        return fleet_main(argv[1:])
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = _parser(command).parse_args(argv)
    return HANDLERS[args.command](args)


def _pipeline_command(args: argparse.Namespace) -> int:
    return pipelineparse.dispatch(args)


def _up(args: argparse.Namespace) -> int:
    from supervisor.runtime import up

    if args.detach:
        return up.detach(args.state_dir, args.config)
    return up.run(args.state_dir, args.config, quiet=args.quiet)


def _completion(args: argparse.Namespace) -> int:
    import shtab

    sys.stdout.write(shtab.complete(_parser(), shell=args.shell))
    sys.stdout.flush()
    return EXIT_OK


def _agent_command(args: argparse.Namespace) -> int:
    if args.command == "run":
        from supervisor import run

        return run.run(args.config, args.state_dir, args.agents, args.timeout_s)
    from broker.statedir import StateDir
    from supervisor import agentcli

    state_dir = StateDir.resolve(args.state_dir)
    if args.command == "spawn" and args.host is not None:  # fleet placement
        from supervisor.fleet import ctl

        return ctl.remote_spawn(state_dir, os.environ.get("CORRAL_FLEET_CONFIG"),
                                     args.name, args.task, args.model, host=args.host,
                                     as_json=args.json)
    if args.command == "spawn":
        return agentcli.spawn(state_dir, args.name, args.task, args.model, as_json=args.json)
    if args.command == "resume":
        return agentcli.resume(state_dir, args.agent, args.budget, args.cost_units,
                               args.request_id)
    if args.command in ("rewind", "fork"):
        from supervisor import treecli

        if args.command == "rewind":
            return treecli.rewind(state_dir, args.ref, to_turn=args.to_turn,
                                  to_seq=args.to_seq, as_json=args.json)
        return treecli.fork(state_dir, args.ref, args.name, at_turn=args.at_turn,
                            as_json=args.json)
    if args.command == "answer":
        return agentcli.answer(state_dir, args.agent, args.request, args.text, args.file)
    if args.command == "correct":
        return agentcli.correct(state_dir, args.agent, args.text, args.file)
    return agentcli.approve(state_dir, args.agent, args.request, deny=args.command == "deny",
                            always=getattr(args, "always", False), note=args.note)


def _status(args: argparse.Namespace) -> int:
    # The fast path (docs/supervisor.md): no pydantic, no broker.protocol; the
    # reply is checked by supervisor/statusclient.py.
    from broker.statedir import StateDir

    if args.fleet:  # docs/fleet.md: every host, from the KV bucket
        from supervisor.fleet import ctl

        return ctl.print_fleet_status(StateDir.resolve(args.state_dir),
                                           os.environ.get("CORRAL_FLEET_CONFIG"), args.json)
    from supervisor import client, statusclient, statusview
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


def _control(args: argparse.Namespace) -> int:
    from supervisor import ctlcli

    target = getattr(args, "target", None) or ""
    if ":" in target and args.command in ("kill", "stop", "start"):  # HOST:AGENT (fleet)
        from broker.statedir import StateDir
        from supervisor.fleet import ctl

        return ctl.remote_control(StateDir.resolve(args.state_dir),
                                       os.environ.get("CORRAL_FLEET_CONFIG"), args.command,
                                       target, sig=getattr(args, "signal", 15),
                                       as_json=args.json)

    return ctlcli.run(args)


def _logs(args: argparse.Namespace) -> int:
    from broker.statedir import StateDir
    from supervisor import logs

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


def _trace(args: argparse.Namespace) -> int:
    from broker.errors import CorralError
    from broker.statedir import StateDir, check_actor_name
    from supervisor import trace

    try:
        check_actor_name(args.agent)
    except CorralError as exc:
        print(f"{PROG}: trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return trace.run(StateDir.resolve(args.state_dir), args.agent, since=args.since,
                     follow=args.follow, json_out=args.json)


def _console(args: argparse.Namespace) -> int:
    from supervisor.console import serve

    return serve.run(args)


def _storage(args: argparse.Namespace) -> int:
    from supervisor import storagecli

    return storagecli.run(args)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": _up,
    "status": _status,
    "kill": _control,
    "restart": _control,
    "start": _control,
    "stop": _control,
    "remove": _control,
    "reload": _control,
    "logs": _logs,
    "trace": _trace,
    "run": _agent_command,
    "spawn": _agent_command,
    "approve": _agent_command,
    "deny": _agent_command,
    "resume": _agent_command,
    "rewind": _agent_command,
    "fork": _agent_command,
    "answer": _agent_command,
    "correct": _agent_command,
    "completion": _completion,
    "du": _storage,
    "gc": _storage,
    "pipeline": _pipeline_command,
    "registry": _pipeline_command,
    "sessions": sessionscli.run,
    "console": _console,
}


if __name__ == "__main__":
    sys.exit(main())
