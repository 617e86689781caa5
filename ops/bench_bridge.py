"""The brokers' bridge between hosts (`python ops/bench.py bridge --json`):
ping round trips and pipelined pings (64 in flight) from an actor of host A to
an echo actor through the local broker, and to an echo actor of host B
through both brokers, their bridges and a local 3-node NATS cluster, in the
same run with the same client (`BrokerPeer`, full decode) and bodies.

Figures: `local_rtt_p50_us`, `local_rtt_p99_us`, `bridge_rtt_p50_us`,
`bridge_rtt_p99_us`, `local_pipelined_per_s`, `bridge_pipelined_per_s`, and
the ratios `bridge_rtt_p50_ratio` (bridge / local) and
`bridge_pipelined_ratio` (bridge / local). Hosts are two brokers with their
own state directories; the fleet view's entries are put by the benchmark
(no supervisors).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from broker import protocol
from broker.peer import BrokerPeer
from broker.statedir import StateDir
from ops.bench_broker import _spawn, _stop, _wait_pong
from ops.benchkit import percentile
from supervisor.fleetconfig import BROKER_HOOK

WINDOW = 64
_IDS = itertools.count()  # msg_ids never repeat (a peer drops replies to finished ids)


def _put_hosts(urls: list[str], hosts: list[str]) -> None:
    import nats
    from nats.js.api import KeyValueConfig

    from supervisor.fleet.natsclient import HOSTS_BUCKET

    async def go() -> None:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            kv = await js.create_key_value(KeyValueConfig(bucket=HOSTS_BUCKET, history=1,
                                                          ttl=600, replicas=3))
            for host in hosts:
                await kv.put(host, json.dumps({"children": [], "at": time.time()}).encode())
        finally:
            await nc.close()

    asyncio.run(go())


def fleet_hosts(root: Path, names: tuple[str, ...]
                ) -> tuple[list[str], Path, dict[str, StateDir]]:
    """A local 3-node cluster under `root/cluster`, the hosts' bus secret
    (`fleet.bus_secret`) and a state directory per named host, each listed
    in the fleet view: what the benchmarks of the bridge stand on."""
    from supervisor.fleet import cluster

    urls = [n.url for n in cluster.up(root / "cluster" / ".corral", 3)]
    cluster.wait_ready(urls, 30)
    key = root / "bus.secret"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    states = {h: StateDir(root / h / ".corral").ensure() for h in names}
    _put_hosts(urls, list(states))
    return urls, key, states


def bridged_broker(state: StateDir, host: str, urls: list[str], key: Path) -> list[str]:
    """The arguments of a broker whose bridge joins the fleet as `host`."""
    return ["-m", "broker.server", "--state-dir", str(state.root), "--log-level", "warning",
            "--hook", BROKER_HOOK, "--fleet-host", host,
            *[a for u in urls for a in ("--fleet-url", u)],
            "--fleet-bus-secret", str(key), "--fleet-view-interval-s", "0.2"]


def _rtts(peer: BrokerPeer, to: str, n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        start = time.perf_counter_ns()
        peer.request(to, protocol.Ping(msg_id=f"r{next(_IDS)}"), timeout_s=5, retries=0)
        out.append((time.perf_counter_ns() - start) / 1000.0)
    return out


def _pipelined(peer: BrokerPeer, to: str, n: int) -> float:
    """Pings per second with WINDOW in flight."""
    sent = got = 0
    start = time.perf_counter()
    while got < n:
        while sent < n and sent - got < WINDOW:
            peer.send(to, protocol.Ping(msg_id=f"w{next(_IDS)}"))
            sent += 1
        item = peer.recv(5)
        if item is None:
            raise TimeoutError(f"pipelined pings stalled at {got}/{n}")
        if isinstance(item[1], protocol.Pong):
            got += 1
    return n / (time.perf_counter() - start)


def run(quick: bool = False) -> dict[str, object]:
    from supervisor.fleet import cluster

    n_rtt = 300 if quick else 3_000
    n_pipe = 2_000 if quick else 20_000
    root = Path(tempfile.mkdtemp(prefix="cbr-", dir="/tmp"))
    procs: list[Any] = []
    cluster_root = root / "cluster" / ".corral"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        urls, key, states = fleet_hosts(root, ("bha", "bhb"))
        for host, state in states.items():
            procs.append(_spawn(bridged_broker(state, host, urls, key), root / f"{host}.out"))
            procs.append(_spawn(["-m", "ops.bench_broker", "peer-echo", "--endpoint",
                                 state.endpoint("broker"), "--name", f"echo-{host}"],
                                root / f"echo-{host}.out"))
        peer = BrokerPeer(ctx, states["bha"], "bench-a")
        local, remote = "echo-bha", "bhb:echo-bhb"
        _wait_pong(peer, local)
        _wait_pong(peer, remote)
        figures: dict[str, object] = {}
        for label, to in (("local", local), ("bridge", remote)):
            _rtts(peer, to, n_rtt // 10)  # warm-up
            rtt = _rtts(peer, to, n_rtt)
            figures[f"{label}_rtt_p50_us"] = round(percentile(rtt, 50), 1)
            figures[f"{label}_rtt_p99_us"] = round(percentile(rtt, 99), 1)
            figures[f"{label}_pipelined_per_s"] = round(_pipelined(peer, to, n_pipe), 1)
        figures["bridge_rtt_p50_ratio"] = round(
            float(figures["bridge_rtt_p50_us"]) / float(figures["local_rtt_p50_us"]), 2)  # type: ignore[arg-type]
        figures["bridge_pipelined_ratio"] = round(
            float(figures["bridge_pipelined_per_s"]) / float(figures["local_pipelined_per_s"]), 3)  # type: ignore[arg-type]
        peer.close()
        return figures
    finally:
        ctx.destroy(linger=0)
        _stop(procs)
        cluster.down(cluster_root)
        if not os.environ.get("CORRAL_BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)
