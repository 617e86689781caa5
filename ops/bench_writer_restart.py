"""`bench.py writer-restart`: time from starting a writer process to its first
answer, after a SIGKILL, with WALs of 10k and 1M records. Each WAL is written
directly in the WAL format, opened once by a writer (which checkpoints), then
given an unchekpointed tail by real appends before the kill, as a crash would.

`restart_ms_*` is a restart as the supervisor does it once its zygote is ready:
the writer forked from the preloaded template (actors/zygote.py `run`), from the
request to the first answer. `restart_ms_*_fresh` is the same restart in a fresh
interpreter (the fallback, and the first start).

Baselines from the same run: `interpreter_import_ms` (a bare interpreter
importing what the writer imports) and `full_scan_ms_1m` (start-up with the
checkpoint deleted, i.e. what start-up would cost if it scanned everything)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from actors.writer.wal import encode_record, segment_name
from ops.benchkit import (
    child_env,
    percentile,
    start_writer,
    stop,
    temp_state_root,
    wait_writer_ready,
)

SEGMENT_BYTES = 64 * 1024 * 1024
TAIL_RECORDS = 2000
PAYLOAD = json.dumps({"op": "write_file", "path": "src/app.py", "note": "x" * 200},
                     separators=(",", ":")).encode()  # compact: the payload policy


def write_wal(state_dir: Path, count: int) -> None:
    wal_dir = state_dir / "state" / "wal"
    wal_dir.mkdir(parents=True, exist_ok=True)
    seq = 1
    while seq <= count:
        path = wal_dir / segment_name(seq)
        size = 0
        with open(path, "wb") as f:
            chunk: list[bytes] = []
            while seq <= count and size < SEGMENT_BYTES:
                agent = seq % 64
                line = encode_record(
                    seq, 1.0, f"agent/a{agent}", "tool_call", f"a{agent}", f"k{seq}", None, PAYLOAD
                )
                chunk.append(line)
                size += len(line)
                seq += 1
                if len(chunk) >= 4096:
                    f.write(b"".join(chunk))
                    chunk.clear()
            f.write(b"".join(chunk))


def append_tail(state_dir: Path, count: int) -> None:
    import zmq

    from actors.writer.client import WriterClient
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with WriterClient(ctx, StateDir.at(state_dir), "tail") as client:
        for i in range(count):
            client.append("agent/tail", "tool_call", PAYLOAD, key=f"t{time.time_ns()}-{i}")
    ctx.destroy(linger=0)


def recovery_ms(state_dir: Path) -> float:
    """The writer's own start-up work, from its log's last wal_recovered event."""
    log = state_dir / "logs" / "writer.log"
    events = [json.loads(x) for x in log.read_text().splitlines() if "wal_recovered" in x]
    return float(events[-1]["elapsed_ms"])


class ZygoteWriters:
    """Writers forked from a zygote this process started, as the supervisor
    restarts them (this process is the subreaper that adopts and reaps them)."""

    def __init__(self, state_dir: Path) -> None:
        from actors.zygotelink import ZygoteLink
        from broker.lifeline import become_subreaper

        become_subreaper()
        self.state_dir = state_dir
        self.link = ZygoteLink(["--state-dir", str(state_dir)], child_env())
        self.link.start()
        if not self.link.wait_ready(60):
            raise RuntimeError("the zygote did not preload")

    def start(self) -> int:
        from actors.zygotewire import Forked

        reply = self.link.run_wait("writer", "actors.writer", ["--state-dir", str(self.state_dir)],
                                   timeout_s=30)
        if isinstance(reply, Forked):
            return reply.pid
        raise RuntimeError(f"the zygote did not fork the writer: {reply}")

    @staticmethod
    def kill(pid: int) -> None:
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    def close(self) -> None:
        pid = self.link.pid
        self.link.close()  # the zygote exits when its socket closes
        if pid is not None:
            os.waitpid(pid, 0)


def restart_ms(
    state_dir: Path, rounds: int, zygote: ZygoteWriters | None = None
) -> tuple[list[float], list[float]]:
    totals, recoveries = [], []
    start: Callable[[], int]
    if zygote is None:
        procs: dict[int, subprocess.Popen[bytes]] = {}

        def start() -> int:
            proc = start_writer(state_dir)
            procs[proc.pid] = proc
            return proc.pid

        def kill(pid: int) -> None:
            stop(procs.pop(pid), signal.SIGKILL)
    else:
        start, kill = zygote.start, zygote.kill
    for _ in range(rounds):
        writer = start_writer(state_dir)
        try:
            wait_writer_ready(state_dir, timeout_s=600)
            append_tail(state_dir, TAIL_RECORDS)
        finally:
            stop(writer, signal.SIGKILL)
        started = time.monotonic()
        pid = start()
        try:
            wait_writer_ready(state_dir, timeout_s=600)
            totals.append((time.monotonic() - started) * 1000)
            recoveries.append(recovery_ms(state_dir))
        finally:
            kill(pid)
    return totals, recoveries


def import_ms(rounds: int) -> float:
    code = (
        "import zmq, structlog, pydantic, broker.protocol, broker.logconfig,"
        " actors.writer.recovery"
    )
    samples = []
    for _ in range(rounds):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", code], env=child_env(), check=True)
        samples.append((time.monotonic() - started) * 1000)
    return percentile(samples, 50)


def full_scan_ms(state_dir: Path) -> float:
    for name in ("wal.checkpoint.json", "wal.checkpoint.prev.json"):
        (state_dir / "state" / name).unlink(missing_ok=True)  # no checkpoint to start from
    started = time.monotonic()
    writer = start_writer(state_dir)
    try:
        wait_writer_ready(state_dir, timeout_s=900)
        return (time.monotonic() - started) * 1000
    finally:
        stop(writer, signal.SIGKILL)


def run(quick: bool = False) -> dict[str, object]:
    rounds = 3 if quick else 5
    sizes = {"10k": 10_000, "1m": 100_000 if quick else 1_000_000}
    figures: dict[str, object] = {"interpreter_import_ms": round(import_ms(rounds), 1)}
    for label, count in sizes.items():
        with temp_state_root() as root:
            state_dir = root / ".corral"
            write_wal(state_dir, count)
            first = start_writer(state_dir)  # full scan once: builds index + checkpoint
            try:
                wait_writer_ready(state_dir, timeout_s=900)
            finally:
                stop(first)
            zygote = ZygoteWriters(state_dir)
            try:
                totals, recoveries = restart_ms(state_dir, rounds, zygote)
            finally:
                zygote.close()
            fresh, _ = restart_ms(state_dir, rounds)
            figures[f"restart_ms_{label}"] = round(percentile(totals, 50), 1)
            figures[f"restart_ms_{label}_fresh"] = round(percentile(fresh, 50), 1)
            figures[f"recovery_ms_{label}"] = round(percentile(recoveries, 50), 1)
            if label == "1m":
                figures["full_scan_ms_1m"] = round(full_scan_ms(state_dir), 1)
    figures["records_1m"] = sizes["1m"]
    ratio = float(figures["restart_ms_1m"]) / float(figures["restart_ms_10k"])  # type: ignore[arg-type]
    figures["restart_ratio_1m_over_10k"] = round(ratio, 3)
    figures["targets"] = {
        "restart_ms_1m<=150": float(figures["restart_ms_1m"]) <= 150,  # type: ignore[arg-type]
        "ratio<=1.5": ratio <= 1.5,
    }
    return figures
