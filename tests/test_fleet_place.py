"""Placement through the hosts' queue group (docs/fleet.md, "Placement"): the
host NATS hands a placement to accepts it only when it is a least-loaded live
host (its own agents, with the ones it accepted since its last status, at
most every other live host's) and below `fleet.max_agents`; else it declines
naming the least-loaded host it sees. The process-level placement is in
tests/test_fleet_hosts.py."""

from __future__ import annotations

from typing import Any

from supervisor.fleet.place import agents_of, decide


def _host(name: str, agents: int, *, stale: bool = False, dead: bool = False,
          expired: bool = False, stopped: int = 0) -> dict[str, Any]:
    children = [{"name": "writer", "kind": "writer", "state": "running"}]
    children += [{"name": f"{name}-a{i}", "kind": "agent", "state": "running"}
                 for i in range(agents)]
    children += [{"name": f"{name}-s{i}", "kind": "agent", "state": "stopped"}
                 for i in range(stopped)]
    return {"host": name, "stale": stale or dead or expired, "dead": dead,
            "age_s": None if dead or expired else 1.0, "children": children}


def test_only_a_least_loaded_host_accepts() -> None:
    view = [_host("h1", 2), _host("h2", 1, stopped=3), _host("h3", 1)]
    assert agents_of(view[1]["children"]) == {"h2-a0"}  # stopped agents are no load
    assert decide("h1", {"x", "y"}, view, 0) == (False, "load 2, h2 has 1", "h2")
    assert decide("h2", {"x"}, view, 0)[0] is True  # a tie accepts
    # its own count includes what it accepted since its status: now it is busier
    assert decide("h2", {"x", "just-placed"}, view, 0) == (False, "load 2, h3 has 1", "h3")


def test_expired_and_dead_hosts_do_not_count_and_a_full_host_declines() -> None:
    view = [_host("h1", 3), _host("h2", 0, expired=True), _host("h3", 0, dead=True)]
    assert decide("h1", {"a", "b", "c"}, view, 0)[0] is True  # the others are not there
    assert decide("h1", {"a", "b", "c"}, view, 3) == (
        False, "full: 3 agents, max_agents 3", None)
    assert decide("h1", set(), [], 0) == (True, "load 0", None)  # alone in the fleet
    # a stale host (a slow status round) still counts: a busier host declines
    assert decide("h1", {"a"}, [_host("h1", 1), _host("h2", 0, stale=True)], 0) == (
        False, "load 1, h2 has 0", "h2")


def test_an_unreadable_entry_makes_a_host_decline() -> None:
    unread = {"host": "h2", "age_s": None, "stale": True, "dead": False,
              "unreadable": "TimeoutError", "children": []}
    assert decide("h1", set(), [_host("h1", 0), unread, _host("h3", 2)], 0) == (
        False, "the view could not read h2", "h3")
