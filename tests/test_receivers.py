"""Each receiver's own receive path, in process, fed arbitrary bytes and
arbitrary msgpack values: the writer's frame handler, the broker's slow path
(wrong names, bodies to the broker), the supervisor's control socket, a
BrokerPeer's reader, and the zygote's datagram parsers. Nothing may escape
any of them; whatever they answer is a decodable frame."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import zygotewire
from actors.writer.process import Writer, WriterOptions
from broker import protocol
from broker.heartbeat import HeartbeatRule
from broker.peer import BrokerPeer
from broker.server import Broker
from broker.statedir import StateDir
from supervisor.runtime.control import ControlServer

Context = zmq.Context[zmq.Socket[bytes]]
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
_ENDPOINTS = itertools.count()

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.binary(max_size=3), inner, max_size=4),
    max_leaves=12,
)
kinds = st.sampled_from(sorted(protocol.REQUEST_KINDS | protocol.REPLY_KINDS)) | scalars
maps = st.builds(
    lambda kind, msg_id, rest: {"v": 1, "kind": kind, "msg_id": msg_id, **rest},
    kinds, st.text(max_size=8) | scalars, st.dictionaries(st.text(max_size=8), values,
                                                          max_size=4),
)
frames = (st.binary(max_size=300) | values.map(msgpack.packb) | maps.map(msgpack.packb)
          | st.just(msgpack.packb({"v": 1, "kind": [], "msg_id": "x"})))


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def writer(state_dir: StateDir, ctx: Context) -> Iterator[Writer]:
    w = Writer(state_dir, WriterOptions())
    w.lock()
    w.recover()
    w.bind(ctx)
    try:
        yield w
    finally:
        w.transport.sock.close(linger=0)
        w.close()


@given(frames)
@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURES)
def test_the_writer_handles_any_frame(writer: Writer, frame: bytes) -> None:
    writer._handle("operator", [b"fuzz", frame])
    writer._handle("operator", [b"fuzz", frame, frame])  # a wrong frame count, too


@given(frames, st.sampled_from([b"broker", b"nobody", b"bad name!", b"", b"\xff" * 70]),
       st.sampled_from([b"fuzz", b"\x00anon", b"broker"]))
@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURES)
def test_the_broker_handles_any_frame(
    state_dir: StateDir, ctx: Context, frame: bytes, to: bytes, sender: bytes
) -> None:
    broker = _broker(state_dir, ctx)
    broker._slow([sender, to, frame], 0.0)
    broker._slow([sender, frame], 0.0)
    broker._slow([sender, to, frame, frame], 0.0)


_BROKERS: dict[str, Broker] = {}


def _broker(state: StateDir, ctx: Context) -> Broker:
    """One bound broker per state directory (hypothesis reuses the fixtures)."""
    key = str(state.root)
    if key not in _BROKERS:
        _BROKERS.clear()
        _BROKERS[key] = Broker(ctx, state.endpoint("broker"), HeartbeatRule(1.0, 3))
    return _BROKERS[key]


@given(frames)
@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURES)
def test_the_control_socket_handles_any_frame(state_dir: StateDir, ctx: Context,
                                              frame: bytes) -> None:
    server = _control(state_dir, ctx)
    incoming = server._accept([b"fuzz", frame], "operator")
    assert incoming is None or not protocol.is_reply(incoming.message) or \
        incoming.message.kind in ("ready", "heartbeat")
    assert server._accept([b"fuzz", frame, frame], "operator") is None


_CONTROLS: dict[str, ControlServer] = {}


def _control(state: StateDir, ctx: Context) -> ControlServer:
    key = str(state.root)
    if key not in _CONTROLS:
        _CONTROLS.clear()
        _CONTROLS[key] = ControlServer(ctx, state)
    return _CONTROLS[key]


@given(st.lists(frames, min_size=1, max_size=5))
@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURES)
def test_a_broker_peer_reads_any_frame_and_answers_no_reply(ctx: Context,
                                                            batch: list[bytes]) -> None:
    endpoint = f"inproc://peer-{next(_ENDPOINTS)}"
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    peer = BrokerPeer(ctx, endpoint, "target", heartbeat_interval_s=10.0)
    try:
        peer.send_frame("broker", protocol.encode(protocol.Ping(msg_id="hello")))
        assert router.poll(5000, zmq.POLLIN)
        identity = router.recv_multipart()[0]
        for frame in batch:
            router.send_multipart([identity, b"mallory", frame])
        router.send_multipart([identity, b"mallory", protocol.encode(protocol.Ping(msg_id="end"))])
        seen = []
        while True:
            item = peer.recv(5.0)
            assert item is not None, "the closing ping never arrived"
            seen.append(item)
            if item[1] == protocol.Ping(msg_id="end"):
                break
        # whatever the peer answered: decodable errors, none to a reply or notice
        answers = []
        while router.poll(0, zmq.POLLIN):
            _, to, body = router.recv_multipart()
            if to == b"broker":
                continue  # its heartbeat
            assert to == b"mallory"
            answers.append(protocol.decode(body))
        assert all(isinstance(a, protocol.Error) for a in answers)
        answerable = sum(1 for f in batch if not protocol.peek(f).is_reply)
        assert len(answers) <= answerable
    finally:
        peer.close()
        router.close(linger=0)


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_the_zygote_datagram_parsers_take_any_bytes(data: bytes) -> None:
    request = zygotewire.parse_request(data)
    assert request is None or isinstance(request, zygotewire.ForkRequest)
    try:
        reply = zygotewire.parse_reply(data)
    except ValueError:
        return
    assert isinstance(reply, zygotewire.Ready | zygotewire.Forked | zygotewire.ForkFailed)
