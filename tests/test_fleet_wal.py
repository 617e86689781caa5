"""Fleet mode's replicated WAL against a real 3-node JetStream cluster (one per
run, `supervisor fleet up`): every acknowledged append is in the host's
stream, gapless and once; a cluster without its majority stops the acks and
they resume in order when it returns; a writer restarted with an unreplicated
tail publishes it first, answering retries only then; a fenced host's writer
acknowledges nothing more and stops with 77 (docs/fleet.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.wal import iter_segment, list_segments
from broker.errors import RequestTimeoutError
from broker.statedir import StateDir
from supervisor.fleet.replicate import EXIT_FENCED
from supervisor.fleetconfig import WRITER_HOOK
from tests.fleetkit import Cluster, stream_leader, stream_records
from tests.processes import ProcessTracker, wait_for

pytestmark = [pytest.mark.fleet, pytest.mark.process]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


FLEET_HOOK = ["--hook", WRITER_HOOK]  # the supervisor passes it in fleet mode


def host_name() -> str:
    return f"h{uuid.uuid4().hex[:10]}"


def start_fleet_writer(processes: ProcessTracker, state_dir: StateDir,
                       ctx: zmq.Context[zmq.Socket[bytes]], host: str, urls: list[str], *,
                       name: str = "writer") -> subprocess.Popen[bytes]:
    url_args = [a for u in urls for a in ("--fleet-url", u)]
    proc = processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root),
                            *FLEET_HOOK, "--fleet-host", host, "--fleet-publish-timeout-s", "1",
                            *url_args],
                           name=name)
    probe = WriterClient(ctx, state_dir, "probe")
    try:
        def answered() -> bool:
            assert proc.poll() is None, processes.output(name)
            try:
                probe.ping(timeout_s=0.1, retries=0)
            except RequestTimeoutError:
                return False
            return True
        wait_for(answered, 20, "the fleet writer to answer a ping")
    finally:
        probe.close()
    return proc


def fleet_stats(ctx: zmq.Context[zmq.Socket[bytes]], state_dir: StateDir) -> dict[str, float]:
    probe = WriterClient(ctx, state_dir, "probe", timeout_s=1, retries=3)
    try:
        return {k: v for k, v in probe.stats().items() if k.startswith("fleet_")}
    finally:
        probe.close()


def local_lines(state_dir: StateDir) -> dict[int, bytes]:
    found = {}
    for _first, path in list_segments(state_dir.wal_dir):
        for _off, rec in iter_segment(path):
            found[rec.seq] = rec.line  # type: ignore[union-attr]
    return found


def journal(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    return {k: int(s) for k, s in (line.split() for line in path.read_text().splitlines())}


def test_every_acknowledged_append_is_in_the_stream_once_and_in_order(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    fleet_cluster.wait_ready()
    host = host_name()
    writer = start_fleet_writer(processes, state_dir, ctx, host, fleet_cluster.urls)
    journals = [state_dir.root.parent / f"j{i}" for i in range(2)]
    appenders = [processes.spawn(["-m", "tests.appender", "--state-dir", str(state_dir.root),
                                  "--origin", f"a{i}", "--count", "40", "--journal", str(j)],
                                 name=f"appender{i}") for i, j in enumerate(journals)]
    # SIGKILL the writer and a NATS node (a follower of the host's stream: the
    # leader's loss is measured by bench.py fleet) while they append: what the
    # writer acknowledged must be in the stream, local disk or not
    wait_for(lambda: sum(len(journal(j)) for j in journals) >= 30, 40, "30 acks")
    follower = next(i for i, n in enumerate(fleet_cluster.nodes)
                    if f"n{n.index}" != stream_leader(fleet_cluster.urls, host))
    writer.send_signal(signal.SIGKILL)
    fleet_cluster.kill(follower)
    writer.wait(10)
    acked = {(f"a{i}", k): s for i, j in enumerate(journals) for k, s in journal(j).items()}
    assert len(acked) >= 30
    replicated = stream_records(fleet_cluster.urls, host)  # gapless from 1, each seq once
    local = local_lines(state_dir)
    for (origin, key), seq in acked.items():
        assert seq in replicated, (origin, key, seq)
        assert replicated[seq] == local[seq]  # the very bytes of the local record
        assert json.loads(replicated[seq])["key"] == key
    fleet_cluster.restart(follower)
    # the writer restarted: the appenders finish, the stream holds all of them once
    start_fleet_writer(processes, state_dir, ctx, host, fleet_cluster.urls, name="writer2")
    for proc in appenders:
        assert proc.wait(40) == 0
    acked = {(f"a{i}", k): s for i, j in enumerate(journals) for k, s in journal(j).items()}
    assert len(acked) == 80
    replicated = stream_records(fleet_cluster.urls, host)
    assert set(acked.values()) <= set(replicated)
    keys = [(json.loads(line)["origin"], json.loads(line)["key"]) for line in
            replicated.values()]
    assert len(keys) == len(set(keys))  # no append stored twice


def test_an_unreplicated_tail_is_published_first_and_retries_answered_only_then(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    fleet_cluster.wait_ready()
    host = host_name()
    writer = start_fleet_writer(processes, state_dir, ctx, host, fleet_cluster.urls)
    # the first append waits for an R3 publish: seconds on a loaded machine, so only the
    # append that must time out (the cluster stopped) gets the short deadline
    client = WriterClient(ctx, state_dir, "a1", timeout_s=5, retries=5)
    assert client.append("agent/a1", "turn", {"n": 0}, key="k0").seq == 1
    client.timeout_s, client.retries = 0.3, 2
    fleet_cluster.stop(1)
    fleet_cluster.stop(2)
    try:
        with pytest.raises(RequestTimeoutError):  # durable locally, never acknowledged
            client.append("agent/a1", "turn", {"n": 1}, key="k1")
        wait_for(lambda: 2 in local_lines(state_dir), 10, "seq 2 durable locally")
        assert fleet_stats(ctx, state_dir)["fleet_waiting_s"] > 0
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
    finally:
        fleet_cluster.restart(1)
        fleet_cluster.restart(2)
    start_fleet_writer(processes, state_dir, ctx, host, fleet_cluster.urls, name="writer2")
    client.close()
    client = WriterClient(ctx, state_dir, "a1", timeout_s=5, retries=5)
    ack = client.append("agent/a1", "turn", {"n": 1}, key="k1")
    assert (ack.seq, ack.duplicate) == (2, True)  # answered once seq 2 is in the stream
    assert client.append("agent/a1", "turn", {"n": 2}, key="k2").seq == 3
    replicated = stream_records(fleet_cluster.urls, host)
    assert sorted(replicated) == [1, 2, 3]
    assert replicated[2] == local_lines(state_dir)[2]
    client.close()


def test_a_cluster_without_majority_stops_acks_and_they_resume_in_order(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    fleet_cluster.wait_ready()
    host = host_name()
    start_fleet_writer(processes, state_dir, ctx, host, fleet_cluster.urls)
    client = WriterClient(ctx, state_dir, "a1", timeout_s=1, retries=100)
    assert client.append("agent/a1", "turn", {"n": 0}, key="k0").seq == 1
    fleet_cluster.stop(1)
    fleet_cluster.stop(2)
    acks: list[int] = []

    def append() -> None:
        for i in range(1, 4):
            acks.append(client.append("agent/a1", "turn", {"n": i}, key=f"k{i}").seq)

    thread = threading.Thread(target=append)
    try:
        thread.start()
        # the batch waits at once; "not connected" comes when its publish has
        # failed (a timeout, later): both are waited for, in one read of the stats
        def waiting_unconnected() -> dict[str, float] | None:
            stats = fleet_stats(ctx, state_dir)
            return stats if stats["fleet_waiting_s"] > 0.5 and not stats["fleet_connected"] \
                else None

        stats = wait_for(waiting_unconnected, 30,
                         "the writer to say it waits for the cluster, unconnected",
                         interval_s=0.2)
        assert stats["fleet_replicated_seq"] == 1
        assert acks == []  # nothing acknowledged without the stream
        assert 2 in local_lines(state_dir)  # though durable locally
    finally:
        fleet_cluster.restart(1)
        fleet_cluster.restart(2)
    thread.join(50)
    assert acks == [2, 3, 4]
    assert sorted(stream_records(fleet_cluster.urls, host)) == [1, 2, 3, 4]
    assert fleet_stats(ctx, state_dir)["fleet_waiting_s"] == 0
    client.close()


def test_a_fenced_host_acknowledges_nothing_more_and_stops(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    fleet_cluster.wait_ready()
    host = host_name()
    writer = start_fleet_writer(processes, state_dir, ctx, host, fleet_cluster.urls)
    client = WriterClient(ctx, state_dir, "a1", timeout_s=5, retries=5)  # an R3 publish
    assert client.append("agent/a1", "turn", {"n": 0}, key="k0").seq == 1
    client.timeout_s, client.retries = 0.5, 2  # for the append that must time out
    fenced = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "fleet", "fence", host,
         "--by", "h-adopter", *[a for u in fleet_cluster.urls for a in ("--url", u)]],
        capture_output=True, text=True, timeout=30, check=False)
    assert fenced.returncode == 0, fenced.stderr
    with pytest.raises(RequestTimeoutError):
        client.append("agent/a1", "turn", {"n": 1}, key="k1")
    assert writer.wait(20) == EXIT_FENCED
    assert "fenced" in processes.output("writer")
    # restarted, it stops again before acknowledging anything
    again = processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root),
                             *FLEET_HOOK, "--fleet-host", host, *fleet_cluster.url_args()],
                            name="writer2")
    assert again.wait(30) == EXIT_FENCED
    assert sorted(stream_records(fleet_cluster.urls, host)) == [1]
    client.close()

