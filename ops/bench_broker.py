"""Broker benchmark (`python ops/bench.py broker --json`): round trips and
one-way throughput through a real broker process, against a direct
DEALER -> ROUTER pair measured in the same run with the same message sizes.

Peer B always runs in its own process (`python -m ops.bench_broker echo ...`);
peer A is this process. Bodies are opaque bytes (the broker never decodes
them), tagged by their first byte: E echo, S stream item, A ack (credit), P
"produce N items to me". One-way streams use credit (at most WINDOW in
flight, an ack every ACK_EVERY) so that nothing is dropped at a high-water mark.

Last, the churn of issue 38: 10,000 connections (2,000 with --quick) made
with agent-1's credential that claim the identity `agent-9`, each pings the
broker (refused `forbidden`) and closes, 50 at a time; `fds_after_churn`
(the broker's open fds once they are closed, waited for up to 30 s) must
equal `fds_before`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

from broker import auth, protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir, bind_umask

REPO_ROOT = Path(__file__).resolve().parent.parent
MSG_BYTES = 200
WINDOW = 400
ACK_EVERY = 100
POLL_MS = 5000
Ctx = zmq.Context[zmq.Socket[bytes]]


# --- the two ends of every measurement ---------------------------------------------
def _produce(sock: zmq.Socket[bytes], head: list[bytes], n: int) -> None:
    """Send n stream items under credit; return when all are acknowledged."""
    body = b"S" + b"x" * (MSG_BYTES - 1)
    sent = acked = 0
    while acked < n:
        while sent < n and sent - acked < WINDOW:
            sock.send_multipart([*head, body])
            sent += 1
        if not sock.poll(POLL_MS, zmq.POLLIN):
            raise TimeoutError(f"no ack after {acked}/{n} items")
        frames = sock.recv_multipart()
        if frames[-1][:1] == b"A":
            acked = max(acked, int(frames[-1][1:]))


def _consume(sock: zmq.Socket[bytes], n: int) -> None:
    """Receive n stream items, acknowledging every ACK_EVERY (and the last)."""
    count = 0
    while count < n:
        if not sock.poll(POLL_MS, zmq.POLLIN):
            raise TimeoutError(f"stream stalled after {count}/{n} items")
        frames = sock.recv_multipart()
        if frames[-1][:1] != b"S":
            continue
        count += 1
        if count % ACK_EVERY == 0 or count == n:
            sock.send_multipart([*frames[:-1], b"A%d" % count])


def _echo_loop(sock: zmq.Socket[bytes], stop: list[bool]) -> None:
    """B: echo E, count and ack S, stream on P. Frames are [route, body]."""
    streamed = 0
    while not stop[0]:
        if not sock.poll(100, zmq.POLLIN):
            continue
        while True:
            try:
                route, body = sock.recv_multipart(zmq.NOBLOCK)[-2:]
            except zmq.Again:
                break
            tag = body[:1]
            if tag == b"E":
                sock.send_multipart([route, body])
            elif tag == b"S":
                streamed += 1
                if streamed % ACK_EVERY == 0:
                    sock.send_multipart([route, b"A%d" % streamed])
            elif tag == b"R":
                streamed = 0
                sock.send_multipart([route, b"R"])
            elif tag == b"P":
                _produce_to(sock, route, int(body[1:]))


def _produce_to(sock: zmq.Socket[bytes], route: bytes, n: int) -> None:
    _produce(sock, [route], n)


def _echo_main(args: argparse.Namespace) -> int:
    stop = [False]

    def _on_term(_signum: int, _frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _on_term)
    ctx: Ctx = zmq.Context()
    if args.mode == "bind":
        sock = ctx.socket(zmq.ROUTER)
        old = bind_umask()
        try:
            sock.bind(args.endpoint)
        finally:
            os.umask(old)
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, args.name.encode())
        auth.authenticate(sock, auth.state_dir_of(args.endpoint))
        sock.connect(args.endpoint)
    sock.setsockopt(zmq.LINGER, 0)
    if args.mode == "connect":  # announce ourselves, so the broker can route to us
        sock.send_multipart([b"broker", protocol.encode(protocol.Heartbeat(actor=args.name,
                                                                           pid=os.getpid()))])
    try:
        _echo_loop(sock, stop)
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


def _peer_echo_main(args: argparse.Namespace) -> int:
    """B with the full client stack: BrokerPeer, decode, pydantic reply."""
    stop = [False]

    def _on_term(_signum: int, _frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _on_term)
    ctx: Ctx = zmq.Context()
    peer = BrokerPeer(ctx, args.endpoint, args.name)
    try:
        while not stop[0]:
            item = peer.recv(0.1)
            if item is not None and isinstance(item[1], protocol.Ping):
                peer.send(item[0], protocol.Pong(msg_id=item[1].msg_id, actor=args.name,
                                                 pid=os.getpid()))
    finally:
        peer.close()
        ctx.term()
    return 0


# --- measurement side (peer A) ---------------------------------------------------------
def _rtts(sock: zmq.Socket[bytes], head: list[bytes], n: int) -> list[float]:
    body = b"E" + b"x" * (MSG_BYTES - 1)
    out: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        sock.send_multipart([*head, body])
        while True:
            if not sock.poll(POLL_MS, zmq.POLLIN):
                raise TimeoutError("echo did not answer")
            if sock.recv_multipart()[-1][:1] == b"E":
                break
        out.append((clock() - start) / 1000.0)
    return out


def _reset(sock: zmq.Socket[bytes], head: list[bytes]) -> None:
    sock.send_multipart([*head, b"R"])
    while True:
        if not sock.poll(POLL_MS, zmq.POLLIN):
            raise TimeoutError("echo did not answer a reset")
        if sock.recv_multipart()[-1] == b"R":
            return


def _one_way(sock: zmq.Socket[bytes], head: list[bytes], n: int) -> tuple[float, float]:
    """(msgs/s A -> B, msgs/s B -> A)."""
    _reset(sock, head)
    start = time.perf_counter()
    _produce(sock, head, n)
    a_to_b = n / (time.perf_counter() - start)
    start = time.perf_counter()
    sock.send_multipart([*head, b"P%d" % n])
    _consume(sock, n)
    b_to_a = n / (time.perf_counter() - start)
    return a_to_b, b_to_a


def _routed(peer: BrokerPeer) -> int:
    reply = peer.request("broker", protocol.StatsRequest(msg_id=new_msg_id()))
    assert isinstance(reply, protocol.Stats)
    return int(reply.values["routed_total"])


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


CHURN_BATCH = 50


def _churn(ctx: Ctx, state: StateDir, broker_pid: int, n: int) -> dict[str, object]:
    """Open and close `n` spoofing connections; the broker's fds before and after."""
    credential = auth.ensure_keys(state).credential("agent-1")
    ping = protocol.encode(protocol.Ping(msg_id="spoof"))

    def fds() -> int:
        return len(os.listdir(f"/proc/{broker_pid}/fd"))

    before = fds()
    refused = 0
    started = time.monotonic()
    for _ in range(max(1, n // CHURN_BATCH)):
        socks = []
        poller = zmq.Poller()
        for _ in range(CHURN_BATCH):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"agent-9")
            auth.apply_client(sock, credential)
            sock.connect(state.endpoint("broker"))
            sock.send_multipart([b"broker", ping])
            poller.register(sock, zmq.POLLIN)
            socks.append(sock)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the one that holds the name is refused
            ready = poller.poll(POLL_MS)
            if not ready:
                break
            body = protocol.decode(ready[0][0].recv_multipart()[-1])
            if isinstance(body, protocol.Error):
                refused += 1
                break
        for sock in socks:
            sock.close()
    churn_s = time.monotonic() - started
    deadline = time.monotonic() + 30
    after = fds()
    while after > before and time.monotonic() < deadline:
        time.sleep(0.1)  # a reading against a deadline: the figure is what it reaches
        after = fds()
    return {"churn_connections": max(1, n // CHURN_BATCH) * CHURN_BATCH,
            "churn_refused_forbidden": refused, "churn_s": round(churn_s, 2),
            "fds_before": before, "fds_after_churn": after,
            "churn_target_met": after <= before}


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("CORRAL_CONTROL", None)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO_ROOT,
        )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _wait_pong(peer: BrokerPeer, to: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            peer.request(to, protocol.Ping(msg_id=new_msg_id()), timeout_s=0.5, retries=0)
        except (RequestTimeoutError, RemoteError):  # not up yet: again until the deadline
            if time.monotonic() > deadline:
                raise
        else:
            return


def _wait_echo(sock: zmq.Socket[bytes], head: list[bytes], timeout_s: float = 30.0) -> None:
    """Send an echo until one comes back (an `unknown_recipient` error means the
    echo has not registered with the broker yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.send_multipart([*head, b"E"])
        while sock.poll(200, zmq.POLLIN):
            if sock.recv_multipart()[-1][:1] == b"E":
                while sock.poll(50, zmq.POLLIN):  # late echoes of earlier tries
                    sock.recv_multipart()
                return
    raise TimeoutError("echo never answered")


def run(quick: bool) -> dict[str, object]:
    n_rtt = 2_000 if quick else 20_000
    n_stream = 20_000 if quick else 200_000
    n_peer = 1_000 if quick else 5_000
    rounds = 1 if quick else 5
    root = Path(tempfile.mkdtemp(prefix="cbb-", dir="/tmp"))
    state = StateDir(root / ".corral").ensure()
    procs: list[subprocess.Popen[bytes]] = []
    ctx: Ctx = zmq.Context()
    try:
        broker_ep = state.endpoint("broker")
        direct_ep = state.endpoint("direct")
        procs.append(_spawn(["-m", "broker.server", "--state-dir", str(state.root),
                             "--log-level", "warning"], root / "broker.out"))
        procs.append(_spawn(["-m", "ops.bench_broker", "echo", "--mode", "bind",
                             "--endpoint", direct_ep], root / "direct.out"))
        procs.append(_spawn(["-m", "ops.bench_broker", "echo", "--mode", "connect",
                             "--endpoint", broker_ep, "--name", "bench-b"], root / "b.out"))
        procs.append(_spawn(["-m", "ops.bench_broker", "peer-echo",
                             "--endpoint", broker_ep, "--name", "bench-pb"], root / "pb.out"))
        control = BrokerPeer(ctx, state, "bench-ctl")
        _wait_pong(control, "bench-pb")

        via_broker = ctx.socket(zmq.DEALER)
        via_broker.setsockopt(zmq.IDENTITY, b"bench-a")
        auth.authenticate(via_broker, state)
        via_broker.connect(broker_ep)
        direct = ctx.socket(zmq.DEALER)
        direct.setsockopt(zmq.IDENTITY, b"bench-d")
        direct.connect(direct_ep)
        modes = {"broker": (via_broker, [b"bench-b"]), "direct": (direct, [])}
        for sock, head in modes.values():
            sock.setsockopt(zmq.LINGER, 0)
            _wait_echo(sock, head)  # bench-b is routable once the broker has heard from it
            _rtts(sock, head, 200)  # warm-up

        broker_proc = psutil.Process(procs[0].pid)
        cpu0 = sum(broker_proc.cpu_times()[:2])
        routed0 = _routed(control)
        rtt: dict[str, list[float]] = {"broker": [], "direct": []}
        one_way: dict[str, list[tuple[float, float]]] = {"broker": [], "direct": []}
        for _ in range(rounds):  # alternate, so drift on a noisy host hits both alike
            for mode, (sock, head) in modes.items():
                rtt[mode] += _rtts(sock, head, n_rtt // rounds)
                one_way[mode].append(_one_way(sock, head, n_stream // rounds))

        broker_cpu_s = sum(broker_proc.cpu_times()[:2]) - cpu0
        routed = max(1, _routed(control) - routed0)
        peer_rtt: list[float] = []
        for _ in range(n_peer):
            start = time.perf_counter_ns()
            control.request("bench-pb", protocol.Ping(msg_id=new_msg_id()), timeout_s=5)
            peer_rtt.append((time.perf_counter_ns() - start) / 1000.0)
        stats = control.request("broker", protocol.StatsRequest(msg_id=new_msg_id()))
        churn = _churn(ctx, state, procs[0].pid, 2_000 if quick else 10_000)
        control.close()
        via_broker.close()
        direct.close()

        figures: dict[str, object] = {
            "message_bytes": MSG_BYTES,
            "rtt_samples": n_rtt,
            "cpus": os.cpu_count(),
        }
        for mode in ("broker", "direct"):
            figures[f"{mode}_rtt_us_p50"] = _pct(rtt[mode], 0.50)
            figures[f"{mode}_rtt_us_p99"] = _pct(rtt[mode], 0.99)
            figures[f"{mode}_a_to_b_msgs_per_s"] = round(
                statistics.median(x[0] for x in one_way[mode]))
            figures[f"{mode}_b_to_a_msgs_per_s"] = round(
                statistics.median(x[1] for x in one_way[mode]))
        figures["broker_over_direct_rtt"] = round(
            float(figures["broker_rtt_us_p50"]) / float(figures["direct_rtt_us_p50"]), 2)  # type: ignore[arg-type]
        figures["broker_over_direct_rtt_p99"] = round(
            float(figures["broker_rtt_us_p99"]) / float(figures["direct_rtt_us_p99"]), 2)  # type: ignore[arg-type]
        figures["peer_request_rtt_us_p50"] = _pct(peer_rtt, 0.50)
        figures["peer_request_rtt_us_p99"] = _pct(peer_rtt, 0.99)
        if isinstance(stats, protocol.Stats):
            figures["broker_routed_total"] = stats.values.get("routed_total", 0)
            figures["broker_errors_total"] = stats.values.get("errors_total", 0)
            # the broker's own CPU per routed message: what the hot loop costs, apart
            # from the extra process wake-ups that a hop adds to a round trip
            figures["broker_cpu_us_per_routed"] = round(broker_cpu_s / routed * 1e6, 1)
        figures["target_broker_over_direct_rtt_max"] = 1.5
        figures["target_met"] = float(figures["broker_over_direct_rtt"]) <= 1.5  # type: ignore[arg-type]
        figures.update(churn)
        return figures
    finally:
        ctx.destroy(linger=0)
        _stop(procs)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="broker benchmark child roles")
    parser.add_argument("role", choices=["echo", "peer-echo"])
    parser.add_argument("--mode", choices=["bind", "connect"], default="connect")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--name", default="bench-b")
    args = parser.parse_args()
    if args.role == "echo":
        return _echo_main(args)
    return _peer_echo_main(args)


if __name__ == "__main__":
    sys.exit(main())
