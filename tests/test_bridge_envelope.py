"""The envelope of a frame between hosts (supervisor/fleet/bridge.py), without a cluster:
what `verify` refuses (unsigned, another key, a changed body or name, stale,
replayed, another host's, from this host, oversized) and how the fleet view
resolves a name with no local route."""

from __future__ import annotations

import pytest

from broker import protocol
from broker.hooks import Refusal
from supervisor.fleet.bridge import (
    H_FROM,
    H_TO,
    BusRefusedError,
    Target,
    View,
    bus_key,
    read_view,
    sign,
    verify,
)

KEY = bus_key(b"fleet-secret")
BODY = protocol.encode(protocol.Ping(msg_id="m1"))
NOW = 1_800_000_000.0


def check(headers: dict[str, str], body: bytes = BODY, seen: dict[str, float] | None = None,
          now: float = NOW) -> tuple[str, str]:
    return verify(KEY, "hb", headers, body, {} if seen is None else seen, 1024, now)


def test_a_signed_frame_passes_once() -> None:
    headers = sign(KEY, "ha:probe", "hb:agent-1", BODY, now=NOW)
    seen: dict[str, float] = {}
    assert check(headers, seen=seen) == ("ha:probe", "agent-1")
    with pytest.raises(BusRefusedError, match="replayed"):
        check(headers, seen=seen)


@pytest.mark.parametrize("forge", ["unsigned", "other key", "body", "sender", "recipient"])
def test_a_forged_frame_is_refused(forge: str) -> None:
    headers = sign(bus_key(b"other") if forge == "other key" else KEY, "ha:probe",
                   "hb:agent-1", BODY, now=NOW)
    body = BODY
    if forge == "unsigned":
        headers = {H_FROM: "ha:probe", H_TO: "hb:agent-1"}
    elif forge == "body":
        body = protocol.encode(protocol.Ping(msg_id="m2"))
    elif forge == "sender":
        headers[H_FROM] = "ha:operator"
    elif forge == "recipient":
        headers[H_TO] = "hb:procs"
    with pytest.raises(BusRefusedError):
        check(headers, body)


def test_stale_foreign_own_and_oversized_frames_are_refused() -> None:
    with pytest.raises(BusRefusedError, match="timestamp"):
        check(sign(KEY, "ha:probe", "hb:x", BODY, now=NOW - 31))
    with pytest.raises(BusRefusedError, match="addressed to host"):
        check(sign(KEY, "ha:probe", "hc:x", BODY, now=NOW))
    with pytest.raises(BusRefusedError, match="this host"):
        check(sign(KEY, "hb:probe", "hb:x", BODY, now=NOW))
    with pytest.raises(BusRefusedError, match="HOST:NAME"):
        check(sign(KEY, "ha:no spaces", "hb:x", BODY, now=NOW))
    big = b"x" * 2048
    with pytest.raises(BusRefusedError, match="over the limit"):
        check(sign(KEY, "ha:probe", "hb:x", big, now=NOW), big)


def test_the_view_places_agents_on_live_hosts() -> None:
    hosts = {"ha": {"children": [{"name": "a1", "kind": "agent", "state": "running"},
                                 {"name": "procs", "kind": "procs", "state": "running"}]},
             "hb": {"children": [{"name": "b1", "kind": "agent", "state": "running"},
                                 {"name": "both", "kind": "agent", "state": "running"}]},
             "hc": {"children": [{"name": "both", "kind": "agent", "state": "running"},
                                 {"name": "gone", "kind": "agent", "state": "exited"}]}}
    view = read_view(hosts, {"hd": {"dead": True, "fenced_by": "ha"}, "he": {}},
                     View(last_host={"old": "hd"}))
    assert view.live == {"ha", "hb", "hc"} and view.dead == {"hd": "ha"}
    assert view.silent == {"he"}
    assert view.agents == {"a1": ("ha",), "b1": ("hb",), "both": ("hb", "hc")}
    assert view.last_host["old"] == "hd"  # remembered: a name on a host now dead


def test_resolve() -> None:
    from supervisor.fleet.bridge import Bridge

    bridge = Bridge.__new__(Bridge)
    bridge.host = "ha"
    bridge.unreachable_total = 0
    bridge.view = read_view(
        {"ha": {"children": []},
         "hb": {"children": [{"name": "b1", "kind": "agent", "state": "running"},
                             {"name": "both", "kind": "agent", "state": "running"}]},
         "hc": {"children": [{"name": "both", "kind": "agent", "state": "running"}]}},
        {"hd": {"dead": True, "fenced_by": "hb"}}, View(last_host={"old": "hd"}))
    assert bridge.resolve(b"b1") == Target("hb", "b1")
    assert bridge.resolve(b"hc:x") == Target("hc", "x")
    assert bridge.resolve(b"ha:x") == Target("ha", "x")  # this host: the local route
    assert bridge.resolve(b"nobody") is None  # the broker's own unknown_recipient
    assert bridge.resolve(b"procs") is None  # runtime actors are never looked up elsewhere
    several = bridge.resolve(b"both")
    assert isinstance(several, Refusal) and several.code is protocol.ErrorCode.UNKNOWN_RECIPIENT
    for name, why in ((b"hd:x", "dead"), (b"old", "dead"), (b"hz:x", "no such host")):
        refusal = bridge.resolve(name)
        assert isinstance(refusal, Refusal), name
        assert refusal.code is protocol.ErrorCode.HOST_UNREACHABLE and why in refusal.detail
    bad = bridge.resolve(b"hb:no spaces")
    assert isinstance(bad, Refusal) and bad.code is protocol.ErrorCode.MALFORMED_FRAME
