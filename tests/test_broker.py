"""The broker (broker/server.py) and its client (broker/peer.py) over real ipc
sockets and real processes, plus unit tests of the pure heartbeat rule."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from broker import auth, protocol
from broker.errors import RemoteError, RequestTimeoutError, StateDirError
from broker.heartbeat import HeartbeatRule, Liveness, PeerTable
from broker.parking import Parking
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

HB_MS = 100  # fast heartbeats: expiry after 0.3 s keeps the expiry tests short
HB_S = HB_MS / 1000.0
# Tests that are not about expiry keep the fast beats but expire a peer (or the
# broker, for a peer) only after 5 s of silence: at 3 misses a broker or test
# process stalled 0.3 s on a loaded machine expired a peer (its frames then
# bounced as unknown_recipient) or made it reconnect (its queued frames lost).
FAST_MISSES = 3
CALM_MISSES = 50


# --- helpers -------------------------------------------------------------------------
class Ctx(zmq.Context[zmq.Socket[bytes]]):
    """A context that closes every socket and peer a test opened, even on failure."""

    opened: list[BrokerPeer | zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context = Ctx()
    context.opened = []
    yield context
    for item in context.opened:
        item.close()
    context.destroy(linger=0)


def start_broker(
    processes: ProcessTracker, state_dir: StateDir, *extra: str, name: str = "broker",
    env: dict[str, str] | None = None, misses: int = CALM_MISSES,
) -> subprocess.Popen[bytes]:
    """Start a broker and return once it answers a ping (readiness is a message)."""
    proc = processes.spawn(
        ["-m", "broker.server", "--state-dir", str(state_dir.root),
         "--heartbeat-interval-ms", str(HB_MS), "--heartbeat-misses", str(misses),
         "--log-level", "debug", *extra],
        name=name, env=env,
    )
    with zmq.Context() as probe_ctx, probe_ctx.socket(zmq.DEALER) as probe:
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.IDENTITY, f"probe-{proc.pid}".encode())
        auth.authenticate(probe, state_dir)
        probe.connect(state_dir.endpoint("broker"))
        probe.send_multipart([b"broker", protocol.encode(protocol.Ping(msg_id="probe"))])

        def answered() -> bool:
            assert proc.poll() is None, processes.output(name)
            while probe.poll(50, zmq.POLLIN):
                if isinstance(protocol.decode(probe.recv_multipart()[1]), protocol.Pong):
                    return True
            return False

        # a fresh interpreter's imports alone take 5-10 s on a loaded machine
        wait_for(answered, 30, f"{name} to answer a ping")
    return proc


def start_echo(
    processes: ProcessTracker, state_dir: StateDir, name: str, misses: int = CALM_MISSES
) -> subprocess.Popen[bytes]:
    return processes.spawn(
        ["-m", "tests.broker_echo", "--state-dir", str(state_dir.root), "--name", name,
         "--heartbeat-interval-ms", str(HB_MS), "--heartbeat-misses", str(misses)],
        name=name,
    )


def peer(ctx: Ctx, state_dir: StateDir, name: str, misses: int = CALM_MISSES) -> BrokerPeer:
    p = BrokerPeer(ctx, state_dir, name, HB_S, misses)
    ctx.opened.append(p)
    return p


def raw_dealer(
    ctx: Ctx, state_dir: StateDir, identity: bytes | None
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    auth.authenticate(sock, state_dir)
    sock.connect(state_dir.endpoint("broker"))
    ctx.opened.append(sock)
    return sock


def recv_raw(sock: zmq.Socket[bytes], timeout_s: float = 20.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000), zmq.POLLIN), "no frame within the deadline"
    return sock.recv_multipart()


def broker_error(sock: zmq.Socket[bytes]) -> protocol.Error:
    """The next frame must be an `error` from the broker (heartbeats skipped)."""
    while True:
        frames = recv_raw(sock)
        assert frames[0] == b"broker"
        message = protocol.decode(frames[1])
        if isinstance(message, protocol.Error):
            return message
        assert isinstance(message, protocol.Heartbeat)


def ping_until_served(p: BrokerPeer, to: str = "broker", timeout_s: float = 10) -> protocol.Message:
    return wait_for(
        lambda: _try_ping(p, to), timeout_s, f"{to} to answer a ping through the broker"
    )


def _try_ping(p: BrokerPeer, to: str) -> protocol.Message | None:
    try:
        return p.request(to, protocol.Ping(msg_id=new_msg_id()), timeout_s=0.5, retries=0)
    except (RequestTimeoutError, RemoteError):
        return None


def broker_events(state_dir: StateDir, event: str) -> list[dict[str, Any]]:
    path = state_dir.log_path("broker")
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def stats(p: BrokerPeer) -> dict[str, int | float]:
    reply = p.request("broker", protocol.StatsRequest(msg_id=new_msg_id()), timeout_s=2)
    assert isinstance(reply, protocol.Stats)
    return reply.values


# --- pure parts ----------------------------------------------------------------------
def test_heartbeat_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        HeartbeatRule(0, 3)
    with pytest.raises(ValueError):
        HeartbeatRule(1.0, 0)
    assert HeartbeatRule(0.5, 4).expiry_s == 2.0


def test_peer_table_expires_only_peers_silent_past_interval_times_misses() -> None:
    table = PeerTable(HeartbeatRule(1.0, 3))
    assert table.touch(b"a", 0.0) is True
    assert table.touch(b"a", 0.5) is False
    table.touch(b"b", 2.0)
    assert table.expire(3.5) == []  # a silent 3.0 s: exactly the limit, still alive
    assert table.expire(3.6) == [(b"a", pytest.approx(3.1))]
    assert table.names() == [b"b"]
    assert table.forget(b"b") is True
    assert table.forget(b"b") is False
    assert len(table) == 0


def test_liveness_beats_once_per_interval_and_dies_after_misses() -> None:
    live = Liveness(HeartbeatRule(1.0, 3), last_heard=0.0)
    assert live.beat_due(0.0) is True
    assert live.beat_due(0.5) is False
    assert live.beat_due(1.0) is True
    assert live.next_deadline() == 2.0
    assert not live.dead(3.0)
    assert live.dead(3.01)
    live.reset(10.0)
    assert not live.dead(12.0)
    assert live.beat_due(10.0) is True



def test_parking_counts_handshakes_no_frame_followed_past_the_grace() -> None:
    """broker/parking.py: a handshake is parked once the grace passed with no
    new routing id seen; a first frame read before its handshake event still
    matches it; a renewal is due only past the minimum interval, and resets."""
    parking = Parking(0.0, grace_s=5.0, min_interval_s=10.0)
    for at in (1.0, 2.0, 3.0):
        parking.handshake(at)
    parking.seen(b"\0aaaa")
    parking.seen(b"\0aaaa")  # its second frame: no second connection
    assert parking.parked(6.9) == 0  # the two left are 4.9 and 3.9 s old
    assert parking.parked(7.0) == 1
    assert parking.parked(8.0) == 2
    assert parking.due(8.0) == 0  # the socket is younger than the interval
    assert parking.due(10.0) == 2
    parking.seen(b"\0bbbb")  # a first frame before its handshake event
    parking.handshake(10.5)
    assert parking.parked(30.0) == 2
    parking.renewed(30.0, 2)
    assert (parking.renewals_total, parking.parked_total) == (1, 2)
    assert parking.parked(60.0) == 0 and parking.due(39.0) == 0
    parking.handshake(31.0)
    parking.seen(b"\0aaaa")  # after a renewal an id is new again
    parking.handshake(32.0)
    parking.forget(b"\0aaaa")  # gone: the same id claimed again is another connection
    parking.seen(b"\0aaaa")
    assert parking.due(45.0) == 0


def test_peer_refuses_reserved_and_invalid_names(
    ctx: Ctx, state_dir: StateDir
) -> None:
    with pytest.raises(StateDirError):
        BrokerPeer(ctx, state_dir, "broker")
    with pytest.raises(StateDirError):
        BrokerPeer(ctx, state_dir, "no spaces")


# --- process level --------------------------------------------------------------------


@pytest.mark.process
def test_run_dir_is_0700_and_socket_private(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    start_broker(processes, state_dir)
    assert stat.S_IMODE(state_dir.run_dir.stat().st_mode) == 0o700
    sock_mode = stat.S_IMODE((state_dir.run_dir / "broker.sock").stat().st_mode)
    assert sock_mode & 0o077 == 0, oct(sock_mode)


@pytest.mark.process
def test_request_reply_between_separate_processes(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """A peer in the test process asks an echo peer in another process through a
    broker in a third; the reply carries the request's msg_id and the echo's pid."""
    start_broker(processes, state_dir)
    echo = start_echo(processes, state_dir, "echo")
    a = peer(ctx, state_dir, "alice")
    ping_until_served(a, "echo")
    for _ in range(20):
        msg_id = new_msg_id()
        reply = a.request("echo", protocol.Ping(msg_id=msg_id), timeout_s=2, retries=1)
        assert isinstance(reply, protocol.Pong)
        assert (reply.msg_id, reply.actor, reply.pid) == (msg_id, "echo", echo.pid)
    assert stats(a)["routed_total"] >= 40
    a.close()


@pytest.mark.process
def test_routes_both_ways_between_peers_and_keeps_other_traffic(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """The recipient sees [from, body]; a message arriving while a request waits
    is kept for recv(), not dropped."""
    start_broker(processes, state_dir)
    a, b = peer(ctx, state_dir, "a"), peer(ctx, state_dir, "b")
    ping_until_served(a)
    ping_until_served(b)
    a.send("b", protocol.Ping(msg_id="hello-1"))
    got = b.recv(10)
    assert got == ("a", protocol.Ping(msg_id="hello-1"))
    b.send("a", protocol.Ping(msg_id="unrelated-1"))  # b's own request to a
    b.send("a", protocol.Pong(msg_id="hello-1", actor="b", pid=1))
    # a is waiting for nothing yet: both are delivered in order
    assert a.recv(10) == ("b", protocol.Ping(msg_id="unrelated-1"))
    assert a.recv(10) == ("b", protocol.Pong(msg_id="hello-1", actor="b", pid=1))
    # while a request to the broker is pending, b's message is buffered
    b.send("a", protocol.Ping(msg_id="unrelated-2"))
    assert wait_for(lambda: a.poll(0.05), 10, "b's ping to reach a")
    assert isinstance(a.request("broker", protocol.Ping(msg_id="p-2"), timeout_s=2), protocol.Pong)
    assert a.recv(0) == ("b", protocol.Ping(msg_id="unrelated-2"))
    assert a.recv(0) is None


@pytest.mark.process
def test_unknown_recipient_gets_typed_error_with_msg_id(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    start_broker(processes, state_dir)
    a = peer(ctx, state_dir, "a")
    ping_until_served(a)
    with pytest.raises(RemoteError) as info:
        a.request("nobody", protocol.Ping(msg_id="to-nobody-1"), timeout_s=10, retries=0)
    assert info.value.code == "unknown_recipient"
    # the same through send/recv: the error names the msg_id it refuses
    a.send("nobody", protocol.Ping(msg_id="to-nobody-2"))
    got = a.recv(10)
    assert got is not None
    sender, error = got
    assert sender == "broker"
    assert isinstance(error, protocol.Error)
    assert (error.code, error.msg_id) == (protocol.ErrorCode.UNKNOWN_RECIPIENT, "to-nobody-2")
    assert broker_events(state_dir, "route_failed")[-1]["msg_id"] == "to-nobody-2"
    assert stats(a)["unknown_recipient_total"] == 2


@pytest.mark.process
def test_malformed_control_frames_get_typed_errors_and_broker_stays_up(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    start_broker(processes, state_dir)
    sock = raw_dealer(ctx, state_dir, b"mallory")
    nested: object = {"v": 1, "kind": "ping", "msg_id": "deep-1"}
    for _ in range(40):
        nested = {"v": 1, "kind": "ping", "msg_id": "deep-1", "x": nested}
    cases: list[tuple[bytes, protocol.ErrorCode, str | None]] = [
        (b"\xc1not msgpack", protocol.ErrorCode.MALFORMED_FRAME, None),
        (msgpack.packb([1, 2, 3]), protocol.ErrorCode.MALFORMED_FRAME, None),
        (msgpack.packb(nested), protocol.ErrorCode.TOO_DEEP, "deep-1"),
        (msgpack.packb({"v": 1, "kind": "nope", "msg_id": "k-1"}),
         protocol.ErrorCode.UNKNOWN_KIND, "k-1"),
        (msgpack.packb({"v": 1, "kind": "ping", "msg_id": "x-1", "extra": 1}),
         protocol.ErrorCode.INVALID_MESSAGE, "x-1"),
        (msgpack.packb({"v": 9, "kind": "ping", "msg_id": "v-1"}),
         protocol.ErrorCode.UNSUPPORTED_VERSION, "v-1"),
        (protocol.encode(protocol.StatusRequest(msg_id="u-1")),
         protocol.ErrorCode.UNEXPECTED_MESSAGE, "u-1"),  # a request it does not serve
    ]
    for body, code, msg_id in cases:
        sock.send_multipart([b"broker", body])
        error = broker_error(sock)
        assert (error.code, error.msg_id) == (code, msg_id), body[:40]
    rejected = broker_events(state_dir, "frame_rejected")
    assert {r["code"] for r in rejected} >= {c.value for _, c, _ in cases}
    sock.close()
    a = peer(ctx, state_dir, "a")
    assert isinstance(ping_until_served(a), protocol.Pong)


@pytest.mark.process
def test_wrong_frame_count_bad_names_and_anonymous_senders_are_refused(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    start_broker(processes, state_dir)
    sock = raw_dealer(ctx, state_dir, b"mallory")
    ping = protocol.encode(protocol.Ping(msg_id="f-1"))
    sock.send(ping)  # one frame: no recipient
    assert broker_error(sock).code == protocol.ErrorCode.MALFORMED_FRAME
    sock.send_multipart([b"a", b"b", ping])  # three frames
    assert broker_error(sock).code == protocol.ErrorCode.MALFORMED_FRAME
    sock.send_multipart([b"bad name!", ping])
    error = broker_error(sock)
    assert (error.code, error.msg_id) == (protocol.ErrorCode.MALFORMED_FRAME, "f-1")
    anonymous = raw_dealer(ctx, state_dir, None)
    anonymous.send_multipart([b"broker", ping])
    assert broker_error(anonymous).code == protocol.ErrorCode.MALFORMED_FRAME
    a = peer(ctx, state_dir, "a")
    assert isinstance(ping_until_served(a), protocol.Pong)
    assert stats(a)["rejected_total"] >= 4


@pytest.mark.process
def test_garbage_routed_to_a_peer_is_answered_by_that_peer(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """The broker routes bodies without decoding them; the recipient refuses a
    bad one with a typed error to the sender and keeps serving."""
    start_broker(processes, state_dir)
    b = peer(ctx, state_dir, "b")
    ping_until_served(b)
    sock = raw_dealer(ctx, state_dir, b"mallory")
    sock.send_multipart([b"b", msgpack.packb({"v": 1, "kind": "ping", "msg_id": "g-1", "x": 1})])

    def answered() -> list[bytes] | None:
        # b reads (and refuses) the garbage only inside recv: keep it reading until
        # its error reaches mallory (one recv of 0.5 s lost when the frame came later)
        assert b.recv(0.05) is None  # the bad body is never delivered as a message
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart()
            if frames[0] != b"broker":  # heartbeats to a newly registered peer
                return frames
        return None

    frames = wait_for(answered, 20, "b's error to reach the sender")
    assert frames[0] == b"b"
    error = protocol.decode(frames[1])
    assert isinstance(error, protocol.Error)
    assert (error.code, error.msg_id) == (protocol.ErrorCode.INVALID_MESSAGE, "g-1")
    assert b.statistics().rejected_total == 1


@pytest.mark.process
def test_frame_over_maxmsgsize_drops_only_that_connection(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """ZeroMQ enforces MAXMSGSIZE by dropping the offender's connection; other
    peers are still served, and the offender is served again after it reconnects."""
    start_broker(processes, state_dir, "--max-frame-bytes", "4096")
    a = peer(ctx, state_dir, "a")
    ping_until_served(a)
    big = raw_dealer(ctx, state_dir, b"big")
    big.send_multipart([b"broker", protocol.encode(protocol.Ping(msg_id="small-1"))])
    assert isinstance(protocol.decode(recv_raw(big)[1]), protocol.Heartbeat | protocol.Pong)
    dropped = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big.send_multipart([b"a", b"\x00" * 10_000])
    # positive: the broker's end dropped the connection (a 0.3 s silence at a alone
    # could not tell a dropped frame from one a stalled broker had not routed yet)
    assert dropped.poll(20_000), "the offender's connection was not dropped"
    big.disable_monitor()
    dropped.close(linger=0)
    assert a.recv(0.3) is None  # never delivered
    assert isinstance(a.request("broker", protocol.Ping(msg_id="after-1")), protocol.Pong)
    big.close()
    again = peer(ctx, state_dir, "big")
    assert isinstance(ping_until_served(again), protocol.Pong)
    assert stats(again)["routed_total"] == 0  # the big frame was never routed


@pytest.mark.process
def test_broker_sigkill_and_restart_every_request_completes_or_times_out(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    broker = start_broker(processes, state_dir)
    start_echo(processes, state_dir, "echo")
    a = peer(ctx, state_dir, "a", misses=FAST_MISSES)  # its reconnect is under test
    ping_until_served(a, "echo")
    outcomes: list[str] = []

    def one_request(timeout_s: float = 0.3) -> None:
        msg_id = new_msg_id()
        try:
            reply = a.request("echo", protocol.Ping(msg_id=msg_id), timeout_s=timeout_s, retries=2)
        except RequestTimeoutError:
            outcomes.append("timeout")
        else:
            assert isinstance(reply, protocol.Pong)
            assert reply.msg_id == msg_id
            outcomes.append("ok")

    for _ in range(10):
        one_request()
    reconnects = a.reconnects  # one may come from a stall under load: count from here
    os.kill(broker.pid, signal.SIGKILL)
    broker.wait(5)
    for _ in range(3):  # no broker at all: explicit timeouts, never a hang
        one_request()
    assert outcomes[-3:] == ["timeout"] * 3
    assert a.reconnects > reconnects
    start_broker(processes, state_dir, name="broker2")
    wait_for(lambda: (one_request(), outcomes[-1] == "ok")[1], 30, "requests to complete again")
    # served again: every request completes; 0.3 s a try (three hops through three
    # processes) is a bet a loaded machine can lose, so these get 2 s a try
    for _ in range(10):
        one_request(timeout_s=2.0)
    assert outcomes[-10:] == ["ok"] * 10
    assert set(outcomes) <= {"ok", "timeout"}


@pytest.mark.process
def test_silent_peer_expires_and_killed_peer_is_forgotten(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """A hung peer (SIGSTOP: connected but silent) is expired after
    interval x misses; a killed one is dropped when its heartbeat bounces."""
    start_broker(processes, state_dir, misses=FAST_MISSES)
    hung = start_echo(processes, state_dir, "hung")
    dead = start_echo(processes, state_dir, "dead")
    a = peer(ctx, state_dir, "a")
    ping_until_served(a, "hung")
    ping_until_served(a, "dead")
    os.kill(hung.pid, signal.SIGSTOP)
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait(5)

    def gone() -> bool:
        a.recv(0.02)  # keep our own heartbeats going
        names = {r["peer"] for r in broker_events(state_dir, "peer_expired")}
        names |= {r["peer"] for r in broker_events(state_dir, "peer_disconnected")}
        return {"hung", "dead"} <= names

    wait_for(gone, 30, "both peers to be expired or dropped")
    expired = [r for r in broker_events(state_dir, "peer_expired") if r["peer"] == "hung"]
    # expiry is strictly past interval x misses; the log rounds to the millisecond,
    # so a peer expired 0.3004 s after its last beat is logged as 0.3. A stall under
    # load may have expired hung (or a) before too: every expiry obeys the rule
    assert expired and all(r["silent_s"] >= FAST_MISSES * HB_S for r in expired)
    # a (re-registered by this very request if a stall expired it) is the one left
    assert stats(a)["peers"] == 1
    os.kill(hung.pid, signal.SIGCONT)


def test_a_quiet_peer_is_neither_beaten_to_nor_expired_until_it_speaks() -> None:
    table = PeerTable(HeartbeatRule(1.0, 3))
    table.touch(b"idle", 0.0)
    table.touch(b"busy", 0.0)
    table.hush(b"idle")
    table.hush(b"never-seen")  # only a known peer goes quiet
    assert table.names() == [b"busy"] and len(table) == 2
    assert table.expire(10.0) == [(b"busy", 10.0)]
    table.touch(b"idle", 11.0)  # it spoke: beats and expiry again
    assert table.names() == [b"idle"] and table.expire(15.0) == [(b"idle", 4.0)]


@pytest.mark.process
def test_an_idle_peer_costs_no_heartbeat_and_comes_back_after_a_broker_restart(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """docs/broker.md, "Idle peers": a hushed peer is not expired however
    long it is silent and is sent no heartbeat; a restarted broker learns of
    it from its reconnect, so it is routable again without a beat."""
    broker = start_broker(processes, state_dir, misses=FAST_MISSES)
    a = peer(ctx, state_dir, "a", misses=FAST_MISSES)
    q = peer(ctx, state_dir, "q", misses=FAST_MISSES)
    ping_until_served(a)
    ping_until_served(q)  # registered, then idle
    q.hush()
    window = FAST_MISSES * HB_S
    settle = time.monotonic() + 5 * window  # beats sent before the broker read the hush
    while time.monotonic() < settle:
        a.recv(0.02)  # a keeps beating
        q.recv(0)  # q reads what was already on its way
    quiet = time.monotonic() + 10 * window  # then ten expiry windows unread
    while time.monotonic() < quiet:
        a.recv(0.02)
        q.tick()
    assert "q" not in {r["peer"] for r in broker_events(state_dir, "peer_expired")}
    assert q.socket.poll(0, zmq.POLLIN) == 0  # no heartbeat came to it
    assert stats(a)["peers"] == 2 and q.reconnects == 0

    broker.kill()
    broker.wait(10)
    start_broker(processes, state_dir, misses=FAST_MISSES, name="broker2")

    def routable() -> bool:
        q.tick()  # reads its socket's monitor: a new connection is told "idle"
        with contextlib.suppress(RequestTimeoutError, RemoteError):
            a.send("q", protocol.Ping(msg_id=new_msg_id()))
            got = q.recv(0.2)
            return got is not None and isinstance(got[1], protocol.Ping)
        return False

    wait_for(routable, 20, "the idle peer routable through the restarted broker")
    assert q.reconnects == 0  # libzmq's reconnect, not a Paranoid Pirate one


@pytest.mark.process
def test_a_quiet_peer_that_goes_away_is_forgotten_at_the_next_probe(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    start_broker(processes, state_dir, "--quiet-probe-s", "0.5", misses=FAST_MISSES)
    a = peer(ctx, state_dir, "a", misses=FAST_MISSES)
    gone = BrokerPeer(ctx, state_dir, "gone", HB_S, FAST_MISSES)
    ping_until_served(a)
    ping_until_served(gone)
    gone.hush()
    gone.close()  # its connection ends without a word

    def forgotten() -> bool:
        a.recv(0.02)
        return "gone" in {r["peer"] for r in broker_events(state_dir, "peer_disconnected")}

    wait_for(forgotten, 20, "the quiet peer's probe to bounce")
    assert "gone" not in {r["peer"] for r in broker_events(state_dir, "peer_expired")}
    assert stats(a)["peers"] == 1


@pytest.mark.process
def test_peer_reconnects_when_broker_goes_silent(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    broker = start_broker(processes, state_dir)
    a = peer(ctx, state_dir, "a", misses=FAST_MISSES)
    ping_until_served(a)
    reconnects = a.reconnects  # a stall under load may have made one already
    os.kill(broker.pid, signal.SIGSTOP)
    wait_for(lambda: (a.recv(0.02), a.reconnects > reconnects)[1], 20,
             "the peer to reconnect")
    os.kill(broker.pid, signal.SIGCONT)
    assert isinstance(ping_until_served(a), protocol.Pong)


@pytest.mark.process
def test_sigterm_exits_zero_and_logs_broker_stopped(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    broker = start_broker(processes, state_dir)
    a = peer(ctx, state_dir, "a")
    ping_until_served(a)
    broker.send_signal(signal.SIGTERM)
    assert broker.wait(5) == 0
    stopped = broker_events(state_dir, "broker_stopped")
    assert stopped
    assert stopped[0]["routed_total"] == 0


@pytest.mark.process
def test_supervised_broker_reports_ready_and_heartbeats(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    control = ctx.socket(zmq.ROUTER)
    ctx.opened.append(control)
    control.setsockopt(zmq.LINGER, 0)
    endpoint = state_dir.endpoint("supervisor")
    auth.stand_in_server(ctx, control, state_dir)
    control.bind(endpoint)
    broker = start_broker(
        processes, state_dir, env={"CORRAL_CONTROL": endpoint, "CORRAL_ACTOR": "broker"}
    )
    ident, frame = recv_raw(control)
    assert ident == b"broker"
    assert protocol.decode(frame) == protocol.Ready(actor="broker", pid=broker.pid)
    ident, frame = recv_raw(control)
    beat = protocol.decode(frame)
    assert isinstance(beat, protocol.Heartbeat)
    assert "routed_total" in beat.values
    control.close()


def test_a_second_broker_on_the_same_state_dir_is_refused_naming_the_holder(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    first = start_broker(processes, state_dir)
    second = processes.spawn(
        ["-m", "broker.server", "--state-dir", str(state_dir.root)], name="broker2"
    )
    assert second.wait(timeout=30) == 75  # its imports alone take 5-10 s under load
    assert f"pid {first.pid}" in processes.output("broker2")
    assert first.poll() is None


@pytest.mark.process
def test_a_lost_reply_costs_one_resend_interval_not_the_whole_attempt(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    """A reply lost on the way (the broker restarted as the recipient answered:
    a soak run waited out a foreground command's whole 130 s attempt for it)
    is asked for again within `resend_s`: bob drops the first copy of the
    request and answers the resend. Without the resend the request waits its
    300 s attempt, past the test's timeout."""
    start_broker(processes, state_dir)
    a, b = peer(ctx, state_dir, "alice"), peer(ctx, state_dir, "bob")
    ping_until_served(a)
    ping_until_served(b)
    got: list[str] = []
    stop = threading.Event()

    def bob() -> None:  # drops the first copy of each request, answers the next
        while not stop.is_set():
            item = b.recv(0.05)
            if item is None:
                continue
            sender, message = item
            msg_id = getattr(message, "msg_id", "")
            got.append(msg_id)
            if got.count(msg_id) >= 2:
                b.send(sender, protocol.Pong(msg_id=msg_id, actor="bob", pid=os.getpid()))

    thread = threading.Thread(target=bob, daemon=True)
    thread.start()
    try:
        reply = a.request("bob", protocol.Ping(msg_id="slow-1"), timeout_s=300, retries=0,
                          resend_s=0.2)
    finally:
        stop.set()
        thread.join(5)
    assert isinstance(reply, protocol.Pong) and reply.msg_id == "slow-1"
    assert got.count("slow-1") >= 2  # the first copy was dropped: the resend was answered
