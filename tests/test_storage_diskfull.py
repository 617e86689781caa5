"""A full disk loses nothing (issue 16, docs/storage.md "A full disk"): the
writer's state directory lives on a small tmpfs the test mounts; several
appenders run while the test fills it. The writer must acknowledge no append
it could not make durable, say so in its stats and log (path, free space),
stay up instead of crash-looping, and resume by itself once space is freed;
every append acknowledged before, during and after is in the WAL, also after
a SIGKILL and restart."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.wal import list_segments, parse_record
from broker.errors import RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process

APPENDERS = 4
COUNT = 100


@pytest.fixture
def small_fs(state_dir: StateDir) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = state_dir.root.parent / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)],
        capture_output=True, check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def writer_up(processes: ProcessTracker, sd: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
              name: str) -> subprocess.Popen[bytes]:
    proc = processes.spawn(
        ["-m", "actors.writer", "--state-dir", str(sd.root), "--segment-bytes", "262144"],
        name=name,
    )
    probe = WriterClient(ctx, sd, "probe", storage_wait_s=0)

    def answered() -> bool:
        assert proc.poll() is None, processes.output(name)
        try:
            probe.ping(timeout_s=0.1, retries=0)
        except RequestTimeoutError:
            return False
        return True

    try:
        wait_for(answered, 20, "the writer to answer")
    finally:
        probe.close()
    return proc


def wal_keys(sd: StateDir) -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for _, path in list_segments(sd.wal_dir):
        for line in path.read_bytes().splitlines(keepends=True):
            record = parse_record(line)
            assert record is not None, f"damaged line in {path}"
            assert (record.origin, record.key) not in found, "a key written twice"
            found[(record.origin, record.key)] = record.seq
    return found


def journaled(journals: Path) -> dict[tuple[str, str], int]:
    acked: dict[tuple[str, str], int] = {}
    for path in journals.glob("*.acks"):
        for line in path.read_text().splitlines():
            key, seq = line.split()
            acked[(path.stem, key)] = int(seq)
    return acked


def test_a_full_disk_stops_appends_loses_nothing_and_resumes(
    processes: ProcessTracker, state_dir: StateDir, small_fs: Path
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sd = StateDir(small_fs / ".corral").ensure()
    journals = state_dir.root.parent / "journals"
    journals.mkdir()
    writer = writer_up(processes, sd, ctx, "writer")
    appenders = [
        processes.spawn(
            ["-m", "tests.appender", "--state-dir", str(sd.root), "--origin", f"ap{n}",
             "--count", str(COUNT), "--journal", str(journals / f"ap{n}.acks"),
             "--pad", "1000", "--retries", "120", "--storage-wait-s", "120"],
            name=f"ap{n}",
        )
        for n in range(APPENDERS)
    ]
    stats = WriterClient(ctx, sd, "probe", timeout_s=0.5, retries=4, storage_wait_s=0)
    filler = small_fs / "filler"
    try:
        wait_for(lambda: len(journaled(journals)) >= 40, 30, "some appends acknowledged")
        # fill what is left of the filesystem
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        wait_for(lambda: stats.stats().get("storage_full") == 1, 20, "the writer to stop")
        assert writer.poll() is None  # stopped, not crashed
        values = stats.stats()
        assert values["storage_free_bytes"] >= 0
        acked_while_full = len(journaled(journals))
        # while full, nothing more is acknowledged (appenders wait and resend)
        assert all(a.poll() is None for a in appenders)
        filler.unlink()
        wait_for(lambda: all(a.poll() is not None for a in appenders), 60,
                 "the appenders to finish after space came back")
        assert [a.returncode for a in appenders] == [0] * APPENDERS, [
            processes.output(f"ap{n}")[-500:] for n in range(APPENDERS)]
        assert stats.stats()["storage_full"] == 0
        assert writer.poll() is None
        acked = journaled(journals)
        assert len(acked) == APPENDERS * COUNT > acked_while_full
        on_disk = wal_keys(sd)
        for key, seq in acked.items():
            assert on_disk.get(key) == seq, f"acknowledged {key} seq {seq} not in the WAL"
        assert sorted(on_disk.values()) == list(range(1, len(on_disk) + 1))
        log = (sd.logs_dir / "writer.log").read_text(errors="replace")
        events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        full = [e for e in events if e.get("event") == "storage_full"]
        assert full and full[0]["file"].startswith(str(sd.wal_dir)), log[-2000:]
        assert "free_bytes" in full[0]
        assert any(e.get("event") == "storage_recovered" for e in events)
    finally:
        stats.close()
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
    # a SIGKILL and a restart keep every acknowledged append
    os.killpg(writer.pid, 9)
    writer.wait(timeout=10)
    writer_up(processes, sd, ctx, "writer2")
    with WriterClient(ctx, sd, "probe") as client:
        seen = {(r.origin, r.key): r.seq for r in client.read_stream("agent/ap0")}
    for (origin, key), seq in journaled(journals).items():
        if origin == "ap0":
            assert seen[(origin, key)] == seq
    ctx.destroy(linger=0)
