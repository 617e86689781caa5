"""`bench.py fleet`: acknowledged appends per second and p99 with 64 closed-loop
appender processes through one writer in fleet mode (every batch in the host's
R3 JetStream stream before its ack; a local 3-node cluster, `sync_interval:
always`) against the same writer in local-only mode, and raw JetStream
publishes of batches of the same size (one in flight, as the writer does), all
in the same run. Target: fleet_over_local_k64 >= 0.5 (docs/fleet.md)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

from ops.bench_failover import host_failover_ms
from ops.bench_wal import writer_run
from ops.benchkit import percentile, start_writer, stop, temp_state_root, wait_writer_ready
from supervisor.fleetconfig import WRITER_HOOK


def writer_stats(state_dir: Path) -> dict[str, Any]:
    import zmq

    from actors.writer.client import WriterClient
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, StateDir.at(state_dir), "bench-stats")
    try:
        return client.stats()
    finally:
        client.close()
        ctx.destroy(linger=0)


def jetstream_batches_per_s(urls: list[str], batch_bytes: int, seconds: float) -> float:
    """Sequential R3 publishes of `batch_bytes` messages, deduplicated and with an
    expected last sequence, as the writer publishes."""
    import nats
    from nats.js.api import StorageType, StreamConfig

    async def go() -> float:
        nc: Any = await nats.connect(urls)
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name="BENCH_RAW", subjects=["bench.raw"],
                                         num_replicas=3, storage=StorageType.FILE,
                                         duplicate_window=120))
        body = b"x" * max(1, batch_bytes)
        last, count = 0, 0
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline:
            ack = await js.publish("bench.raw", body, headers={
                "Nats-Msg-Id": f"r{count}", "Nats-Expected-Last-Sequence": str(last)})
            last = int(ack.seq)
            count += 1
        elapsed = time.monotonic() - started
        await nc.close()
        return count / elapsed

    return asyncio.run(go())


def stream_leader(urls: list[str], host: str) -> str:
    import nats

    from supervisor.fleet.replicate import stream_name

    async def go() -> str:
        nc: Any = await nats.connect(urls)
        try:
            info = await nc.jetstream(timeout=5).stream_info(stream_name(host))
            return str(info.cluster.leader)
        finally:
            await nc.close()

    return asyncio.run(go())


def failure_figures(cluster_root: Path, state_dir: Path, host: str) -> dict[str, float]:
    """Measured outages on the running fleet writer: the stream leader SIGKILLed
    (one append's stall), two of three nodes down then back (restart to ack),
    and a fence (to the writer's exit)."""
    import threading

    import zmq

    from actors.writer.client import WriterClient
    from broker.statedir import StateDir
    from supervisor.fleet import cluster
    from supervisor.fleet.cli import fence

    f: dict[str, float] = {}
    nodes = cluster.read_cluster(cluster_root)
    urls = [n.url for n in nodes]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, StateDir.at(state_dir), "bench-faults", timeout_s=1, retries=120)
    try:
        client.append("agent/bench-faults", "turn", {"n": 0}, key="f0")
        leader = stream_leader(urls, host)
        victim = next(n for n in nodes if f"n{n.index}" == leader)
        t0 = time.monotonic()
        cluster.stop_node(victim, signal.SIGKILL)
        client.append("agent/bench-faults", "turn", {"n": 1}, key="f1")
        f["leader_kill_to_ack_ms"] = (time.monotonic() - t0) * 1000
        cluster.start_node(cluster_root, victim)
        cluster.wait_ready(urls, 30)
        nodes = cluster.read_cluster(cluster_root)
        for node in nodes[1:]:
            cluster.stop_node(node, signal.SIGKILL)
        done: list[float] = []

        def append_once() -> None:
            client.append("agent/bench-faults", "turn", {"n": 2}, key="f2")
            done.append(time.monotonic())

        thread = threading.Thread(target=append_once)
        thread.start()
        time.sleep(2.0)  # an outage of two seconds (a measurement, not a synchronisation)
        acked_during_outage = bool(done)
        t0 = time.monotonic()
        for node in nodes[1:]:
            cluster.start_node(cluster_root, node)
        thread.join(120)
        f["majority_back_to_ack_ms"] = (done[0] - t0) * 1000 if done else float("nan")
        f["acked_without_majority"] = float(acked_during_outage)
        cluster.wait_ready(urls, 30)
    finally:
        client.close()
        ctx.destroy(linger=0)
    from supervisor.fleet.natsclient import FleetSettings

    t0 = time.monotonic()
    asyncio.run(fence(FleetSettings(host=host, urls=tuple(urls)), "bench"))
    f["fence_ms"] = (time.monotonic() - t0) * 1000
    return f


def fenced_append(state_dir: Path) -> None:
    import zmq

    from actors.writer.client import WriterClient
    from broker.errors import RequestTimeoutError
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, StateDir.at(state_dir), "bench-fenced", timeout_s=0.5, retries=2)
    try:
        client.append("agent/bench-fenced", "turn", {"n": 0}, key="x")
    except RequestTimeoutError:
        pass  # never acknowledged: the point
    else:
        raise AssertionError("a fenced writer acknowledged an append")
    finally:
        client.close()
        ctx.destroy(linger=0)


def run(quick: bool = False) -> dict[str, object]:
    from supervisor.fleet import cluster

    seconds = 1.5 if quick else 5.0
    f: dict[str, float] = {}
    with temp_state_root("corral-bfleet-") as root:
        cluster_root = root / "cluster"
        nodes = cluster.up(cluster_root, 3)
        urls = [n.url for n in nodes]
        try:
            # both writers up; rounds alternate local, fleet (the machine's load
            # drifts: each figure is the median of its rounds)
            local = root / "local" / ".corral"
            fleet = root / "fleet" / ".corral"
            local_writer = start_writer(local)
            writer = start_writer(fleet, "--hook", WRITER_HOOK, "--fleet-host", "bench",
                                  *[a for u in urls for a in ("--fleet-url", u)])
            try:
                wait_writer_ready(local)
                wait_writer_ready(fleet)
                rounds: dict[str, list[tuple[float, list[float]]]] = {"local": [], "fleet": []}
                for _ in range(1 if quick else 3):
                    rounds["local"].append(writer_run(local, 64, seconds))
                    rounds["fleet"].append(writer_run(fleet, 64, seconds))
                stop(local_writer)
                for mode, runs in rounds.items():
                    rates = sorted(r for r, _ in runs)
                    lat = [x for _, lats in runs for x in lats]
                    f[f"{mode}_acked_per_s_k64"] = rates[len(rates) // 2]
                    f[f"{mode}_p50_ms_k64"] = percentile(lat, 50) * 1000
                    f[f"{mode}_p99_ms_k64"] = percentile(lat, 99) * 1000
                stats = writer_stats(fleet)
                f.update(failure_figures(cluster_root, fleet, "bench"))
                t0 = time.monotonic()
                fenced_append(fleet)  # the next append meets the fence: the writer stops
                writer.wait(30)
                f["fenced_append_to_exit_ms"] = (time.monotonic() - t0) * 1000
                f["fenced_writer_exit_code"] = float(writer.returncode or 0)
            finally:
                stop(local_writer)
                stop(writer)
            batches = max(1, int(stats["batches_total"]))
            f["fleet_records_per_batch"] = int(stats["appends_total"]) / batches
            size = sum(p.stat().st_size for p in (fleet / "state" / "wal").glob("*.jsonl"))
            f["fleet_bytes_per_batch"] = size / batches
            f["jetstream_batches_per_s"] = jetstream_batches_per_s(
                urls, int(f["fleet_bytes_per_batch"]), seconds)
            f.update(host_failover_ms(root / "failover", urls, 30 if quick else 120))
        finally:
            cluster.down(cluster_root)
    f["fleet_over_local_k64"] = f["fleet_acked_per_s_k64"] / f["local_acked_per_s_k64"]
    f["fleet_batches_per_s"] = f["fleet_acked_per_s_k64"] / f["fleet_records_per_batch"]
    figures: dict[str, object] = {key: round(value, 3) for key, value in f.items()}
    figures["targets"] = {"fleet_over_local_k64>=0.5": f["fleet_over_local_k64"] >= 0.5,
                          "host_failover_ms<=10000": f["host_failover_ms"] <= 10000}
    return figures
