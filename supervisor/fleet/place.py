"""Placement through a NATS queue group of host supervisors (docs/fleet.md,
"Placement").

`supervisor spawn NAME --task FILE --host auto` sends one signed request
(ctl.sign, addressed to host `auto`) to the subject `corral.place`,
where every live host supervisor is a member of the queue group
`corral-placers`: NATS hands it to exactly one of them. That host *accepts*
only when it is a least-loaded host: its own load (the agents its
supervisor runs, plus the ones it accepted since its last status round, so
two placements in a row are counted) is at most that of every other host
whose status entry is in the fleet view (not expired, not dead: a stale
one counts, so that a slow status round does not make a busier host accept;
an entry the view could not read makes it decline, its load unknown), and
below `fleet.max_agents` when that is set. Then it spawns
the agent through its own control socket (ctl.carry_out, as a direct
`--host HOST` spawn does) and answers `{"ok": true, "host": ..., "placed":
true}`; else it answers `declined`, naming the least-loaded host it sees.
Each host also takes placements on its own subject `corral.place.<host>`,
under the same rule: the client's next attempt after a decline goes there
(the named host checks again with its own count), so a placement does not
depend on NATS picking the right member of the group by chance. A host's
placements are handled one after the other (one lock), so its count is
exact; two hosts deciding at once may both accept (each is least-loaded in
the view it read): placement is a balance, not a quota.

After `ATTEMPTS` declines, or when no host is in the group, the client falls
back to the fleet view (ctl.least_loaded: the hosts in load order, each
asked directly on its control subject).
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
