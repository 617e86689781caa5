"""The writer's hooks: optional parts (the fleet's replication) that see every
durable batch before it is acknowledged. The writer loads them by name
(`--hook MODULE`, broker/hooks.py); a hook module defines `add_arguments` and
`writer_hook(args, state_dir) -> WriterHook | None`.

A hook's `after_durable` runs on the sync worker's thread, after the batch's
fdatasync and before its acks: while it blocks nothing is acknowledged, and
when it raises a `DurabilityError` nothing of the batch is. A writer with a
hook passes its recovered tail through it (an empty batch) before it answers a
retry of a recovered record. `HaltedError` stops the writer for good: exit 77.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from broker.errors import DurabilityError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

EXIT_HALTED = 77  # a hook said this writer may acknowledge nothing more (fleet: fenced)


class HaltedError(DurabilityError):
    """A hook refuses every later batch (the fleet: another host adopted this one's agents)."""


class WriterHook(Protocol):
    def start(self) -> None:
        """After recovery, before the writer answers."""
        ...

    def after_durable(self, first_seq: int, lines: list[bytes]) -> None:
        """Records first_seq.. are on the local disk; return once they may be acknowledged."""
        ...

    def stopping(self, grace_s: float) -> None:
        """The writer stops: a batch still waiting may fail after `grace_s`."""
        ...

    def close(self) -> None: ...

    def values(self) -> dict[str, int | float]:
        """The hook's counters, in the writer's statistics."""
        ...


def after_durable(hooks: Sequence[WriterHook]) -> Callable[[int, list[bytes]], None] | None:
    """One callable running every hook's `after_durable` in order (None: no hooks)."""
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0].after_durable

    def run(first_seq: int, lines: list[bytes]) -> None:
        for hook in hooks:
            hook.after_durable(first_seq, lines)
    return run
