"""What a command module declares: its `Command`s, each a parser and a handler.

Standard library only, and light (a NamedTuple, not a dataclass: `dataclasses`
imports `inspect`): every run of `supervisor` loads it. The exit codes and
the argument types the commands share live here too. See docs/supervisor.md
("Code layout").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple

PROG = "supervisor"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_SUPERVISOR = 3
EXIT_NO_ANSWER = 4


class Parents(NamedTuple):
    """The argument groups a command's parser may inherit."""

    common: argparse.ArgumentParser  # --state-dir
    as_json: argparse.ArgumentParser  # --json


class Command(NamedTuple):
    """One top-level command. `add(sub, parents)` adds its parser (named `name`)
    to the subparsers; `run(args)` does it and returns the exit code. A command
    that parses its own arguments (`wal`, `fleet`) has `run_argv` instead: it is
    handed the words after its name."""

    name: str
    add: Callable[[Any, Parents], None]
    run: Callable[[argparse.Namespace], int] | None = None
    run_argv: Callable[[list[str]], int] | None = None


def positive(text: str) -> float:
    """A number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0")
    return value


def seq(text: str) -> int:
    """A WAL seq: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a WAL seq (a whole number >= 1)")
    return int(text)
