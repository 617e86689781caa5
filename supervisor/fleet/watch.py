"""Host loss: declaring a silent host dead and fencing it.

See docs/fleet.md ("Declaring a host dead", "Fencing").
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from broker.statedir import StateDir
from supervisor.fleet.natsclient import MEMBERS_BUCKET
from supervisor.fleet.replicate import fence_subject, stream_name
from supervisor.fleet.view import keys_of, least_loaded

log = structlog.get_logger("supervisor.fleet")

MEMBERS = MEMBERS_BUCKET
MAX_FENCER_HOPS = 16  # a chain of fencers that died before adopting, followed this far


async def members_bucket(js: Any, replicas: int) -> Any:
    from nats.js.api import KeyValueConfig, StorageType  # noqa: PLC0415
    from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

    try:
        return await js.key_value(MEMBERS)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(
            bucket=MEMBERS, history=1, replicas=replicas, storage=StorageType.FILE))


async def fence_host(js: Any, dead: str, by: str) -> bool:
    """Append the fence to `dead`'s stream if nobody else did first; True if ours
    was stored (or the stream was already fenced by `by`)."""
    from nats.js.errors import APIError, NotFoundError  # noqa: PLC0415

    stream = stream_name(dead)
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return False  # it never wrote: nothing to fence (its writer creates the stream)
    last = int(info.state.last_seq)
    if last:
        msg = await js.get_msg(stream, last)
        fenced = (msg.headers or {}).get("Corral-Fence")
        if fenced is not None:
            return bool(fenced.startswith(f"by {by} "))
    try:
        await js.publish(fence_subject(dead), b"", stream=stream, headers={
            "Corral-Fence": f"by {by} at {time.time():.3f}",
            "Nats-Expected-Last-Sequence": str(last)})
    except APIError as exc:
        log.info("fleet_fence_lost_race", host=dead, error=str(exc)[:200])
        return False
    return True


class Watch:
    """Per host supervisor: registration, and the dead-host check."""

    def __init__(self, host: str, grace_s: float, replicas: int,
                 state_dir: StateDir | None = None) -> None:
        self.host = host
        self.state_dir = state_dir
        self.grace_s = grace_s
        self.replicas = replicas
        self.members: Any = None
        self.missing_since: dict[str, float] = {}
        self.registered = False
        self.declared: list[str] = []

    async def register(self, js: Any) -> bool:
        """Register this host; False if the fleet declared it dead (fenced)."""
        from nats.js.errors import KeyNotFoundError  # noqa: PLC0415

        self.members = await members_bucket(js, self.replicas)
        try:
            entry = await self.members.get(self.host)
            if json.loads(entry.value or b"{}").get("dead"):
                log.error("fleet_host_declared_dead", host=self.host,
                          detail="fenced by the fleet: start it under a new host name")
                return False
        except KeyNotFoundError:
            pass
        await self.members.put(self.host, json.dumps(
            {"host": self.host, "since": time.time()}).encode())
        self.registered = True
        return True

    async def check(self, js: Any, hosts_kv: Any, hosts: list[dict[str, Any]]) -> None:
        """Declare dead (and fence) the members silent for longer than the grace."""

        if not self.registered:
            return
        now = time.monotonic()
        live = await keys_of(hosts_kv)
        for member in await keys_of(self.members):
            if member == self.host or member in live:
                self.missing_since.pop(member, None)
                continue
            entry = await self.members.get(member)
            data = json.loads(entry.value or b"{}")
            if data.get("dead"):
                if "adopted_at" not in data and await self._adopts(data):
                    await self._adopt(js, member, data)
                continue
            since = self.missing_since.setdefault(member, now)
            if now - since < self.grace_s:
                continue
            order = least_loaded(hosts)
            if not order or order[0] != self.host:
                continue  # another live host adopts
            if await fence_host(js, member, self.host):
                data = {"host": member, "dead": True, "fenced_by": self.host,
                        "at": time.time()}
                await self.members.put(member, json.dumps(data).encode())
                self.declared.append(member)
                log.warning("fleet_host_declared_dead", host=member, fenced_by=self.host,
                            expired_s=round(now - since, 1))
                await self._adopt(js, member, data)

    async def _adopts(self, data: dict[str, Any]) -> bool:
        """Whether this host adopts a dead member not yet adopted: it fenced it,
        or it is the live end of the chain of fencers (the member's fencer died
        before it adopted and was fenced in turn, and so on; docs/fleet.md,
        "Declaring a host dead"). Each dead fencer on the way must have adopted
        its own agents first, so an agent it had adopted resumes from its
        stream, the newer, and the older copy finds its name taken."""
        fencer = data.get("fenced_by")
        for _hop in range(MAX_FENCER_HOPS):
            if fencer == self.host:
                return True
            if not isinstance(fencer, str) or not fencer:
                return False
            try:
                entry = json.loads((await self.members.get(fencer)).value or b"{}")
            except Exception:  # noqa: BLE001 - gone or unreadable: not ours this round
                return False
            if not entry.get("dead") or "adopted_at" not in entry:
                return False  # the fencer lives (it adopts), or has not adopted its own yet
            fencer = entry.get("fenced_by")
        return False

    async def _adopt(self, js: Any, member: str, data: dict[str, Any]) -> None:
        """Adopt the fenced member's agents here, then mark it `adopted`."""
        if self.state_dir is None:
            return
        from supervisor.fleet.adopt import adopt_host  # noqa: PLC0415

        adopted = await adopt_host(js, member, self.state_dir, self.replicas)
        await self.members.put(member, json.dumps(
            {**data, "adopted_at": time.time(),
             "adopted": [a.agent for a in adopted if a.spawned],
             "not_adopted": [a.agent for a in adopted if not a.spawned]}).encode())
