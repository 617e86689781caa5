"""`bench.py storage`: WAL retention and compaction under load (issue 16).

A WAL of 1M records (`--quick`: 100k) is laid down in the writer's own format
(64 streams of kept work, `bench/<i>`, and 16 sessions to purge,
`purge/<j>`, one record in four), the real writer starts on it (a full scan),
then 64 closed-loop appender processes append at full speed:

- `acked_per_s_idle`: acknowledged appends per second with no pass running;
- `acked_per_s_during_gc`: the same appenders, measured from the `gc`
  request to its result, while the writer truncates below the floor (the
  `bench/*` streams are disposable: the rewind horizon, `keep_records`, is
  what is kept) and compacts the 16 purged sessions out of every sealed
  segment (target: >= 0.8x idle);
- `compaction_mb_per_s`: bytes of segments rewritten / time rewriting them;
- `disk_bytes_after_gc` against `live_bytes` (the bytes of the records still
  needed: at or above the floor, not purged) (target: <= 1.2x): everything
  under `.corral/`, stream index and checkpoint included."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sqlite3
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

from ops.benchkit import start_writer, stop, temp_state_root, wait_writer_ready

APPENDERS = 64
STREAMS = 64
PURGED = 16
SEGMENT_BYTES = 4 * 1024 * 1024
PAYLOAD = {"op": "write_file", "path": "src/app.py", "note": "x" * 120}


def lay_down(wal_dir: Path, records: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """Write `records` records as the writer would (batches of 64); return the
    head and each purged stream's (first, last) seq."""
    from actors.writer.wal import encode_record, segment_name

    body = json.dumps(PAYLOAD, separators=(",", ":")).encode()
    wal_dir.mkdir(parents=True, exist_ok=True)
    purged: dict[str, tuple[int, int]] = {}
    seq, fd, size = 1, -1, SEGMENT_BYTES
    while seq <= records:
        if size >= SEGMENT_BYTES:
            if fd >= 0:
                os.close(fd)
            fd = os.open(wal_dir / segment_name(seq), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            size = 0
        last = min(seq + 63, records)
        lines = []
        for s in range(seq, last + 1):
            if s % 4 == 0:
                stream = f"purge/{s % PURGED}"
                first = purged.get(stream, (s, s))[0]
                purged[stream] = (first, s)
            else:
                stream = f"bench/{s % STREAMS}"
            lines.append(encode_record(s, 1.0, stream, "turn", stream.replace("/", "-"),
                                       f"k{s}", None, body, (seq, last)))
        data = b"".join(lines)
        os.write(fd, data)
        size += len(data)
        seq = last + 1
    os.fsync(fd)
    os.close(fd)
    return records, purged


def _appender(state_dir: str, index: int, start_at: float, stop: Event, out: Connection) -> None:
    import zmq

    from actors.writer.client import WriterClient, encode_payload
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, StateDir.at(state_dir), f"ap-{index}", timeout_s=10, retries=3)
    body = encode_payload(PAYLOAD)
    times: list[float] = []
    while time.time() < start_at:
        time.sleep(0.001)
    n = 0
    while not stop.is_set():
        client.append(f"bench/{index % STREAMS}", "turn", body, key=f"a{index}-{n}")
        times.append(time.time())
        n += 1
    client.close()
    ctx.destroy(linger=0)
    out.send(times)
    out.close()


def _purge(root: Path, purged: dict[str, tuple[int, int]]) -> None:
    con = sqlite3.connect(root / "sessions.sqlite3")
    con.execute("CREATE TABLE purge_journal(session_id TEXT PRIMARY KEY, stream TEXT NOT NULL, "
                "first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, state TEXT NOT NULL, "
                "started_at REAL, finished_at REAL)")
    for stream, (first, last) in purged.items():
        con.execute("INSERT INTO purge_journal VALUES (?, ?, ?, ?, 'done', 0, 0)",
                    (stream, stream, first, last))
    con.commit()
    con.close()


def _gc(root: Path, timeout_s: float) -> dict[str, object]:
    from broker.durable import write_atomic

    request_id = uuid.uuid4().hex
    run_dir = root / "run"
    write_atomic(run_dir / "gc.request", json.dumps({"id": request_id}).encode())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads((run_dir / "gc.result.json").read_bytes())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("id") == request_id:
            return data
        time.sleep(0.01)
    raise TimeoutError("no gc result")


def _live_bytes(root: Path, floor: int) -> int:
    from actors.writer.wal import list_segments, parse_record

    total = 0
    for _, path in list_segments(root / "state" / "wal"):
        with open(path, "rb") as f:
            for line in f:
                record = parse_record(line)
                if record is not None and record.seq >= floor and not record.stream.startswith(
                        "purge/"):
                    total += len(line)
    return total


def run(quick: bool = False) -> dict[str, object]:
    from supervisor.storage import tree_bytes

    records = 100_000 if quick else 1_000_000
    idle_s = 2.0 if quick else 5.0
    keep = records // 2
    f: dict[str, object] = {"records": records, "appenders": APPENDERS,
                            "segment_bytes": SEGMENT_BYTES, "keep_records": keep}
    with temp_state_root() as parent:
        root = parent / ".corral"
        t0 = time.monotonic()
        _, purged = lay_down(root / "state" / "wal", records)
        f["lay_down_s"] = round(time.monotonic() - t0, 2)
        _purge(root, purged)
        f["wal_bytes_before"] = tree_bytes(root / "state" / "wal")
        writer = start_writer(root, "--segment-bytes", str(SEGMENT_BYTES), "--gc-interval-s",
                              "3600", "--gc-keep-records", str(keep), "--gc-disposable", "bench/*")
        try:
            f["writer_start_s"] = round(wait_writer_ready(root, timeout_s=300), 2)
            ctx = mp.get_context("fork")
            stop_event = ctx.Event()
            start_at = time.time() + 0.5 + APPENDERS * 0.02
            pipes, procs = [], []
            for i in range(APPENDERS):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_appender,
                                   args=(str(root), i, start_at, stop_event, send))
                proc.start()
                send.close()
                pipes.append(recv)
                procs.append(proc)
            time.sleep(max(0.0, start_at - time.time()) + 0.5)  # a benchmark's warm-up
            idle_from = time.time()
            time.sleep(idle_s)
            idle_to = gc_from = time.time()
            result = _gc(root, 600)
            gc_to = time.time()
            if gc_to - gc_from < 1.0:  # measure at least a second
                time.sleep(1.0 - (gc_to - gc_from))
            stop_event.set()
            times = [t for pipe in pipes for t in pipe.recv()]
            for proc in procs:
                proc.join()
        finally:
            stop(writer)
        idle = sum(idle_from <= t < idle_to for t in times) / (idle_to - idle_from)
        during = sum(gc_from <= t < gc_to for t in times) / (gc_to - gc_from)
        f["acked_per_s_idle"] = round(idle, 1)
        f["acked_per_s_during_gc"] = round(during, 1)
        f["during_gc_vs_idle"] = round(during / idle, 3) if idle else None
        f["gc_pass_s"] = round(gc_to - gc_from, 3)
        f["gc_result"] = {k: v for k, v in result.items()
                          if k not in ("segments_removed", "segments_compacted")}
        f["segments_removed"] = len(result.get("segments_removed") or [])  # type: ignore[arg-type]
        f["segments_compacted"] = len(result.get("segments_compacted") or [])  # type: ignore[arg-type]
        seconds = float(result.get("compaction_s") or 0.0)  # type: ignore[arg-type]
        rewritten = int(result.get("compacted_bytes_before") or 0)  # type: ignore[call-overload]
        f["compaction_mb_per_s"] = round(rewritten / seconds / 1e6, 1) if seconds else None
        floor = int(result.get("floor_seq") or 1)  # type: ignore[call-overload]
        live = _live_bytes(root, floor)
        disk = tree_bytes(root) - tree_bytes(root / "logs")  # logs: the audit tier, not the WAL's
        f["live_bytes"] = live
        f["disk_bytes_after_gc"] = disk
        f["disk_vs_live"] = round(disk / live, 3) if live else None
    return f
