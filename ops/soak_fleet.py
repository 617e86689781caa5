"""The fleet soak of writers alone: fleet-mode writers and appenders, writer kills.

Checks per host that every acknowledged append is in the host's stream at its
seq, gapless, once, byte for byte the local WAL's. See docs/soak.md ("The
fleet soak with real hosts").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ops.benchkit import start_writer, stop, temp_state_root, wait_writer_ready
from supervisor.fleetconfig import WRITER_HOOK


def _appender(state_dir: str, origin: str, journal: str, stop_file: str) -> None:
    import zmq

    from actors.writer.client import WriterClient
    from broker.errors import RequestTimeoutError
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, StateDir.at(state_dir), origin, timeout_s=0.5, retries=2)
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    i = 0
    while not os.path.exists(stop_file):
        try:
            ack = client.append(f"agent/{origin}", "turn", {"i": i, "pad": "x" * 100},
                                key=f"k{i}")
        except RequestTimeoutError:
            continue  # the writer is down: the same key again
        os.write(fd, f"k{i} {ack.seq}\n".encode())
        os.fsync(fd)
        i += 1
    os.close(fd)
    client.close()
    ctx.destroy(linger=0)


def _journal(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    return {k: int(s) for k, s in (line.split() for line in path.read_text().splitlines())}


def _stream(urls: list[str], host: str) -> list[tuple[int, int, list[bytes]]]:
    import asyncio

    import nats

    from supervisor.fleet.replicate import parse_seq_range, stream_name

    async def go() -> list[tuple[int, int, list[bytes]]]:
        nc: Any = await nats.connect(urls)
        try:
            js = nc.jetstream(timeout=10)
            info = await js.stream_info(stream_name(host))
            found = []
            if int(info.state.messages):
                for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
                    msg = await js.get_msg(stream_name(host), seq)
                    first, last = parse_seq_range((msg.headers or {})["Corral-Seq"])
                    found.append((first, last, (msg.data or b"").splitlines(keepends=True)))
            return found
        finally:
            await nc.close()

    return asyncio.run(go())


def check_host(urls: list[str], host: str, state_dir: Path,
               journals: dict[str, Path]) -> list[str]:
    import json

    from actors.writer.wal import WalRecord, iter_segment, list_segments

    problems: list[str] = []
    records: dict[int, bytes] = {}
    expected = 1
    for first, last, lines in _stream(urls, host):
        if first != expected or len(lines) != last - first + 1:
            problems.append(f"{host}: stream message {first}-{last} after {expected - 1}")
        for offset, line in enumerate(lines):
            records[first + offset] = line
        expected = last + 1
    keys = [(json.loads(v)["origin"], json.loads(v)["key"]) for v in records.values()]
    if len(keys) != len(set(keys)):
        problems.append(f"{host}: an append is in the stream twice")
    local = {}
    for _first, path in list_segments(state_dir / "state" / "wal"):
        for _off, rec in iter_segment(path):
            if isinstance(rec, WalRecord):
                local[rec.seq] = rec.line
    for seq, line in records.items():
        if local.get(seq) != line:
            problems.append(f"{host}: stream seq {seq} differs from the local WAL")
            break
    acked = 0
    for origin, path in journals.items():
        for key, seq in _journal(path).items():
            acked += 1
            stored = records.get(seq)
            if stored is None or json.loads(stored)["key"] != key or \
                    json.loads(stored)["origin"] != origin:
                problems.append(f"{host}: acked {origin}/{key} at {seq} not in the stream")
    if acked == 0:
        problems.append(f"{host}: nothing was acknowledged")
    return problems


def run(hosts: int, kill_interval_ms: int, duration_s: float, appenders: int,
        seed: int) -> dict[str, Any]:
    from supervisor.fleet import cluster

    rng = random.Random(seed)
    ctx = mp.get_context("fork")
    result: dict[str, Any] = {"hosts": hosts, "kill_host_interval_ms": kill_interval_ms,
                              "duration_s": duration_s, "seed": seed}
    with temp_state_root("corral-sfleet-") as root:
        cluster_root = root / "cluster"
        nodes = cluster.up(cluster_root, 3)
        urls = [n.url for n in nodes]
        names = [f"s{i}{os.getpid() % 1000}" for i in range(hosts)]
        dirs = {h: root / h / ".corral" for h in names}
        writers: dict[str, subprocess.Popen[bytes]] = {}
        procs = []
        stop_file = root / "stop"
        journals: dict[str, dict[str, Path]] = {h: {} for h in names}

        def start(host: str) -> None:
            writers[host] = start_writer(dirs[host], "--hook", WRITER_HOOK, "--fleet-host", host,
                                         "--fleet-publish-"
                                         "timeout-s", "1", *[a for u in urls
                                                              for a in ("--fleet-url", u)])
            wait_writer_ready(dirs[host], 60)

        kills = node_kills = 0
        try:
            for host in names:
                start(host)
                for j in range(appenders):
                    origin = f"{host}a{j}"
                    journals[host][origin] = root / f"{origin}.acks"
                    proc = ctx.Process(target=_appender, args=(
                        str(dirs[host]), origin, str(journals[host][origin]), str(stop_file)))
                    proc.start()
                    procs.append(proc)
            deadline = time.monotonic() + duration_s
            while time.monotonic() < deadline:
                time.sleep(kill_interval_ms / 1000)
                host = rng.choice(names)
                writers[host].send_signal(signal.SIGKILL)
                writers[host].wait()
                kills += 1
                node = None
                if rng.random() < 0.25:  # the host's NATS node goes with it
                    node = rng.choice(cluster.read_cluster(cluster_root))
                    cluster.stop_node(node, signal.SIGKILL)
                    node_kills += 1
                start(host)
                if node is not None:
                    cluster.start_node(cluster_root, node)
                    cluster.wait_ready(urls, 60)
            stop_file.write_text("")
            for proc in procs:
                proc.join(60)
            problems: list[str] = []
            for host in names:
                problems += check_host(urls, host, dirs[host], journals[host])
            result.update(
                host_kills=kills, node_kills=node_kills,
                acked={h: sum(len(_journal(p)) for p in journals[h].values()) for h in names},
                violations=problems, ok=not problems)
        finally:
            stop_file.write_text("")
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
            for writer in writers.values():
                stop(writer)
            cluster.down(cluster_root)
    return result


def main(argv: list[str]) -> int:
    """`ops/soak.py --hosts N --kill-host-interval-ms I [--duration S] [--json]`."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="ops/soak.py --hosts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--kill-host-interval-ms", type=int, required=True)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of killing")
    parser.add_argument("--appenders", type=int, default=4, help="per host")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.hosts, args.kill_host_interval_ms, args.duration, args.appenders,
                 args.seed)
    print(json.dumps(result, indent=2 if args.json else None, sort_keys=True))
    return 0 if result.get("ok") else 1
