"""`python ops/bench.py procs`: the procs host under 100 concurrent background
commands and 20 terminals (real writer, broker and procs processes; every
poll that returns bytes is a durable WAL fact).

Figures:
    poll_ms_p50 / poll_ms_p99   one bash_poll / terminal_read round trip through
                                the broker, while all 120 jobs run
    capture_mb_per_s            bytes read back by cursor / time from the first
                                start to the last eof
    procs_rss_mib_idle          procs' RSS before the jobs start
    procs_rss_mib_flood         procs' largest RSS while 100 MB flows through the
                                terminals (the PTY path: every byte passes through
                                procs) plus 100 MB through the command logs;
                                must stay flat, well under 100 MB
    lost_bytes                  expected minus received, content-checked (must be 0)
    elapsed_s / procs_cpu_s     wall time of the run and the CPU procs used in it (the
                                producers themselves - yes, head, tr, bash - share the
                                same cores, so capture_mb_per_s is bounded by the box)
    commands / terminals / total_mb
    sandbox_start_ms_p50        start of `bash -c 'printf x'` (exactly as procs starts a
                                program: actors/procs/sandbox.py, bwrap with an empty
                                environment) to its first output byte, in the sandbox
    bare_start_ms_p50           the same program, same clean environment, no sandbox;
                                measured alternately with the sandboxed one in the same
                                run (target: sandbox <= bare + 15 ms)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import zmq

from actors.kernel.settings import AgentSpec, write_spec
from actors.procs import cgroup, launch, sandbox
from actors.procs.client import ProcsClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from ops.benchkit import child_env, percentile, stop, temp_state_root, wait_writer_ready

SESSION = "bench-agent"
READ_BYTES = 512 * 1024  # the protocol's largest read per poll


def _spawn(module: str, state: StateDir, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--state-dir", str(state.root), *extra],
        env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )


def _wait_procs(peer: BrokerPeer, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = peer.request("procs", protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.2,
                                 retries=0)
            if isinstance(reply, protocol.Pong):
                return
        except (RequestTimeoutError, RemoteError):
            continue
    raise TimeoutError("procs did not answer")


def _expected_command(i: int, chunk: int, rounds: int) -> bytes:
    line = f"cmd-{i:03d}-abcdefghijklmnopqrstuvwxyz\n".encode()
    one = (line * (chunk // len(line) + 1))[:chunk]
    return one * rounds


def _first_byte_ms(argv: list[str], cwd: str, group: cgroup.Group | None = None,
                   fd: int | None = None) -> float:
    """Start to the first output byte, started as procs starts a job: forked
    and held at its start gate (actors/procs/launch.py), moved into its
    control group, then let go. Sandboxed, the group is made (with the
    limits) and the seccomp filter written to `fd` in the timed part."""
    started = time.perf_counter()
    out_r, out_w = os.pipe()
    spawned = launch.spawn(argv, {}, cwd, stdio_fd=out_w, pass_fds=() if fd is None else (fd,))
    os.close(out_w)
    if fd is not None:
        os.close(fd)
    if group is not None:
        cgroup.join(group, spawned.pid)
    launch.open_gate(spawned)
    try:
        first = os.read(out_r, 1)
        elapsed = (time.perf_counter() - started) * 1000
    finally:
        os.close(out_r)
        _, status = os.waitpid(spawned.pid, 0)
    if first != b"x":
        raise RuntimeError(f"{argv[:3]}...: no output byte (status {status})")
    return elapsed


def _sandboxed_first_byte_ms(policy: sandbox.SandboxPolicy, confinement: sandbox.Confinement,
                             work: str, layout: cgroup.Layout | None, name: str) -> float:
    """As procs starts a job: its control group made (with the limits), the
    seccomp filter in a fresh descriptor, bwrap; the group killed and removed
    after (not timed)."""
    started = time.perf_counter()
    group = cgroup.create(layout, name, cgroup.Limits()) if layout is not None else None
    fd = sandbox.seccomp_fd(policy)
    argv = [*sandbox.prefix(policy, confinement, work, sandbox.clean_env(os.environ), name,
                            seccomp=fd), "/bin/bash", "-c", "printf x"]
    prepared_ms = (time.perf_counter() - started) * 1000
    try:
        return prepared_ms + _first_byte_ms(argv, work, group, fd)
    finally:
        if group is not None:
            cgroup.kill(group)
            deadline = time.monotonic() + 5.0
            while not cgroup.remove(group) and time.monotonic() < deadline:
                time.sleep(0.001)  # the killed members leave the group as the kernel reaps them


def start_latency(state: StateDir, work: str, runs: int) -> dict[str, float]:
    """(sandbox, bare) start-to-first-byte p50, alternating so both see the same load.
    The sandboxed start includes what procs adds to bwrap: the job's control
    group and the seccomp filter."""
    program = ["/bin/bash", "-c", "printf x"]
    env = sandbox.clean_env(os.environ)
    on = sandbox.check(sandbox.SandboxPolicy(), str(state.root))
    confinement = sandbox.Confinement(
        workspace=work, hidden=tuple(p for p in (str(state.root), *on.hide) if os.path.isdir(p)))
    layout = cgroup.probe(f"bench-{os.getpid()}")
    bare = [*sandbox.prefix(sandbox.SandboxPolicy(enabled=False), confinement, work, env,
                            "p-bench"), *program]
    times: dict[str, list[float]] = {"sandbox": [], "bare": []}
    try:
        for i in range(runs):
            times["sandbox"].append(
                _sandboxed_first_byte_ms(on, confinement, work, layout, f"p-bench-{i}"))
            times["bare"].append(_first_byte_ms(bare, work))
    finally:
        if layout is not None:
            cgroup.release(layout)
    return {name: round(percentile(values, 50), 2) for name, values in times.items()}


def run(quick: bool = False) -> dict[str, object]:
    n_cmd, n_term = (20, 4) if quick else (100, 20)
    cmd_bytes = 1_000_000 if not quick else 200_000
    term_bytes = 5_000_000 if not quick else 1_000_000
    rounds = 20
    chunk = cmd_bytes // rounds
    with temp_state_root() as root:
        state = StateDir(root / ".corral").ensure()
        work = root / "work"
        work.mkdir()
        write_spec(state, SESSION, AgentSpec(task="bench.yaml", workspace=str(work)))
        latency = start_latency(state, str(work.resolve()), 20 if quick else 100)
        procs_list: list[subprocess.Popen[bytes]] = []
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        peer: BrokerPeer | None = None
        try:
            procs_list.append(_spawn("actors.writer", state))
            wait_writer_ready(state.root)
            procs_list.append(_spawn("broker.server", state))
            procs = _spawn("actors.procs", state, "--terminal-cap-bytes", str(2 * term_bytes))
            procs_list.append(procs)
            peer = BrokerPeer(ctx, state, SESSION)
            _wait_procs(peer)
            client = ProcsClient(peer, SESSION, timeout_s=30)
            ps = psutil.Process(procs.pid)
            rss_idle = ps.memory_info().rss
            cpu_before = ps.cpu_times()
            t0 = time.monotonic()
            jobs: list[tuple[str, bool, int]] = []  # (proc_id, terminal, index)
            for i in range(n_cmd):
                line = f"cmd-{i:03d}-abcdefghijklmnopqrstuvwxyz"
                cmd = (f"for r in $(seq 1 {rounds}); do yes {line} | head -c {chunk}; "
                       "sleep 0.02; done")
                jobs.append((str(client.start(cmd, str(work)).proc_id), False, i))
            for i in range(n_term):
                argv = ["/bin/bash", "-c",
                        f"sleep 0.3; head -c {term_bytes} /dev/zero | tr '\\0' t"]
                jobs.append((str(client.terminal_start(argv, str(work)).proc_id), True, i))
            received: dict[str, bytearray] = {pid: bytearray() for pid, _, _ in jobs}
            done: set[str] = set()
            poll_ms: list[float] = []
            rss_max = rss_idle
            while len(done) < len(jobs):
                for proc_id, terminal, _ in jobs:
                    if proc_id in done:
                        continue
                    cursor = len(received[proc_id])
                    started = time.perf_counter()
                    if terminal:
                        out = client.terminal_read(proc_id, cursor, READ_BYTES)
                    else:
                        out = client.poll(proc_id, cursor, READ_BYTES)
                    poll_ms.append((time.perf_counter() - started) * 1000)
                    received[proc_id] += out.data
                    if out.eof:
                        done.add(proc_id)
                rss_max = max(rss_max, ps.memory_info().rss)
            elapsed = time.monotonic() - t0
            cpu_after = ps.cpu_times()
            procs_cpu_s = (cpu_after.user + cpu_after.system
                           - cpu_before.user - cpu_before.system)
            expected_total = 0
            lost = 0
            for proc_id, terminal, i in jobs:
                want = b"t" * term_bytes if terminal else _expected_command(i, chunk, rounds)
                got = bytes(received[proc_id])
                expected_total += len(want)
                lost += len(want) - len(got) if got == want[: len(got)] else len(want)
            total = sum(len(b) for b in received.values())
            client.end_session()
        finally:
            if peer is not None:
                peer.close()
            ctx.destroy(linger=0)
            for p in reversed(procs_list):
                stop(p)
    return {
        "commands": n_cmd,
        "terminals": n_term,
        "total_mb": round(total / 1e6, 1),
        "poll_ms_p50": round(percentile(poll_ms, 50), 3),
        "poll_ms_p99": round(percentile(poll_ms, 99), 3),
        "polls": len(poll_ms),
        "capture_mb_per_s": round(total / 1e6 / elapsed, 1),
        "procs_rss_mib_idle": round(rss_idle / 1048576, 1),
        "procs_rss_mib_flood": round(rss_max / 1048576, 1),
        "lost_bytes": lost,
        "elapsed_s": round(elapsed, 2),
        "procs_cpu_s": round(procs_cpu_s, 2),
        "expected_mb": round(expected_total / 1e6, 1),
        "sandbox_start_ms_p50": latency["sandbox"],
        "bare_start_ms_p50": latency["bare"],
        "sandbox_overhead_ms_p50": round(latency["sandbox"] - latency["bare"], 2),
    }


