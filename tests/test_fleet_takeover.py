"""Who adopts a dead host whose fencer died before it adopted (supervisor/
fleet_watch.py `Watch.check`): the live end of the chain of fencers, once every
dead fencer on the way has adopted its own agents. Found by the fleet soak
(ops/soak.py --hosts 3 --fencer-kill-chance 1): host A killed, host B fences
it and is killed before it adopts, host C fences B and adopts B's agents, and
A's agents were adopted by nobody, ever (A's member stayed `dead` without
`adopted_at`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from supervisor.fleet import watch as fleet_watch
from supervisor.fleet.watch import Watch


@dataclass
class _Entry:
    value: bytes


class _Members:
    """The members bucket: get and put only."""

    def __init__(self, entries: dict[str, dict[str, Any]]) -> None:
        self.entries = entries

    async def get(self, key: str) -> _Entry:
        if key not in self.entries:
            raise KeyError(key)
        return _Entry(json.dumps(self.entries[key]).encode())

    async def put(self, key: str, value: bytes) -> None:
        self.entries[key] = json.loads(value)


class _Watch(Watch):
    def __init__(self, host: str, members: _Members) -> None:
        super().__init__(host, 1.0, 1)
        self.members = members
        self.registered = True
        self.adopted: list[str] = []

    async def _adopt(self, js: Any, member: str, data: dict[str, Any]) -> None:
        self.adopted.append(member)
        await self.members.put(member, json.dumps({**data, "adopted_at": 1.0}).encode())


def _round(monkeypatch: pytest.MonkeyPatch, watch: _Watch, live: set[str]) -> list[str]:
    async def keys_of(kv: Any) -> set[str]:
        return set(watch.members.entries) if kv is watch.members else live

    monkeypatch.setattr(fleet_watch, "keys_of", keys_of)
    asyncio.run(watch.check(None, object(), []))
    return watch.adopted


def dead(by: str, adopted: bool = False) -> dict[str, Any]:
    return {"dead": True, "fenced_by": by, "at": 0.0, **({"adopted_at": 1.0} if adopted else {})}


def test_the_fencers_fencer_adopts_once_the_fencer_is_adopted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    members = _Members({"a": dead("b"), "b": dead("c"), "c": {"host": "c"}})
    watch = _Watch("c", members)
    # c fenced b and adopts it first (b's copy of an agent it took from a is the newer),
    # then a (in the same round or the next, as the bucket lists them)
    _round(monkeypatch, watch, {"c"})
    _round(monkeypatch, watch, {"c"})
    assert watch.adopted == ["b", "a"]
    assert "adopted_at" in members.entries["a"]


def test_a_chain_of_dead_fencers_is_followed_to_the_live_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    members = _Members({"a": dead("b"), "b": dead("d", adopted=True),
                        "d": dead("c", adopted=True), "c": {"host": "c"}})
    assert _round(monkeypatch, _Watch("c", members), {"c"}) == ["a"]


def test_nobody_takes_over_from_a_live_fencer_or_one_that_has_not_adopted_yet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # b lives: it adopts a itself (at its next round, if it stopped in between)
    members = _Members({"a": dead("b"), "b": {"host": "b"}, "c": {"host": "c"}})
    assert _round(monkeypatch, _Watch("c", members), {"b", "c"}) == []
    # b dead, fenced by d which has not adopted b yet: c waits, d adopts b first
    members = _Members({"a": dead("b"), "b": dead("d"), "d": {"host": "d"},
                        "c": {"host": "c"}})
    assert _round(monkeypatch, _Watch("c", members), {"c", "d"}) == []
    # a fencer nobody knows, or a cycle: nobody
    members = _Members({"a": dead("x"), "b": dead("e", adopted=True),
                        "e": dead("b", adopted=True), "f": dead("b"), "c": {"host": "c"}})
    assert _round(monkeypatch, _Watch("c", members), {"c"}) == []
