"""The fleet view: every host's status entry and the members' marks, read
from the KV buckets by operators' commands and hosts alike. See docs/fleet.md
("One view").
"""

from __future__ import annotations

import json
import time
from typing import Any

from supervisor.fleet.natsclient import HOSTS_BUCKET, MEMBERS_BUCKET, kv_entries


async def keys_of(kv: Any) -> set[str]:
    """The bucket's live keys, from its stream's per-subject state and a direct
    get of each (broker/natsclient.kv_entries), never from nats-py's `keys()`:
    that runs a watcher, an ephemeral consumer made and deleted per call, and
    the view is read every status round by every host, each second by every
    bridge and by every `status --fleet`; on a loaded cluster that churn ended
    in "maximum consumers limit reached" (a CI run). The watcher could also
    answer "no keys" for a bucket that has keys, which made every live host
    look silent (and a silent host gets fenced)."""
    return set(await kv_entries(kv._js, kv._name))  # the bucket's own context


async def read_hosts(js: Any, ttl_s: float) -> list[dict[str, Any]]:
    """Every host's last status entry, with its age; then the members whose entry
    has expired: declared dead (`dead`, `fenced_by`) or not yet (`expired`)."""
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError  # noqa: PLC0415

    hosts: list[dict[str, Any]] = []
    try:
        kv = await js.key_value(HOSTS_BUCKET)
    except BucketNotFoundError:
        return hosts
    for key in sorted(await keys_of(kv)):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue  # expired meanwhile: listed below as a member whose entry expired
        except Exception as exc:  # noqa: BLE001 - a read that failed (a timeout under load)
            # not "expired": a host whose entry could not be read is not known silent
            hosts.append({"host": key, "age_s": None, "stale": True, "dead": False,
                          "unreadable": type(exc).__name__, "children": []})
            continue
        if entry is None:
            continue
        data = json.loads(entry.value or b"{}")
        age = time.time() - float(data.get("at", 0))
        hosts.append({"host": key, "age_s": round(age, 1), "stale": age > ttl_s / 2,
                      "dead": False, "children": data.get("children", []),
                      "supervisor_pid": data.get("supervisor_pid")})
    try:
        members = await js.key_value(MEMBERS_BUCKET)
    except BucketNotFoundError:
        return hosts
    seen = {h["host"] for h in hosts}
    for key in sorted(await keys_of(members) - seen):
        try:
            data = json.loads((await members.get(key)).value or b"{}")
        except Exception:  # noqa: BLE001 - deleted meanwhile
            data = {}
        if data.get("dead"):
            hosts.append({"host": key, "age_s": round(time.time() - data.get("at", 0), 1),
                          "stale": True, "dead": True, "fenced_by": data.get("fenced_by"),
                          "children": []})
        elif data:  # a member whose entry expired, not (yet) declared dead
            hosts.append({"host": key, "age_s": None, "stale": True, "dead": False,
                          "expired": True, "children": []})
    return hosts


def least_loaded(hosts: list[dict[str, Any]]) -> list[str]:
    """Live hosts, fewest agents not stopped first (ties by name)."""
    def load(host: dict[str, Any]) -> int:
        return sum(1 for c in host["children"] if c.get("kind") == "agent"
                   and c.get("state") not in ("stopped", "exited", "fatal"))
    live = [h for h in hosts if not h["stale"] and not h.get("dead")]
    return [h["host"] for h in sorted(live, key=lambda h: (load(h), h["host"]))]
