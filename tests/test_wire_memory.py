"""Bounded memory that comes back (issue 38): after 1,000 idle connections
each, a flood of pages a client never reads and a flood of frames the broker
can only refuse, the writer's and the broker's RSS return within 20% of
their start once the load stops (broker/memtrim.py; without the trim they
stayed 80-90% up); after a flood of connections claiming an identity in use
(which ZeroMQ parks and never frees), the broker's fds and RSS come back
(broker/parking.py; without the renewal they stayed up for good)."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator

import psutil
import pytest
import zmq

from actors.writer.client import WriterClient
from broker import auth, protocol
from broker.errors import RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for
from tests.test_broker import start_broker
from tests.test_writer import start_writer

pytestmark = pytest.mark.process
Ctx = zmq.Context[zmq.Socket[bytes]]
IDLE = 1000  # connections to each server
GROWTH_MAX = 1.2  # RSS after the load / RSS at the start


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 3 * IDLE + 512)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    context: Ctx = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    context.set(zmq.MAX_SOCKETS, 2 * IDLE + 64)
    yield context
    context.destroy(linger=0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


@pytest.mark.timeout(150)
def test_writer_and_broker_give_memory_back_after_the_load_stops(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * IDLE + 256:
        pytest.skip("the hard fd limit is too low for 2,000 connections")
    writer = start_writer(processes, state_dir, ctx)
    broker = start_broker(processes, state_dir)
    operator = auth.operator_credential(state_dir)
    client = WriterClient(ctx, state_dir, "probe")

    def dealer(to: str, identity: bytes | None = None) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        auth.apply_client(sock, operator)
        sock.connect(state_dir.endpoint(to))
        return sock

    def counters(sock: zmq.Socket[bytes]) -> dict[str, int | float]:
        sock.send_multipart([b"broker", protocol.encode(protocol.StatsRequest(msg_id="st"))])
        while sock.poll(5000, zmq.POLLIN):
            reply = protocol.decode(sock.recv_multipart()[-1])
            if isinstance(reply, protocol.Stats):
                return reply.values
        return {}

    def writer_counter(name: str) -> int | float:
        try:
            return client.stats().get(name, 0)
        except RequestTimeoutError:
            return 0

    watcher = dealer("broker", b"watcher")
    try:
        for i in range(12):  # a stream whose pages are ~700 KB
            client.append("big", "chunk", {"data": "x" * 60_000}, key=f"big-{i}")
        counters(watcher)
        start = {"writer": rss_mb(writer.pid), "broker": rss_mb(broker.pid)}

        idle = []
        for i in range(IDLE):
            to_writer = dealer("writer")
            to_writer.send(protocol.encode(protocol.Ping(msg_id=f"w{i}")))
            to_broker = dealer("broker", f"idle-{i}".encode())
            # an idle actor's hush (docs/broker.md, "Idle peers"): held, never expired,
            # however long opening the thousand connections takes on a loaded machine
            to_broker.send_multipart([b"broker", protocol.encode(protocol.Heartbeat(
                actor=f"idle-{i}", pid=os.getpid(), values={"idle": 1}))])
            idle += [to_writer, to_broker]
        wait_for(lambda: counters(watcher).get("peers", 0) >= IDLE, 60,
                 "the broker to hold every idle peer", interval_s=0.2)
        deaf = dealer("writer")
        deaf.setsockopt(zmq.RCVHWM, 10)
        reads = 1500
        for i in range(reads):
            deaf.send(protocol.encode(protocol.ReadStream(msg_id=f"r{i}", stream="big")))
        flood = dealer("broker", b"flooder")
        for i in range(20_000):
            flood.send_multipart([b"nobody", protocol.encode(protocol.Ping(msg_id=f"f{i}"))])
        wait_for(lambda: writer_counter("reads_total") >= reads, 60,
                 "the writer to read every deaf request", interval_s=0.2)
        wait_for(lambda: counters(watcher).get("unknown_recipient_total", 0) >= 20_000, 60,
                 "the broker to refuse the flood", interval_s=0.2)
        peak = {"writer": rss_mb(writer.pid), "broker": rss_mb(broker.pid)}
        for sock in [*idle, deaf, flood]:
            sock.close()

        def back() -> bool:
            return (rss_mb(writer.pid) <= GROWTH_MAX * start["writer"]
                    and rss_mb(broker.pid) <= GROWTH_MAX * start["broker"])

        wait_for(back, 30, f"RSS within 20% of {start} (peak {peak}, now writer "
                 f"{rss_mb(writer.pid):.1f} broker {rss_mb(broker.pid):.1f})", interval_s=0.5)
        assert peak["writer"] > start["writer"] and peak["broker"] > start["broker"]
    finally:
        watcher.close()
        client.close()



def rss_and_fds(pid: int) -> tuple[float, int]:
    return rss_mb(pid), len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(150)
def test_connections_zeromq_parks_are_freed_and_the_broker_memory_comes_back(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """A fuzz-like flood at the broker: 60 connections claiming the identity
    another connection holds, each sending 1,200 frames (more than the
    broker's RCVHWM: ZeroMQ parks them, stops reading them, keeps their fds),
    and 1,000 more that send one frame each; all closed. The broker renews its
    socket, and its open fds and RSS return within 20% of their start; the
    connection that held the identity reconnects and is served."""
    broker = start_broker(processes, state_dir, "--renew-interval-s", "2")
    operator = auth.operator_credential(state_dir)

    def dealer(identity: bytes) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        auth.apply_client(sock, operator)
        sock.connect(state_dir.endpoint("broker"))
        return sock

    def counters(sock: zmq.Socket[bytes]) -> dict[str, int | float]:
        sock.send_multipart([b"broker", protocol.encode(protocol.StatsRequest(msg_id="st"))])
        while sock.poll(5000, zmq.POLLIN):
            reply = protocol.decode(sock.recv_multipart()[-1])
            if isinstance(reply, protocol.Stats):
                return reply.values
        return {}

    holder = dealer(b"holder")
    assert counters(holder).get("renewals_total") == 0
    start_rss, start_fds = rss_and_fds(broker.pid)
    frame = protocol.encode(protocol.Ping(msg_id="p" * 60))
    parked = []
    for _ in range(60):
        sock = dealer(b"holder")
        for _ in range(1200):
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([b"nobody", frame], zmq.NOBLOCK)
        parked.append(sock)
    for i in range(1000):
        sock = dealer(b"holder")
        sock.send_multipart([b"broker", protocol.encode(protocol.Ping(msg_id=f"s{i}"))])
        parked.append(sock)
    peak_rss, peak_fds = rss_and_fds(broker.pid)
    for sock in parked:
        sock.close(linger=0)

    def back() -> bool:
        rss, fds = rss_and_fds(broker.pid)
        return rss <= GROWTH_MAX * start_rss and fds <= start_fds

    wait_for(back, 60, f"the broker back to {start_rss:.1f} MB and {start_fds} fds (peak "
             f"{peak_rss:.1f} MB, {peak_fds} fds; now {rss_and_fds(broker.pid)})", interval_s=0.5)
    assert peak_rss > GROWTH_MAX * start_rss, "the flood did not grow the broker: no test"
    assert peak_fds > start_fds + 50
    seen: list[dict[str, int | float]] = []

    def served() -> bool:
        seen.append(counters(holder))
        return bool(seen[-1]) and seen[-1]["renewals_total"] >= 1

    wait_for(served, 30, "the holder served again after the renewal", interval_s=0.2)
    assert seen[-1]["parked_total"] >= 1, seen[-1]
    holder.close(linger=0)
