"""The supervisor's status hooks: optional parts (the fleet's host) that see
the status at every round (what `supervisor status --json` shows). With the
part off its module is never imported: this is the one place that decides
(docs/decisions.md, "Optional parts plug in through named hooks")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from broker.statedir import StateDir
    from supervisor.config import Config


class StatusHook(Protocol):
    def update(self, status: dict[str, Any]) -> None:
        """The status of this round (never blocks the supervisor's loop)."""
        ...

    def close(self) -> None: ...


def status_hooks(config: Config, state_dir: StateDir) -> list[StatusHook]:
    """The started status hooks the configuration turns on."""
    found: list[StatusHook] = []
    if config.fleet.enabled:
        from supervisor.fleet.host import fleet_host  # noqa: PLC0415 - fleet mode only

        host = fleet_host(config.fleet, state_dir)
        if host is not None:
            found.append(host)
    return found
