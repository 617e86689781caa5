"""Actors on other hosts reach the writer over tcp:// only with CURVE: an
authorized key appends (as the actor its key file names), an unknown key or no
key gets nothing, plain tcp:// is refused at start-up, and the writer keeps
serving throughout."""

from __future__ import annotations

import stat
from collections.abc import Iterator

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.process import EXIT_CONFIG
from broker import curve
from broker.errors import AuthRefusedError, RemoteError, RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_tcp_with_curve_admits_only_authorized_keys(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    keys = curve.keys_dir(state_dir.root)
    curve.generate(keys, clients=("local", "remote-agent"))
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    writer = processes.spawn(
        [
            "-m",
            "actors.writer",
            "--state-dir",
            str(state_dir.root),
            "--curve",
            "--tcp",
            "tcp://127.0.0.1:*",
        ],
        name="writer",
    )
    endpoints_file = state_dir.run_dir / "writer.endpoints"
    wait_for(endpoints_file.exists, 30, "the writer to publish its endpoints")
    tcp = next(e for e in endpoints_file.read_text().split() if e.startswith("tcp://"))

    remote = WriterClient(
        ctx,
        state_dir,
        "remote-agent",
        endpoint=tcp,
        timeout_s=1,
        retries=5,
        curve=curve.load_client(keys, "remote-agent"),
    )
    assert remote.append("agent/remote-agent", "turn", {"over": "tcp"}, key="r1").seq == 1
    local = WriterClient(ctx, state_dir, "local", curve=curve.load_client(keys, "local"))
    assert local.append("agent/local", "turn", {}, key="l1").seq == 2
    with pytest.raises(RemoteError, match="forbidden"):  # the key is remote-agent's, not x's
        remote.append("agent/x", "turn", {}, key="r-forged", origin="x")

    # a keypair the writer never authorized, and a client with no CURVE at all
    stranger_dir = state_dir.root.parent / "stranger"
    curve.generate(stranger_dir, clients=("stranger",))
    forged = curve.CurveClient(
        server_public=curve.load_client(keys, "local").server_public,
        public=curve.load_client(stranger_dir, "stranger").public,
        secret=curve.load_client(stranger_dir, "stranger").secret,
    )
    for intruder in (
        WriterClient(ctx, state_dir, "x", endpoint=tcp, timeout_s=0.3, retries=1, curve=forged),
        WriterClient(ctx, state_dir, "y", endpoint=tcp, timeout_s=0.3, retries=1),
    ):
        try:
            # refused at the handshake: the client says so (AuthRefusedError) once the
            # refusal reached its monitor, else its attempts time out; never written
            with pytest.raises((AuthRefusedError, RequestTimeoutError)):
                intruder.append("agent/x", "turn", {}, key="evil")
        finally:
            intruder.close()
    assert writer.poll() is None
    assert remote.append("agent/remote-agent", "turn", {}, key="r2").seq == 3
    assert [r.key for r in remote.read_stream("agent/remote-agent")] == ["r1", "r2"]
    remote.close()
    local.close()


def test_plain_tcp_is_refused_at_start(processes: ProcessTracker, state_dir: StateDir) -> None:
    proc = processes.spawn(
        ["-m", "actors.writer", "--state-dir", str(state_dir.root), "--tcp", "tcp://127.0.0.1:*"],
        name="writer",
    )
    assert proc.wait(timeout=30) == EXIT_CONFIG
    assert "only with CURVE" in processes.output("writer")


def test_broker_routes_between_a_tcp_peer_and_a_local_peer_with_curve(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    from broker import protocol
    from broker.peer import BrokerPeer

    keys = curve.keys_dir(state_dir.root)
    curve.generate(keys, clients=("local-agent", "remote-agent"))
    broker = processes.spawn(
        [
            "-m",
            "broker.server",
            "--state-dir",
            str(state_dir.root),
            "--curve",
            "--tcp",
            "tcp://127.0.0.1:*",
        ],
        name="broker",
    )
    endpoints_file = state_dir.run_dir / "broker.endpoints"
    wait_for(endpoints_file.exists, 30, "the broker to publish its endpoints")
    tcp = next(e for e in endpoints_file.read_text().split() if e.startswith("tcp://"))
    local = BrokerPeer(ctx, state_dir, "local-agent",
                       curve=curve.load_client(keys, "local-agent"))
    remote = BrokerPeer(ctx, tcp, "remote-agent", curve=curve.load_client(keys, "remote-agent"))
    try:
        # the local peer must be known to the broker before it can be routed to
        local.request("broker", protocol.Ping(msg_id="hello-local"), timeout_s=2, retries=3)
        remote.send("local-agent", protocol.Ping(msg_id="over-tcp"))
        got = wait_for(lambda: local.recv(0.05), 10, "the routed ping")
        sender, message = got
        assert sender == "remote-agent" and isinstance(message, protocol.Ping)
        assert message.msg_id == "over-tcp"
        assert broker.poll() is None
    finally:
        local.close()
        remote.close()
