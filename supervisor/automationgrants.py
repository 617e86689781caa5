"""What a schedule's run may do and spend: at most what its owner may.

See docs/automation.md ("Grants: what a schedule's run may do and spend").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from broker import auth
from broker.errors import ConfigError
from broker.statedir import StateDir

if TYPE_CHECKING:
    from actors.writer.client import WriterClient

log = structlog.get_logger("automation")

USAGE_EVENT = "schedule_usage"
CHARGED_EVENT = "schedule_charged"


@dataclass(frozen=True)
class Grant:
    """How a run of a schedule is spawned: `creator` None for the operator's
    schedules; `budget` (tokens, cost_units) the most it may spend."""

    creator: str | None = None
    budget: dict[str, Any] | None = None


class GrantRefusedError(Exception):
    """The schedule's run may not start (the reason is recorded with the slot)."""


def grant_for(writer: WriterClient, state_dir: StateDir, owner: str | None) -> Grant:
    """The grant of a run of a schedule owned by `owner` (raises
    GrantRefusedError: no owner recorded, an owner without a spec, or nothing
    left of its budget)."""
    from actors.kernel.settings import read_spec  # noqa: PLC0415
    from actors.sessions.rebuild import rebuild  # noqa: PLC0415
    from actors.subagents.host import remaining  # noqa: PLC0415

    if owner == auth.OPERATOR:
        return Grant()
    if owner is None:
        raise GrantRefusedError("the schedule records no owner: add it again")
    try:
        spec = read_spec(state_dir, owner)
    except ConfigError as exc:
        raise GrantRefusedError(f"its owner's spec cannot be read: {exc}") from exc
    if spec is None:
        raise GrantRefusedError(f"its owner {owner} has no spec (removed)")
    left = remaining(spec.settings.budget, rebuild(writer, state_dir, owner).state.budget)
    if left.tokens == 0 or left.cost_units == 0:
        raise GrantRefusedError(f"budget: {owner} has no budget left ({left.model_dump()})")
    return Grant(owner, left.model_dump())


class Charges:
    """The runs of agents' schedules whose use is not charged yet."""

    def __init__(self, state_dir: StateDir) -> None:
        self.state_dir = state_dir
        self.due: dict[str, tuple[str, str]] = {}  # run -> (owner, schedule)
        self.cursors: dict[str, int] = {}

    def fired(self, payload: dict[str, Any]) -> None:
        """A `schedule_fired` fact (new, or read back at start)."""
        creator, run = payload.get("creator"), payload.get("agent")
        if payload.get("started") and isinstance(creator, str) and isinstance(run, str):
            self.due[run] = (creator, str(payload.get("schedule")))

    def charged(self, payload: dict[str, Any]) -> None:
        self.due.pop(str(payload.get("run")), None)

    def tick(self, writer: WriterClient) -> None:
        """Charge each due run whose session has ended."""
        from actors.sessions.rebuild import rebuild  # noqa: PLC0415

        for run, (owner, schedule) in list(self.due.items()):
            if not self._ended(writer, run):
                continue
            used = rebuild(writer, self.state_dir, run).state.budget
            payload = {"run": run, "schedule": schedule, "tokens": used.tokens_used,
                       "cost_units": round(used.cost_used, 6)}
            writer.append(f"agent/{owner}", USAGE_EVENT, payload, key=f"usage:{run}")
            writer.append("automation/schedules", CHARGED_EVENT, {**payload, "owner": owner},
                          key=f"charge:{run}")
            del self.due[run]
            log.info("schedule_run_charged", run=run, owner=owner, tokens=used.tokens_used)

    def _ended(self, writer: WriterClient, run: str) -> bool:
        cursor = self.cursors.get(run, 1)
        for record in writer.read_stream(f"agent/{run}", cursor):
            cursor = record.seq + 1
            if record.event == "session_exit":
                self.cursors.pop(run, None)
                return True
        self.cursors[run] = cursor
        return False
