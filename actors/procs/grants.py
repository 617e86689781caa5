"""Whose grants an agent holds: the operator-created agent at its chain's root.

Privilege comes from what the operator wrote, never from a name an agent
picked. See docs/automation.md ("Grants: what a schedule's run may do and
spend") and docs/decisions.md ("Grants come from the operator's spec, never
from a name").
"""

from __future__ import annotations

from actors.kernel.settings import read_spec
from actors.procs.ownership import owner_of
from broker import auth
from broker.errors import ConfigError
from broker.statedir import StateDir

MAX_CHAIN = 16  # creators followed at most (a longer chain holds nothing)


def creator_of(state_dir: StateDir, name: str) -> str | None:
    """The agent whose grants bound `name`'s; None when the operator created it.
    Raises ConfigError when its spec cannot be read."""
    spec = read_spec(state_dir, name)
    if spec is None:  # an in-process pipeline runner is its agent's; else an idle agent
        owner = owner_of(name)
        return owner if owner != name else None
    return spec.creator or spec.parent_agent


def holder(state_dir: StateDir, name: str) -> str | None:
    """The operator-created agent whose grants `name` has (itself when the
    operator created it); None: no grant at all."""
    seen: set[str] = set()
    current = name
    for _ in range(MAX_CHAIN):
        if current in auth.RESERVED or current in seen:
            return None
        seen.add(current)
        try:
            creator = creator_of(state_dir, current)
        except ConfigError:
            return None
        if creator is None:
            return current
        current = creator
    return None
