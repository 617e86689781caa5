"""`supervisor`: the parser and the dispatch of corral's operator command line.

Each command module of supervisor/cli/ declares its commands in `COMMANDS`
(supervisor/cli/command.py); `MODULES` names the module of every command, in
`--help`'s order, so a run loads and builds only its own command's parser. A
new command: its `Command` in its module, its name here, its usage line in
`USAGE` (checked against the README by tests/acceptance/test_docs_match.py).
See docs/supervisor.md ("Code layout").
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from broker.statedir import private_umask
from supervisor.cli.command import EXIT_OK, EXIT_USAGE, PROG, Command, Parents

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

# Each module of supervisor/cli/ and the commands its `COMMANDS` declares, in
# `--help`'s order (tests/test_supervisor_cli.py checks the two agree).
MODULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("up", ("up",)),
    ("status", ("status",)),
    ("control", ("kill", "restart", "start", "remove", "stop", "reload")),
    ("logs", ("logs",)),
    ("trace", ("trace",)),
    ("wal", ("wal",)),
    ("fleet", ("fleet",)),
    ("run", ("run",)),
    ("spawn", ("spawn",)),
    ("agents", ("approve", "deny", "answer", "correct", "resume")),
    ("storage", ("du", "gc")),
    ("trees", ("rewind", "fork")),
    ("pipelines", ("pipeline", "registry")),
    ("sessions", ("sessions",)),
    ("console", ("console",)),
    ("completion", ("completion",)),
)
_MODULE_OF = {name: module for module, names in MODULES for name in names}


def version() -> str:
    from supervisor.identity import version as corral_version  # noqa: PLC0415

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


def commands_of(module: str) -> tuple[Command, ...]:
    """The commands supervisor/cli/<module>.py declares (it is imported now)."""
    found: tuple[Command, ...] = importlib.import_module(f"supervisor.cli.{module}").COMMANDS
    return found


def command(name: str) -> Command | None:
    """The command called `name`, its module alone imported; None if unknown."""
    module = _MODULE_OF.get(name)
    if module is None:
        return None
    return next(c for c in commands_of(module) if c.name == name)


def every_command() -> list[Command]:
    return [c for module, _ in MODULES for c in commands_of(module)]


def parser(commands: Iterable[Command] | None = None) -> argparse.ArgumentParser:
    """The command line with the parsers of `commands` (default: every one, for
    help, completion and an unknown command's error)."""
    common = _Parser(add_help=False)
    common.add_argument("--state-dir", default=None,
                        help="state directory (default $CORRAL_STATE_DIR, else ./.corral)")
    as_json = _Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print the result as JSON")
    top = _Parser(prog=PROG, description=USAGE,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action=_Version, nargs=0, help="print corral's version")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND",
                             parser_class=_Parser)
    parents = Parents(common, as_json)
    for each in every_command() if commands is None else commands:
        each.add(sub, parents)
    return top


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
    asked = command(argv[0]) if argv and not argv[0].startswith("-") else None
    if asked is not None and asked.run_argv is not None:
        return asked.run_argv(argv[1:])
    args = parser(None if asked is None else [asked]).parse_args(argv)
    chosen = asked if asked is not None else command(args.command)
    assert chosen is not None  # argparse knows only these
    assert chosen.run is not None  # (a `run_argv` command never gets here)
    return chosen.run(args)

