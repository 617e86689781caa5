"""The part every process main shares: the common options, the state directory
and the log, a stop requested by SIGTERM/SIGINT, and an orderly end with an
exit code (close steps run in reverse order; a known exception mapped to its
code, logged and said in one line on stderr).

The writer, the broker, procs, subagents and the agent use it; the zygote
does not (its forked children do). See docs/architecture.md ("Processes").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from broker import logconfig
from broker.errors import ConfigError, StateDirError
from broker.statedir import StateDir

if TYPE_CHECKING:
    import structlog
    import zmq

    class LogSettings(Protocol):
        """The logging options (add_arguments' or an agent's AgentOptions)."""

        @property
        def log_level(self) -> str: ...
        @property
        def log_max_bytes(self) -> int: ...
        @property
        def log_backups(self) -> int: ...


EXIT_OK = 0
EXIT_CONFIG = 78  # the options, the configuration or the state directory is unusable


def _error_field(exc: BaseException) -> Mapping[str, object]:
    return {"error": str(exc)}


class Exit:
    """How an exception of `errors` ends a process: `code`, the `event`
    logged (once logging is set up; None: not logged) with `fields(exc)`,
    and `says` (formatted with `exc`) on stderr after "<name>: ". A plain
    class, not a dataclass: it is made at every start."""

    __slots__ = ("code", "errors", "event", "fields", "says", "traceback")

    def __init__(self, errors: type[BaseException] | tuple[type[BaseException], ...],
                 code: int, event: str | None = None, says: str = "{exc}",
                 fields: Callable[[Any], Mapping[str, object]] = _error_field, *,
                 traceback: bool = False) -> None:
        self.errors = errors
        self.code = code
        self.event = event
        self.says = says
        self.fields = fields
        self.traceback = traceback  # log.exception rather than log.error


# what every main refuses before it runs: its options, its state directory
CONFIG_EXITS: tuple[Exit, ...] = (Exit((ConfigError, StateDirError), EXIT_CONFIG),)


def add_arguments(parser: argparse.ArgumentParser, *, binds: bool = False,
                  hooks: bool = False) -> None:
    """--state-dir and the logging options; with `binds` the CURVE and tcp://
    options (broker/curve.py), with `hooks` --hook (broker/hooks.py)."""
    parser.add_argument("--state-dir", default=None, help="state directory (default ./.corral)")
    if binds:
        from broker import curve  # noqa: PLC0415 - zmq.auth only where it serves

        curve.add_arguments(parser)
    logconfig.add_arguments(parser)
    if hooks:
        from broker import hooks as hook_loader  # noqa: PLC0415

        hook_loader.add_argument(parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, *,
               hooks: bool = False) -> tuple[argparse.Namespace, list[ModuleType]]:
    """The options, and with `hooks` the `--hook` modules (imported first:
    they add their own options). A hook that cannot be imported: ConfigError."""
    modules: list[ModuleType] = []
    if hooks:
        from broker import hooks as hook_loader  # noqa: PLC0415

        modules = hook_loader.load(argv, parser)
    return parser.parse_args(argv), modules


class Stop:
    """A stop requested by SIGTERM or SIGINT: `stopped` is set and `then`
    called (in the handler: keep it to setting a flag). With `wakeup`, each
    signal also writes a byte to a pipe whose `read_fd` a loop polls, so it
    wakes at once; with `children` SIGCHLD does too (a child exited).
    `close()` restores the wakeup fd and SIGCHLD; SIGTERM and SIGINT keep
    requesting a stop until the process exits."""

    def __init__(self, then: Callable[[], None] | None = None, *, wakeup: bool = False,
                 children: bool = False) -> None:
        self.stopped = False
        self._then = then
        self._children = children
        self.read_fd = self._write_fd = -1
        if wakeup:
            self.read_fd, self._write_fd = os.pipe()
            os.set_blocking(self.read_fd, False)
            os.set_blocking(self._write_fd, False)
            signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)
        if children:
            signal.signal(signal.SIGCHLD, self._child)

    def _request(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopped = True
        if self._then is not None:
            self._then()

    def _child(self, _signum: int, _frame: FrameType | None) -> None:
        pass  # the byte in the pipe is the point: the loop reaps

    def drain(self) -> None:
        """Empty the wakeup pipe (after a poll found it readable)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.read_fd, 4096):
                pass

    def close(self) -> None:
        if self._children:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if self.read_fd >= 0:
            signal.set_wakeup_fd(-1)
            os.close(self.read_fd)
            os.close(self._write_fd)
            self.read_fd = self._write_fd = -1


class Process:
    """One process's life: `run(body)` returns body's exit code after the
    close steps (`on_close`) have run, last registered first; an exception
    of `exits` ends it with that entry's code instead, any other is raised
    (after the close steps)."""

    def __init__(self, name: str, exits: Sequence[Exit] = CONFIG_EXITS) -> None:
        self.name = name
        self.exits = tuple(exits)
        self.log: structlog.stdlib.BoundLogger | None = None  # once configure_logging ran
        self._steps = contextlib.ExitStack()

    def state_dir(self, path: str | None) -> StateDir:
        """The state directory, made if absent (StateDirError: unusable)."""
        return StateDir.at(path).ensure()

    def configure_logging(self, state: StateDir, settings: LogSettings, *,
                          console: bool | None = None) -> structlog.stdlib.BoundLogger:
        """JSON lines to logs/<name>.log (broker/logconfig.py)."""
        self.log = logconfig.configure(
            self.name, state.log_path(self.name), level=settings.log_level,
            max_bytes=settings.log_max_bytes, backups=settings.log_backups, console=console)
        return self.log

    def stop_on_signals(self, then: Callable[[], None] | None = None, *, wakeup: bool = False,
                        children: bool = False) -> Stop:
        """A Stop (above), closed with the process."""
        stop = Stop(then, wakeup=wakeup, children=children)
        self.on_close(stop.close)
        return stop

    def context(self) -> zmq.Context[zmq.Socket[bytes]]:
        """The process's ZeroMQ context, destroyed (linger 0) with it."""
        import zmq  # noqa: PLC0415 - every caller has it loaded already

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.on_close(lambda: ctx.destroy(linger=0))
        return ctx

    def on_close(self, step: Callable[[], object]) -> None:
        """Run `step` when the process ends, before the steps registered earlier."""
        self._steps.callback(step)

    def refuse(self, exc: BaseException | str, code: int = EXIT_CONFIG) -> int:
        """One line on stderr, "<name>: <exc>"; `code`."""
        print(f"{self.name}: {exc}", file=sys.stderr)
        return code

    def run(self, body: Callable[[], int]) -> int:
        with self._steps:
            try:
                return body()
            except BaseException as exc:
                for entry in self.exits:
                    if isinstance(exc, entry.errors):
                        return self._exit(entry, exc)
                raise

    def _exit(self, entry: Exit, exc: BaseException) -> int:
        if entry.event is not None and self.log is not None:
            if entry.traceback:
                self.log.exception(entry.event, **entry.fields(exc))
            else:
                self.log.error(entry.event, **entry.fields(exc))
        return self.refuse(entry.says.format(exc=exc), entry.code)
