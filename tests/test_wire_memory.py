"""Bounded memory that comes back (issue 38): after 1,000 idle connections
each, a flood of pages a client never reads and a flood of frames the broker
can only refuse, the writer's and the broker's RSS return within 20% of
their start once the load stops (broker/memtrim.py; without the trim they
stayed 80-90% up)."""

from __future__ import annotations

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
            to_broker.send_multipart([b"broker", protocol.encode(protocol.Ping(msg_id=f"b{i}"))])
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
