"""Power loss without a FUSE tool, against the real writer: appends are
acknowledged by a real writer with real fdatasync, the writer is SIGKILLed,
and the WAL's final batch or a ledger write is then left as a torn write
would leave it (zeroed sectors, a later part present, the size past the data).
The next writer repairs and starts when nothing acknowledged is affected, and
refuses with the file and offset when an acknowledged record is;
`supervisor wal verify` says the same before the writer runs."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import asdict

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.process import EXIT_CORRUPT
from actors.writer.wal import list_segments, parse_record
from broker.statedir import StateDir
from supervisor.walverify import verify
from tests.processes import ProcessTracker
from tests.test_writer import kill_and_reap, start_writer, wal_records
from tests.tornwrite import Shape, batch_lines, sectors_of, tear

pytestmark = pytest.mark.process


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _append_acked(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]], n: int
) -> tuple[list[tuple[str, int]], object]:
    writer = start_writer(processes, state_dir, ctx)
    acked = []
    with WriterClient(ctx, state_dir, "agent-a", timeout_s=0.5, retries=20) as client:
        for i in range(n):
            ledger = "budget" if i % 3 == 2 else None
            ack = client.append("agent/a", "turn", {"i": i, "pad": "q" * 90}, key=f"k{i}",
                                ledger=ledger)
            acked.append((f"k{i}", ack.seq))
    return acked, writer


def _verify(state_dir: StateDir) -> dict[str, object]:
    """`supervisor wal verify --json`, in this process (its CLI is exercised in
    test_walverify.py and test_names_to_files.py)."""
    report = asdict(verify(state_dir))
    report["exit"] = 0 if report["sound"] else 1
    return report


def _log(state_dir: StateDir, event: str) -> list[dict[str, object]]:
    lines = state_dir.log_path("writer").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


def _budget_projection(state_dir: StateDir) -> bytes:
    return b"".join(
        line
        for _, path in list_segments(state_dir.wal_dir)
        for line in path.read_bytes().splitlines(keepends=True)
        if (r := parse_record(line)) is not None and r.ledger == "budget"
    )


def test_a_torn_final_batch_is_cut_and_the_writer_starts_with_everything_acknowledged(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    acked, writer = _append_acked(processes, state_dir, ctx, 20)
    kill_and_reap(writer)  # type: ignore[arg-type]
    segment = list_segments(state_dir.wal_dir)[-1][1]
    durable = segment.read_bytes()
    torn = b"".join(batch_lines(21, 10, pad=100, ledger_every=3))
    pieces = len(sectors_of(len(durable), len(torn)))
    # the first sector of the batch never reached the disk, the later ones did,
    # and the file's size went past the data
    tear(segment, torn, Shape(frozenset(range(1, pieces)), "past", 4096))
    on_disk = segment.stat().st_size

    before = _verify(state_dir)
    assert before["writer_refuses"] is False, before
    assert f"byte {len(durable)}" in str(before["writer_start"])

    start_writer(processes, state_dir, ctx)  # before the fix: exit 65, "damage before the tail"
    (repaired,) = _log(state_dir, "wal_tail_repaired")
    assert (repaired["file"], repaired["offset"], repaired["bad_offset"]) == (
        str(segment), len(durable), len(durable)
    )
    assert repaired["cut_bytes"] == on_disk - len(durable)
    assert segment.read_bytes() == durable
    records = {(r["key"], r["seq"]) for r in wal_records(state_dir)}
    assert set(acked) <= records and len(records) == 20
    with WriterClient(ctx, state_dir, "agent-a") as client:
        assert client.append("agent/a", "turn", {}, key="after").seq == 21
    assert state_dir.budget_ledger_path.read_bytes() == _budget_projection(state_dir)
    jq = subprocess.run(["jq", "-c", ".seq", str(segment)], capture_output=True, check=False)
    assert jq.returncode == 0 and jq.stdout.split() == [str(s).encode() for s in range(1, 22)]
    after = _verify(state_dir)
    assert after["sound"] is True and after["exit"] == 0, after


def test_damage_to_an_acknowledged_record_is_refused_with_file_and_offset(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    _, writer = _append_acked(processes, state_dir, ctx, 20)
    kill_and_reap(writer)  # type: ignore[arg-type]
    state_dir.checkpoint_path.unlink(missing_ok=True)  # make start-up read it all
    segment = list_segments(state_dir.wal_dir)[-1][1]
    data = bytearray(segment.read_bytes())
    victim = sum(len(line) for line in data.splitlines(keepends=True)[:7])  # seq 8's line
    data[victim + 50 : victim + 350] = bytes(300)
    segment.write_bytes(bytes(data))
    tear(segment, b"".join(batch_lines(21, 6)), Shape(frozenset({1, 2}), "past", 512))
    before = segment.read_bytes()

    report = _verify(state_dir)
    assert report["writer_refuses"] is True and report["exit"] == 1
    assert f"{segment} byte {victim}" in str(report["writer_start"])

    proc = processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)],
                           name="writer2")
    assert proc.wait(timeout=15) == EXIT_CORRUPT
    out = processes.output("writer2")
    assert str(segment) in out and f"byte {victim}" in out
    assert segment.read_bytes() == before  # nothing cut


def test_a_torn_ledger_write_is_cut_and_the_ledger_completed_from_the_wal(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    _, writer = _append_acked(processes, state_dir, ctx, 12)
    kill_and_reap(writer)  # type: ignore[arg-type]
    # The next batch reached the WAL and its fdatasync returned; then power
    # was lost while its ledger lines were being written: zeros where the
    # first sector should be, the later part present, the size past the data.
    segment = list_segments(state_dir.wal_dir)[-1][1]
    batch = batch_lines(13, 8, pad=200, ledger_every=2)
    with open(segment, "ab") as f:
        f.write(b"".join(batch))
    ledger = state_dir.budget_ledger_path
    durable = ledger.read_bytes()
    lines = b"".join(line for line in batch if b'"ledger":"budget"' in line)
    tear(ledger, lines, Shape(frozenset(range(1, len(sectors_of(len(durable), len(lines))))),
                              "past", 700))

    report = _verify(state_dir)
    assert report["ledger_problems"] and report["sound"] is False
    # the later part holds whole lines: two of the four are there, two are not
    assert report["ledger_missing_total"] == {"budget": 2}

    start_writer(processes, state_dir, ctx)  # before the fix: the zeros stay in the ledger
    assert ledger.read_bytes() == _budget_projection(state_dir)
    (repaired,) = _log(state_dir, "ledger_repaired")
    assert (repaired["file"], repaired["offset"]) == (str(ledger), len(durable))
    assert _verify(state_dir)["sound"] is True


def test_a_bad_line_kept_mid_ledger_is_cut_and_every_missing_record_added(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """The issue's state: a torn ledger line in the middle of the budget
    ledger, kept by an older writer that went on appending, and five budget
    records durable in the WAL that never reached the ledger."""
    _, writer = _append_acked(processes, state_dir, ctx, 30)  # budget: seqs 3, 6, ..., 30
    writer.send_signal(15)  # type: ignore[attr-defined]
    writer.wait(timeout=10)  # type: ignore[attr-defined]
    ledger = state_dir.budget_ledger_path
    full = ledger.read_bytes().splitlines(keepends=True)
    assert len(full) == 10
    bad = bytes(512) + full[3][-60:]  # zeros and the end of seq 12's line
    ledger.write_bytes(b"".join(full[:3]) + bad + b"".join(full[8:]))
    # an older writer's checkpoint (no ledger sizes) is not used
    for path in (state_dir.checkpoint_path, state_dir.checkpoint_path.with_name(
            "wal.checkpoint.prev.json")):
        path.unlink(missing_ok=True)

    report = _verify(state_dir)
    problems = report["ledger_problems"]
    assert isinstance(problems, list) and problems[0]["offset"] == sum(map(len, full[:3]))
    assert report["ledger_missing_total"] == {"budget": 5}
    assert report["ledger_missing"] == {"budget": [12, 15, 18, 21, 24]}

    start_writer(processes, state_dir, ctx)
    assert ledger.read_bytes() == b"".join(full)
    assert _verify(state_dir)["sound"] is True
