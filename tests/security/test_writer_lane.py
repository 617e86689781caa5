"""The writer's local lane (actors/writer/lane.py) against hostile peers: a
same-uid process on `run/writer.lane` with no credential, a wrong one, or an
agent's, sending garbage, empty or oversized packets, or nothing at all,
gets a typed refusal (or its connection closed) and changes nothing durable;
an agent's credential appends only what the ROUTER would let it; the writer
serves everyone else throughout. And the client side: a lane that is full
or gone hands the append to the ROUTER under the same key."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.lane import HELLO_OK, HELLO_PREFIX, MAX_PACKET, hello, lane_path
from broker import auth, protocol
from broker.errors import RemoteError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for
from tests.test_writer import start_writer, wal_bytes

pytestmark = pytest.mark.process

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def lane_socket(state_dir: StateDir) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(30)
    sock.connect(str(lane_path(state_dir.run_dir)))
    return sock


def refused_and_closed(sock: socket.socket, packet: bytes) -> protocol.Error:
    """Send `packet` as a hello: the `error` it is answered with; the writer
    has closed the connection after it."""
    sock.send(packet)
    reply = protocol.decode(sock.recv(MAX_PACKET))
    assert isinstance(reply, protocol.Error)
    assert sock.recv(MAX_PACKET) == b""  # closed
    sock.close()
    return reply


def ask(sock: socket.socket, frame: bytes) -> protocol.Message:
    sock.send(frame)
    return protocol.decode(sock.recv(MAX_PACKET))


def test_the_lane_refuses_bad_hellos_and_hostile_packets_and_keeps_serving(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    keyring = auth.ensure_keys(state_dir)
    owner = WriterClient(ctx, state_dir, "agent-1", credential=keyring.credential("agent-1"))
    assert owner.append("agent/agent-1", "turn", {"n": 1}, key="k1").seq == 1
    assert owner.lane is not None and owner.lane.connects == 1 and owner.lane.fallbacks == 0
    before = wal_bytes(state_dir)

    # hellos: garbage, no password, a wrong one, another actor's, the operator
    # named with an agent's password, a name that is no actor's, oversized
    agent1 = keyring.credential("agent-1")
    for packet in (b"\xc1garbage", HELLO_PREFIX + b"agent-1",
                   HELLO_PREFIX + b"agent-1\n" + b"0" * 64,
                   HELLO_PREFIX + b"agent-2\n" + agent1.secret,
                   HELLO_PREFIX + b"operator\n" + agent1.secret,
                   HELLO_PREFIX + b"../x\n" + agent1.secret,
                   HELLO_PREFIX + b"\xff\xfe\n" + agent1.secret,
                   hello(agent1) + b"x" * 600):
        assert refused_and_closed(lane_socket(state_dir), packet).code == "forbidden", packet
    # a frame before any hello is a bad hello too: nothing of it is taken
    append = protocol.encode(protocol.Append(msg_id="f1", origin="agent-2", key="f1",
                                             stream="agent/agent-2", event="turn",
                                             payload=b"{}"))
    assert refused_and_closed(lane_socket(state_dir), append).code == "forbidden"
    # a first packet larger than any: frame_too_large, and closed
    assert refused_and_closed(lane_socket(state_dir), b"\x00" * (MAX_PACKET + 1)
                              ).code == "frame_too_large"
    # an empty first packet: the connection is closed
    sock = lane_socket(state_dir)
    sock.send(b"")
    assert sock.recv(MAX_PACKET) == b""
    sock.close()

    # agent-1's credential: what the ROUTER refuses, the lane refuses
    sock = lane_socket(state_dir)
    sock.send(hello(agent1))
    assert sock.recv(MAX_PACKET) == HELLO_OK
    forged = ask(sock, append)  # another agent's stream
    assert isinstance(forged, protocol.Error) and forged.code == "forbidden"
    answer = protocol.encode(protocol.Append(
        msg_id="f2", origin="operator", key="f2", stream="agent/agent-1",
        event="approval_answer", payload=b"{}", ledger="approvals"))
    forged = ask(sock, answer)  # an operator's fact on its own stream
    assert isinstance(forged, protocol.Error) and forged.code == "forbidden"
    # garbage, a frame over a packet, a deep one: typed errors, the connection stays
    garbled = ask(sock, b"\xc1garbage")
    assert isinstance(garbled, protocol.Error) and garbled.code == "malformed_frame"
    oversized = ask(sock, b"\x00" * (MAX_PACKET + 1))
    assert isinstance(oversized, protocol.Error) and oversized.code == "frame_too_large"
    deep: object = 1
    for _ in range(30):
        deep = [deep]
    too_deep = ask(sock, msgpack.packb({"v": 1, "kind": "ping", "msg_id": "d", "x": deep}))
    assert isinstance(too_deep, protocol.Error) and too_deep.code == "too_deep"
    # a reply (an unsolicited error or ack) is never answered; a ping still is
    sock.send(protocol.encode(protocol.Error(msg_id="e", code=protocol.ErrorCode.NOT_FOUND,
                                             detail="x")))
    pong = ask(sock, protocol.encode(protocol.Ping(msg_id="p1")))
    assert isinstance(pong, protocol.Pong) and pong.msg_id == "p1"
    sock.close()

    assert wal_bytes(state_dir) == before  # nothing of any of it is durable
    assert owner.append("agent/agent-1", "turn", {"n": 2}, key="k2").seq == 2
    assert owner.lane.fallbacks == 0
    stats = owner.stats()
    assert stats["lane_refused_total"] == 11  # the hellos and the oversized packets
    assert writer.poll() is None
    owner.close()


def test_a_connection_without_a_hello_is_closed_and_the_lane_has_a_cap(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """Past the cap a connection is answered recipient_busy, and a client
    refused so appends on the ROUTER instead; connections that never
    authenticate cannot hold the lane: they are closed after the hello
    timeout. (The cap is filled by connections that said hello, which no
    timeout closes, so nothing here races the 5 s.)"""
    writer = start_writer(processes, state_dir, ctx, "--lane-connections", "4")
    keyring = auth.ensure_keys(state_dir)
    holders = [lane_socket(state_dir) for _ in range(4)]
    for sock in holders:
        sock.send(hello(keyring.credential("agent-2")))
        assert sock.recv(MAX_PACKET) == HELLO_OK
    busy = lane_socket(state_dir)  # answered at once, before any hello
    reply = protocol.decode(busy.recv(MAX_PACKET))
    assert isinstance(reply, protocol.Error) and reply.code == "recipient_busy"
    assert busy.recv(MAX_PACKET) == b""
    busy.close()
    client = WriterClient(ctx, state_dir, "agent-1", credential=keyring.credential("agent-1"))
    assert client.append("agent/agent-1", "turn", {}, key="busy").seq == 1  # on the ROUTER
    assert client.lane is not None and client.lane.fallbacks == 1 and client.lane.connects == 0
    for sock in holders:
        sock.close()
    wait_for(lambda: client.stats()["lane_connections"] == 0, 30, "the holders' ends seen")
    silent = [lane_socket(state_dir) for _ in range(4)]
    for sock in silent:  # closed by the writer within the hello timeout (5 s)
        assert sock.recv(MAX_PACKET) == b""
        sock.close()
    stats = client.stats()
    assert stats["lane_hello_timeouts_total"] == 4 and stats["lane_connections"] == 0
    # the lane has room again: the client's next try after its pause takes it
    wait_for(lambda: _on_lane_after(client, connects=1), 30, "an append on the lane again")
    assert writer.poll() is None
    client.close()


def test_a_lane_peer_that_never_reads_loses_its_replies_not_the_writer(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """A connection that sends and never reads: its replies past the socket's
    buffer are dropped and counted (it would retry), the writer holds nothing
    more for it and serves everyone else."""
    writer = start_writer(processes, state_dir, ctx)
    keyring = auth.ensure_keys(state_dir)
    flooder = lane_socket(state_dir)
    flooder.send(hello(keyring.credential("agent-2")))
    assert flooder.recv(MAX_PACKET) == HELLO_OK
    for i in range(3000):  # ~3,000 pongs: far past what a socket buffer holds
        flooder.send(protocol.encode(protocol.Ping(msg_id=f"flood{i}")))
    owner = WriterClient(ctx, state_dir, "agent-1", credential=keyring.credential("agent-1"))
    wait_for(lambda: owner.stats()["dropped_total"] > 0, 30, "the flooder's replies dropped")
    assert owner.append("agent/agent-1", "turn", {}, key="served").seq == 1
    assert owner.lane is not None and owner.lane.fallbacks == 0
    pong = protocol.decode(flooder.recv(MAX_PACKET))  # what it did get is its own, in order
    assert isinstance(pong, protocol.Pong) and pong.msg_id == "flood0"
    flooder.close()
    assert writer.poll() is None
    owner.close()


_n = 0


def _on_lane_after(client: WriterClient, connects: int) -> bool:
    """Append once; whether the lane has made `connects` connections by now
    (the client leaves it alone a second after a fall-back)."""
    global _n  # noqa: PLW0603
    _n += 1
    client.append("agent/agent-1", "turn", {}, key=f"again{_n}")
    assert client.lane is not None
    return client.lane.connects == connects


def test_a_writer_killed_under_a_lane_client_loses_nothing_acknowledged(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """The writer dies with the lane connected: the next append goes to the
    ROUTER (which waits out the restart), a retried key is answered with its
    original seq, and the lane is used again once the new writer binds it."""
    writer = start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-1", timeout_s=5,
                          credential=auth.ensure_keys(state_dir).credential("agent-1"))
    first = client.append("agent/agent-1", "turn", {"n": 1}, key="a1")
    os.killpg(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    writer = start_writer(processes, state_dir, ctx)
    again = client.append("agent/agent-1", "turn", {"n": 1}, key="a1")
    assert (again.seq, again.duplicate) == (first.seq, True)
    assert client.lane is not None and client.lane.fallbacks == 1
    wait_for(lambda: _on_lane_after(client, connects=2), 30, "the lane used again")
    records = [(r.key, r.seq) for r in client.read_stream("agent/agent-1")]
    assert records[0] == ("a1", 1) and len(records) == len({k for k, _ in records})
    assert writer.poll() is None
    client.close()


def test_without_the_lane_appends_go_on_the_router(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_writer(processes, state_dir, ctx, "--lane-connections", "0")
    assert not lane_path(state_dir.run_dir).exists()
    client = WriterClient(ctx, state_dir, "agent-1",
                          credential=auth.ensure_keys(state_dir).credential("agent-1"))
    assert client.append("agent/agent-1", "turn", {}, key="r1").seq == 1
    assert client.lane is not None and client.lane.connects == 0
    with pytest.raises(RemoteError) as caught:  # the ROUTER's rules all the same
        client.append("agent/agent-2", "turn", {}, key="r2")
    assert caught.value.code == "forbidden"
    client.close()
    monkeypatch.setenv("CORRAL_WRITER_LANE", "0")
    off = WriterClient(ctx, state_dir, "agent-1")
    assert off.lane is None
    off.close()


def test_a_forked_child_never_shares_its_parents_lane_connection(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """A connection inherited through fork would mix two processes' replies
    on one socket: the child makes its own, the parent keeps its own."""
    start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "operator")
    assert client.append("agent/a", "turn", {}, key="parent-1").seq == 1
    assert client.lane is not None and client.lane.connects == 1
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the same client object, a connection of its own
        code = 1
        try:
            os.close(read_end)
            ok = client.append("agent/a", "turn", {}, key="child-1")
            assert client.lane is not None
            os.write(write_end, f"{ok.seq} {client.lane.connects} {client.lane.fallbacks}"
                     .encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert said == "2 2 0"  # its own hello (a second connect), on the lane
    assert client.append("agent/a", "turn", {}, key="parent-2").seq == 3
    assert (client.lane.connects, client.lane.fallbacks) == (1, 0)
    client.close()
