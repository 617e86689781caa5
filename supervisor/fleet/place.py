"""Placement through a NATS queue group of host supervisors.

A balance, not a quota. See docs/fleet.md ("Placement") and docs/decisions.md
("Placement through a queue group, each host deciding").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

PLACE_SUBJECT = "corral.place"
PLACE_QUEUE = "corral-placers"
PLACE_HOST = "auto"  # the `host` a placement request is signed for
ATTEMPTS = 4


def place_subject(host: str) -> str:
    """One host's own placement subject (the same rule as the group's)."""
    return f"{PLACE_SUBJECT}.{host}"


def agents_of(children: Iterable[dict[str, Any]]) -> set[str]:
    """The names of the agents a host's status shows running (not stopped)."""
    return {str(c.get("name")) for c in children if c.get("kind") == "agent"
            and c.get("state") not in ("stopped", "exited", "fatal")}


def decide(host: str, own: set[str], view: list[dict[str, Any]],
           max_agents: int) -> tuple[bool, str, str | None]:
    """(accept, why, the least-loaded other host) for a placement on `host`,
    whose agents (with the ones it accepted since its last status) are `own`."""
    unread = sorted(h["host"] for h in view if h["host"] != host and h.get("unreadable"))
    others = [(len(agents_of(h["children"])), h["host"]) for h in view
              if h["host"] != host and h.get("age_s") is not None and not h.get("dead")]
    least = min(others, default=None)
    load = len(own)
    if unread:  # their load is not known: another host (or the next attempt) decides
        return False, f"the view could not read {', '.join(unread)}", \
            least[1] if least else None
    if max_agents and load >= max_agents:
        return False, f"full: {load} agents, max_agents {max_agents}", \
            least[1] if least else None
    if least is not None and least[0] < load:
        return False, f"load {load}, {least[1]} has {least[0]}", least[1]
    return True, f"load {load}", None


async def place(nc: Any, request: Callable[[], bytes],
                timeout_s: float = 10.0) -> dict[str, Any] | None:
    """Ask the queue group (each attempt signed anew: a host refuses a nonce
    it has seen); its answer, else None (every attempt declined, or no host
    in the group)."""
    from nats.errors import NoRespondersError  # noqa: PLC0415
    from nats.errors import TimeoutError as NatsTimeout  # noqa: PLC0415

    from broker.statedir import NAME_PATTERN  # noqa: PLC0415

    subject = PLACE_SUBJECT
    for _ in range(ATTEMPTS):
        try:
            msg = await nc.request(subject, request(), timeout=timeout_s)
        except (TimeoutError, NoRespondersError, NatsTimeout):
            if subject == PLACE_SUBJECT:
                return None  # no host in the group
            subject = PLACE_SUBJECT  # the named host is gone: the group again
            continue
        reply: dict[str, Any] = json.loads(msg.data)
        if reply.get("ok") or reply.get("error") != "declined":
            return reply  # placed, or refused for a reason another host would share
        least = reply.get("least")
        subject = place_subject(least) if isinstance(least, str) and \
            NAME_PATTERN.fullmatch(least) else PLACE_SUBJECT
    return None
