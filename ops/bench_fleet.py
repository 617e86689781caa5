"""`bench.py fleet`: acknowledged appends per second and p99 with 64 closed-loop
appender processes through one writer in fleet mode (every batch in the host's
R3 JetStream stream before its ack; a local 3-node cluster, `sync_interval:
always`) against the same writer in local-only mode, and raw JetStream
publishes of batches of the same size (one in flight, as the writer does), all
in the same run. Target: fleet_over_local_k64 >= 0.5 (docs/fleet.md)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ops.bench_wal import writer_run
from ops.benchkit import percentile, start_writer, stop, temp_state_root, wait_writer_ready


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


def run(quick: bool = False) -> dict[str, object]:
    from supervisor import fleetcluster

    seconds = 1.5 if quick else 5.0
    f: dict[str, float] = {}
    with temp_state_root("corral-bfleet-") as root:
        cluster_root = root / "cluster"
        nodes = fleetcluster.up(cluster_root, 3)
        urls = [n.url for n in nodes]
        try:
            local = root / "local" / ".corral"
            writer = start_writer(local)
            try:
                wait_writer_ready(local)
                rate, lat = writer_run(local, 64, seconds)
                f["local_acked_per_s_k64"] = rate
                f["local_p99_ms_k64"] = percentile(lat, 99) * 1000
            finally:
                stop(writer)
            fleet = root / "fleet" / ".corral"
            writer = start_writer(fleet, "--fleet-host", "bench",
                                  *[a for u in urls for a in ("--fleet-url", u)])
            try:
                wait_writer_ready(fleet)
                rate, lat = writer_run(fleet, 64, seconds)
                f["fleet_acked_per_s_k64"] = rate
                f["fleet_p50_ms_k64"] = percentile(lat, 50) * 1000
                f["fleet_p99_ms_k64"] = percentile(lat, 99) * 1000
                stats = writer_stats(fleet)
            finally:
                stop(writer)
            batches = max(1, int(stats["batches_total"]))
            f["fleet_records_per_batch"] = int(stats["appends_total"]) / batches
            size = sum(p.stat().st_size for p in (fleet / "state" / "wal").glob("*.jsonl"))
            f["fleet_bytes_per_batch"] = size / batches
            f["jetstream_batches_per_s"] = jetstream_batches_per_s(
                urls, int(f["fleet_bytes_per_batch"]), seconds)
        finally:
            fleetcluster.down(cluster_root)
    f["fleet_over_local_k64"] = f["fleet_acked_per_s_k64"] / f["local_acked_per_s_k64"]
    f["fleet_batches_per_s"] = f["fleet_acked_per_s_k64"] / f["fleet_records_per_batch"]
    figures: dict[str, object] = {key: round(value, 3) for key, value in f.items()}
    figures["targets"] = {"fleet_over_local_k64>=0.5": f["fleet_over_local_k64"] >= 0.5}
    return figures
