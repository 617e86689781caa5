"""Only the operator controls the fleet (docs/fleet.md, "One view", "Messages
between hosts"), on two real hosts and the real 3-node cluster:

- a host configured with the old shared `fleet.operator_key` is refused at start;
- a host whose bus key was wiped makes a new one: the other host's bridge,
  which pinned the old one, refuses its frames; neither a forget request
  signed with a host's material nor a purge of the KV entry changes that;
  the operator's `supervisor fleet forget-bus-key HOST` does: its frames are
  delivered again;
- control requests signed with anything a host holds (the old shared key, the
  hosts' bus secret, its own bus key) are refused by the other host and
  nothing happens there; the operator's `supervisor stop HOST:AGENT` works.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import yaml
import zmq

from broker import protocol
from broker.peer import BrokerPeer
from broker.statedir import StateDir
from supervisor.fleet import buskeys, ctl
from supervisor.fleet.natsclient import control_subject
from supervisor.fleet.place import PLACE_HOST, PLACE_SUBJECT
from tests.fleetkit import Cluster, forget_hosts, operator_key_and_hosts
from tests.processes import ProcessTracker, wait_for
from tests.test_fleet_bus import bridge_values, pong_or_none
from tests.test_fleet_hosts import _request, child, cli, fleet_view, host_config, other_state_dir

__all__ = ["other_state_dir"]  # the fixture, used by name

pytestmark = [pytest.mark.fleet, pytest.mark.process]


def old_format(secret: bytes, verb: str, host: str, agent: str, **extra: str) -> bytes:
    """A request as the shared operator key used to sign it (HMAC-SHA256)."""
    body = {"verb": verb, "host": host, "agent": agent, "signal": 15,
            "ts": round(time.time(), 3), "nonce": f"{time.monotonic_ns():032x}", **extra}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({**body, "mac": hmac.new(secret, text, hashlib.sha256).hexdigest()}
                      ).encode()


@pytest.mark.timeout(120)  # two hosts, a broker restart (~25 s on a quiet machine)
def test_only_the_operator_controls_hosts_and_clears_a_wiped_hosts_bus_key(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir) -> None:
    fleet_cluster.wait_ready()
    keys, ha, hb = operator_key_and_hosts(state_dir.root)
    shared = state_dir.root.parent / "fleet-operator.key"  # what every host used to hold
    shared.write_text("the-old-shared-operator-key")

    # a host still configured with the shared operator key does not start
    old = yaml.safe_load(host_config(state_dir, ha, fleet_cluster, keys, 0).read_text())
    old["fleet"]["operator_key"] = str(shared)
    old_path = state_dir.root.parent / "corral-old.yaml"
    old_path.write_text(yaml.safe_dump(old))
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
         "--config", str(old_path)],
        env=processes.env(), capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 78, done.stderr
    assert "fleet.operator_key" in done.stderr and "fleet.operator_public_key" in done.stderr
    assert "fleet.bus_secret" in done.stderr

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                         "--config", str(host_config(state_dir, ha, fleet_cluster, keys, 0))],
                        name="up-a")
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(other_state_dir.root),
                         "--config", str(host_config(other_state_dir, hb, fleet_cluster, keys,
                                                     1))],
                        name="up-b")
        wait_for((state_dir.run_dir / "fleet.json").exists, 30, "host A up")
        probe = BrokerPeer(ctx, state_dir, "probe", 0.2, 5)  # an actor of host A
        target = BrokerPeer(ctx, other_state_dir, "target", 0.2, 5)  # an actor of host B
        wait_for(lambda: pong_or_none(probe, f"{hb}:agent-1"), 40,
                 "host A's ping answered by host B's agent-1 (B pinned A's bus key)",
                 interval_s=0.3)

        # host A's state directory is wiped: its broker makes a new bus key at its restart
        broker_a = child(fleet_view(processes, state_dir)[ha], "broker")
        key_file = buskeys.key_path(state_dir.root)
        old_public = buskeys.public_hex(buskeys.load_or_create(key_file))
        key_file.unlink()
        os.kill(int(broker_a["pid"]), signal.SIGKILL)
        wait_for(key_file.exists, 20, "host A's broker restarted with a new bus key")
        new_key = buskeys.load_or_create(key_file)
        assert buskeys.public_hex(new_key) != old_public
        probe.close()
        probe = BrokerPeer(ctx, state_dir, "probe", 0.2, 5)

        def refused_more(since: int) -> bool:
            probe.send(f"{hb}:target", protocol.Ping(msg_id="from-wiped-a"))
            return int(bridge_values(target)["bridge_refused_total"]) > since

        base = int(bridge_values(target)["bridge_refused_total"])
        wait_for(lambda: refused_more(base), 30, "host B refusing host A's frames (new key)",
                 interval_s=0.3)
        assert target.recv(0.5) is None  # none delivered

        # neither a forget signed with what a host holds, nor the purge alone, unpins it
        for forged in (buskeys.forget_request(new_key, ha),
                       old_format(keys.bus_secret.read_bytes().strip(), "forget-bus-key", ha,
                                  ha)):
            reply = asyncio.run(_request(fleet_cluster.urls, buskeys.FORGET_SUBJECT, forged))
            assert reply["ok"] is False and reply["error"] == "forbidden", reply
        asyncio.run(_purge(fleet_cluster.urls, ha))  # anyone with NATS access can do this
        wait_for(lambda: asyncio.run(_entry(fleet_cluster.urls, ha))
                 == buskeys.public_hex(new_key).encode(), 20,
                 "host A's broker registering its new key in the emptied entry", interval_s=0.3)
        base = int(bridge_values(target)["bridge_refused_total"])
        wait_for(lambda: refused_more(base), 20, "host B still refusing host A's frames",
                 interval_s=0.3)
        assert target.recv(0.5) is None

        # the operator clears it: B drops its pin, pins A's new key, A's frames arrive
        done = cli(processes, state_dir, "fleet", "forget-bus-key", ha, "--json", keys=keys)
        assert done.returncode == 0, done.stdout + done.stderr
        forgot = json.loads(done.stdout)
        assert forgot["bridges"][hb]["ok"] is True and forgot["bridges"][ha]["ok"] is True
        assert forgot["bridges"][hb]["was_pinned"] is True and forgot["missing"] == []
        pong = wait_for(lambda: pong_or_none(probe, f"{hb}:agent-1"), 30,
                        "host A's frames delivered again", interval_s=0.3)
        assert isinstance(pong, protocol.Pong)
        assert cli(processes, state_dir, "fleet", "forget-bus-key", ha).returncode == 2  # no key

        # control requests signed with what host A holds: refused by B, nothing happens
        agent = child(fleet_view(processes, state_dir)[hb], "agent-1")
        assert agent["state"] == "running"
        forged_requests = [
            (control_subject(hb), old_format(shared.read_bytes().strip(), "stop", hb, "agent-1")),
            (control_subject(hb), old_format(keys.bus_secret.read_bytes().strip(), "stop", hb,
                                             "agent-1")),
            (control_subject(hb), ctl.sign(new_key, "stop", hb, "agent-1")),
            (control_subject(hb), ctl.sign(new_key, "spawn", hb, "x", task="steps: []")),
            (PLACE_SUBJECT, ctl.sign(new_key, "spawn", PLACE_HOST, "x", task="steps: []")),
            (PLACE_SUBJECT, old_format(shared.read_bytes().strip(), "spawn", PLACE_HOST, "x",
                                       task="steps: []")),
        ]
        for subject, data in forged_requests:
            reply = asyncio.run(_request(fleet_cluster.urls, subject, data))
            assert reply["ok"] is False and reply["error"] == "forbidden", reply
        view = fleet_view(processes, state_dir)
        after = child(view[hb], "agent-1")
        assert (after["state"], after["pid"]) == ("running", agent["pid"])
        assert "x" not in {c["name"] for h in view.values() for c in h["children"]}

        # the operator's request works
        done = cli(processes, state_dir, "stop", f"{hb}:agent-1", "--json", keys=keys)
        assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True, done.stderr
        wait_for(lambda: child(fleet_view(processes, state_dir)[hb], "agent-1")["state"]
                 == "stopped", 20, "host B's agent-1 stopped by the operator", interval_s=0.3)
        probe.close()
        target.close()
    finally:
        ctx.destroy(linger=0)
        for proc in processes.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        forget_hosts(fleet_cluster.urls, [ha, hb])


async def _purge(urls: list[str], host: str) -> None:
    import nats

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        await buskeys.purge(nc.jetstream(timeout=5), host)
    finally:
        await nc.close()


async def _entry(urls: list[str], host: str) -> bytes | None:
    import nats

    from supervisor.fleet.natsclient import kv_entries

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        return (await kv_entries(nc.jetstream(timeout=5), buskeys.BUCKET)).get(host)
    finally:
        await nc.close()

