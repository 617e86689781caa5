"""Names never become bad file names, and a derived file that cannot be
written never stops the writer: every valid stream name maps to a bounded,
distinct index file name; a 128-character stream is acknowledged, indexed,
checkpointed and read back across restarts; an index file or cache directory
that cannot be written is skipped with a log line (the writer serves on, and
reads still answer from memory); when the writer refuses to start,
`supervisor wal verify` says why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.writer import checkpoint
from actors.writer.client import WriterClient
from actors.writer.process import EXIT_CORRUPT
from actors.writer.streamindex import stream_filename
from broker.statedir import StateDir
from tests.processes import REPO_ROOT, ProcessTracker, wait_for
from tests.test_writer import kill_and_reap, start_writer

STREAM = r"\A[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,127}\Z"  # broker/protocol.py StreamName
ACTOR = r"\A[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}\Z"  # ActorName: agents, sessions, log files


@given(st.from_regex(STREAM), st.from_regex(STREAM))
@settings(max_examples=100, deadline=None)
def test_every_stream_name_maps_to_a_short_distinct_file_name(a: str, b: str) -> None:
    for name in (a, b, a.ljust(128, "x")[:128]):
        file = stream_filename(name)
        assert len(file.encode()) <= 100 and "/" not in file and not file.startswith(".")
    assert (stream_filename(a) == stream_filename(b)) == (a == b)


@given(st.from_regex(ACTOR))
@settings(max_examples=100, deadline=None)
def test_paths_named_after_actors_stay_within_name_max(name: str) -> None:
    state = StateDir.at("/tmp/corral-names/.corral")
    longest = name.ljust(64, "x")[:64]
    for path in (state.log_path(longest), state.agent_dir(longest),
                 state.log_path(longest).with_suffix(".log.9")):
        assert all(len(part.encode()) <= 255 for part in path.parts)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _checkpointed(state_dir: StateDir, head: int) -> bool:
    cp, _ = checkpoint.load(state_dir.checkpoint_path)
    return cp is not None and cp.head_seq >= head


def _events(state_dir: StateDir, event: str) -> list[dict[str, object]]:
    lines = state_dir.log_path("writer").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


@pytest.mark.process
def test_a_long_stream_name_is_indexed_checkpointed_and_read_after_restarts(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    stream = ("agent/" + "n" * 200)[:128]  # 126 and up overflowed NAME_MAX as hex
    fast = ("--checkpoint-interval-s", "0.05")
    writer = start_writer(processes, state_dir, ctx, *fast)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        for i in range(3):
            client.append(stream, "turn", {"i": i}, key=f"k{i}")
    # before the fix the checkpoint's index file hit ENAMETOOLONG: exit 74
    wait_for(lambda: _checkpointed(state_dir, 3), 10, "a checkpoint of the long stream")
    assert writer.poll() is None, processes.output("writer")
    assert (state_dir.stream_index_dir / stream_filename(stream)).stat().st_size == 3 * 28
    kill_and_reap(writer)
    start_writer(processes, state_dir, ctx, *fast)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        client.append(stream, "turn", {"i": 3}, key="k3")
        assert [r.seq for r in client.read_stream(stream)] == [1, 2, 3, 4]


@pytest.mark.process
def test_an_index_file_that_cannot_be_written_is_skipped_and_the_writer_serves_on(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    blocked = "agent/blocked"
    state_dir.stream_index_dir.mkdir(parents=True, exist_ok=True)
    obstacle = state_dir.stream_index_dir / stream_filename(blocked)
    obstacle.mkdir()  # opening the index file fails (EISDIR), whoever runs the test
    fast = ("--checkpoint-interval-s", "0.05")
    writer = start_writer(processes, state_dir, ctx, *fast)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        client.append(blocked, "turn", {"i": 0}, key="b0")
        client.append("agent/fine", "turn", {"i": 1}, key="f1")
        wait_for(lambda: _events(state_dir, "stream_index_write_failed"), 10, "the failure logged")
        assert writer.poll() is None, processes.output("writer")  # before the fix: exit 74
        client.append(blocked, "turn", {"i": 2}, key="b2")
        assert [r.seq for r in client.read_stream(blocked)] == [1, 3]  # from memory
    (failed,) = _events(state_dir, "stream_index_write_failed")  # logged once, not per turn
    assert failed["file"] == str(obstacle) and failed["checkpoint_skipped"] is True
    assert not _checkpointed(state_dir, 1)  # no checkpoint may claim what the files lack

    kill_and_reap(writer)  # a restart rebuilds from the WAL, and still serves
    writer = start_writer(processes, state_dir, ctx, *fast)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        assert [r.seq for r in client.read_stream(blocked)] == [1, 3]
        obstacle.rmdir()  # the disk is fixed: the next checkpoint goes through
        wait_for(lambda: _events(state_dir, "stream_index_write_recovered"), 10,
                 "a checkpoint once the file works")  # logged after the checkpoint is saved
        assert _checkpointed(state_dir, 3)
        assert [r.seq for r in client.read_stream(blocked)] == [1, 3]


@pytest.mark.process
def test_a_cache_directory_that_cannot_be_created_does_not_stop_the_writer(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    state_dir.cache_dir.mkdir(exist_ok=True)
    state_dir.stream_index_dir.write_bytes(b"not a directory")  # mkdir fails, even for root
    writer = start_writer(processes, state_dir, ctx, "--checkpoint-interval-s", "0.05")
    with WriterClient(ctx, state_dir, "agent-a") as client:
        client.append("agent/a", "turn", {}, key="k1")
        wait_for(lambda: _events(state_dir, "stream_index_write_failed"), 10, "the failure logged")
        assert [r.seq for r in client.read_stream("agent/a")] == [1]
    assert writer.poll() is None
    assert _events(state_dir, "stream_index_unusable")


@pytest.mark.process
def test_wal_verify_says_why_the_writer_refuses_to_start(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        client.append("agent/a", "turn", {}, key="k1")
    writer.send_signal(signal.SIGTERM)
    assert writer.wait(timeout=10) == 0
    for segment in state_dir.wal_dir.iterdir():
        os.unlink(segment)  # the WAL is gone; the checkpoint still names seq 1
    proc = processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="w2")
    assert proc.wait(timeout=15) == EXIT_CORRUPT
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "wal", "verify", "--state-dir",
         str(state_dir.root)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=30, check=False,
    )
    assert result.returncode == 1, result.stdout  # before the fix: "sound", exit 0
    assert "refuses to start" in result.stdout and "the WAL is missing" in result.stdout


@pytest.mark.process
def test_a_checkpoint_that_cannot_be_written_is_skipped_and_the_writer_serves_on(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """The checkpoint is derived too: failing to write it (here its temp file
    is a directory that cannot be removed) is logged once, never exit 74 on
    every restart; a restart without it scans the WAL."""
    obstacle = state_dir.checkpoint_path.with_name(f".{state_dir.checkpoint_path.name}.tmp")
    (obstacle / "stuck").mkdir(parents=True)
    fast = ("--checkpoint-interval-s", "0.05")
    writer = start_writer(processes, state_dir, ctx, *fast)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        client.append("agent/a", "turn", {}, key="k1")
        wait_for(lambda: _events(state_dir, "checkpoint_write_failed"), 10, "the failure logged")
        client.append("agent/a", "turn", {}, key="k2")
        assert writer.poll() is None, processes.output("writer")  # before the fix: exit 74
    kill_and_reap(writer)
    writer = start_writer(processes, state_dir, ctx, *fast)
    with WriterClient(ctx, state_dir, "agent-a") as client:
        assert [r.seq for r in client.read_stream("agent/a")] == [1, 2]
        # this run's first checkpoint writes its file in a thread, after fsyncs: it must
        # have failed before the obstacle goes, or it succeeds and never "recovers"
        wait_for(lambda: len(_events(state_dir, "checkpoint_write_failed")) >= 2, 10,
                 "the restarted writer's failure logged")
        (obstacle / "stuck").rmdir()
        obstacle.rmdir()
        wait_for(lambda: _events(state_dir, "checkpoint_write_recovered"), 10,
                 "a checkpoint once it can be written")  # logged after the checkpoint is saved
    assert _checkpointed(state_dir, 2)
    assert len(_events(state_dir, "checkpoint_write_failed")) == 2  # once per writer run
