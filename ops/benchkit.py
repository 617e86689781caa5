"""Shared pieces of the benchmarks: percentiles, a temporary state directory,
starting and stopping a real writer process and waiting until it answers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def percentile(values: Sequence[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


BENCH_DIR_ENV = "CORRAL_BENCH_DIR"  # where runs make their directories (default /tmp)


@contextmanager
def temp_state_root(prefix: str = "corral-bench-") -> Iterator[Path]:
    """A short directory (ipc socket paths are limited to 107 bytes) in
    $CORRAL_BENCH_DIR, /tmp without it: the disk a run measures is the one
    that directory is on (and, on this VM, how fast a file is created there:
    `file_create_us`)."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get(BENCH_DIR_ENV) or "/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("CORRAL_CONTROL", None)
    return env


CREATE_PROBE_FILES = 200


def file_create_us(directory: Path) -> float:
    """What creating an empty file costs in `directory` now (us, mean of
    CREATE_PROBE_FILES). This VM's cost of a create varied from 16 to 850 us
    between directories and hours (docs/performance.md, "Running them"); a benchmark
    whose work creates files prints it, so that a run says which it met."""
    probe = directory / "create-probe"
    probe.mkdir()
    started = time.perf_counter()
    for i in range(CREATE_PROBE_FILES):
        os.close(os.open(probe / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    elapsed = time.perf_counter() - started
    shutil.rmtree(probe)
    return elapsed / CREATE_PROBE_FILES * 1e6


def start_writer(state_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "actors.writer", "--state-dir", str(state_dir), *extra],
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10) -> None:
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_writer_ready(state_dir: Path, timeout_s: float = 20.0) -> float:
    """Ping the writer until it answers; return seconds waited. Uses its own
    zmq context, closed before returning (safe to fork afterwards).

    One connection, tried again every 2 ms until the writer has bound, carries
    the ping: a fresh socket every few milliseconds (as this did) redid the
    authentication handshake each time and, on a loaded machine, timed out in
    the middle of it round after round, adding 100-150 ms to a restart that
    was already serving."""
    import zmq

    from broker import protocol
    from broker.errors import RequestTimeoutError
    from broker.requester import Requester, new_msg_id
    from broker.statedir import StateDir

    started = time.monotonic()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    req = Requester(ctx, StateDir.at(state_dir).endpoint("writer"), reconnect_ivl_ms=2)
    try:
        while True:
            try:
                req.request(protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.5, retries=0)
                return time.monotonic() - started
            except RequestTimeoutError:
                if time.monotonic() - started > timeout_s:
                    raise
    finally:
        req.close()
        ctx.destroy(linger=0)
