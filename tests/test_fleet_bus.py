"""A message crosses hosts (docs/fleet.md, "Messages between hosts"): two
corral hosts on the real 3-node cluster, each its own `supervisor up`; an
actor on host A pings host B's agent through A's broker, A's bridge, NATS,
B's bridge and B's broker, and the pong comes back the same way. Frames
published straight onto B's subject are refused unless signed with the
fleet's bus key (unsigned, badly signed, replayed), and a frame for a host
that is unknown, or that went silent, is refused with `host_unreachable`."""

from __future__ import annotations

import asyncio
import secrets
import signal
from typing import Any

import pytest
import zmq

from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.statedir import StateDir
from supervisor.fleet import buskeys
from supervisor.fleet.bridge import bus_key, bus_subject, sign
from tests.fleetkit import Cluster, forget_hosts, operator_key_and_hosts, register_bus_key
from tests.processes import ProcessTracker, wait_for
from tests.test_fleet_hosts import fleet_view, host_config, other_state_dir

__all__ = ["other_state_dir"]  # the fixture, used by name

pytestmark = [pytest.mark.fleet, pytest.mark.process]


def ping(peer: BrokerPeer, to: str) -> protocol.Message:
    return peer.request(to, protocol.Ping(msg_id=f"p{secrets.token_hex(4)}"), timeout_s=2,
                        retries=0)


def pong_or_none(peer: BrokerPeer, to: str) -> protocol.Message | None:
    try:
        return ping(peer, to)
    except (RemoteError, RequestTimeoutError):
        return None  # not in host A's fleet view yet


def refused_by(peer: BrokerPeer, code: str, to: str) -> str | None:
    try:
        ping(peer, to)
    except RemoteError as exc:
        return exc.detail if exc.code == code else None
    except RequestTimeoutError:
        return None
    return None


def bridge_values(peer: BrokerPeer) -> dict[str, Any]:
    stats = peer.request("broker", protocol.StatsRequest(msg_id=f"s{secrets.token_hex(4)}"))
    assert isinstance(stats, protocol.Stats)
    return dict(stats.values)


async def _publish(urls: list[str], subject: str, frames: list[tuple[bytes, dict[str, str]]]
                   ) -> None:
    import nats

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        for body, headers in frames:
            await nc.publish(subject, body, headers=headers or None)
        await nc.flush()
    finally:
        await nc.close()


async def _register(urls: list[str], host: str, public: str) -> bool:
    import nats

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        return await register_bus_key(nc.jetstream(timeout=5), host, public, 3)
    finally:
        await nc.close()


@pytest.mark.timeout(120)  # two hosts, pings both ways, a host going silent (~25 s quiet)
def test_a_message_crosses_hosts_and_a_forged_one_is_refused(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir) -> None:
    fleet_cluster.wait_ready()
    keys, ha, hb = operator_key_and_hosts(state_dir.root)
    hc = f"hc{ha[2:]}"  # a third host, played by the test: its own key, registered first
    key_c = buskeys.load_or_create(other_state_dir.root.parent / "hc" / buskeys.KEY_FILE)
    assert asyncio.run(_register(fleet_cluster.urls, hc, buskeys.public_hex(key_c)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                         "--config", str(host_config(state_dir, ha, fleet_cluster, keys, 0))],
                        name="up-a")
        up_b = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir",
                                str(other_state_dir.root), "--config",
                                str(host_config(other_state_dir, hb, fleet_cluster, keys, 1))],
                               name="up-b")
        wait_for((state_dir.run_dir / "fleet.json").exists, 30, "host A up")

        def b_has_agent() -> bool:
            view = fleet_view(processes, state_dir)
            return any(c["name"] == "agent-1" and c["state"] == "running"
                       for c in view.get(hb, {}).get("children", []))

        wait_for(b_has_agent, 40, "host B's agent-1 in the fleet view", interval_s=0.3)
        probe = BrokerPeer(ctx, state_dir, "probe", 0.2, 5)  # an actor of host A
        target = BrokerPeer(ctx, other_state_dir, "target", 0.2, 5)  # an actor of host B
        # host A has no agent-1: its broker's bridge finds it on host B (the fleet view)
        pong = wait_for(lambda: pong_or_none(probe, "agent-1"), 30,
                        "a ping from host A answered by host B's agent-1", interval_s=0.2)
        assert isinstance(pong, protocol.Pong) and pong.actor == "agent-1"
        assert isinstance(ping(probe, f"{hb}:agent-1"), protocol.Pong)  # HOST:NAME
        # a non-agent actor of B, both ways: B's actor sees the sender with its host
        probe.send(f"{hb}:target", protocol.Ping(msg_id="to-target"))
        got = target.recv(10)
        assert got is not None
        sender, message = got
        assert sender == f"{ha}:probe" and getattr(message, "msg_id", None) == "to-target"
        target.send(sender, protocol.Pong(msg_id="to-target", actor="target", pid=1))
        back = probe.recv(10)
        assert back is not None and back[0] == f"{hb}:target"
        assert getattr(back[1], "msg_id", None) == "to-target"

        # frames published straight onto B's subject: unsigned, signed with another
        # key, and a validly signed one published twice (the second is a replay)
        body = protocol.encode(protocol.Ping(msg_id="forged"))
        good = protocol.encode(protocol.Ping(msg_id="signed-once"))
        from_c = protocol.encode(protocol.Ping(msg_id="from-c"))
        real = bus_key(keys.bus_secret.read_bytes().strip())
        key_a = buskeys.load_or_create(buskeys.key_path(state_dir.root))  # host A's own
        replayed = sign(real, f"{ha}:probe", f"{hb}:target", good, host_key=key_a)
        before = bridge_values(target)["bridge_refused_total"]
        asyncio.run(_publish(fleet_cluster.urls, bus_subject(hb), [
            (body, {"Corral-From": f"{ha}:probe", "Corral-To": f"{hb}:target"}),
            (body, sign(bus_key(b"not-the-fleet-key"), f"{ha}:probe", f"{hb}:target", body,
                        host_key=key_a)),
            # host C, holding the fleet key, speaking as host A: the fleet MAC is right,
            # the host signature is C's (or none)
            (body, sign(real, f"{ha}:probe", f"{hb}:target", body, host_key=key_c)),
            (body, sign(real, f"{ha}:probe", f"{hb}:target", body)),
            (good, replayed), (good, replayed),
            (from_c, sign(real, f"{hc}:probe", f"{hb}:target", from_c, host_key=key_c))]))
        wait_for(lambda: bridge_values(target)["bridge_refused_total"] >= before + 5, 10,
                 "host B's bridge refusing the five frames", interval_s=0.1)
        probe.send(f"{hb}:target", protocol.Ping(msg_id="after"))
        seen: list[str | None] = []
        while "after" not in seen:
            item = target.recv(10)
            assert item is not None, seen
            seen.append(getattr(item[1], "msg_id", None))
        # the forged ones and the replay never arrived; C's own frame did, as C's
        assert seen == ["signed-once", "from-c", "after"]
        values = bridge_values(target)
        assert values["bridge_refused_total"] == before + 5
        assert values["bridge_received_total"] >= 5
        # and host C cannot put its key under host A's name
        assert not asyncio.run(_register(fleet_cluster.urls, ha, buskeys.public_hex(key_c)))
        assert bridge_values(probe)["bridge_sent_total"] >= 4

        # a runtime actor of B (procs, the writer...) serves only its own host's actors
        detail = refused_by(probe, "forbidden", f"{hb}:procs")
        assert detail is not None and "procs" in detail
        # an unknown host: refused at once, typed
        detail = refused_by(probe, "host_unreachable", f"nohost{hb[2:]}:agent-1")
        assert detail is not None and "no such host" in detail
        # host B goes silent (its supervisor SIGKILLed): refused, typed, once A's view has it
        up_b.send_signal(signal.SIGKILL)
        up_b.wait(10)
        detail = wait_for(lambda: refused_by(probe, "host_unreachable", "agent-1"), 30,
                          "a ping for B's agent refused: its host is unreachable",
                          interval_s=0.3)
        assert hb in detail
        probe.close()
        target.close()
    finally:
        ctx.destroy(linger=0)
        for proc in processes.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        forget_hosts(fleet_cluster.urls, [ha, hb, hc])


class _Kv:
    """A bus keys bucket whose `create` fails as told (an injected fault)."""

    def __init__(self, fail: Exception, held: bytes | None = None) -> None:
        self.fail, self.held = fail, held

    async def create(self, key: str, value: bytes) -> int:
        raise self.fail

    async def get(self, key: str) -> Any:
        from nats.js.errors import KeyNotFoundError

        if self.held is None:
            raise KeyNotFoundError
        return type("Entry", (), {"value": self.held})()


class _Js:
    def __init__(self, kv: _Kv) -> None:
        self.kv = kv

    async def key_value(self, bucket: str) -> _Kv:
        return self.kv


def test_a_cluster_that_does_not_answer_is_not_taken_for_a_held_name() -> None:
    """`register`: a name held by a key is told from a cluster that did not
    answer the create; the second raises as it is (the caller tries again),
    not as a failed lookup of a key that was never there."""
    from nats.js.errors import KeyWrongLastSequenceError, NoStreamResponseError

    with pytest.raises(NoStreamResponseError):
        asyncio.run(buskeys.register(_Js(_Kv(NoStreamResponseError())), "hx", "ab", 1))
    held = _Kv(KeyWrongLastSequenceError(), held=b"ab")
    assert asyncio.run(buskeys.register(_Js(held), "hx", "ab", 1)) is True
    other = _Kv(KeyWrongLastSequenceError(), held=b"cd")
    assert asyncio.run(buskeys.register(_Js(other), "hx", "ab", 1)) is False
