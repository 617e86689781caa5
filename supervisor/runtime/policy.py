"""Restart decisions: pure functions over one child's history of exits.

No I/O, no clock, no randomness of its own. See docs/supervisor.md
("Start, stop, restart").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

RestartKind = Literal["permanent", "transient", "temporary"]


@dataclass(frozen=True)
class Policy:
    """A child's restart policy, as the configuration states it."""

    restart: RestartKind = "permanent"
    max_restarts: int = 5
    period_s: float = 60.0
    base_s: float = 0.5
    cap_s: float = 30.0
    jitter: float = 0.1
    fatal_exit_codes: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Exit:
    """One exit of a child: its return code or the signal that ended it."""

    at_s: float
    code: int | None = None
    signal: int | None = None
    requested: bool = False  # the supervisor asked for it (restart request)

    @property
    def normal(self) -> bool:
        return self.signal is None and self.code == 0


@dataclass(frozen=True)
class Restart:
    delay_s: float


@dataclass(frozen=True)
class Stay:
    """Leave the child exited: its policy does not restart it."""

    reason: str


@dataclass(frozen=True)
class GiveUp:
    """The child is fatal: it will not be restarted until the operator acts."""

    reason: str


Decision = Restart | Stay | GiveUp


def counted_exits(policy: Policy, history: Sequence[Exit], now_s: float) -> int:
    """Exits within the intensity window that count against the child."""
    start = now_s - policy.period_s
    return sum(1 for e in history if not e.requested and e.at_s > start)


def backoff_delay_s(policy: Policy, counted: int, rand: float) -> float:
    """Delay before the restart after the `counted`-th exit in the window."""
    if counted <= 1:
        return 0.0
    raw = min(policy.cap_s, policy.base_s * 2.0 ** min(counted - 2, 64))
    spread = 1.0 + policy.jitter * (2.0 * rand - 1.0)
    return max(0.0, min(policy.cap_s, raw * spread))


def decide(policy: Policy, history: Sequence[Exit], now_s: float, rand: float) -> Decision:
    """What to do after the last exit in `history` (which must not be empty)."""
    if not history:
        raise ValueError("decide() needs at least one exit")
    last = history[-1]
    if last.requested:
        return Restart(0.0)
    if last.signal is None and last.code in policy.fatal_exit_codes:
        return GiveUp(f"exit code {last.code} is fatal for this child")
    if policy.restart == "temporary":
        return Stay("temporary child")
    if policy.restart == "transient" and last.normal:
        return Stay("transient child exited normally")
    counted = counted_exits(policy, history, now_s)
    if counted > policy.max_restarts:
        return GiveUp(
            f"{counted} exits within {policy.period_s:g}s exceed max_restarts "
            f"{policy.max_restarts}"
        )
    return Restart(backoff_delay_s(policy, counted, rand))


def trim(policy: Policy, history: Sequence[Exit], now_s: float, keep: int = 8) -> list[Exit]:
    """The part of the history that can still matter (bounded memory): the
    last exit, and the newest counted exits of the window (requested exits
    do not count, so a run of operator restarts must not push crashes out)."""
    start = now_s - policy.period_s
    recent = [e for e in history if e.at_s > start]
    room = max(keep, policy.max_restarts + 2) - 1  # > max_restarts: enough to give up
    counted = [i for i, e in enumerate(recent) if not e.requested][-room:]
    chosen = set(counted) | ({len(recent) - 1} if recent else set())
    return [e for i, e in enumerate(recent) if i in chosen]
