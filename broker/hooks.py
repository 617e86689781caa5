"""Optional parts attached to a process by name (docs/decisions.md, "Optional
parts plug in through named hooks").

A process main takes `--hook MODULE` (repeatable). Only then is the module
imported, so a process started without it never loads its code. A hook module
defines `add_arguments(parser)` (its own options) and the factory the process
asks for: the writer's `writer_hook` (actors/writer/hooks.py), the broker's
`route_hook` (`RouteHook` below). The broker's route hook sees only the frames
for names the broker has no local route for.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from broker.errors import ConfigError

if TYPE_CHECKING:
    import zmq

    from broker.protocol import ErrorCode


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hook", action="append", default=[], metavar="MODULE",
                        help="attach an optional part by its module (e.g. the fleet's)")


def load(argv: list[str] | None, parser: argparse.ArgumentParser) -> list[ModuleType]:
    """The hook modules `argv` names, imported, their options added to `parser`."""
    early = argparse.ArgumentParser(add_help=False)
    add_argument(early)
    names: list[str] = early.parse_known_args(argv)[0].hook
    modules = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"hook {name!r} cannot be imported: {exc}") from exc
        adder = getattr(module, "add_arguments", None)
        if adder is not None:
            adder(parser)
        modules.append(module)
    return modules


def factories(modules: list[ModuleType], name: str) -> list[Callable[..., Any]]:
    """Each module's factory called `name` (a module without one is skipped)."""
    return [f for module in modules if (f := getattr(module, name, None)) is not None]


@dataclass(frozen=True)
class Refusal:
    """A frame the route hook took and refused: the sender gets this error."""

    code: ErrorCode
    detail: str


@dataclass(frozen=True)
class Local:
    """The name stands for this local peer (the broker delivers it)."""

    name: bytes


class Forwarded:
    """The route hook took the frame on its way elsewhere."""


FORWARDED = Forwarded()


class RouteHook(Protocol):
    """Where the names with no local route may go (the fleet's bridge)."""

    # frames from elsewhere for local peers, `[to, sender, body]`, read by the loop
    inbox: zmq.Socket[bytes]

    def route(self, sender: bytes, to: bytes, body: bytes) -> Local | Refusal | Forwarded | None:
        """None: not the hook's (the broker answers as it would without it)."""
        ...

    def undeliverable(self, to: bytes, sender: bytes, body: bytes, code: ErrorCode) -> None:
        """A frame from `inbox` the broker could not deliver to `to`."""
        ...

    def values(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...
