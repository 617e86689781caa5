"""`bench.py wal`: acknowledged appends per second through the real writer with
K = 1, 8, 64 closed-loop appender processes (~300-byte events), against
baselines measured in the same run: raw write+fdatasync per record, SQLite
(WAL mode, synchronous=FULL, one row per commit, 64 writers) and a raw ceiling
(pre-encoded records, 64 per fdatasync); and the latency of one raw
fdatasync (p50/p99), the floor under any acknowledgement's latency. The
appenders use the writer's local lane (run/writer.lane) as agents do; the
`router_*` figures are the same writer with the appenders on the ROUTER
alone (CORRAL_WRITER_LANE=0), and the `lane_echo_*` ones the echoes over
SOCK_SEQPACKET, the lane's own ceilings.

Where the time goes, measured in the same run (docs/performance.md): the CPU
each kind of process spends per acknowledged append at K = 64 (the writer,
all of its threads, from /proc; the appenders, their own `os.times`), the
same per round trip of the raw pyzmq echo and of the durable echo (the CPU a
durable request/reply costs here with no work per record: the peer of the
writer's and the appenders' figures), the echo's p99 at 64 clients (the
latency floor of 64 closed-loop clients on this machine with no disk at all),
and the writer's group-commit batches (records per fdatasync) at K = 64.

Every closed-loop client (appender, SQLite writer, echo client) works from
the moment it is ready and is measured from a common start time on: the
figures are the steady state of K clients, not K processes started at once
(the forked processes' first requests, copy-on-write faults and cold caches
made most of the k64 p99 in the first 0.3 s). `warmup_*` counts what each
did before the start."""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ops.benchkit import percentile, start_writer, stop, temp_state_root, wait_writer_ready

RECORD = (
    b'{"seq":1,"ts":1.0,"stream":"agent/a","event":"turn","origin":"a","key":"k","payload":'
    + (b'"' + b"x" * 200 + b'"}\n')
)
PAYLOAD = {"op": "write_file", "path": "src/app.py", "note": "x" * 230}


def fdatasync_per_s(directory: Path, seconds: float,
                    latencies: list[float] | None = None) -> float:
    """Raw write+fdatasync of one record at a time; each one's time into `latencies`."""
    fd = os.open(directory / "fsync.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    count, deadline = 0, time.monotonic() + seconds
    started = time.monotonic()
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        os.write(fd, RECORD)
        os.fdatasync(fd)
        if latencies is not None:
            latencies.append(time.perf_counter() - t0)
        count += 1
    os.close(fd)
    return count / (time.monotonic() - started)


def fdatasync_overwrite_per_s(directory: Path, seconds: float) -> float:
    """The same record and fdatasync, written in place into a file written out
    (and synced) beforehand, as PostgreSQL pre-zeroes its WAL segments: no
    size or block change to commit to the filesystem's journal, so the sync
    is the data and the device's flush alone. Not what corral's WAL does (it
    appends, and every reader takes a segment's size as its end): the rate a
    preallocated WAL would be measured against."""
    region = 1 << 20
    fd = os.open(directory / "overwrite.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(region))
        os.fsync(fd)
        count, offset = 0, 0
        deadline = time.monotonic() + seconds
        started = time.monotonic()
        while time.monotonic() < deadline:
            os.pwrite(fd, RECORD, offset)
            os.fdatasync(fd)
            offset = (offset + len(RECORD)) % (region - len(RECORD))
            count += 1
        return count / (time.monotonic() - started)
    finally:
        os.close(fd)


def raw_ceiling_per_s(directory: Path, seconds: float) -> float:
    fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    batch = RECORD * 64
    count, deadline = 0, time.monotonic() + seconds
    started = time.monotonic()
    while time.monotonic() < deadline:
        os.write(fd, batch)
        os.fdatasync(fd)
        count += 64
    os.close(fd)
    return count / (time.monotonic() - started)


def _sqlite_worker(db: str, start_at: float, stop_at: float, out: Connection) -> None:
    conn = sqlite3.connect(db, timeout=30, isolation_level=None)
    conn.execute("PRAGMA synchronous=FULL")
    payload = RECORD.decode()
    while time.time() < start_at:  # warm-up: the same work, not counted
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO events(body) VALUES (?)", (payload,))
        conn.execute("COMMIT")
    count = 0
    while time.time() < stop_at:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO events(body) VALUES (?)", (payload,))
        conn.execute("COMMIT")
        count += 1
    conn.close()
    out.send(count)
    out.close()


def sqlite_commits_per_s(directory: Path, writers: int, seconds: float) -> float:
    db = str(directory / "bench.sqlite")
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE events(id INTEGER PRIMARY KEY, body TEXT)")
    conn.commit()
    conn.close()
    ctx = mp.get_context("fork")
    start_at = time.time() + 0.5 + writers * 0.01
    stop_at = start_at + seconds
    pipes, procs = [], []
    for _ in range(writers):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_sqlite_worker, args=(db, start_at, stop_at, send))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    total: int = sum(p.recv() for p in pipes)
    for proc in procs:
        proc.join()
    return total / seconds


def _appender(state_dir: str, index: int, start_at: float, stop_at: float, out: Connection,
              *, lane: bool = True) -> None:
    import zmq

    if not lane:  # the ROUTER alone (actors/writer/laneclient.py)
        os.environ["CORRAL_WRITER_LANE"] = "0"

    from actors.writer.client import WriterClient, encode_payload
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, StateDir.at(state_dir), f"bench-{index}", timeout_s=10, retries=3)
    body = encode_payload(PAYLOAD)
    stream = f"agent/bench-{index}"
    latencies: list[float] = []
    n = 0
    while time.time() < start_at:  # warm-up: the same appends, not measured
        client.append(stream, "tool_call", body, key=f"w{n}")
        n += 1
    n = 0
    cpu0 = os.times()
    while True:
        t0 = time.perf_counter()
        if time.time() >= stop_at:
            break
        client.append(stream, "tool_call", body, key=f"k{n}")
        latencies.append(time.perf_counter() - t0)
        n += 1
    cpu1 = os.times()
    client.close()
    ctx.destroy(linger=0)
    out.send((n, latencies, cpu1.user - cpu0.user + cpu1.system - cpu0.system))
    out.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _stats(state_dir: Path) -> dict[str, int | float]:
    import zmq

    from actors.writer.client import WriterClient
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, StateDir.at(state_dir), "bench-stats", timeout_s=5,
                          retries=2) as client:
            return client.stats()
    finally:
        ctx.destroy(linger=0)


def writer_run(state_dir: Path, clients: int, seconds: float,
               cpu: dict[str, float] | None = None,
               writer_pid: int | None = None, *, lane: bool = True
               ) -> tuple[float, list[float]]:
    """Acknowledged appends per second and each append's latency; with `cpu`,
    the appenders' CPU seconds (`clients_s`) and the writer's over the same
    window (`writer_s`, from `writer_pid`). Not `lane`: on the ROUTER only."""
    ctx = mp.get_context("fork")
    start_at = time.time() + 0.5 + clients * 0.02
    stop_at = start_at + seconds
    pipes, procs = [], []
    for i in range(clients):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_appender,
            args=(str(state_dir), i + clients * 1000, start_at, stop_at, send),
            kwargs={"lane": lane})
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    if writer_pid is not None and cpu is not None:
        cpu["writer_s"] = _cpu_s_between(writer_pid, start_at, stop_at)
    total, latencies, clients_s = _gather(pipes, procs)
    if cpu is not None:
        cpu["clients_s"] = clients_s
    return total / seconds, latencies


def _cpu_s_between(pid: int, start_at: float, stop_at: float) -> float:
    """The CPU seconds `pid` spends between two wall-clock times (waits for both)."""
    while time.time() < start_at:
        time.sleep(0.001)
    before = _cpu_s(pid)
    while time.time() < stop_at:
        time.sleep(0.005)
    return _cpu_s(pid) - before


def _gather(pipes: list[Connection], procs: list[Any]) -> tuple[int, list[float], float]:
    """Each closed-loop client's (count, latencies, CPU seconds), summed; joins them."""
    total, latencies, clients_s = 0, [], 0.0
    for pipe in pipes:
        n, lat, used = pipe.recv()
        total += n
        latencies.extend(lat)
        clients_s += used
    for proc in procs:
        proc.join()
    return total, latencies, clients_s


def run(quick: bool = False) -> dict[str, object]:
    seconds = 1.0 if quick else 4.0
    f: dict[str, float] = {}
    with temp_state_root() as root:
        sync_lat: list[float] = []
        f["fdatasync_per_s"] = fdatasync_per_s(root, seconds, sync_lat)
        # the floor of any durable ack's latency on this disk, same run
        f["fdatasync_p50_ms"] = percentile(sync_lat, 50) * 1000
        f["fdatasync_p99_ms"] = percentile(sync_lat, 99) * 1000
        f["fdatasync_overwrite_per_s"] = fdatasync_overwrite_per_s(root, seconds)
        f["raw_ceiling_per_s"] = raw_ceiling_per_s(root, seconds)
        f["sqlite_commits_per_s_k64"] = sqlite_commits_per_s(root, 64, seconds)
        for k in (1, 64):
            echo: dict[str, Any] = {}
            f[f"zmq_echo_per_s_k{k}"] = zmq_echo_per_s(root, k, seconds, echo)
            if k == 64:
                rts = max(1.0, f["zmq_echo_per_s_k64"] * seconds)
                f["zmq_echo_p99_ms_k64"] = percentile(echo["latencies"], 99) * 1000
                f["zmq_echo_server_cpu_us_per_rt_k64"] = echo["server_s"] / rts * 1e6
                f["zmq_echo_client_cpu_us_per_rt_k64"] = echo["clients_s"] / rts * 1e6
            # the same with a write + fdatasync before each answer (group commit,
            # nothing else per request): what a durable ack costs here at best
            durable: dict[str, Any] = {}
            f[f"durable_echo_per_s_k{k}"] = zmq_echo_per_s(root, k, seconds, durable,
                                                           durable=True)
            f[f"durable_echo_p99_ms_k{k}"] = percentile(durable["latencies"], 99) * 1000
            if k == 64:  # the peer of the writer's and the appenders' CPU per ack
                rts = max(1.0, f["durable_echo_per_s_k64"] * seconds)
                f["durable_echo_server_cpu_us_per_rt_k64"] = durable["server_s"] / rts * 1e6
                f["durable_echo_client_cpu_us_per_rt_k64"] = durable["clients_s"] / rts * 1e6
            # the same two over SOCK_SEQPACKET: the ceilings of the writer's local lane
            for durably, name in ((False, "lane_echo"), (True, "durable_lane_echo")):
                seq: dict[str, Any] = {}
                f[f"{name}_per_s_k{k}"] = zmq_echo_per_s(root, k, seconds, seq,
                                                         durable=durably, lane=True)
                f[f"{name}_p99_ms_k{k}"] = percentile(seq["latencies"], 99) * 1000
                if k == 64:
                    rts = max(1.0, f[f"{name}_per_s_k64"] * seconds)
                    f[f"{name}_server_cpu_us_per_rt_k64"] = seq["server_s"] / rts * 1e6
                    f[f"{name}_client_cpu_us_per_rt_k64"] = seq["clients_s"] / rts * 1e6
        state_dir = root / ".corral"
        writer = start_writer(state_dir)
        try:
            wait_writer_ready(state_dir)
            for k in (1, 8, 64):
                cpu: dict[str, float] = {}
                before = _stats(state_dir) if k == 64 else {}
                rate, lat = writer_run(state_dir, k, seconds, cpu, writer.pid)
                f[f"acked_per_s_k{k}"] = rate
                f[f"p50_ms_k{k}"] = percentile(lat, 50) * 1000
                f[f"p99_ms_k{k}"] = percentile(lat, 99) * 1000
                if k == 64:
                    acks = max(1.0, rate * seconds)
                    f["writer_cpu_us_per_ack_k64"] = cpu["writer_s"] / acks * 1e6
                    f["client_cpu_us_per_ack_k64"] = cpu["clients_s"] / acks * 1e6
                    after = _stats(state_dir)
                    batches = after["batches_total"] - before["batches_total"]
                    f["records_per_fdatasync_k64"] = (
                        (after["appends_total"] - before["appends_total"]) / max(1, batches))
            for k in (1, 64):  # the same writer, the appenders on the ROUTER only
                cpu = {}
                rate, lat = writer_run(state_dir, k, seconds, cpu, writer.pid, lane=False)
                f[f"router_acked_per_s_k{k}"] = rate
                f[f"router_p99_ms_k{k}"] = percentile(lat, 99) * 1000
                if k == 64:
                    acks = max(1.0, rate * seconds)
                    f["router_writer_cpu_us_per_ack_k64"] = cpu["writer_s"] / acks * 1e6
                    f["router_client_cpu_us_per_ack_k64"] = cpu["clients_s"] / acks * 1e6
        finally:
            stop(writer)
    f["k1_over_fdatasync"] = f["acked_per_s_k1"] / f["fdatasync_per_s"]
    f["overwrite_over_append_fdatasync"] = f["fdatasync_overwrite_per_s"] / f["fdatasync_per_s"]
    f["k64_over_sqlite_k64"] = f["acked_per_s_k64"] / f["sqlite_commits_per_s_k64"]
    f["k64_over_zmq_echo_k64"] = f["acked_per_s_k64"] / f["zmq_echo_per_s_k64"]
    f["k1_over_durable_echo_k1"] = f["acked_per_s_k1"] / f["durable_echo_per_s_k1"]
    f["k64_over_lane_echo_k64"] = f["acked_per_s_k64"] / f["lane_echo_per_s_k64"]
    f["k64_over_durable_lane_echo_k64"] = (
        f["acked_per_s_k64"] / f["durable_lane_echo_per_s_k64"])
    f["k1_over_durable_lane_echo_k1"] = f["acked_per_s_k1"] / f["durable_lane_echo_per_s_k1"]
    f["lane_over_router_k64"] = f["acked_per_s_k64"] / f["router_acked_per_s_k64"]
    f["lane_over_router_k1"] = f["acked_per_s_k1"] / f["router_acked_per_s_k1"]
    f["k64_over_durable_echo_k64"] = f["acked_per_s_k64"] / f["durable_echo_per_s_k64"]
    # the best k1 can be on this machine: one raw round trip plus one fdatasync
    f["k1_bound_per_s"] = 1 / (1 / f["zmq_echo_per_s_k1"] + 1 / f["fdatasync_per_s"])
    # the rate the CPU spent per ack allows if both cores did nothing else
    # (writer + appenders; the echo's the same per round trip)
    cores = os.cpu_count() or 1
    f["k64_cpu_bound_per_s"] = cores * 1e6 / (
        f["writer_cpu_us_per_ack_k64"] + f["client_cpu_us_per_ack_k64"])
    f["zmq_echo_cpu_bound_per_s_k64"] = cores * 1e6 / (
        f["zmq_echo_server_cpu_us_per_rt_k64"] + f["zmq_echo_client_cpu_us_per_rt_k64"])
    figures: dict[str, object] = {key: round(value, 3) for key, value in f.items()}
    figures["targets"] = {
        "k1_over_fdatasync>=0.5": f["k1_over_fdatasync"] >= 0.5,
        "k64_over_sqlite_k64>=3": f["k64_over_sqlite_k64"] >= 3,
        "k64_over_zmq_echo_k64>=0.5": f["k64_over_zmq_echo_k64"] >= 0.5,
        "p99_ms_k64<=10": f["p99_ms_k64"] <= 10,
        # an ack waits for at least one fdatasync (usually one in flight, then its
        # own): p99 cannot beat the disk's own p99 for one fdatasync
        "p99_ms_k64<=2x_fdatasync_p99": f["p99_ms_k64"] <= 2 * f["fdatasync_p99_ms"],
    }
    return figures


def _lane_echo_server(path: str, ready: Connection, sync_path: str | None = None) -> None:
    """`_echo_server` on an AF_UNIX SOCK_SEQPACKET socket, one epoll set of
    the connections (the writer's lane, actors/writer/lane.py, without its
    hello or any work per packet)."""
    import select
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(512)
    listener.setblocking(False)
    epoll = select.epoll()
    epoll.register(listener.fileno(), select.EPOLLIN)
    conns: dict[int, socket.socket] = {}
    fd = os.open(sync_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if sync_path else -1
    ready.send(True)
    while True:
        batch: list[tuple[socket.socket, bytes]] = []
        for ready_fd, _ in epoll.poll(0.1):
            if ready_fd == listener.fileno():
                while True:
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    conns[conn.fileno()] = conn
                    epoll.register(conn.fileno(), select.EPOLLIN)
                continue
            conn = conns[ready_fd]
            try:
                data = conn.recv(65536)
            except BlockingIOError:
                continue
            if data == b"quit":
                return
            if not data:
                epoll.unregister(ready_fd)
                conns.pop(ready_fd).close()
            elif fd < 0:
                conn.send(data)
            else:
                batch.append((conn, data))
        if batch:
            os.write(fd, RECORD * len(batch))
            os.fdatasync(fd)
            for conn, data in batch:
                conn.send(data)


def _lane_echo_client(path: str, start_at: float, stop_at: float, out: Connection) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    frame = b"x" * 350

    def round_trip() -> None:
        sock.send(frame)
        sock.recv(65536)

    out.send(_closed_loop(round_trip, start_at, stop_at))
    sock.close()
    out.close()


def _closed_loop(round_trip: Callable[[], None], start_at: float,
                 stop_at: float) -> tuple[int, list[float], float]:
    """An echo client's loop: round trips until `start_at` (warm-up, not
    measured), then timed ones until `stop_at`: (count, latencies, CPU s)."""
    latencies: list[float] = []
    while time.time() < start_at:
        round_trip()
    n = 0
    cpu0 = os.times()
    while time.time() < stop_at:
        t0 = time.perf_counter()
        round_trip()
        latencies.append(time.perf_counter() - t0)
        n += 1
    cpu1 = os.times()
    return n, latencies, cpu1.user - cpu0.user + cpu1.system - cpu0.system


def _echo_server(endpoint: str, ready: Connection, sync_path: str | None = None) -> None:
    """Echo every request; with `sync_path`, durably: the requests waiting at a
    turn are written there (one ~300-byte record each) and fdatasynced once
    before any of them is answered (group commit, no other work per record)."""
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.send(True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    fd = os.open(sync_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if sync_path else -1
    while True:
        poller.poll(100)
        batch: list[list[bytes]] = []
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if parts[1] == b"quit":
                ctx.destroy(linger=0)
                return
            if fd < 0:
                sock.send_multipart(parts)
            else:
                batch.append(parts)
        if batch:
            os.write(fd, RECORD * len(batch))
            os.fdatasync(fd)
            for parts in batch:
                sock.send_multipart(parts)


def _echo_client(endpoint: str, start_at: float, stop_at: float, out: Connection) -> None:
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    frame = b"x" * 350

    def round_trip() -> None:
        sock.send(frame)
        sock.poll(5000)
        sock.recv()

    result = _closed_loop(round_trip, start_at, stop_at)
    ctx.destroy(linger=0)
    out.send(result)
    out.close()


def zmq_echo_per_s(directory: Path, clients: int, seconds: float,
                   figures: dict[str, Any] | None = None, durable: bool = False, *,
                   lane: bool = False) -> float:
    """Raw pyzmq DEALER->ROUTER echo, closed loop: the ceiling any Python
    request/reply server on this machine can reach, with no disk at all; with
    `durable`, each request is also written and fdatasynced (group commit)
    before its answer: the ceiling of any durable one on this disk; with
    `lane`, the same over a SOCK_SEQPACKET socket instead (the writer's local
    lane's transport). `figures`, when given, gets the round trips'
    `latencies` and the CPU seconds of the server (`server_s`) and of the
    clients (`clients_s`)."""
    import socket

    import zmq

    endpoint = str(directory / "echo.lane") if lane else f"ipc://{directory}/echo.sock"
    if lane and os.path.exists(endpoint):
        os.unlink(endpoint)
    serve, client = (_lane_echo_server, _lane_echo_client) if lane else (
        _echo_server, _echo_client)
    ctx = mp.get_context("fork")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    sync_path = str(directory / "durable-echo.bin") if durable else None
    server = ctx.Process(target=serve, args=(endpoint, ready_send, sync_path))
    server.start()
    ready_recv.recv()
    start_at = time.time() + 0.5 + clients * 0.02
    stop_at = start_at + seconds
    pipes, procs = [], []
    for _ in range(clients):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=client, args=(endpoint, start_at, stop_at, send))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    assert server.pid is not None
    server_s = _cpu_s_between(server.pid, start_at, stop_at)
    total, latencies, clients_s = _gather(pipes, procs)
    if figures is not None:
        figures.update(latencies=latencies, server_s=server_s, clients_s=clients_s)
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    if lane:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as quit_lane:
            quit_lane.connect(endpoint)
            quit_lane.send(b"quit")
    else:
        quit_sock = zctx.socket(zmq.DEALER)
        quit_sock.connect(endpoint)
        quit_sock.send(b"quit")
    server.join(timeout=10)
    if server.is_alive():
        server.kill()
        server.join()
    zctx.destroy(linger=0)
    return float(total) / seconds
