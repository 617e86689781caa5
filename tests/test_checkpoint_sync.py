"""The writer's checkpoint made durable off its loop (actors/writer/
checkpointsync.py, docs/wal.md): the index entries are appended in the loop
and fsynced in the checkpoint thread before the checkpoint names them. A
SIGKILL between the index fsync and the checkpoint leaves index files longer
than the previous checkpoint says; start-up cuts them back, scans the tail,
and every record is read back once, keys still deduplicated, ledgers whole.
A sync that fails gives the entries back to memory, written again later."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from actors.writer.checkpointsync import FAULT_ENV_CHECKPOINT_KILL_AT
from actors.writer.client import WriterClient
from actors.writer.ledgers import Ledgers
from actors.writer.recovery import recover
from actors.writer.streamindex import ENTRY, StreamIndex, stream_filename
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for
from tests.storagekit import Ctx, start_writer

STREAMS = ("agent/a", "agent/b", "agent/c")


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def checkpoint_json(sd: StateDir) -> dict[str, object]:
    try:
        data: dict[str, object] = json.loads(sd.checkpoint_path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data


def index_entries(sd: StateDir, stream: str) -> int:
    path = sd.stream_index_dir / stream_filename(stream)
    return path.stat().st_size // ENTRY.size if path.exists() else 0


def ledger_lines(sd: StateDir) -> int:
    path = sd.budget_ledger_path
    return len(path.read_bytes().splitlines()) if path.exists() else 0


@pytest.mark.process
def test_a_crash_between_the_index_fsync_and_the_checkpoint_recovers_every_record(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    sd = state_dir
    # checkpoints by count (and the first one at the first record): after seq 1, 11, 21
    args = ("--checkpoint-records", "10", "--checkpoint-interval-s", "3600")
    writer = start_writer(processes, sd, ctx, "w1", *args,
                          env={FAULT_ENV_CHECKPOINT_KILL_AT: "index_synced:3"})
    plan = [("agent/a", 0)] + [("agent/a", i) for i in range(1, 6)]
    plan += [("agent/b", i) for i in range(5)]
    plan += [("agent/a", i) for i in range(6, 11)] + [("agent/c", i) for i in range(5)]
    sent: dict[str, int] = {}
    client = WriterClient(ctx, sd, "app", timeout_s=0.5, retries=40)

    def append(n: int) -> None:
        stream, i = plan[n]
        sent[f"{stream}/{i}"] = client.append(
            stream, "turn", {"i": i}, key=f"{stream}/{i}",
            ledger="budget" if n % 3 == 0 else None).seq

    try:
        append(0)
        wait_for(lambda: checkpoint_json(sd).get("head_seq") == 1, 10, "the first checkpoint")
        for n in range(1, 11):
            append(n)
        wait_for(lambda: checkpoint_json(sd).get("head_seq") == 11, 10, "the second checkpoint")
        assert checkpoint_json(sd)["index_counts"] == {"agent/a": 6, "agent/b": 5}
        for n in range(11, 21):
            append(n)
        # the third checkpoint's thread fsyncs the index and is killed before writing it
        assert writer.wait(timeout=10) == -signal.SIGKILL
        assert checkpoint_json(sd)["head_seq"] == 11
        assert (index_entries(sd, "agent/a"), index_entries(sd, "agent/c")) == (11, 5)

        # start-up (as the writer runs it) uses the checkpoint: files cut back, tail scanned
        ledgers = Ledgers({"budget": sd.budget_ledger_path, "approvals": sd.approvals_ledger_path})
        rec = recover(sd, 64, ledgers)
        assert (rec.full_scan, rec.scanned_records, rec.head_seq) == (False, 10, 21)
        assert rec.index.counts() == {"agent/a": 6, "agent/b": 5}  # what the checkpoint names
        assert (index_entries(sd, "agent/a"), index_entries(sd, "agent/c")) == (6, 0)
        assert {s: [e[0] for e in rec.index.entries(s)] for s in STREAMS} == {
            s: sorted(seq for key, seq in sent.items() if key.startswith(s)) for s in STREAMS}
        rec.index.close()
        ledgers.close()
        writer = start_writer(processes, sd, ctx, "w2", *args)
        for stream in STREAMS:
            records = list(client.read_stream(stream))
            want = sorted((seq, key) for key, seq in sent.items() if key.startswith(stream))
            assert [(r.seq, f"{stream}/{r.payload()['i']}") for r in records] == want
        assert sorted(sent.values()) == list(range(1, 22))
        again = client.append("agent/c", "turn", {"i": 4}, key="agent/c/4")
        assert (again.seq, again.duplicate) == (sent["agent/c/4"], True)
        assert ledger_lines(sd) == 7  # n % 3 == 0 for n in 0..20
        new = client.append("agent/b", "turn", {"i": 5}, key="agent/b/5")
        assert (new.seq, new.duplicate) == (22, False)
        writer.send_signal(signal.SIGTERM)  # the last checkpoint waits for its thread
        assert writer.wait(timeout=10) == 0
        assert checkpoint_json(sd)["head_seq"] == 22
        counts = checkpoint_json(sd)["index_counts"]
        assert counts == {"agent/a": 11, "agent/b": 6, "agent/c": 5}
        assert {s: index_entries(sd, s) for s in STREAMS} == counts
    finally:
        client.close()


def test_entries_whose_sync_failed_go_back_to_memory_and_are_written_again(
    tmp_path: Path,
) -> None:
    index = StreamIndex(tmp_path / "idx")
    for seq in (1, 2):
        index.add("s", seq, 1, seq * 100, 10)
    assert index.flush() == []
    index.add("s", 3, 1, 300, 10)
    index.add("t", 4, 1, 400, 10)
    failures, unsynced = index.write_pending()
    assert failures == [] and unsynced.created and len(unsynced.paths) == 2
    assert index.counts() == {"s": 3, "t": 1}
    index.add("s", 5, 1, 500, 10)  # added while the sync runs
    index.revert(unsynced)  # the fsync failed
    assert index.counts() == {"s": 2}
    assert [e[0] for e in index.lookup("s", 0, 10)] == [1, 2, 3, 5]
    assert index.flush() == []  # cuts the files back and writes them again, once
    assert index.counts() == {"s": 4, "t": 1}
    assert [e[0] for e in index.entries("s")] == [1, 2, 3, 5]
    assert (tmp_path / "idx" / stream_filename("s")).stat().st_size == 4 * ENTRY.size
    index.close()


def test_the_first_checkpoint_is_due_at_once_however_recently_the_machine_booted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Monotonic time counts from the boot: a writer on a machine up for 5 s,
    its interval an hour, still checkpoints the first record it is behind by
    at once (the process test above waited for an hour's interval on a
    machine booted less than an hour before)."""
    from actors.writer import process

    sd = StateDir(tmp_path / ".corral").ensure()
    writer = process.Writer(sd, process.WriterOptions(checkpoint_interval_s=3600,
                                                      checkpoint_records=10))
    writer.lock()
    writer.recover()
    try:
        taken: list[bool] = []
        checkpoints = writer.checkpoints
        monkeypatch.setattr(checkpoints, "run", lambda wait=True: taken.append(wait))
        monkeypatch.setattr(time, "monotonic", lambda: 5.0)  # (the writer's clock)
        checkpoints.maybe()
        assert taken == []  # nothing behind: nothing to take
        writer.head = checkpoints.head_seq + 1
        checkpoints.maybe()
        assert taken == [False]
    finally:
        monkeypatch.undo()
        writer.close()
